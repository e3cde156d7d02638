//! What a pool learned, and the choices and views drawn from it, on profiles built by hand.

use super::*;

fn figures(right: u32, n: u32, cost: f64) -> CategoryFigures {
    CategoryFigures { right, n, cost_per_item_usd: cost, cost_complete: true, latency_p50_ms: 100, tokens_per_item: 50 }
}

fn profile(worker: &str, freshness: Freshness, categories: &[(&str, CategoryFigures)]) -> Profile {
    Profile {
        worker: worker.into(),
        freshness,
        identity: Some(worker.into()),
        by_category: categories.iter().map(|(c, f)| ((*c).to_owned(), f.clone())).collect(),
        by_kind: BTreeMap::new(),
        learned_in: vec!["learn-1".into()],
        marks: ChatMarks::default(),
    }
}

#[test]
fn each_kind_goes_to_the_cheapest_worker_that_is_as_good() {
    let profiles = [
        profile("dear", Freshness::Current, &[("sums", figures(8, 8, 0.01)), ("trivia", figures(8, 8, 0.01))]),
        profile("cheap", Freshness::Current, &[("sums", figures(8, 8, 0.001)), ("trivia", figures(0, 8, 0.001))]),
    ];
    let m = measure(&profiles, Vec::new());
    assert_eq!(m.by_category.best["sums"], 1, "as good and ten times cheaper");
    assert_eq!(m.by_category.best["trivia"], 0);
    assert!(m.by_category.clear["sums"].contains("cheap was right on 8 of 8"), "{:?}", m.by_category.clear);
    assert!(m.by_category.clear.contains_key("trivia"));
    assert_eq!(m.best, Some(0), "overall only the dear one is right on everything");
    assert_eq!(
        m.strengths[&1],
        "When this pool learned, it was right on 8 of 8 sums questions and 0 of 8 trivia questions."
    );
}

#[test]
fn a_margin_the_measurements_cannot_tell_from_chance_is_not_clear() {
    let clear = |a: (u32, u32), b: (u32, u32)| {
        let profiles = [
            profile("a", Freshness::Current, &[("sums", figures(a.0, a.1, 0.0))]),
            profile("b", Freshness::Current, &[("sums", figures(b.0, b.1, 0.0))]),
        ];
        let m = measure(&profiles, Vec::new());
        assert_eq!(m.by_category.best["sums"], 0, "a is the better");
        m.by_category.clear.contains_key("sums")
    };
    assert!(!clear((3, 5), (2, 5)), "3 of 5 against 2 of 5: the conductor plans");
    assert!(!clear((8, 8), (5, 8)), "the intervals overlap");
    assert!(!clear((4, 4), (2, 4)));
    assert!(clear((8, 8), (0, 8)));
    assert!(clear((20, 20), (8, 20)));
    assert!(!clear((3, 8), (0, 8)), "better than nothing is no reason to skip the plan");
}

#[test]
fn equally_good_workers_are_routed_only_when_right_more_often_than_not() {
    let both = |right: u32| {
        let profiles = [
            profile("dear", Freshness::Current, &[("sums", figures(right, 8, 0.01))]),
            profile("cheap", Freshness::Current, &[("sums", figures(right, 8, 0.001))]),
        ];
        measure(&profiles, Vec::new())
    };
    assert_eq!(both(1).by_category.best["sums"], 1, "the cheaper of two equals leads");
    assert!(both(1).by_category.clear.is_empty(), "1 of 8 each: nobody is known to be good, the conductor plans");
    assert!(both(8).by_category.clear.contains_key("sums"));
}

#[test]
fn an_unpriced_worker_is_not_taken_for_the_cheapest_and_one_unlearned_worker_keeps_the_conductor() {
    let mut unpriced = figures(8, 8, 0.0);
    unpriced.cost_complete = false;
    let profiles = [
        profile("remote", Freshness::Current, &[("sums", unpriced)]),
        profile("priced", Freshness::Current, &[("sums", figures(8, 8, 0.002))]),
    ];
    assert_eq!(measure(&profiles, Vec::new()).by_category.best["sums"], 1);
    let profiles = [
        profile("a", Freshness::Current, &[("sums", figures(8, 8, 0.0))]),
        profile("b", Freshness::Current, &[("sums", figures(0, 8, 0.0))]),
        profile("new", Freshness::None, &[]),
    ];
    let m = measure(&profiles, Vec::new());
    assert_eq!(m.by_category.best["sums"], 0, "a still leads");
    assert!(m.by_category.clear.is_empty(), "the new worker might be better: no question skips the plan");
}

#[test]
fn stale_and_thin_profiles_are_not_used() {
    let profiles = [
        profile("a", Freshness::Stale, &[("sums", figures(8, 8, 0.0))]),
        profile("b", Freshness::Current, &[("sums", figures(1, 8, 0.0)), ("few", figures(3, 3, 0.0))]),
    ];
    let m = measure(&profiles, Vec::new());
    assert_eq!(m.by_category.best.get("sums"), Some(&1), "only b's profile is current");
    assert!(!m.by_category.best.contains_key("few"), "3 runs are too few to choose by");
    assert_eq!(m.strengths.keys().collect::<Vec<_>>(), [&1], "the conductor is not told a stale profile");
    let none = [profile("a", Freshness::None, &[])];
    assert_eq!(measure(&none, Vec::new()), Measured::default());
}

#[test]
fn chat_marks_are_told_to_the_conductor_but_choose_no_worker() {
    let mut marked = profile("a", Freshness::None, &[]);
    marked.marks = ChatMarks { better: 2, tie: 1, worse: 0 };
    let mut stale = profile("b", Freshness::Stale, &[("sums", figures(8, 8, 0.0))]);
    stale.marks = ChatMarks { better: 0, tie: 0, worse: 3 };
    let m = measure(&[marked.clone(), stale], Vec::new());
    assert_eq!(
        m.strengths[&0],
        "In chat, the user marked its answer alone better than the pool's 2 times, as good 1 time and worse 0 times."
    );
    assert_eq!(
        m.strengths[&1],
        "In chat, the user marked its answer alone better than the pool's 0 times, as good 0 times and worse 3 times.",
        "marks are the worker's as it is now; the stale figures stay untold"
    );
    assert!(m.by_category.best.is_empty() && m.best.is_none() && m.by_category.clear.is_empty(), "{m:?}");

    let mut learned = profile("a", Freshness::Current, &[("sums", figures(8, 8, 0.0))]);
    learned.marks = marked.marks;
    let m = measure(&[learned, profile("b", Freshness::Current, &[("sums", figures(0, 8, 0.0))])], Vec::new());
    assert!(
        m.strengths[&0].starts_with("When this pool learned, it was right on 8 of 8 sums questions. In chat,"),
        "{}",
        m.strengths[&0]
    );
    assert_eq!(m.by_category.best["sums"], 0);
}

#[test]
fn thin_categories_are_chosen_by_their_kind_and_told_as_it() {
    // MMLU-like: twelve subjects of one item or two, all multiple choice, beside arithmetic.
    let with_kinds = |worker: &str, right_choice: u32| {
        let mut p = profile(worker, Freshness::Current, &[("number", figures(6, 6, 0.0))]);
        for (i, subject) in ["anatomy", "law", "virology", "astronomy", "ethics", "marketing"].iter().enumerate() {
            let right = u32::from((i as u32) < right_choice);
            p.by_category.insert((*subject).to_owned(), figures(right * 2, 2, 0.0));
        }
        p.by_kind.insert("number".into(), figures(6, 6, 0.0));
        p.by_kind.insert("choice".into(), figures(right_choice * 2, 12, 0.0));
        p
    };
    let profiles = [with_kinds("a", 6), with_kinds("b", 0)];
    let m = measure(&profiles, Vec::new());
    assert!(m.by_category.best.keys().eq(["number"]), "2 runs a subject are too few: {:?}", m.by_category.best);
    assert_eq!(m.by_kind.best["choice"], 0);
    assert!(m.by_kind.clear["choice"].contains("a was right on 12 of 12"), "{:?}", m.by_kind.clear);
    assert_eq!(
        m.strengths[&0],
        "When this pool learned, it was right on 6 of 6 numeric questions and 12 of 12 multiple-choice questions."
    );
    let shown = learning(&crate::Pool::parse(TWO_WORKERS, "pool.toml").expect("pool"), &profiles, None, &[]);
    let kinds: Vec<&str> = shown.workers[0].kinds.iter().map(|r| r.category.as_str()).collect();
    assert_eq!(kinds, ["choice"], "number is a category of its own already");
    let routes: Vec<(&str, bool, &str)> =
        shown.routes.iter().map(|r| (r.category.as_str(), r.by_kind, r.worker.as_str())).collect();
    assert_eq!(routes, [("number", false, "a"), ("choice", true, "a")]);
    // With every category thick enough, the kinds are not told again.
    let mut whole = profile("c", Freshness::Current, &[("arithmetic", figures(8, 8, 0.0))]);
    whole.by_kind.insert("number".into(), figures(8, 8, 0.0));
    assert_eq!(
        learned_line(&whole).as_deref(),
        Some("When this pool learned, it was right on 8 of 8 arithmetic questions.")
    );
    // Nor is a kind whose every item is one category's, where others were thin: the same runs.
    whole.by_category.insert("anatomy".into(), figures(1, 2, 0.0));
    whole.by_category.insert("law".into(), figures(0, 2, 0.0));
    whole.by_kind.insert("choice".into(), figures(1, 4, 0.0));
    assert_eq!(
        learned_line(&whole).as_deref(),
        Some(
            "When this pool learned, it was right on 8 of 8 arithmetic questions and 1 of 4 multiple-choice questions."
        )
    );
    assert!(whole.repeats_a_category("number") && !whole.repeats_a_category("choice"));
}

#[test]
fn a_plan_is_skipped_where_the_conductors_plans_were_not_shown_to_do_better_than_the_choice_alone() {
    // 6 of 8 against 2 of 8: a leads, but not by a clear margin.
    let profiles = [
        profile("a", Freshness::Current, &[("sums", figures(6, 8, 0.0)), ("proofs", figures(2, 8, 0.0))]),
        profile("b", Freshness::Current, &[("sums", figures(2, 8, 0.0)), ("proofs", figures(1, 8, 0.0))]),
    ];
    let mut planned = profile(
        "the conductor's plans",
        Freshness::Current,
        &[("sums", figures(10, 16, 0.0)), ("proofs", figures(8, 16, 0.0))],
    );
    planned.by_kind.insert("number".into(), figures(18, 32, 0.0));
    let mut m = measure(&profiles, Vec::new());
    assert!(m.by_category.clear.is_empty());
    weigh_plans(&mut m, &profiles, &planned);
    // Sums: plans right 62% of the time, a alone 75%: no gain, a answers alone.
    assert_eq!(
        m.by_category.no_gain.get("sums").map(String::as_str),
        Some(
            "the conductor's plans were right on 10 of 16 when the pool learned, a alone on 6 of 8: a plan is not known to help"
        )
    );
    // Proofs: plans 8 of 16 (interval from 28%) against a's 2 of 8: they help, so the
    // conductor plans.
    assert!(!m.by_category.no_gain.contains_key("proofs"), "{:?}", m.by_category.no_gain);
    let shown = learning(&crate::Pool::parse(TWO_WORKERS, "pool.toml").expect("pool"), &profiles, Some(&planned), &[]);
    let routes: Vec<(&str, RouteHow)> = shown.routes.iter().map(|r| (r.category.as_str(), r.how)).collect();
    assert_eq!(routes, [("proofs", RouteHow::Lead), ("sums", RouteHow::NoGain)]);
    assert_eq!(shown.plans.as_ref().map(|p| p.categories.len()), Some(2));

    // Too few plans, or a worker not learned: nothing is skipped.
    let mut few = planned.clone();
    few.by_category.insert("sums".into(), figures(1, 3, 0.0));
    let mut m = measure(&profiles, Vec::new());
    weigh_plans(&mut m, &profiles, &few);
    assert!(!m.by_category.no_gain.contains_key("sums"));
    let with_new = [profiles[0].clone(), profiles[1].clone(), profile("new", Freshness::None, &[])];
    let mut m = measure(&with_new, Vec::new());
    weigh_plans(&mut m, &with_new, &planned);
    assert!(m.by_category.no_gain.is_empty(), "{:?}", m.by_category.no_gain);
}

#[test]
fn a_few_items_of_one_kind_do_not_outweigh_everything_learned() {
    // As a real pool learned from 10 items of each: the big model right on 6 of 10 algebra
    // items and 2 of 10 trivia ones, the small one on 1 and 3.
    let profiles = [
        profile("big", Freshness::Current, &[("algebra", figures(6, 10, 0.0)), ("trivia", figures(2, 10, 0.0))]),
        profile("small", Freshness::Current, &[("algebra", figures(1, 10, 0.0)), ("trivia", figures(3, 10, 0.0))]),
    ];
    let mut m = measure(&profiles, Vec::new());
    assert_eq!(m.best, Some(0));
    assert_eq!(m.by_category.best["trivia"], 0, "3 of 10 against 2 of 10 is noise: the best overall stays");
    assert!(m.by_category.clear.is_empty(), "{:?}", m.by_category.clear);
    // Plans right one item more often than the choice alone are not known to help.
    let planned = profile(
        "the conductor's plans",
        Freshness::Current,
        &[("algebra", figures(7, 10, 0.0)), ("trivia", figures(4, 10, 0.0))],
    );
    weigh_plans(&mut m, &profiles, &planned);
    assert!(m.by_category.no_gain["algebra"].contains("right on 7 of 10 when the pool learned, big alone on 6 of 10"));
    assert!(m.by_category.no_gain["trivia"].contains("big alone on 2 of 10"), "{:?}", m.by_category.no_gain);
    // A clear margin still sends a kind to the worker that is weaker overall.
    let profiles = [
        profile("big", Freshness::Current, &[("algebra", figures(20, 20, 0.0)), ("trivia", figures(0, 10, 0.0))]),
        profile("small", Freshness::Current, &[("algebra", figures(1, 20, 0.0)), ("trivia", figures(9, 10, 0.0))]),
    ];
    let m = measure(&profiles, Vec::new());
    assert_eq!((m.best, m.by_category.best["trivia"]), (Some(0), 1));
    assert!(m.by_category.clear.contains_key("trivia"));
    // And plans right clearly more often than the worker alone are written.
    let planned = profile("the conductor's plans", Freshness::Current, &[("algebra", figures(9, 10, 0.0))]);
    let few = [
        profile("big", Freshness::Current, &[("algebra", figures(3, 10, 0.0))]),
        profile("small", Freshness::Current, &[("algebra", figures(1, 10, 0.0))]),
    ];
    let mut m = measure(&few, Vec::new());
    weigh_plans(&mut m, &few, &planned);
    assert!(m.by_category.no_gain.is_empty(), "9 of 10 against 3 of 10: {:?}", m.by_category.no_gain);
}

const TWO_WORKERS: &str = "[[worker]]\nname = \"a\"\nprovider = \"openai\"\nmodel = \"m-a\"\n\n\
                           [[worker]]\nname = \"b\"\nprovider = \"openai\"\nmodel = \"m-b\"\n";

#[test]
fn the_wilson_interval_is_wide_at_small_n() {
    let (low, high) = wilson(2, 3);
    assert!(low < 0.21 && high > 0.9, "({low}, {high})");
    let (low, high) = wilson(80, 100);
    assert!((low - 0.711).abs() < 0.01 && (high - 0.867).abs() < 0.01, "({low}, {high})");
    assert_eq!(wilson(0, 0), (0.0, 1.0));
}

#[test]
fn what_was_learned_is_shown_with_intervals_and_where_each_kind_goes() {
    let pool = |conductor: &str| {
        let text = format!(
            "{conductor}\n[[worker]]\nname = \"a\"\nprovider = \"openai\"\nmodel = \"m-a\"\n\n\
             [[worker]]\nname = \"b\"\nprovider = \"openai\"\nmodel = \"m-b\"\n"
        );
        crate::Pool::parse(&text, "pool.toml").expect("pool")
    };
    let profiles = [
        profile("a", Freshness::Current, &[("math", figures(8, 8, 0.01)), ("trivia", figures(4, 8, 0.01))]),
        profile("b", Freshness::Current, &[("math", figures(0, 8, 0.001)), ("trivia", figures(4, 8, 0.001))]),
    ];
    let shown = learning(&pool(""), &profiles, None, &[]);
    assert_eq!(shown.workers[0].identity_now, pool("").workers[0].identity());
    let math = &shown.workers[0].categories[0];
    assert_eq!((math.category.as_str(), math.figures.right, math.figures.n), ("math", 8, 8));
    assert!(math.low > 0.6 && math.high == 1.0, "{math:?}");
    let routes: Vec<(&str, &str, RouteHow)> =
        shown.routes.iter().map(|r| (r.category.as_str(), r.worker.as_str(), r.how)).collect();
    // Math: a by a clear margin. Trivia: both as good, b cheaper, but 4 of 8 is not clearly
    // right more often than not, so the conductor plans with b as its lead.
    assert_eq!(routes, [("math", "a", RouteHow::Clear), ("trivia", "b", RouteHow::Lead)]);
    let always = learning(&pool("[conductor]\nroute = \"always\"\n"), &profiles, None, &[]);
    assert!(always.routes.iter().all(|r| r.how == RouteHow::Always));
    let named = learning(&pool("[conductor]\nfallback_worker = \"b\"\n"), &profiles, None, &[]);
    assert_eq!(named.named_fallback.as_deref(), Some("b"));
    assert!(named.routes.is_empty(), "the user's worker is not replaced by a measurement");

    // The conductor reads each worker's description, then what was measured of it.
    let mut described = pool("");
    described.workers[0].description = Some("Fast".into());
    described.learned = measure(&profiles, Vec::new());
    let infos = described.conductor_infos();
    assert_eq!(
        infos[0].description.as_deref(),
        Some("Fast. When this pool learned, it was right on 8 of 8 math questions and 4 of 8 trivia questions.")
    );
    assert!(infos[1].description.as_deref().is_some_and(|d| d.starts_with("When this pool learned")));
    assert_eq!(described.infos()[0].description.as_deref(), Some("Fast"), "the workers' own infos are unchanged");
}

#[test]
fn a_workflow_routes_a_kind_only_by_a_clear_margin_over_every_worker_alone() {
    let chain = Workflow::Chain { first: 0, then: 1 };
    let fan = Workflow::FanOut { answerers: vec![0, 1], aggregator: 0 };
    let flow = |w: &Workflow, f: CategoryFigures| (w.clone(), profile("flow", Freshness::Current, &[("word", f)]));
    let workers = [
        profile("reader", Freshness::Current, &[("word", figures(0, 12, 0.001))]),
        profile("calc", Freshness::Current, &[("word", figures(1, 12, 0.001))]),
    ];
    // Both workflows are clear of every worker; the chain is as good and makes fewer calls.
    let mut m = measure(&workers, Vec::new());
    weigh_workflows(&mut m, &workers, &[flow(&fan, figures(12, 12, 0.002)), flow(&chain, figures(12, 12, 0.002))]);
    let chosen = &m.by_category.flows["word"];
    assert_eq!(chosen.workflow, chain);
    assert!(chosen.why.contains("reader, then calc seeing reader's answer was right on 12 of 12"), "{}", chosen.why);
    assert!(chosen.why.contains("no worker alone on more than 1 of 12"), "{}", chosen.why);

    // A worker alone as good as the workflow: no margin, the worker stays the choice.
    let strong = [workers[0].clone(), profile("calc", Freshness::Current, &[("word", figures(11, 12, 0.001))])];
    let mut m = measure(&strong, Vec::new());
    weigh_workflows(&mut m, &strong, &[flow(&chain, figures(12, 12, 0.002))]);
    assert!(m.by_category.flows.is_empty());
    assert_eq!(m.by_category.best["word"], 1);

    // Too few runs, or a worker not measured as it is now: nothing is chosen.
    let mut m = measure(&workers, Vec::new());
    weigh_workflows(&mut m, &workers, &[flow(&chain, figures(3, 3, 0.002))]);
    assert!(m.by_category.flows.is_empty(), "3 runs say too little");
    let stale = [workers[0].clone(), profile("calc", Freshness::Stale, &[("word", figures(1, 12, 0.001))])];
    let mut m = measure(&stale, Vec::new());
    weigh_workflows(&mut m, &stale, &[flow(&chain, figures(12, 12, 0.002))]);
    assert!(m.by_category.flows.is_empty(), "a changed worker might do as well alone");
}

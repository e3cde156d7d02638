//! The regular-expression rendering of the plan grammar, checked both ways against the plan
//! parser: every string the expression matches is a valid plan for the pool, and every valid
//! plan written in the conductor's format is matched. The same plan skeleton feeds the Lark and
//! GBNF renderings, so this also checks their structure.

use baton_conductor::PlanGrammar;
use baton_plan::{Access, Limits, Plan, Step};
use proptest::prelude::*;

fn grammar(pool_size: usize, max_steps: usize, allow_stop: bool) -> PlanGrammar {
    PlanGrammar {
        model_ids: (0..pool_size).collect(),
        max_steps,
        allow_stop,
        max_reasoning_chars: 40,
        max_subtask_chars: 12,
    }
}

fn full_match(g: &PlanGrammar) -> regex::Regex {
    regex::RegexBuilder::new(&format!("^(?:{})$", g.to_regex())).size_limit(1 << 26).build().unwrap()
}

fn limits(g: &PlanGrammar) -> Limits {
    Limits { max_steps: g.max_steps, pool_size: Some(g.model_ids.len()), allow_stop: g.allow_stop }
}

fn fenced(reasoning: &str, plan: &Plan) -> String {
    format!("{reasoning}\n```python\n{}\n```", plan.to_python().trim_end())
}

/// A valid plan for `pool_size` workers, subtasks from the characters the grammar allows (it
/// also asks that a subtask start with a non-blank character, which the validator does not).
fn plan_strategy(pool_size: usize, max_steps: usize) -> impl Strategy<Value = Plan> {
    (1..=max_steps).prop_flat_map(move |n| {
        let steps: Vec<_> = (0..n)
            .map(|i| {
                let access = if i == 0 {
                    prop_oneof![Just(Access::All), Just(Access::Steps(vec![]))].boxed()
                } else {
                    prop_oneof![
                        Just(Access::All),
                        proptest::sample::subsequence((0..i).collect::<Vec<_>>(), 0..=i).prop_map(Access::Steps),
                    ]
                    .boxed()
                };
                (0..pool_size, "[a-zA-Z0-9é][a-zA-Z0-9 ,.?é]{0,11}", access)
                    .prop_map(|(model_id, subtask, access)| Step { model_id, subtask, access })
            })
            .collect();
        steps.prop_map(|steps| Plan { steps })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn everything_the_regex_matches_is_a_valid_plan(
        (text, pool, steps, stop) in (1usize..4, 1usize..5, any::<bool>()).prop_flat_map(|(pool, steps, stop)| {
            let re = grammar(pool, steps, stop).to_regex();
            (proptest::string::string_regex(&re).unwrap(), Just(pool), Just(steps), Just(stop))
        })
    ) {
        let g = grammar(pool, steps, stop);
        let plan = baton_plan::parse(&text, &limits(&g));
        prop_assert!(plan.is_ok(), "{text:?}: {:?}", plan.err());
    }

    #[test]
    fn every_valid_plan_is_matched((plan, pool, steps) in (1usize..4, 1usize..5).prop_flat_map(|(pool, steps)| {
        (plan_strategy(pool, steps), Just(pool), Just(steps))
    }), reasoning in "[^`]{0,40}") {
        let g = grammar(pool, steps, false);
        prop_assert!(full_match(&g).is_match(&fenced(&reasoning, &plan)), "{}", fenced(&reasoning, &plan));
    }
}

#[test]
fn the_regex_rejects_what_the_pool_or_the_order_forbids() {
    let g = grammar(2, 3, false);
    let re = full_match(&g);
    let ok = "Think.\n```python\nmodel_id = [0, 1]\nsubtasks = [\"a\", \"b\"]\naccess_list = [[], [0]]\n```";
    assert!(re.is_match(ok));
    for bad in [
        // A worker outside the pool.
        ok.replace("[0, 1]", "[0, 2]"),
        // Access to a later step.
        ok.replace("[[], [0]]", "[[1], [0]]"),
        // Access to itself.
        ok.replace("[[], [0]]", "[[], [1]]"),
        // Lists of different lengths.
        ok.replace("[\"a\", \"b\"]", "[\"a\"]"),
        // A backtick in the reasoning would make the fence ambiguous.
        ok.replace("Think.", "Use `x`."),
        // An empty subtask.
        ok.replace("\"a\"", "\"\""),
        // Three empty lists are a stop, only allowed in recursive rounds.
        "x\n```python\nmodel_id = []\nsubtasks = []\naccess_list = []\n```".to_owned(),
        // Too many steps.
        "x\n```python\nmodel_id = [0, 0, 0, 0]\nsubtasks = [\"a\", \"a\", \"a\", \"a\"]\naccess_list = [[], [], [], []]\n```"
            .to_owned(),
    ] {
        assert!(!re.is_match(&bad), "{bad}");
    }
    let stop = grammar(2, 3, true);
    assert!(full_match(&stop).is_match("Done.\n```python\nmodel_id = []\nsubtasks = []\naccess_list = []\n```"));
}

//! Routing by what the pool learned (`baton pool learn`): whether a question goes straight to
//! one worker, with no plan ([`route`]; such a run says so, [`is_routed`]), which worker what
//! was learned names for it ([`learned_worker`], the fallback's choice too), and where the
//! learned figures place a question: in a learned category, by the learned questions nearest to
//! it ([`category_of`]), else by its kind, as its form tells it ([`kind_of`]).

use std::collections::{BTreeMap, HashSet};

use crate::learned::{FlowChoice, Measured};
use crate::pool::{FallbackOptions, Route};
use crate::words::{COMMON, words};
use crate::workflow::Workflow;

/// How many learned questions vote on a new question's category, and how alike (shared
/// distinctive words over all of either's, Jaccard) the nearest must be for the vote to count.
const NEIGHBOURS: usize = 3;
const MIN_LIKENESS: f64 = 0.12;

/// Where what the pool learned places a question: the worker for its category, the workflow
/// that beats every worker there, and why a choice is clear, if it is.
struct Placed<'a> {
    /// The cheapest worker as good as the best alone there; `None` where no worker alone was
    /// ever right (a workflow may still be).
    worker: Option<usize>,
    /// Why it answers alone, without a plan ([`Choices::alone`](crate::learned::Choices::alone));
    /// `None`: the conductor plans.
    alone: Option<&'a String>,
    /// A learned workflow that beats every worker alone there by a clear margin.
    flow: Option<&'a FlowChoice>,
    /// The category ("chemistry") or kind ("multiple-choice questions") it was placed by.
    at: String,
    /// How it was placed, in words: "the question is like its chemistry items".
    how: String,
}

/// What the profiles name for `question`: its category's choices, where the learned questions
/// nearest to it place it in a category with a choice of its own; else its kind's, where its
/// form tells the kind ([`kind_of`]); `None` when neither does.
fn placed<'a>(m: &'a Measured, workers: usize, question: &str) -> Option<Placed<'a>> {
    let valid = |w: Option<usize>| w.filter(|w| *w < workers);
    let runs = |f: &&FlowChoice| f.workflow.workers().iter().all(|w| *w < workers);
    if let Some(category) = category_of(question, &m.questions) {
        let worker = valid(m.by_category.best.get(category).copied());
        let flow = m.by_category.flows.get(category).filter(runs);
        if worker.is_some() || flow.is_some() {
            let how = format!("the question is like its {category} items");
            let alone = worker.and(m.by_category.alone(category));
            return Some(Placed { worker, alone, flow, at: category.to_owned(), how });
        }
    }
    let kinds = m.by_kind.best.keys().chain(m.by_kind.flows.keys().filter(|k| !m.by_kind.best.contains_key(*k)));
    let kind = kind_of(question, kinds)?;
    let worker = valid(m.by_kind.best.get(kind).copied());
    let flow = m.by_kind.flows.get(kind).filter(runs);
    if worker.is_none() && flow.is_none() {
        return None;
    }
    let words = crate::profile::kind_words(kind);
    let how = format!("the question is a {words} one, and no learned category is like it");
    let alone = worker.and(m.by_kind.alone(kind));
    Some(Placed { worker, alone, flow, at: format!("{words} questions"), how })
}

/// How the reason of a routed question's `PlanReady::fallback` begins.
pub const ROUTED: &str = "routed";

/// Whether a `PlanReady::fallback` reason says the question was routed by what the pool learned
/// (rather than that its plans could not be used).
pub fn is_routed(reason: &str) -> bool {
    reason.starts_with(ROUTED)
}

/// Where a routed question goes: one worker alone, or a learned workflow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Routed {
    Worker(usize),
    Workflow(Workflow),
}

impl Routed {
    /// The plan a routed run executes.
    pub fn plan(&self, history: &[baton_providers::Message], question: &str) -> baton_plan::Plan {
        match self {
            Routed::Worker(w) => crate::workflow::alone_plan(*w, history, question),
            Routed::Workflow(flow) => flow.plan(history, question),
        }
    }
}

/// Whether the question goes straight to one worker or a learned workflow, with no plan, and
/// why: with [`Route::Auto`], when what was learned names a workflow for the question's
/// category (or, where no category places it, its kind) that beat every worker alone by a
/// clear margin; else when it names the worker by a clear margin, or the conductor's plans were
/// measured there and not shown to do better than that worker alone; with [`Route::Always`],
/// to the workflow or worker what was learned names ([`learned_worker`]), else the first
/// worker. A worker the user chose (`fallback_worker`) turns [`Route::Auto`]'s routing off,
/// since it is the user's choice, not a measurement; with [`Route::Always`] every question goes
/// to it. What the pool learned is `learned` ([`crate::Pool::learned`]).
///
/// The reason starts with [`ROUTED`]: a routed run is told apart from one whose plans failed by
/// its `PlanReady::fallback` reason ([`is_routed`]).
pub fn route(
    options: &FallbackOptions,
    learned: &Measured,
    workers: usize,
    question: &str,
) -> Option<(Routed, String)> {
    if let Some(w) = options.worker {
        return match options.route {
            Route::Always if w < workers => {
                Some((Routed::Worker(w), format!("{ROUTED} to the pool's fallback_worker (route = always)")))
            }
            _ => None,
        };
    }
    let by_flow = |p: &Placed<'_>| {
        p.flow.map(|f| {
            (
                Routed::Workflow(f.workflow.clone()),
                format!("{ROUTED} by what the pool learned: {}, and {}", p.how, f.why),
            )
        })
    };
    match options.route {
        Route::Never => None,
        Route::Auto => {
            let p = placed(learned, workers, question)?;
            if let Some(flow) = by_flow(&p) {
                return Some(flow);
            }
            let why = p.alone?;
            Some((Routed::Worker(p.worker?), format!("{ROUTED} by what the pool learned: {}, and {why}", p.how)))
        }
        // The fallback's own choice: the category's worker, else the best overall; a workflow
        // where one beats every worker alone.
        Route::Always => {
            if let Some(flow) = placed(learned, workers, question).as_ref().and_then(by_flow) {
                return Some(flow);
            }
            Some(match learned_worker(learned, workers, question) {
                Some((w, why)) => (Routed::Worker(w), format!("{ROUTED} by what the pool learned: {why}")),
                None => (Routed::Worker(0), format!("{ROUTED}: nothing learned places this question")),
            })
        }
    }
}

/// The worker what the pool learned names for `question`, and why: the cheapest as good at its
/// category, when the learned questions nearest to it say which category that is, or else at
/// its kind; else the best overall. `None` when nothing learned names a worker of the pool's
/// `workers`. The fallback's choice ([`crate::fallback::fallback_worker`]), and the route's
/// with `route = "always"`.
pub fn learned_worker(learned: &Measured, workers: usize, question: &str) -> Option<(usize, String)> {
    if let Some(p) = placed(learned, workers, question)
        && let Some(worker) = p.worker
    {
        return Some((worker, format!("the cheapest as good at {} when this pool learned", p.at)));
    }
    let best = learned.best.filter(|w| *w < workers)?;
    Some((best, "the best alone when this pool learned".into()))
}

/// The kind of `question` among the `learned` kinds, as far as its form tells: options
/// lettered A, B, … on lines of their own make it `choice`; a Python function's signature or
/// a fenced block of code, `code`; any other question is the one other kind learned (`number`
/// or `exact`), if just one was. `None` when the form names a kind not learned, or leaves two
/// open.
pub fn kind_of<'a>(question: &str, learned: impl Iterator<Item = &'a String>) -> Option<&'a str> {
    let learned: Vec<&'a String> = learned.collect();
    let find = |kind: &str| learned.iter().find(|k| k.as_str() == kind).map(|k| k.as_str());
    if has_lettered_options(question) {
        return find("choice");
    }
    if shows_code(question) {
        return find("code");
    }
    let mut open = learned.iter().filter(|k| !matches!(k.as_str(), "choice" | "code"));
    match (open.next(), open.next()) {
        (Some(one), None) => Some(one.as_str()),
        _ => None,
    }
}

/// Whether `question` offers lettered options: "A" and "B" each opening a line of its own as
/// "A.", "A)", "(A)" or "A:". One lettered line is no options ("A. Lincoln …"). The one rule
/// for routing by kind ([`kind_of`]) and for the conductor's choice of examples, so the two
/// never disagree on what a multiple-choice question is.
pub fn has_lettered_options(question: &str) -> bool {
    let option = |line: &str, letter: char| {
        let line = line.trim_start();
        let line = line.strip_prefix('(').unwrap_or(line);
        let mut chars = line.chars();
        chars.next().map(|c| c.to_ascii_uppercase()) == Some(letter) && matches!(chars.next(), Some('.' | ')' | ':'))
    };
    let lettered = |letter: char| question.lines().any(|line| option(line, letter));
    lettered('A') && lettered('B')
}

/// Whether `question` shows code: a fenced block, or a Python function's signature.
pub fn shows_code(question: &str) -> bool {
    question.contains("```") || (question.contains("def ") && question.contains("):"))
}

/// The category of the learned questions most like `question`, by a vote of the
/// [`NEIGHBOURS`] nearest weighted by likeness; `None` when none is alike enough.
pub fn category_of<'a>(question: &str, evaluated: &'a [(String, String)]) -> Option<&'a str> {
    let mine = distinctive(question);
    if mine.is_empty() {
        return None;
    }
    let mut near: Vec<(f64, &str)> = evaluated
        .iter()
        .map(|(q, category)| {
            let theirs = distinctive(q);
            let shared = mine.intersection(&theirs).count() as f64;
            let all = mine.union(&theirs).count() as f64;
            (if all > 0.0 { shared / all } else { 0.0 }, category.as_str())
        })
        .filter(|(likeness, _)| *likeness >= MIN_LIKENESS)
        .collect();
    near.sort_by(|a, b| b.0.total_cmp(&a.0));
    near.truncate(NEIGHBOURS);
    let mut votes: BTreeMap<&str, f64> = BTreeMap::new();
    for (likeness, category) in near {
        *votes.entry(category).or_default() += likeness;
    }
    votes.into_iter().max_by(|a, b| a.1.total_cmp(&b.1)).map(|(c, _)| c)
}

/// A text's words that can tell one subject from another: three letters or more, not common.
fn distinctive(text: &str) -> HashSet<String> {
    words(text).into_iter().filter(|w| w.chars().count() >= 3 && !COMMON.contains(&w.as_str())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fallback::fallback_worker;
    use crate::learned::Choices;

    #[test]
    fn a_question_routes_only_where_the_profile_is_clear_unless_routing_is_always() {
        let mut measured = Measured {
            best: Some(0),
            by_category: Choices {
                best: [("chemistry".to_owned(), 2), ("history".to_owned(), 1)].into(),
                clear: [("chemistry".to_owned(), "c was right on 8 of 8".to_owned())].into(),
                ..Default::default()
            },
            questions: vec![
                ("What is the pH of a 0.01 M solution of hydrochloric acid?".into(), "chemistry".into()),
                ("Who wrote the Federalist Papers with Madison and Jay?".into(), "history".into()),
            ],
            ..Default::default()
        };
        let mut options = FallbackOptions::default();
        let acid = "What is the pH of a 0.1 M solution of acetic acid?";
        let papers = "Who wrote the Federalist Papers?";
        let (w, why) = route(&options, &measured, 3, acid).expect("chemistry is clear");
        assert_eq!(w, Routed::Worker(2));
        assert!(why.contains("chemistry") && why.contains("8 of 8"), "{why}");
        assert_eq!(route(&options, &measured, 3, papers), None, "history's choice is not clear: the conductor plans");
        assert_eq!(route(&options, &measured, 2, acid), None, "a worker the pool no longer has");
        options.route = Route::Always;
        assert_eq!(route(&options, &measured, 3, papers).map(|r| r.0), Some(Routed::Worker(1)));
        assert_eq!(
            route(&options, &measured, 3, "Translate 'good morning' into French.").map(|r| r.0),
            Some(Routed::Worker(0))
        );
        options.route = Route::Never;
        assert_eq!(route(&options, &measured, 3, acid), None);
        // The user's worker: no routing by measurement, but `always` sends everything to it.
        options.worker = Some(1);
        options.route = Route::Auto;
        assert_eq!(route(&options, &measured, 3, acid), None);
        options.route = Route::Always;
        assert_eq!(route(&options, &measured, 3, acid).map(|r| r.0), Some(Routed::Worker(1)));

        // Where the conductor's plans were not shown to do better than history's worker alone, it
        // answers alone.
        let options = FallbackOptions::default();
        let why = "the conductor's plans were right on 3 of 8 when the pool learned, b alone on 4 of 8: a plan is not known to help";
        measured.by_category.no_gain.insert("history".into(), why.into());
        let (w, said) = route(&options, &measured, 3, papers).expect("no gain: alone");
        assert_eq!(w, Routed::Worker(1));
        assert!(said.ends_with(why), "{said}");
    }

    #[test]
    fn a_question_no_category_places_goes_to_the_worker_of_its_kind() {
        let measured = Measured {
            best: Some(0),
            by_category: Choices {
                best: [("chemistry".to_owned(), 0)].into(),
                clear: [("chemistry".to_owned(), "a was right on 8 of 8".to_owned())].into(),
                ..Default::default()
            },
            by_kind: Choices {
                best: [("choice".to_owned(), 1), ("number".to_owned(), 2)].into(),
                clear: [("choice".to_owned(), "b was right on 18 of 20".to_owned())].into(),
                ..Default::default()
            },
            questions: vec![("What is the pH of a 0.01 M solution of hydrochloric acid?".into(), "chemistry".into())],
            ..Default::default()
        };
        let options = FallbackOptions::default();
        let anatomy = "Which bone is the longest?\n\nA. femur\nB. tibia\nC. ulna\nD. radius";
        let (w, why) = route(&options, &measured, 3, anatomy).expect("multiple choice is clear");
        assert_eq!(w, Routed::Worker(1));
        assert!(why.contains("a multiple-choice one") && why.contains("18 of 20"), "{why}");
        // A question its category places goes by the category, whatever its form.
        let acid = "What is the pH of a 0.1 M solution of acetic acid?\n(A) 1\n(B) 2.9";
        assert_eq!(route(&options, &measured, 3, acid).map(|r| r.0), Some(Routed::Worker(0)));
        // An open question is the one open kind learned; its choice is not clear, so the
        // conductor plans, with that worker as the fallback.
        let sum = "Compute 17 times 23.";
        assert_eq!(route(&options, &measured, 3, sum), None);
        let (w, why) = fallback_worker(&options, &measured, 3, sum);
        assert_eq!(w, 2);
        assert_eq!(why.as_deref(), Some("the cheapest as good at numeric questions when this pool learned"));

        let kinds = |names: &[&str]| names.iter().map(|k| (*k).to_owned()).collect::<Vec<String>>();
        let learned = kinds(&["choice", "code", "exact", "number"]);
        assert_eq!(kind_of(anatomy, learned.iter()), Some("choice"));
        assert_eq!(kind_of("def add(a, b):\n    \"\"\"Add two numbers.\"\"\"", learned.iter()), Some("code"));
        assert_eq!(kind_of(sum, learned.iter()), None, "number or exact: the form does not tell");
        assert_eq!(kind_of(sum, kinds(&["choice", "exact"]).iter()), Some("exact"));
        assert_eq!(kind_of(anatomy, kinds(&["number"]).iter()), None, "no choice questions learned");
        assert_eq!(kind_of("Is A. Lincoln on the penny?", learned.iter()), None, "one lettered line is no options");
        assert!(has_lettered_options("Pick one.\n(a) red\n(b) blue"), "lower case and parentheses");
        assert!(has_lettered_options("Which?\nA: yes\nB: no"));
        assert!(!has_lettered_options("A. Lincoln and B. Franklin, on one line"));
    }

    #[test]
    fn a_learned_workflow_that_beats_every_worker_is_the_route_unless_routing_is_never() {
        let chain = Workflow::Chain { first: 0, then: 1 };
        let why = "a, then b seeing a's answer was right on 12 of 12 when the pool learned, no worker alone on more than 0 of 12";
        let measured = Measured {
            by_category: Choices {
                flows: [("word".to_owned(), FlowChoice { workflow: chain.clone(), why: why.into() })].into(),
                ..Default::default()
            },
            questions: vec![("A farmer has 17 rows of 23 apple trees. How many trees?".into(), "word".into())],
            ..Default::default()
        };
        let mut options = FallbackOptions::default();
        let trees = "A farmer plants 19 rows of 21 apple trees. How many trees are there?";
        let (routed, said) = route(&options, &measured, 3, trees).expect("the workflow routes");
        assert_eq!(routed, Routed::Workflow(chain.clone()));
        assert!(said.starts_with(ROUTED) && said.ends_with(why), "{said}");
        let plan = routed.plan(&[], trees);
        assert_eq!((plan.steps.len(), plan.steps[0].model_id, plan.steps[1].model_id), (2, 0, 1));
        assert_eq!(route(&options, &measured, 1, trees), None, "a worker the pool no longer has");
        options.route = Route::Always;
        assert_eq!(route(&options, &measured, 3, trees).map(|r| r.0), Some(Routed::Workflow(chain)));
        options.route = Route::Never;
        assert_eq!(route(&options, &measured, 3, trees), None, "never: the conductor plans");
        // No worker alone was right there: the fallback is the first worker, as before.
        assert_eq!(learned_worker(&measured, 3, trees), None);
    }
}

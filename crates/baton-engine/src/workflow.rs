//! Workflows a pool learns by search (`baton pool learn`): small plans of a fixed shape over the
//! pool's workers, whose subtasks come from a template so that a workflow found on one question
//! replays on the next. Where one answers a kind of question right by a clear margin over every
//! worker alone, runs of that kind execute it without asking the conductor
//! ([`crate::routing::route`]), as a clear single worker is routed to. The one-worker plan
//! (`alone_plan`, the fallback's and a routed worker's) is the simplest of these shapes, and is
//! here too.

use baton_plan::{Access, Plan, Step};
use baton_providers::{Message, Role};
use serde::{Deserialize, Serialize};

/// A workflow's shape, its workers by their index in the pool.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "shape")]
pub enum Workflow {
    /// `first` answers the question; `then` gets it again, seeing `first`'s answer.
    Chain { first: usize, then: usize },
    /// Each of `answerers` answers the question on its own; `aggregator` then answers it,
    /// seeing all of theirs.
    FanOut { answerers: Vec<usize>, aggregator: usize },
}

/// What the second worker of a chain is told, after the question and the first worker's
/// answer (which it sees): fixed, so the chain replays on any question.
pub const CHAIN_THEN: &str = "Above is another model's answer to this question. Use it: check it, \
finish any work it leaves undone, and give the final answer in the form the question asks for.";

/// What a fan-out's aggregator is told, after the question and every answer (after
/// togethercomputer/MoA's aggregator prompt).
pub const FAN_OUT_THEN: &str = "Above are several models' answers to this question. Some may be wrong. \
Evaluate them critically and write one accurate answer of your own, in the form the question asks for.";

impl Workflow {
    /// The plan that runs this workflow on `question` (after the conversation so far, when
    /// there is one, as a worker alone gets it).
    pub fn plan(&self, history: &[Message], question: &str) -> Plan {
        let asked = alone_subtask(history, question);
        let step =
            |model_id: usize, subtask: &str, access: Access| Step { model_id, subtask: subtask.to_owned(), access };
        let steps = match self {
            Workflow::Chain { first, then } => {
                vec![step(*first, &asked, Access::Steps(vec![])), step(*then, CHAIN_THEN, Access::Steps(vec![0]))]
            }
            Workflow::FanOut { answerers, aggregator } => {
                let mut steps: Vec<Step> = answerers.iter().map(|w| step(*w, &asked, Access::Steps(vec![]))).collect();
                steps.push(step(*aggregator, FAN_OUT_THEN, Access::All));
                steps
            }
        };
        Plan { steps }
    }

    /// Its workers, each once, in the order they first run.
    pub fn workers(&self) -> Vec<usize> {
        let mut all = match self {
            Workflow::Chain { first, then } => vec![*first, *then],
            Workflow::FanOut { answerers, aggregator } => {
                answerers.iter().copied().chain(std::iter::once(*aggregator)).collect()
            }
        };
        let mut seen = std::collections::HashSet::new();
        all.retain(|w| seen.insert(*w));
        all
    }

    /// How many calls one run of it makes.
    pub fn calls(&self) -> usize {
        match self {
            Workflow::Chain { .. } => 2,
            Workflow::FanOut { answerers, .. } => answerers.len() + 1,
        }
    }

    /// Its name in results (a learning run's strategy key), by the workers' names:
    /// `chain:a>b`, `fan-out:a+b>a`.
    pub fn key(&self, names: &[String]) -> String {
        let name = |w: &usize| names.get(*w).cloned().unwrap_or_else(|| format!("#{w}"));
        match self {
            Workflow::Chain { first, then } => format!("chain:{}>{}", name(first), name(then)),
            Workflow::FanOut { answerers, aggregator } => {
                let each: Vec<String> = answerers.iter().map(name).collect();
                format!("fan-out:{}>{}", each.join("+"), name(aggregator))
            }
        }
    }

    /// In words, as a route is shown: "a, then b seeing a's answer".
    pub fn describe(&self, names: &[String]) -> String {
        let name = |w: &usize| names.get(*w).cloned().unwrap_or_else(|| "?".to_owned());
        match self {
            Workflow::Chain { first, then } => {
                format!("{}, then {} seeing {}'s answer", name(first), name(then), name(first))
            }
            Workflow::FanOut { answerers, aggregator } => {
                let each: Vec<String> = answerers.iter().map(name).collect();
                format!("{} each answer, then {} seeing all of them", each.join(", "), name(aggregator))
            }
        }
    }

    /// The same workflow with each worker renumbered by `map` (an index in one pool → its
    /// index in another); `None` when a worker has no place there.
    pub fn renumbered(&self, map: impl Fn(usize) -> Option<usize>) -> Option<Workflow> {
        Some(match self {
            Workflow::Chain { first, then } => Workflow::Chain { first: map(*first)?, then: map(*then)? },
            Workflow::FanOut { answerers, aggregator } => Workflow::FanOut {
                answerers: answerers.iter().map(|w| map(*w)).collect::<Option<Vec<usize>>>()?,
                aggregator: map(*aggregator)?,
            },
        })
    }
}

/// The one instruction a worker alone gets: the question, after the conversation so far when
/// there is one (a worker sees no history of its own).
pub fn alone_subtask(history: &[Message], question: &str) -> String {
    if history.is_empty() {
        return question.to_owned();
    }
    let mut text = String::from("The conversation so far:\n");
    for m in history {
        let who = match m.role {
            Role::User => "User",
            _ => "Assistant",
        };
        text.push_str(&format!("\n{who}: {}\n", m.content));
    }
    text.push_str(&format!("\nAnswer the user's new message:\n\n{question}"));
    text
}

/// The plan that runs the question on `worker` alone.
pub fn alone_plan(worker: usize, history: &[Message], question: &str) -> Plan {
    Plan {
        steps: vec![Step {
            model_id: worker,
            subtask: alone_subtask(history, question),
            access: Access::Steps(vec![]),
        }],
    }
}

/// The workflows search tries for a question that no worker alone (and no plan of the
/// conductor's) answered, in the order it tries them, cheapest first: every chain of two
/// (each ordered pair of the `workers` workers: W·(W−1)), then one fan-out in which the
/// `ranked` workers (best first by measured accuracy; at most `max_steps` − 1 of them, and
/// at most three) each answer and the best of them aggregates. At most W·(W−1) + 1.
pub fn search_order(workers: usize, ranked: &[usize], max_steps: usize) -> Vec<Workflow> {
    let mut order = Vec::new();
    if max_steps < 2 {
        return order;
    }
    for first in 0..workers {
        for then in (0..workers).filter(|t| *t != first) {
            order.push(Workflow::Chain { first, then });
        }
    }
    let answerers: Vec<usize> =
        ranked.iter().copied().filter(|w| *w < workers).take((max_steps - 1).min(MAX_FAN_OUT)).collect();
    if answerers.len() >= 2 {
        order.push(Workflow::FanOut { aggregator: answerers[0], answerers });
    }
    order
}

/// The most workers a searched fan-out asks: past three, each added answer costs a call and
/// the aggregator a longer prompt, for a vote that rarely changes.
pub const MAX_FAN_OUT: usize = 3;

/// The most runs search makes for one item, in words and as a number: `W·(W−1) + 1` for a
/// pool of `workers` workers.
pub fn search_bound(workers: usize) -> (String, usize) {
    let n = workers * workers.saturating_sub(1) + usize::from(workers >= 2);
    (format!("at most W·(W−1) chains plus one fan-out per item = {n} runs for W = {workers}"), n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        vec!["reader".into(), "calc".into(), "dud".into()]
    }

    #[test]
    fn search_tries_every_ordered_pair_then_one_fan_out_of_the_best() {
        let order = search_order(3, &[1, 0, 2], 5);
        assert_eq!(order.len(), 3 * 2 + 1);
        assert_eq!(search_bound(3).1, order.len());
        assert_eq!(order[0], Workflow::Chain { first: 0, then: 1 });
        assert_eq!(order[1], Workflow::Chain { first: 0, then: 2 });
        assert_eq!(order[2], Workflow::Chain { first: 1, then: 0 });
        assert_eq!(order[6], Workflow::FanOut { answerers: vec![1, 0, 2], aggregator: 1 });
        // The fan-out is bounded by the pool's steps.
        assert_eq!(search_order(3, &[1, 0, 2], 3)[6], Workflow::FanOut { answerers: vec![1, 0], aggregator: 1 });
        assert!(search_order(3, &[0, 1, 2], 1).is_empty(), "one step allows no workflow");
        let keys: Vec<String> = order.iter().map(|w| w.key(&names())).collect();
        assert_eq!(keys[0], "chain:reader>calc");
        assert_eq!(keys[6], "fan-out:calc+reader+dud>calc");
    }

    #[test]
    fn a_chain_replays_on_any_question_with_the_same_second_instruction() {
        let chain = Workflow::Chain { first: 0, then: 1 };
        let plan = chain.plan(&[], "What is 6 times 7?");
        assert_eq!(plan.steps.len(), 2);
        assert_eq!(plan.steps[0].subtask, "What is 6 times 7?");
        assert_eq!(plan.steps[1].subtask, CHAIN_THEN);
        assert_eq!(plan.steps[1].access, Access::Steps(vec![0]));
        assert_eq!(chain.plan(&[], "Another question?").steps[1], plan.steps[1]);
        plan.validate(&baton_plan::Limits { max_steps: 5, pool_size: Some(3), allow_stop: false }).expect("valid");
        assert_eq!(chain.describe(&names()), "reader, then calc seeing reader's answer");
        let fan = Workflow::FanOut { answerers: vec![1, 0], aggregator: 1 };
        assert_eq!(fan.plan(&[], "q").steps.len(), 3);
        assert_eq!((fan.calls(), fan.workers()), (3, vec![1, 0]));
        assert_eq!(chain.renumbered(|w| [Some(2), Some(0)][w]), Some(Workflow::Chain { first: 2, then: 0 }));
        assert_eq!(chain.renumbered(|w| [Some(2), None][w]), None, "a worker the pool no longer has");
        let json = serde_json::to_string(&fan).expect("json");
        assert_eq!(serde_json::from_str::<Workflow>(&json).expect("back"), fan);
    }
}

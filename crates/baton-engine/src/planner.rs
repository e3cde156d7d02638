//! The conductor as the executor sees it: something that writes a plan for a question, and,
//! on recursive pools, for the work a step hands back to it.

use baton_plan::Plan;
use baton_providers::{Message, Usage};
use futures::future::BoxFuture;

use crate::accounting::{Meter, Refused};

/// What a conductor is asked to plan.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanningContext {
    pub question: String,
    /// Earlier turns of the conversation, oldest first, already bounded by the caller.
    pub history: Vec<Message>,
    /// For a recursive round: the work the conductor's step sees, as subtask/answer turns.
    pub work: Vec<Message>,
    /// 0 for the question's plan, 1 for a round opened by that plan, and so on.
    pub depth: u32,
    /// Whether the plan may give a step to the conductor itself.
    pub allow_self: bool,
    /// Whether three empty lists (stop) are acceptable: recursive rounds only.
    pub allow_stop: bool,
    pub max_steps: usize,
    /// Number of workers in the pool; the conductor itself is number `pool_size`.
    pub pool_size: usize,
}

impl PlanningContext {
    /// The first plan for a question with no conversation before it: depth 0, no stop, and
    /// the conductor not among the workers (set `allow_self` for a recursive pool).
    pub fn question(question: impl Into<String>, pool_size: usize, max_steps: usize) -> Self {
        PlanningContext {
            question: question.into(),
            history: Vec::new(),
            work: Vec::new(),
            depth: 0,
            allow_self: false,
            allow_stop: false,
            max_steps,
            pool_size,
        }
    }
}

/// A plan and the text it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    pub raw: String,
    pub plan: Plan,
    /// The conductor's tokens for this plan, every call it made (a retry after an unusable
    /// plan included).
    pub usage: Usage,
    /// What those calls cost; `None` when the conductor's price is unknown.
    pub cost_usd: Option<f64>,
    /// Why the conductor's generation ended (`stop`, `length`), as its model reported it.
    pub stop_reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct PlannerError {
    pub message: String,
    /// The conductor's next call would not fit under a budget cap, so it was not made.
    pub budget: bool,
}

impl PlannerError {
    pub fn new(message: impl Into<String>) -> Self {
        PlannerError { message: message.into(), budget: false }
    }

    /// Why the ledger refused a call: over a cap, or the run stopped while it waited.
    pub fn refused(refused: Refused) -> Self {
        match refused {
            Refused::Exceeded(e) => PlannerError { message: e.message, budget: true },
            Refused::Stopped => PlannerError::new("the run stopped"),
        }
    }
}

/// Receives the conductor's text as it is written.
pub type PlanDeltas<'a> = Box<dyn FnMut(&str) + Send + 'a>;

/// Writes plans. Dropping the future must stop generation.
pub trait Planner: Send + Sync {
    /// Names the conductor for people (events, history): model and where it runs.
    fn describe(&self) -> String;

    /// Writes a plan. Every model call goes through `meter` first: reserve its worst case, make
    /// it only if the reservation is granted, settle it with the usage the call reported.
    fn plan<'a>(
        &'a self,
        context: PlanningContext,
        deltas: PlanDeltas<'a>,
        meter: Meter<'a>,
    ) -> BoxFuture<'a, Result<Planned, PlannerError>>;
}

//! The conductor as the executor sees it: something that writes a plan for a question, and,
//! on recursive pools, for the work a step hands back to it.

use baton_plan::{Limits, Plan};
use baton_providers::{Message, Usage};
use futures::future::BoxFuture;

use crate::accounting::{Meter, Refused};

/// The output cap of a remote conductor's calls: far above the longest plan the default
/// grammar admits, and what bounds the call's worst case for a run's budget and for the
/// server's day (`baton_conductor::REMOTE_MAX_TOKENS` is this).
pub const REMOTE_PLAN_MAX_TOKENS: u32 = 4096;

/// What a conductor is asked to plan.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanningContext {
    pub question: String,
    /// Earlier turns of the conversation, oldest first, already bounded by the caller.
    pub history: Vec<Message>,
    /// The client's own instructions for the answer (an API request's `system` message).
    pub instructions: Option<String>,
    /// The worker the prompt's example workflows put on every step: the pool's best for this
    /// question where an evaluation measured it (see [`crate::fallback::fallback_worker`]),
    /// else the first. A small conductor copies an example's shape, models included, so the
    /// examples must not send it to a weak worker.
    pub lead: usize,
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
    /// 0 for the first plan of this round; 1 when the first could not be used and the
    /// conductor is asked again. A conductor must write the second differently (at temperature
    /// 0 the same prompt gives the same plan): other examples, another temperature.
    pub attempt: u32,
}

impl PlanningContext {
    /// What a plan for this context may be: its length, its workers (the conductor among them
    /// when it may take a step) and whether it may stop. The conductor parses under these, and
    /// the executor checks every plan against them again.
    pub fn limits(&self) -> Limits {
        Limits {
            max_steps: self.max_steps,
            pool_size: Some(self.pool_size + usize::from(self.allow_self)),
            allow_stop: self.allow_stop,
        }
    }

    /// The first plan for a question with no conversation before it: depth 0, no stop, and
    /// the conductor not among the workers (set `allow_self` for a recursive pool).
    pub fn question(question: impl Into<String>, pool_size: usize, max_steps: usize) -> Self {
        PlanningContext {
            question: question.into(),
            history: Vec::new(),
            instructions: None,
            lead: 0,
            work: Vec::new(),
            depth: 0,
            allow_self: false,
            allow_stop: false,
            max_steps,
            pool_size,
            attempt: 0,
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
    /// Exactly what the conductor was asked, when it is a model prompted by Baton: recorded
    /// with the plan, so training data and audits use the words that produced it.
    pub prompt: Option<PlanPrompt>,
    /// The example workflows that prompt showed: a plan that repeats one, or names what only
    /// an example's question has, is a copy, not a plan for the question.
    pub examples: Vec<ShownExample>,
    /// Set when no conductor wrote the plan: what the pool learned sends the question to one
    /// worker, and this says why (as a run's `PlanReady::fallback` would).
    pub routed: Option<String>,
}

impl Planned {
    /// A plan with nothing known of how it was written (tests, scripted conductors).
    pub fn bare(raw: String, plan: Plan) -> Planned {
        Planned {
            raw,
            plan,
            usage: Usage::default(),
            cost_usd: None,
            stop_reason: None,
            prompt: None,
            examples: Vec::new(),
            routed: None,
        }
    }
}

/// An example workflow a conductor's prompt showed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ShownExample {
    pub question: String,
    pub subtasks: Vec<String>,
}

/// The conductor's exact request for one plan.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, ts_rs::TS)]
pub struct PlanPrompt {
    /// The prompt's version (`v2`, `v3`, …), from the conductor's prompt files.
    pub version: String,
    pub system: String,
    pub messages: Vec<Message>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct PlannerError {
    pub message: String,
    /// The conductor's next call would not fit under a budget cap, so it was not made.
    pub budget: bool,
    /// The plan took longer than its time limit (asking again would take as long).
    pub timed_out: bool,
}

impl PlannerError {
    pub fn new(message: impl Into<String>) -> Self {
        PlannerError { message: message.into(), budget: false, timed_out: false }
    }

    /// The plan was not finished within its time limit.
    pub fn timed_out(message: impl Into<String>) -> Self {
        PlannerError { timed_out: true, ..PlannerError::new(message) }
    }

    /// Why the ledger refused a call: over a cap, or the run stopped while it waited.
    pub fn refused(refused: Refused) -> Self {
        match refused {
            Refused::Exceeded(e) => PlannerError { budget: true, ..PlannerError::new(e.message) },
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

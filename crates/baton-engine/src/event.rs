//! [`RunEvent`]: the one way progress leaves the executor. The CLI, the history store and the
//! UI all consume the same stream; its JSON form (`{"type": "step_started", ...}`) is what
//! `baton ask --json` prints, one event per line.

use baton_plan::Plan;
use baton_providers::{ErrorKind, Message, Usage};
use serde::{Deserialize, Serialize};

use crate::pool::WorkerInfo;

/// Everything that happens in a run, in order. Per step: `StepStarted`, then `StepDelta`s
/// (and `StepRetrying`, after which the step's text starts over), then exactly one of
/// `StepFinished` or `StepFailed`. A step can also fail without ever starting: when a step it
/// sees failed (`dependency_failed`), or when the run stops while it waits for a free slot at
/// its provider (`cancelled`). Steps that never became ready get no event. The run ends with
/// exactly one of `RunFinished`, `RunFailed` or `RunCancelled`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RunEvent {
    RunStarted {
        run_id: String,
        question: String,
        workers: Vec<WorkerInfo>,
    },
    /// The plan about to run, normalized.
    PlanReady {
        plan: Plan,
    },
    StepStarted {
        step: usize,
        /// Index of the worker in the pool.
        worker: usize,
        /// Exactly what the worker is sent.
        system: Option<String>,
        messages: Vec<Message>,
    },
    StepDelta {
        step: usize,
        text: String,
    },
    /// An attempt failed and will be retried after `delay_ms`; text streamed so far is void.
    StepRetrying {
        step: usize,
        /// The attempt that failed (1 for the first).
        attempt: u32,
        error: StepError,
        delay_ms: u64,
    },
    StepFinished {
        step: usize,
        output: String,
        usage: Usage,
        /// `None` when the worker's price is unknown.
        cost_usd: Option<f64>,
        /// From `StepStarted` to the last token, retries included.
        latency_ms: u64,
        retries: u32,
    },
    StepFailed {
        step: usize,
        error: StepError,
    },
    RunFinished {
        answer: String,
        totals: Totals,
    },
    RunFailed {
        error: RunError,
        totals: Totals,
    },
    RunCancelled {
        totals: Totals,
    },
}

impl RunEvent {
    /// Whether this event ends the run.
    pub fn is_terminal(&self) -> bool {
        matches!(self, RunEvent::RunFinished { .. } | RunEvent::RunFailed { .. } | RunEvent::RunCancelled { .. })
    }
}

/// Why a step failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepErrorKind {
    Auth,
    RateLimited,
    Overloaded,
    BadRequest,
    ContextTooLong,
    Network,
    Timeout,
    MalformedResponse,
    EmptyAnswer,
    /// The run was cancelled, or stopped by a budget cap, while this step ran.
    Cancelled,
    /// A step this one depends on failed, so it never ran.
    DependencyFailed,
}

impl From<ErrorKind> for StepErrorKind {
    fn from(kind: ErrorKind) -> Self {
        match kind {
            ErrorKind::Auth => StepErrorKind::Auth,
            ErrorKind::RateLimited => StepErrorKind::RateLimited,
            ErrorKind::Overloaded => StepErrorKind::Overloaded,
            ErrorKind::BadRequest => StepErrorKind::BadRequest,
            ErrorKind::ContextTooLong => StepErrorKind::ContextTooLong,
            ErrorKind::Network => StepErrorKind::Network,
            ErrorKind::Timeout => StepErrorKind::Timeout,
            ErrorKind::MalformedResponse => StepErrorKind::MalformedResponse,
            ErrorKind::EmptyAnswer => StepErrorKind::EmptyAnswer,
            ErrorKind::Cancelled => StepErrorKind::Cancelled,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepError {
    pub kind: StepErrorKind,
    pub message: String,
    /// The HTTP status, when a provider answered with one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
}

/// Why a run ended without an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunErrorKind {
    /// The plan does not fit the pool or the limits.
    InvalidPlan,
    /// The last step failed (itself or through a dependency).
    StepFailed,
    /// A budget cap was reached before a call.
    BudgetExceeded,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunError {
    pub kind: RunErrorKind,
    pub message: String,
}

/// Running totals of a run.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Totals {
    /// Provider calls, retries included.
    pub calls: u32,
    pub usage: Usage,
    /// Sum over steps with a known price.
    pub cost_usd: f64,
    /// False when some step's price is unknown, so `cost_usd` is a lower bound.
    pub cost_complete: bool,
    pub wall_ms: u64,
    pub steps_finished: Vec<usize>,
    pub steps_failed: Vec<usize>,
}

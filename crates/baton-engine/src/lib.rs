//! Baton's engine: the worker pool, the executor that runs a conductor's plan over it, and the
//! [`RunEvent`] stream that reports everything the executor does.
//!
//! Nothing here knows about a UI or a terminal: the CLI and the desktop app are consumers of
//! [`RunEvent`]s.

pub mod accounting;
pub mod calls;
pub mod event;
pub mod executor;
pub mod fallback;
pub mod keys;
pub mod learned;
pub mod limits;
pub mod logs;
pub mod plan_check;
pub mod planner;
pub mod pool;
pub mod prices;
pub mod profile;
pub mod progress;
pub mod rerun;
pub mod routing;
mod words;
pub mod workflow;

pub use accounting::Budget;
pub use event::{RerunOf, RunError, RunErrorKind, RunEvent, StepError, StepErrorKind, StepRef, Totals};
pub use executor::{AnswerSettings, EventSink, Executor, Reuse, RunOutcome, RunRequest, RunStatus, Worker, new_run_id};
pub use planner::{PlanDeltas, PlanPrompt, Planned, Planner, PlannerError, PlanningContext, ShownExample};
pub use pool::{
    ConductorSpec, Device, FallbackOptions, Pool, PoolError, PoolOptions, RecursionOptions, Route, ServeSpec,
    WorkerInfo, WorkerSpec,
};
pub use progress::RunProgress;

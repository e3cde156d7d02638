//! [`RunEvent`]: the one way progress leaves the executor. The CLI, the history store and the
//! UI all consume the same stream; its JSON form (`{"type": "step_started", ...}`) is what
//! `baton ask --json` prints, one event per line.

use baton_plan::Plan;
use baton_providers::{ErrorKind, Message, Usage};
use serde::{Deserialize, Serialize};

use crate::accounting::Figures;
use crate::planner::PlanPrompt;
use crate::pool::WorkerInfo;

/// Everything that happens in a run, in order.
///
/// A run has one or more *rounds*: round 0 is the plan for the question; each time a plan
/// gives a step to the conductor itself, that step opens a new round (numbered in the order
/// they start) whose plan continues the work. Step events carry their round, so `(round, step)`
/// names a step uniquely.
///
/// Per round: `PlanStarted` and `PlanDelta`s while a conductor writes it (absent for a given
/// plan), each rejected attempt's `PlanRejected`, then `PlanReady`. Per step: `StepStarted`, then `StepDelta`s (and `StepRetrying`,
/// after which the step's text starts over), then exactly one of `StepFinished` or
/// `StepFailed`; in a re-run, a step that keeps its earlier output has just `StepReused`
/// instead. A step can also fail without ever starting: when a step it sees failed
/// (`dependency_failed`), or when the run stops while it waits for a free slot at its provider
/// (`cancelled`). Steps that never became ready get no event. The run ends with exactly one of
/// `RunFinished`, `RunFailed` or `RunCancelled`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ts_rs::TS)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RunEvent {
    RunStarted {
        run_id: String,
        question: String,
        workers: Vec<WorkerInfo>,
        /// The conductor that writes plans, when there is one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        conductor: Option<String>,
        /// Set when this run re-runs one step of an earlier run with another worker.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rerun_of: Option<RerunOf>,
    },
    /// A conductor starts writing the plan of `round`.
    PlanStarted {
        round: u32,
        depth: u32,
        /// The step that handed work back to the conductor (recursion), if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        parent: Option<StepRef>,
    },
    /// More of the conductor's text for `round`, as it is written.
    PlanDelta {
        round: u32,
        text: String,
    },
    /// The plan of `round` about to run, normalized. An empty plan is a stop.
    PlanReady {
        round: u32,
        depth: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        parent: Option<StepRef>,
        plan: Plan,
        /// The conductor's whole answer; absent for a given plan.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        raw: Option<String>,
        /// The conductor's tokens for this plan (prompt, of it cached, and written); absent
        /// for a given plan.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        usage: Option<Usage>,
        /// What those tokens cost; absent for a given plan, and when the conductor's price is
        /// unknown.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cost_usd: Option<f64>,
        /// Why the conductor's generation ended: `stop` (its end token), `length` (its token cap),
        /// or `complete` (Baton ended the stream once the plan was whole).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stop_reason: Option<String>,
        /// Exactly what the conductor was asked for this plan (its prompt version, system
        /// prompt and messages); absent for a given plan and a fallback.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prompt: Option<PlanPrompt>,
        /// Set when this plan is not the conductor's: its plans could not be used (why, and
        /// who answers instead), so the question goes to one worker alone.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fallback: Option<String>,
    },
    /// The conductor's plan for `round` cannot be used: it failed, loops, copies an example
    /// workflow, or gives no worker the question. With `retry` the conductor is asked for
    /// another (more `PlanDelta`s follow, in the same round; or, when the run's caps leave no
    /// room for that attempt, the fallback's `PlanReady` follows at once); without, the round's
    /// `PlanReady` is the fallback. Only the question's plan (round 0) is checked, and only with
    /// the fallback on.
    PlanRejected {
        round: u32,
        reason: String,
        /// The rejected plan's text, when the conductor finished one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        raw: Option<String>,
        /// What the conductor was asked for it, as in `PlanReady`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prompt: Option<PlanPrompt>,
        retry: bool,
    },
    StepStarted {
        round: u32,
        step: usize,
        /// Index of the worker in the pool; the pool's size means the conductor itself.
        worker: usize,
        /// Exactly what the worker is sent.
        system: Option<String>,
        messages: Vec<Message>,
    },
    StepDelta {
        round: u32,
        step: usize,
        text: String,
    },
    /// An attempt failed and will be retried after `delay_ms`; text streamed so far is void.
    StepRetrying {
        round: u32,
        step: usize,
        /// The attempt that failed (1 for the first).
        attempt: u32,
        error: StepError,
        delay_ms: u64,
    },
    StepFinished {
        round: u32,
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
        round: u32,
        step: usize,
        error: StepError,
    },
    /// A step of a re-run that is not called again: it keeps its output from the run being
    /// re-run, because neither it nor any step it sees changed. It ends the step on its own
    /// (no `StepStarted` comes before it) and costs nothing.
    StepReused {
        round: u32,
        step: usize,
        worker: usize,
        output: String,
        /// The run the output comes from.
        from_run: String,
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

/// What a re-run re-runs: `step` (of round 0) of the run `run_id`, with the worker its plan now
/// names; the steps that see it run again too, the others keep their outputs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ts_rs::TS)]
pub struct RerunOf {
    pub run_id: String,
    pub step: usize,
}

/// A step of a particular round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ts_rs::TS)]
pub struct StepRef {
    pub round: u32,
    pub step: usize,
}

impl RunEvent {
    /// The `PlanReady` of a plan no conductor wrote (a client's, a reviewed draft, a re-run's):
    /// no text, tokens, cost or prompt of its own.
    pub fn given_plan(round: u32, depth: u32, parent: Option<StepRef>, plan: Plan) -> RunEvent {
        RunEvent::PlanReady {
            round,
            depth,
            parent,
            plan,
            raw: None,
            usage: None,
            cost_usd: None,
            stop_reason: None,
            prompt: None,
            fallback: None,
        }
    }

    /// Whether this event ends the run.
    pub fn is_terminal(&self) -> bool {
        self.final_totals().is_some()
    }

    /// The run's totals, on the event that ends it.
    pub fn final_totals(&self) -> Option<&Totals> {
        match self {
            RunEvent::RunFinished { totals, .. }
            | RunEvent::RunFailed { totals, .. }
            | RunEvent::RunCancelled { totals } => Some(totals),
            _ => None,
        }
    }
}

/// Why a step failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ts_rs::TS)]
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
    /// The conductor could not write a plan for this step (recursion).
    Conductor,
    /// A recursion cap (depth or total steps) was reached.
    RecursionLimit,
    /// The step's next call would not fit under a budget cap, so it was not made.
    Budget,
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

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ts_rs::TS)]
pub struct StepError {
    pub kind: StepErrorKind,
    pub message: String,
    /// The HTTP status, when a provider answered with one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
}

/// Why a run ended without an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ts_rs::TS)]
#[serde(rename_all = "snake_case")]
pub enum RunErrorKind {
    /// The plan does not fit the pool or the limits.
    InvalidPlan,
    /// The last step failed (itself or through a dependency).
    StepFailed,
    /// A budget cap was reached before a call.
    BudgetExceeded,
    /// The conductor could not write the plan.
    Conductor,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ts_rs::TS)]
pub struct RunError {
    pub kind: RunErrorKind,
    pub message: String,
}

/// What a run spent, in one shape for every surface.
///
/// `calls`, `usage`, `cost_usd` and `cost_complete` cover every request the run sent: the
/// conductor's and the workers', retries and failed attempts included. `conductor` and
/// `workers` split the same figures by who made the call (they add up to the whole).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ts_rs::TS)]
pub struct Totals {
    /// Requests sent, retries and failed attempts included.
    pub calls: u32,
    pub usage: Usage,
    /// Sum over calls with a known price.
    pub cost_usd: f64,
    /// False when some call's price is unknown, so `cost_usd` is a lower bound.
    pub cost_complete: bool,
    /// The conductor's share: its calls writing plans (a local conductor costs $0, its tokens count).
    #[serde(default)]
    pub conductor: Figures,
    /// The workers' share.
    #[serde(default)]
    pub workers: Figures,
    /// Who made calls with no known price (worker names, or "the conductor").
    #[serde(default)]
    pub cost_unknown_for: Vec<String>,
    pub wall_ms: u64,
    /// Steps of round 0 that finished or failed (nested rounds are in the events).
    pub steps_finished: Vec<usize>,
    pub steps_failed: Vec<usize>,
    /// Plans written, recursive rounds included.
    pub rounds: u32,
}

impl Totals {
    /// The whole run's figures.
    pub fn all(&self) -> Figures {
        Figures { calls: self.calls, usage: self.usage, cost_usd: self.cost_usd, cost_complete: self.cost_complete }
    }

    /// The figures for people, one labelled line each: the whole run, the conductor's share,
    /// the workers', and which prices are unknown. CLI progress and Markdown exports print
    /// these; the app shows the same fields.
    pub fn breakdown(&self) -> Vec<String> {
        let mut lines = vec![
            format!("total: {}", self.all().summary()),
            format!("conductor: {}", self.conductor.summary()),
            format!("workers: {}", self.workers.summary()),
        ];
        lines.extend(self.cost_unknown_note());
        lines
    }

    /// "cost unknown for a, b", when some price is unknown: what every surface shows beside
    /// the dollar figure, which is then only a lower bound.
    pub fn cost_unknown_note(&self) -> Option<String> {
        (!self.cost_complete).then(|| {
            if self.cost_unknown_for.is_empty() {
                "cost unknown for some calls".to_owned()
            } else {
                format!("cost unknown for {}", self.cost_unknown_for.join(", "))
            }
        })
    }
}

/// Checks a whole run's events against the contract documented on [`RunEvent`]; the error
/// says which rule broke. Consumers' tests use it on every run they make.
pub fn check_sequence(events: &[RunEvent]) -> Result<(), String> {
    use std::collections::HashSet;
    if !matches!(events.first(), Some(RunEvent::RunStarted { .. })) {
        return Err(format!("the first event is not run_started: {:?}", events.first()));
    }
    if !events.last().is_some_and(RunEvent::is_terminal) {
        return Err(format!("the last event does not end the run: {:?}", events.last()));
    }
    if events.iter().filter(|e| e.is_terminal()).count() != 1 {
        return Err("more than one terminal event".into());
    }
    let mut planned = HashSet::new();
    let mut started = HashSet::new();
    let mut ended = HashSet::new();
    for e in events {
        match e {
            RunEvent::PlanReady { round, .. } if !planned.insert(*round) => {
                return Err(format!("round {round} planned twice"));
            }
            RunEvent::PlanRejected { round, .. } if planned.contains(round) => {
                return Err(format!("round {round}'s plan rejected after it was ready"));
            }
            RunEvent::StepStarted { round, step, .. } => {
                if !planned.contains(round) {
                    return Err(format!("step {round}.{step} started before its round's plan"));
                }
                if !started.insert((*round, *step)) {
                    return Err(format!("step {round}.{step} started twice"));
                }
                if ended.contains(&(*round, *step)) {
                    return Err(format!("step {round}.{step} started after it ended"));
                }
            }
            RunEvent::StepDelta { round, step, .. } | RunEvent::StepRetrying { round, step, .. }
                if !started.contains(&(*round, *step)) || ended.contains(&(*round, *step)) =>
            {
                return Err(format!("an event for step {round}.{step} outside its life"));
            }
            RunEvent::StepFinished { round, step, .. } => {
                if !started.contains(&(*round, *step)) {
                    return Err(format!("step {round}.{step} finished without starting"));
                }
                if !ended.insert((*round, *step)) {
                    return Err(format!("step {round}.{step} ended twice"));
                }
            }
            RunEvent::StepFailed { round, step, .. } if !ended.insert((*round, *step)) => {
                return Err(format!("step {round}.{step} ended twice"));
            }
            RunEvent::StepReused { round, step, .. } => {
                if !planned.contains(round) {
                    return Err(format!("step {round}.{step} reused before its round's plan"));
                }
                if started.contains(&(*round, *step)) {
                    return Err(format!("step {round}.{step} both started and reused"));
                }
                if !ended.insert((*round, *step)) {
                    return Err(format!("step {round}.{step} ended twice"));
                }
            }
            _ => {}
        }
    }
    if let Some((round, step)) = started.difference(&ended).next() {
        return Err(format!("step {round}.{step} started but never ended"));
    }
    Ok(())
}

//! Runs a plan over the pool.
//!
//! The access lists form a DAG; a step starts as soon as every step it sees has finished, so
//! independent steps run at the same time (bounded per provider endpoint). A step that fails
//! after its retries fails the steps that depend on it; the others still finish. The last step's
//! output is the answer. Progress leaves only as [`RunEvent`]s.
//!
//! With a [`Planner`] the executor also asks the conductor for the plan, and on recursive pools
//! a step given to the conductor itself opens a new round: the conductor sees that step's work
//! and writes a plan (or stops), whose answer becomes the step's output.
//!
//! Stopping is cooperative: every future in flight watches the run's stop token and returns
//! promptly, so each running step reports its own `StepFailed` before the run ends.
//!
//! This module holds the executor, its public types and a run's top level; the parts of a run
//! live in its children: `planning` (the conductor's plan for a round), `dag` (a round's steps,
//! in dependency order, and recursive rounds) and `step` (one worker's step).

mod dag;
mod planning;
mod step;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_plan::Plan;
use baton_providers::{
    ChatModel, ChatRequest, ChatStream, ErrorKind, HttpModel, KeySource, Message, ProviderError, ProviderKind,
};
use futures::future::BoxFuture;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

use self::dag::{RoundError, RoundOutcome};
use self::planning::NoPlan;
use crate::accounting::{Budget, Ledger};
use crate::event::{RerunOf, RunError, RunErrorKind, RunEvent, StepError, StepErrorKind, Totals};
use crate::keys;
use crate::learned::Measured;
use crate::planner::Planner;
use crate::pool::{Pool, PoolOptions, WorkerInfo, WorkerSpec};
use crate::prices::Pricing;
// `Reuse` is the re-run's type; it is also named here, where a run takes it.
pub use crate::rerun::Reuse;

/// Where a run's events go. Unbounded so a slow consumer never stalls the run.
pub type EventSink = mpsc::UnboundedSender<RunEvent>;

/// A pool member ready to be called.
pub struct Worker {
    pub info: WorkerInfo,
    pub model: Arc<dyn ChatModel>,
    pub pricing: Pricing,
    /// The most output tokens one call can produce (see `ModelSettings::output_cap`): what a
    /// call reserves for its output.
    pub output_cap: u32,
    /// Limit for one call, retries not included.
    pub timeout: Duration,
    /// Workers with the same endpoint share one concurrency limit.
    pub endpoint: String,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("info", &self.info).field("endpoint", &self.endpoint).finish_non_exhaustive()
    }
}

/// The model of a `local` worker built without one: the engine runs no model itself, so every
/// call fails, naming the worker.
struct NotLoaded(String);

impl ChatModel for NotLoaded {
    fn stream(&self, _request: ChatRequest) -> BoxFuture<'static, Result<ChatStream, ProviderError>> {
        let message = format!("worker \"{}\" runs a model in process, and none was loaded for it", self.0);
        Box::pin(async move { Err(ProviderError::new(ErrorKind::BadRequest, message)) })
    }
}

pub struct Executor {
    workers: Vec<Worker>,
    options: PoolOptions,
    /// What the pool learned ([`Pool::learned`]): routing and the fallback worker read it.
    learned: Measured,
    limits: HashMap<String, Arc<Semaphore>>,
    planner: Option<Arc<dyn Planner>>,
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("workers", &self.workers)
            .field("options", &self.options)
            .field("learned", &self.learned)
            .field("planner", &self.planner.as_ref().map(|p| p.describe()))
            .finish()
    }
}

/// What to run.
#[derive(Debug, Clone, Default)]
pub struct RunRequest {
    pub run_id: String,
    pub question: String,
    /// Earlier turns of the conversation, for the conductor.
    pub history: Vec<Message>,
    /// The plan to run; `None` asks the conductor for one.
    pub plan: Option<Plan>,
    /// Round-0 outputs to keep from an earlier run instead of calling again (a re-run; see
    /// [`crate::rerun`]). Needs `plan`.
    pub reuse: Option<Reuse>,
    /// The client's own instructions (an API request's `system` message): the conductor sees
    /// them with the question, and every worker after Baton's step instructions.
    pub instructions: Option<String>,
    /// Settings for the steps that write an answer (the last step of each plan), from an API
    /// client's request: they tighten or replace the worker's own.
    pub answer: AnswerSettings,
    /// Caps for this run instead of the pool's (an evaluation gives each run its share of the
    /// evaluation's spending cap). Each cap is the tighter of this and the pool's.
    pub budget: Option<Budget>,
}

/// An API client's settings for the answer it gets: the last step of each plan (a recursive
/// round's last step answers for the step that opened it).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct AnswerSettings {
    /// At most this many output tokens (never more than the worker's own `max_tokens`).
    pub max_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunStatus {
    Finished,
    Failed,
    Cancelled,
}

/// The end of a run; the same facts as its terminal event.
#[derive(Debug, Clone, PartialEq)]
pub struct RunOutcome {
    pub status: RunStatus,
    pub answer: Option<String>,
    pub error: Option<RunError>,
    pub totals: Totals,
}

impl Executor {
    pub fn new(workers: Vec<Worker>, options: PoolOptions) -> Self {
        let mut limits = HashMap::new();
        for w in &workers {
            limits
                .entry(w.endpoint.clone())
                .or_insert_with(|| Arc::new(Semaphore::new(options.max_concurrency_per_provider)));
        }
        Executor { workers, options, learned: Measured::default(), limits, planner: None }
    }

    /// Workers over HTTP for every pool entry, with keys from the environment variables the
    /// pool names, else from the OS keychain (see [`keys::key_source`]). A `local` worker gets
    /// no model here: each of its calls fails (see [`Executor::from_pool_with_local`]).
    pub fn from_pool(pool: &Pool) -> Self {
        Self::from_pool_with_keys(pool, keys::key_source)
    }

    /// Like [`Executor::from_pool`], with each `local` worker on the model `local` holds under
    /// its index in the pool. The engine runs no model itself: whoever builds the executor loads
    /// them first, so each is built once, as what it is.
    pub fn from_pool_with_local(pool: &Pool, local: HashMap<usize, Arc<dyn ChatModel>>) -> Self {
        Self::with_models(pool, keys::key_source, local)
    }

    /// Like [`Executor::from_pool`], with each worker's key source chosen by `keys`.
    pub fn from_pool_with_keys(pool: &Pool, keys: impl Fn(&WorkerSpec) -> KeySource) -> Self {
        Self::with_models(pool, keys, HashMap::new())
    }

    fn with_models(
        pool: &Pool,
        keys: impl Fn(&WorkerSpec) -> KeySource,
        mut local: HashMap<usize, Arc<dyn ChatModel>>,
    ) -> Self {
        let http = HttpModel::http_client();
        let workers = pool
            .workers
            .iter()
            .zip(pool.infos())
            .enumerate()
            .map(|(index, (spec, info))| {
                if spec.provider == ProviderKind::Local {
                    let model = local.remove(&index).unwrap_or_else(|| Arc::new(NotLoaded(spec.name.clone())));
                    return Worker {
                        info,
                        model,
                        pricing: spec.pricing(),
                        output_cap: spec.max_tokens,
                        timeout: spec.timeout,
                        // One local engine runs its sequences itself; share one limit per model file.
                        endpoint: format!("local {}", spec.model),
                    };
                }
                let base_url = spec.effective_base_url().to_owned();
                let model = HttpModel::new(spec.provider, &base_url, spec.settings(), keys(spec), http.clone());
                Worker {
                    info,
                    model: Arc::new(model),
                    pricing: spec.pricing(),
                    output_cap: spec.settings().output_cap(),
                    timeout: spec.timeout,
                    endpoint: format!("{} {base_url}", spec.provider),
                }
            })
            .collect();
        Executor { learned: pool.learned.clone(), ..Executor::new(workers, pool.options.clone()) }
    }

    /// Lets the executor ask `planner` for plans (and, on recursive pools, hand work back to it).
    pub fn with_planner(mut self, planner: Arc<dyn Planner>) -> Self {
        self.planner = Some(planner);
        self
    }

    pub fn workers(&self) -> &[Worker] {
        &self.workers
    }

    pub fn options(&self) -> &PoolOptions {
        &self.options
    }

    /// Whether plans may give steps to the conductor itself.
    fn recursive(&self) -> bool {
        self.options.recursion.enabled && self.planner.is_some()
    }

    /// Plan numbers a plan may use: the workers, plus the conductor on recursive pools.
    fn plan_pool_size(&self) -> usize {
        self.workers.len() + usize::from(self.recursive())
    }

    /// Runs the question, sending every event to `events`. Cancelling `cancel` stops all calls
    /// in flight (their connections are closed, local generation stops) and ends the run with
    /// `RunCancelled`.
    pub async fn run(&self, request: RunRequest, events: &EventSink, cancel: &CancellationToken) -> RunOutcome {
        let started = Instant::now();
        let ctx = RunCtx::new(&request, tighter(self.options.budget, request.budget), events, cancel);
        let reuse = request.reuse.unwrap_or_default();
        ctx.emit(RunEvent::RunStarted {
            run_id: request.run_id.clone(),
            question: request.question.clone(),
            workers: self.workers.iter().map(|w| w.info.clone()).collect(),
            conductor: self.planner.as_ref().map(|p| p.describe()),
            rerun_of: (!reuse.from_run.is_empty())
                .then(|| RerunOf { run_id: reuse.from_run.clone(), step: reuse.step }),
        });

        let (round, plan) = match self.question_plan(&ctx, request.plan, &reuse).await {
            Ok(first) => first,
            Err(NoPlan::Stopped) => return ctx.finish_stopped(started),
            Err(NoPlan::Failed(error)) => return ctx.finish(RunStatus::Failed, None, Some(error), started, &[], &[]),
        };
        let cap = self.options.recursion.max_total_steps.unwrap_or(2 * plan.steps.len());
        ctx.step_cap.store(cap, Ordering::SeqCst);

        let outcome = self.run_plan(&ctx, round, 0, plan, Vec::new(), Some(&reuse)).await;
        ctx.finish_round(started, outcome)
    }
}

/// Shared state of one run.
struct RunCtx<'a> {
    /// Named on each of the run's log lines, which interleave with other runs' on a server.
    run_id: String,
    events: &'a EventSink,
    ledger: Ledger,
    user_cancel: CancellationToken,
    /// Cancelled when the user cancels (a budget cap only stops new steps: see `exhausted`).
    stop: CancellationToken,
    /// Why the run stopped, when it was not the user.
    stop_reason: Mutex<Option<RunError>>,
    /// A budget cap refused a call: no new step starts.
    exhausted: AtomicBool,
    rounds: AtomicU32,
    steps_started: AtomicUsize,
    /// Steps allowed in the whole run, recursive rounds included.
    step_cap: AtomicUsize,
    question: String,
    history: Vec<Message>,
    instructions: Option<String>,
    answer: AnswerSettings,
}

impl<'a> RunCtx<'a> {
    /// The state `request` starts with, under `budget` (already the tighter of the pool's and
    /// the request's); `cancel` is the user's stop.
    fn new(request: &RunRequest, budget: Budget, events: &'a EventSink, cancel: &CancellationToken) -> Self {
        RunCtx {
            run_id: request.run_id.clone(),
            events,
            ledger: Ledger::new(budget),
            user_cancel: cancel.clone(),
            stop: cancel.child_token(),
            stop_reason: Mutex::new(None),
            exhausted: AtomicBool::new(false),
            rounds: AtomicU32::new(0),
            steps_started: AtomicUsize::new(0),
            step_cap: AtomicUsize::new(usize::MAX),
            question: request.question.clone(),
            history: request.history.clone(),
            instructions: request.instructions.clone().filter(|i| !i.trim().is_empty()),
            answer: request.answer,
        }
    }
}

impl RunCtx<'_> {
    fn emit(&self, event: RunEvent) {
        crate::logs::log_event(&self.run_id, &event);
        // A consumer that went away must not stop the run.
        let _ = self.events.send(event);
    }

    fn step_failed(&self, round: u32, step: usize, kind: StepErrorKind, message: String, status: Option<u16>) {
        self.emit(RunEvent::StepFailed { round, step, error: StepError { kind, message, status } });
    }

    /// A cap refused a call: the run starts nothing new and ends failed for this reason.
    fn exhaust(&self, error: RunError) {
        let mut reason = self.stop_reason.lock().unwrap_or_else(|p| p.into_inner());
        reason.get_or_insert(error);
        self.exhausted.store(true, Ordering::SeqCst);
    }

    fn is_exhausted(&self) -> bool {
        self.exhausted.load(Ordering::SeqCst)
    }

    fn stop_message(&self) -> String {
        match &*self.stop_reason.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(reason) => format!("the run stopped: {}", reason.message),
            None => "the run was cancelled".to_owned(),
        }
    }

    fn finish(
        &self,
        status: RunStatus,
        answer: Option<String>,
        error: Option<RunError>,
        started: Instant,
        finished: &[usize],
        failed: &[usize],
    ) -> RunOutcome {
        let spent = self.ledger.spent();
        let all = spent.total();
        let totals = Totals {
            calls: all.calls,
            usage: all.usage,
            cost_usd: all.cost_usd,
            cost_complete: all.cost_complete,
            conductor: spent.conductor,
            workers: spent.workers,
            cost_unknown_for: spent.cost_unknown_for,
            // To the nearest millisecond: truncating would understate every run by half of one.
            wall_ms: ((started.elapsed().as_micros() + 500) / 1000) as u64,
            steps_finished: finished.to_vec(),
            steps_failed: failed.to_vec(),
            rounds: self.rounds.load(Ordering::SeqCst),
        };
        let event = match (status, &answer) {
            (RunStatus::Finished, Some(a)) => RunEvent::RunFinished { answer: a.clone(), totals: totals.clone() },
            (RunStatus::Cancelled, _) => RunEvent::RunCancelled { totals: totals.clone() },
            _ => RunEvent::RunFailed {
                error: error
                    .clone()
                    .unwrap_or(RunError { kind: RunErrorKind::StepFailed, message: "the run failed".into() }),
                totals: totals.clone(),
            },
        };
        self.emit(event);
        RunOutcome { status, answer, error, totals }
    }

    /// Ends the run with the question's round: its answer, or why there is none.
    fn finish_round(&self, started: Instant, outcome: RoundOutcome) -> RunOutcome {
        let RoundOutcome { result, finished, failed } = outcome;
        match result {
            Ok(answer) => self.finish(RunStatus::Finished, Some(answer), None, started, &finished, &failed),
            Err(RoundError::Stopped) => self.finish_stopped_with(started, &finished, &failed),
            Err(RoundError::Failed(message)) => {
                let error = RunError { kind: RunErrorKind::StepFailed, message };
                self.finish(RunStatus::Failed, None, Some(error), started, &finished, &failed)
            }
        }
    }

    fn finish_stopped(&self, started: Instant) -> RunOutcome {
        self.finish_stopped_with(started, &[], &[])
    }

    /// Ends a stopped run: cancelled by the user, or failed for the recorded reason.
    fn finish_stopped_with(&self, started: Instant, finished: &[usize], failed: &[usize]) -> RunOutcome {
        let reason = self.stop_reason.lock().unwrap_or_else(|p| p.into_inner()).clone();
        match reason {
            Some(error) if !self.user_cancel.is_cancelled() => {
                self.finish(RunStatus::Failed, None, Some(error), started, finished, failed)
            }
            _ => self.finish(RunStatus::Cancelled, None, None, started, finished, failed),
        }
    }
}

/// Each cap the tighter of the pool's and the run's own.
fn tighter(pool: Budget, run: Option<Budget>) -> Budget {
    let Some(run) = run else { return pool };
    fn min<T: PartialOrd>(a: Option<T>, b: Option<T>) -> Option<T> {
        match (a, b) {
            (Some(a), Some(b)) => Some(if b < a { b } else { a }),
            (a, b) => a.or(b),
        }
    }
    Budget {
        max_calls: min(pool.max_calls, run.max_calls),
        max_tokens: min(pool.max_tokens, run.max_tokens),
        max_cost_usd: min(pool.max_cost_usd, run.max_cost_usd),
    }
}

/// A fresh run id: time-ordered, unique enough for one user's history.
pub fn new_run_id() -> String {
    let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
    format!("{ms:012x}{:06x}", fastrand::u32(..) & 0xff_ffff)
}

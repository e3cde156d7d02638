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

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_plan::{Limits, Plan};
use baton_providers::{ChatModel, ChatRequest, ErrorKind, HttpModel, KeySource, Message, ProviderError, Role, Usage};
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

use crate::accounting::{Caller, Ledger, Meter, Refused, WorstCase};
use crate::event::{RerunOf, RunError, RunErrorKind, RunEvent, StepError, StepErrorKind, StepRef, Totals};
use crate::keys;
use crate::planner::{Planner, PlanningContext};
use crate::pool::{Budget, Pool, PoolOptions, WorkerInfo, WorkerSpec};
use crate::prices::Pricing;

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

pub struct Executor {
    workers: Vec<Worker>,
    options: PoolOptions,
    limits: HashMap<String, Arc<Semaphore>>,
    planner: Option<Arc<dyn Planner>>,
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("workers", &self.workers)
            .field("options", &self.options)
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

/// A worker's system message: Baton's step instructions (the question, when the pool shows it;
/// the step's part, for a step asked the question itself), then the client's own instructions,
/// if any.
fn worker_system(show_question: bool, part: Option<&str>, ctx: &RunCtx<'_>) -> Option<String> {
    let question = show_question
        .then(|| format!("You are one step of a larger workflow. The user's original question:\n\n{}", ctx.question));
    let part = part.map(|p| format!("Your part in this workflow: {p}"));
    let step = match (question, part) {
        (Some(q), Some(p)) => Some(format!("{q}\n\n{p}")),
        (q, p) => q.or(p),
    };
    match (step, &ctx.instructions) {
        (Some(step), Some(theirs)) => Some(format!("{step}\n\nThe user's instructions:\n\n{theirs}")),
        (step, theirs) => step.or_else(|| theirs.clone()),
    }
}

/// What a re-run keeps from the run it re-runs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reuse {
    /// The run the outputs come from.
    pub from_run: String,
    /// The step that is re-run with another worker (recorded with the run).
    pub step: usize,
    /// Outputs of round-0 steps, by step number. Every step a kept step sees must be kept too.
    pub outputs: BTreeMap<usize, String>,
}

impl Reuse {
    /// Whether some step of `plan` given to `worker` runs again (is not kept).
    pub fn runs_worker(&self, plan: &Plan, worker: usize) -> bool {
        plan.steps.iter().enumerate().any(|(i, s)| s.model_id == worker && !self.outputs.contains_key(&i))
    }

    /// Why this cannot be used with `plan`, if it cannot: outputs for steps the plan lacks, or
    /// a kept step that sees a step which runs again (its output would be stale).
    fn check(&self, plan: &Plan) -> Result<(), String> {
        let deps = plan.dependencies();
        for &i in self.outputs.keys() {
            let Some(seen) = deps.get(i) else {
                return Err(format!("the re-run keeps step {i}, which the plan does not have"));
            };
            if let Some(j) = seen.iter().find(|j| !self.outputs.contains_key(j)) {
                return Err(format!("the re-run keeps step {i} but runs step {j}, which step {i} sees, again"));
            }
        }
        Ok(())
    }
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
        Executor { workers, options, limits, planner: None }
    }

    /// Workers over HTTP for every pool entry, with keys from the environment variables the
    /// pool names, else from the OS keychain (see [`keys::key_source`]).
    pub fn from_pool(pool: &Pool) -> Self {
        Self::from_pool_with_keys(pool, keys::key_source)
    }

    /// Like [`Executor::from_pool`], with each worker's key source chosen by `keys`.
    pub fn from_pool_with_keys(pool: &Pool, keys: impl Fn(&WorkerSpec) -> KeySource) -> Self {
        let http = HttpModel::http_client();
        let workers = pool
            .workers
            .iter()
            .zip(pool.infos())
            .map(|(spec, info)| {
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
        Executor::new(workers, pool.options.clone())
    }

    /// Lets the executor ask `planner` for plans (and, on recursive pools, hand work back to it).
    pub fn with_planner(mut self, planner: Arc<dyn Planner>) -> Self {
        self.planner = Some(planner);
        self
    }

    /// Replaces worker `index` (e.g. with a local model).
    pub fn replace_worker(&mut self, index: usize, worker: Worker) {
        if let Some(slot) = self.workers.get_mut(index) {
            self.limits
                .entry(worker.endpoint.clone())
                .or_insert_with(|| Arc::new(Semaphore::new(self.options.max_concurrency_per_provider)));
            *slot = worker;
        }
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
        let ctx = RunCtx {
            run_id: request.run_id.clone(),
            events,
            ledger: Ledger::new(tighter(self.options.budget, request.budget)),
            user_cancel: cancel.clone(),
            stop: cancel.child_token(),
            stop_reason: Mutex::new(None),
            exhausted: std::sync::atomic::AtomicBool::new(false),
            rounds: AtomicU32::new(0),
            steps_started: AtomicUsize::new(0),
            step_cap: AtomicUsize::new(usize::MAX),
            question: request.question.clone(),
            history: request.history.clone(),
            instructions: request.instructions.clone().filter(|i| !i.trim().is_empty()),
            answer: request.answer,
        };
        let reuse = request.reuse.unwrap_or_default();
        ctx.emit(RunEvent::RunStarted {
            run_id: request.run_id.clone(),
            question: request.question.clone(),
            workers: self.workers.iter().map(|w| w.info.clone()).collect(),
            conductor: self.planner.as_ref().map(|p| p.describe()),
            rerun_of: (!reuse.from_run.is_empty())
                .then(|| RerunOf { run_id: reuse.from_run.clone(), step: reuse.step }),
        });
        if request.plan.is_none() && !reuse.outputs.is_empty() {
            let message = "a re-run needs the plan it re-runs".to_owned();
            let error = RunError { kind: RunErrorKind::InvalidPlan, message };
            return ctx.finish(RunStatus::Failed, None, Some(error), started, &[], &[]);
        }

        let (round, plan) = match request.plan {
            Some(plan) => {
                // A re-run may keep the output of a step the conductor ran, even when there is
                // no conductor (or no recursion) now; only steps that run need one.
                let conductor = self.workers.len();
                let conductor_kept =
                    plan.steps.iter().any(|s| s.model_id == conductor) && !reuse.runs_worker(&plan, conductor);
                let limits = Limits {
                    max_steps: self.options.max_steps,
                    pool_size: Some(self.plan_pool_size().max(conductor + usize::from(conductor_kept))),
                    allow_stop: false,
                };
                if let Err(message) =
                    plan.validate(&limits).map_err(|e| e.to_string()).and_then(|()| reuse.check(&plan))
                {
                    let error = RunError { kind: RunErrorKind::InvalidPlan, message };
                    return ctx.finish(RunStatus::Failed, None, Some(error), started, &[], &[]);
                }
                let round = ctx.rounds.fetch_add(1, Ordering::SeqCst);
                ctx.emit(RunEvent::PlanReady {
                    round,
                    depth: 0,
                    parent: None,
                    plan: plan.clone(),
                    raw: None,
                    usage: None,
                    stop_reason: None,
                    prompt: None,
                    fallback: None,
                });
                (round, plan)
            }
            None => match self.write_plan(&ctx, 0, None, Vec::new()).await {
                Ok(written) => (written.round, written.plan),
                Err(StepFailure::Stopped) => return ctx.finish_stopped(started),
                Err(failure) => {
                    let kind = match failure {
                        StepFailure::Budget(_) => RunErrorKind::BudgetExceeded,
                        _ => RunErrorKind::Conductor,
                    };
                    let error = RunError { kind, message: failure.message() };
                    return ctx.finish(RunStatus::Failed, None, Some(error), started, &[], &[]);
                }
            },
        };
        let cap = self.options.recursion.max_total_steps.unwrap_or(2 * plan.steps.len());
        ctx.step_cap.store(cap, Ordering::SeqCst);

        let outcome = self.run_plan(&ctx, round, 0, plan, Vec::new(), Some(&reuse)).await;
        match outcome.result {
            Ok(answer) => {
                ctx.finish(RunStatus::Finished, Some(answer), None, started, &outcome.finished, &outcome.failed)
            }
            Err(RoundError::Stopped) => ctx.finish_stopped_with(started, &outcome.finished, &outcome.failed),
            Err(RoundError::Failed(message)) => {
                let error = RunError { kind: RunErrorKind::StepFailed, message };
                ctx.finish(RunStatus::Failed, None, Some(error), started, &outcome.finished, &outcome.failed)
            }
        }
    }

    /// Asks the conductor for a plan; emits the round's plan events. Returns the round number.
    ///
    /// For the question's plan (depth 0), with the fallback on: a plan that fails, loops,
    /// copies an example or keeps the question from the workers is asked for once more (the
    /// conductor writes the second attempt differently), and if that one is no better, or the
    /// run's caps leave no room for it, the question goes to one worker alone (see
    /// [`crate::fallback`]). Each rejected attempt is reported with
    /// `PlanRejected`; the plan that runs instead says why in `PlanReady::fallback`.
    async fn write_plan(
        &self,
        ctx: &RunCtx<'_>,
        depth: u32,
        parent: Option<StepRef>,
        work: Vec<Message>,
    ) -> Result<Written, StepFailure> {
        let Some(planner) = &self.planner else {
            return Err(StepFailure::Conductor("no conductor is configured to write a plan".into()));
        };
        let round = ctx.rounds.fetch_add(1, Ordering::SeqCst);
        ctx.emit(RunEvent::PlanStarted { round, depth, parent });
        let recursive_round = parent.is_some();
        let remaining = ctx.step_cap.load(Ordering::SeqCst).saturating_sub(ctx.steps_started.load(Ordering::SeqCst));
        let max_steps = if recursive_round { self.options.max_steps.min(remaining) } else { self.options.max_steps };
        let mut context = PlanningContext {
            question: ctx.question.clone(),
            history: ctx.history.clone(),
            instructions: ctx.instructions.clone(),
            lead: crate::fallback::fallback_worker(&self.options.fallback, self.workers.len(), &ctx.question).0,
            work,
            depth,
            allow_self: self.recursive() && depth < self.options.recursion.max_depth,
            allow_stop: recursive_round,
            max_steps,
            pool_size: self.workers.len(),
            attempt: 0,
        };
        let limits = Limits {
            max_steps,
            pool_size: Some(self.workers.len() + usize::from(context.allow_self)),
            allow_stop: recursive_round,
        };
        let checked = depth == 0 && self.options.fallback.enabled;
        let mut spent = (Usage::default(), Some(0.0));
        let mut reasons: Vec<String> = Vec::new();
        // Every example shown in this round's attempts: a second attempt that names what only
        // the first one's examples had is no more about the question than the first.
        let mut shown: Vec<crate::ShownExample> = Vec::new();
        loop {
            let events = ctx.events;
            let deltas = Box::new(move |text: &str| {
                let _ = events.send(RunEvent::PlanDelta { round, text: text.to_owned() });
            });
            let meter = Meter { ledger: &ctx.ledger, stop: &ctx.stop };
            let planned = tokio::select! {
                biased;
                () = ctx.stop.cancelled() => return Err(StepFailure::Stopped),
                planned = planner.plan(context.clone(), deltas, meter) => planned,
            };
            // Why this attempt cannot run. A budget refusal of the first attempt is final; of a
            // second one, it leaves the fallback, which costs one worker's call, to answer.
            let timed_out = matches!(&planned, Err(e) if e.timed_out);
            let (problem, raw, prompt) = match planned {
                Err(e) if e.budget && context.attempt > 0 => {
                    reasons.push(format!("a second plan did not fit under the run's caps: {}", e.message));
                    break;
                }
                Err(e) if e.budget => return Err(StepFailure::Budget(e.message)),
                Err(e) => {
                    if !checked {
                        return Err(StepFailure::Conductor(format!("the conductor failed: {}", e.message)));
                    }
                    (format!("the conductor failed: {}", e.message), None, None)
                }
                Ok(planned) => {
                    spent.0 += planned.usage;
                    spent.1 = spent.1.zip(planned.cost_usd).map(|(a, b)| a + b);
                    shown.extend(planned.examples.iter().cloned());
                    // The conductor should only produce valid plans; check anyway, against this round.
                    let problem = match planned.plan.validate(&limits) {
                        Err(e) => Some(format!("the conductor's plan is not usable: {e}")),
                        Ok(()) if checked => {
                            let pool_gives_it = self.options.show_question || self.options.question_to_answer_step;
                            crate::fallback::check(&planned.plan, &shown, &ctx.question, pool_gives_it)
                                .map(|u| u.to_string())
                        }
                        Ok(()) => None,
                    };
                    match problem {
                        None => {
                            ctx.emit(RunEvent::PlanReady {
                                round,
                                depth,
                                parent,
                                plan: planned.plan.clone(),
                                raw: Some(planned.raw),
                                usage: Some(spent.0),
                                stop_reason: planned.stop_reason,
                                prompt: planned.prompt,
                                fallback: None,
                            });
                            return Ok(Written { round, plan: planned.plan, usage: spent.0, cost_usd: spent.1 });
                        }
                        Some(p) if !checked => return Err(StepFailure::Conductor(p)),
                        Some(p) => (p, Some(planned.raw), planned.prompt),
                    }
                }
            };
            // Only a time limit is not worth a second attempt: it would take as long again.
            let again = context.attempt == 0 && !timed_out;
            ctx.emit(RunEvent::PlanRejected { round, reason: problem.clone(), raw, prompt, retry: again });
            reasons.push(problem);
            if again {
                context.attempt += 1;
                continue;
            }
            break;
        }
        let (worker, why) = crate::fallback::fallback_worker(&self.options.fallback, self.workers.len(), &ctx.question);
        let plan = crate::fallback::alone_plan(worker, &ctx.history, &ctx.question);
        let reason = format!(
            "{}; the question went to {} alone{}",
            reasons.join("; then "),
            self.workers.get(worker).map_or("the first worker", |w| w.info.name.as_str()),
            why.map(|w| format!(" ({w})")).unwrap_or_default()
        );
        ctx.emit(RunEvent::PlanReady {
            round,
            depth,
            parent,
            plan: plan.clone(),
            raw: None,
            usage: Some(spent.0),
            stop_reason: None,
            prompt: None,
            fallback: Some(reason),
        });
        Ok(Written { round, plan, usage: spent.0, cost_usd: spent.1 })
    }

    /// Runs one round's plan. `prefix` is context every step of the round sees first (the work
    /// handed to a recursive round); steps with an output in `reuse` keep it and are not run.
    fn run_plan<'a>(
        &'a self,
        ctx: &'a RunCtx<'a>,
        round: u32,
        depth: u32,
        plan: Plan,
        prefix: Vec<Message>,
        reuse: Option<&'a Reuse>,
    ) -> BoxFuture<'a, RoundOutcome> {
        Box::pin(async move {
            let n = plan.steps.len();
            let deps = plan.dependencies();
            let mut states: Vec<State> = vec![State::Waiting; n];
            let mut running: FuturesUnordered<BoxFuture<'a, (usize, Result<StepDone, StepFailure>)>> =
                FuturesUnordered::new();
            let mut stopping = false;

            loop {
                if !stopping {
                    // Fail what can no longer run; start what is ready. Steps only see earlier
                    // steps, so one pass in order settles everything.
                    for i in 0..n {
                        if states[i] != State::Waiting {
                            continue;
                        }
                        if let Some(&j) = deps[i].iter().find(|&&j| matches!(states[j], State::Failed)) {
                            states[i] = State::Failed;
                            ctx.step_failed(
                                round,
                                i,
                                StepErrorKind::DependencyFailed,
                                format!("step {j}, which this step sees, failed"),
                                None,
                            );
                            continue;
                        }
                        if !deps[i].iter().all(|&j| matches!(states[j], State::Done(_))) {
                            continue;
                        }
                        if let Some(reuse) = reuse
                            && let Some(output) = reuse.outputs.get(&i)
                        {
                            ctx.emit(RunEvent::StepReused {
                                round,
                                step: i,
                                worker: plan.steps[i].model_id,
                                output: output.clone(),
                                from_run: reuse.from_run.clone(),
                            });
                            states[i] = State::Done(output.clone());
                            continue;
                        }
                        if ctx.steps_started.fetch_add(1, Ordering::SeqCst) >= ctx.step_cap.load(Ordering::SeqCst) {
                            states[i] = State::Failed;
                            let cap = ctx.step_cap.load(Ordering::SeqCst);
                            ctx.step_failed(
                                round,
                                i,
                                StepErrorKind::RecursionLimit,
                                format!("the run's cap of {cap} steps is used up"),
                                None,
                            );
                            continue;
                        }
                        let mut messages = prefix.clone();
                        for &j in &deps[i] {
                            let State::Done(output) = &states[j] else { continue };
                            messages.push(Message::user(plan.steps[j].subtask.clone()));
                            messages.push(Message::assistant(output.clone()));
                        }
                        let answers = i + 1 == n;
                        let worker = plan.steps[i].model_id;
                        let subtask = &plan.steps[i].subtask;
                        let replies = answers && depth == 0 && worker < self.workers.len();
                        // The step that replies is asked the question itself, its subtask
                        // being its part, so a narrowed subtask cannot drop what was asked.
                        let asked = replies
                            && self.options.question_to_answer_step
                            && !crate::fallback::holds_question(subtask, &ctx.question);
                        let system = worker_system(self.options.show_question, asked.then_some(subtask.as_str()), ctx);
                        messages.push(Message::user(if asked {
                            crate::fallback::alone_subtask(&ctx.history, &ctx.question)
                        } else {
                            subtask.clone()
                        }));
                        states[i] = State::Running;
                        if worker == self.workers.len() {
                            running.push(Box::pin(self.run_recursive_step(ctx, round, i, depth, messages)));
                        } else {
                            let at = StepRef { round, step: i };
                            running.push(Box::pin(self.run_step(ctx, at, worker, system, messages, answers)));
                        }
                    }
                }
                let Some((i, result)) = running.next().await else { break };
                match result {
                    Ok(done) => {
                        ctx.emit(RunEvent::StepFinished {
                            round,
                            step: i,
                            output: done.output.clone(),
                            usage: done.usage,
                            cost_usd: done.cost_usd,
                            latency_ms: done.latency.as_millis() as u64,
                            retries: done.retries,
                        });
                        states[i] = State::Done(done.output);
                    }
                    Err(failure) => {
                        states[i] = State::Failed;
                        let (kind, status) = match &failure {
                            StepFailure::Provider(e) => (e.kind.into(), e.status),
                            StepFailure::Stopped => (StepErrorKind::Cancelled, None),
                            StepFailure::Budget(_) => (StepErrorKind::Budget, None),
                            StepFailure::Conductor(_) => (StepErrorKind::Conductor, None),
                            StepFailure::RecursionLimit(_) => (StepErrorKind::RecursionLimit, None),
                        };
                        let message = match &failure {
                            StepFailure::Stopped => ctx.stop_message(),
                            other => other.message(),
                        };
                        if let StepFailure::Budget(message) = &failure {
                            ctx.exhaust(RunError { kind: RunErrorKind::BudgetExceeded, message: message.clone() });
                        }
                        ctx.step_failed(round, i, kind, message, status);
                    }
                }
                // Once stopping, no new step starts. On a cancel, the steps in flight notice the
                // stop token and finish promptly with their own StepFailed; once the budget is
                // used up, calls in flight (which fit when they were made, and which providers
                // bill whether or not their answer is read) finish, and nothing new starts.
                stopping |= ctx.stop.is_cancelled() || ctx.is_exhausted();
            }

            let finished =
                states.iter().enumerate().filter(|(_, s)| matches!(s, State::Done(_))).map(|(i, _)| i).collect();
            let failed = states.iter().enumerate().filter(|(_, s)| **s == State::Failed).map(|(i, _)| i).collect();
            let result = if stopping || ctx.stop.is_cancelled() {
                Err(RoundError::Stopped)
            } else {
                match states.last() {
                    Some(State::Done(answer)) => Ok(answer.clone()),
                    _ => {
                        let last = n.saturating_sub(1);
                        let worker = plan.steps.get(last).map_or(0, |s| s.model_id);
                        let name = self.workers.get(worker).map_or("the conductor", |w| w.info.name.as_str());
                        Err(RoundError::Failed(format!(
                            "the last step (step {last}, worker \"{name}\") failed; failed steps: {failed:?}"
                        )))
                    }
                }
            };
            RoundOutcome { result, finished, failed }
        })
    }

    /// A step given to a worker: wait for a slot at its endpoint, then call with retries.
    async fn run_step(
        &self,
        ctx: &RunCtx<'_>,
        at: StepRef,
        worker_index: usize,
        system: Option<String>,
        messages: Vec<Message>,
        answers: bool,
    ) -> (usize, Result<StepDone, StepFailure>) {
        let StepRef { round, step } = at;
        let worker = &self.workers[worker_index];
        let permit = match self.limits.get(&worker.endpoint) {
            Some(limit) => tokio::select! {
                biased;
                () = ctx.stop.cancelled() => return (step, Err(StepFailure::Stopped)),
                permit = limit.clone().acquire_owned() => permit.ok(),
            },
            None => None,
        };
        let _permit = permit;
        ctx.emit(RunEvent::StepStarted {
            round,
            step,
            worker: worker_index,
            system: system.clone(),
            messages: messages.clone(),
        });
        let started = Instant::now();
        let mut request = ChatRequest { system, messages, ..ChatRequest::default() };
        let mut output_cap = worker.output_cap;
        if answers {
            let a = ctx.answer;
            request.max_tokens = a.max_tokens.map(|m| m.min(worker.output_cap));
            output_cap = request.max_tokens.unwrap_or(output_cap);
            (request.temperature, request.top_p) = (a.temperature, a.top_p);
        }
        // The same for every attempt: the messages do not change between retries. A model that
        // counts its input exactly (a local one) is reserved for that, not for its bytes.
        let worst = match worker.model.input_tokens(&request).await {
            Some(input) => WorstCase::of_size(input, u64::from(output_cap), &worker.pricing),
            None => WorstCase::of(request.system.as_deref(), &request.messages, output_cap, &worker.pricing),
        };
        // Every attempt's usage, failed ones included: the step's figures are what it cost.
        let mut spent = Usage::default();
        let mut cost = Some(0.0);
        let mut retries = 0;
        loop {
            let reservation = match ctx.ledger.reserve(Caller::Worker, &worker.info.name, worst, &ctx.stop).await {
                Ok(reservation) => reservation,
                Err(Refused::Stopped) => return (step, Err(StepFailure::Stopped)),
                Err(Refused::Exceeded(e)) => return (step, Err(StepFailure::Budget(e.message))),
            };
            // What the provider reported before the call ended; a call cut short by the
            // timeout below or by a stop still counts it.
            let reported = Mutex::new(Usage::default());
            let received = AtomicUsize::new(0);
            let attempt = tokio::time::timeout(
                worker.timeout,
                attempt(worker.model.as_ref(), request.clone(), round, step, ctx.events, &reported, &received),
            );
            // A call that ends without its usage is billed for what it read and sent.
            let cut = |usage: Usage| {
                usage.estimate_cut_call(received.load(Ordering::SeqCst) as u64, worst.input_tokens, worst.output_tokens)
            };
            let result = tokio::select! {
                biased;
                () = ctx.stop.cancelled() => {
                    let usage = cut(*reported.lock().unwrap_or_else(|p| p.into_inner()));
                    reservation.settle(usage, worker.pricing.cost(&usage));
                    return (step, Err(StepFailure::Stopped));
                }
                result = attempt => result.unwrap_or_else(|_| {
                    Err(ProviderError::new(
                        ErrorKind::Timeout,
                        format!("no complete answer within {} s", worker.timeout.as_secs_f64()),
                    ))
                }),
            };
            let usage = match &result {
                Ok((_, usage)) => *usage,
                // Our own timeout dropped the call: what had been reported by then.
                Err(error) => cut(error.usage.unwrap_or_else(|| *reported.lock().unwrap_or_else(|p| p.into_inner()))),
            };
            let call_cost = worker.pricing.cost(&usage);
            reservation.settle(usage, call_cost);
            spent += usage;
            cost = cost.zip(call_cost).map(|(a, b)| a + b);
            match result {
                Ok((output, _)) => {
                    let latency = started.elapsed();
                    return (step, Ok(StepDone { output, usage: spent, cost_usd: cost, latency, retries }));
                }
                Err(error) => {
                    retries += 1;
                    let Some(delay) = self.options.retry.delay(retries, &error) else {
                        return (step, Err(StepFailure::Provider(error)));
                    };
                    ctx.emit(RunEvent::StepRetrying {
                        round,
                        step,
                        attempt: retries,
                        error: StepError { kind: error.kind.into(), message: error.message, status: error.status },
                        delay_ms: delay.as_millis() as u64,
                    });
                    tokio::select! {
                        biased;
                        () = ctx.stop.cancelled() => return (step, Err(StepFailure::Stopped)),
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }

    /// A step given to the conductor itself: it sees the step's work and writes a new round,
    /// whose answer becomes this step's output, or stops, keeping the latest answer it saw.
    async fn run_recursive_step(
        &self,
        ctx: &RunCtx<'_>,
        round: u32,
        step: usize,
        depth: u32,
        messages: Vec<Message>,
    ) -> (usize, Result<StepDone, StepFailure>) {
        ctx.emit(RunEvent::StepStarted {
            round,
            step,
            worker: self.workers.len(),
            system: None,
            messages: messages.clone(),
        });
        let started = Instant::now();
        if depth >= self.options.recursion.max_depth {
            let cap = self.options.recursion.max_depth;
            return (step, Err(StepFailure::RecursionLimit(format!("the recursion depth cap ({cap}) is reached"))));
        }
        // The step's own instruction was for the conductor; the work before it is what the
        // conductor and the next round's workers see.
        let work: Vec<Message> = messages[..messages.len().saturating_sub(1)].to_vec();
        let parent = Some(StepRef { round, step });
        let Written { round: inner_round, plan, usage, cost_usd } =
            match self.write_plan(ctx, depth + 1, parent, messages.clone()).await {
                Ok(written) => written,
                Err(failure) => return (step, Err(failure)),
            };
        let output = if plan.is_stop() {
            match work.iter().rev().find(|m| m.role == Role::Assistant) {
                Some(latest) => latest.content.clone(),
                None => {
                    return (
                        step,
                        Err(StepFailure::Conductor("the conductor stopped with no earlier answer to keep".into())),
                    );
                }
            }
        } else {
            match self.run_plan(ctx, inner_round, depth + 1, plan, work, None).await.result {
                Ok(answer) => answer,
                Err(RoundError::Stopped) => return (step, Err(StepFailure::Stopped)),
                Err(RoundError::Failed(message)) => {
                    return (step, Err(StepFailure::Conductor(format!("round {inner_round} failed: {message}"))));
                }
            }
        };
        // The step's own figures are the conductor's call that wrote its round; the round's
        // steps report theirs.
        let done = StepDone { output, usage, cost_usd, latency: started.elapsed(), retries: 0 };
        (step, Ok(done))
    }
}

/// One call: stream the answer, forwarding text as it comes.
async fn attempt(
    model: &dyn ChatModel,
    request: ChatRequest,
    round: u32,
    step: usize,
    events: &EventSink,
    reported: &Mutex<Usage>,
    received: &AtomicUsize,
) -> Result<(String, Usage), ProviderError> {
    let mut forward = |text: &str| {
        received.fetch_add(text.len(), Ordering::SeqCst);
        let _ = events.send(RunEvent::StepDelta { round, step, text: text.to_owned() });
    };
    let answer = baton_providers::read_answer(model, request, &mut forward, reported).await?;
    // An empty answer would reach dependent steps as an empty assistant turn, which providers
    // reject; say why here instead.
    if answer.text.trim().is_empty() {
        let stop = answer.stop_reason.unwrap_or_else(|| "none given".to_owned());
        return Err(ProviderError::new(
            ErrorKind::EmptyAnswer,
            format!(
                "the model finished without any text (stop reason: {stop}); if it ran out of tokens, raise max_tokens or lower thinking_budget"
            ),
        )
        .with_usage(Some(answer.usage)));
    }
    Ok((answer.text, answer.usage))
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
    exhausted: std::sync::atomic::AtomicBool,
    rounds: AtomicU32,
    steps_started: AtomicUsize,
    /// Steps allowed in the whole run, recursive rounds included.
    step_cap: AtomicUsize,
    question: String,
    history: Vec<Message>,
    instructions: Option<String>,
    answer: AnswerSettings,
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

#[derive(Debug, Clone, PartialEq)]
enum State {
    Waiting,
    Running,
    Done(String),
    Failed,
}

struct StepDone {
    output: String,
    usage: Usage,
    cost_usd: Option<f64>,
    latency: Duration,
    retries: u32,
}

enum StepFailure {
    Provider(ProviderError),
    /// A budget cap was reached before a call; the message says which.
    Budget(String),
    /// The run is stopping (cancelled, or another step hit a cap).
    Stopped,
    /// The conductor could not write a usable plan.
    Conductor(String),
    RecursionLimit(String),
}

impl StepFailure {
    fn message(&self) -> String {
        match self {
            StepFailure::Provider(e) => e.message.clone(),
            StepFailure::Budget(m) | StepFailure::Conductor(m) | StepFailure::RecursionLimit(m) => m.clone(),
            StepFailure::Stopped => "the run stopped".to_owned(),
        }
    }
}

/// A plan the conductor wrote, and what writing it cost.
struct Written {
    round: u32,
    plan: Plan,
    usage: Usage,
    cost_usd: Option<f64>,
}

enum RoundError {
    Stopped,
    Failed(String),
}

struct RoundOutcome {
    result: Result<String, RoundError>,
    finished: Vec<usize>,
    failed: Vec<usize>,
}

/// A fresh run id: time-ordered, unique enough for one user's history.
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

pub fn new_run_id() -> String {
    let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
    format!("{ms:012x}{:06x}", fastrand::u32(..) & 0xff_ffff)
}

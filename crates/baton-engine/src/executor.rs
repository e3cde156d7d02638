//! Runs a plan over the pool.
//!
//! The access lists form a DAG; a step starts as soon as every step it sees has finished, so
//! independent steps run at the same time (bounded per provider endpoint). A step that fails
//! after its retries fails the steps that depend on it; the others still finish. The last step's
//! output is the answer. Progress leaves only as [`RunEvent`]s.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_plan::{Limits, Plan};
use baton_providers::{
    ChatEvent, ChatModel, ChatRequest, ErrorKind, HttpModel, KeySource, Message, ProviderError, Usage,
};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

use crate::event::{RunError, RunErrorKind, RunEvent, StepError, StepErrorKind, Totals};
use crate::keys;
use crate::pool::{Budget, Pool, PoolOptions, WorkerInfo, WorkerSpec};
use crate::pricing::Price;

/// Where a run's events go. Unbounded so a slow consumer never stalls the run.
pub type EventSink = mpsc::UnboundedSender<RunEvent>;

/// A pool member ready to be called.
pub struct Worker {
    pub info: WorkerInfo,
    pub model: Arc<dyn ChatModel>,
    pub price: Option<Price>,
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

#[derive(Debug)]
pub struct Executor {
    workers: Vec<Worker>,
    options: PoolOptions,
    limits: HashMap<String, Arc<Semaphore>>,
}

/// What to run.
#[derive(Debug, Clone)]
pub struct RunRequest {
    pub run_id: String,
    pub question: String,
    pub plan: Plan,
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
        Executor { workers, options, limits }
    }

    /// Workers over HTTP for every pool entry, with keys from the environment variables the
    /// pool names.
    pub fn from_pool(pool: &Pool) -> Self {
        Self::from_pool_with_keys(pool, keys::key_source)
    }

    /// Like [`Executor::from_pool`], with each worker's key source chosen by `keys`.
    pub fn from_pool_with_keys(pool: &Pool, keys: impl Fn(&WorkerSpec) -> KeySource) -> Self {
        let http = HttpModel::http_client();
        let infos = pool.infos();
        let workers = pool
            .workers
            .iter()
            .zip(infos)
            .map(|(spec, info)| {
                let base_url = spec.effective_base_url().to_owned();
                let model = HttpModel::new(spec.provider, &base_url, spec.settings(), keys(spec), http.clone());
                Worker {
                    info,
                    model: Arc::new(model),
                    price: spec.price(),
                    timeout: spec.timeout,
                    endpoint: format!("{} {base_url}", spec.provider),
                }
            })
            .collect();
        Executor::new(workers, pool.options.clone())
    }

    pub fn workers(&self) -> &[Worker] {
        &self.workers
    }

    pub fn options(&self) -> &PoolOptions {
        &self.options
    }

    /// Runs `request.plan`, sending every event to `events`. Cancelling `cancel` stops all calls
    /// in flight (their connections are closed) and ends the run with `RunCancelled`.
    pub async fn run(&self, request: RunRequest, events: &EventSink, cancel: &CancellationToken) -> RunOutcome {
        let started = Instant::now();
        let emit = |event: RunEvent| {
            // A consumer that went away must not stop the run.
            let _ = events.send(event);
        };
        emit(RunEvent::RunStarted {
            run_id: request.run_id.clone(),
            question: request.question.clone(),
            workers: self.workers.iter().map(|w| w.info.clone()).collect(),
        });

        let ledger = Ledger::new(self.options.budget);
        let finish = |status: RunStatus, answer: Option<String>, error: Option<RunError>, totals: Totals| {
            let event = match (status, &answer, &error) {
                (RunStatus::Finished, Some(a), _) => {
                    RunEvent::RunFinished { answer: a.clone(), totals: totals.clone() }
                }
                (RunStatus::Cancelled, _, _) => RunEvent::RunCancelled { totals: totals.clone() },
                (_, _, e) => RunEvent::RunFailed {
                    error: e
                        .clone()
                        .unwrap_or(RunError { kind: RunErrorKind::StepFailed, message: "the run failed".into() }),
                    totals: totals.clone(),
                },
            };
            emit(event);
            RunOutcome { status, answer, error, totals }
        };

        let plan = request.plan;
        let limits =
            Limits { max_steps: self.options.max_steps, pool_size: Some(self.workers.len()), allow_stop: false };
        if let Err(e) = plan.validate(&limits) {
            let error = RunError { kind: RunErrorKind::InvalidPlan, message: e.to_string() };
            return finish(RunStatus::Failed, None, Some(error), ledger.totals(started, &[]));
        }
        emit(RunEvent::PlanReady { plan: plan.clone() });

        let n = plan.steps.len();
        let deps = plan.dependencies();
        let mut states: Vec<State> = vec![State::Waiting; n];
        let mut running = FuturesUnordered::new();
        let mut stop: Option<(RunStatus, Option<RunError>)> = None;

        loop {
            // Fail what can no longer run; start what is ready. Steps only see earlier steps, so
            // one pass in order settles everything.
            for i in 0..n {
                if states[i] != State::Waiting {
                    continue;
                }
                if let Some(&j) = deps[i].iter().find(|&&j| matches!(states[j], State::Failed)) {
                    states[i] = State::Failed;
                    emit(RunEvent::StepFailed {
                        step: i,
                        error: StepError {
                            kind: StepErrorKind::DependencyFailed,
                            message: format!("step {j}, which this step sees, failed"),
                            status: None,
                        },
                    });
                    continue;
                }
                if deps[i].iter().all(|&j| matches!(states[j], State::Done(_))) {
                    let mut messages = Vec::with_capacity(deps[i].len() * 2 + 1);
                    for &j in &deps[i] {
                        let State::Done(output) = &states[j] else { continue };
                        messages.push(Message::user(plan.steps[j].subtask.clone()));
                        messages.push(Message::assistant(output.clone()));
                    }
                    messages.push(Message::user(plan.steps[i].subtask.clone()));
                    let system = self.options.show_question.then(|| {
                        format!(
                            "You are one step of a larger workflow. The user's original question:\n\n{}",
                            request.question
                        )
                    });
                    states[i] = State::Running;
                    running.push(self.run_step(i, plan.steps[i].model_id, system, messages, events, &ledger));
                }
            }
            if running.is_empty() {
                break;
            }
            tokio::select! {
                biased;
                () = cancel.cancelled() => {
                    stop = Some((RunStatus::Cancelled, None));
                    break;
                }
                Some((i, result)) = running.next() => match result {
                    Ok(done) => {
                        emit(RunEvent::StepFinished {
                            step: i,
                            output: done.output.clone(),
                            usage: done.usage,
                            cost_usd: done.cost_usd,
                            latency_ms: done.latency.as_millis() as u64,
                            retries: done.retries,
                        });
                        states[i] = State::Done(done.output);
                    }
                    Err(StepFailure::Provider(e)) => {
                        states[i] = State::Failed;
                        emit(RunEvent::StepFailed {
                            step: i,
                            error: StepError { kind: e.kind.into(), message: e.message, status: e.status },
                        });
                    }
                    Err(StepFailure::Budget(message)) => {
                        states[i] = State::Failed;
                        emit(RunEvent::StepFailed {
                            step: i,
                            error: StepError { kind: StepErrorKind::Cancelled, message: message.clone(), status: None },
                        });
                        stop = Some((RunStatus::Failed, Some(RunError { kind: RunErrorKind::BudgetExceeded, message })));
                        break;
                    }
                },
            }
        }
        // Dropping the futures closes their connections.
        drop(running);

        if let Some((status, error)) = stop {
            let why = match status {
                RunStatus::Cancelled => "the run was cancelled".to_owned(),
                _ => format!("the run stopped: {}", error.as_ref().map_or("", |e| e.message.as_str())),
            };
            for (i, state) in states.iter_mut().enumerate() {
                if *state == State::Running {
                    *state = State::Failed;
                    emit(RunEvent::StepFailed {
                        step: i,
                        error: StepError { kind: StepErrorKind::Cancelled, message: why.clone(), status: None },
                    });
                }
            }
            return finish(status, None, error, ledger.totals(started, &states));
        }

        let totals = ledger.totals(started, &states);
        match &states[n - 1] {
            State::Done(answer) => finish(RunStatus::Finished, Some(answer.clone()), None, totals),
            _ => {
                let worker = &self.workers[plan.steps[n - 1].model_id].info.name;
                let error = RunError {
                    kind: RunErrorKind::StepFailed,
                    message: format!(
                        "the last step (step {}, worker \"{worker}\") failed; failed steps: {:?}",
                        n - 1,
                        totals.steps_failed
                    ),
                };
                finish(RunStatus::Failed, None, Some(error), totals)
            }
        }
    }

    /// One step: wait for a slot at the worker's endpoint, then call with retries.
    async fn run_step(
        &self,
        step: usize,
        worker_index: usize,
        system: Option<String>,
        messages: Vec<Message>,
        events: &EventSink,
        ledger: &Ledger,
    ) -> (usize, Result<StepDone, StepFailure>) {
        let worker = &self.workers[worker_index];
        let _permit = match self.limits.get(&worker.endpoint) {
            Some(limit) => limit.clone().acquire_owned().await.ok(),
            None => None,
        };
        let _ = events.send(RunEvent::StepStarted {
            step,
            worker: worker_index,
            system: system.clone(),
            messages: messages.clone(),
        });
        let started = Instant::now();
        let request = ChatRequest { system, messages, max_tokens: None };
        let mut retries = 0;
        loop {
            if let Err(message) = ledger.begin_call() {
                return (step, Err(StepFailure::Budget(message)));
            }
            let attempt =
                tokio::time::timeout(worker.timeout, attempt(worker.model.as_ref(), request.clone(), step, events));
            let result = attempt.await.unwrap_or_else(|_| {
                Err(ProviderError::new(
                    ErrorKind::Timeout,
                    format!("no complete answer within {} s", worker.timeout.as_secs_f64()),
                ))
            });
            match result {
                Ok((output, usage)) => {
                    let cost_usd = worker.price.map(|p| p.cost(&usage));
                    ledger.record(usage, cost_usd);
                    let latency = started.elapsed();
                    return (step, Ok(StepDone { output, usage, cost_usd, latency, retries }));
                }
                Err(error) => {
                    retries += 1;
                    match self.options.retry.delay(retries, &error) {
                        Some(delay) => {
                            let _ = events.send(RunEvent::StepRetrying {
                                step,
                                attempt: retries,
                                error: StepError {
                                    kind: error.kind.into(),
                                    message: error.message,
                                    status: error.status,
                                },
                                delay_ms: delay.as_millis() as u64,
                            });
                            tokio::time::sleep(delay).await;
                        }
                        None => return (step, Err(StepFailure::Provider(error))),
                    }
                }
            }
        }
    }
}

/// One call: stream the answer, forwarding text as it comes.
async fn attempt(
    model: &dyn ChatModel,
    request: ChatRequest,
    step: usize,
    events: &EventSink,
) -> Result<(String, Usage), ProviderError> {
    let mut stream = model.stream(request).await?;
    let mut output = String::new();
    while let Some(item) = stream.next().await {
        match item? {
            ChatEvent::Text(text) => {
                output.push_str(&text);
                let _ = events.send(RunEvent::StepDelta { step, text });
            }
            ChatEvent::Done { usage, stop_reason } => {
                // An empty answer would reach dependent steps as an empty assistant turn, which
                // providers reject; say why here instead.
                if output.trim().is_empty() {
                    let stop = stop_reason.unwrap_or_else(|| "none given".to_owned());
                    return Err(ProviderError::new(
                        ErrorKind::EmptyAnswer,
                        format!(
                            "the model finished without any text (stop reason: {stop}); if it ran out of tokens, raise max_tokens or lower thinking_budget"
                        ),
                    ));
                }
                return Ok((output, usage));
            }
        }
    }
    Err(ProviderError::new(ErrorKind::Network, "the answer stream ended without completing"))
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
}

/// Counts calls, tokens and cost against the run's budget.
struct Ledger {
    budget: Budget,
    inner: Mutex<LedgerInner>,
}

#[derive(Default)]
struct LedgerInner {
    calls: u32,
    usage: Usage,
    cost: f64,
    unknown_cost: bool,
}

impl Ledger {
    fn new(budget: Budget) -> Self {
        Ledger { budget, inner: Mutex::default() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LedgerInner> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Checks every cap, then counts a call.
    fn begin_call(&self) -> Result<(), String> {
        let mut l = self.lock();
        if let Some(max) = self.budget.max_calls
            && l.calls >= max
        {
            return Err(format!("budget cap reached: {} of at most {max} calls made", l.calls));
        }
        if let Some(max) = self.budget.max_tokens
            && l.usage.total() >= max
        {
            return Err(format!("budget cap reached: {} of at most {max} tokens used", l.usage.total()));
        }
        if let Some(max) = self.budget.max_cost_usd
            && l.cost >= max
        {
            return Err(format!("budget cap reached: ${:.4} of at most ${max:.4} spent", l.cost));
        }
        l.calls += 1;
        Ok(())
    }

    fn record(&self, usage: Usage, cost: Option<f64>) {
        let mut l = self.lock();
        l.usage += usage;
        match cost {
            Some(c) => l.cost += c,
            None => l.unknown_cost = true,
        }
    }

    fn totals(&self, started: Instant, states: &[State]) -> Totals {
        let l = self.lock();
        Totals {
            calls: l.calls,
            usage: l.usage,
            cost_usd: l.cost,
            cost_complete: !l.unknown_cost,
            wall_ms: started.elapsed().as_millis() as u64,
            steps_finished: states
                .iter()
                .enumerate()
                .filter(|(_, s)| matches!(s, State::Done(_)))
                .map(|(i, _)| i)
                .collect(),
            steps_failed: states.iter().enumerate().filter(|(_, s)| **s == State::Failed).map(|(i, _)| i).collect(),
        }
    }
}

/// A fresh run id: time-ordered, unique enough for one user's history.
pub fn new_run_id() -> String {
    let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
    format!("{ms:012x}{:06x}", fastrand::u32(..) & 0xff_ffff)
}

//! The request handling both wire formats share (`chat`, `responses`): a request's body read
//! and its run admitted, the conversation it continues, the run started on its own task (which
//! records it in the history and relays its events), what the client is shown of the run as it
//! goes, and the two ways of answering: waiting for the run's end, or streaming its events, which
//! stops the run when the client goes away. Each format only puts these in its own shapes.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::body::Body;
use axum::http::{HeaderValue, header};
use axum::response::Response;
use baton_engine::progress::StepStatus;
use baton_engine::{RunErrorKind, RunEvent, RunProgress, RunRequest, StepErrorKind, Totals, new_run_id};
use baton_providers::Role;
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tokio_util::sync::CancellationToken;

use crate::request::Call;
use crate::{ApiError, Service};

/// A request's body, up to the server's limit (413 above it).
pub(crate) async fn read_body(service: &Service, body: Body) -> Result<axum::body::Bytes, ApiError> {
    axum::body::to_bytes(body, service.options.max_body_bytes).await.map_err(|_| {
        ApiError::too_large(format!(
            "the request is over this server's limit of {} bytes",
            service.options.max_body_bytes
        ))
    })
}

/// The middleware that bounds the bodies a server holds: each request's body counts against
/// [`crate::MAX_QUEUED_BYTES`] from before it is read until its handler has answered (a run
/// that streams: once it has its slot; one that does not: once its answer is whole), so bodies
/// being read and bodies waiting for a run slot share the bound. A body counts its declared
/// length, or the server's limit for one sent without a length. Past the bound, 429 with
/// `Retry-After` before the body is read.
pub(crate) async fn bound_body(
    axum::extract::State(service): axum::extract::State<Arc<Service>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::body::HttpBody;
    use axum::response::IntoResponse;
    let most = service.options.max_body_bytes;
    let declared = request.body().size_hint().upper().map_or(most, |n| usize::try_from(n).unwrap_or(most).min(most));
    let Some(_held) = QueuedBytes::join(&service.queued_bytes, declared) else {
        return ApiError::busy(
            format!(
                "the requests this server is reading or that wait for a run slot hold {} MiB already; try again shortly",
                crate::MAX_QUEUED_BYTES >> 20
            ),
            Some(1),
        )
        .into_response();
    };
    next.run(request).await
}

/// A run slot for `call`, with its cost capped at what is left of the day's cap. A request
/// waits its turn while every slot is taken; 429 when the queue is full too, when the history
/// has fallen a whole set of runs behind, or when the day's cap is spent. (Its body is counted
/// while it waits by [`bound_body`].)
pub(crate) async fn admit(service: &Service) -> Result<OwnedSemaphorePermit, ApiError> {
    let most = service.options.max_concurrent_runs.max(1);
    // Runs going, and runs that ended but wait for the history. The wait is usually a few
    // milliseconds, but one commit can take tens on a busy disk, and a client asking one
    // question after another may meanwhile have several runs waiting: only a backlog of a
    // whole set of runs (and never under `HISTORY_BACKLOG`) means a history that cannot keep up.
    if service.recording.count() >= (2 * most).max(crate::HISTORY_BACKLOG) {
        return Err(ApiError::busy(
            "the history is behind on recording this server's runs; try again shortly",
            Some(1),
        ));
    }
    // Refused before it waits: a spent cap will not be less spent after the wait.
    service.check_today()?;
    let permit = match service.runs.clone().try_acquire_owned() {
        Ok(permit) => permit,
        Err(_) => {
            let Some(_place) = Queued::join(&service.queued, service.options.max_queued_runs) else {
                return Err(ApiError::busy(
                    format!(
                        "all {} of this server's run slots are busy and {} requests wait already; try again shortly",
                        service.options.max_concurrent_runs, service.options.max_queued_runs
                    ),
                    Some(1),
                ));
            };
            // Dropped with the request when its client hangs up: it leaves the queue.
            service.runs.clone().acquire_owned().await.map_err(|_| ApiError::internal("the server is stopping"))?
        }
    };
    // What is left of the day may have shrunk while it waited: `Service::hold_for_run`
    // checks it again once the run's conversation is known.
    Ok(permit)
}

/// A place in the queue for a run slot, given up when dropped.
struct Queued(Arc<AtomicUsize>);

impl Queued {
    /// A place, unless `most` requests wait already.
    fn join(queued: &Arc<AtomicUsize>, most: usize) -> Option<Queued> {
        queued.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < most).then_some(n + 1)).ok()?;
        Some(Queued(queued.clone()))
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The bytes of a request's body, counted against [`crate::MAX_QUEUED_BYTES`] until its
/// handler has answered ([`bound_body`]).
struct QueuedBytes(Arc<AtomicUsize>, usize);

impl QueuedBytes {
    /// A place for `bytes` more, unless the waiting bodies would pass the bound (a body alone
    /// always fits in an empty queue).
    fn join(queued: &Arc<AtomicUsize>, bytes: usize) -> Option<QueuedBytes> {
        let fits = |held: usize| (held == 0 || held + bytes <= crate::MAX_QUEUED_BYTES).then_some(held + bytes);
        queued.fetch_update(Ordering::AcqRel, Ordering::Acquire, fits).ok()?;
        Some(QueuedBytes(queued.clone(), bytes))
    }
}

impl Drop for QueuedBytes {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::AcqRel);
    }
}

/// The history's conversation a request continues: the one `x-baton-conversation` names, else
/// the one whose latest run is the request's last question and answer (a client resends the
/// whole conversation each time), else none (a new one).
pub(crate) async fn continued(
    service: &Service,
    store: &baton_store::Store,
    call: &Call,
) -> Result<Option<i64>, ApiError> {
    if let Some(id) = call.conversation {
        return match store.conversation_title(id).await.map_err(unreadable)? {
            Some(_) => Ok(Some(id)),
            None => Err(ApiError::bad_request(format!(
                "there is no conversation {id} in the history (x-baton-conversation)"
            ))),
        };
    }
    let [.., question, answer] = call.history.as_slice() else { return Ok(None) };
    if question.role != Role::User || answer.role != Role::Assistant {
        return Ok(None);
    }
    let found = store.conversation_ending_with(&question.content, &answer.content).await.map_err(unreadable)?;
    if found.is_some() {
        return Ok(found);
    }
    // The answer may have reached the client a moment before its run was recorded.
    service.caught_up().await;
    store.conversation_ending_with(&question.content, &answer.content).await.map_err(unreadable)
}

/// A history that could not be read, as the client is told.
pub(crate) fn unreadable(e: baton_store::StoreError) -> ApiError {
    ApiError::internal(format!("the history cannot be read: {e}"))
}

/// The most events a run may be ahead of its client; a run whose client falls further behind
/// (it stopped reading) is cancelled. A stream sends every waiting event in one write, so a
/// client that reads keeps this near empty.
pub(crate) const EVENTS_AHEAD: usize = 16_384;

/// Set when a run's client fell [`EVENTS_AHEAD`] events behind and its run was stopped: the
/// stream then ends early, and is not kept for an `Idempotency-Key`'s replay (a retry runs
/// anew). It rides on the streamed response as an extension.
#[derive(Debug, Clone, Default)]
pub(crate) struct FellBehind(pub(crate) Arc<std::sync::atomic::AtomicBool>);

impl FellBehind {
    pub(crate) fn get(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// A run in flight: its events, and the token that stops it.
pub(crate) struct Running {
    pub(crate) run_id: String,
    pub(crate) model: String,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    pub(crate) events: mpsc::Receiver<RunEvent>,
    pub(crate) cancel: CancellationToken,
    pub(crate) created: u64,
    pub(crate) workers: Vec<String>,
    pub(crate) fell_behind: FellBehind,
}

/// Starts the run on its own task, which records every event in the history and passes it on;
/// the run goes on to its end (or its cancellation) whatever the client does.
/// `hold` is the run's hold on the day's cap, if the server has one (see `day.rs`): freed when
/// the run ends.
pub(crate) fn start(
    service: &Arc<Service>,
    call: Call,
    permit: OwnedSemaphorePermit,
    hold: Option<crate::day::DayHold>,
) -> Running {
    let run_id = new_run_id();
    let plan = call.worker.map(|w| baton_engine::fallback::alone_plan(w, &call.history, &call.question));
    let request = RunRequest {
        run_id: run_id.clone(),
        question: call.question,
        history: call.history,
        plan,
        instructions: call.instructions,
        answer: call.answer,
        budget: call.budget,
        ..RunRequest::default()
    };
    let (to_client, events) = mpsc::channel(EVENTS_AHEAD);
    let cancel = CancellationToken::new();
    let behind = cancel.clone();
    let fell_behind = FellBehind::default();
    let mark = fell_behind.clone();
    let executor = service.executor.clone();
    let (created, workers) = (service.created, service.workers.clone());
    let recording = service.recording.enter();
    // The history records the events beside the client, on the server's one writer.
    let log = service.history().map(|(store, writer)| writer.begin(store.recorder(call.conversation), recording));
    let stop = cancel.clone();
    let service = service.clone();
    tokio::spawn(async move {
        // The run's place under the concurrency limit, and its hold on the day, are free once
        // it has ended (its cost is spent by then).
        let _permit = permit;
        let _hold = hold;
        let forward = move |event: RunEvent| {
            if let Some(totals) = event.final_totals() {
                service.spend(totals.cost_usd);
            }
            // A client this far behind has stopped reading: its run stops, as if it had gone.
            if let Err(mpsc::error::TrySendError::Full(_)) = to_client.try_send(event) {
                mark.0.store(true, std::sync::atomic::Ordering::Release);
                behind.cancel();
            }
        };
        // The writer never fails a run's event: its errors are its own (see `history`).
        let (_, log) = baton_store::relay::run_kept(&executor, request, &stop, log, forward, |_| {}).await;
        drop(log);
    });
    Running {
        run_id,
        model: call.model,
        stream: call.stream,
        include_usage: call.include_usage,
        events,
        cancel,
        created,
        workers,
        fell_behind,
    }
}

/// What a client is shown of a run as it goes: which step writes the answer, the plans, the
/// steps and how they ended (the engine's fold of the events), and the reasoning text.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    pub(crate) run: RunProgress,
}

impl Progress {
    /// Takes in one event; returns the text it adds to the reasoning shown, if any.
    pub(crate) fn see(&mut self, event: &RunEvent, workers: &[String]) -> Option<String> {
        self.run.see(event);
        let name = |w: usize| workers.get(w).cloned().unwrap_or_else(|| "the conductor".to_owned());
        match event {
            RunEvent::PlanStarted { round, .. } => {
                Some(format!("Planning{}…\n", if *round > 0 { " again" } else { "" }))
            }
            RunEvent::PlanDelta { text, .. } => Some(text.clone()),
            RunEvent::PlanRejected { reason, retry, .. } => {
                Some(format!("\nPlan not used: {reason}{}\n", if *retry { "; asking again" } else { "" }))
            }
            RunEvent::PlanReady { plan, fallback, .. } => {
                let mut text = String::from("\n");
                if let Some(why) = fallback {
                    text.push_str(&format!("Fallback: {why}\n"));
                }
                for (i, s) in plan.steps.iter().enumerate() {
                    text.push_str(&format!("Step {i} · {}: {}\n", name(s.model_id), first_line(&s.subtask)));
                }
                Some(text)
            }
            RunEvent::StepStarted { round, step, worker, .. } => {
                (!self.run.is_answer_step(*round, *step)).then(|| format!("Step {step} · {} working…\n", name(*worker)))
            }
            RunEvent::StepFinished { round, step, latency_ms, .. } => (!self.run.is_answer_step(*round, *step))
                .then(|| format!("Step {step} done in {:.1} s\n", *latency_ms as f64 / 1000.0)),
            RunEvent::StepFailed { step, error, .. } => Some(format!("Step {step} failed: {}\n", error.message)),
            RunEvent::StepRetrying { step, attempt, delay_ms, .. } => {
                Some(format!("Step {step}: attempt {attempt} failed; retrying in {:.1} s\n", *delay_ms as f64 / 1000.0))
            }
            _ => None,
        }
    }

    /// The plans, as the `baton` object shows them.
    fn plans(&self) -> Vec<Value> {
        let plans = self.run.plans().iter();
        plans.map(|p| json!({ "round": p.round, "plan": p.plan, "fallback": p.fallback })).collect()
    }

    /// The steps that started, by worker name, as the `baton` object shows them.
    fn steps(&self, workers: &[String]) -> Vec<Value> {
        let name = |w: usize| workers.get(w).cloned().unwrap_or_else(|| "the conductor".to_owned());
        let status = |s: StepStatus| match s {
            StepStatus::Running => "running",
            StepStatus::Finished => "finished",
            StepStatus::Failed => "failed",
        };
        let steps = self.run.steps().iter();
        steps
            .map(|s| json!({ "round": s.round, "step": s.step, "worker": name(s.worker), "status": status(s.status) }))
            .collect()
    }
}

pub(crate) fn first_line(text: &str) -> String {
    let line = text.lines().next().unwrap_or_default();
    let cut: String = line.chars().take(160).collect();
    if cut.len() < text.len() { format!("{cut}…") } else { cut }
}

/// `x-baton-cost-usd`: the dollars, prefixed `>=` when some price is unknown (a lower bound)
/// and `~` when some call's tokens are Baton's upper estimate (it was cut off before its usage
/// came).
pub(crate) fn cost_text(totals: &Totals) -> String {
    let bound = if totals.cost_complete { "" } else { ">=" };
    let estimated = if totals.usage.estimated { "~" } else { "" };
    format!("{bound}{estimated}{:.6}", totals.cost_usd)
}

pub(crate) fn baton_object(run: &Running, progress: &Progress, status: &str, totals: Option<&Totals>) -> Value {
    let mut o = json!({
        "run_id": run.run_id,
        "status": status,
        "plans": progress.plans(),
        "steps": progress.steps(&run.workers),
    });
    if let Some(f) = progress.run.fallback() {
        o["fallback"] = json!(f);
    }
    if let Some(t) = totals {
        // In Chat Completions' shape, whichever format carries the object.
        o["usage"] = usage(t);
        o["cost_usd"] = json!(t.cost_usd);
        o["cost_complete"] = json!(t.cost_complete);
        o["wall_ms"] = json!(t.wall_ms);
    }
    o
}

/// Chat Completions' `usage` (the `baton` object carries it in this shape in both formats), with the conductor's share in the orchestration fields.
pub(crate) fn usage(totals: &Totals) -> Value {
    let all = totals.usage;
    let c = totals.conductor.usage;
    json!({
        "prompt_tokens": all.input_tokens,
        "completion_tokens": all.output_tokens,
        "total_tokens": all.input_tokens + all.output_tokens,
        "prompt_tokens_details": {
            "cached_tokens": all.cached_input_tokens,
            "orchestration_input_tokens": c.input_tokens,
            "orchestration_input_cached_tokens": c.cached_input_tokens,
        },
        "completion_tokens_details": { "orchestration_output_tokens": c.output_tokens },
        "estimated": all.estimated,
    })
}

/// How a run that ended without an answer reaches the client.
pub(crate) fn failure(kind: Option<RunErrorKind>, message: &str, progress: &Progress, workers: &[String]) -> ApiError {
    let worker = progress.run.answer_worker().and_then(|w| workers.get(w)).map_or("", String::as_str);
    match kind {
        Some(RunErrorKind::BudgetExceeded) => ApiError {
            code: Some("budget_exceeded"),
            ..ApiError::capped(format!("the run stopped at a budget cap: {message}"), None)
        },
        _ if progress.run.answer_error() == Some(StepErrorKind::Timeout) => {
            ApiError::timeout(format!("the answer's step (worker {worker}) timed out: {message}"))
        }
        _ => ApiError::bad_gateway(format!("the run failed: {message}")),
    }
}

/// Not streamed: waits for the run's end, taking in each event; `reasoning` gets the text each
/// adds to the reasoning shown. Returns what the client is shown of the run, and its last event.
pub(crate) async fn wait(run: &mut Running, mut reasoning: impl FnMut(String)) -> (Progress, Option<RunEvent>) {
    // A client that goes away drops this future, and the guard stops the run.
    let _stop_on_drop = run.cancel.clone().drop_guard();
    let mut progress = Progress::default();
    let mut end = None;
    while let Some(event) = run.events.recv().await {
        if let Some(text) = progress.see(&event, &run.workers) {
            reasoning(text);
        }
        if event.is_terminal() {
            end = Some(event);
        }
    }
    (progress, end)
}

/// A whole answer's headers: its run's id, and its cost (`x-baton-cost-usd`) when known.
pub(crate) fn run_headers(response: &mut Response, run_id: &str, cost: Option<&str>) {
    let headers = response.headers_mut();
    if let Ok(v) = HeaderValue::from_str(run_id) {
        headers.insert("x-baton-run-id", v);
    }
    if let Some(v) = cost.and_then(|c| HeaderValue::from_str(c).ok()) {
        headers.insert("x-baton-cost-usd", v);
    }
}

/// What a streamed answer gets when its step broke off mid-answer and is retried: the retry's
/// text follows, from its start. The history keeps the retry's answer alone (and a Responses
/// stream's `response.completed` carries it).
pub(crate) const RESTARTED: &str = "\n\n[The answer broke off here; it is written again from the start.]\n\n";

/// What a wire format's stream shows of a run's events (the state it keeps between writes).
pub(crate) trait StreamFormat: Send + 'static {
    /// Adds what `event` shows the client to `out`; true when the stream is over.
    fn show(&mut self, run: &Running, event: RunEvent, out: &mut String) -> bool;

    /// Ends the stream of a run whose events ended without its last one.
    fn cut_off(&mut self, run: &Running, out: &mut String);
}

/// Streamed: Server-Sent Events, `opening` and then what `format` shows of the run's events. The
/// head goes out first (`x-baton-run-id` is in it); the body's end is the stream's.
pub(crate) async fn stream<F: StreamFormat>(mut run: Running, mut format: F, opening: String) -> Response {
    let run_id = run.run_id.clone();
    let fell_behind = run.fell_behind.clone();
    // The body owns this guard: a client that disconnects drops the body, which stops the run
    // (or, before there is a body, this future, which drops it here).
    let stop = run.cancel.clone().drop_guard();
    // The head waits for the run's first events (a moment: the run has started) and goes out
    // with the opening and them in one write, where it would otherwise be a write alone.
    let (first, done) = frame(&mut run, &mut format, opening).await;
    let chunks =
        futures::stream::unfold((run, format, Some(first), done), |(mut run, mut format, waiting, done)| async move {
            if let Some(out) = waiting {
                return Some((out, (run, format, None, done)));
            }
            if done {
                return None;
            }
            let (out, done) = frame(&mut run, &mut format, String::new()).await;
            Some((out, (run, format, None, done)))
        });
    let body = chunks
        .map(move |text| {
            let _ = &stop;
            Ok::<_, std::convert::Infallible>(text)
        })
        .boxed();
    let mut response = Response::new(Body::from_stream(body));
    response.extensions_mut().insert(fell_behind);
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    if let Ok(v) = HeaderValue::from_str(&run_id) {
        h.insert("x-baton-run-id", v);
    }
    response
}

/// A stream's next write, after `out`; true when the stream is over.
async fn frame<F: StreamFormat>(run: &mut Running, format: &mut F, mut out: String) -> (String, bool) {
    let done = next_write(run, &mut out, |run, event, out| format.show(run, event, out)).await;
    if done.is_none() {
        format.cut_off(run, &mut out);
    }
    (out, done.unwrap_or(true))
}

/// Adds a stream's next write to `out`: what the events show from the next one on, with every
/// event already waiting (events that show nothing make no write: under load, fewer and fuller
/// writes for the server and the client alike). `show` adds what one event shows and says
/// whether the stream is over. Returns whether it is, or `None` when the run's events ended
/// without its last one. Chat Completions and Responses streams both write this way.
async fn next_write(
    run: &mut Running,
    out: &mut String,
    mut show: impl FnMut(&Running, RunEvent, &mut String) -> bool,
) -> Option<bool> {
    loop {
        let mut next = Some(run.events.recv().await?);
        while let Some(event) = next {
            if show(run, event, out) {
                return Some(true);
            }
            next = run.events.try_recv().ok();
        }
        if !out.is_empty() {
            return Some(false);
        }
    }
}

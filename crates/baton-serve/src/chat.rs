//! `POST /v1/chat/completions`: one request is one run.
//!
//! The request's last message is the question; earlier user and assistant turns are the
//! conversation the conductor sees; `system` and `developer` messages are the client's
//! instructions, which the conductor sees with the question and every worker gets after Baton's
//! own step instructions. `max_tokens`, `temperature` and `top_p` go to the steps that write
//! the answer (the last step of each plan). Fields Baton cannot honour are refused by name.
//!
//! Streamed, the answer's step streams as `content`; the plan and each step's progress stream
//! as `reasoning_content`, which clients show as thinking. Every chunk and the whole response
//! carry a `baton` object (run id, plan, steps, status, usage) that other clients ignore.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use baton_engine::{AnswerSettings, Budget, RunErrorKind, RunEvent, RunRequest, StepErrorKind, Totals, new_run_id};
use baton_providers::{Message, Role};
use futures::StreamExt;
use serde_json::{Map, Value, json};
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tokio_util::sync::CancellationToken;

use crate::{ApiError, Service};

/// Fields of OpenAI's Chat Completions request and what Baton does with each.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Field {
    /// Read and honoured.
    Used,
    /// Accepted and not used (bookkeeping a local server has no use for).
    Ignored,
    /// Refused unless absent, `null`, or a value that asks for nothing (`n: 1`, `logprobs: false`).
    Refused(&'static str),
}

const FIELDS: &[(&str, Field)] = &[
    ("model", Field::Used),
    ("messages", Field::Used),
    ("stream", Field::Used),
    ("stream_options", Field::Used),
    ("max_tokens", Field::Used),
    ("max_completion_tokens", Field::Used),
    ("temperature", Field::Used),
    ("top_p", Field::Used),
    ("n", Field::Refused("Baton writes one answer per request (n = 1)")),
    ("user", Field::Ignored),
    ("metadata", Field::Ignored),
    ("store", Field::Ignored),
    ("service_tier", Field::Ignored),
    ("prompt_cache_key", Field::Ignored),
    ("safety_identifier", Field::Ignored),
    ("parallel_tool_calls", Field::Ignored),
    ("tools", Field::Refused("Baton's workers answer in text; tools are not supported")),
    ("functions", Field::Refused("Baton's workers answer in text; functions are not supported")),
    ("tool_choice", Field::Refused("Baton's workers answer in text; tools are not supported")),
    ("function_call", Field::Refused("Baton's workers answer in text; functions are not supported")),
    ("logprobs", Field::Refused("log probabilities are not available through a workflow")),
    ("top_logprobs", Field::Refused("log probabilities are not available through a workflow")),
    ("response_format", Field::Refused("only text answers are supported (response_format type \"text\")")),
    ("audio", Field::Refused("only text is supported")),
    ("modalities", Field::Refused("only text is supported (modalities [\"text\"])")),
    ("seed", Field::Refused("a seed is not passed to the workers")),
    ("stop", Field::Refused("stop sequences are not passed to the workers")),
    ("presence_penalty", Field::Refused("penalties are not passed to the workers")),
    ("frequency_penalty", Field::Refused("penalties are not passed to the workers")),
    ("logit_bias", Field::Refused("logit bias is not passed to the workers")),
    ("reasoning_effort", Field::Refused("set a worker's reasoning effort in the pool file instead")),
    ("verbosity", Field::Refused("verbosity is not passed to the workers")),
    ("prediction", Field::Refused("predicted outputs are not supported")),
    ("web_search_options", Field::Refused("web search is not supported")),
];

/// Whether a refused field's value asks for nothing, so a client that sends defaults works.
fn asks_for_nothing(name: &str, value: &Value) -> bool {
    match (name, value) {
        (_, Value::Null) => true,
        ("n", v) => v.as_u64() == Some(1),
        ("logprobs", Value::Bool(false)) => true,
        ("tools" | "functions", Value::Array(a)) => a.is_empty(),
        ("tool_choice" | "function_call", Value::String(s)) => s == "none",
        ("response_format", v) => v.get("type").and_then(Value::as_str) == Some("text"),
        ("modalities", Value::Array(a)) => a.iter().all(|m| m == "text"),
        ("presence_penalty" | "frequency_penalty", v) => v.as_f64() == Some(0.0),
        ("logit_bias", Value::Object(m)) => m.is_empty(),
        ("stop", Value::Array(a)) => a.is_empty(),
        _ => false,
    }
}

/// Refuses the first field of `body` that `fields` does not list (as OpenAI does), or that asks
/// for what Baton cannot do.
pub(crate) fn check_fields(
    body: &Map<String, Value>,
    fields: &[(&str, Field)],
    asks_for_nothing: fn(&str, &Value) -> bool,
) -> Result<(), ApiError> {
    for (name, value) in body {
        match fields.iter().find(|(f, _)| f == name).map(|(_, f)| *f) {
            None => return Err(ApiError::bad_field(name, format!("Unrecognized request argument supplied: {name}"))),
            Some(Field::Refused(why)) if !asks_for_nothing(name, value) => {
                return Err(ApiError::bad_field(name, format!("`{name}` is not supported: {why}")));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// A request, checked: what to run and how to answer.
#[derive(Debug)]
pub(crate) struct Call {
    pub(crate) model: String,
    /// `None`: the conductor plans; `Some(i)`: worker `i` alone.
    pub(crate) worker: Option<usize>,
    pub(crate) question: String,
    pub(crate) history: Vec<Message>,
    pub(crate) instructions: Option<String>,
    pub(crate) answer: AnswerSettings,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    pub(crate) budget: Option<Budget>,
    pub(crate) conversation: Option<i64>,
}

#[cfg(test)]
impl Call {
    pub(crate) fn for_tests() -> Call {
        Call {
            model: "baton".into(),
            worker: None,
            question: "Q?".into(),
            history: Vec::new(),
            instructions: None,
            answer: AnswerSettings::default(),
            stream: false,
            include_usage: false,
            budget: None,
            conversation: None,
        }
    }
}

pub(crate) fn number(body: &Map<String, Value>, name: &str) -> Result<Option<f64>, ApiError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| ApiError::bad_field(name, format!("`{name}` must be a number"))),
    }
}

/// The text of a message's `content`: a string, or text parts (anything else is refused).
fn text_of(content: &Value, at: usize) -> Result<String, ApiError> {
    match content {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
                if kind != "text" {
                    return Err(ApiError::bad_field(
                        &format!("messages[{at}].content[{j}].type"),
                        format!("only text parts are supported, not `{kind}`"),
                    ));
                }
                text.push_str(part.get("text").and_then(Value::as_str).unwrap_or(""));
            }
            Ok(text)
        }
        _ => Err(ApiError::bad_field(&format!("messages[{at}].content"), "content must be a string or text parts")),
    }
}

/// Checks a request body and headers; every refusal names what to change.
pub(crate) fn parse(service: &Service, headers: &HeaderMap, bytes: &[u8]) -> Result<Call, ApiError> {
    let body: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("the body is not JSON ({e}); send a Chat Completions request")))?;
    let Value::Object(body) = body else {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    };
    check_fields(&body, FIELDS, asks_for_nothing)?;
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_field("model", "`model` is required: `baton`, or `baton/<worker>`"))?
        .to_owned();
    let worker = service.target(&model)?;
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::bad_field("messages", "`messages` is required: a list of messages"))?;
    if messages.is_empty() {
        return Err(ApiError::bad_field("messages", "`messages` is empty: the last message is the question"));
    }
    if messages.len() > service.options.max_messages {
        return Err(ApiError::bad_field(
            "messages",
            format!("{} messages is over this server's limit of {}", messages.len(), service.options.max_messages),
        ));
    }
    let mut instructions = Vec::new();
    let mut turns = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        if m.get("tool_calls").is_some_and(|t| !t.is_null()) {
            return Err(ApiError::bad_field(&format!("messages[{i}].tool_calls"), "tool calls are not supported"));
        }
        let text = text_of(m.get("content").unwrap_or(&Value::Null), i)?;
        match role {
            "system" | "developer" => instructions.push(text),
            "user" => turns.push(Message::user(text)),
            "assistant" => turns.push(Message::assistant(text)),
            other => {
                return Err(ApiError::bad_field(
                    &format!("messages[{i}].role"),
                    format!("role `{other}` is not supported: use system, developer, user or assistant"),
                ));
            }
        }
    }
    let question = match turns.pop() {
        Some(Message { role: Role::User, content }) if !content.trim().is_empty() => content,
        _ => {
            return Err(ApiError::bad_field(
                "messages",
                "the last user or assistant message must be the user's question, and not empty",
            ));
        }
    };
    let max_tokens = match (number(&body, "max_completion_tokens")?, number(&body, "max_tokens")?) {
        (Some(m), _) | (None, Some(m)) if m >= 1.0 => Some(m as u32),
        (None, None) => None,
        _ => return Err(ApiError::bad_field("max_tokens", "`max_tokens` must be at least 1")),
    };
    let temperature = number(&body, "temperature")?.map(|t| t as f32);
    let top_p = number(&body, "top_p")?.map(|t| t as f32);
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage =
        body.get("stream_options").and_then(|o| o.get("include_usage")).and_then(Value::as_bool).unwrap_or(false);
    Ok(Call {
        model,
        worker,
        question,
        history: turns,
        instructions: (!instructions.is_empty()).then(|| instructions.join("\n\n")),
        answer: AnswerSettings { max_tokens, temperature, top_p },
        stream,
        include_usage,
        budget: budget(headers)?,
        conversation: header_number(headers, "x-baton-conversation")?.map(|c| c as i64),
    })
}

pub(crate) fn header_number(headers: &HeaderMap, name: &str) -> Result<Option<f64>, ApiError> {
    let Some(value) = headers.get(name) else { return Ok(None) };
    let parsed = value.to_str().ok().and_then(|v| v.trim().parse::<f64>().ok()).filter(|v| *v > 0.0);
    parsed.map(Some).ok_or_else(|| ApiError::bad_request(format!("the header {name} must be a number above 0")))
}

/// A request's own caps (`x-baton-max-cost-usd`, `x-baton-max-tokens`): the executor applies
/// the tighter of these and the pool's, so a request can lower a cap and never raise it.
pub(crate) fn budget(headers: &HeaderMap) -> Result<Option<Budget>, ApiError> {
    let cost = header_number(headers, "x-baton-max-cost-usd")?;
    let tokens = header_number(headers, "x-baton-max-tokens")?.map(|t| t as u64);
    Ok((cost.is_some() || tokens.is_some()).then_some(Budget {
        max_calls: None,
        max_tokens: tokens,
        max_cost_usd: cost,
    }))
}

pub async fn completions(
    axum::extract::State(service): axum::extract::State<Arc<Service>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let bytes = match read_body(&service, body).await {
        Ok(bytes) => bytes,
        Err(e) => return e.into_response(),
    };
    let call = match parse(&service, &headers, &bytes) {
        Ok(call) => call,
        Err(e) => return e.into_response(),
    };
    let mut call = call;
    let permit = match admit(&service, &mut call) {
        Ok(permit) => permit,
        Err(e) => return e.into_response(),
    };
    if let Some(store) = &service.store {
        match continued(&service, store, &call).await {
            Ok(conversation) => call.conversation = conversation,
            Err(e) => return e.into_response(),
        }
    }
    let run = start(&service, call, permit);
    if run.stream { stream(run).await } else { complete(run).await }
}

/// A request's body, up to the server's limit (413 above it).
pub(crate) async fn read_body(service: &Service, body: Body) -> Result<axum::body::Bytes, ApiError> {
    axum::body::to_bytes(body, service.options.max_body_bytes).await.map_err(|_| {
        ApiError::too_large(format!(
            "the request is over this server's limit of {} bytes",
            service.options.max_body_bytes
        ))
    })
}

/// A run slot for `call` (429 when all are busy, or when the history has fallen a whole set of
/// runs behind), with its cost capped at what is left of the day's cap.
pub(crate) fn admit(service: &Service, call: &mut Call) -> Result<OwnedSemaphorePermit, ApiError> {
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
    let Ok(permit) = service.runs.clone().try_acquire_owned() else {
        return Err(ApiError::busy(
            format!(
                "all {} of this server's run slots are busy; try again shortly",
                service.options.max_concurrent_runs
            ),
            Some(1),
        ));
    };
    service.limit_to_today(call)?;
    Ok(permit)
}

/// The history's conversation a request continues: the one `x-baton-conversation` names, else
/// the one whose latest run is the request's last question and answer (a client resends the
/// whole conversation each time), else none (a new one).
pub(crate) async fn continued(
    service: &Service,
    store: &baton_store::Store,
    call: &Call,
) -> Result<Option<i64>, ApiError> {
    let unreadable = |e: baton_store::StoreError| ApiError::internal(format!("the history cannot be read: {e}"));
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

/// A run in flight: its events, and the token that stops it.
pub(crate) struct Running {
    pub(crate) run_id: String,
    pub(crate) model: String,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    pub(crate) events: mpsc::UnboundedReceiver<RunEvent>,
    pub(crate) cancel: CancellationToken,
    pub(crate) created: u64,
    pub(crate) workers: Vec<String>,
}

/// Starts the run on its own task, which records every event in the history and passes it on;
/// the run goes on to its end (or its cancellation) whatever the client does.
pub(crate) fn start(service: &Arc<Service>, call: Call, permit: OwnedSemaphorePermit) -> Running {
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
    let (to_client, events) = mpsc::unbounded_channel();
    let cancel = CancellationToken::new();
    let executor = service.executor.clone();
    let (created, workers) = (service.created, service.workers.clone());
    let recording = service.recording.enter();
    // The history records the events beside the client, on the server's one writer.
    let log = service.history().map(|(store, writer)| writer.begin(store.recorder(call.conversation), recording));
    let stop = cancel.clone();
    let service = service.clone();
    tokio::spawn(async move {
        // The run's place under the concurrency limit is free once it has ended.
        let _permit = permit;
        let (tx, mut rx) = mpsc::unbounded_channel::<RunEvent>();
        let relay = async {
            while let Some(event) = rx.recv().await {
                if let Some(totals) = event.final_totals() {
                    service.spend(totals.cost_usd);
                }
                if let Some(log) = &log {
                    log.event(event.clone());
                }
                let _ = to_client.send(event);
            }
        };
        let run = async {
            executor.run(request, &tx, &stop).await;
            drop(tx);
        };
        tokio::join!(run, relay);
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
    }
}

/// What a client is shown of a run as it goes: which step writes the answer, the plans, the
/// steps and how they ended.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    /// The step whose text is the answer: the last step of the question's plan, or of the
    /// round a final conductor step opened.
    pub(crate) answer_step: Option<(u32, usize)>,
    answer_worker: Option<usize>,
    plans: Vec<Value>,
    steps: Vec<Value>,
    fallback: Option<String>,
    /// The answer step's failure, to tell a time-out (504) from other failures (502).
    answer_error: Option<StepErrorKind>,
}

impl Progress {
    /// Takes in one event; returns the text it adds to the reasoning shown, if any.
    pub(crate) fn see(&mut self, event: &RunEvent, workers: &[String]) -> Option<String> {
        let name = |w: usize| workers.get(w).cloned().unwrap_or_else(|| "the conductor".to_owned());
        match event {
            RunEvent::PlanStarted { round, .. } => {
                Some(format!("Planning{}…\n", if *round > 0 { " again" } else { "" }))
            }
            RunEvent::PlanDelta { text, .. } => Some(text.clone()),
            RunEvent::PlanRejected { reason, retry, .. } => {
                Some(format!("\nPlan not used: {reason}{}\n", if *retry { "; asking again" } else { "" }))
            }
            RunEvent::PlanReady { round, parent, plan, fallback, .. } => {
                let last = plan.steps.len().checked_sub(1);
                let continues = parent.is_some_and(|p| Some((p.round, p.step)) == self.answer_step);
                if let (true, Some(last)) = (*round == 0 || continues, last) {
                    self.answer_step = Some((*round, last));
                    self.answer_worker = Some(plan.steps[last].model_id);
                }
                if fallback.is_some() {
                    self.fallback = fallback.clone();
                }
                self.plans.push(json!({ "round": round, "plan": plan, "fallback": fallback }));
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
                self.steps.push(json!({ "round": round, "step": step, "worker": name(*worker), "status": "running" }));
                (Some((*round, *step)) != self.answer_step)
                    .then(|| format!("Step {step} · {} working…\n", name(*worker)))
            }
            RunEvent::StepFinished { round, step, latency_ms, .. } => {
                self.set_status(*round, *step, "finished");
                (Some((*round, *step)) != self.answer_step)
                    .then(|| format!("Step {step} done in {:.1} s\n", *latency_ms as f64 / 1000.0))
            }
            RunEvent::StepFailed { round, step, error } => {
                self.set_status(*round, *step, "failed");
                if Some((*round, *step)) == self.answer_step {
                    self.answer_error = Some(error.kind);
                }
                Some(format!("Step {step} failed: {}\n", error.message))
            }
            RunEvent::StepRetrying { step, attempt, delay_ms, .. } => {
                Some(format!("Step {step}: attempt {attempt} failed; retrying in {:.1} s\n", *delay_ms as f64 / 1000.0))
            }
            _ => None,
        }
    }

    fn set_status(&mut self, round: u32, step: usize, status: &str) {
        if let Some(s) = self.steps.iter_mut().rev().find(|s| s["round"] == round && s["step"] == step) {
            s["status"] = json!(status);
        }
    }
}

pub(crate) fn first_line(text: &str) -> String {
    let line = text.lines().next().unwrap_or_default();
    let cut: String = line.chars().take(160).collect();
    if cut.len() < text.len() { format!("{cut}…") } else { cut }
}

/// OpenAI's `usage`, with the conductor's share in the orchestration fields.
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
        "plans": progress.plans,
        "steps": progress.steps,
    });
    if let Some(f) = &progress.fallback {
        o["fallback"] = json!(f);
    }
    if let Some(t) = totals {
        o["usage"] = usage(t);
        o["cost_usd"] = json!(t.cost_usd);
        o["cost_complete"] = json!(t.cost_complete);
        o["wall_ms"] = json!(t.wall_ms);
    }
    o
}

/// How a run that ended without an answer reaches the client.
pub(crate) fn failure(kind: Option<RunErrorKind>, message: &str, progress: &Progress, workers: &[String]) -> ApiError {
    let worker = progress.answer_worker.and_then(|w| workers.get(w)).map_or("", String::as_str);
    match kind {
        Some(RunErrorKind::BudgetExceeded) => ApiError {
            code: Some("budget_exceeded"),
            ..ApiError::busy(format!("the run stopped at a budget cap: {message}"), None)
        },
        _ if progress.answer_error == Some(StepErrorKind::Timeout) => {
            ApiError::timeout(format!("the answer's step (worker {worker}) timed out: {message}"))
        }
        _ => ApiError::bad_gateway(format!("the run failed: {message}")),
    }
}

/// Not streamed: waits for the run's end, then answers in one body.
async fn complete(mut run: Running) -> Response {
    // A client that goes away drops this future, and the guard stops the run.
    let _stop_on_drop = run.cancel.clone().drop_guard();
    let mut progress = Progress::default();
    let mut reasoning = String::new();
    let mut end = None;
    while let Some(event) = run.events.recv().await {
        if let Some(text) = progress.see(&event, &run.workers) {
            reasoning.push_str(&text);
        }
        if event.is_terminal() {
            end = Some(event);
        }
    }
    let (answer, totals, error) = match end {
        Some(RunEvent::RunFinished { answer, totals }) => (answer, totals, None),
        Some(RunEvent::RunFailed { error, totals }) => {
            (String::new(), totals, Some(failure(Some(error.kind), &error.message, &progress, &run.workers)))
        }
        Some(RunEvent::RunCancelled { totals }) => {
            (String::new(), totals, Some(ApiError::internal("the run was cancelled before it answered")))
        }
        _ => return ApiError::internal("the run ended without a result").into_response(),
    };
    let mut response = match error {
        Some(e) => {
            let mut body = e.body();
            body["baton"] = baton_object(&run, &progress, "failed", Some(&totals));
            let mut r = (e.status, axum::Json(body)).into_response();
            if let Some(s) = e.retry_after {
                r.headers_mut().insert(axum::http::header::RETRY_AFTER, HeaderValue::from(s));
            }
            r
        }
        None => {
            let body = json!({
                "id": format!("chatcmpl-{}", run.run_id),
                "object": "chat.completion",
                "created": run.created,
                "model": run.model,
                "choices": [{
                    "index": 0,
                    "message": { "role": "assistant", "content": answer, "reasoning_content": reasoning, "refusal": null },
                    "finish_reason": "stop",
                    "logprobs": null,
                }],
                "usage": usage(&totals),
                "baton": baton_object(&run, &progress, "finished", Some(&totals)),
            });
            (StatusCode::OK, axum::Json(body)).into_response()
        }
    };
    let headers = response.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&run.run_id) {
        headers.insert("x-baton-run-id", v);
    }
    if let Ok(v) = HeaderValue::from_str(&cost_text(&totals)) {
        headers.insert("x-baton-cost-usd", v);
    }
    response
}

/// What a streamed answer gets when its step broke off mid-answer and is retried: the retry's
/// text follows, from its start. The history keeps the retry's answer alone (and a Responses
/// stream's `response.completed` carries it).
pub(crate) const RESTARTED: &str = "\n\n[The answer broke off here; it is written again from the start.]\n\n";

/// Streamed: Server-Sent Events in OpenAI's chunk shape, ending with `data: [DONE]`. The run's
/// cost is known only at its end, so it comes in the last chunk's `baton` object (headers go
/// out first: `x-baton-run-id` is one).
async fn stream(mut run: Running) -> Response {
    let run_id = run.run_id.clone();
    // The body owns this guard: a client that disconnects drops the body, which stops the run
    // (or, before there is a body, this future, which drops it here).
    let stop = run.cancel.clone().drop_guard();
    // The head waits for the run's first events (a moment: the run has started) and goes out
    // with the opening chunk and them in one write, where it would otherwise be a write alone.
    let mut progress = Progress::default();
    let mut streamed = String::new();
    let opening = chunk(
        &run,
        &json!({ "role": "assistant", "content": "" }),
        None,
        &json!({ "run_id": run.run_id, "status": "running" }),
    );
    let (first, done) = frame(&mut run, &mut progress, &mut streamed, opening).await;
    let chunks = futures::stream::unfold(
        (run, progress, streamed, Some(first), done),
        |(mut run, mut progress, mut streamed, waiting, done)| async move {
            if let Some(out) = waiting {
                return Some((out, (run, progress, streamed, None, done)));
            }
            if done {
                return None;
            }
            let (out, done) = frame(&mut run, &mut progress, &mut streamed, String::new()).await;
            Some((out, (run, progress, streamed, None, done)))
        },
    );
    let body = chunks
        .map(move |text| {
            let _ = &stop;
            Ok::<_, std::convert::Infallible>(text)
        })
        .boxed();
    let mut response = Response::new(Body::from_stream(body));
    let h = response.headers_mut();
    h.insert(axum::http::header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(axum::http::header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    if let Ok(v) = HeaderValue::from_str(&run_id) {
        h.insert("x-baton-run-id", v);
    }
    response
}

/// Adds a stream's next write to `out`: what the events show from the next one on, with every
/// event already waiting (events that show nothing make no write: under load, fewer and fuller
/// writes for the server and the client alike). `show` adds what one event shows and says
/// whether the stream is over. Returns whether it is, or `None` when the run's events ended
/// without its last one. Chat Completions and Responses streams both write this way.
pub(crate) async fn next_write(
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

/// A chat stream's next write, after `out`; true when the stream is over.
async fn frame(run: &mut Running, progress: &mut Progress, streamed: &mut String, mut out: String) -> (String, bool) {
    let done = next_write(run, &mut out, |run, event, out| on_event(run, progress, streamed, event, out)).await;
    if done.is_none() {
        out.push_str(&sse(&ApiError::internal("the run ended without a result").body()));
        out.push_str(DONE);
    }
    (out, done.unwrap_or(true))
}

/// One streamed chunk in OpenAI's shape, as its SSE line. The envelope is written straight from
/// borrowed parts rather than built as a `Value` first: a chunk goes out for every piece of
/// every answer, and on a busy server that building was a large share of its work.
fn chunk(run: &Running, delta: &Value, finish: Option<&str>, baton: &Value) -> String {
    #[derive(serde::Serialize)]
    struct Choice<'a> {
        index: u32,
        delta: &'a Value,
        finish_reason: Option<&'a str>,
        logprobs: Option<()>,
    }
    envelope(run, &[Choice { index: 0, delta, finish_reason: finish, logprobs: None }], None, baton)
}

/// A chunk with `choices` (none for the usage chunk), `usage` when given, and the `baton` object.
fn envelope<C: serde::Serialize>(run: &Running, choices: &[C], usage: Option<&Value>, baton: &Value) -> String {
    struct Id<'a>(&'a str);
    impl serde::Serialize for Id<'_> {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.collect_str(&format_args!("chatcmpl-{}", self.0))
        }
    }
    #[derive(serde::Serialize)]
    struct Chunk<'a, C> {
        id: Id<'a>,
        object: &'static str,
        created: u64,
        model: &'a str,
        choices: &'a [C],
        #[serde(skip_serializing_if = "Option::is_none")]
        usage: Option<&'a Value>,
        baton: &'a Value,
    }
    let chunk = Chunk {
        id: Id(&run.run_id),
        object: "chat.completion.chunk",
        created: run.created,
        model: &run.model,
        choices,
        usage,
        baton,
    };
    let mut line = Vec::with_capacity(512);
    line.extend_from_slice(b"data: ");
    // Writing JSON into a Vec cannot fail, and JSON is UTF-8.
    let _ = serde_json::to_writer(&mut line, &chunk);
    line.extend_from_slice(b"\n\n");
    String::from_utf8(line).unwrap_or_default()
}

/// Adds what `event` shows the client to `out`; true when the stream is over.
fn on_event(run: &Running, progress: &mut Progress, streamed: &mut String, event: RunEvent, out: &mut String) -> bool {
    if let Some(text) = progress.see(&event, &run.workers) {
        let baton = json!({ "run_id": run.run_id, "event": event_name(&event) });
        out.push_str(&chunk(run, &json!({ "reasoning_content": text }), None, &baton));
    }
    match event {
        RunEvent::StepDelta { round, step, text } if Some((round, step)) == progress.answer_step => {
            streamed.push_str(&text);
            let baton = json!({ "run_id": run.run_id, "round": round, "step": step });
            out.push_str(&chunk(run, &json!({ "content": text }), None, &baton));
        }
        RunEvent::StepRetrying { round, step, .. }
            if Some((round, step)) == progress.answer_step && !streamed.is_empty() =>
        {
            // The retry writes the answer again from its start, and what was sent cannot be
            // taken back: say so in the answer itself.
            streamed.push_str(RESTARTED);
            let baton = json!({ "run_id": run.run_id, "round": round, "step": step });
            out.push_str(&chunk(run, &json!({ "content": RESTARTED }), None, &baton));
        }
        RunEvent::RunFinished { answer, totals } => {
            // Nothing streamed (a stop, a retried answer step): the answer whole.
            if streamed.is_empty() && !answer.is_empty() {
                let baton = json!({ "run_id": run.run_id });
                out.push_str(&chunk(run, &json!({ "content": answer }), None, &baton));
            }
            let mut baton = baton_object(run, progress, "finished", Some(&totals));
            baton["cost_text"] = json!(cost_text(&totals));
            out.push_str(&chunk(run, &json!({}), Some("stop"), &baton));
            if run.include_usage {
                let none: [(); 0] = [];
                out.push_str(&envelope(run, &none, Some(&usage(&totals)), &json!({ "run_id": run.run_id })));
            }
            out.push_str(DONE);
            return true;
        }
        RunEvent::RunFailed { error, totals } => {
            let e = failure(Some(error.kind), &error.message, progress, &run.workers);
            let mut body = e.body();
            body["baton"] = baton_object(run, progress, "failed", Some(&totals));
            out.push_str(&sse(&body));
            out.push_str(DONE);
            return true;
        }
        RunEvent::RunCancelled { .. } => {
            out.push_str(&sse(&ApiError::internal("the run was cancelled").body()));
            out.push_str(DONE);
            return true;
        }
        _ => {}
    }
    false
}

const DONE: &str = "data: [DONE]\n\n";

pub(crate) fn sse(value: &Value) -> String {
    format!("data: {value}\n\n")
}

fn event_name(event: &RunEvent) -> &'static str {
    match event {
        RunEvent::RunStarted { .. } => "run_started",
        RunEvent::PlanStarted { .. } => "plan_started",
        RunEvent::PlanDelta { .. } => "plan_delta",
        RunEvent::PlanReady { .. } => "plan_ready",
        RunEvent::PlanRejected { .. } => "plan_rejected",
        RunEvent::StepStarted { .. } => "step_started",
        RunEvent::StepDelta { .. } => "step_delta",
        RunEvent::StepRetrying { .. } => "step_retrying",
        RunEvent::StepFinished { .. } => "step_finished",
        RunEvent::StepFailed { .. } => "step_failed",
        RunEvent::StepReused { .. } => "step_reused",
        RunEvent::RunFinished { .. } => "run_finished",
        RunEvent::RunFailed { .. } => "run_failed",
        RunEvent::RunCancelled { .. } => "run_cancelled",
    }
}

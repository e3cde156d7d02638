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
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use baton_engine::RunEvent;
use serde_json::{Value, json};

use crate::handling::{self, Progress, Running, StreamFormat, baton_object, cost_text, failure, usage};
use crate::request::{self, Call, Field, Messages};
use crate::{ApiError, Service};

/// Fields of OpenAI's Chat Completions request and what Baton does with each.
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

/// The text of a message's `content`: a string, or text parts (anything else is refused).
fn text_of(content: &Value, at: usize) -> Result<String, ApiError> {
    match content {
        Value::Null => Ok(String::new()),
        content => request::text_of(content, "messages", at, &["text"]),
    }
}

/// Checks a request body and headers; every refusal names what to change.
pub(crate) fn parse(service: &Service, headers: &HeaderMap, bytes: &[u8]) -> Result<Call, ApiError> {
    let body = request::object(bytes, "Chat Completions", FIELDS, asks_for_nothing)?;
    let (model, worker) = request::model(service, &body)?;
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::bad_field("messages", "`messages` is required: a list of messages"))?;
    if messages.is_empty() {
        return Err(ApiError::bad_field("messages", "`messages` is empty: the last message is the question"));
    }
    request::within_limit(service, "messages", messages.len(), "messages")?;
    let mut sorted = Messages::default();
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        if m.get("tool_calls").is_some_and(|t| !t.is_null()) {
            return Err(ApiError::bad_field(&format!("messages[{i}].tool_calls"), "tool calls are not supported"));
        }
        let text = text_of(m.get("content").unwrap_or(&Value::Null), i)?;
        sorted.add("messages", i, role, text)?;
    }
    let (question, history, instructions) =
        sorted.split("messages", "the last user or assistant message must be the user's question, and not empty")?;
    // The newer name wins where a client sends both.
    let newer = request::output_tokens(&body, "max_completion_tokens")?;
    let max_tokens = newer.or(request::output_tokens(&body, "max_tokens")?);
    let answer = request::answer(&body, max_tokens)?;
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage =
        body.get("stream_options").and_then(|o| o.get("include_usage")).and_then(Value::as_bool).unwrap_or(false);
    Ok(Call {
        model,
        worker,
        question,
        history,
        instructions,
        answer,
        stream,
        include_usage,
        budget: request::budget(headers)?,
        conversation: request::conversation(headers)?,
    })
}

pub async fn completions(
    axum::extract::State(service): axum::extract::State<Arc<Service>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let started = async {
        let bytes = handling::read_body(&service, body).await?;
        let mut call = parse(&service, &headers, &bytes)?;
        // Parsed: the raw body need not wait in the queue beside its copy.
        drop(bytes);
        let permit = handling::admit(&service).await?;
        if let Some(store) = &service.store {
            call.conversation = handling::continued(&service, store, &call).await?;
        }
        // Held once the run's conversation is known: what it sends is part of its worst case.
        let hold = service.hold_for_run(&mut call)?;
        Ok::<_, ApiError>(handling::start(&service, call, permit, hold))
    };
    let run = match started.await {
        Ok(run) => run,
        Err(e) => return e.into_response(),
    };
    if run.stream { stream(run).await } else { complete(run).await }
}

/// Not streamed: waits for the run's end, then answers in one body.
async fn complete(mut run: Running) -> Response {
    let mut reasoning = String::new();
    let (progress, end) = handling::wait(&mut run, |text| reasoning.push_str(&text)).await;
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
            e.into_response_with(body)
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
    handling::run_headers(&mut response, &run.run_id, Some(cost_text(&totals).as_str()));
    response
}

/// Streamed: Server-Sent Events in OpenAI's chunk shape, ending with `data: [DONE]`. The run's
/// cost is known only at its end, so it comes in the last chunk's `baton` object (headers go
/// out first: `x-baton-run-id` is one).
async fn stream(run: Running) -> Response {
    let opening = chunk(
        &run,
        &json!({ "role": "assistant", "content": "" }),
        None,
        &json!({ "run_id": run.run_id, "status": "running" }),
    );
    handling::stream(run, ChatStream::default(), opening).await
}

/// A chat stream's state between writes: what the client is shown of the run, and the answer's
/// text streamed so far.
#[derive(Default)]
struct ChatStream {
    progress: Progress,
    streamed: String,
}

impl StreamFormat for ChatStream {
    fn show(&mut self, run: &Running, event: RunEvent, out: &mut String) -> bool {
        on_event(run, &mut self.progress, &mut self.streamed, event, out)
    }

    fn cut_off(&mut self, _run: &Running, out: &mut String) {
        out.push_str(&sse(&ApiError::internal("the run ended without a result").body()));
        out.push_str(DONE);
    }
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
        RunEvent::StepDelta { round, step, text } if Some((round, step)) == progress.run.answer_step() => {
            streamed.push_str(&text);
            let baton = json!({ "run_id": run.run_id, "round": round, "step": step });
            out.push_str(&chunk(run, &json!({ "content": text }), None, &baton));
        }
        RunEvent::StepRetrying { round, step, .. }
            if Some((round, step)) == progress.run.answer_step() && !streamed.is_empty() =>
        {
            // The retry writes the answer again from its start, and what was sent cannot be
            // taken back: say so in the answer itself.
            streamed.push_str(handling::RESTARTED);
            let baton = json!({ "run_id": run.run_id, "round": round, "step": step });
            out.push_str(&chunk(run, &json!({ "content": handling::RESTARTED }), None, &baton));
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

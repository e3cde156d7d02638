//! `POST /v1/responses`, for text in and text out: the same run as a chat completion, in the
//! Responses API's shape. `input` is the question (a string) or messages; `instructions` are the
//! client's system message; `previous_response_id` continues that response's conversation from
//! the history (a response's id is `resp_` and its run's id). Streamed, the events are
//! `response.created`, `response.in_progress`, the output item and text part opening,
//! `response.output_text.delta` as the answer is written, their closing, and
//! `response.completed` (or `response.failed`); the plan and the steps' progress come as
//! `baton.progress` events, which clients that do not know them skip.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use baton_engine::{RunEvent, Totals};
use baton_providers::Message;
use serde_json::{Map, Value, json};

use crate::handling::{self, Progress, Running, StreamFormat, baton_object, cost_text, failure};
use crate::request::{self, Call, Field, Messages};
use crate::{ApiError, Service};

/// Fields of the Responses API's create request and what Baton does with each (as for chat
/// completions: [`Field`]).
const FIELDS: &[(&str, Field)] = &[
    ("model", Field::Used),
    ("input", Field::Used),
    ("instructions", Field::Used),
    ("stream", Field::Used),
    ("previous_response_id", Field::Used),
    ("max_output_tokens", Field::Used),
    ("temperature", Field::Used),
    ("top_p", Field::Used),
    ("store", Field::Ignored),
    ("metadata", Field::Ignored),
    ("user", Field::Ignored),
    ("service_tier", Field::Ignored),
    ("prompt_cache_key", Field::Ignored),
    ("safety_identifier", Field::Ignored),
    ("parallel_tool_calls", Field::Ignored),
    ("truncation", Field::Ignored),
    ("text", Field::Refused("only text answers are supported (text.format type \"text\")")),
    ("tools", Field::Refused("Baton's workers answer in text; tools are not supported")),
    ("tool_choice", Field::Refused("Baton's workers answer in text; tools are not supported")),
    ("max_tool_calls", Field::Refused("Baton's workers answer in text; tools are not supported")),
    ("include", Field::Refused("no extra output is available")),
    ("reasoning", Field::Refused("set a worker's reasoning effort in the pool file instead")),
    ("background", Field::Refused("responses run in the foreground")),
    ("conversation", Field::Refused("continue a conversation with previous_response_id or x-baton-conversation")),
    ("prompt", Field::Refused("stored prompts are not supported")),
    ("top_logprobs", Field::Refused("log probabilities are not available through a workflow")),
    ("stream_options", Field::Refused("stream options are not supported here")),
];

fn asks_for_nothing(name: &str, value: &Value) -> bool {
    match (name, value) {
        (_, Value::Null) => true,
        ("text", v) => v.get("format").is_none_or(|f| f.get("type").and_then(Value::as_str) == Some("text")),
        ("tools" | "include", Value::Array(a)) => a.is_empty(),
        ("tool_choice", Value::String(s)) => s == "none",
        ("background", Value::Bool(false)) => true,
        ("top_logprobs", v) => v.as_u64() == Some(0),
        _ => false,
    }
}

/// The text of an input message's content: a string, or `input_text` / `output_text` parts.
fn text_of(content: &Value, at: usize) -> Result<String, ApiError> {
    request::text_of(content, "input", at, &["input_text", "output_text", "text"])
}

fn parse(service: &Service, headers: &HeaderMap, bytes: &[u8]) -> Result<(Call, Echo), ApiError> {
    let body = request::object(bytes, "Responses", FIELDS, asks_for_nothing)?;
    let (model, worker) = request::model(service, &body)?;
    let mut sorted = Messages::default();
    sorted.instructions.extend(body.get("instructions").and_then(Value::as_str).map(str::to_owned));
    match body.get("input") {
        Some(Value::String(s)) => sorted.turns.push(Message::user(s.clone())),
        Some(Value::Array(items)) => {
            request::within_limit(service, "input", items.len(), "items")?;
            for (i, item) in items.iter().enumerate() {
                let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
                if kind != "message" {
                    return Err(ApiError::bad_field(
                        &format!("input[{i}].type"),
                        format!("only messages are supported as input, not `{kind}`"),
                    ));
                }
                let text = text_of(item.get("content").unwrap_or(&Value::Null), i)?;
                sorted.add("input", i, item.get("role").and_then(Value::as_str).unwrap_or(""), text)?;
            }
        }
        _ => return Err(ApiError::bad_field("input", "`input` is required: the question, or a list of messages")),
    }
    let (question, history, instructions) =
        sorted.split("input", "the last input message must be the user's question, and not empty")?;
    let max_tokens = request::output_tokens(&body, "max_output_tokens")?;
    let call = Call {
        model,
        worker,
        question,
        history,
        instructions: instructions.clone(),
        answer: request::answer(&body, max_tokens)?,
        stream: body.get("stream").and_then(Value::as_bool).unwrap_or(false),
        include_usage: true,
        budget: request::budget(headers)?,
        conversation: request::conversation(headers)?,
    };
    let previous = body.get("previous_response_id").and_then(Value::as_str).map(str::to_owned);
    Ok((call, Echo { previous, instructions }))
}

pub async fn create(
    axum::extract::State(service): axum::extract::State<Arc<Service>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let started = async {
        let bytes = handling::read_body(&service, body).await?;
        let (mut call, echo) = parse(&service, &headers, &bytes)?;
        // Parsed: the raw body need not wait in the queue beside its copy.
        drop(bytes);
        let permit = handling::admit(&service).await?;
        if let Some(store) = &service.store {
            if let Some(previous) = &echo.previous {
                continue_response(&service, store, previous, &mut call).await?;
            } else {
                call.conversation = handling::continued(&service, store, &call).await?;
            }
        } else if echo.previous.is_some() {
            return Err(ApiError::bad_field("previous_response_id", "this server keeps no history (--no-history)"));
        }
        // Held once the run's conversation is known: what it sends is part of its worst case.
        let hold = service.hold_for_run(&mut call)?;
        Ok::<_, ApiError>((handling::start(&service, call, permit, hold), echo))
    };
    let (run, echo) = match started.await {
        Ok(started) => started,
        Err(e) => return e.into_response(),
    };
    if run.stream { stream(run, echo).await } else { complete(run, echo).await }
}

/// Puts the conversation of the earlier response `previous` into `call`: refused when the
/// history holds no such response.
async fn continue_response(
    service: &Service,
    store: &baton_store::Store,
    previous: &str,
    call: &mut Call,
) -> Result<(), ApiError> {
    // The earlier response's conversation, as the history keeps it, comes before
    // whatever this request's input adds.
    let look = async || match previous.strip_prefix("resp_") {
        Some(uid) => store.run_by_uid(uid).await.map_err(handling::unreadable),
        None => Ok(None),
    };
    let mut found = look().await;
    if matches!(found, Ok(None)) {
        // The earlier response may have reached the client a moment before its run
        // was recorded.
        service.caught_up().await;
        found = look().await;
    }
    let Some((run, conversation)) = found? else {
        return Err(ApiError::not_found(
            Some("previous_response_id"),
            format!("there is no response {previous} in this server's history"),
        ));
    };
    let mut history = store.messages_through_run(conversation, run).await.map_err(handling::unreadable)?;
    history.append(&mut call.history);
    call.history = history;
    call.conversation = Some(conversation);
    Ok(())
}

/// What a response repeats of its request.
struct Echo {
    previous: Option<String>,
    instructions: Option<String>,
}

/// The Responses API's `usage`, with the conductor's share in the orchestration fields.
fn usage(totals: &Totals) -> Value {
    let all = totals.usage;
    let c = totals.conductor.usage;
    json!({
        "input_tokens": all.input_tokens,
        "input_tokens_details": {
            "cached_tokens": all.cached_input_tokens,
            "orchestration_input_tokens": c.input_tokens,
            "orchestration_input_cached_tokens": c.cached_input_tokens,
        },
        "output_tokens": all.output_tokens,
        "output_tokens_details": { "reasoning_tokens": 0, "orchestration_output_tokens": c.output_tokens },
        "total_tokens": all.input_tokens + all.output_tokens,
        "estimated": all.estimated,
    })
}

fn message(run: &Running, text: &str, status: &str) -> Value {
    let content: Vec<Value> = if status == "in_progress" && text.is_empty() {
        Vec::new()
    } else {
        vec![json!({ "type": "output_text", "text": text, "annotations": [] })]
    };
    json!({ "type": "message", "id": format!("msg_{}", run.run_id), "status": status, "role": "assistant", "content": content })
}

/// The response object, in any state.
fn response(run: &Running, echo: &Echo, status: &str, output: Vec<Value>, extra: Map<String, Value>) -> Value {
    let mut r = json!({
        "id": format!("resp_{}", run.run_id),
        "object": "response",
        "created_at": run.created,
        "status": status,
        "model": run.model,
        "output": output,
        "previous_response_id": echo.previous,
        "instructions": echo.instructions,
        "error": null,
        "incomplete_details": null,
        "parallel_tool_calls": false,
        "tool_choice": "none",
        "tools": [],
        "text": { "format": { "type": "text" } },
        "truncation": "disabled",
        "metadata": {},
    });
    r.as_object_mut().expect("an object").extend(extra);
    r
}

fn finished(
    run: &Running,
    echo: &Echo,
    progress: &Progress,
    end: Option<RunEvent>,
) -> Result<(Value, Totals), Box<(ApiError, Value)>> {
    match end {
        Some(RunEvent::RunFinished { answer, totals }) => {
            let mut extra = Map::new();
            extra.insert("usage".into(), usage(&totals));
            extra.insert("baton".into(), baton_object(run, progress, "finished", Some(&totals)));
            Ok((response(run, echo, "completed", vec![message(run, &answer, "completed")], extra), totals))
        }
        Some(RunEvent::RunFailed { error, totals }) => {
            let e = failure(Some(error.kind), &error.message, progress, &run.workers);
            Err(Box::new((e, baton_object(run, progress, "failed", Some(&totals)))))
        }
        Some(RunEvent::RunCancelled { totals }) => Err(Box::new((
            ApiError::internal("the run was cancelled before it answered"),
            baton_object(run, progress, "cancelled", Some(&totals)),
        ))),
        _ => Err(Box::new((ApiError::internal("the run ended without a result"), json!({ "run_id": run.run_id })))),
    }
}

async fn complete(mut run: Running, echo: Echo) -> Response {
    let (progress, end) = handling::wait(&mut run, |_| {}).await;
    let (mut out, cost) = match finished(&run, &echo, &progress, end) {
        Ok((body, totals)) => ((StatusCode::OK, axum::Json(body)).into_response(), Some(cost_text(&totals))),
        Err(failed) => {
            let (e, baton) = *failed;
            let mut body = e.body();
            body["baton"] = baton;
            let cost = body["baton"]["cost_usd"].as_f64().map(|c| format!("{c:.6}"));
            (e.into_response_with(body), cost)
        }
    };
    handling::run_headers(&mut out, &run.run_id, cost.as_deref());
    out
}

fn event(kind: &str, sequence: &mut u64, mut data: Value) -> String {
    data["type"] = json!(kind);
    data["sequence_number"] = json!(*sequence);
    *sequence += 1;
    format!("event: {kind}\ndata: {data}\n\n")
}

async fn stream(run: Running, echo: Echo) -> Response {
    // The head waits for the run's first events and goes out with them and the opening events
    // in one write (as a chat completion's stream does).
    let mut at = Sent::default();
    let created = response(&run, &echo, "in_progress", vec![], Map::new());
    let mut opening = event("response.created", &mut at.seq, json!({ "response": created }));
    opening.push_str(&event("response.in_progress", &mut at.seq, json!({ "response": created })));
    handling::stream(run, ResponseStream { echo, progress: Progress::default(), at }, opening).await
}

/// A Responses stream's state between writes: what the response repeats of its request, what
/// the client is shown of the run, and what has been sent.
struct ResponseStream {
    echo: Echo,
    progress: Progress,
    at: Sent,
}

impl StreamFormat for ResponseStream {
    fn show(&mut self, run: &Running, event: RunEvent, out: &mut String) -> bool {
        on_event(run, &self.echo, &mut self.progress, &mut self.at, event, out)
    }

    /// A run whose events end without its terminal one ends the stream with `response.failed`.
    fn cut_off(&mut self, run: &Running, out: &mut String) {
        let failed = failed_response(run, &self.echo, &ApiError::internal("the run ended without a result"));
        out.push_str(&event("response.failed", &mut self.at.seq, json!({ "response": failed })));
    }
}

/// The response object of a run that failed with `e`.
fn failed_response(run: &Running, echo: &Echo, e: &ApiError) -> Value {
    let mut failed = response(run, echo, "failed", vec![], Map::new());
    failed["error"] = json!({ "code": e.code.unwrap_or(e.kind), "message": e.message });
    failed
}

/// What a Responses stream has sent so far.
#[derive(Debug, Default)]
struct Sent {
    /// The next event's `sequence_number`.
    seq: u64,
    /// The answer's text so far.
    text: String,
}

/// Adds to `out` what `ev` shows the client; true when the stream is over (the terminal event
/// went out).
fn on_event(
    run: &Running,
    echo: &Echo,
    progress: &mut Progress,
    at: &mut Sent,
    ev: RunEvent,
    out: &mut String,
) -> bool {
    let item = format!("msg_{}", run.run_id);
    if let Some(note) = progress.see(&ev, &run.workers) {
        out.push_str(&event("baton.progress", &mut at.seq, json!({ "run_id": run.run_id, "text": note })));
    }
    match ev {
        RunEvent::StepDelta { round, step, text: piece } if Some((round, step)) == progress.run.answer_step() => {
            if at.text.is_empty() {
                out.push_str(&open(run, &item, &mut at.seq));
            }
            at.text.push_str(&piece);
            out.push_str(&event(
                "response.output_text.delta",
                &mut at.seq,
                json!({ "item_id": item, "output_index": 0, "content_index": 0, "delta": piece, "logprobs": [] }),
            ));
        }
        RunEvent::StepRetrying { round, step, .. }
            if Some((round, step)) == progress.run.answer_step() && !at.text.is_empty() =>
        {
            at.text.push_str(handling::RESTARTED);
            out.push_str(&event(
                "response.output_text.delta",
                &mut at.seq,
                json!({ "item_id": item, "output_index": 0, "content_index": 0, "delta": handling::RESTARTED, "logprobs": [] }),
            ));
        }
        end if end.is_terminal() => {
            match finished(run, echo, progress, Some(end)) {
                Ok((body, _)) => {
                    let answer = body["output"][0]["content"][0]["text"].as_str().unwrap_or_default().to_owned();
                    if at.text.is_empty() {
                        out.push_str(&open(run, &item, &mut at.seq));
                        if !answer.is_empty() {
                            out.push_str(&event(
                                "response.output_text.delta",
                                &mut at.seq,
                                json!({ "item_id": item, "output_index": 0, "content_index": 0, "delta": answer, "logprobs": [] }),
                            ));
                        }
                    }
                    let part = json!({ "type": "output_text", "text": answer, "annotations": [] });
                    out.push_str(&event(
                        "response.output_text.done",
                        &mut at.seq,
                        json!({ "item_id": item, "output_index": 0, "content_index": 0, "text": answer, "logprobs": [] }),
                    ));
                    out.push_str(&event(
                        "response.content_part.done",
                        &mut at.seq,
                        json!({ "item_id": item, "output_index": 0, "content_index": 0, "part": part }),
                    ));
                    out.push_str(&event(
                        "response.output_item.done",
                        &mut at.seq,
                        json!({ "output_index": 0, "item": body["output"][0] }),
                    ));
                    out.push_str(&event("response.completed", &mut at.seq, json!({ "response": body })));
                }
                Err(failure) => {
                    let (e, baton) = *failure;
                    let mut failed = failed_response(run, echo, &e);
                    failed["baton"] = baton;
                    out.push_str(&event("response.failed", &mut at.seq, json!({ "response": failed })));
                }
            }
            return true;
        }
        _ => {}
    }
    false
}

/// The output item and its text part, opened.
fn open(run: &Running, item: &str, seq: &mut u64) -> String {
    let mut out =
        event("response.output_item.added", seq, json!({ "output_index": 0, "item": message(run, "", "in_progress") }));
    out.push_str(&event(
        "response.content_part.added",
        seq,
        json!({ "item_id": item, "output_index": 0, "content_index": 0, "part": { "type": "output_text", "text": "", "annotations": [] } }),
    ));
    out
}

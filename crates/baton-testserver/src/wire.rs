//! The three wire formats' answers: streamed events, whole bodies and error bodies, shaped as
//! the providers document them.

use std::collections::BTreeMap;

use axum::body::{Body, Bytes};
use axum::http::{StatusCode, header};
use axum::response::Response;
use serde_json::{Value, json};

use crate::Script;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Wire {
    OpenAi,
    Anthropic,
    Gemini,
}

impl Wire {
    pub fn as_str(self) -> &'static str {
        match self {
            Wire::OpenAi => "openai",
            Wire::Anthropic => "anthropic",
            Wire::Gemini => "gemini",
        }
    }
}

/// The key the request carries in its wire's auth header.
pub(crate) fn presented_key(wire: Wire, headers: &BTreeMap<String, String>) -> Option<String> {
    match wire {
        Wire::OpenAi => headers.get("authorization").and_then(|v| v.strip_prefix("Bearer ")).map(str::to_owned),
        Wire::Anthropic => headers.get("x-api-key").cloned(),
        Wire::Gemini => headers.get("x-goog-api-key").cloned(),
    }
}

/// The wire's answer to a wrong key. The OpenAI one echoes the key it got, as some
/// compatible proxies do, so tests can prove Baton keeps it out of its own messages.
pub(crate) fn auth_error(wire: Wire, presented: Option<&str>) -> Response {
    match wire {
        Wire::OpenAi => json_response(
            StatusCode::UNAUTHORIZED,
            json!({"error": {"message": format!("Incorrect API key provided: {}. You can find your API key at https://platform.openai.com/account/api-keys.", presented.unwrap_or("(none)")), "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}}),
            None,
        ),
        Wire::Anthropic => json_response(
            StatusCode::UNAUTHORIZED,
            json!({"type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key"}}),
            None,
        ),
        // Gemini answers a bad key with 400 INVALID_ARGUMENT and reason API_KEY_INVALID.
        Wire::Gemini => json_response(
            StatusCode::BAD_REQUEST,
            json!({"error": {"code": 400, "message": "API key not valid. Please pass a valid API key.", "status": "INVALID_ARGUMENT",
                "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "API_KEY_INVALID", "domain": "googleapis.com"}]}}),
            None,
        ),
    }
}

/// The wire's error body for `status`, as its provider sends it.
pub(crate) fn error_response(
    wire: Wire,
    status: StatusCode,
    _hint: &str,
    message: &str,
    retry_after: Option<&str>,
) -> Response {
    let code = status.as_u16();
    let body = match wire {
        Wire::OpenAi => {
            let (kind, code_str, msg) = match code {
                400 => (
                    "invalid_request_error",
                    Some("context_length_exceeded"),
                    "This model's maximum context length is 128000 tokens. However, your messages resulted in 131072 tokens. Please reduce the length of the messages.",
                ),
                401 => return auth_error(wire, None),
                404 => (
                    "invalid_request_error",
                    Some("model_not_found"),
                    "The model does not exist or you do not have access to it.",
                ),
                429 => (
                    "requests",
                    Some("rate_limit_exceeded"),
                    "Rate limit reached for requests per min (RPM): Limit 3, Used 3, Requested 1. Please try again in 20s.",
                ),
                500 => {
                    ("server_error", None, "The server had an error while processing your request. Sorry about that!")
                }
                503 => ("server_error", None, "The engine is currently overloaded, please try again later"),
                _ => ("server_error", None, message),
            };
            json!({"error": {"message": msg, "type": kind, "param": null, "code": code_str}})
        }
        Wire::Anthropic => {
            let (kind, msg) = match code {
                400 => ("invalid_request_error", "prompt is too long: 212345 tokens > 200000 maximum"),
                401 => ("authentication_error", "invalid x-api-key"),
                403 => ("permission_error", "Your API key does not have permission to use the specified resource."),
                404 => ("not_found_error", "The requested resource could not be found."),
                413 => ("request_too_large", "Request exceeds the maximum allowed number of bytes."),
                429 => ("rate_limit_error", "Number of request tokens has exceeded your per-minute rate limit"),
                500 => ("api_error", "An unexpected error has occurred internal to Anthropic's systems."),
                529 => ("overloaded_error", "Overloaded"),
                _ => ("api_error", message),
            };
            json!({"type": "error", "error": {"type": kind, "message": msg}})
        }
        Wire::Gemini => {
            let (status_name, msg) = match code {
                400 => (
                    "INVALID_ARGUMENT",
                    "The input token count (1200000) exceeds the maximum number of tokens allowed (1048576).",
                ),
                401 | 403 => return auth_error(wire, None),
                404 => (
                    "NOT_FOUND",
                    "models/unknown is not found for API version v1beta, or is not supported for generateContent.",
                ),
                429 => (
                    "RESOURCE_EXHAUSTED",
                    "You exceeded your current quota, please check your plan and billing details.",
                ),
                500 => (
                    "INTERNAL",
                    "An internal error has occurred. Please retry or report in https://developers.generativeai.google/guide/troubleshooting",
                ),
                503 => ("UNAVAILABLE", "The model is overloaded. Please try again later."),
                _ => ("UNKNOWN", message),
            };
            let mut details = vec![];
            if let (429, Some(after)) = (code, retry_after) {
                details.push(
                    json!({"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": format!("{after}s")}),
                );
            }
            json!({"error": {"code": code, "message": msg, "status": status_name, "details": details}})
        }
    };
    let retry_after = if matches!(code, 429 | 503 | 529) { retry_after } else { None };
    json_response(status, body, retry_after)
}

fn json_response(status: StatusCode, body: Value, retry_after: Option<&str>) -> Response {
    let mut builder = Response::builder().status(status).header(header::CONTENT_TYPE, "application/json");
    if let Some(after) = retry_after {
        builder = builder.header(header::RETRY_AFTER, after);
    }
    builder.body(Body::from(body.to_string())).unwrap_or_default()
}

/// The conversation as the server sees it: last user text, earlier answers, prompt size.
struct Conversation {
    last_user: String,
    prompt_chars: usize,
    thinking: bool,
    include_usage: bool,
    system: String,
    /// Role, text, and whether the turn carries an Anthropic `cache_control` breakpoint.
    turns: Vec<(String, String, bool)>,
    /// The request's output cap, in the wire's own field.
    max_tokens: Option<u64>,
}

/// The prompt cache as one request sees it: prefixes (system and whole turns) the server has
/// seen, as OpenAI and Gemini cache them on their own, and as Anthropic caches them at
/// `cache_control` breakpoints. A prefix is cached from `min` tokens (a token is four characters
/// here, as in the usage figures).
pub(crate) struct CacheView<'a> {
    set: &'a std::sync::Mutex<std::collections::HashSet<u64>>,
    name: String,
    min: u64,
}

impl<'a> CacheView<'a> {
    pub(crate) fn new(set: &'a std::sync::Mutex<std::collections::HashSet<u64>>, script: &Script) -> Self {
        CacheView { set, name: script.name.clone(), min: script.cache_min.unwrap_or(1024) }
    }

    /// Tokens read from and written to the cache by this request, and the cache updated.
    fn apply(&self, wire: Wire, conv: &Conversation) -> (u64, u64) {
        use std::hash::{Hash, Hasher};
        let mut prefixes = Vec::with_capacity(conv.turns.len());
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        (wire.as_str(), &self.name, &conv.system).hash(&mut hasher);
        let mut chars = conv.system.len();
        for (role, text, breakpoint) in &conv.turns {
            (role, text).hash(&mut hasher);
            chars += text.len();
            prefixes.push((hasher.finish(), chars as u64 / 4, *breakpoint));
        }
        let Ok(mut set) = self.set.lock() else { return (0, 0) };
        let cacheable = |tokens: u64| tokens >= self.min && tokens > 0;
        let hit = |upto: usize| {
            prefixes[..upto].iter().filter(|(h, t, _)| cacheable(*t) && set.contains(h)).map(|p| p.1).max().unwrap_or(0)
        };
        match wire {
            Wire::Anthropic => {
                let Some(last) = prefixes.iter().rposition(|(_, t, b)| *b && cacheable(*t)) else { return (0, 0) };
                let read = hit(last + 1);
                let written = prefixes[last].1 - read;
                for (h, t, b) in &prefixes {
                    if *b && cacheable(*t) {
                        set.insert(*h);
                    }
                }
                (read, written)
            }
            Wire::OpenAi | Wire::Gemini => {
                let read = hit(prefixes.len());
                for (h, t, _) in &prefixes {
                    if cacheable(*t) {
                        set.insert(*h);
                    }
                }
                (read, 0)
            }
        }
    }
}

fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(blocks) => blocks.iter().filter_map(|b| b.get("text").and_then(Value::as_str)).collect(),
        _ => String::new(),
    }
}

fn conversation(wire: Wire, body: &Value) -> Conversation {
    let empty = vec![];
    let (turns, assistant_role, content_key) = match wire {
        Wire::OpenAi | Wire::Anthropic => (body["messages"].as_array().unwrap_or(&empty), "assistant", "content"),
        Wire::Gemini => (body["contents"].as_array().unwrap_or(&empty), "model", "parts"),
    };
    let mut last_user = String::new();
    let mut prompt_chars = 0;
    let mut system = match wire {
        Wire::OpenAi => String::new(),
        Wire::Anthropic => text_of(&body["system"]),
        Wire::Gemini => text_of(&body["systemInstruction"]["parts"]),
    };
    prompt_chars += system.len();
    let mut kept = Vec::new();
    for turn in turns {
        let text = text_of(&turn[content_key]);
        prompt_chars += text.len();
        let breakpoint =
            turn[content_key].as_array().is_some_and(|blocks| blocks.iter().any(|b| b.get("cache_control").is_some()));
        if turn["role"] == "system" {
            system.push_str(&text);
            continue;
        }
        if turn["role"] != assistant_role {
            last_user = text.clone();
        }
        kept.push((turn["role"].as_str().unwrap_or_default().to_owned(), text, breakpoint));
    }
    let max_tokens = match wire {
        Wire::OpenAi => body["max_completion_tokens"].as_u64().or(body["max_tokens"].as_u64()),
        Wire::Anthropic => body["max_tokens"].as_u64(),
        Wire::Gemini => body["generationConfig"]["maxOutputTokens"].as_u64(),
    };
    let thinking = match wire {
        Wire::OpenAi => body.get("reasoning_effort").is_some(),
        Wire::Anthropic => body.get("thinking").is_some(),
        Wire::Gemini => body["generationConfig"].get("thinkingConfig").is_some(),
    };
    let include_usage = body["stream_options"]["include_usage"].as_bool().unwrap_or(false);
    Conversation { last_user, prompt_chars, thinking, include_usage, system, turns: kept, max_tokens }
}

/// What a call shares with the server: `hangups` counts streams the client closed before their
/// end, `cache` is the prompt cache, `reported` the usage this call has reported so far.
pub(crate) struct CallState<'a> {
    pub(crate) hangups: std::sync::Arc<std::sync::atomic::AtomicU32>,
    pub(crate) cache: CacheView<'a>,
    pub(crate) reported: std::sync::Arc<std::sync::Mutex<crate::Reported>>,
}

pub(crate) async fn respond(
    wire: Wire,
    script: &Script,
    call: u32,
    body: &Value,
    stream: bool,
    state: CallState<'_>,
) -> Response {
    let CallState { hangups, cache, reported } = state;
    let mut wait = script.ttfb;
    if let Some((slow, n)) = script.slow
        && call < n
    {
        wait += slow;
    }
    tokio::time::sleep(wait).await;

    if let Some((status, n)) = script.fail
        && call < n
    {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return error_response(wire, status, "", "scripted failure", script.retry_after.as_deref());
    }
    if call < script.garbage {
        let mut builder = Response::builder().status(StatusCode::OK);
        builder = builder.header(header::CONTENT_TYPE, if stream { "text/event-stream" } else { "application/json" });
        let junk =
            if stream { "data: <html>upstream proxy error</html>\n\n" } else { "<html>upstream proxy error</html>" };
        return builder.body(Body::from(junk)).unwrap_or_default();
    }

    let conv = conversation(wire, body);
    let text = match script.plan {
        Some(_) => {
            let asked: Vec<&str> =
                conv.turns.iter().filter(|(role, ..)| role == "user").map(|(_, t, _)| t.as_str()).collect();
            script.plan(&format!("{}\n{}", conv.system, asked.join("\n")), call).unwrap_or_default()
        }
        None => {
            let earlier: Vec<&str> = conv
                .turns
                .iter()
                .filter(|(role, ..)| role == "assistant" || role == "model")
                .map(|(_, t, _)| t.as_str())
                .collect();
            script.answer(&conv.last_user, &earlier)
        }
    };
    let thinking_tokens = if conv.thinking { 7 } else { 0 };
    let mut pieces = script.pieces(&text);
    // A provider stops at the request's output cap.
    if let Some(cap) = conv.max_tokens {
        pieces.truncate(cap.saturating_sub(thinking_tokens).max(1) as usize);
    }
    let text: String = pieces.concat();
    let (usage_in, usage_out) = if script.usage_max {
        let turns = conv.turns.len() as u64 + u64::from(!conv.system.is_empty());
        (conv.prompt_chars as u64 + 3 * turns, conv.max_tokens.unwrap_or(4096).max(1))
    } else {
        (conv.prompt_chars.div_ceil(4) as u64, pieces.len() as u64 + thinking_tokens)
    };
    let (cached, written) = cache.apply(wire, &conv);
    let full = crate::Reported {
        input_tokens: usage_in,
        cached_input_tokens: cached,
        cache_write_input_tokens: written,
        output_tokens: usage_out,
    };
    // Anthropic's input_tokens are only those after the last breakpoint.
    let anthropic_in = usage_in - cached - written;
    let model = script.name.clone();

    if !stream {
        tokio::time::sleep(script.latency).await;
        let body = match wire {
            Wire::OpenAi => json!({
                "id": "chatcmpl-test", "object": "chat.completion", "created": 0, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": null}, "logprobs": null, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": usage_in, "completion_tokens": usage_out, "total_tokens": usage_in + usage_out,
                    "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0}},
            }),
            Wire::Anthropic => {
                let mut content = vec![];
                if conv.thinking {
                    content.push(json!({"type": "thinking", "thinking": "Let me think.", "signature": "sig"}));
                }
                content.push(json!({"type": "text", "text": text}));
                json!({
                    "id": "msg_test", "type": "message", "role": "assistant", "model": model, "content": content,
                    "stop_reason": "end_turn", "stop_sequence": null,
                    "usage": {"input_tokens": anthropic_in, "output_tokens": usage_out,
                        "cache_creation_input_tokens": written, "cache_read_input_tokens": cached},
                })
            }
            Wire::Gemini => {
                let mut parts = vec![];
                if conv.thinking {
                    parts.push(json!({"text": "Let me think.", "thought": true}));
                }
                parts.push(json!({"text": text}));
                json!({
                    "candidates": [{"content": {"parts": parts, "role": "model"}, "finishReason": "STOP", "index": 0}],
                    "usageMetadata": {"promptTokenCount": usage_in, "candidatesTokenCount": usage_out - thinking_tokens, "totalTokenCount": usage_in + usage_out,
                        "thoughtsTokenCount": thinking_tokens, "cachedContentTokenCount": cached},
                    "modelVersion": model,
                })
            }
        };
        if let Ok(mut r) = reported.lock() {
            *r = full;
        }
        return json_response(StatusCode::OK, body, None);
    }

    let events = stream_events(wire, &model, &pieces, &conv, full, thinking_tokens);
    // The last piece of text arrives `latency` after the headers.
    let delay = script.latency / (pieces.len().max(1) as u32);
    let cut = call < script.cut;
    let stream_error = call < script.stream_error;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    tokio::spawn(async move {
        let total = events.len();
        // Pieces go out on a schedule, not after a fixed sleep each: one sent late (a busy
        // machine, the timer's millisecond steps) does not push the later ones back, so
        // `lines=4000;latency=20000` really is 200 pieces a second.
        let start = tokio::time::Instant::now();
        let mut texts_sent = 0u32;
        for (i, event) in events.into_iter().enumerate() {
            let is_text = event.text;
            if is_text {
                texts_sent += 1;
                tokio::time::sleep_until(start + delay * texts_sent).await;
            }
            if cut && i == total / 2 {
                // Half an event, then the connection ends.
                let partial: String = event.bytes.chars().take(event.bytes.len() / 2).collect();
                let _ = tx.send(Ok(Bytes::from(partial))).await;
                return;
            }
            // Recorded before it is sent, so a client that has read it never finds it missing.
            if let (Some(usage), Ok(mut r)) = (event.usage, reported.lock()) {
                *r = usage;
            }
            if tx.send(Ok(Bytes::from(event.bytes))).await.is_err() {
                hangups.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                return;
            }
            if is_text && stream_error {
                let _ = tx.send(Ok(Bytes::from(in_stream_error(wire)))).await;
                return;
            }
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)))
        .unwrap_or_default()
}

struct Event {
    bytes: String,
    /// Carries answer text (the scripted latency is spent after these).
    text: bool,
    /// The usage a client has been told once this event is sent, when it carries usage.
    usage: Option<crate::Reported>,
}

fn data(value: Value) -> Event {
    Event { bytes: format!("data: {value}\n\n"), text: false, usage: None }
}

fn named(name: &str, value: Value) -> Event {
    Event { bytes: format!("event: {name}\ndata: {value}\n\n"), text: false, usage: None }
}

fn with_usage(mut e: Event, usage: crate::Reported) -> Event {
    e.usage = Some(usage);
    e
}

fn text(mut e: Event) -> Event {
    e.text = true;
    e
}

fn stream_events(
    wire: Wire,
    model: &str,
    pieces: &[String],
    conv: &Conversation,
    full: crate::Reported,
    thinking_tokens: u64,
) -> Vec<Event> {
    let usage_in = full.input_tokens;
    let usage_out = full.output_tokens;
    let cached = full.cached_input_tokens;
    let written = full.cache_write_input_tokens;
    let mut out = Vec::new();
    match wire {
        Wire::OpenAi => {
            let chunk = |delta: Value, finish: Value| {
                json!({"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 0, "model": model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]})
            };
            out.push(data(chunk(json!({"role": "assistant", "content": "", "refusal": null}), Value::Null)));
            for p in pieces {
                out.push(text(data(chunk(json!({"content": p}), Value::Null))));
            }
            out.push(data(chunk(json!({}), json!("stop"))));
            if conv.include_usage {
                out.push(with_usage(data(json!({"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 0, "model": model, "choices": [],
                    "usage": {"prompt_tokens": usage_in, "completion_tokens": usage_out, "total_tokens": usage_in + usage_out,
                        "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
                        "completion_tokens_details": {"reasoning_tokens": thinking_tokens}}})), full));
            }
            out.push(Event { bytes: "data: [DONE]\n\n".to_owned(), text: false, usage: None });
        }
        Wire::Anthropic => {
            let anthropic_in = usage_in - cached - written;
            out.push(with_usage(named("message_start", json!({"type": "message_start", "message": {"id": "msg_test", "type": "message", "role": "assistant",
                "content": [], "model": model, "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": anthropic_in, "output_tokens": 1,
                    "cache_creation_input_tokens": written, "cache_read_input_tokens": cached}}})), crate::Reported { output_tokens: 1, ..full }));
            let mut index = 0;
            if conv.thinking {
                out.push(named("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}})));
                out.push(named("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Let me think."}})));
                out.push(named("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "sig"}})));
                out.push(named("content_block_stop", json!({"type": "content_block_stop", "index": 0})));
                index = 1;
            }
            out.push(named(
                "content_block_start",
                json!({"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}),
            ));
            out.push(named("ping", json!({"type": "ping"})));
            for p in pieces {
                out.push(text(named(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": p}}),
                )));
            }
            out.push(named("content_block_stop", json!({"type": "content_block_stop", "index": index})));
            out.push(with_usage(named("message_delta", json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null}, "usage": {"output_tokens": usage_out}})), full));
            out.push(named("message_stop", json!({"type": "message_stop"})));
        }
        Wire::Gemini => {
            if conv.thinking {
                out.push(with_usage(data(json!({"candidates": [{"content": {"parts": [{"text": "Let me think.", "thought": true}], "role": "model"}, "index": 0}],
                    "usageMetadata": {"promptTokenCount": usage_in, "totalTokenCount": usage_in, "cachedContentTokenCount": cached}, "modelVersion": model})),
                    crate::Reported { output_tokens: 0, ..full }));
            }
            let last = pieces.len().saturating_sub(1);
            for (i, p) in pieces.iter().enumerate() {
                let mut candidate = json!({"content": {"parts": [{"text": p}], "role": "model"}, "index": 0});
                let candidates = if i == last { usage_out - thinking_tokens } else { i as u64 + 1 };
                let mut usage = json!({"promptTokenCount": usage_in, "candidatesTokenCount": candidates,
                    "totalTokenCount": usage_in + candidates, "cachedContentTokenCount": cached});
                let mut seen = crate::Reported { output_tokens: candidates, ..full };
                if i == last {
                    candidate["finishReason"] = json!("STOP");
                    usage["thoughtsTokenCount"] = json!(thinking_tokens);
                    seen = full;
                }
                out.push(with_usage(
                    text(data(json!({"candidates": [candidate], "usageMetadata": usage, "modelVersion": model, "responseId": "resp-test"}))),
                    seen,
                ));
            }
        }
    }
    out
}

fn in_stream_error(wire: Wire) -> String {
    match wire {
        Wire::OpenAi => format!(
            "data: {}\n\n",
            json!({"error": {"message": "The server had an error while processing your request.", "type": "server_error", "param": null, "code": null}})
        ),
        Wire::Anthropic => format!(
            "event: error\ndata: {}\n\n",
            json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
        ),
        Wire::Gemini => format!(
            "data: {}\n\n",
            json!({"error": {"code": 503, "message": "The model is overloaded. Please try again later.", "status": "UNAVAILABLE"}})
        ),
    }
}

//! Anthropic Messages (`POST {base_url}/v1/messages`).

use reqwest::header::HeaderMap;
use serde::{Deserialize, Serialize};

use crate::http::{self, Call, StreamParser};
use crate::sse::SseEvent;
use crate::{ChatEvent, ChatRequest, ChatStream, ErrorKind, ProviderError, Role, Usage};

pub const DEFAULT_BASE_URL: &str = "https://api.anthropic.com";
pub const API_VERSION: &str = "2023-06-01";

#[derive(Debug, Serialize)]
pub struct Request<'a> {
    pub model: &'a str,
    pub max_tokens: u32,
    pub messages: Vec<RequestMessage<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub system: Option<&'a str>,
    pub stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thinking: Option<Thinking>,
}

#[derive(Debug, Serialize)]
pub struct RequestMessage<'a> {
    pub role: &'static str,
    pub content: Content<'a>,
}

/// A turn's content: plain text, or one text block carrying a cache breakpoint.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Content<'a> {
    Text(&'a str),
    Blocks([TextBlock<'a>; 1]),
}

#[derive(Debug, Serialize)]
pub struct TextBlock<'a> {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub text: &'a str,
    pub cache_control: CacheControl,
}

#[derive(Debug, Serialize)]
pub struct CacheControl {
    #[serde(rename = "type")]
    pub kind: &'static str,
}

/// A prefix shorter than this many bytes gets no breakpoint. Anthropic caches prefixes of at
/// least 1,024 tokens (more on some models) and ignores shorter ones; at roughly four bytes a
/// token this is where caching can start.
pub const CACHE_MIN_PREFIX_BYTES: usize = 4096;

/// Which turns carry a cache breakpoint: the last (a later step that sees this whole step,
/// its subtask included, reads it: a chain, an `"all"` plan) and the one before it (steps that
/// see the same earlier work read it: a fan-out). Both cost what one would: tokens are written
/// once, at the first breakpoint that covers them. None when caching is off, and none on a
/// prefix too short to be cached.
fn cache_breakpoints(req: &ChatRequest, enabled: bool) -> [Option<usize>; 2] {
    if !enabled {
        return [None, None];
    }
    let mut bytes = req.system.as_ref().map_or(0, String::len);
    let mut ends = Vec::with_capacity(req.messages.len());
    for m in &req.messages {
        bytes += m.content.len();
        ends.push(bytes);
    }
    let at = |i: Option<usize>| i.filter(|&i| ends[i] >= CACHE_MIN_PREFIX_BYTES);
    let n = req.messages.len();
    [at(n.checked_sub(1)), at(n.checked_sub(2))]
}

#[derive(Debug, Serialize)]
pub struct Thinking {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub budget_tokens: u32,
}

/// A streamed event's payload; its `type` repeats the SSE `event:` name.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StreamEvent {
    MessageStart {
        message: MessageStart,
    },
    ContentBlockStart {},
    ContentBlockDelta {
        delta: ContentDelta,
    },
    ContentBlockStop {},
    MessageDelta {
        delta: MessageDeltaBody,
        usage: Option<WireUsage>,
    },
    MessageStop,
    Ping,
    Error {
        error: WireError,
    },
    #[serde(other)]
    Unknown,
}

#[derive(Debug, Deserialize)]
pub struct MessageStart {
    pub usage: Option<WireUsage>,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentDelta {
    TextDelta {
        text: String,
    },
    /// Extended thinking: billed as output, not part of the answer.
    ThinkingDelta {},
    SignatureDelta {},
    #[serde(other)]
    Other,
}

#[derive(Debug, Deserialize)]
pub struct MessageDeltaBody {
    pub stop_reason: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, Deserialize)]
pub struct WireUsage {
    pub input_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    pub cache_creation_input_tokens: Option<u64>,
    pub cache_read_input_tokens: Option<u64>,
}

/// A non-streamed answer.
#[derive(Debug, Deserialize)]
pub struct Response {
    pub content: Vec<ContentBlock>,
    pub stop_reason: Option<String>,
    pub usage: WireUsage,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentBlock {
    Text {
        text: String,
    },
    #[serde(other)]
    Other,
}

#[derive(Debug, Deserialize)]
pub struct ErrorBody {
    pub error: WireError,
}

#[derive(Debug, Deserialize)]
pub struct WireError {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub message: String,
}

impl WireError {
    fn into_error(self, status: Option<u16>, headers: Option<&HeaderMap>) -> ProviderError {
        let kind = match self.kind.as_str() {
            "authentication_error" | "permission_error" | "billing_error" => ErrorKind::Auth,
            "rate_limit_error" => ErrorKind::RateLimited,
            "overloaded_error" | "api_error" => ErrorKind::Overloaded,
            "timeout_error" => ErrorKind::Timeout,
            "request_too_large" => ErrorKind::ContextTooLong,
            "invalid_request_error" if http::mentions_context_limit(&self.message) => ErrorKind::ContextTooLong,
            "invalid_request_error" | "not_found_error" => ErrorKind::BadRequest,
            _ => status.map_or(ErrorKind::Overloaded, http::kind_for_status),
        };
        let message = if self.message.is_empty() { self.kind } else { self.message };
        http::wire_error(kind, message, status, headers)
    }
}

/// Maps an HTTP error answer, reading Anthropic's `{"type":"error","error":{...}}` body.
pub fn classify(status: u16, headers: &HeaderMap, body: &str) -> ProviderError {
    match serde_json::from_str::<ErrorBody>(body) {
        Ok(b) => b.error.into_error(Some(status), Some(headers)),
        Err(_) => http::unrecognized_error(status, headers, body),
    }
}

pub(crate) fn request_body<'a>(call: &Call<'a>, req: &'a ChatRequest) -> Request<'a> {
    let s = call.settings;
    let thinking = s.thinking_budget.map(|budget_tokens| Thinking { kind: "enabled", budget_tokens });
    let max_tokens = req.max_tokens.unwrap_or(s.max_tokens);
    let breakpoints = cache_breakpoints(req, s.prompt_cache);
    Request {
        model: &s.model,
        // With thinking on, max_tokens must exceed the thinking budget.
        max_tokens: match s.thinking_budget {
            Some(budget) if req.max_tokens.is_none() => max_tokens.max(budget + 1),
            _ => max_tokens,
        },
        messages: req
            .messages
            .iter()
            .enumerate()
            .map(|(i, m)| RequestMessage {
                role: match m.role {
                    Role::User => "user",
                    Role::Assistant => "assistant",
                },
                content: if breakpoints.contains(&Some(i)) {
                    Content::Blocks([TextBlock {
                        kind: "text",
                        text: &m.content,
                        cache_control: CacheControl { kind: "ephemeral" },
                    }])
                } else {
                    Content::Text(&m.content)
                },
            })
            .collect(),
        system: req.system.as_deref(),
        stream: s.stream,
        // Anthropic rejects temperature and top_p together with thinking.
        temperature: if thinking.is_some() { None } else { req.temperature.or(s.temperature) },
        top_p: if thinking.is_some() { None } else { req.top_p.or(s.top_p) },
        thinking: if req.max_tokens.is_some() { None } else { thinking },
    }
}

pub(crate) async fn stream(call: Call<'_>, req: &ChatRequest) -> Result<ChatStream, ProviderError> {
    let body = request_body(&call, req);
    let mut builder =
        call.http.post(format!("{}/v1/messages", call.base_url)).header("anthropic-version", API_VERSION).json(&body);
    if let Some(key) = call.key {
        builder = builder.header("x-api-key", key.expose());
    }
    let response = http::send(builder, classify).await?;
    if call.settings.stream {
        Ok(http::sse_stream(response, Parser::default(), call.settings.idle_timeout))
    } else {
        let body: Response = http::json_body(response).await?;
        let text: String = body
            .content
            .into_iter()
            .filter_map(|b| match b {
                ContentBlock::Text { text } => Some(text),
                ContentBlock::Other => None,
            })
            .collect();
        let mut usage = Usage::default();
        add_usage(&mut usage, body.usage);
        Ok(http::finished_stream(text, ChatEvent::Done { usage, stop_reason: body.stop_reason }))
    }
}

/// Anthropic's `input_tokens` are only the tokens after the last cache breakpoint; cache reads
/// and writes come apart. `Usage` counts all input, with reads and writes as parts of it.
fn add_usage(usage: &mut Usage, wire: WireUsage) {
    let read = wire.cache_read_input_tokens.unwrap_or(0);
    let written = wire.cache_creation_input_tokens.unwrap_or(0);
    let input = wire.input_tokens.unwrap_or(0) + written + read;
    if input > 0 {
        usage.input_tokens = input;
        usage.cached_input_tokens = read;
        usage.cache_write_input_tokens = written;
    }
    // output_tokens in message_delta is cumulative.
    if let Some(out) = wire.output_tokens {
        usage.output_tokens = out;
    }
}

#[derive(Debug, Default)]
struct Parser {
    usage: Usage,
    stop_reason: Option<String>,
}

impl StreamParser for Parser {
    fn event(&mut self, event: SseEvent, out: &mut Vec<ChatEvent>) -> Result<bool, ProviderError> {
        let parsed: StreamEvent = http::decode("stream event", &event.data)?;
        match parsed {
            StreamEvent::MessageStart { message } => {
                // Its output count is a placeholder (1), not output: a stream cut after it
                // must be estimated from the text that came, not billed for one token.
                if let Some(u) = message.usage {
                    add_usage(&mut self.usage, WireUsage { output_tokens: None, ..u });
                }
            }
            StreamEvent::ContentBlockDelta { delta: ContentDelta::TextDelta { text } } => {
                if !text.is_empty() {
                    out.push(ChatEvent::Text(text));
                }
            }
            StreamEvent::MessageDelta { delta, usage } => {
                if let Some(u) = usage {
                    add_usage(&mut self.usage, u);
                }
                if delta.stop_reason.is_some() {
                    self.stop_reason = delta.stop_reason;
                }
            }
            StreamEvent::MessageStop => {
                out.push(ChatEvent::Done { usage: self.usage, stop_reason: self.stop_reason.take() });
                return Ok(true);
            }
            StreamEvent::Error { error } => return Err(error.into_error(None, None)),
            StreamEvent::ContentBlockStart {}
            | StreamEvent::ContentBlockDelta { .. }
            | StreamEvent::ContentBlockStop {}
            | StreamEvent::Ping
            | StreamEvent::Unknown => {}
        }
        Ok(false)
    }

    fn end_of_stream(&mut self) -> Result<ChatEvent, ProviderError> {
        Err(ProviderError::cut_stream())
    }

    fn usage_so_far(&self) -> Option<Usage> {
        (self.usage != Usage::default()).then_some(self.usage)
    }
}

//! OpenAI Chat Completions (`POST {base_url}/chat/completions`), also spoken by OpenRouter,
//! Ollama, vLLM, LM Studio and llama.cpp's server.

use reqwest::header::HeaderMap;
use serde::{Deserialize, Serialize};

use crate::http::{self, Call, StreamParser};
use crate::sse::SseEvent;
use crate::{ChatEvent, ChatRequest, ChatStream, Constraint, ErrorKind, ProviderError, Role, Usage};

pub const DEFAULT_BASE_URL: &str = "https://api.openai.com/v1";

#[derive(Debug, Serialize)]
pub struct Request<'a> {
    pub model: &'a str,
    pub messages: Vec<RequestMessage<'a>>,
    pub stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_effort: Option<&'a str>,
    /// vLLM's structured outputs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub structured_outputs: Option<StructuredOutputs<'a>>,
    /// SGLang's regular-expression constraint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub regex: Option<&'a str>,
    /// llama.cpp's GBNF grammar.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grammar: Option<&'a str>,
}

#[derive(Debug, Serialize)]
pub struct StructuredOutputs<'a> {
    pub regex: &'a str,
}

#[derive(Debug, Serialize)]
pub struct RequestMessage<'a> {
    pub role: &'static str,
    pub content: &'a str,
}

#[derive(Debug, Serialize)]
pub struct StreamOptions {
    pub include_usage: bool,
}

/// One `data:` payload of a streamed answer.
#[derive(Debug, Deserialize)]
pub struct Chunk {
    #[serde(default)]
    pub choices: Vec<ChunkChoice>,
    pub usage: Option<WireUsage>,
    /// OpenAI sends an object; some compatible servers send a bare string.
    pub error: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
pub struct ChunkChoice {
    #[serde(default)]
    pub delta: Delta,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub struct Delta {
    pub content: Option<String>,
}

/// A non-streamed answer.
#[derive(Debug, Deserialize)]
pub struct Response {
    pub choices: Vec<ResponseChoice>,
    pub usage: Option<WireUsage>,
}

#[derive(Debug, Deserialize)]
pub struct ResponseChoice {
    pub message: ResponseMessage,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ResponseMessage {
    pub content: Option<String>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
pub struct WireUsage {
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub completion_tokens: u64,
    /// OpenAI's automatic prompt cache (and vLLM's prefix cache): `cached_tokens` of the prompt.
    #[serde(default)]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Debug, Clone, Copy, Default, Deserialize)]
pub struct PromptTokensDetails {
    #[serde(default)]
    pub cached_tokens: Option<u64>,
}

impl From<WireUsage> for Usage {
    fn from(u: WireUsage) -> Self {
        let cached = u.prompt_tokens_details.and_then(|d| d.cached_tokens).unwrap_or(0);
        Usage {
            input_tokens: u.prompt_tokens,
            output_tokens: u.completion_tokens,
            // A server that reports more cached than prompt tokens is wrong; keep the parts within the whole.
            cached_input_tokens: cached.min(u.prompt_tokens),
            cache_write_input_tokens: 0,
            estimated: false,
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct ErrorBody {
    pub error: WireError,
}

#[derive(Debug, Deserialize)]
pub struct WireError {
    #[serde(default)]
    pub message: String,
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    /// A string on OpenAI; some compatible servers send a number.
    #[serde(default)]
    pub code: Option<serde_json::Value>,
}

impl WireError {
    fn into_error(self, status: Option<u16>, headers: Option<&HeaderMap>) -> ProviderError {
        let code = self.code.as_ref().and_then(|c| c.as_str()).unwrap_or_default().to_owned();
        let kind_name = self.kind.clone().unwrap_or_default();
        // In a stream there is no HTTP status; vLLM and others put one in `code`.
        let numeric_code = self.code.as_ref().and_then(serde_json::Value::as_u64).and_then(|c| u16::try_from(c).ok());
        let mut kind = match status.or(numeric_code) {
            Some(s) => http::kind_for_status(s),
            None => match kind_name.as_str() {
                "invalid_request_error" => ErrorKind::BadRequest,
                "authentication_error" => ErrorKind::Auth,
                "rate_limit_error" | "rate_limit_exceeded" => ErrorKind::RateLimited,
                _ => ErrorKind::Overloaded,
            },
        };
        let mut message = self.message;
        match code.as_str() {
            "context_length_exceeded" | "string_above_max_length" => kind = ErrorKind::ContextTooLong,
            "invalid_api_key" => kind = ErrorKind::Auth,
            "insufficient_quota" => {
                kind = ErrorKind::Auth;
                message = format!("the account's quota is used up: {message}");
            }
            _ if kind == ErrorKind::BadRequest && http::mentions_context_limit(&message) => {
                kind = ErrorKind::ContextTooLong;
            }
            _ => {}
        }
        if message.is_empty() {
            message = if kind_name.is_empty() { "(no message)".to_owned() } else { kind_name };
        }
        http::wire_error(kind, message, status, headers)
    }
}

/// Maps an HTTP error answer to the taxonomy, reading OpenAI's `{"error": {...}}` body.
pub fn classify(status: u16, headers: &HeaderMap, body: &str) -> ProviderError {
    match serde_json::from_str::<ErrorBody>(body) {
        Ok(b) => b.error.into_error(Some(status), Some(headers)),
        Err(_) => http::unrecognized_error(status, headers, body),
    }
}

/// Builds the request body. `official` selects OpenAI's own parameter names
/// (`max_completion_tokens`, which reasoning models require) over the older `max_tokens` that
/// compatible servers understand.
pub(crate) fn request_body<'a>(call: &Call<'a>, req: &'a ChatRequest, official: bool) -> Request<'a> {
    let s = call.settings;
    let mut messages = Vec::with_capacity(req.messages.len() + 1);
    if let Some(system) = &req.system {
        messages.push(RequestMessage { role: "system", content: system });
    }
    messages.extend(req.messages.iter().map(|m| RequestMessage {
        role: match m.role {
            Role::User => "user",
            Role::Assistant => "assistant",
        },
        content: &m.content,
    }));
    let max = req.max_tokens.unwrap_or(s.max_tokens);
    let completion_style = official || s.reasoning_effort.is_some();
    Request {
        model: &s.model,
        messages,
        stream: s.stream,
        stream_options: s.stream.then_some(StreamOptions { include_usage: true }),
        max_tokens: (!completion_style).then_some(max),
        max_completion_tokens: completion_style.then_some(max),
        temperature: req.temperature.or(s.temperature),
        top_p: req.top_p.or(s.top_p),
        reasoning_effort: s.reasoning_effort.as_deref(),
        structured_outputs: match &req.constraint {
            Some(Constraint::VllmRegex(regex)) => Some(StructuredOutputs { regex }),
            _ => None,
        },
        regex: match &req.constraint {
            Some(Constraint::SglangRegex(regex)) => Some(regex),
            _ => None,
        },
        grammar: match &req.constraint {
            Some(Constraint::LlamaCppGbnf(gbnf)) => Some(gbnf),
            _ => None,
        },
    }
}

pub(crate) async fn stream(call: Call<'_>, req: &ChatRequest, official: bool) -> Result<ChatStream, ProviderError> {
    let body = request_body(&call, req, official);
    let mut builder = call.http.post(format!("{}/chat/completions", call.base_url)).json(&body);
    if let Some(key) = call.key {
        builder = builder.bearer_auth(key.expose());
    }
    let response = http::send(builder, classify).await?;
    if call.settings.stream {
        Ok(http::sse_stream(response, Parser::default(), call.settings.idle_timeout))
    } else {
        let body: Response = http::json_body(response).await?;
        let usage = body.usage.map(Usage::from).unwrap_or_default();
        let choice =
            body.choices.into_iter().next().ok_or_else(|| ProviderError::malformed("no choices in the answer"))?;
        let text = choice.message.content.unwrap_or_default();
        Ok(http::finished_stream(text, ChatEvent::Done { usage, stop_reason: choice.finish_reason }))
    }
}

#[derive(Debug, Default)]
struct Parser {
    usage: Option<Usage>,
    finish_reason: Option<String>,
}

impl Parser {
    fn done(&mut self) -> ChatEvent {
        ChatEvent::Done { usage: self.usage.unwrap_or_default(), stop_reason: self.finish_reason.take() }
    }
}

impl StreamParser for Parser {
    fn event(&mut self, event: SseEvent, out: &mut Vec<ChatEvent>) -> Result<bool, ProviderError> {
        if event.data.trim() == "[DONE]" {
            out.push(self.done());
            return Ok(true);
        }
        let chunk: Chunk = http::decode("stream chunk", &event.data)?;
        if let Some(error) = chunk.error {
            let wire = match error {
                serde_json::Value::String(message) => WireError { message, kind: None, code: None },
                other => serde_json::from_value(other.clone())
                    .map_err(|_| ProviderError::malformed(format!("unreadable error in stream: {other}")))?,
            };
            return Err(wire.into_error(None, None));
        }
        for choice in chunk.choices {
            if let Some(text) = choice.delta.content
                && !text.is_empty()
            {
                out.push(ChatEvent::Text(text));
            }
            if choice.finish_reason.is_some() {
                self.finish_reason = choice.finish_reason;
            }
        }
        if let Some(usage) = chunk.usage {
            self.usage = Some(usage.into());
        }
        Ok(false)
    }

    fn end_of_stream(&mut self) -> Result<ChatEvent, ProviderError> {
        // Some compatible servers close after the finish reason without `[DONE]`.
        if self.finish_reason.is_some() { Ok(self.done()) } else { Err(ProviderError::cut_stream()) }
    }

    fn usage_so_far(&self) -> Option<Usage> {
        self.usage
    }
}

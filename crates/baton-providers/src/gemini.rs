//! Gemini (`POST {base_url}/v1beta/models/{model}:generateContent`, and
//! `:streamGenerateContent?alt=sse` for streaming).

use reqwest::header::HeaderMap;
use serde::{Deserialize, Serialize};

use crate::error::parse_proto_duration;
use crate::http::{self, Call, StreamParser};
use crate::sse::SseEvent;
use crate::{ChatEvent, ChatRequest, ChatStream, ErrorKind, ProviderError, Role, Usage};

pub const DEFAULT_BASE_URL: &str = "https://generativelanguage.googleapis.com";

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Request<'a> {
    pub contents: Vec<Content<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub system_instruction: Option<SystemInstruction<'a>>,
    pub generation_config: GenerationConfig,
}

#[derive(Debug, Serialize)]
pub struct Content<'a> {
    pub role: &'static str,
    pub parts: Vec<RequestPart<'a>>,
}

#[derive(Debug, Serialize)]
pub struct SystemInstruction<'a> {
    pub parts: Vec<RequestPart<'a>>,
}

#[derive(Debug, Serialize)]
pub struct RequestPart<'a> {
    pub text: &'a str,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GenerationConfig {
    pub max_output_tokens: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thinking_config: Option<ThinkingConfig>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ThinkingConfig {
    pub thinking_budget: u32,
}

/// A whole answer, or one piece of a streamed one.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Response {
    #[serde(default)]
    pub candidates: Vec<Candidate>,
    pub usage_metadata: Option<UsageMetadata>,
    pub prompt_feedback: Option<PromptFeedback>,
    pub error: Option<WireError>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Candidate {
    pub content: Option<CandidateContent>,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct CandidateContent {
    #[serde(default)]
    pub parts: Vec<ResponsePart>,
}

#[derive(Debug, Deserialize)]
pub struct ResponsePart {
    pub text: Option<String>,
    /// Thought summaries are not part of the answer.
    #[serde(default)]
    pub thought: bool,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UsageMetadata {
    #[serde(default)]
    pub prompt_token_count: u64,
    #[serde(default)]
    pub candidates_token_count: u64,
    #[serde(default)]
    pub thoughts_token_count: u64,
    /// Of the prompt, tokens served from a cache (implicit or explicit caching).
    #[serde(default)]
    pub cached_content_token_count: u64,
}

impl From<UsageMetadata> for Usage {
    fn from(u: UsageMetadata) -> Self {
        Usage {
            input_tokens: u.prompt_token_count,
            output_tokens: u.candidates_token_count + u.thoughts_token_count,
            cached_input_tokens: u.cached_content_token_count.min(u.prompt_token_count),
            cache_write_input_tokens: 0,
            estimated: false,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PromptFeedback {
    pub block_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ErrorBody {
    pub error: WireError,
}

#[derive(Debug, Deserialize)]
pub struct WireError {
    #[serde(default)]
    pub code: Option<u16>,
    #[serde(default)]
    pub message: String,
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub details: Vec<serde_json::Value>,
}

impl WireError {
    fn into_error(self, status: Option<u16>, headers: Option<&HeaderMap>) -> ProviderError {
        let status = status.or(self.code);
        let reason = |want: &str| self.details.iter().any(|d| d.get("reason").and_then(|r| r.as_str()) == Some(want));
        let kind = match self.status.as_str() {
            "UNAUTHENTICATED" | "PERMISSION_DENIED" => ErrorKind::Auth,
            // An invalid key comes back as 400 INVALID_ARGUMENT with reason API_KEY_INVALID.
            "INVALID_ARGUMENT" if reason("API_KEY_INVALID") || self.message.contains("API key not valid") => {
                ErrorKind::Auth
            }
            "INVALID_ARGUMENT" if http::mentions_context_limit(&self.message) => ErrorKind::ContextTooLong,
            "INVALID_ARGUMENT" | "FAILED_PRECONDITION" | "NOT_FOUND" => ErrorKind::BadRequest,
            "RESOURCE_EXHAUSTED" => ErrorKind::RateLimited,
            "UNAVAILABLE" | "INTERNAL" | "UNKNOWN" => ErrorKind::Overloaded,
            "DEADLINE_EXCEEDED" => ErrorKind::Timeout,
            _ => status.map_or(ErrorKind::Overloaded, http::kind_for_status),
        };
        // google.rpc.RetryInfo in the body, else the header.
        let retry_after = self
            .details
            .iter()
            .filter_map(|d| d.get("retryDelay").and_then(|r| r.as_str()))
            .find_map(parse_proto_duration)
            .or_else(|| headers.and_then(http::retry_after));
        let message = if self.message.is_empty() { self.status } else { self.message };
        let mut err = ProviderError::new(kind, message).with_retry_after(retry_after);
        err.status = status;
        err
    }
}

/// Maps an HTTP error answer, reading Google's `{"error": {"code", "message", "status"}}` body.
pub fn classify(status: u16, headers: &HeaderMap, body: &str) -> ProviderError {
    // Errors on the streaming endpoint sometimes come as a one-element JSON array.
    let body_trim = body.trim();
    let parsed = serde_json::from_str::<ErrorBody>(body_trim)
        .ok()
        .or_else(|| serde_json::from_str::<Vec<ErrorBody>>(body_trim).ok().and_then(|v| v.into_iter().next()));
    match parsed {
        Some(b) => b.error.into_error(Some(status), Some(headers)),
        None => http::unrecognized_error(status, headers, body),
    }
}

pub(crate) fn request_body<'a>(call: &Call<'a>, req: &'a ChatRequest) -> Request<'a> {
    let s = call.settings;
    Request {
        contents: req
            .messages
            .iter()
            .map(|m| Content {
                role: match m.role {
                    Role::User => "user",
                    Role::Assistant => "model",
                },
                parts: vec![RequestPart { text: &m.content }],
            })
            .collect(),
        system_instruction: req.system.as_deref().map(|text| SystemInstruction { parts: vec![RequestPart { text }] }),
        generation_config: GenerationConfig {
            max_output_tokens: req.max_tokens.unwrap_or(s.max_tokens),
            temperature: req.temperature.or(s.temperature),
            top_p: req.top_p.or(s.top_p),
            thinking_config: s.thinking_budget.map(|thinking_budget| ThinkingConfig { thinking_budget }),
        },
    }
}

pub(crate) async fn stream(call: Call<'_>, req: &ChatRequest) -> Result<ChatStream, ProviderError> {
    let body = request_body(&call, req);
    let model = call.settings.model.trim_start_matches("models/");
    let url = if call.settings.stream {
        format!("{}/v1beta/models/{model}:streamGenerateContent?alt=sse", call.base_url)
    } else {
        format!("{}/v1beta/models/{model}:generateContent", call.base_url)
    };
    let mut builder = call.http.post(url).json(&body);
    if let Some(key) = call.key {
        builder = builder.header("x-goog-api-key", key.expose());
    }
    let response = http::send(builder, classify).await?;
    if call.settings.stream {
        Ok(http::sse_stream(response, Parser::default(), call.settings.idle_timeout))
    } else {
        let body: Response = http::json_body(response).await?;
        let mut parser = Parser::default();
        let mut out = Vec::new();
        parser.piece(body, &mut out)?;
        let text: String = out
            .into_iter()
            .filter_map(|e| match e {
                ChatEvent::Text(t) => Some(t),
                ChatEvent::Usage(_) | ChatEvent::Done { .. } => None,
            })
            .collect();
        let done = parser
            .end_of_stream()
            .map_err(|_| ProviderError::malformed("the answer has no candidate with a finish reason"))?;
        Ok(http::finished_stream(text, done))
    }
}

#[derive(Debug, Default)]
struct Parser {
    usage: Usage,
    finish_reason: Option<String>,
}

impl Parser {
    fn piece(&mut self, piece: Response, out: &mut Vec<ChatEvent>) -> Result<(), ProviderError> {
        if let Some(error) = piece.error {
            return Err(error.into_error(None, None));
        }
        if let Some(reason) = piece.prompt_feedback.and_then(|f| f.block_reason) {
            return Err(ProviderError::new(ErrorKind::BadRequest, format!("the prompt was blocked ({reason})")));
        }
        if let Some(usage) = piece.usage_metadata {
            self.usage = usage.into();
        }
        for candidate in piece.candidates.into_iter().take(1) {
            for part in candidate.content.map(|c| c.parts).unwrap_or_default() {
                if let Some(text) = part.text
                    && !part.thought
                    && !text.is_empty()
                {
                    out.push(ChatEvent::Text(text));
                }
            }
            if candidate.finish_reason.is_some() {
                self.finish_reason = candidate.finish_reason;
            }
        }
        Ok(())
    }
}

impl StreamParser for Parser {
    fn event(&mut self, event: SseEvent, out: &mut Vec<ChatEvent>) -> Result<bool, ProviderError> {
        let piece: Response = http::decode("stream chunk", &event.data)?;
        self.piece(piece, out)?;
        // Gemini has no end marker: the stream ends when the connection closes after the piece
        // with the finish reason (usage may still follow in that same piece).
        Ok(false)
    }

    fn end_of_stream(&mut self) -> Result<ChatEvent, ProviderError> {
        match self.finish_reason.take() {
            Some(reason) => Ok(ChatEvent::Done { usage: self.usage, stop_reason: Some(reason) }),
            None => Err(ProviderError::cut_stream()),
        }
    }

    fn usage_so_far(&self) -> Option<Usage> {
        (self.usage != Usage::default()).then_some(self.usage)
    }
}

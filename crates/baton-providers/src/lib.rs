//! Thin clients for the wire formats Baton's workers speak: OpenAI Chat Completions (also used by
//! every OpenAI-compatible server), Anthropic Messages and Gemini `generateContent`.
//!
//! Each wire module holds serde types for its requests and responses and a decoder for its
//! stream. They all meet in one trait, [`ChatModel`], one stream item, [`ChatEvent`], and one
//! error taxonomy, [`ProviderError`]. Retrying is the caller's business ([`RetryPolicy`] says
//! how long to wait) so that the caller can report every attempt.

pub mod anthropic;
mod error;
pub mod fake;
pub mod gemini;
mod http;
pub mod openai;
pub mod sse;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use serde::{Deserialize, Serialize};

pub use error::{ErrorKind, ProviderError, RetryPolicy};

/// Who speaks a turn of the conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ts_rs::TS)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    User,
    Assistant,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ts_rs::TS)]
pub struct Message {
    pub role: Role,
    pub content: String,
}

impl Message {
    pub fn user(content: impl Into<String>) -> Self {
        Message { role: Role::User, content: content.into() }
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Message { role: Role::Assistant, content: content.into() }
    }
}

/// One call: an optional system prompt and alternating turns that start and end with the user.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChatRequest {
    pub system: Option<String>,
    pub messages: Vec<Message>,
    /// Overrides the worker's `max_tokens` (used by connection checks to keep calls cheap).
    pub max_tokens: Option<u32>,
    /// Override the worker's sampling settings for this call (an API client's own, for the
    /// answer's step).
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// A grammar the server must hold the answer to; only OpenAI-compatible servers take one.
    pub constraint: Option<Constraint>,
}

/// Which structured-output extension an OpenAI-compatible server speaks. None of them is part of
/// OpenAI's API, so the user names the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerGrammar {
    Vllm,
    Sglang,
    LlamaCpp,
}

impl ServerGrammar {
    pub const NAMES: &[&str] = &["vllm", "sglang", "llama.cpp"];

    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "vllm" => Some(ServerGrammar::Vllm),
            "sglang" => Some(ServerGrammar::Sglang),
            "llama.cpp" => Some(ServerGrammar::LlamaCpp),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ServerGrammar::Vllm => "vllm",
            ServerGrammar::Sglang => "sglang",
            ServerGrammar::LlamaCpp => "llama.cpp",
        }
    }
}

/// A grammar in the dialect and request field one server reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Constraint {
    /// vLLM 0.10.2 and later: `"structured_outputs": {"regex": …}`, matched in full.
    VllmRegex(String),
    /// SGLang: `"regex": …`, matched in full.
    SglangRegex(String),
    /// llama.cpp's server: `"grammar": …` in GBNF.
    LlamaCppGbnf(String),
}

/// Token counts as the provider reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ts_rs::TS)]
pub struct Usage {
    /// Every input token, whether served from a cache, written to one, or neither.
    pub input_tokens: u64,
    /// Includes reasoning ("thinking") tokens, which providers bill as output.
    pub output_tokens: u64,
    /// Of `input_tokens`, those read from a prompt cache (the provider's, or a local model's
    /// prefix cache); providers bill them at a discount.
    #[serde(default)]
    pub cached_input_tokens: u64,
    /// Of `input_tokens`, those written to a prompt cache (Anthropic bills them at a premium).
    #[serde(default)]
    pub cache_write_input_tokens: u64,
    /// Some of these counts are Baton's upper estimate, not the provider's report: a call cut
    /// off before its usage arrived (OpenAI reports it only at the end) is still billed for
    /// what it sent. See `Usage::estimate_cut_call`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    #[ts(optional = nullable)]
    pub estimated: bool,
}

impl Usage {
    pub fn total(&self) -> u64 {
        self.input_tokens + self.output_tokens
    }

    /// A call that ended without its usage (a stream cut off, a time-out, a stop) after
    /// sending `received_bytes` of text, for a request of at most `input_bound` input tokens
    /// and `output_bound` output tokens: the provider bills what it read and sent, so count
    /// an upper estimate of both, marked as such. Output: one token per byte received (a
    /// token is at least a byte), at most the request's cap. Input: what the provider reported
    /// (Anthropic reports it as the stream opens), else the request's bound. An output count
    /// the provider did report (Gemini's, with every chunk) is kept as it is.
    pub fn estimate_cut_call(self, received_bytes: u64, input_bound: u64, output_bound: u64) -> Usage {
        if self.output_tokens > 0 || received_bytes == 0 {
            return self;
        }
        Usage {
            input_tokens: if self.input_tokens > 0 { self.input_tokens } else { input_bound },
            output_tokens: received_bytes.min(output_bound),
            estimated: true,
            ..self
        }
    }
}

impl std::ops::AddAssign for Usage {
    fn add_assign(&mut self, rhs: Usage) {
        self.input_tokens += rhs.input_tokens;
        self.output_tokens += rhs.output_tokens;
        self.cached_input_tokens += rhs.cached_input_tokens;
        self.cache_write_input_tokens += rhs.cache_write_input_tokens;
        self.estimated |= rhs.estimated;
    }
}

/// An item of a model's answer stream.
#[derive(Debug, Clone, PartialEq)]
pub enum ChatEvent {
    /// More answer text.
    Text(String),
    /// The usage the provider has reported so far (cumulative), before the answer is complete;
    /// a call cut short (a timeout, a cancelled run) still counts these tokens.
    Usage(Usage),
    /// The answer is complete. Always the last item of a successful stream.
    Done { usage: Usage, stop_reason: Option<String> },
}

pub type ChatStream = BoxStream<'static, Result<ChatEvent, ProviderError>>;

/// A whole answer, read to its end.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub text: String,
    pub usage: Usage,
    pub stop_reason: Option<String>,
}

/// Calls `model` and reads the answer to its end, passing text to `on_text` as it arrives.
/// `reported` holds the usage the provider has reported so far, so a caller that drops this
/// future (a timeout, a cancel) still knows what the call used; an error carries it too.
pub async fn read_answer(
    model: &dyn ChatModel,
    request: ChatRequest,
    on_text: &mut (dyn FnMut(&str) + Send),
    reported: &std::sync::Mutex<Usage>,
) -> Result<Answer, ProviderError> {
    let so_far = || *reported.lock().unwrap_or_else(|p| p.into_inner());
    let with_usage = |e: ProviderError| {
        let usage = e.usage.unwrap_or_else(so_far);
        e.with_usage(Some(usage))
    };
    let mut stream = model.stream(request).await.map_err(with_usage)?;
    let mut text = String::new();
    while let Some(item) = stream.next().await {
        match item.map_err(with_usage)? {
            ChatEvent::Text(t) => {
                on_text(&t);
                text.push_str(&t);
            }
            ChatEvent::Usage(usage) => *reported.lock().unwrap_or_else(|p| p.into_inner()) = usage,
            ChatEvent::Done { usage, stop_reason } => {
                *reported.lock().unwrap_or_else(|p| p.into_inner()) = usage;
                return Ok(Answer { text, usage, stop_reason });
            }
        }
    }
    Err(with_usage(ProviderError::new(ErrorKind::Network, "the answer stream ended without completing")))
}

/// Anything that answers a conversation as a stream: a provider over HTTP, a local model, a fake.
///
/// Dropping the future or the stream cancels the call (the HTTP connection is closed).
pub trait ChatModel: Send + Sync {
    fn stream(&self, request: ChatRequest) -> BoxFuture<'static, Result<ChatStream, ProviderError>>;

    /// The exact number of tokens `request`'s input is, when this model can count them before
    /// the call (a local model holds its tokenizer). `None`, the default, leaves the caller to
    /// bound it by the input's bytes.
    fn input_tokens(&self, _request: &ChatRequest) -> BoxFuture<'static, Option<u64>> {
        Box::pin(async { None })
    }
}

/// The wire formats Baton speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ts_rs::TS)]
#[serde(rename_all = "kebab-case")]
pub enum ProviderKind {
    #[serde(rename = "openai")]
    OpenAi,
    Anthropic,
    Gemini,
    #[serde(rename = "openai-compatible")]
    OpenAiCompatible,
    /// A model run in process (mistral.rs); not an HTTP wire format.
    Local,
}

impl ProviderKind {
    pub const ALL: [ProviderKind; 5] = [
        ProviderKind::OpenAi,
        ProviderKind::Anthropic,
        ProviderKind::Gemini,
        ProviderKind::OpenAiCompatible,
        ProviderKind::Local,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ProviderKind::OpenAi => "openai",
            ProviderKind::Anthropic => "anthropic",
            ProviderKind::Gemini => "gemini",
            ProviderKind::OpenAiCompatible => "openai-compatible",
            ProviderKind::Local => "local",
        }
    }

    /// The base URL each provider's official SDK uses.
    pub fn default_base_url(self) -> Option<&'static str> {
        match self {
            ProviderKind::OpenAi => Some(openai::DEFAULT_BASE_URL),
            ProviderKind::Anthropic => Some(anthropic::DEFAULT_BASE_URL),
            ProviderKind::Gemini => Some(gemini::DEFAULT_BASE_URL),
            ProviderKind::OpenAiCompatible | ProviderKind::Local => None,
        }
    }

    /// Whether calls without a key make sense (local OpenAI-compatible servers often take none).
    pub fn key_optional(self) -> bool {
        matches!(self, ProviderKind::OpenAiCompatible | ProviderKind::Local)
    }
}

impl fmt::Display for ProviderKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An API key. Its `Debug` shows nothing of the value, so it cannot leak through logging.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    pub fn new(key: impl Into<String>) -> Self {
        ApiKey(key.into())
    }

    /// The secret itself, for building a request header and nothing else.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

/// Produces the key when a request is built, so that keys are held no longer than a request.
pub type KeySource = Arc<dyn Fn() -> Result<Option<ApiKey>, ProviderError> + Send + Sync>;

/// Per-worker generation settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSettings {
    pub model: String,
    pub max_tokens: u32,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// OpenAI reasoning models: `minimal`, `low`, `medium`, `high`.
    pub reasoning_effort: Option<String>,
    /// Anthropic extended thinking / Gemini thinking budget, in tokens.
    pub thinking_budget: Option<u32>,
    /// Stream the answer (default) or ask for one JSON body.
    pub stream: bool,
    /// Longest silence allowed between two pieces of a streamed answer.
    pub idle_timeout: Duration,
    /// Anthropic: mark the conversation's shared prefix with `cache_control` breakpoints so
    /// that steps sending the same prefix read it from the cache. OpenAI and Gemini cache
    /// long prefixes on their own.
    pub prompt_cache: bool,
}

impl ModelSettings {
    pub fn new(model: impl Into<String>) -> Self {
        ModelSettings {
            model: model.into(),
            max_tokens: 4096,
            temperature: None,
            top_p: None,
            reasoning_effort: None,
            thinking_budget: None,
            stream: true,
            idle_timeout: Duration::from_secs(120),
            prompt_cache: true,
        }
    }

    /// An upper bound on the output tokens one call may produce. Providers differ on whether a
    /// thinking budget counts inside `max_tokens` (Anthropic raises `max_tokens` above it;
    /// Gemini's documentation leaves it open), so the bound counts both.
    pub fn output_cap(&self) -> u32 {
        self.max_tokens.saturating_add(self.thinking_budget.unwrap_or(0))
    }
}

/// A worker model reached over HTTP in one of the wire formats.
#[derive(Clone)]
pub struct HttpModel {
    inner: Arc<HttpModelInner>,
}

struct HttpModelInner {
    kind: ProviderKind,
    /// Without a trailing slash.
    base_url: String,
    settings: ModelSettings,
    key: KeySource,
    http: reqwest::Client,
}

impl fmt::Debug for HttpModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpModel")
            .field("kind", &self.inner.kind)
            .field("base_url", &self.inner.base_url)
            .field("settings", &self.inner.settings)
            .finish_non_exhaustive()
    }
}

impl HttpModel {
    /// `http` is shared between workers so connections are pooled.
    pub fn new(
        kind: ProviderKind,
        base_url: &str,
        settings: ModelSettings,
        key: KeySource,
        http: reqwest::Client,
    ) -> Self {
        let base_url = base_url.trim_end_matches('/').to_owned();
        HttpModel { inner: Arc::new(HttpModelInner { kind, base_url, settings, key, http }) }
    }

    /// A client with the timeouts Baton uses for every provider.
    pub fn http_client() -> reqwest::Client {
        reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            // Keys travel in headers reqwest does not strip on a redirect (`x-api-key`,
            // `x-goog-api-key`): a redirect to another host is never followed, so a key reaches
            // only the host it was saved for. `http::send` turns the 3xx into an error.
            .redirect(reqwest::redirect::Policy::custom(|attempt| {
                let same_origin = attempt.previous().first().is_some_and(|first| {
                    let (a, b) = (first, attempt.url());
                    a.scheme() == b.scheme()
                        && a.host_str() == b.host_str()
                        && a.port_or_known_default() == b.port_or_known_default()
                });
                if same_origin && attempt.previous().len() < 5 { attempt.follow() } else { attempt.stop() }
            }))
            .user_agent(concat!("baton/", env!("CARGO_PKG_VERSION")))
            .build()
            .unwrap_or_else(|_| reqwest::Client::new())
    }

    pub fn kind(&self) -> ProviderKind {
        self.inner.kind
    }
}

impl ChatModel for HttpModel {
    fn stream(&self, request: ChatRequest) -> BoxFuture<'static, Result<ChatStream, ProviderError>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            // A key source may block (the keychain is a D-Bus round trip, or a prompt to unlock
            // it), so it runs on the blocking pool rather than stalling an async worker.
            let source = Arc::clone(&inner.key);
            let key = tokio::task::spawn_blocking(move || source()).await.map_err(|e| {
                ProviderError::new(ErrorKind::Auth, format!("reading the key failed unexpectedly: {e}"))
            })??;
            let call = http::Call {
                http: &inner.http,
                base_url: &inner.base_url,
                settings: &inner.settings,
                key: key.as_ref(),
            };
            let result = match inner.kind {
                kind if request.constraint.is_some() && kind != ProviderKind::OpenAiCompatible => {
                    Err(ProviderError::new(
                        ErrorKind::BadRequest,
                        format!(
                            "{} does not take a grammar; constrained output needs an OpenAI-compatible server (vLLM, SGLang or llama.cpp)",
                            kind.as_str()
                        ),
                    ))
                }
                ProviderKind::OpenAi => openai::stream(call, &request, true).await,
                ProviderKind::OpenAiCompatible => openai::stream(call, &request, false).await,
                // The executor builds local workers from their loaded model and never as an HTTP
                // model; this answers a library caller that asks for one over HTTP.
                ProviderKind::Local => Err(ProviderError::new(
                    ErrorKind::BadRequest,
                    "a local worker runs in process, not over HTTP: load it with baton-local's LocalWorker",
                )),
                ProviderKind::Anthropic => anthropic::stream(call, &request).await,
                ProviderKind::Gemini => gemini::stream(call, &request).await,
            };
            // Some servers and proxies echo the key they received in their error text; errors
            // are shown and stored, so the key is cut out of every one.
            let redact = move |mut e: ProviderError| {
                if let Some(key) = key.as_ref().map(ApiKey::expose).filter(|k| k.len() >= 4) {
                    e.message = e.message.replace(key, "<redacted>");
                }
                e
            };
            match result {
                Ok(stream) => Ok(stream.map(move |item| item.map_err(&redact)).boxed()),
                Err(e) => Err(redact(e)),
            }
        })
    }
}

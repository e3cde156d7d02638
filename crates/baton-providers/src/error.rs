//! One error taxonomy for every provider, and the retry policy that reads it.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::Usage;

/// What went wrong with a model call, independent of the provider's own vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The key is missing, wrong, lacks permission, or the account cannot pay. Never retried.
    Auth,
    /// Too many requests; the provider may say when to come back.
    RateLimited,
    /// The provider is overloaded or failed internally (5xx, Anthropic 529).
    Overloaded,
    /// The request itself is wrong (unknown model, bad parameter). Never retried.
    BadRequest,
    /// The conversation does not fit the model's context window. Never retried.
    ContextTooLong,
    /// Connecting failed or the connection broke, mid-stream included.
    Network,
    /// No answer within the per-call time limit.
    Timeout,
    /// The provider answered something that is not its documented format.
    MalformedResponse,
    /// The model finished without any text (out of tokens while thinking, or filtered).
    EmptyAnswer,
    /// The caller cancelled the call.
    Cancelled,
}

impl ErrorKind {
    /// Whether trying the same request again may succeed.
    pub fn is_retryable(self) -> bool {
        matches!(self, ErrorKind::RateLimited | ErrorKind::Overloaded | ErrorKind::Network | ErrorKind::Timeout)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Auth => "auth",
            ErrorKind::RateLimited => "rate_limited",
            ErrorKind::Overloaded => "overloaded",
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::ContextTooLong => "context_too_long",
            ErrorKind::Network => "network",
            ErrorKind::Timeout => "timeout",
            ErrorKind::MalformedResponse => "malformed_response",
            ErrorKind::EmptyAnswer => "empty_answer",
            ErrorKind::Cancelled => "cancelled",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failed model call. `message` is safe to show and store: it never contains request headers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}{}: {message}", status.map(|s| format!(" (HTTP {s})")).unwrap_or_default())]
pub struct ProviderError {
    pub kind: ErrorKind,
    pub message: String,
    /// The HTTP status, when the provider answered with one.
    pub status: Option<u16>,
    /// How long the provider asked us to wait before retrying.
    pub retry_after: Option<Duration>,
    /// Tokens the provider reported before the call failed (a stream that broke after its
    /// usage arrived), which it may bill; `None` when it reported none.
    pub usage: Option<Usage>,
    /// The request never reached the server (no connection could be made), so nothing of it
    /// can be billed.
    pub not_sent: bool,
}

impl ProviderError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ProviderError { kind, message: message.into(), status: None, retry_after: None, usage: None, not_sent: false }
    }

    pub fn with_usage(mut self, usage: Option<Usage>) -> Self {
        self.usage = usage;
        self
    }

    pub fn with_status(mut self, status: u16) -> Self {
        self.status = Some(status);
        self
    }

    pub fn with_retry_after(mut self, retry_after: Option<Duration>) -> Self {
        self.retry_after = retry_after;
        self
    }

    pub fn is_retryable(&self) -> bool {
        self.kind.is_retryable()
    }

    pub(crate) fn malformed(message: impl Into<String>) -> Self {
        ProviderError::new(ErrorKind::MalformedResponse, message)
    }

    pub(crate) fn cut_stream() -> Self {
        ProviderError::new(ErrorKind::Network, "the stream ended before the response was complete")
    }

    /// Maps a transport error. The message comes from reqwest without the URL's query, and our
    /// URLs never carry keys.
    pub(crate) fn from_reqwest(err: &reqwest::Error) -> Self {
        let kind = if err.is_timeout() {
            ErrorKind::Timeout
        } else if err.is_decode() {
            ErrorKind::MalformedResponse
        } else {
            ErrorKind::Network
        };
        let mut message = err.to_string();
        let mut source = std::error::Error::source(err);
        while let Some(s) = source {
            message.push_str(": ");
            message.push_str(&s.to_string());
            source = s.source();
        }
        ProviderError { not_sent: err.is_connect(), ..ProviderError::new(kind, message) }
    }

    /// Whether the provider may bill for this failed call: the request reached it and it did
    /// not refuse it with an error status (an error answer is not billed; a connection cut or a
    /// time-out after the request went out may be).
    pub fn may_be_billed(&self) -> bool {
        !self.not_sent && self.status.is_none()
    }
}

/// Exponential backoff with jitter; honours the provider's `Retry-After`.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Retries after the first attempt (0 disables retrying).
    pub max_retries: u32,
    pub initial_delay: Duration,
    pub max_delay: Duration,
    /// A `Retry-After` longer than this fails the call instead of stalling the run.
    pub max_retry_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_retries: 3,
            initial_delay: Duration::from_millis(500),
            max_delay: Duration::from_secs(30),
            max_retry_after: Duration::from_secs(120),
        }
    }
}

impl RetryPolicy {
    /// How long to wait before retry number `retry` (1 for the first retry) after `error`, or
    /// `None` when the call should fail now.
    pub fn delay(&self, retry: u32, error: &ProviderError) -> Option<Duration> {
        if !error.is_retryable() || retry > self.max_retries {
            return None;
        }
        if let Some(after) = error.retry_after {
            return (after <= self.max_retry_after).then_some(after);
        }
        let exp = self.initial_delay.saturating_mul(2u32.saturating_pow(retry.saturating_sub(1)));
        let capped = exp.min(self.max_delay);
        // "Equal jitter": half fixed, half random, so concurrent callers spread out but never
        // retry immediately.
        let half = capped / 2;
        Some(half + half.mul_f64(jitter()))
    }
}

/// A number in [0, 1) that differs between calls; the quality of randomness does not matter.
fn jitter() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64));
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// Parses a `Retry-After` header: delta-seconds or an HTTP date.
pub(crate) fn parse_retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<f64>() {
        // try_from: a huge or negative value from a server must not panic.
        return Duration::try_from_secs_f64(secs).ok();
    }
    let when = httpdate::parse_http_date(value).ok()?;
    Some(when.duration_since(std::time::SystemTime::now()).unwrap_or(Duration::ZERO))
}

/// Parses a protobuf JSON duration such as Gemini's `"retryDelay": "1.5s"`.
pub(crate) fn parse_proto_duration(value: &str) -> Option<Duration> {
    let secs: f64 = value.trim().strip_suffix('s')?.parse().ok()?;
    Duration::try_from_secs_f64(secs).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_bounded() {
        let p = RetryPolicy { max_retries: 5, initial_delay: Duration::from_millis(100), ..RetryPolicy::default() };
        let e = ProviderError::new(ErrorKind::Overloaded, "x");
        for retry in 1..=5 {
            let d = p.delay(retry, &e).expect("retryable");
            let full = Duration::from_millis(100 * 2u64.pow(retry - 1));
            assert!(d >= full / 2 && d <= full, "retry {retry}: {d:?}");
        }
        assert_eq!(p.delay(6, &e), None);
    }

    #[test]
    fn never_retries_auth_or_bad_requests() {
        let p = RetryPolicy::default();
        for kind in [ErrorKind::Auth, ErrorKind::BadRequest, ErrorKind::ContextTooLong, ErrorKind::MalformedResponse] {
            assert_eq!(p.delay(1, &ProviderError::new(kind, "x")), None, "{kind}");
        }
    }

    #[test]
    fn honours_retry_after() {
        let p = RetryPolicy::default();
        let e = ProviderError::new(ErrorKind::RateLimited, "x").with_retry_after(Some(Duration::from_secs(7)));
        assert_eq!(p.delay(1, &e), Some(Duration::from_secs(7)));
        let too_long = e.clone().with_retry_after(Some(Duration::from_secs(3600)));
        assert_eq!(p.delay(1, &too_long), None);
    }

    #[test]
    fn retry_after_formats() {
        assert_eq!(parse_retry_after("3"), Some(Duration::from_secs(3)));
        assert_eq!(parse_retry_after("0.5"), Some(Duration::from_millis(500)));
        assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("soon"), None);
        assert_eq!(parse_proto_duration("1.5s"), Some(Duration::from_millis(1500)));
        for hostile in ["1e30", "-1", "NaN", "inf"] {
            assert_eq!(parse_retry_after(hostile), None, "{hostile}");
            assert_eq!(parse_proto_duration(&format!("{hostile}s")), None, "{hostile}");
        }
    }
}

//! Transport shared by the wire modules: sending, turning HTTP errors into [`ProviderError`]s,
//! and driving an SSE body through a wire-specific parser.

use std::collections::VecDeque;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use reqwest::header::HeaderMap;
use serde::de::DeserializeOwned;

use crate::error::parse_retry_after;
use crate::sse::{SseDecoder, SseEvent};
use crate::{ApiKey, ChatEvent, ChatStream, ErrorKind, ModelSettings, ProviderError, Usage};

/// Everything a wire module needs to make one call.
pub(crate) struct Call<'a> {
    pub(crate) http: &'a reqwest::Client,
    pub(crate) base_url: &'a str,
    pub(crate) settings: &'a ModelSettings,
    pub(crate) key: Option<&'a ApiKey>,
}

/// An error body is read up to this size; providers' error bodies are small.
const MAX_ERROR_BODY: usize = 64 * 1024;

/// Sends the request; a non-2xx answer becomes an error through `classify`, which reads the
/// provider's error body.
pub(crate) async fn send(
    request: reqwest::RequestBuilder,
    classify: fn(u16, &HeaderMap, &str) -> ProviderError,
) -> Result<reqwest::Response, ProviderError> {
    let response = request.send().await.map_err(|e| ProviderError::from_reqwest(&e))?;
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    if status.is_redirection() {
        let to = response.headers().get(reqwest::header::LOCATION).and_then(|v| v.to_str().ok()).unwrap_or("?");
        return Err(ProviderError::new(
            ErrorKind::BadRequest,
            format!(
                "the server redirected the request to {to}, another host; Baton does not follow it, since the key is only for the host it was saved for. If that address is right, make it the base_url (and store its key)"
            ),
        )
        .with_status(status.as_u16()));
    }
    let headers = response.headers().clone();
    let body = read_bounded(response).await;
    Err(classify(status.as_u16(), &headers, &body))
}

async fn read_bounded(mut response: reqwest::Response) -> String {
    let mut body = Vec::new();
    while let Ok(Some(chunk)) = response.chunk().await {
        body.extend_from_slice(&chunk);
        if body.len() >= MAX_ERROR_BODY {
            body.truncate(MAX_ERROR_BODY);
            break;
        }
    }
    String::from_utf8_lossy(&body).into_owned()
}

/// The error kind an HTTP status implies when the body says nothing more specific.
pub(crate) fn kind_for_status(status: u16) -> ErrorKind {
    match status {
        401..=403 => ErrorKind::Auth,
        408 => ErrorKind::Timeout,
        413 => ErrorKind::ContextTooLong,
        429 => ErrorKind::RateLimited,
        500..=599 => ErrorKind::Overloaded,
        _ => ErrorKind::BadRequest,
    }
}

/// An error the provider described in its own error body.
pub(crate) fn wire_error(
    kind: ErrorKind,
    message: String,
    status: Option<u16>,
    headers: Option<&HeaderMap>,
) -> ProviderError {
    let mut err = ProviderError::new(kind, message).with_retry_after(headers.and_then(retry_after));
    err.status = status;
    err
}

/// An error answer whose body is not the provider's documented error shape (a proxy's HTML
/// page, say): the status decides the kind, the body's start becomes the message.
pub(crate) fn unrecognized_error(status: u16, headers: &HeaderMap, body: &str) -> ProviderError {
    ProviderError::new(kind_for_status(status), excerpt(body))
        .with_status(status)
        .with_retry_after(retry_after(headers))
}

/// `retry-after-ms` (OpenAI) or `retry-after` (everyone).
pub(crate) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    if let Some(ms) =
        headers.get("retry-after-ms").and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<f64>().ok())
        && let Ok(after) = Duration::try_from_secs_f64(ms / 1000.0)
    {
        return Some(after);
    }
    headers.get(reqwest::header::RETRY_AFTER).and_then(|v| v.to_str().ok()).and_then(parse_retry_after)
}

/// Whether a provider's error message is about the context window.
pub(crate) fn mentions_context_limit(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    m.contains("context length")
        || m.contains("context_length")
        || m.contains("context window")
        || m.contains("prompt is too long")
        || m.contains("too many tokens")
        || m.contains("exceeds the maximum number of tokens")
        || m.contains("maximum context")
}

/// A short, printable excerpt of an unexpected body.
pub(crate) fn excerpt(body: &str) -> String {
    let trimmed = body.trim();
    let mut out: String = trimmed.chars().take(200).collect();
    if out.len() < trimmed.len() {
        out.push('…');
    }
    if out.is_empty() { "(empty body)".to_owned() } else { out }
}

/// Decodes a JSON value, calling anything else a malformed response.
pub(crate) fn decode<T: DeserializeOwned>(what: &str, text: &str) -> Result<T, ProviderError> {
    serde_json::from_str(text).map_err(|e| ProviderError::malformed(format!("{what}: {e}: {}", excerpt(text))))
}

/// Reads a whole non-streamed JSON body.
pub(crate) async fn json_body<T: DeserializeOwned>(response: reqwest::Response) -> Result<T, ProviderError> {
    let bytes = response.bytes().await.map_err(|e| ProviderError::from_reqwest(&e))?;
    let text = String::from_utf8_lossy(&bytes);
    decode("response body", &text)
}

/// A wire format's stream decoder: SSE events in, chat events out.
pub(crate) trait StreamParser: Send + 'static {
    /// Handles one event. Returns `true` once the provider has said the answer is complete
    /// (the parser has then pushed [`ChatEvent::Done`]).
    fn event(&mut self, event: SseEvent, out: &mut Vec<ChatEvent>) -> Result<bool, ProviderError>;

    /// The connection closed before `event` returned `true`: either finish leniently (some
    /// compatible servers omit the terminator) or report a cut stream.
    fn end_of_stream(&mut self) -> Result<ChatEvent, ProviderError>;

    /// The usage the provider has reported so far, if any: a stream that breaks after it
    /// still counts those tokens (the provider may bill them).
    fn usage_so_far(&self) -> Option<Usage>;
}

struct StreamState<P> {
    body: BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    decoder: SseDecoder,
    parser: P,
    queue: VecDeque<ChatEvent>,
    finished: bool,
    idle_timeout: Duration,
    /// The usage last passed on as [`ChatEvent::Usage`].
    usage_sent: Option<Usage>,
}

/// Turns an SSE response into a [`ChatStream`]. Ends after [`ChatEvent::Done`] or the first error.
pub(crate) fn sse_stream<P: StreamParser>(
    response: reqwest::Response,
    parser: P,
    idle_timeout: Duration,
) -> ChatStream {
    let state = StreamState {
        body: response.bytes_stream().boxed(),
        decoder: SseDecoder::new(),
        parser,
        queue: VecDeque::new(),
        finished: false,
        idle_timeout,
        usage_sent: None,
    };
    futures::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(event) = s.queue.pop_front() {
                return Some((Ok(event), s));
            }
            if s.finished {
                return None;
            }
            let next = tokio::time::timeout(s.idle_timeout, s.body.next()).await;
            let fail = |mut s: StreamState<P>, e: ProviderError| {
                s.finished = true;
                let usage = e.usage.or_else(|| s.parser.usage_so_far());
                Some((Err(e.with_usage(usage)), s))
            };
            match next {
                Err(_) => {
                    let secs = s.idle_timeout.as_secs_f64();
                    return fail(
                        s,
                        ProviderError::new(ErrorKind::Timeout, format!("no data for {secs:.1} s mid-stream")),
                    );
                }
                Ok(None) => {
                    s.finished = true;
                    let end = if s.decoder.has_partial_event() {
                        Err(ProviderError::cut_stream())
                    } else {
                        s.parser.end_of_stream()
                    };
                    let usage = s.parser.usage_so_far();
                    return Some((end.map_err(|e| e.with_usage(usage)), s));
                }
                Ok(Some(Err(e))) => {
                    let mut err = ProviderError::from_reqwest(&e);
                    if err.kind == ErrorKind::MalformedResponse {
                        err.kind = ErrorKind::Network;
                    }
                    return fail(s, err);
                }
                Ok(Some(Ok(bytes))) => {
                    let events = match s.decoder.push(&bytes) {
                        Ok(events) => events,
                        Err(_) => return fail(s, ProviderError::malformed("the event stream is not valid UTF-8")),
                    };
                    let mut out = Vec::new();
                    for event in events {
                        match s.parser.event(event, &mut out) {
                            Ok(true) => {
                                s.finished = true;
                                break;
                            }
                            Ok(false) => {
                                let usage = s.parser.usage_so_far();
                                if usage.is_some() && usage != s.usage_sent {
                                    s.usage_sent = usage;
                                    out.extend(usage.map(ChatEvent::Usage));
                                }
                            }
                            // The call fails as a whole; text before the error is moot.
                            Err(e) => return fail(s, e),
                        }
                    }
                    s.queue.extend(out);
                }
            }
        }
    })
    .boxed()
}

/// A complete non-streamed answer as a stream, so callers handle both modes alike.
pub(crate) fn finished_stream(text: String, done: ChatEvent) -> ChatStream {
    let mut items = Vec::with_capacity(2);
    if !text.is_empty() {
        items.push(Ok(ChatEvent::Text(text)));
    }
    items.push(Ok(done));
    futures::stream::iter(items).boxed()
}

//! Loopback HTTP servers that speak the providers' wire formats, written from their public API
//! references: OpenAI Chat Completions, Anthropic Messages and Gemini `generateContent`, each
//! streamed (SSE) and not, with usage, their error bodies, `Retry-After`, cut streams, slow
//! first bytes and garbage.
//!
//! One server answers all three formats. What it does for a call is chosen by the request's
//! model name, so that a pool file alone can script a scenario (see [`Script`]):
//!
//! ```text
//! model = "solver;latency=300"          # answer after ~300 ms, streamed in pieces
//! model = "flaky;fail=429x2;retry_after=0"  # two 429s, then an answer
//! ```
//!
//! Every request is recorded (path, headers, JSON body) so tests can assert on the wire.

pub mod hub;
mod script;
mod wire;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::post;

pub use script::Script;
pub use wire::Wire;

/// One request as the server received it.
#[derive(Debug, Clone)]
pub struct RecordedRequest {
    pub wire: Wire,
    pub path: String,
    /// Lower-cased header names.
    pub headers: BTreeMap<String, String>,
    pub body: serde_json::Value,
    /// The full model string, directives included.
    pub model: String,
    /// Milliseconds since the server started.
    pub at_ms: u64,
    /// The usage the server has reported for this request so far (what a client that read
    /// every byte sent saw): zero for an error answer, the last usage a stream carried before
    /// it was cut.
    pub reported: Arc<Mutex<Reported>>,
}

impl RecordedRequest {
    pub fn reported(&self) -> Reported {
        self.reported.lock().map(|r| *r).unwrap_or_default()
    }
}

/// Token counts as the server reported them, in Baton's terms: `input_tokens` is all input,
/// `cached_input_tokens` and `cache_write_input_tokens` the parts read from and written to the
/// prompt cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Reported {
    pub input_tokens: u64,
    pub cached_input_tokens: u64,
    pub cache_write_input_tokens: u64,
    pub output_tokens: u64,
}

#[derive(Debug, Default)]
struct Shared {
    requests: Mutex<Vec<RecordedRequest>>,
    /// Calls seen per model string, for directives that apply to the first N calls.
    counts: Mutex<HashMap<String, u32>>,
    /// Streams the client closed before their end.
    hangups: Arc<std::sync::atomic::AtomicU32>,
    /// Replies queued per model name (the part before `;`), used before the script's own.
    replies: Mutex<HashMap<String, std::collections::VecDeque<String>>>,
    /// Prompt prefixes cached so far, by hash (model name, system text and turns).
    cache: Mutex<std::collections::HashSet<u64>>,
    /// When set, requests must carry this key in the wire's auth header.
    key: Option<String>,
    started: Option<Instant>,
    /// Append every request as a JSON line here.
    log: Option<std::path::PathBuf>,
}

/// A running server on `127.0.0.1`; stops when dropped.
#[derive(Debug)]
pub struct TestServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

/// Options for [`TestServer::start_with`].
#[derive(Debug, Default, Clone)]
pub struct Options {
    pub key: Option<String>,
    pub port: u16,
    pub log: Option<std::path::PathBuf>,
}

impl TestServer {
    /// Starts on a free port, accepting any key.
    pub async fn start() -> std::io::Result<TestServer> {
        Self::start_with(Options::default()).await
    }

    pub async fn start_with(options: Options) -> std::io::Result<TestServer> {
        let shared =
            Arc::new(Shared { key: options.key, started: Some(Instant::now()), log: options.log, ..Shared::default() });
        let app = Router::new()
            .route("/v1/chat/completions", post(openai))
            .route("/v1/messages", post(anthropic))
            .route("/v1beta/models/{*rest}", post(gemini))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", options.port)).await?;
        let addr = listener.local_addr()?;
        // Pieces go out as they are written, as the providers' own servers send them.
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp: &mut tokio::net::TcpStream| {
            let _ = tcp.set_nodelay(true);
        });
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(TestServer { addr, shared, task })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The `base_url` a pool uses for this wire format.
    pub fn base_url(&self, wire: Wire) -> String {
        match wire {
            Wire::OpenAi => format!("http://{}/v1", self.addr),
            Wire::Anthropic | Wire::Gemini => format!("http://{}", self.addr),
        }
    }

    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared.requests.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// Queues exact answers for calls to `model` (any text, newlines included), one per call;
    /// when they run out the model's script answers again.
    pub fn queue_replies(&self, model: &str, replies: impl IntoIterator<Item = impl Into<String>>) {
        if let Ok(mut r) = self.shared.replies.lock() {
            r.entry(model.to_owned()).or_default().extend(replies.into_iter().map(Into::into));
        }
    }

    /// How many streamed answers the client closed before their end (a cancelled call).
    pub fn hangups(&self) -> u32 {
        self.shared.hangups.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits for the server task (for the standalone binary).
    pub async fn serve_forever(mut self) {
        let task = std::mem::replace(&mut self.task, tokio::spawn(async {}));
        let _ = task.await;
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn openai(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    handle(shared, Wire::OpenAi, "/v1/chat/completions".to_owned(), None, headers, body).await
}

async fn anthropic(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    handle(shared, Wire::Anthropic, "/v1/messages".to_owned(), None, headers, body).await
}

async fn gemini(
    State(shared): State<Arc<Shared>>,
    Path(rest): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = format!("/v1beta/models/{rest}");
    let Some((model, method)) = rest.rsplit_once(':') else {
        return wire::error_response(Wire::Gemini, StatusCode::NOT_FOUND, "not_found", "unknown method", None);
    };
    let stream = match method {
        "streamGenerateContent" => true,
        "generateContent" => false,
        _ => return wire::error_response(Wire::Gemini, StatusCode::NOT_FOUND, "not_found", "unknown method", None),
    };
    handle(shared, Wire::Gemini, path, Some((model.to_owned(), stream)), headers, body).await
}

async fn handle(
    shared: Arc<Shared>,
    wire: Wire,
    path: String,
    gemini: Option<(String, bool)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return wire::error_response(wire, StatusCode::BAD_REQUEST, "invalid_request", "the body is not JSON", None);
    };
    let (model, stream) = match gemini {
        Some(g) => g,
        None => (
            json.get("model").and_then(|m| m.as_str()).unwrap_or_default().to_owned(),
            json.get("stream").and_then(|s| s.as_bool()).unwrap_or(false),
        ),
    };
    let header_map: BTreeMap<String, String> = headers
        .iter()
        .map(|(k, v)| (k.as_str().to_ascii_lowercase(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
        .collect();
    let at_ms = shared.started.map_or(0, |s| s.elapsed().as_millis() as u64);
    let reported = Arc::new(Mutex::new(Reported::default()));
    let record = RecordedRequest {
        wire,
        path,
        headers: header_map.clone(),
        body: json.clone(),
        model: model.clone(),
        at_ms,
        reported: reported.clone(),
    };
    if let Some(log) = &shared.log {
        let line = serde_json::json!({
            "wire": wire.as_str(), "path": record.path, "headers": record.headers,
            "body": record.body, "model": record.model, "at_ms": at_ms,
        });
        use std::io::Write;
        // One write per line, under a lock: `writeln!` issues several writes, and requests
        // served at the same time would interleave their lines.
        let line = format!("{line}\n");
        let _serial = shared.requests.lock();
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(log) {
            let _ = f.write_all(line.as_bytes());
        }
    }
    if let Ok(mut r) = shared.requests.lock() {
        r.push(record);
    }

    if let Some(expected) = &shared.key {
        let presented = wire::presented_key(wire, &header_map);
        if presented.as_deref() != Some(expected.as_str()) {
            return wire::auth_error(wire, presented.as_deref());
        }
    }

    let call_index = {
        let mut counts = shared.counts.lock().unwrap_or_else(|e| e.into_inner());
        let n = counts.entry(model.clone()).or_insert(0);
        *n += 1;
        *n - 1
    };
    let mut script = Script::parse(&model);
    let queued = shared.replies.lock().ok().and_then(|mut r| r.get_mut(&script.name).and_then(|q| q.pop_front()));
    if let Some(reply) = queued {
        script.reply = Some(reply);
    }
    let state = wire::CallState {
        hangups: shared.hangups.clone(),
        cache: wire::CacheView::new(&shared.cache, &script),
        reported,
    };
    wire::respond(wire, &script, call_index, &json, stream, state).await
}

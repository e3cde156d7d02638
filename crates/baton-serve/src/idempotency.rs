//! `Idempotency-Key`: a client that sends a request again with the same key (its retry after a
//! dropped connection or a timeout) gets the first request's response, not a second run. A
//! repeat that arrives while the first still runs waits for it. Responses are kept in memory
//! for [`KEPT_FOR`], at most [`KEPT_AT_MOST`] of them and [`KEPT_BYTES_AT_MOST`] bytes, the
//! oldest answered going first; a request still running is never forgotten, so its retry never
//! runs it twice. A restart forgets them.
//!
//! A key belongs to the route and the token it came with: two callers never share one. A key
//! sent again with another request (another body, or other `x-baton-*` headers, which change
//! what a run may spend) is refused with 422.
//!
//! What is not kept: a response that says a retry may succeed (`x-should-retry: true`: nothing
//! ran), one whose client hung up before its end (the run was cancelled), and a stream whose
//! client fell behind (its run was stopped). A repeat of any of them runs anew.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::Stream;
use sha2::{Digest, Sha256};
use tokio::sync::watch;

use crate::handling::FellBehind;
use crate::{ApiError, Service};

/// How long a response is kept for a repeat of its request.
pub const KEPT_FOR: Duration = Duration::from_secs(60 * 60);

/// The most responses kept at once; past it, the oldest answered go first.
pub const KEPT_AT_MOST: usize = 1000;

/// The most bytes of responses kept at once (bodies and headers); past it, the oldest answered
/// go first.
pub const KEPT_BYTES_AT_MOST: usize = 64 << 20;

const KEY: HeaderName = HeaderName::from_static("idempotency-key");
const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// A first response, whole.
#[derive(Debug, Clone)]
struct Kept {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Kept {
    fn bytes(&self) -> usize {
        self.body.len() + self.headers.iter().map(|(k, v)| k.as_str().len() + v.len()).sum::<usize>()
    }
}

/// Where the first request of a key is.
#[derive(Debug, Clone)]
enum Slot {
    Answering,
    Answered(Arc<Kept>),
    /// Not kept (see the module's note): a repeat runs anew.
    Dropped,
}

#[derive(Debug)]
struct Entry {
    /// The request's method, path and body: a key sent with another request is refused.
    digest: [u8; 32],
    at: Instant,
    slot: watch::Receiver<Slot>,
}

/// The keys seen, and their responses.
#[derive(Debug, Default)]
pub(crate) struct Responses {
    entries: Mutex<HashMap<String, Entry>>,
}

impl Responses {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Forgets what is older than [`KEPT_FOR`], then the oldest beyond [`KEPT_AT_MOST`] or
    /// [`KEPT_BYTES_AT_MOST`]; never a request still running (a retry of it would run again).
    fn prune(entries: &mut HashMap<String, Entry>) {
        fn running(e: &Entry) -> bool {
            matches!(*e.slot.borrow(), Slot::Answering) && e.slot.has_changed().is_ok()
        }
        fn bytes(e: &Entry) -> usize {
            if let Slot::Answered(kept) = &*e.slot.borrow() { kept.bytes() } else { 0 }
        }
        entries.retain(|_, e| running(e) || e.at.elapsed() < KEPT_FOR);
        let mut kept: usize = entries.values().map(bytes).sum();
        while entries.len() >= KEPT_AT_MOST || kept > KEPT_BYTES_AT_MOST {
            let oldest = entries.iter().filter(|(_, e)| !running(e)).min_by_key(|(_, e)| e.at).map(|(k, _)| k.clone());
            let Some(gone) = oldest.and_then(|k| entries.remove(&k)) else { break };
            kept -= bytes(&gone);
        }
    }
}

/// The middleware: requests without a key pass through.
pub(crate) async fn replay(State(service): State<Arc<Service>>, request: Request, next: Next) -> Response {
    let Some(key) = request.headers().get(KEY).map(|v| v.to_str().map(str::to_owned)) else {
        return next.run(request).await;
    };
    let key = match key {
        Ok(key) if !key.is_empty() && key.len() <= 255 => key,
        _ => return ApiError::bad_request("Idempotency-Key must be 1 to 255 visible characters").into_response(),
    };
    let (parts, body) = request.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, service.options.max_body_bytes).await else {
        return ApiError::too_large(format!(
            "the request is over this server's limit of {} bytes",
            service.options.max_body_bytes
        ))
        .into_response();
    };
    // The key's scope: the token it came with (hashed; past the guard it is this server's, or
    // none on a loopback server without one) and the route.
    let scope: [u8; 32] = {
        let mut h = Sha256::new();
        h.update(parts.headers.get(axum::http::header::AUTHORIZATION).map_or(&b""[..], |v| v.as_bytes()));
        h.update([0]);
        h.update(parts.uri.path());
        h.finalize().into()
    };
    let key = format!("{}\0{key}", scope.iter().map(|b| format!("{b:02x}")).collect::<String>());
    // What the request asks: its method, body and every `x-baton-*` header (caps, the
    // conversation), in name order.
    let digest: [u8; 32] = {
        let mut h = Sha256::new();
        h.update(parts.method.as_str());
        h.update([0]);
        h.update(&bytes);
        let mut baton: Vec<(&str, &[u8])> = parts
            .headers
            .iter()
            .filter(|(name, _)| name.as_str().starts_with("x-baton-"))
            .map(|(name, value)| (name.as_str(), value.as_bytes()))
            .collect();
        baton.sort();
        for (name, value) in baton {
            h.update([0]);
            h.update(name);
            h.update([0]);
            h.update(value);
        }
        h.finalize().into()
    };
    let responses = &service.idempotent;
    let mut request = Some(Request::from_parts(parts, Body::from(bytes)));
    loop {
        // Decided under the lock, acted on after it: the lock is never held across a wait.
        let found = {
            let mut entries = responses.lock();
            Responses::prune(&mut entries);
            match entries.get(&key) {
                Some(e) if e.digest != digest => None,
                Some(e) => Some(Err(e.slot.clone())),
                None => {
                    let (tx, rx) = watch::channel(Slot::Answering);
                    entries.insert(key.clone(), Entry { digest, at: Instant::now(), slot: rx });
                    Some(Ok(tx))
                }
            }
        };
        let mut slot = match found {
            None => {
                return ApiError::unprocessable(
                    "this Idempotency-Key was sent with another request; send a new key with a new request",
                )
                .into_response();
            }
            Some(Ok(tx)) => {
                let Some(request) = request.take() else { unreachable!("the request runs once") };
                return first(next.run(request).await, tx);
            }
            Some(Err(slot)) => slot,
        };
        // The first one's client may hang up, which drops its sender: then it is not kept.
        let settled = slot.wait_for(|s| !matches!(s, Slot::Answering)).await.map(|s| s.clone());
        if let Ok(Slot::Answered(kept)) = settled {
            return replayed(&kept);
        }
        // Not kept: this request runs in its place (unless another repeat got there first).
        let mut entries = responses.lock();
        let gone = |e: &Entry| matches!(*e.slot.borrow(), Slot::Dropped) || e.slot.has_changed().is_err();
        if entries.get(&key).is_some_and(gone) {
            entries.remove(&key);
        }
    }
}

fn replayed(kept: &Kept) -> Response {
    let mut response = (kept.status, kept.body.clone()).into_response();
    *response.headers_mut() = kept.headers.clone();
    response.headers_mut().insert(REPLAYED, HeaderValue::from_static("true"));
    response
}

/// The first response of a key, passed on as it streams and kept once it has ended.
fn first(response: Response, tx: watch::Sender<Slot>) -> Response {
    let (parts, body) = response.into_parts();
    if parts.headers.get("x-should-retry").is_some_and(|v| v == "true") {
        let _ = tx.send(Slot::Dropped);
        return Response::from_parts(parts, body);
    }
    let tee = Tee {
        inner: Box::pin(body.into_data_stream()),
        status: parts.status,
        headers: parts.headers.clone(),
        body: Vec::new(),
        tx: Some(tx),
        fell_behind: parts.extensions.get::<FellBehind>().cloned(),
    };
    Response::from_parts(parts, Body::from_stream(tee))
}

/// A response body that keeps a copy of what it passes on, and hands it to the waiting repeats
/// at its end; dropped before its end (the client hung up), it keeps nothing.
struct Tee {
    inner: Pin<Box<dyn Stream<Item = Result<Bytes, axum::Error>> + Send>>,
    status: StatusCode,
    headers: HeaderMap,
    body: Vec<u8>,
    tx: Option<watch::Sender<Slot>>,
    /// A stream whose client fell behind ends early, its run stopped: not kept.
    fell_behind: Option<FellBehind>,
}

impl Stream for Tee {
    type Item = Result<Bytes, axum::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let polled = self.inner.as_mut().poll_next(cx);
        match &polled {
            Poll::Ready(Some(Ok(chunk))) => self.body.extend_from_slice(chunk),
            Poll::Ready(None) if self.fell_behind.as_ref().is_some_and(FellBehind::get) => {
                if let Some(tx) = self.tx.take() {
                    let _ = tx.send(Slot::Dropped);
                }
            }
            Poll::Ready(None) => {
                if let Some(tx) = self.tx.take() {
                    let kept = Kept {
                        status: self.status,
                        headers: std::mem::take(&mut self.headers),
                        body: Bytes::from(std::mem::take(&mut self.body)),
                    };
                    let _ = tx.send(Slot::Answered(Arc::new(kept)));
                }
            }
            Poll::Ready(Some(Err(_))) | Poll::Pending => {}
        }
        polled
    }
}

impl Drop for Tee {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(Slot::Dropped);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(slot: Slot, age: Duration) -> (watch::Sender<Slot>, Entry) {
        let (tx, rx) = watch::channel(slot);
        (tx, Entry { digest: [0; 32], at: Instant::now() - age, slot: rx })
    }

    fn answered(bytes: usize) -> Slot {
        Slot::Answered(Arc::new(Kept {
            status: StatusCode::OK,
            headers: HeaderMap::new(),
            body: Bytes::from(vec![0; bytes]),
        }))
    }

    #[test]
    fn the_oldest_answers_go_past_the_byte_bound_and_a_running_request_never_goes() {
        let mut entries = HashMap::new();
        let mut senders = Vec::new();
        // A request still running, older than everything (and than KEPT_FOR).
        let (tx, e) = entry(Slot::Answering, KEPT_FOR + Duration::from_secs(1));
        senders.push(tx);
        entries.insert("running".to_owned(), e);
        for (i, age) in [30, 20, 10].into_iter().enumerate() {
            let (tx, e) = entry(answered(30 << 20), Duration::from_secs(age));
            senders.push(tx);
            entries.insert(format!("answer-{i}"), e);
        }
        Responses::prune(&mut entries);
        let mut left: Vec<&str> = entries.keys().map(String::as_str).collect();
        left.sort();
        assert_eq!(left, ["answer-1", "answer-2", "running"], "90 MiB kept is over 64: the oldest answer went");

        // Past the count, the oldest answered go; the running one stays.
        for i in 0..KEPT_AT_MOST {
            let (tx, e) = entry(answered(1), Duration::from_millis(i as u64));
            senders.push(tx);
            entries.insert(format!("small-{i}"), e);
        }
        Responses::prune(&mut entries);
        assert!(entries.len() < KEPT_AT_MOST, "{}", entries.len());
        assert!(entries.contains_key("running"));
        assert!(!entries.contains_key("answer-1"), "the oldest answered went first");
    }
}

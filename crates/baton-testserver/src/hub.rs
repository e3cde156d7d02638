//! A loopback Hugging Face hub, written from the hub's documented file protocol and what its
//! client libraries (`huggingface_hub`, the `hf-hub` crate) read of it:
//!
//! - `HEAD`/`GET /<owner>/<name>/resolve/<revision>/<file>`: for an LFS file a `302` to a file
//!   host (a second listener, so another origin) with `X-Repo-Commit`, `X-Linked-Etag` (the
//!   SHA-256, quoted), `X-Linked-Size` and `ETag`; for a small file a `200` with its git ETag.
//! - The file host answers `GET` with `Range: bytes=N-` as `206` and `Content-Range`.
//! - Errors as the hub sends them: `401` with `X-Error-Code: RepoNotFound` or `GatedRepo`,
//!   `404` with `EntryNotFound` or `RevisionNotFound`, and `X-Error-Message`.
//!
//! - The dataset viewer (`datasets-server`), on the hub's own port here: `GET /splits?dataset=`
//!   and `GET /rows?dataset=&config=&split=&offset=&length=` (at most 100 rows a page) in its
//!   JSON, errors as `{"error": "..."}`.
//!
//! Scenarios: gated repositories (a bearer token required), a corrupt file host (other bytes
//! than the hash announced), an announced size larger than any disk, transfers cut after N
//! bytes, a pace per chunk, and a renamed repository (a relative redirect). Every request is
//! recorded with the bytes its answer carried.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::Response;
use axum::routing::any;
use bytes::Bytes;
use sha2::Digest;

/// The commit every file of the hub is at.
pub const COMMIT: &str = "5f1d3c0b8e2a4f6d9c7b1a3e5d7f9b2c4a6e8d0f";

/// How a [`TestHub`] serves.
#[derive(Debug, Clone)]
pub struct HubOptions {
    /// Bytes per chunk of a file body.
    pub chunk: usize,
    /// Pause before each chunk (zero: as fast as the client reads).
    pub chunk_delay: Duration,
    /// The token gated repositories require (`Authorization: Bearer …`).
    pub token: String,
}

impl Default for HubOptions {
    fn default() -> Self {
        HubOptions { chunk: 64 * 1024, chunk_delay: Duration::ZERO, token: "hf_test_token".into() }
    }
}

/// One request either host received.
#[derive(Debug, Clone)]
pub struct HubRequest {
    /// `hub` or `files`.
    pub host: &'static str,
    pub method: String,
    pub path: String,
    pub range: Option<String>,
    pub authorization: Option<String>,
    pub status: u16,
    /// Body bytes the connection took for this answer (so far, for one still streaming): a
    /// chunk counts once the connection asks for the next one, or the body ends.
    pub sent: Arc<AtomicU64>,
}

impl HubRequest {
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::SeqCst)
    }
}

#[derive(Debug, Clone)]
struct HubFile {
    bytes: Bytes,
    sha256: String,
    lfs: bool,
    /// What the file host sends instead (a corrupt mirror).
    served: Option<Bytes>,
    /// The size the hub announces, when it lies.
    announced: Option<u64>,
}

/// A dataset viewer split: (dataset, config, split).
type SplitKey = (String, String, String);

#[derive(Debug, Default)]
struct Shared {
    files: Mutex<HashMap<(String, String), HubFile>>,
    gated: Mutex<Vec<String>>,
    renamed: Mutex<HashMap<String, String>>,
    requests: Mutex<Vec<HubRequest>>,
    /// Transfers still to cut, each after this many bytes of its answer.
    cuts: Mutex<Vec<u64>>,
    options: Mutex<Option<HubOptions>>,
    files_addr: Mutex<Option<SocketAddr>>,
    datasets: Mutex<Vec<(SplitKey, Vec<serde_json::Value>)>>,
    /// Viewer answers still to fail with a 500 (a busy server).
    viewer_failures: Mutex<u32>,
    /// Columns the viewer says it cut short, by dataset.
    truncated: Mutex<HashMap<String, String>>,
}

/// A running hub and its file host, on two loopback ports; stops when dropped.
#[derive(Debug)]
pub struct TestHub {
    hub_addr: SocketAddr,
    shared: Arc<Shared>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl TestHub {
    pub async fn start(options: HubOptions) -> std::io::Result<TestHub> {
        Self::start_on(0, options).await
    }

    /// Starts with the hub on `port` (0 picks one) and the file host on a free port.
    pub async fn start_on(port: u16, options: HubOptions) -> std::io::Result<TestHub> {
        let shared = Arc::new(Shared { options: Mutex::new(Some(options)), ..Shared::default() });
        let hub = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
        let files = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let hub_addr = hub.local_addr()?;
        *lock(&shared.files_addr) = Some(files.local_addr()?);
        let hub_app = Router::new()
            .route("/{owner}/{name}/resolve/{rev}/{*file}", any(resolve))
            .route("/splits", axum::routing::get(viewer_splits))
            .route("/rows", axum::routing::get(viewer_rows))
            .with_state(shared.clone());
        let files_app = Router::new().route("/blobs/{sha}", any(blob)).with_state(shared.clone());
        let tasks = vec![
            tokio::spawn(async move {
                let _ = axum::serve(hub, hub_app).await;
            }),
            tokio::spawn(async move {
                let _ = axum::serve(files, files_app).await;
            }),
        ];
        Ok(TestHub { hub_addr, shared, tasks })
    }

    /// The hub's address, as `HF_ENDPOINT` takes it.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.hub_addr)
    }

    /// Adds an LFS file (as model weights are); returns its SHA-256.
    pub fn add(&self, repo: &str, file: &str, bytes: impl Into<Bytes>) -> String {
        self.insert(repo, file, bytes.into(), true)
    }

    /// Adds a small file kept in git itself (a config), whose ETag is not a SHA-256.
    pub fn add_small(&self, repo: &str, file: &str, bytes: impl Into<Bytes>) -> String {
        self.insert(repo, file, bytes.into(), false)
    }

    fn insert(&self, repo: &str, file: &str, bytes: Bytes, lfs: bool) -> String {
        let sha256 = hex(&sha2::Sha256::digest(&bytes));
        lock(&self.shared.files).insert(
            (repo.to_owned(), file.to_owned()),
            HubFile { bytes, sha256: sha256.clone(), lfs, served: None, announced: None },
        );
        sha256
    }

    /// Adds a split to the dataset viewer (`gate` the dataset to require the token).
    pub fn add_dataset(&self, dataset: &str, config: &str, split: &str, rows: Vec<serde_json::Value>) {
        lock(&self.shared.datasets).push(((dataset.to_owned(), config.to_owned(), split.to_owned()), rows));
    }

    /// The viewer marks `column` of every row of `dataset` as cut short (too long to serve).
    pub fn truncate(&self, dataset: &str, column: &str) {
        lock(&self.shared.truncated).insert(dataset.to_owned(), column.to_owned());
    }

    /// The next `n` dataset viewer requests fail with a 500.
    pub fn fail_viewer(&self, n: u32) {
        *lock(&self.shared.viewer_failures) = n;
    }

    /// Requires the token for this repository.
    pub fn gate(&self, repo: &str) {
        lock(&self.shared.gated).push(repo.to_owned());
    }

    /// Answers for `old` with a relative redirect to `new` (a renamed repository).
    pub fn rename(&self, old: &str, new: &str) {
        lock(&self.shared.renamed).insert(old.to_owned(), new.to_owned());
    }

    /// The file host sends other bytes than the hub's hash says (one byte flipped mid-file).
    pub fn corrupt(&self, repo: &str, file: &str) {
        if let Some(f) = lock(&self.shared.files).get_mut(&(repo.to_owned(), file.to_owned())) {
            let mut bytes = f.bytes.to_vec();
            let mid = bytes.len() / 2;
            bytes[mid] ^= 0xff;
            f.served = Some(bytes.into());
        }
    }

    /// The hub announces `size` bytes for the file (more than any disk holds, say).
    pub fn announce_size(&self, repo: &str, file: &str, size: u64) {
        if let Some(f) = lock(&self.shared.files).get_mut(&(repo.to_owned(), file.to_owned())) {
            f.announced = Some(size);
        }
    }

    /// The next transfer from the file host breaks off after `bytes` bytes of its answer.
    pub fn cut_next_transfer_after(&self, bytes: u64) {
        lock(&self.shared.cuts).push(bytes);
    }

    /// Paces the file host: a pause before each chunk.
    pub fn set_chunk_delay(&self, delay: Duration) {
        if let Some(o) = lock(&self.shared.options).as_mut() {
            o.chunk_delay = delay;
        }
    }

    pub fn requests(&self) -> Vec<HubRequest> {
        lock(&self.shared.requests).clone()
    }

    /// Body bytes the file host has sent, over all its answers.
    pub fn file_bytes_sent(&self) -> u64 {
        self.requests().iter().filter(|r| r.host == "files").map(HubRequest::sent).sum()
    }

    /// Waits for the server tasks (for the standalone binary).
    pub async fn serve_forever(mut self) {
        for task in std::mem::take(&mut self.tasks) {
            let _ = task.await;
        }
    }
}

impl Drop for TestHub {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn record(
    shared: &Shared,
    host: &'static str,
    method: &Method,
    path: String,
    headers: &HeaderMap,
    status: u16,
) -> Arc<AtomicU64> {
    let get = |name: header::HeaderName| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let sent = Arc::new(AtomicU64::new(0));
    lock(&shared.requests).push(HubRequest {
        host,
        method: method.to_string(),
        path,
        range: get(header::RANGE),
        authorization: get(header::AUTHORIZATION),
        status,
        sent: sent.clone(),
    });
    sent
}

fn hub_error(status: StatusCode, code: &str, message: &str) -> Response {
    Response::builder()
        .status(status)
        .header("x-error-code", code)
        .header("x-error-message", message)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(serde_json::json!({ "error": message }).to_string()))
        .unwrap_or_default()
}

async fn resolve(
    State(shared): State<Arc<Shared>>,
    Path((owner, name, rev, file)): Path<(String, String, String, String)>,
    method: Method,
    headers: HeaderMap,
) -> Response {
    let repo = format!("{owner}/{name}");
    let path = format!("/{repo}/resolve/{rev}/{file}");
    let response = resolve_answer(&shared, &repo, &rev, &file, &method, &headers);
    let sent = record(&shared, "hub", &method, path, &headers, response.0.status().as_u16());
    match response {
        (r, None) => r,
        (r, Some((bytes, start))) => body_response(&shared, r, bytes, start, sent, false),
    }
}

/// The hub's answer, and for a small file served from the hub itself, its bytes from `start`.
fn resolve_answer(
    shared: &Shared,
    repo: &str,
    rev: &str,
    file: &str,
    method: &Method,
    headers: &HeaderMap,
) -> (Response, Option<(Bytes, u64)>) {
    if let Some(new) = lock(&shared.renamed).get(repo) {
        let to = format!("/{new}/resolve/{rev}/{file}");
        let r = Response::builder().status(StatusCode::TEMPORARY_REDIRECT).header(header::LOCATION, to);
        return (r.body(Body::empty()).unwrap_or_default(), None);
    }
    let files = lock(&shared.files).clone();
    if !files.keys().any(|(r, _)| r == repo) {
        let message = format!("Repository Not Found for url: /{repo}/resolve/{rev}/{file}.");
        return (hub_error(StatusCode::UNAUTHORIZED, "RepoNotFound", &message), None);
    }
    let token = lock(&shared.options).as_ref().map(|o| o.token.clone()).unwrap_or_default();
    let presented = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    if lock(&shared.gated).iter().any(|g| g == repo) && presented != Some(&format!("Bearer {token}")) {
        let message = format!(
            "Access to model {repo} is restricted. You must have access to it and be authenticated to access it. Please log in."
        );
        return (hub_error(StatusCode::UNAUTHORIZED, "GatedRepo", &message), None);
    }
    if rev != "main" && rev != COMMIT {
        return (hub_error(StatusCode::NOT_FOUND, "RevisionNotFound", &format!("Invalid rev id: {rev}")), None);
    }
    let Some(f) = files.get(&(repo.to_owned(), file.to_owned())) else {
        return (
            hub_error(StatusCode::NOT_FOUND, "EntryNotFound", &format!("{file} does not exist on \"{rev}\"")),
            None,
        );
    };
    let size = f.announced.unwrap_or(f.bytes.len() as u64);
    let git_etag = format!("\"{}\"", &hex(&sha2::Sha256::digest([f.sha256.as_bytes(), b"git"].concat()))[..40]);
    let builder = Response::builder().header("x-repo-commit", COMMIT).header(header::ETAG, &git_etag);
    if f.lfs {
        let files_addr = lock(&shared.files_addr).unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 9)));
        // Signed like a CDN's address: the signature is for this one file.
        let location =
            format!("http://{files_addr}/blobs/{}?Expires=4102444800&Signature=sig-{}", f.sha256, &f.sha256[..8]);
        let r = builder
            .status(StatusCode::FOUND)
            .header(header::LOCATION, location)
            .header("x-linked-etag", format!("\"{}\"", f.sha256))
            .header("x-linked-size", size.to_string())
            .body(Body::empty())
            .unwrap_or_default();
        return (r, None);
    }
    let r = builder.status(StatusCode::OK).header(header::CONTENT_LENGTH, size.to_string());
    if *method == Method::HEAD {
        return (r.body(Body::empty()).unwrap_or_default(), None);
    }
    let start = range_start(headers).unwrap_or(0);
    (r.body(Body::empty()).unwrap_or_default(), Some((f.served.clone().unwrap_or(f.bytes.clone()), start)))
}

async fn blob(
    State(shared): State<Arc<Shared>>,
    Path(sha): Path<String>,
    method: Method,
    headers: HeaderMap,
) -> Response {
    let path = format!("/blobs/{sha}");
    let file = lock(&shared.files).values().find(|f| f.sha256 == sha).cloned();
    let Some(file) = file else {
        record(&shared, "files", &method, path, &headers, 404);
        return Response::builder().status(StatusCode::NOT_FOUND).body(Body::from("NoSuchKey")).unwrap_or_default();
    };
    let bytes = file.served.clone().unwrap_or(file.bytes.clone());
    let start = range_start(&headers).unwrap_or(0);
    if start > 0 && start >= bytes.len() as u64 {
        record(&shared, "files", &method, path, &headers, 416);
        return Response::builder()
            .status(StatusCode::RANGE_NOT_SATISFIABLE)
            .header(header::CONTENT_RANGE, format!("bytes */{}", bytes.len()))
            .body(Body::empty())
            .unwrap_or_default();
    }
    let status = if start > 0 { 206 } else { 200 };
    let sent = record(&shared, "files", &method, path, &headers, status);
    if method == Method::HEAD {
        return Response::builder()
            .header(header::CONTENT_LENGTH, bytes.len().to_string())
            .body(Body::empty())
            .unwrap_or_default();
    }
    body_response(&shared, Response::new(Body::empty()), bytes, start, sent, true)
}

/// `bytes=N-` (or `bytes=N-M`, read as from N).
fn range_start(headers: &HeaderMap) -> Option<u64> {
    let value = headers.get(header::RANGE)?.to_str().ok()?;
    value.strip_prefix("bytes=")?.split('-').next()?.trim().parse().ok()
}

/// `bytes[start..]` as the body of `head`'s answer: paced, counted, and cut where a cut is due.
fn body_response(
    shared: &Shared,
    head: Response,
    bytes: Bytes,
    start: u64,
    sent: Arc<AtomicU64>,
    may_cut: bool,
) -> Response {
    let (options, cut) = {
        let options = lock(&shared.options).clone().unwrap_or_default();
        let cut = if may_cut { lock(&shared.cuts).pop() } else { None };
        (options, cut)
    };
    let total = bytes.len() as u64;
    let body = bytes.slice(start as usize..);
    let length = body.len();
    let chunk = options.chunk.max(1);
    // A chunk counts as sent when the connection asks for the next one (it has taken the last),
    // the last one when it is yielded: a chunk yielded into a connection the client has dropped is not sent.
    let stream = futures::stream::unfold((0usize, body, 0u64), move |(offset, body, pending)| {
        let sent = sent.clone();
        async move {
            sent.fetch_add(pending, Ordering::SeqCst);
            if offset >= body.len() {
                return None;
            }
            if let Some(cut) = cut
                && offset as u64 >= cut
            {
                // Ends the body with an error: hyper closes the connection mid-transfer. The pause
                // first lets it flush what it holds, so the client gets every byte up to the cut.
                tokio::time::sleep(Duration::from_millis(50)).await;
                return Some((Err(std::io::Error::other("transfer cut")), (body.len(), body, 0)));
            }
            if !options.chunk_delay.is_zero() {
                tokio::time::sleep(options.chunk_delay).await;
            }
            let mut end = (offset + chunk).min(body.len());
            if let Some(cut) = cut {
                end = end.min(cut.max(offset as u64 + 1) as usize);
            }
            let piece = body.slice(offset..end);
            let mut len = piece.len() as u64;
            if end == body.len() {
                // With the length known, the connection may never ask past the last chunk.
                sent.fetch_add(len, Ordering::SeqCst);
                len = 0;
            }
            Some((Ok::<Bytes, std::io::Error>(piece), (end, body, len)))
        }
    });
    let (mut parts, _) = head.into_parts();
    parts.headers.insert(header::CONTENT_LENGTH, length.into());
    parts.headers.insert(header::ACCEPT_RANGES, header::HeaderValue::from_static("bytes"));
    if start > 0 {
        parts.status = StatusCode::PARTIAL_CONTENT;
        if let Ok(v) = header::HeaderValue::from_str(&format!("bytes {start}-{}/{total}", total - 1)) {
            parts.headers.insert(header::CONTENT_RANGE, v);
        }
    }
    Response::from_parts(parts, Body::from_stream(stream))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn viewer_error(status: StatusCode, message: &str) -> Response {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(serde_json::json!({ "error": message }).to_string()))
        .unwrap_or_default()
}

fn viewer_json(value: serde_json::Value) -> Response {
    Response::builder()
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(value.to_string()))
        .unwrap_or_default()
}

/// The viewer's refusal, or `None` when `dataset` may be read with these headers.
fn viewer_refuses(shared: &Shared, dataset: &str, headers: &HeaderMap) -> Option<Response> {
    {
        let mut failures = lock(&shared.viewer_failures);
        if *failures > 0 {
            *failures -= 1;
            return Some(viewer_error(StatusCode::INTERNAL_SERVER_ERROR, "Unexpected error."));
        }
    }
    let known = lock(&shared.datasets).iter().any(|((d, _, _), _)| d == dataset);
    let gated = lock(&shared.gated).iter().any(|g| g == dataset);
    let token = lock(&shared.options).as_ref().map(|o| o.token.clone()).unwrap_or_default();
    let authorized =
        headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) == Some(&format!("Bearer {token}"));
    (!known || (gated && !authorized)).then(|| {
        viewer_error(
            StatusCode::NOT_FOUND,
            "The dataset does not exist, or is not accessible without authentication (private or gated). Please check the spelling of the dataset name or retry with authentication.",
        )
    })
}

async fn viewer_splits(
    State(shared): State<Arc<Shared>>,
    axum::extract::Query(q): axum::extract::Query<HashMap<String, String>>,
    method: Method,
    headers: HeaderMap,
) -> Response {
    let dataset = q.get("dataset").cloned().unwrap_or_default();
    let response = viewer_refuses(&shared, &dataset, &headers).unwrap_or_else(|| {
        let splits: Vec<serde_json::Value> = lock(&shared.datasets)
            .iter()
            .filter(|((d, _, _), _)| *d == dataset)
            .map(|((d, c, s), _)| serde_json::json!({ "dataset": d, "config": c, "split": s }))
            .collect();
        viewer_json(serde_json::json!({ "splits": splits, "pending": [], "failed": [] }))
    });
    record(&shared, "hub", &method, format!("/splits?dataset={dataset}"), &headers, response.status().as_u16());
    response
}

async fn viewer_rows(
    State(shared): State<Arc<Shared>>,
    axum::extract::Query(q): axum::extract::Query<HashMap<String, String>>,
    method: Method,
    headers: HeaderMap,
) -> Response {
    let get = |k: &str| q.get(k).cloned().unwrap_or_default();
    let (dataset, config, split) = (get("dataset"), get("config"), get("split"));
    let offset: usize = get("offset").parse().unwrap_or(0);
    let length: usize = get("length").parse().unwrap_or(100);
    let response = viewer_refuses(&shared, &dataset, &headers).unwrap_or_else(|| {
        if length > 100 {
            return viewer_error(StatusCode::UNPROCESSABLE_ENTITY, "Parameter 'length' must not be greater than 100");
        }
        let all = lock(&shared.datasets);
        let Some((_, rows)) = all.iter().find(|((d, c, s), _)| *d == dataset && *c == config && *s == split) else {
            return viewer_error(StatusCode::NOT_FOUND, "Not found.");
        };
        let cut: Vec<String> = lock(&shared.truncated).get(&dataset).cloned().into_iter().collect();
        let page: Vec<serde_json::Value> = rows
            .iter()
            .enumerate()
            .skip(offset)
            .take(length)
            .map(|(i, row)| serde_json::json!({ "row_idx": i, "row": row, "truncated_cells": cut }))
            .collect();
        let features: Vec<serde_json::Value> = rows
            .first()
            .and_then(|r| r.as_object())
            .map(|o| {
                o.keys()
                    .enumerate()
                    .map(|(i, k)| serde_json::json!({ "feature_idx": i, "name": k, "type": { "_type": "Value" } }))
                    .collect()
            })
            .unwrap_or_default();
        viewer_json(serde_json::json!({
            "features": features, "rows": page, "num_rows_total": rows.len(), "num_rows_per_page": 100, "partial": false,
        }))
    });
    record(
        &shared,
        "hub",
        &method,
        format!("/rows?dataset={dataset}&config={config}&split={split}&offset={offset}&length={length}"),
        &headers,
        response.status().as_u16(),
    );
    response
}

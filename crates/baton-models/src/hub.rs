//! The hub's file protocol, as `huggingface_hub` and the `hf-hub` crate speak it:
//!
//! 1. `HEAD <endpoint>/<repo>/resolve/<revision>/<file>` without following redirects. The answer
//!    names the commit (`X-Repo-Commit`), the file's ETag (`X-Linked-Etag` for LFS files: their
//!    SHA-256; else `ETag`), its size (`X-Linked-Size`, else `Content-Length`), and for LFS files
//!    a redirect (`Location`) to a file host. Relative redirects (a renamed repository) are
//!    followed; errors carry `X-Error-Code` (`GatedRepo`, `RepoNotFound`, `EntryNotFound`,
//!    `RevisionNotFound`) and `X-Error-Message`.
//! 2. `GET` on that address, with `Range: bytes=N-` to go on from byte N.
//!
//! The token goes only to the endpoint's own origin, never to the file host a redirect names
//! (its address is signed for the one file).

use std::path::Path;
use std::time::{Duration, Instant};

use futures::StreamExt;
use reqwest::StatusCode;
use reqwest::header::{self, HeaderMap};
use sha2::Digest;
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::cache::{Cache, PartialNote};
use crate::{ModelRef, PullError};

pub(crate) const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Room left free beside a download, so that finishing it does not fill the disk to the last byte.
const SPACE_MARGIN: u64 = 64 * 1024 * 1024;
/// Dropped connections in a row (with no byte between them) before a pull gives up.
const MAX_DROPS: u32 = 5;
/// How often progress is reported while bytes flow.
const PROGRESS_EVERY: Duration = Duration::from_millis(100);

/// A hub endpoint and the token to show it.
#[derive(Clone)]
pub struct Hub {
    endpoint: String,
    token: Option<String>,
    /// For the hub: redirects are read, not followed.
    http: reqwest::Client,
    /// For the file host, which may redirect once more (mirrors do); reqwest drops credentials
    /// on a redirect to another host, and the file host gets none anyway.
    files: reqwest::Client,
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The token is never printed.
        f.debug_struct("Hub").field("endpoint", &self.endpoint).field("token", &self.token.is_some()).finish()
    }
}

/// What the hub says of a file before it is downloaded.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileMeta {
    commit: String,
    /// The name of its blob in the cache: the SHA-256 for LFS files, the git blob id otherwise.
    etag: String,
    /// The SHA-256 to check the bytes against (LFS files only: other files are small text
    /// files whose ETag is a git hash).
    sha256: Option<String>,
    size: u64,
    /// Where the bytes are (the file host a redirect names, or the resolve address itself).
    url: reqwest::Url,
}

/// How far a pull is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Progress {
    pub phase: Phase,
    /// Bytes done in this phase, of `total`.
    pub done: u64,
    pub total: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Asking the hub about the file.
    Resolving,
    /// Reading back the part an earlier pull left, to go on checking its SHA-256.
    Checking,
    Downloading,
    /// The connection dropped; trying again from the last byte on disk.
    Reconnecting,
}

/// A finished pull.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Pulled {
    pub reference: ModelRef,
    /// The file to load.
    pub path: std::path::PathBuf,
    pub size: u64,
    pub commit: String,
    /// The SHA-256 the bytes were checked against; `None` for a small non-LFS file, whose size
    /// alone was checked.
    pub sha256: Option<String>,
    /// Bytes fetched by this pull (the rest was on disk already).
    pub fetched: u64,
    /// Where this pull started: 0 for a fresh download, the partial file's size when resumed.
    pub resumed_from: u64,
    /// The file was complete in the cache already; nothing was fetched.
    pub cached: bool,
}

impl Hub {
    /// `endpoint` is the hub's address (`https://huggingface.co`, or a mirror).
    pub fn new(endpoint: &str, token: Option<String>) -> Hub {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(15))
            // A stalled transfer is a dropped connection: it resumes from the last byte.
            .read_timeout(Duration::from_secs(60))
            // Redirects are read, not followed: the token must not reach another host, and an
            // LFS redirect carries the file's metadata in its own headers.
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("baton/", env!("CARGO_PKG_VERSION")))
            .build()
            .unwrap_or_else(|_| reqwest::Client::new());
        let files = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(15))
            .read_timeout(Duration::from_secs(60))
            .redirect(reqwest::redirect::Policy::limited(5))
            .user_agent(concat!("baton/", env!("CARGO_PKG_VERSION")))
            .build()
            .unwrap_or_else(|_| reqwest::Client::new());
        let token = token.filter(|t| !t.trim().is_empty()).map(|t| t.trim().to_owned());
        Hub { endpoint: endpoint.trim().trim_end_matches('/').to_owned(), token, http, files }
    }

    /// `$HF_ENDPOINT` (else the official hub) with `$HF_TOKEN` (or the older
    /// `$HUGGING_FACE_HUB_TOKEN`) when set, else `keychain_token(endpoint)`.
    pub fn from_env(keychain_token: impl FnOnce(&str) -> Option<String>) -> Hub {
        let endpoint = std::env::var("HF_ENDPOINT").ok().filter(|e| !e.trim().is_empty());
        let endpoint = endpoint.as_deref().unwrap_or(DEFAULT_ENDPOINT).trim().trim_end_matches('/').to_owned();
        let token = ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"]
            .iter()
            .find_map(|v| std::env::var(v).ok().filter(|t| !t.trim().is_empty()))
            .or_else(|| keychain_token(&endpoint));
        Hub::new(&endpoint, token)
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// The file's `resolve` address.
    pub fn resolve_url(&self, reference: &ModelRef) -> String {
        let file: Vec<String> = reference.file.split('/').map(encode).collect();
        format!("{}/{}/resolve/{}/{}", self.endpoint, reference.repo, encode(&reference.revision), file.join("/"))
    }

    /// Whether `url` is on the endpoint's own origin (the only one that gets the token).
    fn same_origin(&self, url: &reqwest::Url) -> bool {
        reqwest::Url::parse(&self.endpoint).is_ok_and(|e| {
            e.scheme() == url.scheme()
                && e.host_str() == url.host_str()
                && e.port_or_known_default() == url.port_or_known_default()
        })
    }

    fn request(&self, method: reqwest::Method, url: reqwest::Url) -> reqwest::RequestBuilder {
        let client = if self.same_origin(&url) { &self.http } else { &self.files };
        let mut request = client.request(method, url.clone()).header(header::ACCEPT_ENCODING, "identity");
        if let Some(token) = &self.token
            && self.same_origin(&url)
        {
            request = request.bearer_auth(token);
        }
        request
    }

    async fn metadata(&self, reference: &ModelRef) -> Result<FileMeta, PullError> {
        let start = self.resolve_url(reference);
        let mut url = reqwest::Url::parse(&start)
            .map_err(|e| PullError::Protocol { url: start.clone(), what: format!("not an address: {e}") })?;
        for _ in 0..5 {
            let response = self
                .request(reqwest::Method::HEAD, url.clone())
                .timeout(Duration::from_secs(30))
                .send()
                .await
                .map_err(|e| PullError::Unreachable { url: url.to_string(), cause: cause(&e) })?;
            let status = response.status();
            let headers = response.headers();
            if status.is_success() || status.is_redirection() {
                let location = headers
                    .get(header::LOCATION)
                    .and_then(|l| l.to_str().ok())
                    .map(|l| url.join(l))
                    .transpose()
                    .map_err(|e| PullError::Protocol { url: url.to_string(), what: format!("a bad Location: {e}") })?;
                // A relative redirect stays on the hub (a renamed repository, a cached resolve):
                // followed, as the hub's own clients do. An absolute one is the file host.
                let relative = headers
                    .get(header::LOCATION)
                    .and_then(|l| l.to_str().ok())
                    .is_some_and(|l| !l.contains("://") && !l.starts_with("//"));
                if status.is_redirection()
                    && relative
                    && let Some(next) = &location
                {
                    url = next.clone();
                    continue;
                }
                let target = if status.is_redirection() { location } else { Some(url.clone()) };
                return read_meta(&url, headers, target);
            }
            return Err(self.refusal(reference, &url, status, headers));
        }
        Err(PullError::Protocol { url: start, what: "more than five redirects".into() })
    }

    fn refusal(&self, r: &ModelRef, url: &reqwest::Url, status: StatusCode, headers: &HeaderMap) -> PullError {
        let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let code = get("x-error-code").unwrap_or_default();
        let message = get("x-error-message");
        let endpoint = self.endpoint.clone();
        match (code.as_str(), status.as_u16()) {
            ("GatedRepo", _) | ("", 401 | 403) => {
                PullError::Gated { repo: r.repo.clone(), endpoint, had_token: self.token.is_some(), message }
            }
            ("RepoNotFound", _) => PullError::RepoNotFound { repo: r.repo.clone(), endpoint },
            ("RevisionNotFound", _) => {
                PullError::RevisionNotFound { repo: r.repo.clone(), revision: r.revision.clone(), endpoint }
            }
            ("EntryNotFound", _) | ("", 404) => PullError::FileNotFound {
                repo: r.repo.clone(),
                revision: r.revision.clone(),
                file: r.file.clone(),
                endpoint,
            },
            _ => PullError::Http { url: url.to_string(), status: status.as_u16(), message },
        }
    }

    /// Downloads `reference` into `cache` (or finds it there) and returns the file to load.
    ///
    /// Resumes a partial file an earlier pull left; retries a dropped connection from the last
    /// byte on disk; refuses to start without the space to finish; checks the SHA-256 before
    /// the file takes its place (a mismatch deletes the data). `on_progress` is called at most
    /// every 100 ms while bytes flow. Stopping (`stop`) keeps what is on disk for the next pull.
    pub async fn pull(
        &self,
        cache: &Cache,
        reference: &ModelRef,
        on_progress: &mut (dyn FnMut(Progress) + Send),
        stop: &CancellationToken,
    ) -> Result<Pulled, PullError> {
        on_progress(Progress { phase: Phase::Resolving, done: 0, total: 0 });
        let meta = tokio::select! {
            meta = self.metadata(reference) => meta?,
            () = stop.cancelled() => return Err(PullError::Cancelled { have: 0, size: 0 }),
        };
        let repo = &reference.repo;
        let blob = cache.blob(repo, &meta.etag);
        let done = |fetched: u64, resumed_from: u64, cached: bool| -> Result<Pulled, PullError> {
            let path = cache.link(reference, &meta.commit, &meta.etag).map_err(io(cache.repo_dir(repo).as_path()))?;
            Ok(Pulled {
                reference: reference.clone(),
                path,
                size: meta.size,
                commit: meta.commit.clone(),
                sha256: meta.sha256.clone(),
                fetched,
                resumed_from,
                cached,
            })
        };
        if std::fs::metadata(&blob).is_ok_and(|m| m.len() == meta.size) {
            return done(0, 0, true);
        }

        let blobs = cache.blobs_dir(repo);
        std::fs::create_dir_all(&blobs).map_err(io(&blobs))?;
        let partial = cache.incomplete(repo, &meta.etag);
        // Space first, before a partial file (and its note) exists for a download that cannot
        // finish: what a partial file holds already need not fit again.
        let on_disk = std::fs::metadata(&partial).map_or(0, |m| m.len()).min(meta.size);
        let free = fs2::available_space(&blobs).map_err(io(&blobs))?;
        let need = meta.size - on_disk;
        if free < need.saturating_add(SPACE_MARGIN) {
            return Err(PullError::NoSpace { dir: blobs, need, free });
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&partial)
            .map_err(io(&partial))?;
        // The lock lives as long as the file is open: one writer per partial file, across
        // processes (the app and the command line), and released by a crash.
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => return Err(PullError::Busy { reference: reference.to_string() }),
            Err(std::fs::TryLockError::Error(e)) => return Err(io(&partial)(e)),
        }
        // Another pull may have finished it between our look and the lock (and renamed the
        // partial file we opened into the blob).
        if std::fs::metadata(&blob).is_ok_and(|m| m.len() == meta.size) {
            return done(0, 0, true);
        }
        let note = PartialNote { reference: reference.clone(), commit: meta.commit.clone(), size: meta.size };
        let note_path = cache.note(repo, &meta.etag);
        std::fs::write(&note_path, serde_json::to_vec(&note).unwrap_or_default()).map_err(io(&note_path))?;

        let mut have = file.metadata().map_err(io(&partial))?.len();
        let mut file = tokio::fs::File::from_std(file);
        if have > meta.size {
            file.set_len(0).await.map_err(io(&partial))?;
            have = 0;
        }

        // The hash covers the whole file, so a resumed pull first reads back what is there.
        let mut hasher = sha2::Sha256::new();
        if have > 0 {
            let mut buf = vec![0u8; 1 << 20];
            let mut read = 0u64;
            file.seek(std::io::SeekFrom::Start(0)).await.map_err(io(&partial))?;
            let mut last = Instant::now();
            while read < have {
                if stop.is_cancelled() {
                    return Err(PullError::Cancelled { have, size: meta.size });
                }
                let want = buf.len().min((have - read) as usize);
                let n = file.read(&mut buf[..want]).await.map_err(io(&partial))?;
                if n == 0 {
                    break;
                }
                hasher.update(&buf[..n]);
                read += n as u64;
                if last.elapsed() >= PROGRESS_EVERY {
                    last = Instant::now();
                    on_progress(Progress { phase: Phase::Checking, done: read, total: have });
                }
            }
            have = read;
            on_progress(Progress { phase: Phase::Checking, done: read, total: have });
        }
        let mut resumed_from = have;

        let mut drops = 0u32;
        let mut url = meta.url.clone();
        let mut refreshed = false;
        while have < meta.size {
            file.seek(std::io::SeekFrom::Start(have)).await.map_err(io(&partial))?;
            let mut request = self.request(reqwest::Method::GET, url.clone());
            if have > 0 {
                request = request.header(header::RANGE, format!("bytes={have}-"));
            }
            let sent = tokio::select! {
                r = request.send() => r,
                () = stop.cancelled() => return Err(PullError::Cancelled { have, size: meta.size }),
            };
            let response = match sent {
                Ok(r) => r,
                Err(e) => {
                    drops += 1;
                    if drops > MAX_DROPS {
                        return Err(PullError::Unreachable { url: host_of(&url), cause: cause(&e) });
                    }
                    on_progress(Progress { phase: Phase::Reconnecting, done: have, total: meta.size });
                    backoff(drops, stop).await;
                    continue;
                }
            };
            let status = response.status();
            match status {
                StatusCode::PARTIAL_CONTENT => {
                    let start = content_range_start(response.headers());
                    if start != Some(have) {
                        return Err(PullError::Protocol {
                            url: host_of(&url),
                            what: format!("asked for bytes from {have}, got a range starting at {start:?}"),
                        });
                    }
                }
                StatusCode::OK => {
                    if have > 0 {
                        // The server ignored the range: the body starts at byte 0.
                        tracing::info!(%reference, have, "the file host ignored the range; starting over");
                        file.set_len(0).await.map_err(io(&partial))?;
                        file.seek(std::io::SeekFrom::Start(0)).await.map_err(io(&partial))?;
                        have = 0;
                        resumed_from = 0;
                        hasher = sha2::Sha256::new();
                    }
                }
                StatusCode::RANGE_NOT_SATISFIABLE => {
                    return Err(PullError::Protocol {
                        url: host_of(&url),
                        what: format!("refused the range from byte {have} of a {}-byte file", meta.size),
                    });
                }
                // A file host's signed address expires (a resume hours later): ask the hub for a
                // fresh one, once.
                StatusCode::FORBIDDEN | StatusCode::UNAUTHORIZED if !refreshed && !self.same_origin(&url) => {
                    refreshed = true;
                    let fresh = tokio::select! {
                        m = self.metadata(reference) => m?,
                        () = stop.cancelled() => return Err(PullError::Cancelled { have, size: meta.size }),
                    };
                    if fresh.etag != meta.etag || fresh.size != meta.size {
                        // The revision moved on to another file while this one downloaded: the
                        // part on disk stays for a pull of the old commit; this pull starts again.
                        return Err(PullError::Protocol {
                            url: host_of(&url),
                            what: format!(
                                "{reference} changed on the hub during the download; pull again to download the new version"
                            ),
                        });
                    }
                    url = fresh.url;
                    continue;
                }
                _ if status.is_server_error() => {
                    drops += 1;
                    if drops > MAX_DROPS {
                        return Err(PullError::Http { url: host_of(&url), status: status.as_u16(), message: None });
                    }
                    on_progress(Progress { phase: Phase::Reconnecting, done: have, total: meta.size });
                    backoff(drops, stop).await;
                    continue;
                }
                _ if self.same_origin(&url) => return Err(self.refusal(reference, &url, status, response.headers())),
                _ => return Err(PullError::Http { url: host_of(&url), status: status.as_u16(), message: None }),
            }

            let mut body = response.bytes_stream();
            let mut last = Instant::now();
            loop {
                let chunk = tokio::select! {
                    c = body.next() => c,
                    () = stop.cancelled() => {
                        file.flush().await.map_err(io(&partial))?;
                        return Err(PullError::Cancelled { have, size: meta.size });
                    }
                };
                match chunk {
                    Some(Ok(bytes)) => {
                        if have + bytes.len() as u64 > meta.size {
                            file.set_len(0).await.map_err(io(&partial))?;
                            return Err(PullError::Protocol {
                                url: host_of(&url),
                                what: format!("sent more than the {} bytes the hub announced", meta.size),
                            });
                        }
                        // Written through before the next read: after a crash, what the file
                        // holds is exactly what the next pull need not fetch again.
                        file.write_all(&bytes).await.map_err(io(&partial))?;
                        file.flush().await.map_err(io(&partial))?;
                        hasher.update(&bytes);
                        have += bytes.len() as u64;
                        drops = 0;
                        if last.elapsed() >= PROGRESS_EVERY {
                            last = Instant::now();
                            on_progress(Progress { phase: Phase::Downloading, done: have, total: meta.size });
                        }
                    }
                    Some(Err(e)) => {
                        drops += 1;
                        tracing::info!(%reference, have, "the download's connection dropped: {}", cause(&e));
                        if drops > MAX_DROPS {
                            return Err(PullError::Unreachable { url: host_of(&url), cause: cause(&e) });
                        }
                        on_progress(Progress { phase: Phase::Reconnecting, done: have, total: meta.size });
                        backoff(drops, stop).await;
                        break;
                    }
                    None => {
                        if have < meta.size {
                            // The body ended early without an error: also a dropped connection.
                            drops += 1;
                            if drops > MAX_DROPS {
                                return Err(PullError::Unreachable {
                                    url: host_of(&url),
                                    cause: format!("the transfer kept ending at byte {have} of {}", meta.size),
                                });
                            }
                            on_progress(Progress { phase: Phase::Reconnecting, done: have, total: meta.size });
                            backoff(drops, stop).await;
                        }
                        break;
                    }
                }
            }
        }
        on_progress(Progress { phase: Phase::Downloading, done: have, total: meta.size });
        file.sync_all().await.map_err(io(&partial))?;
        drop(file);

        let actual = hex(&hasher.finalize());
        if let Some(expected) = &meta.sha256
            && *expected != actual
        {
            let _ = std::fs::remove_file(&partial);
            let _ = std::fs::remove_file(&note_path);
            return Err(PullError::Checksum { file: reference.to_string(), expected: expected.clone(), actual });
        }
        std::fs::rename(&partial, &blob).map_err(io(&blob))?;
        let _ = std::fs::remove_file(&note_path);
        done(meta.size - resumed_from, resumed_from, false)
    }
}

/// Turns an I/O error into one that names the file.
fn io(path: &Path) -> impl FnOnce(std::io::Error) -> PullError + use<> {
    let path = path.to_path_buf();
    move |source| PullError::Io { path, source }
}

fn read_meta(url: &reqwest::Url, headers: &HeaderMap, target: Option<reqwest::Url>) -> Result<FileMeta, PullError> {
    let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let missing = |what: &str| PullError::Protocol {
        url: url.to_string(),
        what: format!("no {what} in its answer (is HF_ENDPOINT a Hugging Face hub or mirror?)"),
    };
    let commit = get("x-repo-commit").ok_or_else(|| missing("X-Repo-Commit"))?;
    let linked = get("x-linked-etag");
    let etag = linked.clone().or_else(|| get("etag")).map(|e| normalize_etag(&e)).ok_or_else(|| missing("ETag"))?;
    let size = get("x-linked-size")
        .or_else(|| get("content-length"))
        .and_then(|s| s.trim().parse::<u64>().ok())
        .ok_or_else(|| missing("file size (X-Linked-Size or Content-Length)"))?;
    let is_sha256 = |e: &str| e.len() == 64 && e.bytes().all(|b| b.is_ascii_hexdigit());
    let sha256 = linked.map(|e| normalize_etag(&e)).filter(|e| is_sha256(e)).map(|e| e.to_ascii_lowercase());
    // The etag names a file in the cache: nothing but a plain name will do.
    if etag.is_empty() || !etag.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
        return Err(PullError::Protocol { url: url.to_string(), what: format!("an unusable ETag \"{etag}\"") });
    }
    if commit.is_empty() || !commit.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(PullError::Protocol { url: url.to_string(), what: format!("an unusable commit \"{commit}\"") });
    }
    let url = target.ok_or_else(|| missing("Location"))?;
    Ok(FileMeta { commit, etag, sha256, size, url })
}

/// `W/"abc"` → `abc`.
fn normalize_etag(etag: &str) -> String {
    etag.trim().trim_start_matches("W/").trim_matches('"').to_owned()
}

fn content_range_start(headers: &HeaderMap) -> Option<u64> {
    // `bytes 100-199/200`
    let value = headers.get(header::CONTENT_RANGE)?.to_str().ok()?;
    value.strip_prefix("bytes ")?.split('-').next()?.trim().parse().ok()
}

/// The address without its query: file hosts sign their addresses, and a signature is no one's
/// business in an error message or a log.
fn host_of(url: &reqwest::Url) -> String {
    let mut shown = url.clone();
    shown.set_query(None);
    shown.to_string()
}

/// A transport error's cause chain in one line ("connection refused", "dns error: …").
fn cause(error: &reqwest::Error) -> String {
    let mut parts = Vec::new();
    let mut source: Option<&dyn std::error::Error> = std::error::Error::source(error);
    while let Some(s) = source {
        parts.push(s.to_string());
        source = s.source();
    }
    let detail = parts.last().cloned();
    match (error.is_timeout(), error.is_connect(), detail) {
        (true, _, _) => "timed out".to_owned(),
        (_, _, Some(detail)) => detail,
        _ => error.to_string(),
    }
}

async fn backoff(attempt: u32, stop: &CancellationToken) {
    let delay = Duration::from_millis(250 * (1 << attempt.min(5)));
    tokio::select! {
        () = tokio::time::sleep(delay) => {}
        () = stop.cancelled() => {}
    }
}

/// Percent-encodes a path segment (the hub's file names are usually plain; spaces are not).
fn encode(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for b in segment.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_goes_to_the_endpoint_s_origin_only() {
        let hub = Hub::new("https://huggingface.co/", Some("hf_x".into()));
        assert_eq!(hub.endpoint(), "https://huggingface.co");
        let ok = |u: &str| hub.same_origin(&reqwest::Url::parse(u).unwrap());
        assert!(ok("https://huggingface.co/o/n/resolve/main/m.gguf"));
        assert!(!ok("https://cdn-lfs.huggingface.co/repos/x"));
        assert!(!ok("http://huggingface.co/o/n"));
        assert!(!ok("https://huggingface.co:8443/o/n"));
        assert!(!format!("{hub:?}").contains("hf_x"), "{hub:?}");
    }

    #[test]
    fn resolve_addresses_encode_the_revision_and_each_path_segment() {
        let hub = Hub::new("http://127.0.0.1:9", None);
        let r = ModelRef::new("o/n", "refs/pr/1", "dir/my model.gguf");
        assert_eq!(hub.resolve_url(&r), "http://127.0.0.1:9/o/n/resolve/refs%2Fpr%2F1/dir/my%20model.gguf");
    }
}

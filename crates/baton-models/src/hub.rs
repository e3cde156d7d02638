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

mod blobs;
mod download;
mod meta;

use std::path::Path;
use std::time::Duration;

use reqwest::header;
use tokio_util::sync::CancellationToken;

use crate::cache::Cache;
use crate::{ModelRef, PullError};
use blobs::{check_space, is_complete, open_locked, pulled, write_note};
use download::{Download, verify};

pub(crate) const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

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
        let meta = self.resolve(reference, stop, 0, 0).await?;
        let blob = cache.blob(&reference.repo, &meta.etag);
        if is_complete(&blob, meta.size) {
            return pulled(cache, reference, &meta, 0, 0, true);
        }

        let partial = cache.incomplete(&reference.repo, &meta.etag);
        check_space(&cache.blobs_dir(&reference.repo), &partial, meta.size)?;
        let file = open_locked(&partial, reference)?;
        // Another pull may have finished it between our look and the lock (and renamed the
        // partial file we opened into the blob).
        if is_complete(&blob, meta.size) {
            return pulled(cache, reference, &meta, 0, 0, true);
        }
        let note_path = write_note(cache, reference, &meta)?;

        let mut download = Download::resume(file, &partial, meta.size, on_progress, stop).await?;
        self.fetch(reference, &meta, &mut download, on_progress, stop).await?;
        let resumed_from = download.resumed_from;
        let actual = download.finish(on_progress).await?;

        verify(reference, &meta, actual, &partial, &note_path)?;
        std::fs::rename(&partial, &blob).map_err(io(&blob))?;
        let _ = std::fs::remove_file(&note_path);
        pulled(cache, reference, &meta, meta.size - resumed_from, resumed_from, false)
    }
}

/// Turns an I/O error into one that names the file.
fn io(path: &Path) -> impl FnOnce(std::io::Error) -> PullError + use<> {
    let path = path.to_path_buf();
    move |source| PullError::Io { path, source }
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

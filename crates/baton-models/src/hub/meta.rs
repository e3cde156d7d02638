//! The `HEAD` on a file's `resolve` address: what the hub says of a file (its commit, ETag,
//! size and where its bytes are), and what its refusals mean.

use std::time::Duration;

use reqwest::StatusCode;
use reqwest::header::{self, HeaderMap};
use tokio_util::sync::CancellationToken;

use super::{Hub, cause};
use crate::{ModelRef, PullError};

/// What the hub says of a file before it is downloaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct FileMeta {
    pub(super) commit: String,
    /// The name of its blob in the cache: the SHA-256 for LFS files, the git blob id otherwise.
    pub(super) etag: String,
    /// The SHA-256 to check the bytes against (LFS files only: other files are small text
    /// files whose ETag is a git hash).
    pub(super) sha256: Option<String>,
    pub(super) size: u64,
    /// Where the bytes are (the file host a redirect names, or the resolve address itself).
    pub(super) url: reqwest::Url,
}

impl Hub {
    /// [`Self::metadata`], unless `stop` comes first: then the pull ends as cancelled, with
    /// `have` of `size` bytes on disk.
    pub(super) async fn resolve(
        &self,
        reference: &ModelRef,
        stop: &CancellationToken,
        have: u64,
        size: u64,
    ) -> Result<FileMeta, PullError> {
        tokio::select! {
            meta = self.metadata(reference) => meta,
            () = stop.cancelled() => Err(PullError::Cancelled { have, size }),
        }
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

    pub(super) fn refusal(
        &self,
        r: &ModelRef,
        url: &reqwest::Url,
        status: StatusCode,
        headers: &HeaderMap,
    ) -> PullError {
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

//! The download itself: the bytes still missing fetched into the partial file, resumed where
//! an earlier pull stopped, a dropped connection tried again from the last byte on disk, an
//! expired file host address asked of the hub again, and the SHA-256 checked at the end.

use std::path::Path;
use std::time::{Duration, Instant};

use futures::StreamExt;
use reqwest::StatusCode;
use reqwest::header::{self, HeaderMap};
use sha2::Digest;
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use super::meta::FileMeta;
use super::{Hub, Phase, Progress, cause, io};
use crate::{ModelRef, PullError};

/// Dropped connections in a row (with no byte between them) before a pull gives up.
const MAX_DROPS: u32 = 5;
/// How often progress is reported while bytes flow.
const PROGRESS_EVERY: Duration = Duration::from_millis(100);

impl Hub {
    /// Fetches the rest of the file into `download`, from its last byte on disk to the end:
    /// each try asks for the bytes still missing, a dropped connection (or a server error) is
    /// tried again after a pause, and an expired file host address is asked of the hub again.
    pub(super) async fn fetch(
        &self,
        reference: &ModelRef,
        meta: &FileMeta,
        download: &mut Download<'_>,
        on_progress: &mut (dyn FnMut(Progress) + Send),
        stop: &CancellationToken,
    ) -> Result<(), PullError> {
        let mut url = meta.url.clone();
        let mut refreshed = false;
        while download.have < meta.size {
            let have = download.have;
            download.file.seek(std::io::SeekFrom::Start(have)).await.map_err(io(download.partial))?;
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
                    let give_up = || PullError::Unreachable { url: host_of(&url), cause: cause(&e) };
                    download.reconnect(give_up, on_progress, stop).await?;
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
                        download.start_over().await?;
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
                    url = self.fresh_url(reference, meta, &url, have, stop).await?;
                    continue;
                }
                _ if status.is_server_error() => {
                    let give_up = || PullError::Http { url: host_of(&url), status: status.as_u16(), message: None };
                    download.reconnect(give_up, on_progress, stop).await?;
                    continue;
                }
                _ if self.same_origin(&url) => return Err(self.refusal(reference, &url, status, response.headers())),
                _ => return Err(PullError::Http { url: host_of(&url), status: status.as_u16(), message: None }),
            }
            download.read_body(response, reference, &url, on_progress, stop).await?;
        }
        Ok(())
    }

    /// The file's address asked of the hub again, for when the file host's (at `url`) has
    /// expired; refused when the hub now names another file than `meta`'s.
    async fn fresh_url(
        &self,
        reference: &ModelRef,
        meta: &FileMeta,
        url: &reqwest::Url,
        have: u64,
        stop: &CancellationToken,
    ) -> Result<reqwest::Url, PullError> {
        let fresh = self.resolve(reference, stop, have, meta.size).await?;
        if fresh.etag != meta.etag || fresh.size != meta.size {
            // The revision moved on to another file while this one downloaded: the
            // part on disk stays for a pull of the old commit; this pull starts again.
            return Err(PullError::Protocol {
                url: host_of(url),
                what: format!(
                    "{reference} changed on the hub during the download; pull again to download the new version"
                ),
            });
        }
        Ok(fresh.url)
    }
}

/// Checks the downloaded bytes' SHA-256 (`actual`) against the one the hub announced, if any;
/// a mismatch deletes the partial file and its note, so the next pull starts afresh.
pub(super) fn verify(
    reference: &ModelRef,
    meta: &FileMeta,
    actual: String,
    partial: &Path,
    note_path: &Path,
) -> Result<(), PullError> {
    if let Some(expected) = &meta.sha256
        && *expected != actual
    {
        let _ = std::fs::remove_file(partial);
        let _ = std::fs::remove_file(note_path);
        return Err(PullError::Checksum { file: reference.to_string(), expected: expected.clone(), actual });
    }
    Ok(())
}

/// A download under way: the locked partial file, how much of the file it holds, and the hash
/// of those bytes so far.
pub(super) struct Download<'a> {
    file: tokio::fs::File,
    /// The partial file's path, for errors.
    partial: &'a Path,
    /// The whole file's size, as the hub announced it.
    size: u64,
    /// Bytes on disk, all of them hashed.
    have: u64,
    /// Where this pull started: what an earlier pull had left on disk.
    pub(super) resumed_from: u64,
    hasher: sha2::Sha256,
    /// Dropped connections in a row, with no byte between them.
    drops: u32,
}

impl<'a> Download<'a> {
    /// Goes on from what the partial file holds (a file longer than `size` is no part of this
    /// one, and starts over).
    pub(super) async fn resume(
        file: std::fs::File,
        partial: &'a Path,
        size: u64,
        on_progress: &mut (dyn FnMut(Progress) + Send),
        stop: &CancellationToken,
    ) -> Result<Self, PullError> {
        let mut have = file.metadata().map_err(io(partial))?.len();
        let mut file = tokio::fs::File::from_std(file);
        if have > size {
            file.set_len(0).await.map_err(io(partial))?;
            have = 0;
        }

        // The hash covers the whole file, so a resumed pull first reads back what is there.
        let mut hasher = sha2::Sha256::new();
        if have > 0 {
            let mut buf = vec![0u8; 1 << 20];
            let mut read = 0u64;
            file.seek(std::io::SeekFrom::Start(0)).await.map_err(io(partial))?;
            let mut last = Instant::now();
            while read < have {
                if stop.is_cancelled() {
                    return Err(PullError::Cancelled { have, size });
                }
                let want = buf.len().min((have - read) as usize);
                let n = file.read(&mut buf[..want]).await.map_err(io(partial))?;
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
        Ok(Self { file, partial, size, have, resumed_from: have, hasher, drops: 0 })
    }

    /// Empties the partial file, for a body that starts at byte 0 after all.
    async fn start_over(&mut self) -> Result<(), PullError> {
        self.file.set_len(0).await.map_err(io(self.partial))?;
        self.file.seek(std::io::SeekFrom::Start(0)).await.map_err(io(self.partial))?;
        self.have = 0;
        self.resumed_from = 0;
        self.hasher = sha2::Sha256::new();
        Ok(())
    }

    /// Appends `response`'s body (from `url`) to the file until it ends or the connection drops;
    /// either way the caller asks again for whatever is still missing.
    async fn read_body(
        &mut self,
        response: reqwest::Response,
        reference: &ModelRef,
        url: &reqwest::Url,
        on_progress: &mut (dyn FnMut(Progress) + Send),
        stop: &CancellationToken,
    ) -> Result<(), PullError> {
        let mut body = response.bytes_stream();
        let mut last = Instant::now();
        loop {
            let chunk = tokio::select! {
                c = body.next() => c,
                () = stop.cancelled() => {
                    self.file.flush().await.map_err(io(self.partial))?;
                    return Err(PullError::Cancelled { have: self.have, size: self.size });
                }
            };
            match chunk {
                Some(Ok(bytes)) => {
                    if self.have + bytes.len() as u64 > self.size {
                        self.file.set_len(0).await.map_err(io(self.partial))?;
                        return Err(PullError::Protocol {
                            url: host_of(url),
                            what: format!("sent more than the {} bytes the hub announced", self.size),
                        });
                    }
                    // Written through before the next read: after a crash, what the file
                    // holds is exactly what the next pull need not fetch again.
                    self.file.write_all(&bytes).await.map_err(io(self.partial))?;
                    self.file.flush().await.map_err(io(self.partial))?;
                    self.hasher.update(&bytes);
                    self.have += bytes.len() as u64;
                    self.drops = 0;
                    if last.elapsed() >= PROGRESS_EVERY {
                        last = Instant::now();
                        on_progress(Progress { phase: Phase::Downloading, done: self.have, total: self.size });
                    }
                }
                Some(Err(e)) => {
                    tracing::info!(%reference, have = self.have, "the download's connection dropped: {}", cause(&e));
                    let give_up = || PullError::Unreachable { url: host_of(url), cause: cause(&e) };
                    return self.reconnect(give_up, on_progress, stop).await;
                }
                None => {
                    if self.have < self.size {
                        // The body ended early without an error: also a dropped connection.
                        let (have, size) = (self.have, self.size);
                        let give_up = || PullError::Unreachable {
                            url: host_of(url),
                            cause: format!("the transfer kept ending at byte {have} of {size}"),
                        };
                        self.reconnect(give_up, on_progress, stop).await?;
                    }
                    return Ok(());
                }
            }
        }
    }

    /// Counts one more dropped connection (or server error) in a row: past [`MAX_DROPS`] the
    /// pull gives up with `give_up`'s error; else it says it reconnects, and waits first.
    async fn reconnect(
        &mut self,
        give_up: impl FnOnce() -> PullError,
        on_progress: &mut (dyn FnMut(Progress) + Send),
        stop: &CancellationToken,
    ) -> Result<(), PullError> {
        self.drops += 1;
        if self.drops > MAX_DROPS {
            return Err(give_up());
        }
        on_progress(Progress { phase: Phase::Reconnecting, done: self.have, total: self.size });
        backoff(self.drops, stop).await;
        Ok(())
    }

    /// Reports the last progress, makes the bytes durable, closes the file, and returns the
    /// bytes' SHA-256 in hex.
    pub(super) async fn finish(self, on_progress: &mut (dyn FnMut(Progress) + Send)) -> Result<String, PullError> {
        on_progress(Progress { phase: Phase::Downloading, done: self.have, total: self.size });
        let Self { file, partial, hasher, .. } = self;
        file.sync_all().await.map_err(io(partial))?;
        drop(file);
        Ok(hex(&hasher.finalize()))
    }
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

async fn backoff(attempt: u32, stop: &CancellationToken) {
    let delay = Duration::from_millis(250 * (1 << attempt.min(5)));
    tokio::select! {
        () = tokio::time::sleep(delay) => {}
        () = stop.cancelled() => {}
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

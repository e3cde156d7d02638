//! The pull's files in the cache: the finished blob and its snapshot link, and the partial
//! file beside it (its space, its lock, its note).

use std::path::Path;

use super::meta::FileMeta;
use super::{Pulled, io};
use crate::cache::{Cache, PartialNote};
use crate::{ModelRef, PullError};

/// Room left free beside a download, so that finishing it does not fill the disk to the last byte.
const SPACE_MARGIN: u64 = 64 * 1024 * 1024;

/// Whether the cache holds the whole blob already (its size is all that is checked: a blob only
/// takes its place once its bytes were checked).
pub(super) fn is_complete(blob: &Path, size: u64) -> bool {
    std::fs::metadata(blob).is_ok_and(|m| m.len() == size)
}

/// Links the blob into its snapshot, and says what the pull did.
pub(super) fn pulled(
    cache: &Cache,
    reference: &ModelRef,
    meta: &FileMeta,
    fetched: u64,
    resumed_from: u64,
    cached: bool,
) -> Result<Pulled, PullError> {
    let path =
        cache.link(reference, &meta.commit, &meta.etag).map_err(io(cache.repo_dir(&reference.repo).as_path()))?;
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
}

/// Creates the folder of blobs, and refuses a download of `size` bytes into `partial` that the
/// disk has no room to finish.
pub(super) fn check_space(blobs: &Path, partial: &Path, size: u64) -> Result<(), PullError> {
    std::fs::create_dir_all(blobs).map_err(io(blobs))?;
    // Space first, before a partial file (and its note) exists for a download that cannot
    // finish: what a partial file holds already need not fit again.
    let on_disk = std::fs::metadata(partial).map_or(0, |m| m.len()).min(size);
    let free = fs2::available_space(blobs).map_err(io(blobs))?;
    let need = size - on_disk;
    if free < need.saturating_add(SPACE_MARGIN) {
        return Err(PullError::NoSpace { dir: blobs.to_path_buf(), need, free });
    }
    Ok(())
}

/// Opens (or creates) the partial file and locks it for this pull.
pub(super) fn open_locked(partial: &Path, reference: &ModelRef) -> Result<std::fs::File, PullError> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(partial)
        .map_err(io(partial))?;
    // The lock lives as long as the file is open: one writer per partial file, across
    // processes (the app and the command line), and released by a crash.
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(PullError::Busy { reference: reference.to_string() }),
        Err(std::fs::TryLockError::Error(e)) => Err(io(partial)(e)),
    }
}

/// Writes the note kept beside the partial file (see [`PartialNote`]); returns its path.
pub(super) fn write_note(
    cache: &Cache,
    reference: &ModelRef,
    meta: &FileMeta,
) -> Result<std::path::PathBuf, PullError> {
    let note = PartialNote { reference: reference.clone(), commit: meta.commit.clone(), size: meta.size };
    let note_path = cache.note(&reference.repo, &meta.etag);
    std::fs::write(&note_path, serde_json::to_vec(&note).unwrap_or_default()).map_err(io(&note_path))?;
    Ok(note_path)
}

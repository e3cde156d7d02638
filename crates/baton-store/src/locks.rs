//! How one process tells a run another process is still recording from a run whose process
//! died: OS file locks in a folder beside the database (`<db>.locks/`). A lock dies with the
//! process that holds it, whichever way the process ends.
//!
//! A run being recorded holds a *slot*: a lock file its store created and keeps locked. The run's
//! row names the slot (`runs.recorder`). When the run ends its slot goes back to the store for the
//! next run, so a server making thousands of runs creates only as many files as it ever had runs
//! at once, not one per run (creating and deleting a file costs more than recording the run's
//! first events). A recorder dropped before its run ended takes its slot with it, so the run
//! reads as dead at once, as it would after a crash. Runs recorded before slots existed have no
//! `recorder` and were locked by `<run uid>.lock`; both are looked up by the same name rule.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::StoreError;

/// A lock file this process holds for the runs it records, one run at a time.
#[derive(Debug)]
pub(crate) struct Slot {
    name: String,
    path: PathBuf,
    _file: File,
}

impl Slot {
    /// What a run's row holds to name this slot.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }
}

/// Gone with its file: a run that still named it reads as dead.
impl Drop for Slot {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A store's slots that no run holds now.
#[derive(Debug)]
pub(crate) struct Slots {
    db: PathBuf,
    free: Mutex<Vec<Slot>>,
}

static NEXT: AtomicU64 = AtomicU64::new(0);

impl Slots {
    pub(crate) fn new(db: &Path) -> Slots {
        Slots { db: db.to_path_buf(), free: Mutex::new(Vec::new()) }
    }

    /// A free slot, or a new one.
    pub(crate) fn take(&self) -> Result<Slot, StoreError> {
        if let Some(slot) = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop() {
            return Ok(slot);
        }
        // Unique among processes (the pid) and within this one (the counter); "slot" has letters
        // outside the hex digits of run uids, so it names no older run's lock.
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let name = format!("slot{:x}n{:x}t{nanos:x}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let path = lock_path(&self.db, &name);
        let failed = |e: std::io::Error| StoreError::Open {
            path: path.display().to_string(),
            message: format!("cannot take a lock file for the run: {e}"),
        };
        // Locked before it has its name, so that no other process finds it unlocked (and takes
        // it for a dead one's) in between.
        let fresh = path.with_extension("new");
        let file = create_locked(&fresh).map_err(failed)?;
        std::fs::rename(&fresh, &path).map_err(|e| {
            let _ = std::fs::remove_file(&fresh);
            failed(e)
        })?;
        Ok(Slot { name, path, _file: file })
    }

    /// The run that held `slot` has ended (or was never kept): the next run may take it.
    pub(crate) fn give_back(&self, slot: Slot) {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).push(slot);
    }
}

/// `<db>.locks/<name>.lock`.
fn lock_path(db: &Path, name: &str) -> PathBuf {
    let mut dir = db.as_os_str().to_owned();
    dir.push(".locks");
    // Names come from run uids (hex digits) and slots; anything else is kept out of the path.
    let safe: String = name.chars().filter(char::is_ascii_alphanumeric).collect();
    PathBuf::from(dir).join(format!("{safe}.lock"))
}

/// Waits for, then holds, the lock that lets one process at a time open (and migrate) the
/// database at `db`. The lock goes with the returned file.
pub(crate) async fn lock_opening(db: &Path) -> Result<File, StoreError> {
    // "opening" has letters outside the hex digits of run uids, so it names no run's lock.
    let path = lock_path(db, "opening");
    let shown = path.display().to_string();
    // Waiting for another process blocks, so it waits off the async workers.
    let locked = tokio::task::spawn_blocking(move || create_locked(&path))
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e)));
    locked
        .map_err(|e| StoreError::Open { path: shown, message: format!("cannot take the database's opening lock: {e}") })
}

/// Creates the lock file at `path` (and its directory), waiting until this process holds it.
fn create_locked(path: &Path) -> std::io::Result<File> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let file = File::create(path)?;
    file.lock()?;
    Ok(file)
}

/// Whether some process still records the runs whose lock is `name` (holds it).
pub(crate) fn is_live(db: &Path, name: &str) -> bool {
    let Ok(file) = File::open(lock_path(db, name)) else { return false };
    match file.try_lock() {
        Ok(()) => false,
        Err(std::fs::TryLockError::WouldBlock) => true,
        // A lock that cannot even be tried says nothing; treat the run as still going rather
        // than mark a live run interrupted.
        Err(std::fs::TryLockError::Error(_)) => true,
    }
}

pub(crate) fn remove_lock(db: &Path, name: &str) {
    let _ = std::fs::remove_file(lock_path(db, name));
}

/// Deletes the slots of processes that are gone (a crash leaves its free slots behind). Called
/// while the opening lock is held.
pub(crate) fn remove_dead_slots(db: &Path) {
    let Some(dir) = lock_path(db, "x").parent().and_then(|d| std::fs::read_dir(d).ok()) else { return };
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if name.starts_with("slot")
            && let Some(name) = name.strip_suffix(".lock")
            && !is_live(db, name)
        {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

//! The Hugging Face hub's cache layout, as `huggingface_hub` and the `hf-hub` crate write it, so
//! a file Baton downloads is where other hub tools look for it and the other way round:
//!
//! ```text
//! <root>/models--<owner>--<name>/
//!     refs/<revision>                 the commit the revision pointed at (text)
//!     blobs/<etag>                    the file's bytes, named by its SHA-256 (LFS files)
//!     blobs/<etag>.incomplete         a download in progress or interrupted (resumed from)
//!     blobs/<etag>.incomplete.json    Baton's note of what that partial file is
//!     snapshots/<commit>/<file>       a relative symbolic link to the blob
//! ```

use std::io;
use std::path::{Path, PathBuf};

use crate::ModelRef;

/// A hub cache directory.
#[derive(Debug, Clone)]
pub struct Cache {
    root: PathBuf,
}

/// A model file in the cache, whole or partly downloaded.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Entry {
    pub reference: ModelRef,
    /// The file to load (the snapshot link) when it is complete; the partial file otherwise.
    pub path: PathBuf,
    /// Bytes on disk.
    pub bytes: u64,
    /// The whole file's size; for a complete file, `bytes`.
    pub size: u64,
    pub complete: bool,
}

/// What a partial download is, kept beside it so it can be listed, resumed and removed by name.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct PartialNote {
    pub reference: ModelRef,
    pub commit: String,
    pub size: u64,
}

impl Cache {
    pub fn new(root: impl Into<PathBuf>) -> Cache {
        Cache { root: root.into() }
    }

    /// `$BATON_MODELS_DIR`, else the `hub` folder of Baton's own Hugging Face home in its data
    /// directory (`~/.local/share/baton/hf/hub` on Linux), which the local model loader uses too.
    pub fn default_root() -> PathBuf {
        match std::env::var_os("BATON_MODELS_DIR") {
            Some(dir) if !dir.is_empty() => PathBuf::from(dir),
            _ => dirs::data_dir().unwrap_or_else(std::env::temp_dir).join("baton").join("hf").join("hub"),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn repo_dir(&self, repo: &str) -> PathBuf {
        self.root.join(format!("models--{}", repo.replace('/', "--")))
    }

    pub(crate) fn blobs_dir(&self, repo: &str) -> PathBuf {
        self.repo_dir(repo).join("blobs")
    }

    pub(crate) fn blob(&self, repo: &str, etag: &str) -> PathBuf {
        self.blobs_dir(repo).join(etag)
    }

    pub(crate) fn incomplete(&self, repo: &str, etag: &str) -> PathBuf {
        self.blobs_dir(repo).join(format!("{etag}.incomplete"))
    }

    pub(crate) fn note(&self, repo: &str, etag: &str) -> PathBuf {
        self.blobs_dir(repo).join(format!("{etag}.incomplete.json"))
    }

    fn snapshot(&self, repo: &str, commit: &str, file: &str) -> PathBuf {
        self.repo_dir(repo).join("snapshots").join(commit).join(file)
    }

    /// The commit a revision stands for here: what `refs/<revision>` says, or the revision
    /// itself when it is a commit with a snapshot.
    fn commit_of(&self, repo: &str, revision: &str) -> Option<String> {
        let from_ref = std::fs::read_to_string(self.repo_dir(repo).join("refs").join(revision)).ok();
        match from_ref {
            Some(commit) if !commit.trim().is_empty() => Some(commit.trim().to_owned()),
            _ => self.repo_dir(repo).join("snapshots").join(revision).is_dir().then(|| revision.to_owned()),
        }
    }

    /// The complete file a reference names, when it has been downloaded.
    pub fn find(&self, reference: &ModelRef) -> Option<PathBuf> {
        let commit = self.commit_of(&reference.repo, &reference.revision)?;
        let path = self.snapshot(&reference.repo, &commit, &reference.file);
        // `is_file` follows the link: a link whose blob is gone does not count.
        path.is_file().then_some(path)
    }

    /// Puts a finished blob in place: the snapshot link to it and the revision's ref.
    pub(crate) fn link(&self, reference: &ModelRef, commit: &str, etag: &str) -> io::Result<PathBuf> {
        let link = self.snapshot(&reference.repo, commit, &reference.file);
        let parent = link.parent().ok_or_else(|| io::Error::other("a snapshot path has a folder"))?;
        std::fs::create_dir_all(parent)?;
        if link.symlink_metadata().is_ok() {
            std::fs::remove_file(&link)?;
        }
        place_blob(&self.blob(&reference.repo, etag), &link, reference.file.matches('/').count())?;
        if reference.revision != commit {
            let refs = self.repo_dir(&reference.repo).join("refs").join(&reference.revision);
            if let Some(dir) = refs.parent() {
                std::fs::create_dir_all(dir)?;
            }
            std::fs::write(refs, commit)?;
        }
        Ok(link)
    }

    /// Every model file here, complete or partial, in a stable order.
    pub fn list(&self) -> io::Result<Vec<Entry>> {
        let mut entries = Vec::new();
        let repos = match std::fs::read_dir(&self.root) {
            Ok(dir) => dir,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(entries),
            Err(e) => return Err(e),
        };
        for repo_dir in repos {
            let repo_dir = repo_dir?.path();
            let Some(repo) = repo_dir
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_prefix("models--"))
                .and_then(|n| n.split_once("--"))
                .map(|(owner, name)| format!("{owner}/{name}"))
            else {
                continue;
            };
            let refs = read_refs(&repo_dir.join("refs"));
            if let Ok(snapshots) = std::fs::read_dir(repo_dir.join("snapshots")) {
                for snapshot in snapshots {
                    let snapshot = snapshot?.path();
                    let Some(commit) = snapshot.file_name().and_then(|n| n.to_str()).map(str::to_owned) else {
                        continue;
                    };
                    let revision =
                        refs.iter().find(|(_, c)| *c == commit).map_or(commit.clone(), |(name, _)| name.clone());
                    for (file, path) in files_under(&snapshot)? {
                        let Ok(meta) = std::fs::metadata(&path) else { continue };
                        entries.push(Entry {
                            reference: ModelRef::new(&repo, &revision, &file),
                            path,
                            bytes: meta.len(),
                            size: meta.len(),
                            complete: true,
                        });
                    }
                }
            }
            for (note_path, note) in partials(&repo_dir)? {
                let partial = note_path.with_extension("");
                let bytes = std::fs::metadata(&partial).map(|m| m.len()).unwrap_or(0);
                entries.push(Entry {
                    reference: note.reference,
                    path: partial,
                    bytes,
                    size: note.size,
                    complete: false,
                });
            }
        }
        entries.sort_by_cached_key(|e| (e.reference.to_string(), !e.complete));
        Ok(entries)
    }

    /// Removes a model file (and the blob behind it, unless another snapshot still uses it) and
    /// any partial download of it. Returns whether there was anything to remove. A partial file
    /// a download is writing is left alone, with an error saying so.
    pub fn remove(&self, reference: &ModelRef) -> io::Result<bool> {
        let repo_dir = self.repo_dir(&reference.repo);
        let mut removed = false;
        if let Some(commit) = self.commit_of(&reference.repo, &reference.revision) {
            let link = self.snapshot(&reference.repo, &commit, &reference.file);
            if link.symlink_metadata().is_ok() {
                let target = std::fs::read_link(&link).ok().map(|t| link.parent().unwrap_or(&link).join(t));
                std::fs::remove_file(&link)?;
                removed = true;
                if let Some(blob) = target
                    && !self.blob_in_use(&repo_dir, &blob)?
                {
                    remove_if_there(&blob)?;
                }
                remove_empty_dirs(link.parent(), &repo_dir.join("snapshots"));
            }
        }
        for (note_path, note) in partials(&repo_dir)? {
            if note.reference.file != reference.file || note.reference.revision != reference.revision {
                continue;
            }
            let partial = note_path.with_extension("");
            if let Ok(file) = std::fs::OpenOptions::new().write(true).open(&partial)
                && file.try_lock().is_err()
            {
                return Err(io::Error::other(format!(
                    "{reference} is being downloaded right now; stop that download first"
                )));
            }
            remove_if_there(&partial)?;
            remove_if_there(&note_path)?;
            removed = true;
        }
        // A repository with nothing left in it goes entirely (its refs mean nothing alone). Where
        // files live in the snapshots themselves (no links), those count too.
        let has_files = std::fs::read_dir(repo_dir.join("blobs")).is_ok_and(|mut d| d.next().is_some())
            || files_under(&repo_dir.join("snapshots")).is_ok_and(|f| !f.is_empty());
        if removed && !has_files {
            std::fs::remove_dir_all(&repo_dir)?;
        }
        Ok(removed)
    }

    /// Whether a snapshot link other than ones already removed still points at `blob`.
    fn blob_in_use(&self, repo_dir: &Path, blob: &Path) -> io::Result<bool> {
        let Ok(snapshots) = std::fs::read_dir(repo_dir.join("snapshots")) else { return Ok(false) };
        let wanted = blob.canonicalize().ok();
        for snapshot in snapshots {
            for (_, path) in files_under(&snapshot?.path())? {
                if path.canonicalize().ok() == wanted {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }
}

fn read_note(path: &Path) -> Option<PartialNote> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

/// The partial downloads of a repository: each note beside a partial file, and what it says.
fn partials(repo_dir: &Path) -> io::Result<Vec<(PathBuf, PartialNote)>> {
    let mut out = Vec::new();
    let blobs = match std::fs::read_dir(repo_dir.join("blobs")) {
        Ok(blobs) => blobs,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e),
    };
    for blob in blobs {
        let path = blob?.path();
        if path.to_string_lossy().ends_with(".incomplete.json")
            && let Some(note) = read_note(&path)
        {
            out.push((path, note));
        }
    }
    Ok(out)
}

fn read_refs(dir: &Path) -> Vec<(String, String)> {
    let mut refs = Vec::new();
    if let Ok(files) = files_under(dir) {
        for (name, path) in files {
            if let Ok(commit) = std::fs::read_to_string(path) {
                refs.push((name, commit.trim().to_owned()));
            }
        }
    }
    // `main` first, so a commit both `main` and a tag point at is listed as `main`.
    refs.sort_by_key(|(name, _)| (name != "main", name.clone()));
    refs
}

/// Files (or links to files) under `dir`, as `/`-separated paths relative to it.
fn files_under(dir: &Path) -> io::Result<Vec<(String, PathBuf)>> {
    let mut out = Vec::new();
    let mut pending = vec![(String::new(), dir.to_path_buf())];
    while let Some((prefix, dir)) = pending.pop() {
        if !dir.is_dir() {
            continue;
        }
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        for entry in entries {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let rel = if prefix.is_empty() { name } else { format!("{prefix}/{name}") };
            let path = entry.path();
            // `file_type` does not follow links; snapshot files are links to blobs.
            if entry.file_type()?.is_dir() {
                pending.push((rel, path));
            } else {
                out.push((rel, path));
            }
        }
    }
    out.sort();
    Ok(out)
}

fn remove_if_there(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Removes `dir` and its parents while they are empty, up to and including `stop`.
fn remove_empty_dirs(mut dir: Option<&Path>, stop: &Path) {
    while let Some(d) = dir {
        if !d.starts_with(stop) || std::fs::remove_dir(d).is_err() {
            break;
        }
        if d == stop {
            break;
        }
        dir = d.parent();
    }
}

/// Makes `link` a relative symbolic link to `blob` (`depth` folders below the snapshot), as
/// the hub's tools do; where links are not allowed, the blob moves to the snapshot path.
fn place_blob(blob: &Path, link: &Path, depth: usize) -> io::Result<()> {
    #[cfg(unix)]
    {
        let name = blob.file_name().ok_or_else(|| io::Error::other("a blob has a name"))?;
        let target = PathBuf::from("../".repeat(depth + 2)).join("blobs").join(name);
        std::os::unix::fs::symlink(target, link)
    }
    #[cfg(not(unix))]
    {
        let _ = depth;
        std::fs::rename(blob, link)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(cache: &Cache, reference: &ModelRef, commit: &str, etag: &str, bytes: &[u8]) -> PathBuf {
        std::fs::create_dir_all(cache.blobs_dir(&reference.repo)).unwrap();
        std::fs::write(cache.blob(&reference.repo, etag), bytes).unwrap();
        cache.link(reference, commit, etag).unwrap()
    }

    #[test]
    fn a_linked_file_is_found_listed_and_removed_with_its_blob() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::new(dir.path());
        let r = ModelRef::new("o/n", "main", "sub/m.gguf");
        let path = put(&cache, &r, "c0ffee", "e1", b"12345");
        assert_eq!(path, dir.path().join("models--o--n/snapshots/c0ffee/sub/m.gguf"));
        assert_eq!(std::fs::read(&path).unwrap(), b"12345", "the link reaches the blob");
        assert_eq!(std::fs::read_to_string(dir.path().join("models--o--n/refs/main")).unwrap(), "c0ffee");
        assert_eq!(cache.find(&r), Some(path.clone()));
        assert_eq!(cache.find(&ModelRef::new("o/n", "c0ffee", "sub/m.gguf")), Some(path.clone()), "by commit");
        assert_eq!(cache.find(&ModelRef::new("o/n", "dev", "sub/m.gguf")), None);

        let listed = cache.list().unwrap();
        assert_eq!(listed, vec![Entry { reference: r.clone(), path, bytes: 5, size: 5, complete: true }]);

        assert!(cache.remove(&r).unwrap());
        assert_eq!(cache.find(&r), None);
        assert!(!cache.repo_dir("o/n").exists(), "an emptied repository goes");
        assert!(!cache.remove(&r).unwrap(), "nothing left to remove");
    }

    #[test]
    fn a_blob_two_snapshots_share_stays_until_the_last_goes_and_partials_are_listed() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::new(dir.path());
        let old = ModelRef::new("o/n", "v1", "m.gguf");
        let new = ModelRef::new("o/n", "main", "m.gguf");
        put(&cache, &old, "c1", "e1", b"abc");
        put(&cache, &new, "c2", "e1", b"abc");
        let partial = ModelRef::new("o/n", "main", "big.gguf");
        std::fs::write(cache.incomplete("o/n", "e2"), b"xy").unwrap();
        let note = PartialNote { reference: partial.clone(), commit: "c2".into(), size: 10 };
        std::fs::write(cache.note("o/n", "e2"), serde_json::to_vec(&note).unwrap()).unwrap();

        let listed = cache.list().unwrap();
        let summary: Vec<_> = listed.iter().map(|e| (e.reference.to_string(), e.bytes, e.size, e.complete)).collect();
        assert_eq!(
            summary,
            vec![
                ("o/n:big.gguf".to_owned(), 2, 10, false),
                ("o/n:m.gguf".to_owned(), 3, 3, true),
                ("o/n@v1:m.gguf".to_owned(), 3, 3, true),
            ]
        );

        assert!(cache.remove(&old).unwrap());
        assert_eq!(std::fs::read(cache.find(&new).unwrap()).unwrap(), b"abc", "the shared blob stays");
        assert!(cache.remove(&partial).unwrap());
        assert!(!cache.incomplete("o/n", "e2").exists() && !cache.note("o/n", "e2").exists());
        assert!(cache.remove(&new).unwrap());
        assert!(!cache.repo_dir("o/n").exists());
    }

    #[test]
    fn a_partial_file_being_written_is_not_removed() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::new(dir.path());
        let r = ModelRef::new("o/n", "main", "m.gguf");
        std::fs::create_dir_all(cache.blobs_dir("o/n")).unwrap();
        let file = std::fs::File::create(cache.incomplete("o/n", "e")).unwrap();
        file.lock().unwrap();
        let note = PartialNote { reference: r.clone(), commit: "c".into(), size: 10 };
        std::fs::write(cache.note("o/n", "e"), serde_json::to_vec(&note).unwrap()).unwrap();
        let e = cache.remove(&r).unwrap_err().to_string();
        assert!(e.contains("being downloaded right now"), "{e}");
        assert!(cache.incomplete("o/n", "e").exists());
    }
}

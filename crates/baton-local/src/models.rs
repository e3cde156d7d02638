//! The local models a process has loaded, kept for whoever uses the same model next: a model
//! used as conductor and worker (or by several workers, or by many runs of the app) is loaded
//! once. Which models to load, and when one is no longer wanted, the crates above decide.

use std::path::Path;
#[cfg(feature = "engine")]
use std::path::PathBuf;
#[cfg(feature = "engine")]
use std::sync::Arc;

#[cfg(feature = "engine")]
use crate::engine::{LoadError, LocalModel, LocalModelConfig};

/// Progress of a model load, for whoever shows it.
#[derive(Debug, Clone, Copy)]
pub enum LoadNotice<'a> {
    Loading { what: &'a str, path: &'a Path },
    Loaded { what: &'a str, path: &'a Path, seconds: f64, device: &'a str },
    Failed { what: &'a str, path: &'a Path },
}

/// Receives [`LoadNotice`]s; `&|_| {}` for none.
pub type Notify<'a> = &'a (dyn Fn(LoadNotice<'_>) + Send + Sync);

/// Local models loaded so far, by their config.
///
/// Shared by reference: loads of one model file wait for each other (the second use gets the
/// first's model), but nothing else waits on a load: not another model's load, not a run that
/// needs no local model, not a settings save (which only drops the models the new settings no
/// longer ask for, see [`LocalModels::retain`]).
///
/// Without the `engine` feature nothing is ever loaded, and every question about what is
/// loaded answers "nothing".
#[derive(Default)]
pub struct LocalModels {
    #[cfg(feature = "engine")]
    loaded: std::sync::Mutex<std::collections::HashMap<LocalModelConfig, Arc<LocalModel>>>,
    /// One gate per model file, held while it loads.
    #[cfg(feature = "engine")]
    loading: std::sync::Mutex<std::collections::HashMap<PathBuf, Arc<tokio::sync::Mutex<()>>>>,
    /// Each loaded file's size and modification time when it was read, so that a long-lived
    /// holder (the command line's warm helper) notices a file replaced since.
    #[cfg(feature = "engine")]
    stamps: std::sync::Mutex<std::collections::HashMap<PathBuf, Option<FileStamp>>>,
}

/// A file's (or a model directory's) size and modification time.
#[cfg(feature = "engine")]
type FileStamp = (u64, std::time::SystemTime);

#[cfg(feature = "engine")]
fn stamp(path: &Path) -> Option<FileStamp> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.len(), meta.modified().ok()?))
}

impl std::fmt::Debug for LocalModels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let d = &mut f.debug_struct("LocalModels");
        #[cfg(feature = "engine")]
        d.field("loaded", &self.loaded_paths());
        d.finish()
    }
}

/// A loaded model: where it runs, what it took, and how fast it ran last (the app's Conductor
/// screen shows it).
#[derive(Debug, Clone, PartialEq, serde::Serialize, ts_rs::TS)]
pub struct LoadedModel {
    pub path: String,
    pub device: String,
    pub load_seconds: f64,
    /// How much the process's memory grew while it loaded (Linux).
    pub memory_bytes: Option<u64>,
    /// Its latest generation (a plan, for the conductor): prompt and decode rates, tokens.
    pub prompt_tokens_per_sec: Option<f64>,
    pub decode_tokens_per_sec: Option<f64>,
    pub last_prompt_tokens: Option<u64>,
    pub last_cached_prompt_tokens: Option<u64>,
    pub last_output_tokens: Option<u64>,
}

impl LocalModels {
    /// Every model loaded now, by path.
    pub fn loaded(&self) -> Vec<LoadedModel> {
        #[cfg(feature = "engine")]
        {
            let mut out: Vec<LoadedModel> = lock(&self.loaded)
                .iter()
                .map(|(config, m)| {
                    let last = m.last_speed();
                    LoadedModel {
                        path: config.path.display().to_string(),
                        device: m.device.clone(),
                        load_seconds: m.load_time.as_secs_f64(),
                        memory_bytes: m.memory_bytes,
                        prompt_tokens_per_sec: last.map(|s| s.prompt_tokens_per_sec),
                        decode_tokens_per_sec: last.map(|s| s.decode_tokens_per_sec),
                        last_prompt_tokens: last.map(|s| s.prompt_tokens),
                        last_cached_prompt_tokens: last.map(|s| s.cached_prompt_tokens),
                        last_output_tokens: last.map(|s| s.output_tokens),
                    }
                })
                .collect();
            out.sort_by(|a, b| a.path.cmp(&b.path));
            out
        }
        #[cfg(not(feature = "engine"))]
        Vec::new()
    }

    /// Whether a model from `path` (from the working directory, as models are known by their
    /// absolute paths) is loaded, with any settings.
    pub fn is_loaded(&self, path: &Path) -> bool {
        #[cfg(feature = "engine")]
        {
            let path = std::path::absolute(path).unwrap_or_else(|_| path.to_owned());
            self.loaded_paths().contains(&path)
        }
        #[cfg(not(feature = "engine"))]
        {
            let _ = path;
            false
        }
    }

    #[cfg(feature = "engine")]
    fn loaded_paths(&self) -> Vec<PathBuf> {
        lock(&self.loaded).keys().map(|c| c.path.clone()).collect()
    }

    /// Keeps the loaded models whose config `keep` accepts and drops the others; each is freed
    /// once no run uses it. Never waits for a load.
    #[cfg(feature = "engine")]
    pub fn retain(&self, keep: impl Fn(&LocalModelConfig) -> bool) {
        lock(&self.loaded).retain(|config, _| keep(config));
    }

    /// Drops every loaded model whose file changed on disk since it was read (a model pulled
    /// again, say), so that the next run loads the file as it is now. Returns their paths.
    pub fn forget_changed_files(&self) -> Vec<std::path::PathBuf> {
        #[cfg(feature = "engine")]
        {
            let stamps = lock(&self.stamps);
            let mut gone = Vec::new();
            lock(&self.loaded).retain(|config, _| {
                let same = stamps.get(&config.path).is_some_and(|then| *then == stamp(&config.path));
                if !same {
                    gone.push(config.path.clone());
                }
                same
            });
            gone
        }
        #[cfg(not(feature = "engine"))]
        Vec::new()
    }

    #[cfg(feature = "engine")]
    fn get(&self, config: &LocalModelConfig) -> Option<Arc<LocalModel>> {
        lock(&self.loaded).get(config).cloned()
    }

    /// The model `config` describes: the one loaded already, else loaded now, `notify` told of
    /// the load as `what` ("the conductor", "worker \"w\"").
    #[cfg(feature = "engine")]
    pub async fn load(
        &self,
        config: LocalModelConfig,
        what: &str,
        notify: Notify<'_>,
    ) -> Result<Arc<LocalModel>, LoadError> {
        if let Some(m) = self.get(&config) {
            return Ok(m);
        }
        // Two runs that need the same file load it once: the second waits here, then finds it.
        let gate = lock(&self.loading).entry(config.path.clone()).or_default().clone();
        let _loading = gate.lock().await;
        if let Some(m) = self.get(&config) {
            return Ok(m);
        }
        notify(LoadNotice::Loading { what, path: &config.path });
        tracing::info!(path = %config.path.display(), "loading {what}");
        // Read before the load: a file replaced while it loads counts as changed.
        let before = stamp(&config.path);
        let model = LocalModel::load(&config).await.inspect_err(|e| {
            tracing::warn!(path = %config.path.display(), "{what} did not load: {e}");
            notify(LoadNotice::Failed { what, path: &config.path });
        })?;
        let device = model.device.to_string();
        tracing::info!(path = %config.path.display(), seconds = model.load_time.as_secs_f64(), %device, "loaded {what}");
        notify(LoadNotice::Loaded {
            what,
            path: &config.path,
            seconds: model.load_time.as_secs_f64(),
            device: &device,
        });
        let model = Arc::new(model);
        lock(&self.stamps).insert(config.path.clone(), before);
        lock(&self.loaded).insert(config, model.clone());
        Ok(model)
    }
}

/// A poisoned lock only means a thread panicked while it held it; the map is still whole.
#[cfg(feature = "engine")]
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

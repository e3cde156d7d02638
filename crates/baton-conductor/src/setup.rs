//! From a pool's `[conductor]` table (or a choice that overrides it) to a running planner, and
//! the pool's `local` workers to in-process models. The command line and the desktop app both
//! start runs through here, so they load, name and refuse models the same way.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use baton_engine::{Executor, Planner, Pool};
use baton_providers::{HttpModel, ModelSettings, ProviderKind, ServerGrammar};

use crate::ConductorOptions;
use crate::prompt::PromptVersion;

/// What the pool file says unless overridden (the CLI's `--conductor…` flags, the app's settings).
#[derive(Debug, Clone, Default)]
pub struct ConductorChoice {
    /// A `.gguf` file, a safetensors directory, or an `http(s)://` URL of an OpenAI-compatible server.
    pub source: Option<String>,
    /// The model name a remote server serves.
    pub model_name: Option<String>,
    /// `Some(None)` turns off the pool's grammar; `None` keeps it.
    pub grammar: Option<Option<ServerGrammar>>,
    pub lora: Option<PathBuf>,
    pub chat_template: Option<PathBuf>,
    pub force_cpu: bool,
}

/// Why no planner or local worker could be set up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SetupError {
    #[error(
        "no conductor is configured: add a [conductor] table with model = \"/path/to/model.gguf\" to the pool file, pass --conductor PATH|URL, or run a written plan with --plan FILE"
    )]
    NotConfigured,
    /// A model could not be loaded; the message names the file and the reason.
    #[error("{0}")]
    Load(String),
    #[error(
        "{0}: this build of Baton runs no local models (built without the `local` feature); use a remote conductor URL"
    )]
    NoLocalSupport(String),
    /// A `[conductor]` setting names something that does not exist.
    #[error("{0}")]
    Settings(String),
}

/// Progress of a model load, for whoever shows it.
#[derive(Debug, Clone, Copy)]
pub enum LoadNotice<'a> {
    Loading { what: &'a str, path: &'a Path },
    Loaded { what: &'a str, path: &'a Path, seconds: f64, device: &'a str },
    Failed { what: &'a str, path: &'a Path },
}

/// Receives [`LoadNotice`]s; `&|_| {}` for none.
pub type Notify<'a> = &'a (dyn Fn(LoadNotice<'_>) + Send + Sync);

/// Local models loaded so far, by their config: a model used as conductor and worker (or by
/// several workers, or by many runs of the app) is loaded once.
///
/// Shared by reference: loads of one model file wait for each other (the second use gets the
/// first's model), but nothing else waits on a load: not another model's load, not a run that
/// needs no local model, not a settings save (which only drops the models the new settings no
/// longer ask for, see [`LocalModels::keep_only`]).
#[derive(Default)]
pub struct LocalModels {
    #[cfg(feature = "local")]
    loaded: std::sync::Mutex<std::collections::HashMap<crate::local::LocalModelConfig, Arc<crate::local::LocalModel>>>,
    /// One gate per model file, held while it loads.
    #[cfg(feature = "local")]
    loading: std::sync::Mutex<std::collections::HashMap<PathBuf, Arc<tokio::sync::Mutex<()>>>>,
    /// Each loaded file's size and modification time when it was read, so that a long-lived
    /// holder (the command line's warm helper) notices a file replaced since.
    #[cfg(feature = "local")]
    stamps: std::sync::Mutex<std::collections::HashMap<PathBuf, Option<FileStamp>>>,
}

/// A file's (or a model directory's) size and modification time.
#[cfg(feature = "local")]
type FileStamp = (u64, std::time::SystemTime);

#[cfg(feature = "local")]
fn stamp(path: &Path) -> Option<FileStamp> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.len(), meta.modified().ok()?))
}

impl std::fmt::Debug for LocalModels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("LocalModels");
        #[cfg(feature = "local")]
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
        #[cfg(feature = "local")]
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
        #[cfg(not(feature = "local"))]
        Vec::new()
    }

    /// Whether a model from `path` is loaded (with any settings).
    pub fn is_loaded(&self, path: &Path) -> bool {
        #[cfg(feature = "local")]
        return self.loaded_paths().iter().any(|p| *p == absolute(path));
        #[cfg(not(feature = "local"))]
        {
            let _ = path;
            false
        }
    }

    #[cfg(feature = "local")]
    fn loaded_paths(&self) -> Vec<PathBuf> {
        lock(&self.loaded).keys().map(|c| c.path.clone()).collect()
    }

    /// Drops every loaded model that `pool` no longer asks for (as conductor or local worker,
    /// with the same settings); each is freed once no run uses it. Never waits for a load.
    pub fn keep_only(&self, pool: &Pool) {
        self.keep_only_with(pool, &ConductorChoice::default());
    }

    /// As [`LocalModels::keep_only`], with `choice` overriding the pool's conductor as it does
    /// when a run is built.
    pub fn keep_only_with(&self, pool: &Pool, choice: &ConductorChoice) {
        #[cfg(feature = "local")]
        {
            let wanted = wanted_models(pool, choice);
            lock(&self.loaded).retain(|config, _| wanted.contains(config));
        }
        #[cfg(not(feature = "local"))]
        let _ = (pool, choice);
    }

    /// Drops every loaded model whose file changed on disk since it was read (a model pulled
    /// again, say), so that the next run loads the file as it is now. Returns their paths.
    pub fn forget_changed_files(&self) -> Vec<PathBuf> {
        #[cfg(feature = "local")]
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
        #[cfg(not(feature = "local"))]
        Vec::new()
    }

    #[cfg(feature = "local")]
    fn get(&self, config: &crate::local::LocalModelConfig) -> Option<Arc<crate::local::LocalModel>> {
        lock(&self.loaded).get(config).cloned()
    }

    #[cfg(feature = "local")]
    pub async fn load(
        &self,
        config: crate::local::LocalModelConfig,
        what: &str,
        notify: Notify<'_>,
    ) -> Result<Arc<crate::local::LocalModel>, SetupError> {
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
        let model = crate::local::LocalModel::load(&config).await.map_err(|e| {
            tracing::warn!(path = %config.path.display(), "{what} did not load: {e}");
            notify(LoadNotice::Failed { what, path: &config.path });
            SetupError::Load(e.to_string())
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
#[cfg(feature = "local")]
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whether running `pool` with `choice` loads any model in this process: a local conductor
/// (when `with_conductor`: the run asks one for a plan) or a `local` worker.
pub fn uses_local_models(pool: &Pool, choice: &ConductorChoice, with_conductor: bool) -> bool {
    let spec = &pool.options.conductor;
    let conductor = choice.source.as_ref().or(spec.url.as_ref()).or(spec.model.as_ref());
    (with_conductor && conductor.is_some_and(|source| !is_remote(source)))
        || pool.workers.iter().any(|w| w.provider == ProviderKind::Local)
}

/// The local models `pool` uses with `choice` over its settings: its conductor, when that is a
/// local model, and its `local` workers.
#[cfg(feature = "local")]
fn wanted_models(pool: &Pool, choice: &ConductorChoice) -> Vec<crate::local::LocalModelConfig> {
    let spec = &pool.options.conductor;
    let mut wanted = Vec::new();
    if let Some(source) = choice.source.as_ref().or(spec.url.as_ref()).or(spec.model.as_ref())
        && !is_remote(source)
    {
        wanted.push(conductor_config(pool, choice, source));
    }
    let force_cpu = choice.force_cpu || spec.device.forces_cpu();
    wanted.extend(
        pool.workers.iter().filter(|w| w.provider == ProviderKind::Local).map(|w| worker_config(&w.model, force_cpu)),
    );
    wanted
}

#[cfg(feature = "local")]
fn worker_config(model: &str, force_cpu: bool) -> crate::local::LocalModelConfig {
    crate::local::LocalModelConfig { path: absolute(Path::new(model)), force_cpu, ..Default::default() }
}

/// `path` from the working directory of the command that names it. A model is known by its
/// absolute path: a holder that outlives one command (the warm helper, which serves commands
/// from many directories) must neither take `model.gguf` of one directory for another's nor
/// look for a relative file from the wrong place when it checks whether the file changed.
#[cfg(feature = "local")]
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_owned())
}

#[cfg(feature = "local")]
fn conductor_config(pool: &Pool, choice: &ConductorChoice, path: &str) -> crate::local::LocalModelConfig {
    let spec = &pool.options.conductor;
    crate::local::LocalModelConfig {
        path: absolute(Path::new(path)),
        lora: choice.lora.clone().or_else(|| spec.lora.as_ref().map(PathBuf::from)).map(|p| absolute(&p)),
        chat_template: choice
            .chat_template
            .clone()
            .or_else(|| spec.chat_template.as_ref().map(PathBuf::from))
            .map(|p| absolute(&p)),
        force_cpu: choice.force_cpu || spec.device.forces_cpu(),
        isq: spec.isq.clone(),
        dtype: spec.dtype.clone(),
        max_sequences: None,
    }
}

/// Runs the pool's `local` workers in process.
pub async fn attach_local_workers(
    executor: &mut Executor,
    pool: &Pool,
    models: &LocalModels,
    force_cpu: bool,
    notify: Notify<'_>,
) -> Result<(), SetupError> {
    for (index, spec) in pool.workers.iter().enumerate() {
        if spec.provider != ProviderKind::Local {
            continue;
        }
        #[cfg(not(feature = "local"))]
        {
            let _ = (executor, models, force_cpu, notify);
            return Err(SetupError::NoLocalSupport(format!("worker \"{}\" ({})", spec.name, spec.model)));
        }
        #[cfg(feature = "local")]
        {
            let model = models
                .load(worker_config(&spec.model, force_cpu), &format!("worker \"{}\"", spec.name), notify)
                .await?;
            let local = crate::local::LocalWorker {
                model,
                max_tokens: spec.max_tokens as usize,
                temperature: spec.temperature.map(f64::from),
            };
            executor.replace_worker(
                index,
                baton_engine::Worker {
                    info: pool.infos()[index].clone(),
                    model: Arc::new(local),
                    pricing: spec.pricing(),
                    output_cap: spec.max_tokens,
                    timeout: spec.timeout,
                    // One local engine runs its sequences itself; share one limit per model file.
                    endpoint: format!("local {}", spec.model),
                },
            );
        }
    }
    Ok(())
}

/// Whether a conductor source names a server rather than a local model.
pub fn is_remote(source: &str) -> bool {
    source.starts_with("http://") || source.starts_with("https://")
}

/// Builds the planner `choice` and the pool describe, loading a local conductor if needed.
pub async fn planner(
    pool: &Pool,
    choice: &ConductorChoice,
    models: &LocalModels,
    notify: Notify<'_>,
) -> Result<Arc<dyn Planner>, SetupError> {
    let spec = &pool.options.conductor;
    let defaults = ConductorOptions::default();
    let prompt_version = match spec.prompt.as_deref() {
        None => PromptVersion::default(),
        Some(name) => PromptVersion::parse(name).ok_or_else(|| {
            SetupError::Settings(format!(
                "[conductor] prompt = \"{name}\" is not a prompt version; expected one of {}",
                PromptVersion::NAMES.join(", ")
            ))
        })?,
    };
    let options = ConductorOptions {
        prompt_version,
        max_reasoning_chars: spec.max_reasoning_chars.unwrap_or(prompt_version.default_reasoning_chars()),
        max_subtask_chars: spec.max_subtask_chars.unwrap_or(defaults.max_subtask_chars),
        temperature: spec.temperature.or(defaults.temperature),
        learned: pool.options.fallback.measured.plans.clone(),
        plan_time_limit: spec.plan_time_limit_secs.map_or(defaults.plan_time_limit, std::time::Duration::from_secs),
        call: baton_engine::calls::CallPolicy {
            timeout: spec.timeout_secs.map_or(defaults.call.timeout, std::time::Duration::from_secs),
            retry: pool.options.retry.clone(),
        },
        ..ConductorOptions::default()
    };
    let source = match (&choice.source, &spec.url, &spec.model) {
        (Some(c), _, _) => c.clone(),
        (None, Some(url), _) => url.clone(),
        (None, None, Some(model)) => model.clone(),
        (None, None, None) => return Err(SetupError::NotConfigured),
    };
    // v3's words promise the conductor that every worker sees the question; without that, its
    // short subtasks would reach workers that never saw what they are about.
    if prompt_version == PromptVersion::V3 && !pool.options.show_question {
        return Err(SetupError::Settings(
            "prompt v3 tells the conductor that every worker is shown the question, but this pool sets \
             show_question = false: set show_question = true, or [conductor] prompt = \"v2\" (whose subtasks \
             carry the question themselves)"
                .into(),
        ));
    }
    if is_remote(&source) {
        let model_name = choice
            .model_name
            .clone()
            .or_else(|| spec.url.as_ref().and(spec.model.clone()))
            .unwrap_or_else(|| "default".to_owned());
        // Like a worker's: the pool's variable wins, else the keychain entry for this server.
        let key = match &spec.api_key_env {
            Some(var) => baton_engine::keys::env_key_source(
                Some(var.clone()),
                "the conductor".to_owned(),
                ProviderKind::OpenAiCompatible,
            ),
            None => baton_engine::keys::keychain_key_source(
                baton_secrets::account(ProviderKind::OpenAiCompatible, Some(&source)),
                ProviderKind::OpenAiCompatible,
            ),
        };
        let settings = ModelSettings {
            max_tokens: crate::conductor::REMOTE_MAX_TOKENS,
            temperature: options.temperature.map(|t| t as f32),
            ..ModelSettings::new(&model_name)
        };
        let http = HttpModel::new(ProviderKind::OpenAiCompatible, &source, settings, key, HttpModel::http_client());
        let name = format!("{model_name} at {source}");
        let grammar = choice.grammar.unwrap_or(spec.grammar);
        let pricing = baton_engine::prices::lookup(ProviderKind::OpenAiCompatible, &source, &model_name);
        let conductor = crate::RemoteConductor::new(Arc::new(http), name, pool.conductor_infos(), &options)
            .with_grammar(grammar)
            .with_pricing(pricing);
        return Ok(Arc::new(conductor));
    }
    local(pool, choice, &source, options, models, notify).await
}

#[cfg(feature = "local")]
async fn local(
    pool: &Pool,
    choice: &ConductorChoice,
    path: &str,
    options: ConductorOptions,
    models: &LocalModels,
    notify: Notify<'_>,
) -> Result<Arc<dyn Planner>, SetupError> {
    let model = models.load(conductor_config(pool, choice, path), "the conductor", notify).await?;
    Ok(Arc::new(crate::LocalConductor::new(model, pool.conductor_infos(), options)))
}

#[cfg(not(feature = "local"))]
async fn local(
    _pool: &Pool,
    _choice: &ConductorChoice,
    path: &str,
    _options: ConductorOptions,
    _models: &LocalModels,
    _notify: Notify<'_>,
) -> Result<Arc<dyn Planner>, SetupError> {
    Err(SetupError::NoLocalSupport(path.to_owned()))
}

/// What this build runs local models on: `cuda`, `metal` or `cpu`, fixed when it was compiled
/// (`scripts/app` builds for the GPU when it finds the CUDA toolkit or Apple silicon).
pub const BUILD_DEVICE: &str = if cfg!(feature = "cuda") {
    "cuda"
} else if cfg!(feature = "metal") {
    "metal"
} else {
    "cpu"
};

/// Sets the environment the engine reads, before anything else runs.
///
/// - mistral.rs's Hugging Face cache goes into Baton's own data directory and stays offline.
///   mistral.rs creates that cache even for local models; nothing should land in the user's home
///   cache, and a local model must never reach for the network.
/// - Libraries' errors carry no backtrace (`RUST_LIB_BACKTRACE=0`) unless the user sets that
///   variable. With `RUST_BACKTRACE=1` in a shell, every candle and anyhow error captured one,
///   and an error turned into text resolved it: loading a GGUF formats such an error for an
///   optional metadata field it reads, which read the binary's debug information into memory
///   for the process's life (44 MiB beside SmolLM2's 94 MiB of weights, measured with
///   `baton bench conductor`); a candle error shown to a user would carry the backtrace too.
///   `RUST_BACKTRACE` still gives backtraces on a panic.
/// - The allocator keeps freed memory for reuse ([`keep_freed_memory`]).
///
/// # Safety
///
/// It sets environment variables, so it must run before any other thread exists (the async
/// runtime, a webview): call it first thing in `main`.
#[allow(unsafe_code)]
pub unsafe fn set_engine_environment() {
    let dir = dirs::data_dir().unwrap_or_else(std::env::temp_dir).join("baton").join("hf");
    // SAFETY: the caller guarantees no other thread exists yet, so nothing reads the
    // environment concurrently.
    unsafe {
        std::env::set_var("HF_HOME", &dir);
        std::env::set_var("HF_HUB_OFFLINE", "1");
        if std::env::var_os("RUST_LIB_BACKTRACE").is_none() {
            std::env::set_var("RUST_LIB_BACKTRACE", "0");
        }
    }
    keep_freed_memory();
}

/// Has glibc keep the memory a local model's prompt frees, for the next layer to reuse.
///
/// A prompt allocates each layer's activations afresh: for Qwen2.5-1.5B and a 585-token prompt,
/// blocks of up to 21 MiB, dozens a layer. By default glibc maps blocks above its mmap
/// threshold on their own and gives the top of a heap back to the system once 128 KiB of it is
/// free, so nearly every block came back as new pages, which the kernel zeroes on first touch:
/// page faults and zeroing were about a tenth of the prompt's time. Now blocks up to 32 MiB
/// (the most glibc allows) come from the heaps, the heaps keep what is freed, and they grow
/// 256 MiB at a time (address space; only touched pages are resident). The 1.5B's 585-token
/// prompt ran about 10% faster on a 2-core Xeon, medians of three runs each, with the same peak
/// resident memory (the prompt's buffers were resident at their peak anyway). After loading a
/// model, [`crate::local`] still hands free pages back (`malloc_trim`), so the memory a loaded
/// model is reported to take does not change.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc's allocation policy; it is called before other threads
    // exist, and glibc serialises it with allocation anyway.
    #[allow(unsafe_code)]
    unsafe {
        const MIB: libc::c_int = 1 << 20;
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 * MIB);
        libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX);
        libc::mallopt(libc::M_TOP_PAD, 256 * MIB);
    }
}

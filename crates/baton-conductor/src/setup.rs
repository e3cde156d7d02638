//! From a pool's `[conductor]` table (or a choice that overrides it) to a running planner, and
//! the pool's `local` workers to in-process models. The command line and the desktop app both
//! start runs through here, so they load, name and refuse models the same way.

use std::collections::HashMap;
#[cfg(feature = "local")]
use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;

use baton_engine::{Planner, Pool, WorkerSpec};
#[cfg(feature = "local")]
use baton_local::LocalModelConfig;
use baton_local::{LocalModels, Notify};
use baton_providers::{ChatModel, HttpModel, ModelSettings, ProviderKind, ServerGrammar};

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
    /// The pool would send a variable's key to a host the user has not allowed it to go to.
    #[error(transparent)]
    KeyNotAllowed(#[from] baton_engine::keys::KeyNotAllowed),
}

/// What a pool asks of the models a process keeps loaded.
pub trait KeepForPool {
    /// Drops every loaded model that `pool` no longer asks for (as conductor or local worker,
    /// with the same settings); each is freed once no run uses it. Never waits for a load.
    fn keep_only(&self, pool: &Pool) {
        self.keep_only_with(pool, &ConductorChoice::default());
    }

    /// As [`KeepForPool::keep_only`], with `choice` overriding the pool's conductor as it does
    /// when a run is built.
    fn keep_only_with(&self, pool: &Pool, choice: &ConductorChoice);
}

impl KeepForPool for LocalModels {
    fn keep_only_with(&self, pool: &Pool, choice: &ConductorChoice) {
        #[cfg(feature = "local")]
        {
            let wanted = wanted_models(pool, choice);
            self.retain(|config| wanted.contains(config));
        }
        #[cfg(not(feature = "local"))]
        let _ = (self, pool, choice);
    }
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
fn wanted_models(pool: &Pool, choice: &ConductorChoice) -> Vec<LocalModelConfig> {
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
fn worker_config(model: &str, force_cpu: bool) -> LocalModelConfig {
    LocalModelConfig { path: absolute(Path::new(model)), force_cpu, ..Default::default() }
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
fn conductor_config(pool: &Pool, choice: &ConductorChoice, path: &str) -> LocalModelConfig {
    let spec = &pool.options.conductor;
    LocalModelConfig {
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

/// The models of the pool's `local` workers, each loaded (or found loaded) in `models`, by the
/// worker's index in the pool: what
/// [`Executor::from_pool_with_local`](baton_engine::Executor::from_pool_with_local) runs them on.
pub async fn load_local_workers(
    pool: &Pool,
    models: &LocalModels,
    force_cpu: bool,
    notify: Notify<'_>,
) -> Result<HashMap<usize, Arc<dyn ChatModel>>, SetupError> {
    let mut loaded = HashMap::new();
    for (index, spec) in pool.workers.iter().enumerate() {
        if spec.provider == ProviderKind::Local {
            loaded.insert(index, local_worker(spec, models, force_cpu, notify).await?);
        }
    }
    Ok(loaded)
}

#[cfg(feature = "local")]
async fn local_worker(
    spec: &WorkerSpec,
    models: &LocalModels,
    force_cpu: bool,
    notify: Notify<'_>,
) -> Result<Arc<dyn ChatModel>, SetupError> {
    let what = format!("worker \"{}\"", spec.name);
    let model = models.load(worker_config(&spec.model, force_cpu), &what, notify).await.map_err(load_error)?;
    Ok(Arc::new(baton_local::LocalWorker {
        model,
        max_tokens: spec.max_tokens as usize,
        temperature: spec.temperature.map(f64::from),
        top_p: spec.top_p.map(f64::from),
    }))
}

#[cfg(not(feature = "local"))]
async fn local_worker(
    spec: &WorkerSpec,
    _models: &LocalModels,
    _force_cpu: bool,
    _notify: Notify<'_>,
) -> Result<Arc<dyn ChatModel>, SetupError> {
    Err(SetupError::NoLocalSupport(format!("worker \"{}\" ({})", spec.name, spec.model)))
}

#[cfg(feature = "local")]
fn load_error(e: baton_local::LoadError) -> SetupError {
    SetupError::Load(e.to_string())
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
        learned: pool.learned.plans.clone(),
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
            Some(var) => {
                let (var_, to, owner) = (var.clone(), source.clone(), "the conductor");
                tokio::task::spawn_blocking(move || baton_engine::keys::check_env_key(&var_, &to, owner))
                    .await
                    .map_err(|e| SetupError::Settings(format!("the conductor's key could not be checked: {e}")))??;
                baton_engine::keys::env_key_source(
                    Some(var.clone()),
                    owner.to_owned(),
                    ProviderKind::OpenAiCompatible,
                    Some(source.clone()),
                )
            }
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
    let model = models.load(conductor_config(pool, choice, path), "the conductor", notify).await.map_err(load_error)?;
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

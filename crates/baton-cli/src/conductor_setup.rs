//! Choosing and loading the conductor: `--conductor PATH|URL` or the pool's `[conductor]` table.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use baton_conductor::ConductorOptions;
use baton_engine::{Planner, Pool};
use baton_providers::{HttpModel, ModelSettings, ProviderKind, ServerGrammar};

use crate::Failure;

#[derive(Debug, Clone, clap::Args)]
pub struct ConductorArgs {
    /// The conductor: a .gguf file or a safetensors model directory, or the URL of an
    /// OpenAI-compatible server (default: the pool's [conductor] table).
    #[arg(long, value_name = "PATH|URL")]
    pub conductor: Option<String>,
    /// The model name a remote conductor's server serves.
    #[arg(long, value_name = "NAME")]
    pub conductor_model: Option<String>,
    /// The remote conductor server's grammar support: vllm, sglang, llama.cpp or none
    /// (default: the pool's conductor.grammar, else none: answers are parsed, retried once).
    #[arg(long, value_name = "SERVER", value_parser = parse_server_grammar)]
    pub conductor_grammar: Option<GrammarArg>,
    /// A LoRA adapter for the local conductor (a fine-tuned conductor).
    #[arg(long, value_name = "DIR")]
    pub lora: Option<PathBuf>,
    /// A chat template (.jinja) for a local model that lacks one.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// Run the local conductor on the CPU even when a GPU is available.
    #[arg(long)]
    pub cpu: bool,
}

/// `--conductor-grammar`: a server, or `none` to override the pool's choice.
#[derive(Debug, Clone, Copy)]
pub struct GrammarArg(Option<ServerGrammar>);

fn parse_server_grammar(s: &str) -> Result<GrammarArg, String> {
    match s {
        "none" => Ok(GrammarArg(None)),
        s => ServerGrammar::parse(s)
            .map(|g| GrammarArg(Some(g)))
            .ok_or_else(|| format!("expected one of {} or none", ServerGrammar::NAMES.join(", "))),
    }
}

const NONE_CONFIGURED: &str = "no conductor is configured: add a [conductor] table with model = \"/path/to/model.gguf\" to the pool file, pass --conductor PATH|URL, or run a written plan with --plan FILE";

/// Local models loaded by this command, by path, so a model used as conductor and worker (or
/// by several workers) is loaded once.
#[derive(Default)]
pub struct LocalModels {
    #[cfg(feature = "local")]
    loaded: std::collections::HashMap<PathBuf, Arc<baton_conductor::local::LocalModel>>,
}

#[cfg(feature = "local")]
impl LocalModels {
    async fn load(
        &mut self,
        config: baton_conductor::local::LocalModelConfig,
        what: &str,
        quiet: bool,
    ) -> Result<Arc<baton_conductor::local::LocalModel>, Failure> {
        if let Some(m) = self.loaded.get(&config.path) {
            return Ok(m.clone());
        }
        if !quiet {
            eprint!("loading {what} {} … ", config.path.display());
            let _ = std::io::stderr().flush();
        }
        let model = baton_conductor::local::LocalModel::load(&config).await.map_err(|e| {
            if !quiet {
                eprintln!("failed");
            }
            Failure::BadInput(e.to_string())
        })?;
        if !quiet {
            eprintln!("loaded in {:.2} s on {}", model.load_time.as_secs_f64(), model.device);
        }
        let model = Arc::new(model);
        self.loaded.insert(config.path.clone(), model.clone());
        Ok(model)
    }
}

/// Runs the pool's `local` workers in process.
#[cfg(feature = "local")]
pub async fn attach_local_workers(
    executor: &mut baton_engine::Executor,
    pool: &Pool,
    models: &mut LocalModels,
    force_cpu: bool,
    quiet: bool,
) -> Result<(), Failure> {
    for (index, spec) in pool.workers.iter().enumerate() {
        if spec.provider != ProviderKind::Local {
            continue;
        }
        let config = baton_conductor::local::LocalModelConfig {
            path: PathBuf::from(&spec.model),
            force_cpu,
            ..Default::default()
        };
        let model = models.load(config, &format!("worker \"{}\"", spec.name), quiet).await?;
        let local = baton_conductor::local::LocalWorker {
            model,
            max_tokens: spec.max_tokens as usize,
            temperature: spec.temperature.map(f64::from),
        };
        executor.replace_worker(
            index,
            baton_engine::Worker {
                info: pool.infos()[index].clone(),
                model: Arc::new(local),
                price: spec.price(),
                timeout: spec.timeout,
                // One local engine runs its sequences itself; share one limit per model file.
                endpoint: format!("local {}", spec.model),
            },
        );
    }
    Ok(())
}

#[cfg(not(feature = "local"))]
pub async fn attach_local_workers(
    _executor: &mut baton_engine::Executor,
    pool: &Pool,
    _models: &mut LocalModels,
    _force_cpu: bool,
    _quiet: bool,
) -> Result<(), Failure> {
    match pool.workers.iter().find(|w| w.provider == ProviderKind::Local) {
        Some(w) => Err(Failure::BadInput(format!(
            "worker \"{}\" is local, but this build of baton runs no local models (built without the `local` feature)",
            w.name
        ))),
        None => Ok(()),
    }
}

/// Builds the planner the arguments and the pool describe. `quiet` suppresses load progress.
pub async fn planner(
    pool: &Pool,
    args: &ConductorArgs,
    models: &mut LocalModels,
    quiet: bool,
) -> Result<Arc<dyn Planner>, Failure> {
    let spec = &pool.options.conductor;
    let options = ConductorOptions {
        max_reasoning_chars: spec.max_reasoning_chars.unwrap_or(ConductorOptions::default().max_reasoning_chars),
        max_subtask_chars: spec.max_subtask_chars.unwrap_or(ConductorOptions::default().max_subtask_chars),
        temperature: spec.temperature.or(ConductorOptions::default().temperature),
        ..ConductorOptions::default()
    };
    let (source, remote) = match &args.conductor {
        Some(c) => (c.clone(), c.starts_with("http://") || c.starts_with("https://")),
        None => match (&spec.url, &spec.model) {
            (Some(url), _) => (url.clone(), true),
            (None, Some(model)) => (model.clone(), false),
            (None, None) => return Err(Failure::BadInput(NONE_CONFIGURED.into())),
        },
    };
    if remote {
        let model_name = args
            .conductor_model
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
            max_tokens: 4096,
            temperature: options.temperature.map(|t| t as f32),
            ..ModelSettings::new(&model_name)
        };
        let http = HttpModel::new(ProviderKind::OpenAiCompatible, &source, settings, key, HttpModel::http_client());
        let name = format!("{model_name} at {source}");
        let grammar = args.conductor_grammar.map_or(spec.grammar, |GrammarArg(g)| g);
        let conductor =
            baton_conductor::RemoteConductor::new(Arc::new(http), name, pool.infos(), &options).with_grammar(grammar);
        return Ok(Arc::new(conductor));
    }
    local(pool, spec, args, &source, options, models, quiet).await
}

#[cfg(feature = "local")]
async fn local(
    pool: &Pool,
    spec: &baton_engine::ConductorSpec,
    args: &ConductorArgs,
    path: &str,
    options: ConductorOptions,
    models: &mut LocalModels,
    quiet: bool,
) -> Result<Arc<dyn Planner>, Failure> {
    use baton_conductor::local::LocalModelConfig;
    let config = LocalModelConfig {
        path: PathBuf::from(path),
        lora: args.lora.clone().or_else(|| spec.lora.as_ref().map(PathBuf::from)),
        chat_template: args.chat_template.clone().or_else(|| spec.chat_template.as_ref().map(PathBuf::from)),
        force_cpu: args.cpu || spec.device.as_deref() == Some("cpu"),
        isq: spec.isq.clone(),
        dtype: spec.dtype.clone(),
    };
    let model = models.load(config, "the conductor", quiet).await?;
    Ok(Arc::new(baton_conductor::LocalConductor::new(model, pool.infos(), options)))
}

#[cfg(not(feature = "local"))]
async fn local(
    _pool: &Pool,
    _spec: &baton_engine::ConductorSpec,
    _args: &ConductorArgs,
    path: &str,
    _options: ConductorOptions,
    _models: &mut LocalModels,
    _quiet: bool,
) -> Result<Arc<dyn Planner>, Failure> {
    Err(Failure::BadInput(format!(
        "{path}: this build of baton runs no local models (built without the `local` feature); use a remote conductor URL"
    )))
}

//! Choosing and loading the conductor: `--conductor PATH|URL` or the pool's `[conductor]` table.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use baton_conductor::setup::{ConductorChoice, LoadNotice, SetupError};
use baton_engine::{Planner, Pool};
use baton_providers::ServerGrammar;

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

pub use baton_conductor::setup::LocalModels;

impl ConductorArgs {
    fn choice(&self) -> ConductorChoice {
        ConductorChoice {
            source: self.conductor.clone(),
            model_name: self.conductor_model.clone(),
            grammar: self.conductor_grammar.map(|GrammarArg(g)| g),
            lora: self.lora.clone(),
            chat_template: self.chat_template.clone(),
            force_cpu: self.cpu,
        }
    }
}

/// Load progress on stderr, unless `quiet` (JSON output).
fn progress(quiet: bool) -> impl Fn(LoadNotice<'_>) + Send + Sync {
    move |notice| {
        if quiet {
            return;
        }
        match notice {
            LoadNotice::Loading { what, path } => {
                eprint!("loading {what} {} … ", path.display());
                let _ = std::io::stderr().flush();
            }
            LoadNotice::Loaded { seconds, device, .. } => eprintln!("loaded in {seconds:.2} s on {device}"),
            LoadNotice::Failed { .. } => eprintln!("failed"),
        }
    }
}

fn failure(e: SetupError) -> Failure {
    Failure::BadInput(e.to_string())
}

/// Runs the pool's `local` workers in process.
pub async fn attach_local_workers(
    executor: &mut baton_engine::Executor,
    pool: &Pool,
    models: &LocalModels,
    force_cpu: bool,
    quiet: bool,
) -> Result<(), Failure> {
    baton_conductor::setup::attach_local_workers(executor, pool, models, force_cpu, &progress(quiet))
        .await
        .map_err(failure)
}

/// Builds the planner the arguments and the pool describe. `quiet` suppresses load progress.
pub async fn planner(
    pool: &Pool,
    args: &ConductorArgs,
    models: &LocalModels,
    quiet: bool,
) -> Result<Arc<dyn Planner>, Failure> {
    baton_conductor::setup::planner(pool, &args.choice(), models, &progress(quiet)).await.map_err(failure)
}

/// Like [`planner`], but a pool with no conductor (and none given) is `None`, not an error:
/// `baton serve` then serves the workers alone.
pub async fn optional_planner(
    pool: &Pool,
    args: &ConductorArgs,
    models: &LocalModels,
    quiet: bool,
) -> Result<Option<Arc<dyn Planner>>, Failure> {
    match baton_conductor::setup::planner(pool, &args.choice(), models, &progress(quiet)).await {
        Ok(planner) => Ok(Some(planner)),
        Err(SetupError::NotConfigured) => Ok(None),
        Err(e) => Err(failure(e)),
    }
}

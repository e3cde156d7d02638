//! Choosing and loading the conductor: `--conductor PATH|URL` or the pool's `[conductor]` table.

use std::path::PathBuf;

use baton_engine::Pool;
use baton_providers::ServerGrammar;
use baton_runner::{Built, Conductor, ConductorChoice, Context, KeepForPool, LoadNotice, LocalModels, RunnerError};

use crate::Failure;
use crate::io::{Io, errln};

#[derive(Debug, Clone, Default, clap::Args)]
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

impl ConductorArgs {
    pub fn choice(&self) -> ConductorChoice {
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

/// What a command lends the application layer to load models with: the user's conductor
/// choice and load progress on `io`'s error stream (none when `quiet`: JSON output).
pub struct Loader {
    choice: ConductorChoice,
    notify: Box<dyn Fn(LoadNotice<'_>) + Send + Sync>,
}

impl std::fmt::Debug for Loader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader").field("choice", &self.choice).finish_non_exhaustive()
    }
}

impl Loader {
    pub fn new(args: &ConductorArgs, quiet: bool, io: &Io) -> Loader {
        let io = io.clone();
        let notify = move |notice: LoadNotice<'_>| {
            if quiet {
                return;
            }
            match notice {
                LoadNotice::Loading { what, path } => io.err(&format!("loading {what} {} … ", path.display())),
                LoadNotice::Loaded { seconds, device, .. } => errln!(io, "loaded in {seconds:.2} s on {device}"),
                LoadNotice::Failed { .. } => errln!(io, "failed"),
            }
        };
        Loader { choice: args.choice(), notify: Box::new(notify) }
    }

    /// The context for work on `pool`, loading local models into `models`. Models a warm
    /// helper loaded for an earlier question with another pool are let go.
    pub fn context<'a>(&'a self, pool: &Pool, models: &'a LocalModels) -> Context<'a> {
        models.keep_only_with(pool, &self.choice);
        Context { models, choice: &self.choice, notify: &*self.notify }
    }

    /// The executor for `pool` through the application layer, with a conductor as `conductor`
    /// says and nothing learned put in (`baton pool check`: the workers alone).
    pub async fn executor(&self, pool: Pool, models: &LocalModels, conductor: Conductor) -> Result<Built, Failure> {
        let context = self.context(&pool, models);
        Ok(baton_runner::build(pool, context.setup(conductor, None)).await.map_err(RunnerError::from)?)
    }
}

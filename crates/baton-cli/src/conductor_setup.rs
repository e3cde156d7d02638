//! Choosing and loading the conductor: `--conductor PATH|URL` or the pool's `[conductor]` table.

use std::path::PathBuf;

use baton_engine::Pool;
use baton_providers::ServerGrammar;
use baton_runner::{Built, Conductor, ConductorChoice, LoadNotice, LocalModels, Setup, SetupError};

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

/// Load progress on `io`'s error stream, unless `quiet` (JSON output).
fn progress(quiet: bool, io: &Io) -> impl Fn(LoadNotice<'_>) + Send + Sync + use<> {
    let io = io.clone();
    move |notice| {
        if quiet {
            return;
        }
        match notice {
            LoadNotice::Loading { what, path } => io.err(&format!("loading {what} {} … ", path.display())),
            LoadNotice::Loaded { seconds, device, .. } => errln!(io, "loaded in {seconds:.2} s on {device}"),
            LoadNotice::Failed { .. } => errln!(io, "failed"),
        }
    }
}

/// What a command builds its executor from: the pool, these arguments, and the history (which
/// picks the fallback worker). `quiet` keeps load progress off stderr (JSON output); `io` is
/// where it goes, and what interrupts a plan.
#[derive(Debug)]
pub struct Build<'a> {
    pub args: &'a ConductorArgs,
    pub conductor: Conductor,
    pub store: Option<&'a baton_store::Store>,
    pub quiet: bool,
    pub io: &'a Io,
}

impl Build<'_> {
    /// The executor for `pool` through the runner, loading local models into `models`.
    pub async fn executor(&self, pool: Pool, models: &LocalModels) -> Result<Built, Failure> {
        let choice = self.args.choice();
        let notify = progress(self.quiet, self.io);
        // Models a warm helper loaded for an earlier question with another pool are let go.
        models.keep_only_with(&pool, &choice);
        let setup = Setup { models, choice: &choice, conductor: self.conductor, store: self.store, notify: &notify };
        baton_runner::build(pool, setup).await.map_err(failure)
    }

    /// A plan for `question`, through the executor's own planning round; nothing runs.
    pub async fn draft(
        &self,
        pool: Pool,
        models: &LocalModels,
        question: &str,
        deltas: baton_engine::PlanDeltas<'_>,
    ) -> Result<baton_engine::Planned, Failure> {
        let choice = self.args.choice();
        let notify = progress(self.quiet, self.io);
        models.keep_only_with(&pool, &choice);
        let setup = Setup { models, choice: &choice, conductor: self.conductor, store: self.store, notify: &notify };
        match baton_runner::draft::draft(pool, setup, question, Vec::new(), deltas, &self.io.cancel).await {
            Ok((planned, _)) => Ok(planned),
            Err(baton_runner::RunnerError::Setup(e)) => Err(failure(e)),
            Err(baton_runner::RunnerError::Cancelled(_)) => Err(Failure::Interrupted),
            Err(e) => Err(Failure::Failed(e.to_string())),
        }
    }
}

fn failure(e: SetupError) -> Failure {
    Failure::BadInput(e.to_string())
}

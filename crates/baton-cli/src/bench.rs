//! `baton bench`: measurements a user can repeat.
//!
//! `bench executor`: the executor's own overhead. Workers are in-process fakes with a fixed
//! latency, one per step, so each step's real duration is known exactly; the critical path is
//! the longest chain of those durations through the plan's DAG, and anything above it is the
//! executor's (scheduling, message building, events). `bench history`: the history database at
//! scale. `bench serve`: what `baton serve` adds to a run. `bench conductor`: a local
//! conductor model's speed.

use crate::Outcome;

#[cfg(feature = "local")]
mod conductor;
mod executor;
mod flood;
mod history;
mod serve;

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Wall time of 1-step, chain, fan-out and "all" plans against their critical path.
    Executor {
        /// Latency of every fake worker call.
        #[arg(long, default_value_t = 50)]
        latency_ms: u64,
        /// Runs per plan.
        #[arg(long, default_value_t = 20)]
        runs: usize,
        /// One JSON object per plan on stdout.
        #[arg(long)]
        json: bool,
    },
    /// The history at scale: fills a database with generated runs, then times listing the latest
    /// 50, searching (a common and a rare word), and loading one run's whole tree.
    History {
        /// The database to fill (created; an existing one gets more runs).
        #[arg(long, value_name = "FILE")]
        db: std::path::PathBuf,
        /// Runs to add before measuring.
        #[arg(long, default_value_t = 100_000)]
        runs: u32,
        /// Steps per generated run.
        #[arg(long, default_value_t = 3)]
        steps: u32,
        /// Repetitions of each query.
        #[arg(long, default_value_t = 50)]
        repeat: usize,
        /// One JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// What `baton serve` adds to a run: concurrent streamed requests over loopback to fake
    /// workers with a fixed latency, each one's time at the client against the executor's own
    /// wall time for its run (the difference is HTTP, checks, recording and streaming). The
    /// burst is sent on new connections, then `--bursts` times on the ones the first opened.
    Serve {
        /// Requests sent at once.
        #[arg(long, default_value_t = 64)]
        requests: usize,
        /// Bursts on open connections, each once the history has recorded the one before: the
        /// figures are over all of them (one burst's median moves by a millisecond from one go
        /// to the next on a small machine).
        #[arg(long, default_value_t = 5)]
        bursts: usize,
        /// Latency of every fake worker call.
        #[arg(long, default_value_t = 200)]
        latency_ms: u64,
        /// Serve without a history, to see what recording adds.
        #[arg(long)]
        no_history: bool,
        /// Run slots of the server (default: twice `--requests`, so that no request waits and
        /// the figures are serving alone). `--max-concurrent-runs 8`, `baton serve`'s default,
        /// shows what a burst waits in the queue beyond the slots.
        #[arg(long, value_name = "N")]
        max_concurrent_runs: Option<usize>,
        /// Pin the runtime's worker threads one per core, as `baton serve --pin-threads` does.
        #[arg(long)]
        pin_threads: bool,
        /// One JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// What a flood costs `baton serve` in resident memory, for each bound it keeps: idle
    /// connections, waiting request bodies, responses kept for `Idempotency-Key`, and a remote
    /// conductor's endless plan; each sent far past its bound (Linux: memory from /proc).
    Flood {
        /// Run only flood N (0 to 3) in this process, printing its figures as JSON: what the
        /// bench runs each flood as.
        #[arg(long, value_name = "N", hide = true)]
        only: Option<usize>,
        /// One JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// A local conductor model's speed: load time, prompt and decode rates, time to the first
    /// plan token cold (the first plan) and warm (later plans, whose prompts share the pool's
    /// prefix), plan tokens and time, and what the plan grammar costs per token.
    Conductor(ConductorArgs),
}

#[derive(Debug, clap::Args)]
pub struct ConductorArgs {
    /// A .gguf file or a safetensors model directory.
    #[arg(long, value_name = "PATH")]
    model: std::path::PathBuf,
    /// Plans to write; the first is cold, the others warm.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Workers in the pool the plans are for.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// The conductor's prompt version (v2, v3).
    #[arg(long, default_value = baton_conductor::PROMPT_VERSION)]
    prompt: String,
    /// Longest reasoning before the lists (default: the prompt version's: 1200 for v2, 0 for v3).
    #[arg(long)]
    max_reasoning_chars: Option<usize>,
    /// Sampling temperature of the plans (0 is greedy); default the conductor's.
    #[arg(long, value_parser = crate::numbers::temperature)]
    temperature: Option<f64>,
    /// Run on the CPU even when a GPU is available.
    #[arg(long)]
    cpu: bool,
    /// In-situ quantization while loading a safetensors model (e.g. Q4K).
    #[arg(long)]
    isq: Option<String>,
    /// A chat template (.jinja) for a model that lacks one.
    #[arg(long, value_name = "FILE")]
    chat_template: Option<std::path::PathBuf>,
    /// One JSON object on stdout.
    #[arg(long)]
    json: bool,
}

pub async fn run(cmd: Command) -> Outcome {
    match cmd {
        Command::Executor { latency_ms, runs, json } => executor::run(latency_ms, runs, json).await,
        Command::History { db, runs, steps, repeat, json } => history::run(&db, runs, steps, repeat, json).await,
        Command::Serve { requests, bursts, latency_ms, no_history, max_concurrent_runs, pin_threads, json } => {
            let slots = max_concurrent_runs.unwrap_or(2 * requests);
            serve::run(requests, bursts, latency_ms, !no_history, slots, pin_threads, json).await
        }
        Command::Flood { only, json } => flood::run(only, json).await,
        #[cfg(feature = "local")]
        Command::Conductor(args) => conductor::run(args).await,
        // Named in full: this arm is this file's only use of `Failure`, and the `local` feature
        // compiles it out, which would leave an import unused.
        #[cfg(not(feature = "local"))]
        Command::Conductor(_) => Err(crate::Failure::BadInput("this build of baton runs no local models".into())),
    }
}

/// Sorts `values` and returns their median and largest; the benches' common summary.
fn median_max(values: &mut [f64]) -> (f64, f64) {
    values.sort_by(f64::total_cmp);
    (values[values.len() / 2], values[values.len() - 1])
}

//! `baton`: ask a pool of models a question through a conductor's plan, check a pool, parse
//! plans, and measure the engine.
//!
//! Exit codes: 0 success, 1 the run (or a check) failed, 2 bad input, 3 this CPU lacks features
//! the build needs (AVX2 …), 130 interrupted.

mod ask;
mod bench;
mod conductor_setup;
mod eval_cmd;
mod history_cmd;
mod io;
mod json;
mod keys_cmd;
mod learn_cmd;
mod models_cmd;
mod numbers;
mod plan_cmd;
mod pool_cmd;
mod progress;
mod runtime;
mod serve_cmd;
#[cfg(unix)]
mod warm;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "baton", version, about = "Orchestrate a pool of language models with a conductor's plan")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a plan over the pool and print the final answer.
    Ask(ask::Args),
    /// Print the conductor's plan for a question without running it; `plan parse` checks one.
    Plan(plan_cmd::Args),
    /// Inspect and check the worker pool.
    #[command(subcommand)]
    Pool(pool_cmd::Command),
    /// Measure the engine.
    #[command(subcommand)]
    Bench(bench::Command),
    /// Recorded runs: list, search, show, export, delete.
    History(history_cmd::Args),
    /// Store, list and delete provider API keys in the OS keychain.
    #[command(subcommand)]
    Keys(keys_cmd::Command),
    /// Model files from the Hugging Face hub: pull (resumable, verified), path, list, rm, and the
    /// curated conductor models for this computer.
    #[command(subcommand)]
    Models(models_cmd::Command),
    /// Evaluations: does the conductor beat the best single worker, a lookup table, MoA or
    /// best-of-n on this pool, and at what cost? run, list, show, export, delete, suites.
    Eval(eval_cmd::Args),
    /// Serve the pool as one OpenAI-compatible model (`baton`, and `baton/<worker>` for each
    /// worker alone) on this machine; `serve token` prints the token clients send.
    Serve(serve_cmd::Args),
    /// Baton's log files (what to attach to a problem report).
    #[command(subcommand)]
    Logs(LogsCommand),
    /// The warm helper that `ask` and `plan` start themselves (see `BATON_KEEP_WARM`).
    #[command(name = "__keep-warm", hide = true)]
    KeepWarm { socket: PathBuf, idle_secs: u64 },
}

#[derive(Debug, Subcommand)]
enum LogsCommand {
    /// Print the directory the command line and the app write their logs to.
    Path,
}

/// How a command ended, mapped to the documented exit codes.
#[derive(Debug)]
pub enum Failure {
    /// The input was wrong (exit 2); the message says what and where.
    BadInput(String),
    /// The work was attempted and failed (exit 1).
    Failed(String),
    /// Interrupted by the user (exit 130).
    Interrupted,
    /// The warm helper ran the command, said why it failed, and ended with this code.
    Exited(u8),
}

pub type Outcome = Result<(), Failure>;

/// The pool file: `--pool`, else `$BATON_POOL`, else `<config dir>/baton/pool.toml`.
#[derive(Debug, clap::Args)]
pub struct PoolArg {
    /// Pool file (TOML).
    #[arg(long, value_name = "FILE", env = "BATON_POOL")]
    pool: Option<PathBuf>,
}

impl PoolArg {
    pub fn path(&self) -> PathBuf {
        match &self.pool {
            Some(p) => p.clone(),
            None => baton_engine::pool::default_pool_path(&dirs::config_dir().unwrap_or_else(|| PathBuf::from("."))),
        }
    }

    pub fn load(&self) -> Result<baton_engine::Pool, Failure> {
        baton_engine::Pool::load(&self.path()).map_err(|e| Failure::BadInput(e.to_string()))
    }
}

/// Says that a spending cap (`cap`, as the user set it) cannot count the workers without a
/// price: their calls pass it as $0.
pub fn warn_unpriced(pool: &baton_engine::Pool, cap: &str, io: &io::Io) {
    if let Some(warning) = baton_runner::unpriced_warning(pool, cap) {
        io::errln!(io, "{warning}");
    }
}

impl From<baton_runner::RunnerError> for Failure {
    /// Exit 2 for what the user can change in their input or settings, 1 for work that failed,
    /// 130 for a stop.
    fn from(e: baton_runner::RunnerError) -> Failure {
        use baton_runner::RunnerError;
        match e {
            RunnerError::Setup(e) => Failure::BadInput(e.to_string()),
            RunnerError::NotFound(m) | RunnerError::BadInput(m) => Failure::BadInput(m),
            RunnerError::Cancelled(_) => Failure::Interrupted,
            RunnerError::Token(
                e @ (baton_serve::TokenError::VariableUnset(_) | baton_serve::TokenError::FromVariable(_)),
            ) => Failure::BadInput(e.to_string()),
            RunnerError::Io(m) => Failure::BadInput(m),
            e @ (RunnerError::Store(_)
            | RunnerError::Pool(_)
            | RunnerError::Conductor(_)
            | RunnerError::Sandbox(_)
            | RunnerError::Token(_)) => Failure::Failed(e.to_string()),
        }
    }
}

/// Cancels `cancel` on the first Ctrl-C; abort the task once the work it stops has ended.
pub fn cancel_on_ctrl_c(cancel: &tokio_util::sync::CancellationToken) -> tokio::task::JoinHandle<()> {
    let cancel = cancel.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            cancel.cancel();
        }
    })
}

baton_local::check_cpu_before_anything!();

fn main() -> ExitCode {
    // Before anything else: the rest of the binary may use instructions this CPU lacks. `main`
    // stays this small so that the compiler has nothing to put before the check: with the work
    // inlined here, its prologue zeroed locals with an AVX instruction and died of SIGILL first.
    baton_local::cpu::exit_unless_supported();
    run()
}

#[inline(never)]
fn run() -> ExitCode {
    let cli = Cli::parse();
    // SAFETY: before the async runtime or any other thread exists.
    #[allow(unsafe_code)]
    unsafe {
        baton_local::set_engine_environment();
    }
    if let Command::Logs(LogsCommand::Path) = cli.command {
        println!("{}", baton_engine::logs::log_dir().display());
        return ExitCode::SUCCESS;
    }
    // Without a log the command still works; it says why there is none.
    let _log = baton_engine::logs::init("baton").map_err(|e| eprintln!("warning: no log file: {e}")).ok();
    let pin = match &cli.command {
        Command::Serve(args) => args.pin_threads,
        Command::Bench(bench::Command::Serve { pin_threads, .. }) => *pin_threads,
        _ => false,
    };
    let runtime = match runtime::build(pin) {
        Ok((rt, pinned)) => {
            if !pinned.is_empty() {
                let cores: Vec<String> = pinned.iter().map(usize::to_string).collect();
                eprintln!("the server's worker threads are pinned to cores {}", cores.join(", "));
            }
            rt
        }
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let result = runtime.block_on(async {
        #[cfg(unix)]
        if let Some(reads_stdin) = helper_route(&cli.command) {
            match warm::keep_warm() {
                Err(failure) => return Err(failure),
                Ok(Some(idle)) => {
                    let args = std::env::args_os().skip(1).collect();
                    if let Some(outcome) = warm::run_in_helper(args, reads_stdin, idle).await {
                        return outcome;
                    }
                }
                Ok(None) => {}
            }
        }
        let (io, models) = (io::Io::terminal(), baton_runner::LocalModels::default());
        match cli.command {
            Command::Ask(args) => ask::run(args, &io, &models).await,
            Command::Plan(args) => plan_cmd::run(args, &io, &models).await,
            Command::Pool(cmd) => pool_cmd::run(cmd).await,
            Command::Bench(cmd) => bench::run(cmd).await,
            Command::History(args) => history_cmd::run(args).await,
            Command::Keys(cmd) => keys_cmd::run(cmd).await,
            Command::Models(cmd) => models_cmd::run(cmd).await,
            Command::Eval(args) => eval_cmd::run(args).await,
            Command::Serve(args) => serve_cmd::run(args).await,
            Command::Logs(LogsCommand::Path) => Ok(()),
            #[cfg(unix)]
            Command::KeepWarm { socket, idle_secs } => {
                warm::serve(socket, std::time::Duration::from_secs(idle_secs)).await
            }
            #[cfg(not(unix))]
            Command::KeepWarm { .. } => Err(Failure::BadInput("the warm helper runs on Unix only".into())),
        }
    });
    ExitCode::from(report(result, &io::Io::terminal()))
}

/// Whether the command would load a local model and so runs in the warm helper; if so, whether
/// it reads its standard input.
#[cfg(unix)]
fn helper_route(command: &Command) -> Option<bool> {
    match command {
        Command::Ask(args) => args.helper_route(),
        Command::Plan(args) => args.helper_route(),
        _ => None,
    }
}

/// Runs `ask` or `plan` (`args`: the command line after `baton`) for a client of the warm
/// helper, with the models it keeps; returns the exit code.
#[cfg(unix)]
pub async fn run_command(args: Vec<OsString>, io: &io::Io, models: &baton_runner::LocalModels) -> u8 {
    let cli = match Cli::try_parse_from(std::iter::once(OsString::from("baton")).chain(args)) {
        Ok(cli) => cli,
        Err(e) => {
            io.err(&e.render().to_string());
            return 2;
        }
    };
    let result = match cli.command {
        Command::Ask(args) => ask::run(args, io, models).await,
        Command::Plan(args) => plan_cmd::run(args, io, models).await,
        _ => Err(Failure::BadInput("the warm helper runs only `ask` and `plan`".into())),
    };
    report(result, io)
}

/// Says why a command failed, on `io`, and returns its exit code.
pub fn report(result: Outcome, io: &io::Io) -> u8 {
    // A command run in the warm helper ends as `Exited` with its code: the helper has logged
    // its failure, if it failed.
    if let Err(failure) = &result
        && !matches!(failure, Failure::Exited(_))
    {
        tracing::warn!("the command failed: {failure:?}");
    }
    match result {
        Ok(()) => 0,
        Err(Failure::BadInput(message)) => {
            io::errln!(io, "error: {message}");
            2
        }
        Err(Failure::Failed(message)) => {
            io::errln!(io, "error: {message}");
            1
        }
        Err(Failure::Interrupted) => {
            io::errln!(io, "interrupted");
            130
        }
        Err(Failure::Exited(code)) => code,
    }
}

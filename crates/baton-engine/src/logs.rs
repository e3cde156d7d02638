//! Baton's log, for a user reporting a problem: what runs did (started, retried, failed,
//! finished, with their figures), which models loaded and how long it took, what the app's
//! commands refused and why. `tracing` events from every crate (mistral.rs's included) go to a
//! file rotated daily in Baton's data directory; the last [`KEPT_FILES`] files are kept.
//!
//! Keys never reach it: nothing logs a request's headers, an `ApiKey` formats as `<redacted>`,
//! and a provider error that echoes the key has it cut out before it exists anywhere
//! (`HttpModel::stream`). The command-line leak test scans the log files for its canary key.

use std::path::PathBuf;

use tracing_subscriber::EnvFilter;

use crate::RunEvent;

/// Overrides where the logs go (tests keep them out of the user's data directory).
pub const LOG_DIR_ENV: &str = "BATON_LOG_DIR";
/// A `tracing` filter (`debug`, `baton_engine=debug,info`, …); the default is `info`.
pub const LOG_FILTER_ENV: &str = "BATON_LOG";
/// Daily files kept; older ones are deleted as new ones start.
pub const KEPT_FILES: usize = 7;

/// Where the log files are: `$BATON_LOG_DIR`, else `logs/` in Baton's data directory.
pub fn log_dir() -> PathBuf {
    match std::env::var_os(LOG_DIR_ENV).filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => dirs::data_dir().unwrap_or_else(std::env::temp_dir).join("baton").join("logs"),
    }
}

/// Keeps the log writer going; dropping it flushes what is buffered (hold it for the whole of
/// `main`).
#[derive(Debug)]
pub struct LogGuard {
    _writer: tracing_appender::non_blocking::WorkerGuard,
}

/// Why the log could not be started; the program goes on without one.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("{dir}: cannot write the log here ({cause}); set {LOG_DIR_ENV} to a writable directory")]
    Dir { dir: String, cause: String },
    #[error("{LOG_FILTER_ENV}: {0}")]
    Filter(String),
}

/// Sends `tracing` events to `<log dir>/<program>.<date>.log` from now on.
pub fn init(program: &str) -> Result<LogGuard, LogError> {
    let dir = log_dir();
    let dir_err = |cause: String| LogError::Dir { dir: dir.display().to_string(), cause };
    std::fs::create_dir_all(&dir).map_err(|e| dir_err(e.to_string()))?;
    let filter = match std::env::var(LOG_FILTER_ENV) {
        Ok(f) if !f.trim().is_empty() => EnvFilter::try_new(f).map_err(|e| LogError::Filter(e.to_string()))?,
        _ => EnvFilter::new("info"),
    };
    let file = tracing_appender::rolling::Builder::new()
        .rotation(tracing_appender::rolling::Rotation::DAILY)
        .filename_prefix(program)
        .filename_suffix("log")
        .max_log_files(KEPT_FILES)
        .build(&dir)
        .map_err(|e| dir_err(e.to_string()))?;
    // The log's thread writes all the lines waiting for it and then flushes: buffered, a burst
    // of lines (many runs starting at once on a server) is one write, not one per line.
    let (writer, guard) = tracing_appender::non_blocking(std::io::BufWriter::new(file));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(false)
        .try_init()
        .map_err(|e| dir_err(e.to_string()))?;
    tracing::info!(program, version = env!("CARGO_PKG_VERSION"), "started");
    Ok(LogGuard { _writer: guard })
}

/// Logs what a run did, one line per event that matters to someone reading about a problem
/// (not text deltas, not the texts themselves: those are in the history), each naming its run.
pub fn log_event(run: &str, event: &RunEvent) {
    match event {
        RunEvent::RunStarted { .. } => tracing::info!(run, "run started"),
        RunEvent::PlanReady { round, plan, .. } => {
            tracing::info!(run, round, steps = plan.steps.len(), "plan ready")
        }
        RunEvent::StepRetrying { round, step, attempt, error, delay_ms } => tracing::warn!(
            run,
            round,
            step,
            attempt,
            delay_ms,
            kind = ?error.kind,
            status = ?error.status,
            "step retrying: {}",
            error.message
        ),
        RunEvent::StepFailed { round, step, error } => tracing::warn!(
            run,
            round,
            step,
            kind = ?error.kind,
            status = ?error.status,
            "step failed: {}",
            error.message
        ),
        RunEvent::StepFinished { round, step, latency_ms, usage, .. } => tracing::info!(
            run,
            round,
            step,
            latency_ms,
            input_tokens = usage.input_tokens,
            output_tokens = usage.output_tokens,
            "step finished"
        ),
        RunEvent::RunFinished { totals, .. } => {
            tracing::info!(run, calls = totals.calls, "run finished: {}", totals.breakdown().join("; "))
        }
        RunEvent::RunFailed { error, totals } => tracing::warn!(
            run,
            kind = ?error.kind,
            calls = totals.calls,
            "run failed: {}",
            error.message
        ),
        RunEvent::RunCancelled { totals } => tracing::info!(run, calls = totals.calls, "run cancelled"),
        _ => {}
    }
}

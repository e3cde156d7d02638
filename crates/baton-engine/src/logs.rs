//! Baton's log, for a user reporting a problem: what runs did (started, retried, failed,
//! finished, with their figures), which models loaded and how long it took, what the app's
//! commands refused and why. `tracing` events from every crate (mistral.rs's included) go to a
//! file rotated daily in Baton's data directory; the last [`KEPT_FILES`] files are kept.
//!
//! Keys never reach it: nothing logs a request's headers, an `ApiKey` formats as `<redacted>`,
//! and a provider error that echoes the key has it cut out before it exists anywhere
//! (`HttpModel::stream`). The command-line leak test scans the log files for its canary key.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

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

/// Keeps the log writer going; dropping it writes out what is buffered (hold it for the whole
/// of `main`; a program that ends without returning from `main`, as a Tauri app does, calls
/// [`flush`] on its way out).
#[derive(Debug)]
pub struct LogGuard {
    shared: Arc<Shared>,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        {
            // Under the lock, so the log's thread cannot miss the wake-up between its check and
            // its wait.
            let _lines = self.shared.lines.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.closed.store(true, Ordering::Release);
            self.shared.wake.notify_one();
        }
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

/// How long the log's thread lets lines gather once one is waiting. A thread that woke for
/// every line (a channel's receiver) cost a server's busiest moments (runs that start or end
/// together, four lines each) more than the rest of their runs' own work; a line now costs its
/// thread a copy. A crash loses at most the lines of this last moment.
const GATHER: Duration = Duration::from_millis(50);
/// Lines waiting that make the log's thread write at once.
const WRITE_AT: usize = 64 * 1024;
/// Lines waiting past which new ones are dropped (the file cannot be written, say): the log
/// must not take the memory of the runs it tells of.
const MOST_WAITING: usize = 8 * 1024 * 1024;

/// The lines waiting, and the file they go to.
struct Shared {
    lines: Mutex<Vec<u8>>,
    wake: Condvar,
    closed: AtomicBool,
    /// Held while lines are taken and written, so that two writers keep their order.
    file: Mutex<Box<dyn std::io::Write + Send>>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("closed", &self.closed).finish_non_exhaustive()
    }
}

impl Shared {
    /// Writes out the lines waiting now.
    fn write_out(&self, spare: &mut Vec<u8>) {
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::swap(&mut *self.lines.lock().unwrap_or_else(|e| e.into_inner()), spare);
        if !spare.is_empty() {
            let _ = file.write_all(spare).and_then(|()| file.flush());
            spare.clear();
        }
    }
}

/// The log of this process, for [`flush`].
static LOG: std::sync::OnceLock<Arc<Shared>> = std::sync::OnceLock::new();

/// Writes out the lines logged so far, now: for a program about to end without dropping its
/// [`LogGuard`].
pub fn flush() {
    if let Some(shared) = LOG.get() {
        shared.write_out(&mut Vec::new());
    }
}

/// What `tracing` writes each formatted line to: the waiting lines.
#[derive(Debug)]
struct Lines(Arc<Shared>);

impl std::io::Write for &Lines {
    fn write(&mut self, line: &[u8]) -> std::io::Result<usize> {
        let mut lines = self.0.lines.lock().unwrap_or_else(|e| e.into_inner());
        let was_empty = lines.is_empty();
        if lines.len() + line.len() <= MOST_WAITING {
            lines.extend_from_slice(line);
        }
        // The first line of a batch wakes the log's thread, and so do many lines at once.
        if was_empty || lines.len() >= WRITE_AT {
            self.0.wake.notify_one();
        }
        Ok(line.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Lines {
    type Writer = &'a Lines;

    fn make_writer(&'a self) -> Self::Writer {
        self
    }
}

/// The log's thread: sleeps until a line waits, lets more gather for [`GATHER`] (less when many
/// wait), writes them out, and writes a last time when the guard goes.
fn write_lines(shared: &Shared) {
    let closed = || shared.closed.load(Ordering::Acquire);
    let mut spare = Vec::new();
    loop {
        {
            let lines = shared.lines.lock().unwrap_or_else(|e| e.into_inner());
            let lines = shared.wake.wait_while(lines, |l| l.is_empty() && !closed()).unwrap_or_else(|e| e.into_inner());
            let _ = shared
                .wake
                .wait_timeout_while(lines, GATHER, |l| l.len() < WRITE_AT && !closed())
                .unwrap_or_else(|e| e.into_inner());
        }
        // Read before the write: lines logged after the guard went up to this write are in it.
        let closing = closed();
        shared.write_out(&mut spare);
        if closing {
            return;
        }
    }
}

/// Starts the log's thread, writing to `file`; returns its guard and what lines go to.
fn start(file: Box<dyn std::io::Write + Send>) -> std::io::Result<(LogGuard, Lines)> {
    let shared = Arc::new(Shared {
        lines: Mutex::new(Vec::new()),
        wake: Condvar::new(),
        closed: AtomicBool::new(false),
        file: Mutex::new(file),
    });
    let writer = std::thread::Builder::new().name("baton-log".into()).spawn({
        let shared = shared.clone();
        move || write_lines(&shared)
    })?;
    Ok((LogGuard { shared: shared.clone(), writer: Some(writer) }, Lines(shared)))
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
    let (guard, lines) = start(Box::new(file)).map_err(|e| dir_err(e.to_string()))?;
    let _ = LOG.set(guard.shared.clone());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(lines)
        .with_ansi(false)
        .try_init()
        .map_err(|e| dir_err(e.to_string()))?;
    tracing::info!(program, version = env!("CARGO_PKG_VERSION"), "started");
    Ok(guard)
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

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    /// A file that the test can read while the log writes it.
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Sink {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    #[test]
    fn lines_reach_the_file_soon_in_order_and_all_of_them_when_the_log_ends() {
        let sink = Sink::default();
        let (guard, lines) = start(Box::new(sink.clone())).expect("the log starts");
        // A lone line is written without anyone asking (within the gathering time).
        (&lines).write_all(b"first\n").unwrap();
        let waited = std::time::Instant::now();
        while sink.text().is_empty() && waited.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(sink.text(), "first\n");
        // Writing out on demand (what a program ending without its guard does).
        (&lines).write_all(b"second\n").unwrap();
        guard.shared.write_out(&mut Vec::new());
        assert_eq!(sink.text(), "first\nsecond\n");
        // Many lines, more than one batch's worth, then the end: every one, in order.
        let many: Vec<String> = (0..5_000).map(|i| format!("line {i} {}\n", "x".repeat(40))).collect();
        for line in &many {
            (&lines).write_all(line.as_bytes()).unwrap();
        }
        drop(guard);
        assert_eq!(sink.text(), format!("first\nsecond\n{}", many.concat()));
    }
}

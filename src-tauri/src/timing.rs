//! A timing trace for benchmarks: with `BATON_TIMING_LOG=<file>` set, the shell appends one JSON
//! line per step when the step's first text leaves the engine:
//! `{"run": "<run id>", "round": 0, "step": 2, "first_delta_unix_ms": 1763740000123}`.
//! The end-to-end suite pairs it with the moment the webview painted that text, which gives the
//! token-to-paint figure. Off (and free) when the variable is unset.

use std::collections::HashSet;
use std::io::Write;
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use baton_engine::RunEvent;

pub const TIMING_LOG_VAR: &str = "BATON_TIMING_LOG";

#[derive(Debug)]
pub struct TimingLog {
    path: PathBuf,
    /// The run's id, from its `run_started` event.
    run: String,
    seen: HashSet<(u32, usize)>,
}

impl TimingLog {
    /// The trace for a run, if the environment asks for one.
    pub fn for_a_run() -> Option<TimingLog> {
        let path = std::env::var_os(TIMING_LOG_VAR)?;
        Some(TimingLog { path: path.into(), run: String::new(), seen: HashSet::new() })
    }

    /// Notes `event` as it leaves the engine (only a step's first delta is written).
    pub fn observe(&mut self, event: &RunEvent) {
        if let RunEvent::RunStarted { run_id, .. } = event {
            self.run.clone_from(run_id);
        }
        let RunEvent::StepDelta { round, step, .. } = event else { return };
        if !self.seen.insert((*round, *step)) {
            return;
        }
        let ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
        let line = format!(
            "{}\n",
            serde_json::json!({ "run": self.run, "round": round, "step": step, "first_delta_unix_ms": ms })
        );
        // A trace that cannot be written only loses the figure, never the run.
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(&self.path) {
            let _ = f.write_all(line.as_bytes());
        }
    }
}

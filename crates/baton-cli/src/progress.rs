//! Human-readable progress on stderr: the plan, then one line per step start, retry, finish or
//! failure, with elapsed time, so a fan-out is visibly concurrent.

use std::io::{IsTerminal, Write};
use std::time::Instant;

use baton_engine::{RunEvent, Totals};
use baton_plan::Access;

pub struct Progress {
    names: Vec<String>,
    /// Worker index per step, from the plan.
    step_workers: Vec<usize>,
    started: Instant,
    color: bool,
}

impl Progress {
    pub fn new(names: Vec<String>) -> Self {
        let color = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
        Progress { names, step_workers: Vec::new(), started: Instant::now(), color }
    }

    fn paint(&self, code: &str, text: &str) -> String {
        if self.color { format!("\x1b[{code}m{text}\x1b[0m") } else { text.to_owned() }
    }

    fn worker(&self, step: usize) -> &str {
        self.step_workers.get(step).and_then(|&w| self.names.get(w)).map_or("?", String::as_str)
    }

    fn line(&self, text: String) {
        let t = format!("{:>7.2}s", self.started.elapsed().as_secs_f64());
        let mut err = std::io::stderr().lock();
        let _ = writeln!(err, "{} {text}", self.paint("2", &t));
    }

    pub fn show(&mut self, event: &RunEvent) {
        match event {
            RunEvent::RunStarted { .. } | RunEvent::StepDelta { .. } => {}
            RunEvent::PlanReady { plan } => {
                self.step_workers = plan.steps.iter().map(|s| s.model_id).collect();
                let mut err = std::io::stderr().lock();
                let _ = writeln!(err, "{}", self.paint("1", &format!("plan: {} steps", plan.steps.len())));
                for (i, step) in plan.steps.iter().enumerate() {
                    let sees = match &step.access {
                        Access::All if i == 0 => "sees nothing".to_owned(),
                        Access::All => "sees all earlier".to_owned(),
                        Access::Steps(v) if v.is_empty() => "sees nothing".to_owned(),
                        Access::Steps(v) => {
                            format!("sees {}", v.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "))
                        }
                    };
                    let subtask: String = step.subtask.replace('\n', " ").chars().take(60).collect();
                    let _ = writeln!(err, "  [{i}] {:<12} {subtask}  ({sees})", self.worker(i));
                }
            }
            RunEvent::StepStarted { step, .. } => {
                self.line(format!("step {step} started    {}", self.worker(*step)));
            }
            RunEvent::StepRetrying { step, attempt, error, delay_ms } => {
                let msg = format!(
                    "step {step} retrying   {} after attempt {attempt}: {} ({:?}); waiting {delay_ms} ms",
                    self.worker(*step),
                    error.message,
                    error.kind
                );
                self.line(self.paint("33", &msg));
            }
            RunEvent::StepFinished { step, usage, cost_usd, latency_ms, retries, .. } => {
                let cost = cost_usd.map_or_else(|| "$?".to_owned(), |c| format!("${c:.4}"));
                let retries = if *retries > 0 { format!(", {retries} retries") } else { String::new() };
                let msg = format!(
                    "step {step} finished   {}  {latency_ms} ms, {} in / {} out tokens, {cost}{retries}",
                    self.worker(*step),
                    usage.input_tokens,
                    usage.output_tokens
                );
                self.line(self.paint("32", &msg));
            }
            RunEvent::StepFailed { step, error } => {
                let msg = format!("step {step} failed     {}  {:?}: {}", self.worker(*step), error.kind, error.message);
                self.line(self.paint("31", &msg));
            }
            RunEvent::RunFinished { totals, .. } => self.summary("done", totals),
            RunEvent::RunFailed { error, totals } => {
                self.line(self.paint("31", &format!("run failed: {}", error.message)));
                self.summary("stopped", totals);
            }
            RunEvent::RunCancelled { totals } => self.summary("cancelled", totals),
        }
    }

    fn summary(&self, what: &str, t: &Totals) {
        let cost = if t.cost_complete {
            format!("${:.4}", t.cost_usd)
        } else {
            format!("≥ ${:.4} (some prices unknown)", t.cost_usd)
        };
        let msg = format!(
            "{what} in {:.2} s · {} calls · {} in / {} out tokens · {cost}",
            t.wall_ms as f64 / 1000.0,
            t.calls,
            t.usage.input_tokens,
            t.usage.output_tokens
        );
        self.line(self.paint("1", &msg));
    }
}

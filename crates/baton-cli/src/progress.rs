//! Human-readable progress on stderr: the plan, then one line per step start, retry, finish or
//! failure, with elapsed time, so a fan-out is visibly concurrent.

use std::time::Instant;

use baton_engine::{RunEvent, RunProgress, Totals};
use baton_plan::Access;

use crate::io::{Io, errln};

pub struct Progress {
    names: Vec<String>,
    /// The run so far, as the engine folds its events.
    run: RunProgress,
    started: Instant,
    color: bool,
    /// The conductor's text is being echoed and the line is still open.
    streaming_plan: bool,
    io: Io,
}

impl Progress {
    pub fn new(names: Vec<String>, io: Io) -> Self {
        Progress {
            names,
            run: RunProgress::default(),
            started: Instant::now(),
            color: io.color,
            streaming_plan: false,
            io,
        }
    }

    fn paint(&self, code: &str, text: &str) -> String {
        if self.color { format!("\x1b[{code}m{text}\x1b[0m") } else { text.to_owned() }
    }

    fn worker(&self, round: u32, step: usize) -> &str {
        match self.run.worker_of(round, step) {
            Some(w) if w == self.names.len() => "conductor",
            Some(w) => self.names.get(w).map_or("?", String::as_str),
            None => "?",
        }
    }

    /// "step 2", or "r1 step 2" inside a recursive round.
    fn label(round: u32, step: usize) -> String {
        if round == 0 { format!("step {step}") } else { format!("r{round} step {step}") }
    }

    fn end_plan_stream(&mut self) {
        if self.streaming_plan {
            self.streaming_plan = false;
            self.io.err("\n");
        }
    }

    fn line(&self, text: String) {
        let t = format!("{:>7.2}s", self.started.elapsed().as_secs_f64());
        errln!(self.io, "{} {text}", self.paint("2", &t));
    }

    pub fn show(&mut self, event: &RunEvent) {
        self.run.see(event);
        if !matches!(event, RunEvent::PlanDelta { .. }) {
            self.end_plan_stream();
        }
        match event {
            RunEvent::RunStarted { conductor: Some(c), .. } => self.line(format!("conductor: {c}")),
            RunEvent::RunStarted { .. } | RunEvent::StepDelta { .. } => {}
            RunEvent::PlanStarted { round, depth, parent } => {
                let what = match parent {
                    Some(p) => format!(
                        "round {round} (depth {depth}, for {}): the conductor is planning",
                        Self::label(p.round, p.step)
                    ),
                    None => "the conductor is planning".to_owned(),
                };
                self.line(self.paint("2", &what));
            }
            RunEvent::PlanDelta { text, .. } => {
                self.streaming_plan = true;
                self.io.err(&self.paint("2", text));
            }
            RunEvent::PlanRejected { reason, retry, .. } => {
                let next = if *retry { "asking the conductor again" } else { "falling back" };
                self.line(self.paint("33", &format!("plan rejected: {reason}; {next}")));
            }
            RunEvent::PlanReady { round, plan, fallback, .. } => {
                match fallback {
                    Some(why) if baton_engine::routing::is_routed(why) => self.line(why.clone()),
                    Some(why) => self.line(self.paint("33", &format!("fallback: {why}"))),
                    None => {}
                }
                let title = match (round, plan.is_stop()) {
                    (_, true) => format!("round {round}: the conductor stops here"),
                    (0, false) => format!("plan: {} steps", plan.steps.len()),
                    (r, false) => format!("round {r} plan: {} steps", plan.steps.len()),
                };
                let mut lines = vec![self.paint("1", &title)];
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
                    lines.push(format!("  [{i}] {:<12} {subtask}  ({sees})", self.worker(*round, i)));
                }
                lines.push(String::new());
                self.io.err(&lines.join("\n"));
            }
            RunEvent::StepStarted { round, step, .. } => {
                let label = Self::label(*round, *step);
                self.line(format!("{label} started    {}", self.worker(*round, *step)));
            }
            RunEvent::StepRetrying { round, step, attempt, error, delay_ms } => {
                let msg = format!(
                    "{} retrying   {} after attempt {attempt}: {} ({:?}); waiting {delay_ms} ms",
                    Self::label(*round, *step),
                    self.worker(*round, *step),
                    error.message,
                    error.kind
                );
                self.line(self.paint("33", &msg));
            }
            RunEvent::StepFinished { round, step, usage, cost_usd, latency_ms, retries, .. } => {
                let cost = cost_usd.map_or_else(|| "$?".to_owned(), |c| format!("${c:.4}"));
                let retries = if *retries > 0 { format!(", {retries} retries") } else { String::new() };
                let cached = if usage.cached_input_tokens > 0 {
                    format!(" ({} cached)", usage.cached_input_tokens)
                } else {
                    String::new()
                };
                let msg = format!(
                    "{} finished   {}  {latency_ms} ms, {} in{cached} / {} out tokens, {cost}{retries}",
                    Self::label(*round, *step),
                    self.worker(*round, *step),
                    usage.input_tokens,
                    usage.output_tokens
                );
                self.line(self.paint("32", &msg));
            }
            RunEvent::StepReused { round, step, from_run, .. } => {
                let label = Self::label(*round, *step);
                self.line(format!("{label} kept       {}  output of run {from_run}", self.worker(*round, *step)));
            }
            RunEvent::StepFailed { round, step, error } => {
                let msg = format!(
                    "{} failed     {}  {:?}: {}",
                    Self::label(*round, *step),
                    self.worker(*round, *step),
                    error.kind,
                    error.message
                );
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

    /// The engine's own lines for the figures (`Totals::breakdown`), so every surface shows
    /// the same: the whole run, the conductor's share, the workers', and unknown prices.
    fn summary(&self, what: &str, t: &Totals) {
        self.line(self.paint("1", &format!("{what} in {:.2} s", t.wall_ms as f64 / 1000.0)));
        for line in t.breakdown() {
            self.line(format!("  {line}"));
        }
    }
}

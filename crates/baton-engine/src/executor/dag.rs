//! A round's plan as a DAG: each step starts once every step it sees has finished (or keeps a
//! re-run's output instead of running), a failed step fails the steps that see it, and a step
//! given to the conductor opens a recursive round whose answer becomes its output.

use std::sync::atomic::Ordering;
use std::time::Instant;

use baton_plan::Plan;
use baton_providers::{Message, Role};
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;

use super::planning::Written;
use super::step::{StepDone, StepFailure};
use super::{Executor, RunCtx};
use crate::event::{RunError, RunErrorKind, RunEvent, StepErrorKind, StepRef};
use crate::rerun::Reuse;

#[derive(Debug, Clone, PartialEq)]
enum State {
    Waiting,
    Running,
    Done(String),
    Failed,
}

pub(super) enum RoundError {
    Stopped,
    Failed(String),
}

pub(super) struct RoundOutcome {
    pub(super) result: Result<String, RoundError>,
    pub(super) finished: Vec<usize>,
    pub(super) failed: Vec<usize>,
}

impl Executor {
    /// Runs one round's plan. `prefix` is context every step of the round sees first (the work
    /// handed to a recursive round); steps with an output in `reuse` keep it and are not run.
    pub(super) fn run_plan<'a>(
        &'a self,
        ctx: &'a RunCtx<'a>,
        round: u32,
        depth: u32,
        plan: Plan,
        prefix: Vec<Message>,
        reuse: Option<&'a Reuse>,
    ) -> BoxFuture<'a, RoundOutcome> {
        Box::pin(async move {
            let n = plan.steps.len();
            let deps = plan.dependencies();
            let mut states: Vec<State> = vec![State::Waiting; n];
            let mut running: FuturesUnordered<BoxFuture<'a, (usize, Result<StepDone, StepFailure>)>> =
                FuturesUnordered::new();
            let mut stopping = false;

            loop {
                if !stopping {
                    // Fail what can no longer run; start what is ready. Steps only see earlier
                    // steps, so one pass in order settles everything.
                    for i in 0..n {
                        if states[i] != State::Waiting {
                            continue;
                        }
                        if let Some(&j) = deps[i].iter().find(|&&j| matches!(states[j], State::Failed)) {
                            states[i] = State::Failed;
                            ctx.step_failed(
                                round,
                                i,
                                StepErrorKind::DependencyFailed,
                                format!("step {j}, which this step sees, failed"),
                                None,
                            );
                            continue;
                        }
                        if !deps[i].iter().all(|&j| matches!(states[j], State::Done(_))) {
                            continue;
                        }
                        if let Some(reuse) = reuse
                            && let Some(output) = reuse.outputs.get(&i)
                        {
                            ctx.emit(RunEvent::StepReused {
                                round,
                                step: i,
                                worker: plan.steps[i].model_id,
                                output: output.clone(),
                                from_run: reuse.from_run.clone(),
                            });
                            states[i] = State::Done(output.clone());
                            continue;
                        }
                        if ctx.steps_started.fetch_add(1, Ordering::SeqCst) >= ctx.step_cap.load(Ordering::SeqCst) {
                            states[i] = State::Failed;
                            let cap = ctx.step_cap.load(Ordering::SeqCst);
                            ctx.step_failed(
                                round,
                                i,
                                StepErrorKind::RecursionLimit,
                                format!("the run's cap of {cap} steps is used up"),
                                None,
                            );
                            continue;
                        }
                        let seen: Vec<(usize, &str)> = deps[i]
                            .iter()
                            .filter_map(|&j| match &states[j] {
                                State::Done(output) => Some((j, output.as_str())),
                                _ => None,
                            })
                            .collect();
                        let (system, messages) = self.step_conversation(ctx, &plan, i, depth, &prefix, &seen);
                        let answers = i + 1 == n;
                        let worker = plan.steps[i].model_id;
                        states[i] = State::Running;
                        if worker == self.workers.len() {
                            running.push(Box::pin(self.run_recursive_step(ctx, round, i, depth, messages)));
                        } else {
                            let at = StepRef { round, step: i };
                            running.push(Box::pin(self.run_step(ctx, at, worker, system, messages, answers)));
                        }
                    }
                }
                let Some((i, result)) = running.next().await else { break };
                match result {
                    Ok(done) => {
                        ctx.emit(RunEvent::StepFinished {
                            round,
                            step: i,
                            output: done.output.clone(),
                            usage: done.usage,
                            cost_usd: done.cost_usd,
                            latency_ms: done.latency.as_millis() as u64,
                            retries: done.retries,
                        });
                        states[i] = State::Done(done.output);
                    }
                    Err(failure) => {
                        states[i] = State::Failed;
                        let (kind, status) = match &failure {
                            StepFailure::Provider(e) => (e.kind.into(), e.status),
                            StepFailure::Stopped => (StepErrorKind::Cancelled, None),
                            StepFailure::Budget(_) => (StepErrorKind::Budget, None),
                            StepFailure::Conductor(_) => (StepErrorKind::Conductor, None),
                            StepFailure::RecursionLimit(_) => (StepErrorKind::RecursionLimit, None),
                        };
                        let message = match &failure {
                            StepFailure::Stopped => ctx.stop_message(),
                            other => other.message(),
                        };
                        if let StepFailure::Budget(message) = &failure {
                            ctx.exhaust(RunError { kind: RunErrorKind::BudgetExceeded, message: message.clone() });
                        }
                        ctx.step_failed(round, i, kind, message, status);
                    }
                }
                // Once stopping, no new step starts. On a cancel, the steps in flight notice the
                // stop token and finish promptly with their own StepFailed; once the budget is
                // used up, calls in flight (which fit when they were made, and which providers
                // bill whether or not their answer is read) finish, and nothing new starts.
                stopping |= ctx.stop.is_cancelled() || ctx.is_exhausted();
            }

            let finished =
                states.iter().enumerate().filter(|(_, s)| matches!(s, State::Done(_))).map(|(i, _)| i).collect();
            let failed = states.iter().enumerate().filter(|(_, s)| **s == State::Failed).map(|(i, _)| i).collect();
            let result = if stopping || ctx.stop.is_cancelled() {
                Err(RoundError::Stopped)
            } else {
                match states.last() {
                    Some(State::Done(answer)) => Ok(answer.clone()),
                    _ => {
                        let last = n.saturating_sub(1);
                        let worker = plan.steps.get(last).map_or(0, |s| s.model_id);
                        let name = self.workers.get(worker).map_or("the conductor", |w| w.info.name.as_str());
                        Err(RoundError::Failed(format!(
                            "the last step (step {last}, worker \"{name}\") failed; failed steps: {failed:?}"
                        )))
                    }
                }
            };
            RoundOutcome { result, finished, failed }
        })
    }

    /// A step given to the conductor itself: it sees the step's work and writes a new round,
    /// whose answer becomes this step's output, or stops, keeping the latest answer it saw.
    async fn run_recursive_step(
        &self,
        ctx: &RunCtx<'_>,
        round: u32,
        step: usize,
        depth: u32,
        messages: Vec<Message>,
    ) -> (usize, Result<StepDone, StepFailure>) {
        ctx.emit(RunEvent::StepStarted {
            round,
            step,
            worker: self.workers.len(),
            system: None,
            messages: messages.clone(),
        });
        let started = Instant::now();
        if depth >= self.options.recursion.max_depth {
            let cap = self.options.recursion.max_depth;
            return (step, Err(StepFailure::RecursionLimit(format!("the recursion depth cap ({cap}) is reached"))));
        }
        // The step's own instruction was for the conductor; the work before it is what the
        // conductor and the next round's workers see.
        let work: Vec<Message> = messages[..messages.len().saturating_sub(1)].to_vec();
        let parent = Some(StepRef { round, step });
        let Written { round: inner_round, plan, spent } =
            match self.write_plan(ctx, depth + 1, parent, messages.clone()).await {
                Ok(written) => written,
                Err(failure) => return (step, Err(failure)),
            };
        let output = if plan.is_stop() {
            match work.iter().rev().find(|m| m.role == Role::Assistant) {
                Some(latest) => latest.content.clone(),
                None => {
                    return (
                        step,
                        Err(StepFailure::Conductor("the conductor stopped with no earlier answer to keep".into())),
                    );
                }
            }
        } else {
            match self.run_plan(ctx, inner_round, depth + 1, plan, work, None).await.result {
                Ok(answer) => answer,
                Err(RoundError::Stopped) => return (step, Err(StepFailure::Stopped)),
                Err(RoundError::Failed(message)) => {
                    return (step, Err(StepFailure::Conductor(format!("round {inner_round} failed: {message}"))));
                }
            }
        };
        // The step's own figures are the conductor's call that wrote its round; the round's
        // steps report theirs.
        let done =
            StepDone { output, usage: spent.usage, cost_usd: spent.cost(), latency: started.elapsed(), retries: 0 };
        (step, Ok(done))
    }
}

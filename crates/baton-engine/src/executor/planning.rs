//! The plan for each round: a client's own plan for the question, checked against the pool, or
//! the conductor's. For the question's plan the conductor's work is checked and, with the
//! fallback on, asked for again or replaced by one worker alone; [`Executor::draft`] asks for
//! the question's plan the same way for review, without running it.

use std::sync::atomic::Ordering;

use baton_plan::{Limits, Plan};
use baton_providers::Message;
use tokio_util::sync::CancellationToken;

use super::step::StepFailure;
use super::{Executor, RunCtx};
use crate::accounting::{Budget, Figures, Hold, Ledger, Meter};
use crate::event::{RunError, RunErrorKind, RunEvent, StepRef};
use crate::planner::{PlanDeltas, Planned, PlannerError, PlanningContext, ShownExample};
use crate::rerun::Reuse;

/// A plan the conductor wrote, and what writing it cost.
pub(super) struct Written {
    pub(super) round: u32,
    pub(super) plan: Plan,
    /// The conductor's tokens and dollars for it, every attempt included.
    pub(super) spent: Figures,
}

/// Why a run has no plan for its question; the run ends here.
pub(super) enum NoPlan {
    /// The run was stopped while the conductor wrote.
    Stopped,
    Failed(RunError),
}

impl Executor {
    /// Drafts the question's plan for review, without running it. The conductor is asked
    /// exactly as a run with no plan asks it for the question's round (the same
    /// [`PlanningContext`]: the lead worker for the question, whether the plan may give steps
    /// to the conductor, the pool's `max_steps`, the conversation so far), and its plan is held
    /// to the limits that round holds it to. The conductor's text streams to `deltas` as it is
    /// written.
    ///
    /// Unlike a run, a draft sends no events, asks no second time and never falls back to one
    /// worker: the reviewer sees the conductor's own plan, or why there is none. It has no
    /// client instructions (a run without them is asked the same). Where what the pool learned
    /// routes the question to one worker, as a run would, the draft is that worker alone, with
    /// no conductor call, and `Planned::routed` says why.
    ///
    /// A draft is not a run: no budget caps it (the run that follows has its own). Cancelling
    /// `cancel` stops generation at once; the error then says the plan was stopped, and
    /// `cancel.is_cancelled()` tells a stop from a failure.
    pub async fn draft(
        &self,
        question: &str,
        history: Vec<Message>,
        deltas: PlanDeltas<'_>,
        cancel: &CancellationToken,
    ) -> Result<Planned, PlannerError> {
        if let Some((routed, why)) =
            crate::routing::route(&self.options.fallback, &self.learned, self.workers.len(), question)
        {
            let plan = routed.plan(&history, question);
            return Ok(Planned { routed: Some(why), ..Planned::bare(String::new(), plan) });
        }
        let Some(planner) = &self.planner else {
            return Err(PlannerError::new("no conductor is configured to write a plan"));
        };
        let context = self.question_context(question, history, None);
        let limits = context.limits();
        let ledger = Ledger::new(Budget::default());
        let meter = Meter { ledger: &ledger, stop: cancel };
        // Dropping the planner's future stops generation (local and remote alike).
        let planned = tokio::select! {
            biased;
            () = cancel.cancelled() => return Err(PlannerError::new("the plan was not finished: stopped")),
            planned = planner.plan(context, deltas, meter) => planned,
        };
        let planned = planned?;
        // The conductor should only produce valid plans; the run's round checks anyway, and so
        // does its draft.
        if let Err(e) = planned.plan.validate(&limits) {
            return Err(PlannerError::new(format!("the conductor's plan is not usable: {e}")));
        }
        Ok(planned)
    }

    /// The question's round: `plan`, when the client gave one (a reviewed draft, a re-run's
    /// edited plan), else the conductor's. Returns the round number and the plan.
    pub(super) async fn question_plan(
        &self,
        ctx: &RunCtx<'_>,
        plan: Option<Plan>,
        reuse: &Reuse,
    ) -> Result<(u32, Plan), NoPlan> {
        match plan {
            Some(plan) => self.given_plan(ctx, plan, reuse),
            None if !reuse.outputs.is_empty() => {
                let message = "a re-run needs the plan it re-runs".to_owned();
                Err(NoPlan::Failed(RunError { kind: RunErrorKind::InvalidPlan, message }))
            }
            None => match self.write_plan(ctx, 0, None, Vec::new()).await {
                Ok(written) => Ok((written.round, written.plan)),
                Err(StepFailure::Stopped) => Err(NoPlan::Stopped),
                Err(failure) => {
                    let kind = match failure {
                        StepFailure::Budget(_) => RunErrorKind::BudgetExceeded,
                        _ => RunErrorKind::Conductor,
                    };
                    Err(NoPlan::Failed(RunError { kind, message: failure.message() }))
                }
            },
        }
    }

    /// The client's plan for the question's round, checked against the pool and against what
    /// `reuse` keeps; emits its `PlanReady`.
    fn given_plan(&self, ctx: &RunCtx<'_>, plan: Plan, reuse: &Reuse) -> Result<(u32, Plan), NoPlan> {
        // A re-run may keep the output of a step the conductor ran, even when there is
        // no conductor (or no recursion) now; only steps that run need one.
        let conductor = self.workers.len();
        let conductor_kept = plan.steps.iter().any(|s| s.model_id == conductor) && !reuse.runs_worker(&plan, conductor);
        let limits = Limits {
            max_steps: self.options.max_steps,
            pool_size: Some(self.plan_pool_size().max(conductor + usize::from(conductor_kept))),
            allow_stop: false,
        };
        if let Err(message) = plan.validate(&limits).map_err(|e| e.to_string()).and_then(|()| reuse.check(&plan)) {
            return Err(NoPlan::Failed(RunError { kind: RunErrorKind::InvalidPlan, message }));
        }
        let round = ctx.rounds.fetch_add(1, Ordering::SeqCst);
        ctx.emit(RunEvent::given_plan(round, 0, None, plan.clone()));
        Ok((round, plan))
    }

    /// What the conductor is asked for the question's plan (depth 0). A run's rounds and a
    /// draft all start from here, so a draft is asked what the run would ask.
    fn question_context(&self, question: &str, history: Vec<Message>, instructions: Option<String>) -> PlanningContext {
        PlanningContext {
            question: question.to_owned(),
            history,
            instructions,
            lead: self.fallback_worker(question).0,
            work: Vec::new(),
            depth: 0,
            allow_self: self.allows_self(0),
            allow_stop: false,
            max_steps: self.options.max_steps,
            pool_size: self.workers.len(),
            attempt: 0,
        }
    }

    /// Whether a plan written at `depth` may give a step to the conductor itself: on recursive
    /// pools, while the depth cap leaves room for another round.
    fn allows_self(&self, depth: u32) -> bool {
        self.recursive() && depth < self.options.recursion.max_depth
    }

    /// Asks the conductor for a plan; emits the round's plan events. Returns the round number.
    ///
    /// For the question's plan (depth 0), with the fallback on: a plan that fails, loops,
    /// copies an example or keeps the question from the workers is asked for once more (the
    /// conductor writes the second attempt differently), and if that one is no better, or the
    /// run's caps leave no room for an attempt, the question goes to one worker alone (see
    /// [`crate::plan_check`] and [`crate::fallback`]). Each rejected attempt is reported with
    /// `PlanRejected`; the plan that runs instead says why in `PlanReady::fallback`.
    ///
    /// Under caps, the room of that one worker's answer is held while the conductor writes,
    /// so the fallback can always answer; a run whose caps cannot afford even that answer is
    /// refused before the conductor spends anything.
    pub(super) async fn write_plan(
        &self,
        ctx: &RunCtx<'_>,
        depth: u32,
        parent: Option<StepRef>,
        work: Vec<Message>,
    ) -> Result<Written, StepFailure> {
        // What the pool learned may name the worker (or the workflow) for this kind of
        // question; then no plan is written (a plan costs seconds to minutes on a CPU). Only for the question's round.
        if depth == 0
            && let Some((routed, why)) =
                crate::routing::route(&self.options.fallback, &self.learned, self.workers.len(), &ctx.question)
        {
            let round = ctx.rounds.fetch_add(1, Ordering::SeqCst);
            let plan = routed.plan(&ctx.history, &ctx.question);
            let mut ready = RunEvent::given_plan(round, depth, parent, plan.clone());
            if let RunEvent::PlanReady { fallback, .. } = &mut ready {
                *fallback = Some(why);
            }
            ctx.emit(ready);
            return Ok(Written { round, plan, spent: Figures::default() });
        }
        let Some(planner) = &self.planner else {
            return Err(StepFailure::Conductor("no conductor is configured to write a plan".into()));
        };
        let checked = depth == 0 && self.options.fallback.enabled;
        // Dropped when this round's plan is chosen: the fallback's call then reserves as any.
        let _fallback_room = if checked && ctx.ledger.capped() { Some(self.hold_fallback(ctx).await?) } else { None };
        let round = ctx.rounds.fetch_add(1, Ordering::SeqCst);
        ctx.emit(RunEvent::PlanStarted { round, depth, parent });
        let recursive_round = parent.is_some();
        let remaining = ctx.step_cap.load(Ordering::SeqCst).saturating_sub(ctx.steps_started.load(Ordering::SeqCst));
        let max_steps = if recursive_round { self.options.max_steps.min(remaining) } else { self.options.max_steps };
        let mut context = PlanningContext {
            work,
            depth,
            allow_self: self.allows_self(depth),
            allow_stop: recursive_round,
            max_steps,
            ..self.question_context(&ctx.question, ctx.history.clone(), ctx.instructions.clone())
        };
        let limits = context.limits();
        let mut spent = Figures::default();
        let mut reasons: Vec<String> = Vec::new();
        // Every example shown in this round's attempts: a second attempt that names what only
        // the first one's examples had is no more about the question than the first.
        let mut shown: Vec<ShownExample> = Vec::new();
        loop {
            let events = ctx.events;
            let deltas = Box::new(move |text: &str| {
                let _ = events.send(RunEvent::PlanDelta { round, text: text.to_owned() });
            });
            let meter = Meter { ledger: &ctx.ledger, stop: &ctx.stop };
            let planned = tokio::select! {
                biased;
                () = ctx.stop.cancelled() => return Err(StepFailure::Stopped),
                planned = planner.plan(context.clone(), deltas, meter) => planned,
            };
            // Why this attempt cannot run. An attempt the caps refuse leaves the fallback, whose
            // room is held, to answer; without the fallback, the run ends there.
            let timed_out = matches!(&planned, Err(e) if e.timed_out);
            let (problem, raw, prompt) = match planned {
                Err(e) if e.budget && checked => {
                    let which = if context.attempt > 0 { "a second plan" } else { "a plan" };
                    reasons.push(format!("{which} did not fit under the run's caps: {}", e.message));
                    break;
                }
                Err(e) if e.budget => return Err(StepFailure::Budget(e.message)),
                Err(e) => {
                    if !checked {
                        return Err(StepFailure::Conductor(format!("the conductor failed: {}", e.message)));
                    }
                    (format!("the conductor failed: {}", e.message), None, None)
                }
                Ok(planned) => {
                    spent.add(planned.usage, planned.cost_usd);
                    shown.extend(planned.examples.iter().cloned());
                    // The conductor should only produce valid plans; check anyway, against this round.
                    let problem = match planned.plan.validate(&limits) {
                        Err(e) => Some(format!("the conductor's plan is not usable: {e}")),
                        Ok(()) if checked => {
                            let pool_gives_it = self.options.show_question || self.options.question_to_answer_step;
                            crate::plan_check::check(&planned.plan, &shown, &ctx.question, pool_gives_it)
                                .map(|u| u.to_string())
                        }
                        Ok(()) => None,
                    };
                    match problem {
                        None => {
                            ctx.emit(RunEvent::PlanReady {
                                round,
                                depth,
                                parent,
                                plan: planned.plan.clone(),
                                raw: Some(planned.raw),
                                usage: Some(spent.usage),
                                cost_usd: spent.cost(),
                                stop_reason: planned.stop_reason,
                                prompt: planned.prompt,
                                fallback: None,
                            });
                            return Ok(Written { round, plan: planned.plan, spent });
                        }
                        Some(p) if !checked => return Err(StepFailure::Conductor(p)),
                        Some(p) => (p, Some(planned.raw), planned.prompt),
                    }
                }
            };
            // Only a time limit is not worth a second attempt: it would take as long again.
            let again = context.attempt == 0 && !timed_out;
            ctx.emit(RunEvent::PlanRejected { round, reason: problem.clone(), raw, prompt, retry: again });
            reasons.push(problem);
            if again {
                context.attempt += 1;
                continue;
            }
            break;
        }
        let (worker, why) = self.fallback_worker(&ctx.question);
        let plan = crate::fallback::alone_plan(worker, &ctx.history, &ctx.question);
        let reason = format!(
            "{}; the question went to {} alone{}",
            reasons.join("; then "),
            self.workers.get(worker).map_or("the first worker", |w| w.info.name.as_str()),
            why.map(|w| format!(" ({w})")).unwrap_or_default()
        );
        ctx.emit(RunEvent::PlanReady {
            round,
            depth,
            parent,
            plan: plan.clone(),
            raw: None,
            usage: Some(spent.usage),
            cost_usd: spent.cost(),
            stop_reason: None,
            prompt: None,
            fallback: Some(reason),
        });
        Ok(Written { round, plan, spent })
    }

    /// The worker that answers `question` alone when no plan can be used, and why that one.
    fn fallback_worker(&self, question: &str) -> (usize, Option<String>) {
        crate::fallback::fallback_worker(&self.options.fallback, &self.learned, self.workers.len(), question)
    }

    /// Holds the room of the fallback's call (the question to one worker alone, its request
    /// built as the step would build it), or refuses the run when even that cannot fit.
    async fn hold_fallback<'c>(&self, ctx: &'c RunCtx<'_>) -> Result<Hold<'c>, StepFailure> {
        let (worker, _) = self.fallback_worker(&ctx.question);
        let plan = crate::fallback::alone_plan(worker, &ctx.history, &ctx.question);
        let (system, messages) = self.step_conversation(ctx, &plan, 0, 0, &[], &[]);
        let (_, worst, _) = self.step_request(ctx, worker, system, messages, true).await;
        let name = &self.workers[worker].info.name;
        ctx.ledger.hold(name, worst).map_err(|e| {
            StepFailure::Budget(format!(
                "{}; not even the question to one worker alone ({name}) fits, so the conductor was not asked. Raise the cap, or give {name} a lower max_tokens",
                e.message
            ))
        })
    }
}

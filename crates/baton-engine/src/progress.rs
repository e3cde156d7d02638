//! [`RunProgress`]: what a run's events have said so far about its shape. The command line's
//! progress lines and the server's reasoning text and `baton` object are drawn from this one
//! fold; the UI's topology keeps its own in TypeScript, tested against the same recorded runs.

use std::collections::BTreeMap;

use baton_plan::Plan;

use crate::event::{RunEvent, StepErrorKind};

/// A round's plan as it was about to run.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundPlan {
    pub round: u32,
    pub plan: Plan,
    /// Why the question's plan was replaced by one worker alone, if it was.
    pub fallback: Option<String>,
}

/// Where a started step is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepStatus {
    Running,
    Finished,
    Failed,
}

/// A step that started, in the order steps started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepState {
    pub round: u32,
    pub step: usize,
    /// Index of the worker in the pool; the pool's size means the conductor itself.
    pub worker: usize,
    pub status: StepStatus,
}

/// The fold of a run's events (see the module doc). Feed it every event with [`RunProgress::see`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunProgress {
    plans: Vec<RoundPlan>,
    steps: Vec<StepState>,
    /// Worker per step of each round, from the plans.
    workers: BTreeMap<u32, Vec<usize>>,
    answer_step: Option<(u32, usize)>,
    answer_worker: Option<usize>,
    fallback: Option<String>,
    answer_error: Option<StepErrorKind>,
}

impl RunProgress {
    /// Takes in the run's next event.
    pub fn see(&mut self, event: &RunEvent) {
        match event {
            RunEvent::PlanReady { round, parent, plan, fallback, .. } => {
                // The answer is written by the question's plan's last step, or, when that step
                // handed the work back to the conductor, by the last step of the round it opened.
                let continues = parent.is_some_and(|p| Some((p.round, p.step)) == self.answer_step);
                if let (true, Some(last)) = (*round == 0 || continues, plan.steps.len().checked_sub(1)) {
                    self.answer_step = Some((*round, last));
                    self.answer_worker = Some(plan.steps[last].model_id);
                }
                if fallback.is_some() {
                    self.fallback = fallback.clone();
                }
                self.workers.insert(*round, plan.steps.iter().map(|s| s.model_id).collect());
                self.plans.push(RoundPlan { round: *round, plan: plan.clone(), fallback: fallback.clone() });
            }
            RunEvent::StepStarted { round, step, worker, .. } => {
                self.steps.push(StepState { round: *round, step: *step, worker: *worker, status: StepStatus::Running });
            }
            RunEvent::StepFinished { round, step, .. } => self.set_status(*round, *step, StepStatus::Finished),
            RunEvent::StepFailed { round, step, error } => {
                self.set_status(*round, *step, StepStatus::Failed);
                if self.is_answer_step(*round, *step) {
                    self.answer_error = Some(error.kind);
                }
            }
            _ => {}
        }
    }

    fn set_status(&mut self, round: u32, step: usize, status: StepStatus) {
        if let Some(s) = self.steps.iter_mut().rev().find(|s| s.round == round && s.step == step) {
            s.status = status;
        }
    }

    /// The plans so far, in the order they were ready.
    pub fn plans(&self) -> &[RoundPlan] {
        &self.plans
    }

    /// The steps that started, in the order they started.
    pub fn steps(&self) -> &[StepState] {
        &self.steps
    }

    /// The worker a round's plan gives `step` (the pool's size means the conductor).
    pub fn worker_of(&self, round: u32, step: usize) -> Option<usize> {
        self.workers.get(&round)?.get(step).copied()
    }

    /// The step whose text is the answer, as far as the plans so far say.
    pub fn answer_step(&self) -> Option<(u32, usize)> {
        self.answer_step
    }

    pub fn is_answer_step(&self, round: u32, step: usize) -> bool {
        self.answer_step == Some((round, step))
    }

    /// The worker the answer's step was given.
    pub fn answer_worker(&self) -> Option<usize> {
        self.answer_worker
    }

    /// How the answer's step failed, if it did (a time-out reads differently from other failures).
    pub fn answer_error(&self) -> Option<StepErrorKind> {
        self.answer_error
    }

    /// Why the question's plan was replaced by one worker alone, if it was.
    pub fn fallback(&self) -> Option<&str> {
        self.fallback.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use baton_plan::{Access, Step};

    use super::*;
    use crate::event::{StepError, StepRef};

    fn ready(round: u32, parent: Option<StepRef>, workers: &[usize]) -> RunEvent {
        let steps =
            workers.iter().map(|&w| Step { model_id: w, subtask: "do it".into(), access: Access::All }).collect();
        RunEvent::given_plan(round, round, parent, Plan { steps })
    }

    fn started(round: u32, step: usize, worker: usize) -> RunEvent {
        RunEvent::StepStarted { round, step, worker, system: None, messages: Vec::new() }
    }

    #[test]
    fn a_last_step_given_to_the_conductor_hands_the_answer_to_the_round_it_opens() {
        let mut p = RunProgress::default();
        // Two workers; the last step goes to the conductor (worker 2), which opens round 1.
        p.see(&ready(0, None, &[0, 2]));
        assert_eq!((p.answer_step(), p.answer_worker()), (Some((0, 1)), Some(2)));
        // A round opened by another step does not move the answer.
        p.see(&ready(1, Some(StepRef { round: 0, step: 0 }), &[1]));
        assert_eq!(p.answer_step(), Some((0, 1)));
        p.see(&ready(2, Some(StepRef { round: 0, step: 1 }), &[0, 1]));
        assert_eq!((p.answer_step(), p.answer_worker()), (Some((2, 1)), Some(1)));
        assert_eq!(p.worker_of(0, 1), Some(2));
        assert_eq!(p.worker_of(2, 0), Some(0));
        assert_eq!(p.worker_of(3, 0), None);
        assert_eq!(p.plans().len(), 3);
    }

    #[test]
    fn steps_keep_their_start_order_and_only_the_answer_steps_failure_is_the_answers() {
        let mut p = RunProgress::default();
        p.see(&ready(0, None, &[0, 1]));
        p.see(&started(0, 1, 1));
        p.see(&started(0, 0, 0));
        let timeout = StepError { kind: StepErrorKind::Timeout, message: "slow".into(), status: None };
        p.see(&RunEvent::StepFailed { round: 0, step: 0, error: timeout.clone() });
        assert_eq!(p.answer_error(), None, "step 0 does not write the answer");
        p.see(&RunEvent::StepFailed { round: 0, step: 1, error: timeout });
        assert_eq!(p.answer_error(), Some(StepErrorKind::Timeout));
        let order: Vec<_> = p.steps().iter().map(|s| (s.step, s.status)).collect();
        assert_eq!(order, [(1, StepStatus::Failed), (0, StepStatus::Failed)]);
    }
}

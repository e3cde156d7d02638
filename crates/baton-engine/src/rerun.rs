//! Re-running one step of a finished run with another worker.
//!
//! The step and every step that sees it (directly or through others) run again; every other
//! step keeps the output it had, so only the changed part of the workflow costs calls. The
//! re-run is an ordinary run of the edited plan with a [`Reuse`]: it has its own events and its
//! own place in the history, and names the run it re-runs.
//!
//! Worker numbers in a stored plan refer to the pool as that run saw it, which may since have
//! changed (workers added, removed or reordered, or a conversation's choice of workers). The
//! re-run's pool is therefore rebuilt by worker *name*: the run's workers in their old order,
//! then the new worker if the run did not have it.

use std::collections::{BTreeMap, BTreeSet};

use baton_plan::Plan;

use crate::pool::{Pool, WorkerInfo};

/// A finished run, as much of it as a re-run needs.
#[derive(Debug, Clone, Copy)]
pub struct Source<'a> {
    /// The executor's id of the run.
    pub run_id: &'a str,
    /// The plan of round 0 (the question's plan).
    pub plan: &'a Plan,
    /// The pool as the run saw it; the plan's numbers index it, and its length is the conductor.
    pub workers: &'a [WorkerInfo],
    /// The output of each round-0 step that finished, by step number.
    pub outputs: &'a BTreeMap<usize, String>,
}

/// What to run: the pool, the edited plan (numbers refer to that pool) and what to keep.
#[derive(Debug, Clone)]
pub struct Rerun {
    pub pool: Pool,
    pub plan: Plan,
    pub reuse: Reuse,
}

/// What a re-run keeps from the run it re-runs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reuse {
    /// The run the outputs come from.
    pub from_run: String,
    /// The step that is re-run with another worker (recorded with the run).
    pub step: usize,
    /// Outputs of round-0 steps, by step number. Every step a kept step sees must be kept too.
    pub outputs: BTreeMap<usize, String>,
}

impl Reuse {
    /// Whether some step of `plan` given to `worker` runs again (is not kept).
    pub fn runs_worker(&self, plan: &Plan, worker: usize) -> bool {
        plan.steps.iter().enumerate().any(|(i, s)| s.model_id == worker && !self.outputs.contains_key(&i))
    }

    /// Why this cannot be used with `plan`, if it cannot: outputs for steps the plan lacks, or
    /// a kept step that sees a step which runs again (its output would be stale).
    pub(crate) fn check(&self, plan: &Plan) -> Result<(), String> {
        let deps = plan.dependencies();
        for &i in self.outputs.keys() {
            let Some(seen) = deps.get(i) else {
                return Err(format!("the re-run keeps step {i}, which the plan does not have"));
            };
            if let Some(j) = seen.iter().find(|j| !self.outputs.contains_key(j)) {
                return Err(format!("the re-run keeps step {i} but runs step {j}, which step {i} sees, again"));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RerunError {
    #[error("the run has no step {step}; its plan has {steps} steps")]
    NoSuchStep { step: usize, steps: usize },
    #[error("there is no worker named \"{0}\" in the pool")]
    NoSuchWorker(String),
    #[error(
        "the worker \"{0}\", which this run used, is no longer in the pool; add it back (same name) to re-run part of this run"
    )]
    WorkerGone(String),
}

/// The step `step` and every step that sees it, directly or through other steps.
pub fn dependents(plan: &Plan, step: usize) -> BTreeSet<usize> {
    let deps = plan.dependencies();
    let mut affected = BTreeSet::from([step]);
    // Steps only see earlier steps, so one pass in order reaches every dependent.
    for (i, seen) in deps.iter().enumerate().skip(step + 1) {
        if seen.iter().any(|j| affected.contains(j)) {
            affected.insert(i);
        }
    }
    affected
}

/// Plans re-running `step` of `source` with the pool worker named `worker`.
pub fn prepare(source: Source<'_>, pool: &Pool, step: usize, worker: &str) -> Result<Rerun, RerunError> {
    let steps = source.plan.steps.len();
    if step >= steps {
        return Err(RerunError::NoSuchStep { step, steps });
    }
    let find = |name: &str| pool.workers.iter().find(|w| w.name == name);
    let chosen = find(worker).ok_or_else(|| RerunError::NoSuchWorker(worker.to_owned()))?;

    let mut workers = Vec::with_capacity(source.workers.len() + 1);
    for info in source.workers {
        workers.push(find(&info.name).ok_or_else(|| RerunError::WorkerGone(info.name.clone()))?.clone());
    }
    let target = match workers.iter().position(|w| w.name == chosen.name) {
        Some(i) => i,
        None => {
            workers.push(chosen.clone());
            workers.len() - 1
        }
    };

    // The conductor is numbered after the workers, so it moves when a worker is added.
    let (old_conductor, new_conductor) = (source.workers.len(), workers.len());
    let mut plan = source.plan.clone();
    for s in &mut plan.steps {
        if s.model_id == old_conductor {
            s.model_id = new_conductor;
        }
    }
    plan.steps[step].model_id = target;

    let again = dependents(&plan, step);
    let outputs = source
        .outputs
        .iter()
        .filter(|(i, _)| !again.contains(i) && **i < steps)
        .map(|(i, output)| (*i, output.clone()))
        .collect();
    // A kept step must see only kept steps; a step that failed before runs again, and so must
    // the steps that see it.
    let reuse = keep_consistent(&plan, Reuse { from_run: source.run_id.to_owned(), step, outputs });
    Ok(Rerun { pool: Pool { workers, options: pool.options.clone(), learned: pool.learned.clone() }, plan, reuse })
}

/// Drops kept outputs of steps that see a step which runs again.
fn keep_consistent(plan: &Plan, mut reuse: Reuse) -> Reuse {
    for (i, seen) in plan.dependencies().iter().enumerate() {
        if seen.iter().any(|j| !reuse.outputs.contains_key(j)) {
            reuse.outputs.remove(&i);
        }
    }
    reuse
}

#[cfg(test)]
mod tests {
    use baton_plan::{Access, Step};
    use baton_providers::ProviderKind;

    use super::*;

    fn plan(steps: &[(usize, Access)]) -> Plan {
        Plan {
            steps: steps
                .iter()
                .enumerate()
                .map(|(i, (model_id, access))| Step {
                    model_id: *model_id,
                    subtask: format!("task {i}"),
                    access: access.clone(),
                })
                .collect(),
        }
    }

    fn pool(names: &[&str]) -> Pool {
        let toml: String = names
            .iter()
            .map(|n| format!("[[worker]]\nname = \"{n}\"\nprovider = \"openai\"\nmodel = \"m-{n}\"\n\n"))
            .collect();
        Pool::parse(&toml, "pool.toml").expect("pool")
    }

    fn infos(names: &[&str]) -> Vec<WorkerInfo> {
        names
            .iter()
            .enumerate()
            .map(|(index, n)| WorkerInfo {
                index,
                name: (*n).to_owned(),
                provider: ProviderKind::OpenAi,
                model: format!("m-{n}"),
                description: None,
            })
            .collect()
    }

    fn outputs(n: usize) -> BTreeMap<usize, String> {
        (0..n).map(|i| (i, format!("out {i}"))).collect()
    }

    #[test]
    fn dependents_follow_access_transitively() {
        // 0 ← 1 ← 3, 2 sees nothing, 4 sees everything.
        let p = plan(&[
            (0, Access::Steps(vec![])),
            (0, Access::Steps(vec![0])),
            (0, Access::Steps(vec![])),
            (0, Access::Steps(vec![1])),
            (0, Access::All),
        ]);
        assert_eq!(dependents(&p, 0), BTreeSet::from([0, 1, 3, 4]));
        assert_eq!(dependents(&p, 2), BTreeSet::from([2, 4]));
        assert_eq!(dependents(&p, 4), BTreeSet::from([4]));
    }

    #[test]
    fn the_step_and_its_dependents_run_again_the_rest_is_kept() {
        let p = plan(&[(0, Access::Steps(vec![])), (1, Access::Steps(vec![])), (0, Access::Steps(vec![1]))]);
        let (ws, outs) = (infos(&["a", "b"]), outputs(3));
        let source = Source { run_id: "run1", plan: &p, workers: &ws, outputs: &outs };
        let rerun = prepare(source, &pool(&["a", "b"]), 1, "a").expect("prepare");
        assert_eq!(rerun.plan.steps[1].model_id, 0);
        assert_eq!(rerun.reuse.outputs, BTreeMap::from([(0, "out 0".to_owned())]));
        assert_eq!((rerun.reuse.from_run.as_str(), rerun.reuse.step), ("run1", 1));
    }

    #[test]
    fn workers_are_matched_by_name_and_a_new_one_is_added_after_them() {
        // The pool was reordered and grew since the run; the conductor (number 2 then) must
        // stay the conductor.
        let p = plan(&[(1, Access::Steps(vec![])), (2, Access::All), (0, Access::All)]);
        let (ws, outs) = (infos(&["a", "b"]), outputs(3));
        let source = Source { run_id: "r", plan: &p, workers: &ws, outputs: &outs };
        let rerun = prepare(source, &pool(&["c", "b", "a"]), 0, "c").expect("prepare");
        let names: Vec<&str> = rerun.pool.workers.iter().map(|w| w.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        let ids: Vec<usize> = rerun.plan.steps.iter().map(|s| s.model_id).collect();
        assert_eq!(ids, [2, 3, 0]);
        assert!(rerun.reuse.outputs.is_empty(), "every step sees step 0");
    }

    #[test]
    fn a_failed_step_runs_again_with_the_steps_that_see_it() {
        let p = plan(&[
            (0, Access::Steps(vec![])),
            (0, Access::Steps(vec![])),
            (0, Access::Steps(vec![1])),
            (0, Access::Steps(vec![0])),
        ]);
        let ws = infos(&["a", "b"]);
        // Step 1 failed in the original run, so 2 never ran; re-running step 3 keeps only 0.
        let outs = BTreeMap::from([(0, "out 0".to_owned()), (3, "out 3".to_owned())]);
        let source = Source { run_id: "r", plan: &p, workers: &ws, outputs: &outs };
        let rerun = prepare(source, &pool(&["a", "b"]), 3, "b").expect("prepare");
        assert_eq!(rerun.reuse.outputs.keys().copied().collect::<Vec<_>>(), [0]);
    }

    #[test]
    fn clear_errors_for_missing_steps_and_workers() {
        let p = plan(&[(0, Access::Steps(vec![])), (1, Access::All)]);
        let (ws, outs) = (infos(&["a", "b"]), outputs(2));
        let source = Source { run_id: "r", plan: &p, workers: &ws, outputs: &outs };
        assert_eq!(
            prepare(source, &pool(&["a", "b"]), 5, "a").unwrap_err(),
            RerunError::NoSuchStep { step: 5, steps: 2 }
        );
        assert_eq!(prepare(source, &pool(&["a", "b"]), 0, "z").unwrap_err(), RerunError::NoSuchWorker("z".into()));
        let gone = prepare(source, &pool(&["a", "c"]), 0, "c").unwrap_err();
        assert_eq!(gone, RerunError::WorkerGone("b".into()));
        assert!(gone.to_string().contains("add it back"), "{gone}");
    }
}

//! Going on from an earlier run: re-running one step of it with another worker, in the same
//! conversation (see [`baton_engine::rerun`] for what runs again and what is kept).

use std::collections::BTreeMap;

use baton_engine::rerun::{self, RerunError, Source};
use baton_engine::{Pool, RunEvent, RunRequest, new_run_id};
use baton_store::{Store, StoreError};
use tokio_util::sync::CancellationToken;

use crate::build::{Conductor, Context};
use crate::{Recorded, RunnerError};

/// Re-runs `step` of history run `run_id` with the pool's worker named `worker`, as a new run in
/// the same conversation: every step that sees it runs again, the rest keep their output.
/// Events go to `show` once kept, as for [`crate::ask`]. `pool` reads the pool file; it is
/// called only once the run is found, so a run that is gone is the answer even where the pool
/// file is broken.
#[allow(clippy::too_many_arguments)]
pub async fn rerun_step(
    pool: impl FnOnce() -> Result<Pool, baton_engine::PoolError>,
    context: Context<'_>,
    store: &Store,
    run_id: i64,
    step: usize,
    worker: &str,
    show: impl FnMut(RunEvent) + Send + 'static,
    on_history_error: impl FnOnce(StoreError) + Send + 'static,
    cancel: &CancellationToken,
) -> Result<Recorded, RunnerError> {
    // The run first: one that is gone is the answer, whatever the pool file says.
    let earlier = Earlier::load(store, run_id).await?;
    let pool = pool()?;
    let rerun = earlier.rerun(store, &pool, step, worker).await?;
    let conductor = if rerun.needs_conductor { Conductor::Required } else { Conductor::None };
    let built = crate::build(rerun.pool, context.setup(conductor, Some(store))).await?;
    if cancel.is_cancelled() {
        return Err(RunnerError::Cancelled("the run was stopped before it started".into()));
    }
    let recorder = Some(store.recorder(Some(rerun.conversation)));
    Ok(crate::run::run_in_conversation(&built.executor, rerun.request, recorder, show, on_history_error, cancel).await)
}

/// A re-run ready to go: the pool it runs on, its request, and where it is recorded.
#[derive(Debug)]
pub struct Rerun {
    /// The pool rebuilt by worker name as the earlier run saw it.
    pub pool: Pool,
    pub request: RunRequest,
    /// The earlier run's conversation, which the re-run joins.
    pub conversation: i64,
    /// Steps given to the conductor itself run again, and need it to write their rounds anew.
    pub needs_conductor: bool,
}

/// A finished run of the history whose steps can be re-run. Loaded before the pool is read,
/// so "there is no run N" is what a user hears about a run that is gone, whatever the pool
/// file says.
#[derive(Debug)]
pub struct Earlier {
    tree: baton_store::RunTree,
    /// Which of its plans is the question's own: the one no step opened.
    top: usize,
}

impl Earlier {
    /// History run `run_id`, if it has ended and has a plan of the conductor's to re-run.
    pub async fn load(store: &Store, run_id: i64) -> Result<Self, RunnerError> {
        let tree = store
            .run(run_id)
            .await?
            .ok_or_else(|| RunnerError::NotFound(format!("there is no run {run_id} in the history")))?;
        if tree.run.status == baton_store::RunStatus::Running {
            return Err(RunnerError::BadInput("this run is still going; re-run a step once it has ended".into()));
        }
        let Some(top) = tree.plans.iter().position(|p| p.parent.is_none()) else {
            return Err(RunnerError::BadInput(
                "this run has no plan to re-run (the conductor wrote none); ask the question again instead".into(),
            ));
        };
        Ok(Self { tree, top })
    }

    /// Prepares re-running `step` of the question's plan with the pool worker named `worker`;
    /// every step that sees it runs again, the rest keep their output.
    pub async fn rerun(&self, store: &Store, pool: &Pool, step: usize, worker: &str) -> Result<Rerun, RunnerError> {
        let tree = &self.tree;
        let top = &tree.plans[self.top];
        let outputs: BTreeMap<usize, String> = tree
            .steps
            .iter()
            .filter(|s| s.round == top.round && s.status == "finished")
            .filter_map(|s| Some((s.step as usize, s.output.clone()?)))
            .collect();
        let source = Source { run_id: &tree.run.uid, plan: &top.plan, workers: &tree.run.workers, outputs: &outputs };
        let rerun = rerun::prepare(source, pool, step, worker).map_err(|e| match e {
            RerunError::NoSuchWorker(_) => RunnerError::NotFound(e.to_string()),
            e => RunnerError::BadInput(e.to_string()),
        })?;
        let needs_conductor = rerun.reuse.runs_worker(&rerun.plan, rerun.pool.workers.len());
        let conversation = tree.run.conversation_id;
        // The conductor sees the conversation as it was when the question was first asked.
        let history = store.messages_before_run(conversation, tree.run.id).await?;
        let request = RunRequest {
            run_id: new_run_id(),
            question: tree.run.question.clone(),
            history,
            plan: Some(rerun.plan),
            reuse: Some(rerun.reuse),
            ..RunRequest::default()
        };
        Ok(Rerun { pool: rerun.pool, request, conversation, needs_conductor })
    }
}

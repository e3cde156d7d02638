//! A plan for review before anything runs: the conductor writes it through the executor's own
//! planning round, so a draft is the plan a run of the same question would be given.

use baton_engine::{PlanDeltas, Planned, Pool};
use baton_providers::Message;
use tokio_util::sync::CancellationToken;

use crate::RunnerError;
use crate::build::Setup;

/// The conductor's plan for `question` (after `history`), its text streamed to `deltas` as it
/// is written; nothing runs. `cancel` stops it, and the error is then [`RunnerError::Cancelled`].
pub async fn draft(
    pool: Pool,
    setup: Setup<'_>,
    question: &str,
    history: Vec<Message>,
    deltas: PlanDeltas<'_>,
    cancel: &CancellationToken,
) -> Result<(Planned, Pool), RunnerError> {
    let built = crate::build::build_planning(pool, setup).await?;
    // A model still loading finishes loading (mistral.rs cannot stop a load); the draft stops
    // right after.
    if cancel.is_cancelled() {
        return Err(stopped());
    }
    // The executor's draft stops the planner (dropping its future stops generation, local and
    // remote alike) when `cancel` fires.
    let planned = built
        .executor
        .draft(question.trim(), history, deltas, cancel)
        .await
        .map_err(|e| if cancel.is_cancelled() { stopped() } else { RunnerError::Conductor(e.to_string()) })?;
    Ok((planned, built.pool))
}

fn stopped() -> RunnerError {
    RunnerError::Cancelled("the plan was not finished: stopped".into())
}

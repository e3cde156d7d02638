//! A plan for review before anything runs: the conductor writes it through the executor's own
//! planning round, so a draft is the plan a run of the same question would be given.

use baton_engine::{PlanDeltas, Planned, Pool};
use tokio_util::sync::CancellationToken;

use crate::RunnerError;
use crate::build::{Conductor, Context};

/// The conductor's plan for `question` (in `conversation` of `store`, when given), its text
/// streamed to `deltas` as it is written; nothing runs. `cancel` stops it, and the error is
/// then [`RunnerError::Cancelled`]. Returns the plan and the pool it numbers workers in.
///
/// A reviewed plan runs without its conductor, so the draft may not hand it steps: recursion
/// is off while drafting, whichever front end asks.
pub async fn draft(
    mut pool: Pool,
    context: Context<'_>,
    store: Option<&baton_store::Store>,
    question: &str,
    conversation: Option<i64>,
    deltas: PlanDeltas<'_>,
    cancel: &CancellationToken,
) -> Result<(Planned, Pool), RunnerError> {
    pool.options.recursion.enabled = false;
    let history = match store {
        Some(store) => crate::conversation_so_far(store, conversation).await?,
        None if conversation.is_some() => {
            return Err(RunnerError::BadInput("a conversation is read only with the history on".into()));
        }
        None => Vec::new(),
    };
    let built = crate::build::build_planning(pool, context.setup(Conductor::Required, store)).await?;
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

//! Learning a pool: every worker alone on a suite's items (and, where the pool has a
//! conductor, its sampled plans), kept in the history as what the pool learned; runs then send
//! each kind of question to the cheapest worker that is as good at it (see
//! [`baton_engine::profile`]). `baton pool learn` and the app's *Learn this pool* are this one
//! call.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use baton_engine::Pool;
use baton_engine::profile::PoolLearning;
use baton_eval::learn::{self, LearnOptions};
use baton_eval::{Ended, Harness, Progress};
use baton_store::Store;
use tokio_util::sync::CancellationToken;

use crate::RunnerError;
use crate::build::{Conductor, Context};

/// How a learning run ended, and what the pool knows now.
#[derive(Debug)]
pub struct Learned {
    /// The learning run's id: the same request goes on with it.
    pub id: String,
    pub ended: Ended,
    /// What the pool learned of each worker, and where each kind of question goes now.
    pub learning: PoolLearning,
}

/// Learns `options.suite` on `pool`, keeping what was measured in `store`; `progress` hears
/// the run start (its id and what it asks), notes (workers not asked again, a cap that cannot
/// see a worker's cost) and each item scored. Stopped by `cancel` or the spending cap, it says
/// so in [`Learned::ended`], and the same request goes on where it ended.
///
/// A worker measured on the same items as it is defined now is not asked again. The
/// conductor samples its plans from the prompt a run would give it (what the pool learned
/// before included: the measured lines, the learned plans as examples), never routed. Items
/// that nothing answered are searched for a workflow that does (`LearnOptions::search`). One
/// learning run per id at a time in this process: a second would ask every
/// worker the same items again, so it is refused.
pub async fn learn(
    pool: &Pool,
    store: &Store,
    options: &LearnOptions,
    context: Context<'_>,
    progress: &(dyn Fn(Progress) + Send + Sync),
    cancel: &CancellationToken,
) -> Result<Learned, RunnerError> {
    let mut spec = learn::spec(pool, options)?;
    let _one = Running::claim(&spec.id)?;
    let plans = learn::plan_samples(&spec);
    let left_out = learn::leave_out_learned(&mut spec, pool, store).await?;
    let workers: Vec<String> = pool.workers.iter().map(|w| w.name.clone()).collect();
    let sampled = if plans > 0 { format!(", and {plans} conductor plans per item") } else { String::new() };
    let about = format!(
        "each of {} workers alone on {} items of {}{sampled}",
        workers.len() - left_out.len(),
        learn::items(&spec),
        spec.suite.name
    );
    progress(Progress::Started { id: spec.id.clone(), about });
    if let Some(note) = learn::held_out_note(&spec) {
        progress(Progress::Note(note));
    }
    if options.plans > 0 && plans == 0 {
        progress(Progress::Note("the pool has no conductor, so only the workers alone are learned (no plans)".into()));
    }
    if options.max_cost_usd.is_some()
        && let Some(note) = crate::unpriced_warning(pool, "the spending cap")
    {
        progress(Progress::Note(note));
    }
    for w in &left_out {
        progress(Progress::Note(learn::left_out_note(w)));
    }
    let ended = if spec.strategies.is_empty() {
        progress(Progress::Note("every worker is already learned on these items; nothing to ask".into()));
        Ended::Finished
    } else {
        let conductor = if plans > 0 { Conductor::Required } else { Conductor::None };
        // The samples are written from the prompt a run would see, with what was learned before
        // (the history to the build); the sampling pool never routes, so every item is planned.
        let built = crate::build(learn::sampling_pool(pool), context.setup(conductor, Some(store))).await?;
        let harness = Harness::new(Arc::new(built.executor), workers, store.clone(), plans > 0);
        tracing::info!(learning = %spec.id, items = learn::items(&spec), "learning started");
        let ended = harness.run(&spec, progress, cancel).await?;
        tracing::info!(learning = %spec.id, ended = ended.as_str(), "learning ended");
        ended
    };
    let learning = crate::learned::pool_learning(pool, store).await?;
    Ok(Learned { id: spec.id, ended, learning })
}

/// The learning ids running in this process (the app can start one from two windows).
static RUNNING: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

/// A learning id claimed until dropped, however the run ends.
struct Running(String);

impl Running {
    fn claim(id: &str) -> Result<Running, RunnerError> {
        let mut running = RUNNING.lock().unwrap_or_else(|p| p.into_inner());
        if !running.insert(id.to_owned()) {
            return Err(RunnerError::BadInput(format!(
                "the pool is already learning from these items ({id}); stop it or wait"
            )));
        }
        Ok(Running(id.to_owned()))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        RUNNING.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_learning_id_runs_once_at_a_time_and_is_free_again_when_its_run_ends() {
        let first = Running::claim("mmlu-pool-a").expect("free");
        let again = Running::claim("mmlu-pool-a").err().expect("refused while running");
        assert!(again.to_string().contains("already learning from these items (mmlu-pool-a)"), "{again}");
        let other = Running::claim("mmlu-pool-b").expect("another id runs beside it");
        drop(first);
        Running::claim("mmlu-pool-a").expect("free once the first ended");
        drop(other);
    }
}

//! What the pool learned, read from the history: the workers' profiles from learning runs
//! (found by each worker's identity), put into a pool before it runs ([`learned_into`]), shown
//! as `baton pool show` and the Workers screen show it ([`pool_learning`]), and the questions an
//! evaluation leaves out ([`learned_items`]).

use baton_engine::Pool;
use baton_store::{Store, StoreError};

/// Each worker's name and identity, as its learned profile is kept.
pub fn identities(pool: &Pool) -> Vec<(String, String)> {
    pool.workers.iter().map(|w| (w.name.clone(), w.identity())).collect()
}

/// The conductor's identity, which its plans' measured figures are kept under; `None` for a
/// pool without a conductor model.
pub fn conductor_identity(pool: &Pool) -> Option<String> {
    let conductor = &pool.options.conductor;
    conductor.is_set().then(|| conductor.identity())
}

/// The items the pool's current profiles were learned from, which an evaluation leaves out. A
/// history that cannot be read is an error: leaving nothing out would score what was taught.
pub async fn learned_items(pool: &Pool, store: &Store) -> Result<baton_store::profiles::LearnedItems, StoreError> {
    store.learned_items(&identities(pool)).await
}

/// Fills `pool.learned` with what its workers' current profiles say (see
/// [`baton_engine::profile::measure`]): the fallback worker and the plan's lead for the
/// question's kind, where a question may skip the plan (a clear margin, or plans measured to do
/// no better than the worker alone), what the conductor is told of each
/// worker, and the plans that were right, as its examples. A worker the pool names (`fallback_worker`) is kept, and then nothing is routed by
/// measurement (the conductor is still told what was measured). A history that cannot be read
/// leaves the pool as it is: what was learned helps a run, and is no reason to fail one.
pub async fn learned_into(pool: &mut Pool, store: &Store) {
    match store.learned(&identities(pool), conductor_identity(pool).as_deref()).await {
        Ok(learned) => {
            let mut measured = baton_engine::profile::measure(&learned.profiles, learned.questions);
            if let Some(planned) = &learned.planned {
                baton_engine::profile::weigh_plans(&mut measured, &learned.profiles, planned);
            }
            baton_engine::profile::weigh_workflows(&mut measured, &learned.profiles, &learned.workflows);
            measured.plans = learned.plans;
            pool.learned = measured;
        }
        Err(e) => tracing::warn!("what the pool learned cannot be read, so it is not used: {e}"),
    }
}

/// What the pool learned of each worker and where each kind of question goes because of it,
/// as `baton pool show` and the Workers screen show it.
pub async fn pool_learning(pool: &Pool, store: &Store) -> Result<baton_engine::profile::PoolLearning, StoreError> {
    let learned = store.learned(&identities(pool), conductor_identity(pool).as_deref()).await?;
    let mut learning =
        baton_engine::profile::learning(pool, &learned.profiles, learned.planned.as_ref(), &learned.workflows);
    learning.plan_variety = learned.plan_variety;
    Ok(learning)
}

//! From a pool and the user's settings to an executor that can run: what the pool learned put
//! into it (the fallback worker, the routes), the conductor loaded (when the run needs one), the `local`
//! workers loaded in process.

use baton_conductor::setup::{self, ConductorChoice, SetupError};
use baton_engine::{Executor, Pool, Route};
use baton_local::{LocalModels, Notify};
use baton_store::Store;

/// Whether the executor gets a conductor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conductor {
    /// The run asks the conductor for a plan: a pool without one is an error, unless the pool
    /// routes every question by what it learned (`route = "always"`), which needs no plan.
    Required,
    /// Load the pool's conductor if it names one (`baton serve` then serves the workers alone).
    IfConfigured,
    /// The plan is given (a written plan, a worker alone): no conductor is loaded.
    None,
}

/// What a front end lends the application layer for work that may load models: the local
/// models it keeps between calls, the user's conductor choice (the command line's
/// `--conductor…` flags; the app's is the pool's own) and where model loads are told.
#[derive(Clone, Copy)]
pub struct Context<'a> {
    pub models: &'a LocalModels,
    pub choice: &'a ConductorChoice,
    pub notify: Notify<'a>,
}

impl std::fmt::Debug for Context<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").field("choice", &self.choice).finish_non_exhaustive()
    }
}

impl<'a> Context<'a> {
    /// The setup of an executor that gets a conductor as `conductor` says, and what the pool
    /// learned from `store`.
    pub fn setup(self, conductor: Conductor, store: Option<&'a Store>) -> Setup<'a> {
        Setup { models: self.models, choice: self.choice, conductor, store, notify: self.notify }
    }
}

/// What an executor is built from.
#[derive(Clone, Copy)]
pub struct Setup<'a> {
    pub models: &'a LocalModels,
    /// What overrides the pool's `[conductor]` table (the command line's `--conductor…` flags).
    pub choice: &'a ConductorChoice,
    pub conductor: Conductor,
    /// The history whose learned profiles choose the fallback worker and the routes; `None`
    /// keeps the pool's.
    pub store: Option<&'a Store>,
    /// Told of every model load.
    pub notify: Notify<'a>,
}

impl std::fmt::Debug for Setup<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Setup")
            .field("choice", &self.choice)
            .field("conductor", &self.conductor)
            .field("store", &self.store.is_some())
            .finish_non_exhaustive()
    }
}

/// An executor ready to run, and the pool it was built from.
#[derive(Debug)]
pub struct Built {
    pub executor: Executor,
    /// The pool with its fallback worker chosen.
    pub pool: Pool,
    /// Whether a conductor was loaded.
    pub conductor: bool,
}

impl Built {
    /// Whether the whole pool answers (`baton` on a server): a conductor plans, or the pool
    /// routes every question by what it learned and needs none.
    pub fn answers_as_pool(&self) -> bool {
        self.conductor || routes_every_question(&self.pool)
    }
}

/// Whether `pool` sends every question to one worker, or to a learned workflow, without a plan
/// (`route = "always"`), so it answers with no conductor at all.
pub fn routes_every_question(pool: &Pool) -> bool {
    pool.options.fallback.route == Route::Always
}

/// Builds the executor `setup` describes for `pool`.
pub async fn build(pool: Pool, setup: Setup<'_>) -> Result<Built, SetupError> {
    check_env_keys(&pool).await?;
    let pool = with_what_was_learned(pool, setup.store).await;
    let needed = match setup.conductor {
        Conductor::Required if routes_every_question(&pool) => Conductor::IfConfigured,
        other => other,
    };
    let planner = match needed {
        Conductor::None => None,
        Conductor::Required => Some(setup::planner(&pool, setup.choice, setup.models, setup.notify).await?),
        Conductor::IfConfigured => match setup::planner(&pool, setup.choice, setup.models, setup.notify).await {
            Ok(planner) => Some(planner),
            Err(SetupError::NotConfigured) => None,
            Err(e) => return Err(e),
        },
    };
    let local = setup::load_local_workers(&pool, setup.models, forces_cpu(&pool, setup.choice), setup.notify).await?;
    let mut executor = Executor::from_pool_with_local(&pool, local);
    let conductor = planner.is_some();
    if let Some(planner) = planner {
        executor = executor.with_planner(planner);
    }
    Ok(Built { executor, pool, conductor })
}

/// Refuses, before anything runs, a pool whose workers would send a variable's key to a host the
/// user has not allowed it to go to (the conductor's is checked as it is set up). Each request
/// checks again as it reads the key; this says it before a run starts, with what to do.
async fn check_env_keys(pool: &Pool) -> Result<(), SetupError> {
    let pool = pool.clone();
    tokio::task::spawn_blocking(move || baton_engine::keys::check_pool_env_keys(&pool))
        .await
        .map_err(|e| SetupError::Settings(format!("the pool's keys could not be checked: {e}")))??;
    Ok(())
}

/// Like [`build`] for an executor that only plans (a draft): the conductor is loaded whatever
/// `setup.conductor` says, the `local` workers are not, since nothing runs.
pub async fn build_planning(pool: Pool, setup: Setup<'_>) -> Result<Built, SetupError> {
    let pool = with_what_was_learned(pool, setup.store).await;
    let planner = match setup::planner(&pool, setup.choice, setup.models, setup.notify).await {
        Ok(planner) => Some(planner),
        // A pool that routes every question drafts without one: its draft is the routed worker.
        Err(SetupError::NotConfigured) if routes_every_question(&pool) => None,
        Err(e) => return Err(e),
    };
    let mut executor = Executor::from_pool(&pool);
    let conductor = planner.is_some();
    if let Some(planner) = planner {
        executor = executor.with_planner(planner);
    }
    Ok(Built { executor, pool, conductor })
}

/// The pool with what it learned ([`crate::learned::learned_into`]), when there is a history.
async fn with_what_was_learned(mut pool: Pool, store: Option<&Store>) -> Pool {
    if let Some(store) = store {
        crate::learned::learned_into(&mut pool, store).await;
    }
    pool
}

/// Whether local models run on the CPU whatever the machine has: the user's choice, or the
/// pool's `[conductor] device`.
pub fn forces_cpu(pool: &Pool, choice: &ConductorChoice) -> bool {
    choice.force_cpu || pool.options.conductor.device.forces_cpu()
}

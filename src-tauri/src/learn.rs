//! The Workers screen's *Learn this pool*: every worker alone on a suite's items (progress on a
//! Channel, stopped with `cancel_run`, resumed by learning the same suite again), and the
//! profiles that came of it. The work is `baton_runner::learn`'s; this is the
//! shell around it.

use baton_engine::profile::PoolLearning;
use baton_eval::Progress;
use baton_eval::learn::LearnOptions;
use serde::{Deserialize, Serialize};
use tauri::ipc::Channel;
use tauri::{AppHandle, Runtime, State};

use crate::error::AppResult;
use crate::eval::EvalProgress;
use crate::state::AppState;

/// What the window asks to learn from.
#[derive(Debug, Clone, Deserialize, ts_rs::TS)]
pub struct LearnRequest {
    /// A built-in suite's name, or the path of a JSONL file of items with answers.
    pub suite: String,
    /// Items to learn from (stratified by category); `null` for all.
    pub limit: Option<u32>,
    /// Plans the conductor samples and runs per item; `null`: the default
    /// (`baton_eval::learn::DEFAULT_PLANS`), 0: the workers alone only.
    pub plans: Option<u32>,
    /// Dollars the run may spend at most (priced calls); `null`: no cap. Learning the same
    /// items again with a higher cap goes on where it stopped.
    pub max_cost_usd: Option<f64>,
}

/// How a learning run ended, and what the pool knows now.
#[derive(Debug, Clone, Serialize, ts_rs::TS)]
pub struct Learned {
    /// The learning run's id (the same request goes on with it).
    pub id: String,
    /// `finished`, `stopped` or `over_budget`.
    pub ended: String,
    pub learning: PoolLearning,
}

/// What the pool learned so far; every worker "not learned" when the history holds nothing.
#[tauri::command]
pub async fn pool_learning(state: State<'_, AppState>) -> AppResult<PoolLearning> {
    let pool = state.pool()?;
    Ok(baton_runner::learned::pool_learning(&pool, state.store().await?).await?)
}

/// Runs (or resumes) a learning run over the pool as it is saved now; resolves once it ends.
#[tauri::command]
pub async fn learn_pool<R: Runtime>(
    app: AppHandle<R>,
    state: State<'_, AppState>,
    request: LearnRequest,
    stop_id: String,
    on_progress: Channel<EvalProgress>,
) -> AppResult<Learned> {
    let registration = state.register(&stop_id)?;
    let pool = state.pool()?;
    let defaults = LearnOptions::new(request.suite);
    let options = LearnOptions {
        limit: request.limit.map(|l| l as usize),
        plans: request.plans.unwrap_or(defaults.plans),
        max_cost_usd: request.max_cost_usd,
        ..defaults
    };
    // The history opens first, so a damaged database costs no provider calls.
    let store = state.store().await?;
    let loader = crate::chat::Loader::new(&app);
    let progress = |p: Progress| {
        let _ = on_progress.send(EvalProgress::from(p));
    };
    let context = loader.context(&state);
    let learned = baton_runner::learn::learn(&pool, store, &options, context, &progress, &registration.token).await?;
    Ok(Learned { id: learned.id, ended: learned.ended.as_str().to_owned(), learning: learned.learning })
}

//! The Evaluate screen's commands: the built-in suites, running an evaluation over the pool as
//! it is now (progress on a Channel, stopped with `cancel_run`), past evaluations with their
//! report and every item's result, export (through the save dialog) and delete. The work is
//! `baton_eval`'s; this is the shell around it.

use std::sync::Arc;

use baton_eval::report::{self, Report};
use baton_eval::{Harness, Progress, Purpose, Spec, Strategy};
use baton_store::evaluations::{EvalResult, Evaluation};
use serde::{Deserialize, Serialize};
use tauri::ipc::Channel;
use tauri::{AppHandle, Runtime, State};

use crate::error::{AppError, AppResult};
use crate::state::AppState;

/// A built-in suite.
#[derive(Debug, Clone, Serialize, ts_rs::TS)]
pub struct SuiteInfo {
    pub name: String,
    pub provenance: String,
    pub items: u32,
}

/// What the window asks to evaluate.
#[derive(Debug, Clone, Deserialize, ts_rs::TS)]
pub struct EvalRequest {
    /// A built-in suite's name.
    pub suite: String,
    /// `conductor`, `single:W`, `moa`, `router:lookup`, `router:random`, `best-of-n:W`, `oracle`.
    pub strategies: Vec<String>,
    /// Items to draw (stratified by category); `null` for all.
    pub limit: Option<u32>,
    pub max_cost_usd: Option<f64>,
    /// Names the evaluation; the same id resumes it. `null`: the suite's name and the time.
    pub id: Option<String>,
    /// Runs of every strategy per item (`null`: 1).
    #[serde(default)]
    pub repeats: Option<u32>,
    /// Runs in flight at once (`null`: 4).
    #[serde(default)]
    pub concurrency: Option<u32>,
    /// Share of each category kept to calibrate the lookup router and MoA's aggregator (`null`:
    /// 0.3 when one of them is asked for).
    #[serde(default)]
    pub calibration: Option<f64>,
    /// Seed for sampling, splits and the random router (`null`: 1).
    #[serde(default)]
    pub seed: Option<u64>,
}

/// News of an evaluation in progress.
#[derive(Debug, Clone, Serialize, ts_rs::TS)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum EvalProgress {
    Started { id: String },
    Planned { total: u32, done: u32 },
    Scored { strategy: String, item: String, correct: bool, cost_usd: f64, spent_usd: f64 },
    Note { text: String },
}

impl From<Progress> for EvalProgress {
    fn from(p: Progress) -> EvalProgress {
        match p {
            Progress::Planned { total, done } => EvalProgress::Planned { total: total as u32, done: done as u32 },
            Progress::Scored { strategy, item, correct, cost_usd, spent_usd } => {
                EvalProgress::Scored { strategy, item, correct, cost_usd, spent_usd }
            }
            Progress::Note(text) => EvalProgress::Note { text },
        }
    }
}

/// An evaluation with its report and every result.
#[derive(Debug, Clone, Serialize, ts_rs::TS)]
pub struct EvalView {
    pub evaluation: Evaluation,
    pub report: Report,
    pub results: Vec<EvalResult>,
}

#[tauri::command]
pub fn eval_suites() -> Vec<SuiteInfo> {
    baton_eval::suite::builtins()
        .map(|(name, provenance)| SuiteInfo {
            name: name.to_owned(),
            provenance: provenance.to_owned(),
            items: baton_eval::suite::load(name).map_or(0, |s| s.items.len() as u32),
        })
        .collect()
}

/// Runs (or resumes) an evaluation; resolves with its report once it ends (finished, stopped
/// or at its spending cap: `evaluation.status` says which).
#[tauri::command]
pub async fn run_evaluation<R: Runtime>(
    app: AppHandle<R>,
    state: State<'_, AppState>,
    request: EvalRequest,
    stop_id: String,
    on_progress: Channel<EvalProgress>,
) -> AppResult<EvalView> {
    let registration = state.register(&stop_id)?;
    let suite = baton_eval::suite::load(&request.suite).map_err(|e| AppError::bad_input(e.to_string()))?;
    let pool = state.pool()?;
    let workers: Vec<String> = pool.workers.iter().map(|w| w.name.clone()).collect();
    let strategies = Strategy::parse_list(&request.strategies.join(","), &workers).map_err(AppError::bad_input)?;
    if request.max_cost_usd.is_some_and(|c| c.is_nan() || c <= 0.0) {
        return Err(AppError::bad_input("the spending cap must be above $0"));
    }
    if request.repeats == Some(0) || request.concurrency == Some(0) {
        return Err(AppError::bad_input("repeats and runs at once must be at least 1"));
    }
    // The history opens first, so a damaged database costs no provider calls.
    let store = state.store().await?.clone();
    let wants_conductor = strategies.contains(&Strategy::Conductor);
    let learned = baton_runner::build::learned_questions(&pool, &store).await;
    let executor = crate::chat::executor(&app, &state, &pool, wants_conductor).await?;
    let harness = Harness::new(Arc::new(executor), workers, store.clone(), wants_conductor);
    let id = request.id.filter(|i| !i.trim().is_empty()).unwrap_or_else(|| {
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        format!("{}-{secs}", suite.name)
    });
    let spec = Spec {
        id: id.clone(),
        suite_source: request.suite.clone(),
        suite,
        strategies,
        repeats: request.repeats.unwrap_or(1),
        concurrency: request.concurrency.unwrap_or(4) as usize,
        max_cost_usd: request.max_cost_usd,
        calibration: request.calibration,
        limit: request.limit.map(|l| l as usize),
        seed: request.seed.unwrap_or(1),
        purpose: Purpose::Evaluate { leave_out: learned },
    };
    let _ = on_progress.send(EvalProgress::Started { id: id.clone() });
    let progress = |p: Progress| {
        let _ = on_progress.send(EvalProgress::from(p));
    };
    tracing::info!(evaluation = %id, "evaluation started");
    let ended = harness.run(&spec, &progress, &registration.token).await?;
    tracing::info!(evaluation = %id, ended = ended.as_str(), "evaluation ended");
    view(&store, &id).await
}

async fn view(store: &baton_store::Store, id: &str) -> AppResult<EvalView> {
    let evaluation =
        store.evaluation(id).await?.ok_or_else(|| AppError::not_found(format!("there is no evaluation {id}")))?;
    let results = store.eval_results(id).await?;
    let report = report::summarize(&evaluation, &results);
    Ok(EvalView { evaluation, report, results })
}

#[tauri::command]
pub async fn list_evaluations(state: State<'_, AppState>) -> AppResult<Vec<Evaluation>> {
    Ok(state.store().await?.evaluations().await?)
}

#[tauri::command]
pub async fn get_evaluation(state: State<'_, AppState>, id: String) -> AppResult<EvalView> {
    view(state.store().await?, &id).await
}

#[tauri::command]
pub async fn delete_evaluation(state: State<'_, AppState>, id: String) -> AppResult<()> {
    if state.store().await?.delete_evaluation(&id).await? {
        Ok(())
    } else {
        Err(AppError::not_found(format!("there is no evaluation {id}")))
    }
}

/// Writes the evaluation's HTML report (table, comparisons, chart) where the save dialog the
/// shell opens says; the path, or `null` when the user cancelled.
#[tauri::command]
pub async fn export_evaluation<R: Runtime>(
    app: AppHandle<R>,
    state: State<'_, AppState>,
    id: String,
) -> AppResult<Option<String>> {
    let v = view(state.store().await?, &id).await?;
    let text = report::html(&v.report);
    let name: String =
        id.chars().map(|c| if c.is_alphanumeric() || matches!(c, '-' | '_') { c } else { '_' }).collect();
    crate::history::save_as(&app, &state, format!("baton-evaluation-{name}.html"), "HTML", "html", &text).await
}

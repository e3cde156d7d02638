//! The Evaluate screen's commands: the built-in suites, running an evaluation over the pool as
//! it is now (progress on a Channel, stopped with `cancel_run`), past evaluations with their
//! report and every item's result, export (through the save dialog) and delete. The work is
//! `baton_eval`'s; this is the shell around it.

use baton_eval::Progress;
use baton_eval::report::{self, Report};
use baton_runner::evaluate::{self, EvalRequest as RunnerRequest};
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
    /// What it asks, in a line.
    Started {
        id: String,
        about: String,
    },
    Planned {
        total: u32,
        done: u32,
    },
    Scored {
        strategy: String,
        item: String,
        correct: bool,
        cost_usd: f64,
        spent_usd: f64,
    },
    Note {
        text: String,
    },
}

impl From<Progress> for EvalProgress {
    fn from(p: Progress) -> EvalProgress {
        match p {
            Progress::Planned { total, done } => EvalProgress::Planned { total: total as u32, done: done as u32 },
            Progress::Scored { strategy, item, correct, cost_usd, spent_usd } => {
                EvalProgress::Scored { strategy, item, correct, cost_usd, spent_usd }
            }
            Progress::Note(text) => EvalProgress::Note { text },
            Progress::Started { id, about } => EvalProgress::Started { id, about },
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
    let pool = state.pool()?;
    let defaults = RunnerRequest::new(request.suite);
    let request = RunnerRequest {
        strategies: request.strategies.join(","),
        id: request.id,
        limit: request.limit.map(|l| l as usize),
        repeats: request.repeats.unwrap_or(defaults.repeats),
        concurrency: request.concurrency.map_or(defaults.concurrency, |c| c as usize),
        max_cost_usd: request.max_cost_usd,
        calibration: request.calibration,
        seed: request.seed.unwrap_or(defaults.seed),
        ..defaults
    };
    // The history opens first, so a damaged database costs no provider calls.
    let store = state.store().await?;
    let loader = crate::chat::Loader::new(&app);
    let progress = |p: Progress| {
        let _ = on_progress.send(EvalProgress::from(p));
    };
    let context = loader.context(&state);
    let evaluated = evaluate::evaluate(pool, store, &request, context, &progress, &registration.token).await?;
    view(store, &evaluated.id).await
}

async fn view(store: &baton_store::Store, id: &str) -> AppResult<EvalView> {
    let evaluate::Results { evaluation, report, results } = evaluate::results(store, id).await?;
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

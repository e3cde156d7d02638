//! Evaluating a pool: strategies side by side on a suite of checkable questions, with what
//! each costs, kept in the history and resumable by id. `baton eval run` and the app's Evaluate
//! screen are this one call.

use std::sync::Arc;

use baton_engine::Pool;
use baton_eval::report::{self, Report};
use baton_eval::{Ended, Harness, Progress, Purpose, Spec, Strategy};
use baton_store::Store;
use baton_store::evaluations::{EvalResult, Evaluation};
use tokio_util::sync::CancellationToken;

use crate::RunnerError;
use crate::build::{Conductor, Context};

/// The strategies an evaluation compares unless told otherwise.
pub const DEFAULT_STRATEGIES: &str = "conductor,all-singles,router:lookup,oracle";

/// What the user asks to evaluate.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalRequest {
    /// A built-in suite's name or a JSONL file of items with answers.
    pub suite: String,
    /// Comma-separated: `conductor`, `single:W` (`all-singles`), `moa`, `router:lookup`,
    /// `router:random`, `best-of-n:W[:N]`, `oracle`.
    pub strategies: String,
    /// Names the evaluation; the same id resumes it. `None`: the suite's name and the time.
    pub id: Option<String>,
    /// Items to draw, stratified by category (`None`: all).
    pub limit: Option<usize>,
    /// Runs of every strategy per item.
    pub repeats: u32,
    /// Runs in flight at once.
    pub concurrency: usize,
    /// Spend at most this much in total, resumes included.
    pub max_cost_usd: Option<f64>,
    /// Share of items kept to calibrate the lookup router and MoA's aggregator (`None`: 0.3
    /// when one of them is asked for).
    pub calibration: Option<f64>,
    /// Seed for sampling, splits and the random router.
    pub seed: u64,
}

impl EvalRequest {
    /// The defaults every front end starts from.
    pub fn new(suite: impl Into<String>) -> EvalRequest {
        EvalRequest {
            suite: suite.into(),
            strategies: DEFAULT_STRATEGIES.to_owned(),
            id: None,
            limit: None,
            repeats: 1,
            concurrency: 4,
            max_cost_usd: None,
            calibration: None,
            seed: 1,
        }
    }
}

/// How an evaluation ended.
#[derive(Debug, Clone)]
pub struct Evaluated {
    /// Its id: the same request with it goes on where it ended.
    pub id: String,
    pub ended: Ended,
}

/// Runs (or resumes) the evaluation `request` asks for on `pool`, kept in `store`; `progress`
/// hears it start (its id and what it asks), notes and each item scored. Every input is
/// checked before a call is made. Items whose question the pool learned from are left out, and
/// said so: a pool is never scored on what it was taught with.
pub async fn evaluate(
    pool: Pool,
    store: &Store,
    request: &EvalRequest,
    context: Context<'_>,
    progress: &(dyn Fn(Progress) + Send + Sync),
    cancel: &CancellationToken,
) -> Result<Evaluated, RunnerError> {
    let suite = baton_eval::suite::load(&request.suite).map_err(|e| RunnerError::BadInput(e.to_string()))?;
    let workers: Vec<String> = pool.workers.iter().map(|w| w.name.clone()).collect();
    let strategies = Strategy::parse_list(&request.strategies, &workers).map_err(RunnerError::BadInput)?;
    if request.repeats == 0 || request.concurrency == 0 {
        return Err(RunnerError::BadInput("the repeats and the runs at once must each be at least 1".into()));
    }
    if let Some(cap) = request.max_cost_usd {
        baton_engine::limits::COST_USD.check("the spending cap", cap).map_err(RunnerError::BadInput)?;
    }
    let id = request.id.clone().filter(|i| !i.trim().is_empty()).unwrap_or_else(|| {
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        format!("{}-{secs}", suite.name)
    });
    let wants_conductor = strategies.contains(&Strategy::Conductor);
    let learned = crate::learned::learned_items(&pool, store).await?;
    let warning = request.max_cost_usd.and_then(|_| crate::unpriced_warning(&pool, "the spending cap"));
    let conductor = if wants_conductor { Conductor::Required } else { Conductor::None };
    let built = crate::build(pool, context.setup(conductor, Some(store))).await?;
    let harness = Harness::new(Arc::new(built.executor), workers, store.clone(), wants_conductor);
    let spec = Spec {
        id: id.clone(),
        suite,
        suite_source: request.suite.clone(),
        strategies,
        repeats: request.repeats,
        concurrency: request.concurrency,
        max_cost_usd: request.max_cost_usd,
        calibration: request.calibration,
        limit: request.limit,
        seed: request.seed,
        purpose: Purpose::Evaluate { leave_out: learned },
    };
    let items = spec.limit.map_or(spec.suite.items.len(), |l| l.min(spec.suite.items.len()));
    let about = format!("{items} items of {} ({})", spec.suite.name, spec.suite.provenance);
    progress(Progress::Started { id: id.clone(), about });
    if let Some(note) = warning {
        progress(Progress::Note(note));
    }
    tracing::info!(evaluation = %id, "evaluation started");
    let ended = harness.run(&spec, progress, cancel).await?;
    tracing::info!(evaluation = %id, ended = ended.as_str(), "evaluation ended");
    Ok(Evaluated { id, ended })
}

/// An evaluation of the history with every item's result and the report made of them.
#[derive(Debug, Clone)]
pub struct Results {
    pub evaluation: Evaluation,
    pub report: Report,
    pub results: Vec<EvalResult>,
}

/// Evaluation `id` of `store`, its results and its report.
pub async fn results(store: &Store, id: &str) -> Result<Results, RunnerError> {
    let evaluation = store
        .evaluation(id)
        .await?
        .ok_or_else(|| RunnerError::NotFound(format!("there is no evaluation {id:?} in the history")))?;
    let results = store.eval_results(id).await?;
    let report = report::summarize(&evaluation, &results);
    Ok(Results { evaluation, report, results })
}

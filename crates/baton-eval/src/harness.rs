//! Running an evaluation: choosing items and splits, running every strategy on them through
//! the executor (each run recorded in the history like any other), scoring, and keeping each
//! result as it arrives so that a killed evaluation resumes without paying twice.
//!
//! Order of work:
//! 1. the calibration split (only when a strategy needs one): every worker alone;
//! 2. from it, the lookup router's table (best worker per category) and MoA's aggregator;
//! 3. the test split: the conductor, single workers, MoA; in a learning run, then search
//!    (workflows for the items nothing answered, each one found measured on its kind);
//! 4. best-of-n, its `n` matched to the conductor's measured cost per item when not given;
//! 5. the routers and the oracle, built from the single workers' results on the test split.
//!
//! [`Harness::run`] reads as that list; the work is split by concern:
//! - `setup`: the settings checked, and the evaluation created or resumed;
//! - `items`: which items run, and which of them are calibration;
//! - `phases`: what each step of the order of work runs and decides;
//! - `jobs`: running many runs at once within the spending cap;
//! - `search`: a learning run's search for workflows;
//! - `run_one`: one run through the executor, recorded in the history, and its result;
//! - `scoring`: an answer checked against its item, and best-of-n's vote;
//! - `derived`: what is computed from other results rather than run (the lookup table, best-of-n's
//!   `n`, the routers and the oracle).

use std::collections::BTreeMap;
use std::sync::Arc;

use baton_engine::Executor;
use baton_store::Store;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::strategy::Strategy;
use crate::suite::Suite;

mod derived;
mod items;
mod jobs;
mod phases;
mod run_one;
mod scoring;
mod search;
mod setup;

pub use run_one::prompt;
pub use scoring::{Scored, score};

use phases::Evaluation;

/// What to evaluate.
#[derive(Debug, Clone)]
pub struct Spec {
    pub id: String,
    pub suite: Suite,
    /// How the user named the suite (kept with the evaluation).
    pub suite_source: String,
    pub strategies: Vec<Strategy>,
    pub repeats: u32,
    pub concurrency: usize,
    /// Stop starting runs once this much has been spent (over the whole evaluation, resumes
    /// included); no run may spend past it.
    pub max_cost_usd: Option<f64>,
    /// Share of items (per category) kept for calibration; `None`: 0.3 when a router or MoA
    /// needs one, else none.
    pub calibration: Option<f64>,
    /// Evaluate this many items, drawn stratified by category (default: all).
    pub limit: Option<usize>,
    pub seed: u64,
    pub purpose: Purpose,
}

/// Why the items run: to score the strategies, or to teach the pool its workers' strengths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Purpose {
    /// An evaluation. Items the pool learned from (`leave_out`: this suite's items by id, and
    /// any suite's by their question's text) are left out, and said so: a pool is never scored
    /// on what it was taught with.
    Evaluate { leave_out: baton_store::profiles::LearnedItems },
    /// A learning run (`baton pool learn`): `identities` are the workers' identities, in the
    /// pool's order, which the profiles are kept under; with the conductor among the
    /// strategies, it writes `plan_samples` plans for each item (sampled), which are run;
    /// `conductor` is then its identity, which the plans' figures are kept under. The suite's
    /// items pinned `test` are not among its items: `held_out` says how many were left out.
    /// With `search`, the items nothing answered are searched for a workflow that does
    /// (`harness/search.rs`).
    Learn { identities: Vec<String>, plan_samples: u32, conductor: Option<String>, held_out: usize, search: bool },
}

/// The settings an evaluation is resumed with must be these; stored as its config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Config {
    pub strategies: Vec<String>,
    pub repeats: u32,
    pub calibration: f64,
    pub limit: Option<usize>,
    pub seed: u64,
    pub workers: Vec<String>,
    /// The suite as the user named it (a built-in name or a path), to read its items again.
    #[serde(default)]
    pub suite_source: Option<String>,
    /// Choices made along the way, kept so a resume makes the same ones.
    #[serde(default)]
    pub best_of_n: BTreeMap<String, u32>,
    #[serde(default)]
    pub moa_aggregator: Option<String>,
    /// Category → worker, from the calibration split.
    #[serde(default)]
    pub lookup: BTreeMap<String, String>,
    /// The latest spending cap (may change between resumes).
    #[serde(default)]
    pub max_cost_usd: Option<f64>,
    /// A learning run (`baton pool learn`): its single-worker results are the workers'
    /// profiles, kept under `identities` (one per worker, in `workers`' order).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub learn: bool,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub identities: Vec<String>,
    /// A learning run's plans per item (the conductor's runs); 0: `repeats`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub plan_samples: u32,
    /// A learning run's conductor as its plans were sampled
    /// ([`baton_engine::ConductorSpec::identity`]); none without plans, and in runs kept before
    /// it was recorded, whose plans' figures are then used for nothing but examples.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conductor: Option<String>,
    /// A learning run that searches for workflows where nothing else answered.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub search: bool,
    /// The workflows search found and measured, by their strategy key (workers by their index
    /// in `workers`): the history reads their figures under these keys.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub workflows: BTreeMap<String, baton_engine::workflow::Workflow>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl Config {
    /// The settings that must match for a resume (choices made along the way excluded).
    fn same_settings(&self, other: &Config) -> bool {
        self.strategies == other.strategies
            && self.repeats == other.repeats
            && (self.calibration - other.calibration).abs() < 1e-9
            && self.limit == other.limit
            && self.seed == other.seed
            && self.workers == other.workers
            && self.learn == other.learn
            && self.identities == other.identities
            && self.plan_samples == other.plan_samples
    }

    /// Runs per item of strategy `s` on the test split.
    pub(crate) fn repeats_of(&self, s: &Strategy) -> u32 {
        match s {
            Strategy::Conductor if self.plan_samples > 0 => self.plan_samples,
            _ => self.repeats,
        }
    }
}

/// Progress, for a bar.
#[derive(Debug, Clone)]
pub enum Progress {
    /// The evaluation or learning run `id` begins: `about` says what it asks, in a line.
    Started { id: String, about: String },
    /// The work ahead: runs to make (`total`), of which `done` were made before (a resume).
    Planned { total: usize, done: usize },
    /// One run scored.
    Scored { strategy: String, item: String, correct: bool, cost_usd: f64, spent_usd: f64 },
    /// Something the user should know (a choice made, a cap reached).
    Note(String),
}

#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("{0}")]
    Settings(String),
    #[error(transparent)]
    Store(#[from] baton_store::StoreError),
    #[error(transparent)]
    Sandbox(#[from] crate::sandbox::SandboxError),
}

/// How the evaluation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    Finished,
    /// Stopped by the user; run it again to go on.
    Stopped,
    /// The spending cap was reached; run it again with a higher cap to go on.
    OverBudget,
}

impl Ended {
    pub fn as_str(self) -> &'static str {
        match self {
            Ended::Finished => "finished",
            Ended::Stopped => "stopped",
            Ended::OverBudget => "over_budget",
        }
    }
}

/// Runs evaluations over one pool.
#[derive(Debug, Clone)]
pub struct Harness {
    executor: Arc<Executor>,
    workers: Vec<String>,
    store: Store,
    /// Whether the executor has a conductor (needed by `conductor`).
    has_conductor: bool,
}

impl Harness {
    pub fn new(executor: Arc<Executor>, workers: Vec<String>, store: Store, has_conductor: bool) -> Harness {
        Harness { executor, workers, store, has_conductor }
    }

    /// Runs (or resumes) the evaluation. Stops early, keeping every finished result, when
    /// `cancel` fires or the spending cap is reached.
    pub async fn run(
        &self,
        spec: &Spec,
        progress: &(dyn Fn(Progress) + Send + Sync),
        cancel: &CancellationToken,
    ) -> Result<Ended, EvalError> {
        let spec = &self.leaving_out_what_was_learned(spec, progress)?;
        let calibration = self.calibration_share(spec)?;
        let sandbox = setup::sandbox(spec, progress)?;
        let (config, spent_before) = self.create_or_resume(spec, calibration).await?;
        let mut eval = Evaluation::start(self, spec, config, sandbox, spent_before, progress, cancel).await?;
        let calibration_jobs = eval.calibration_jobs();
        eval.announce_plan(&calibration_jobs);

        // 1. Calibration.
        if let Some(end) = eval.run_remaining(calibration_jobs).await? {
            return eval.finish(end).await;
        }
        // 2. The lookup table and the aggregator, from the calibration results.
        eval.choose_lookup_and_aggregator().await?;
        // 3. The test split.
        let test_jobs = eval.test_jobs();
        if let Some(end) = eval.run_remaining(test_jobs).await? {
            return eval.finish(end).await;
        }
        // 3b. A learning run's search: workflows for the items nothing answered, each found
        // one then measured on the other items of its kind.
        if let Some(end) = eval.search().await? {
            return eval.finish(end).await;
        }
        // 4. Best-of-n, at the conductor's cost.
        let best_of_n_jobs = eval.best_of_n_jobs().await?;
        if let Some(end) = eval.run_remaining(best_of_n_jobs).await? {
            return eval.finish(end).await;
        }
        // 5. Routers and the oracle.
        eval.derive_routers_and_oracle().await?;
        eval.finish(Ended::Finished).await
    }
}

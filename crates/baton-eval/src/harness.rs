//! Running an evaluation: choosing items and splits, running every strategy on them through
//! the executor (each run recorded in the history like any other), scoring, and keeping each
//! result as it arrives so that a killed evaluation resumes without paying twice.
//!
//! Order of work:
//! 1. the calibration split (only when a strategy needs one): every worker alone;
//! 2. from it, the lookup router's table (best worker per category) and MoA's aggregator;
//! 3. the test split: the conductor, single workers, MoA;
//! 4. best-of-n, its `n` matched to the conductor's measured cost per item when not given;
//! 5. the routers and the oracle, built from the single workers' results on the test split.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use baton_engine::{Budget, Executor, RunEvent, RunRequest, RunStatus, new_run_id};
use baton_plan::{Access, Plan, Step};
use baton_store::Store;
use baton_store::evaluations::EvalResult;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::extract;
use crate::sandbox::Sandbox;
use crate::strategy::Strategy;
use crate::suite::{Item, Kind, Suite};

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
    }
}

/// Progress, for a bar.
#[derive(Debug, Clone)]
pub enum Progress {
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

/// One run to make.
#[derive(Debug, Clone)]
struct Job {
    strategy: String,
    what: Run,
    item: usize,
    repeat: u32,
    calibration: bool,
}

#[derive(Debug, Clone)]
enum Run {
    Conductor,
    Single(usize),
    Moa { aggregator: usize },
    BestOfN { worker: usize, n: u32 },
}

/// The shared state of the runs in flight: what has been spent and what is promised to runs
/// still going, so their caps never add up past the evaluation's.
struct Purse {
    cap: Option<f64>,
    spent: f64,
    promised: f64,
    over: bool,
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
        let needs_calibration = spec.strategies.iter().any(|s| matches!(s, Strategy::RouterLookup | Strategy::Moa));
        let pinned = pinned_share(&spec.suite.items);
        if pinned.is_some() && spec.calibration.is_some() {
            return Err(EvalError::Settings(
                "the suite's items say which split they are in (`split`); leave out --calibration".into(),
            ));
        }
        // Pinned calibration items run only when a strategy learns from them; either way they
        // are never test items (`split` honours the pins whatever the fraction).
        let calibration = match pinned {
            Some(share) if needs_calibration => share,
            Some(_) => 0.0,
            None => spec.calibration.unwrap_or(if needs_calibration { 0.3 } else { 0.0 }),
        };
        if !(0.0..0.9).contains(&calibration) {
            return Err(EvalError::Settings("--calibration must be at least 0 and below 0.9".into()));
        }
        if calibration == 0.0 && spec.strategies.contains(&Strategy::RouterLookup) {
            return Err(EvalError::Settings(
                "router:lookup learns from a calibration split: give --calibration above 0".into(),
            ));
        }
        if spec.strategies.contains(&Strategy::Conductor) && !self.has_conductor {
            return Err(EvalError::Settings(
                "the conductor strategy needs a conductor: set [conductor] in the pool or pass --conductor".into(),
            ));
        }
        let sandbox = if spec.suite.items.iter().any(|i| i.kind == Kind::Code) {
            let s = Sandbox::new(crate::sandbox::Limits::default())?;
            progress(Progress::Note(format!("code runs in a sandbox: {}", s.isolation.describe())));
            Some(Arc::new(s))
        } else {
            None
        };

        let mut config = Config {
            strategies: spec.strategies.iter().map(ToString::to_string).collect(),
            repeats: spec.repeats.max(1),
            calibration,
            limit: spec.limit,
            seed: spec.seed,
            workers: self.workers.clone(),
            suite_source: Some(spec.suite_source.clone()),
            best_of_n: BTreeMap::new(),
            moa_aggregator: None,
            lookup: BTreeMap::new(),
            max_cost_usd: spec.max_cost_usd,
        };
        let spent_before = match self.store.evaluation(&spec.id).await? {
            Some(existing) => {
                if existing.suite_sha256 != spec.suite.sha256 {
                    return Err(EvalError::Settings(format!(
                        "evaluation {} was run on other items ({}); choose another --id",
                        spec.id, existing.suite
                    )));
                }
                let before: Config = serde_json::from_value(existing.config.clone()).map_err(|e| {
                    EvalError::Settings(format!("evaluation {} has an unreadable config: {e}", spec.id))
                })?;
                if !before.same_settings(&config) {
                    return Err(EvalError::Settings(format!(
                        "evaluation {} was started with other settings (strategies {}, repeats {}, calibration {}, limit {:?}, seed {}, workers {}); run it with those, or choose another --id",
                        spec.id,
                        before.strategies.join(","),
                        before.repeats,
                        before.calibration,
                        before.limit,
                        before.seed,
                        before.workers.join(",")
                    )));
                }
                config.best_of_n = before.best_of_n;
                config.moa_aggregator = before.moa_aggregator;
                config.lookup = before.lookup;
                existing.spent_usd
            }
            None => {
                let json = serde_json::to_value(&config).unwrap_or_default();
                self.store.create_evaluation(&spec.id, &spec.suite.name, &spec.suite.sha256, &json).await?;
                0.0
            }
        };

        let items = select(&spec.suite.items, spec.limit, spec.seed);
        let is_calibration = split(&items, calibration, spec.seed);
        let done: HashSet<(String, String, u32)> =
            self.store.eval_results(&spec.id).await?.into_iter().map(|r| (r.strategy, r.item_id, r.repeat)).collect();

        let ctx = Arc::new(RunCtx {
            harness: self.clone(),
            id: spec.id.clone(),
            items: items.clone(),
            sandbox,
            purse: Mutex::new(Purse { cap: spec.max_cost_usd, spent: spent_before, promised: 0.0, over: false }),
            progress,
        });
        let repeats = config.repeats;
        let singles_needed: Vec<usize> = (0..self.workers.len())
            .filter(|&w| {
                spec.strategies.iter().any(|s| s.is_derived())
                    || spec.strategies.contains(&Strategy::Single(self.workers[w].clone()))
            })
            .collect();
        let test: Vec<usize> = (0..items.len()).filter(|i| !is_calibration[*i]).collect();
        let calib: Vec<usize> = (0..items.len()).filter(|i| is_calibration[*i]).collect();
        let single_key = |w: usize| Strategy::Single(self.workers[w].clone()).key();

        // Everything that will run, for the bar (best-of-n counted at its eventual size).
        let mut phase1 = Vec::new();
        if calibration > 0.0 {
            for w in 0..self.workers.len() {
                for &i in &calib {
                    for r in 0..repeats {
                        phase1.push(Job {
                            strategy: single_key(w),
                            what: Run::Single(w),
                            item: i,
                            repeat: r,
                            calibration: true,
                        });
                    }
                }
            }
        }
        let count_done = |jobs: &[Job]| {
            jobs.iter().filter(|j| done.contains(&(j.strategy.clone(), items[j.item].id.clone(), j.repeat))).count()
        };
        let runnable: Vec<&Strategy> = spec.strategies.iter().filter(|s| !s.is_derived()).collect();
        let mut singles_in_test: Vec<usize> = singles_needed.clone();
        singles_in_test.sort_unstable();
        let per_test_runs =
            runnable.iter().filter(|s| !matches!(s, Strategy::Single(_))).count() + singles_in_test.len();
        let total = phase1.len() + per_test_runs * test.len() * repeats as usize;
        let already = count_done(&phase1)
            + done
                .iter()
                .filter(|(s, item, _)| {
                    !s.starts_with("router:") && s != "oracle" && test.iter().any(|&t| items[t].id == *item)
                })
                .count();
        progress(Progress::Planned { total, done: already.min(total) });

        // 1. Calibration.
        if let Some(end) = run_jobs(&ctx, not_done(phase1, &done, &items), spec.concurrency, cancel).await? {
            self.finish(&spec.id, &config, end).await?;
            return Ok(end);
        }

        // 2. The lookup table and the aggregator, from the calibration results.
        let results = self.store.eval_results(&spec.id).await?;
        if calibration > 0.0 && config.lookup.is_empty() {
            let (table, best) = lookup_table(&results, &self.workers, &items);
            config.lookup = table;
            if config.moa_aggregator.is_none() {
                config.moa_aggregator = best;
            }
            if !config.lookup.is_empty() {
                let shown: Vec<String> = config.lookup.iter().map(|(c, w)| format!("{c} → {w}")).collect();
                progress(Progress::Note(format!("lookup table from the calibration split: {}", shown.join(", "))));
            }
        }
        if config.moa_aggregator.is_none() {
            config.moa_aggregator = self.workers.first().cloned();
        }
        self.save_config(&spec.id, &config).await?;
        let aggregator =
            config.moa_aggregator.as_ref().and_then(|a| self.workers.iter().position(|w| w == a)).unwrap_or(0);

        // 3. The test split.
        let mut jobs = Vec::new();
        for &i in &test {
            for r in 0..repeats {
                for s in &runnable {
                    let what = match s {
                        Strategy::Conductor => Run::Conductor,
                        Strategy::Moa => Run::Moa { aggregator },
                        _ => continue,
                    };
                    jobs.push(Job { strategy: s.key(), what, item: i, repeat: r, calibration: false });
                }
                for &w in &singles_in_test {
                    jobs.push(Job {
                        strategy: single_key(w),
                        what: Run::Single(w),
                        item: i,
                        repeat: r,
                        calibration: false,
                    });
                }
            }
        }
        if let Some(end) = run_jobs(&ctx, not_done(jobs, &done, &items), spec.concurrency, cancel).await? {
            self.finish(&spec.id, &config, end).await?;
            return Ok(end);
        }

        // 4. Best-of-n, at the conductor's cost.
        let results = self.store.eval_results(&spec.id).await?;
        let max_steps = self.executor.options().max_steps.max(1) as u32;
        let mut jobs = Vec::new();
        for s in &runnable {
            let Strategy::BestOfN { worker, n } = s else { continue };
            let w = self.workers.iter().position(|x| x == worker).unwrap_or(0);
            let n = match (n, config.best_of_n.get(worker)) {
                (Some(n), _) => *n,
                (None, Some(n)) => *n,
                (None, None) => {
                    let n = matched_n(&results, &single_key(w)).clamp(1, max_steps);
                    progress(Progress::Note(format!(
                        "best-of-n:{worker}: n = {n}, to match the conductor's cost per item (at most the pool's max_steps, {max_steps})"
                    )));
                    n
                }
            }
            .clamp(1, max_steps);
            config.best_of_n.insert(worker.clone(), n);
            for &i in &test {
                for r in 0..repeats {
                    jobs.push(Job {
                        strategy: s.key(),
                        what: Run::BestOfN { worker: w, n },
                        item: i,
                        repeat: r,
                        calibration: false,
                    });
                }
            }
        }
        self.save_config(&spec.id, &config).await?;
        if let Some(end) = run_jobs(&ctx, not_done(jobs, &done, &items), spec.concurrency, cancel).await? {
            self.finish(&spec.id, &config, end).await?;
            return Ok(end);
        }

        // 5. Routers and the oracle.
        let results = self.store.eval_results(&spec.id).await?;
        for s in spec.strategies.iter().filter(|s| s.is_derived()) {
            // A category the calibration split had no items of goes to the best worker overall.
            let fallback = aggregator;
            for row in derive(s, &results, &self.workers, &items, &test, repeats, &config.lookup, fallback, spec.seed) {
                self.store.put_eval_result(&spec.id, &row).await?;
            }
        }
        self.finish(&spec.id, &config, Ended::Finished).await?;
        Ok(Ended::Finished)
    }

    async fn save_config(&self, id: &str, config: &Config) -> Result<(), EvalError> {
        let json = serde_json::to_value(config).unwrap_or_default();
        self.store.update_evaluation(id, &json, "running").await?;
        Ok(())
    }

    async fn finish(&self, id: &str, config: &Config, end: Ended) -> Result<(), EvalError> {
        let json = serde_json::to_value(config).unwrap_or_default();
        self.store.update_evaluation(id, &json, end.as_str()).await?;
        Ok(())
    }
}

/// The jobs whose result is not recorded yet (a resume pays for nothing twice).
fn not_done(jobs: Vec<Job>, done: &HashSet<(String, String, u32)>, items: &[Item]) -> Vec<Job> {
    jobs.into_iter().filter(|j| !done.contains(&(j.strategy.clone(), items[j.item].id.clone(), j.repeat))).collect()
}

struct RunCtx<'p> {
    harness: Harness,
    id: String,
    items: Vec<Item>,
    sandbox: Option<Arc<Sandbox>>,
    purse: Mutex<Purse>,
    progress: &'p (dyn Fn(Progress) + Send + Sync),
}

/// Runs `jobs`, `concurrency` at a time. `Some(end)` when stopped early.
async fn run_jobs(
    ctx: &Arc<RunCtx<'_>>,
    jobs: Vec<Job>,
    concurrency: usize,
    cancel: &CancellationToken,
) -> Result<Option<Ended>, EvalError> {
    use futures::StreamExt;
    let concurrency = concurrency.max(1);
    let mut pending = jobs.into_iter();
    let mut running = futures::stream::FuturesUnordered::new();
    let mut failure: Option<EvalError> = None;
    loop {
        while running.len() < concurrency && failure.is_none() && !cancel.is_cancelled() {
            let share = {
                let mut purse = ctx.purse.lock().unwrap_or_else(|e| e.into_inner());
                if purse.over {
                    None
                } else {
                    match purse.cap {
                        None => Some(None),
                        Some(cap) => {
                            let left = cap - purse.spent - purse.promised;
                            if left <= 0.0 {
                                purse.over = true;
                                None
                            } else {
                                // What is left, shared by the free slots: the caps of runs in
                                // flight never add up past the evaluation's.
                                let share = left / (concurrency - running.len()) as f64;
                                purse.promised += share;
                                Some(Some(share))
                            }
                        }
                    }
                }
            };
            let Some(share) = share else { break };
            let Some(job) = pending.next() else {
                if let Some(s) = share {
                    ctx.purse.lock().unwrap_or_else(|e| e.into_inner()).promised -= s;
                }
                break;
            };
            let ctx = ctx.clone();
            let cancel = cancel.clone();
            running.push(async move {
                let out = run_one(&ctx, &job, share, &cancel).await;
                (share, out)
            });
        }
        let Some((share, out)) = running.next().await else { break };
        let mut purse = ctx.purse.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = share {
            purse.promised -= s;
        }
        match out {
            Ok(Some(budget_hit)) if budget_hit => purse.over = true,
            Ok(_) => {}
            Err(e) => failure = failure.or(Some(e)),
        }
    }
    if let Some(e) = failure {
        return Err(e);
    }
    if cancel.is_cancelled() {
        return Ok(Some(Ended::Stopped));
    }
    let over = ctx.purse.lock().unwrap_or_else(|e| e.into_inner()).over;
    if over {
        (ctx.progress)(Progress::Note(
            "the spending cap is reached: run again with a higher --max-cost-usd to go on".into(),
        ));
        return Ok(Some(Ended::OverBudget));
    }
    Ok(None)
}

/// The question as every strategy sends it: the item, then how to write the answer.
pub fn prompt(item: &Item) -> String {
    let question = item.question.trim_end();
    let how = match item.kind {
        Kind::Number => "Solve the problem. End your reply with a final line of the form `#### <number>`.",
        Kind::Choice => "Choose one option. End your reply with a final line of the form `Answer: <letter>`.",
        Kind::Exact => "End your reply with the final answer alone on its last line.",
        Kind::Code => {
            const BLOCK: &str = "Reply with the whole function in one ```python code block.";
            return match item.code_stub() {
                Some(stub) if stub == item.question => {
                    format!("{question}\n\nComplete the Python function above. {BLOCK}")
                }
                Some(stub) => {
                    format!(
                        "{question}\n\n```python\n{}\n```\n\nComplete the Python function above. {BLOCK}",
                        stub.trim_end()
                    )
                }
                None => format!(
                    "{question}\n\nWrite it as a Python function named `{}`, with the imports it needs. {BLOCK}",
                    item.entry_point.as_deref().unwrap_or_default()
                ),
            };
        }
    };
    format!("{question}\n\n{how}")
}

/// MoA's aggregation instruction (after togethercomputer/MoA's aggregator prompt).
fn aggregate_prompt(question: &str) -> String {
    format!(
        "You have been given answers from several models to the question below. Some may be wrong. \
         Evaluate them critically and write one accurate, complete reply of your own; do not just copy one.\n\n{question}"
    )
}

/// Makes one run and records its result. `Ok(Some(true))`: the run was refused by the
/// spending cap (not recorded; a resume with a higher cap redoes it). `Ok(None)`: stopped.
async fn run_one(
    ctx: &RunCtx<'_>,
    job: &Job,
    share: Option<f64>,
    cancel: &CancellationToken,
) -> Result<Option<bool>, EvalError> {
    let h = &ctx.harness;
    let item = &ctx.items[job.item];
    let question = prompt(item);
    let one = |w: usize, subtask: String, access: Access| Step { model_id: w, subtask, access };
    let plan = match &job.what {
        Run::Conductor => None,
        Run::Single(w) => Some(Plan { steps: vec![one(*w, question.clone(), Access::Steps(vec![]))] }),
        Run::Moa { aggregator } => {
            let proposers = h.workers.len().min(h.executor.options().max_steps.saturating_sub(1).max(1));
            let mut steps: Vec<Step> =
                (0..proposers).map(|w| one(w, question.clone(), Access::Steps(vec![]))).collect();
            steps.push(one(*aggregator, aggregate_prompt(&question), Access::All));
            Some(Plan { steps })
        }
        Run::BestOfN { worker, n } => {
            Some(Plan { steps: (0..*n).map(|_| one(*worker, question.clone(), Access::Steps(vec![]))).collect() })
        }
    };
    let title = format!("{} · {} · {}", ctx.id, job.strategy, item.id);
    let conversation = h.store.create_evaluation_conversation(&ctx.id, &title).await?;
    let recorder = h.store.recorder(Some(conversation));
    let run_id = new_run_id();
    let request = RunRequest {
        run_id: run_id.clone(),
        question: question.clone(),
        plan,
        budget: share.map(|usd| Budget { max_cost_usd: Some(usd), ..Budget::default() }),
        ..RunRequest::default()
    };
    // The share is counted as spent before the run starts, so a process killed mid-run leaves
    // the history saying at least what it may have spent; the difference is settled after.
    let promised = share.unwrap_or(0.0);
    h.store.add_evaluation_spend(&ctx.id, promised).await?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let collect = async move {
        let mut recorder = Some(recorder);
        let mut outputs: BTreeMap<usize, String> = BTreeMap::new();
        let mut planned = false;
        let mut steps = 0u32;
        let mut budget_hit = false;
        let mut refused_key: Option<String> = None;
        while let Some(event) = rx.recv().await {
            // A history write that fails must not lose the run's result: note it, and record no
            // more of this run (later events would refer to rows that are not there).
            if let Some(r) = &mut recorder
                && let Err(e) = r.record(&event).await
            {
                tracing::warn!("evaluation run not fully recorded: {e}");
                recorder = None;
            }
            match &event {
                RunEvent::PlanReady { round: 0, .. } => planned = true,
                RunEvent::StepStarted { .. } => steps += 1,
                RunEvent::StepFinished { round: 0, step, output, .. } => {
                    outputs.insert(*step, output.clone());
                }
                RunEvent::StepFailed { error, .. } if error.kind == baton_engine::StepErrorKind::Budget => {
                    budget_hit = true;
                }
                RunEvent::StepFailed { error, .. } if error.kind == baton_engine::StepErrorKind::Auth => {
                    refused_key = Some(error.message.clone());
                }
                _ => {}
            }
        }
        (outputs, planned, steps, budget_hit, refused_key)
    };
    let executor = h.executor.clone();
    let run = async move {
        let outcome = executor.run(request, &tx, cancel).await;
        drop(tx);
        outcome
    };
    let (outcome, (outputs, planned, steps, budget_hit, refused_key)) = tokio::join!(run, collect);
    let totals = &outcome.totals;
    {
        let mut purse = ctx.purse.lock().unwrap_or_else(|e| e.into_inner());
        purse.spent += totals.cost_usd;
    }
    h.store.add_evaluation_spend(&ctx.id, totals.cost_usd - promised).await?;
    if outcome.status == RunStatus::Cancelled || cancel.is_cancelled() {
        return Ok(None);
    }
    // A refused key is the user's to fix, not the strategy's failure: scoring every item wrong
    // for it would be final (a resume skips recorded items).
    if let Some(message) = refused_key {
        return Err(EvalError::Settings(format!(
            "a worker refused its key ({message}); fix the key (Workers & keys, or `baton keys set`) and run again with the same id"
        )));
    }
    // A run cut short by its share of the cap is not a result: a resume with a higher cap
    // makes it again.
    if budget_hit || outcome.error.as_ref().is_some_and(|e| e.kind == baton_engine::RunErrorKind::BudgetExceeded) {
        return Ok(Some(true));
    }
    let answer = match &job.what {
        Run::BestOfN { .. } => vote(item, outputs.values().map(String::as_str)),
        _ => outcome.answer.clone(),
    };
    let scored = score(ctx.sandbox.as_deref(), item, answer.as_deref()).await?;
    let error = match (&outcome.error, scored.error) {
        (Some(e), _) => Some(e.message.clone()),
        (None, e) => e,
    };
    let row = EvalResult {
        strategy: job.strategy.clone(),
        item_id: item.id.clone(),
        repeat: job.repeat,
        split: if job.calibration { "calibration" } else { "test" }.into(),
        category: item.stratum().to_owned(),
        run_uid: Some(run_id),
        run_id: None,
        answer,
        extracted: scored.extracted,
        correct: scored.correct,
        error,
        plan_valid: matches!(job.what, Run::Conductor).then_some(planned),
        steps: Some(steps),
        calls: totals.calls,
        input_tokens: totals.usage.input_tokens,
        cached_input_tokens: totals.usage.cached_input_tokens,
        output_tokens: totals.usage.output_tokens,
        conductor_input_tokens: totals.conductor.usage.input_tokens,
        conductor_cached_input_tokens: totals.conductor.usage.cached_input_tokens,
        conductor_output_tokens: totals.conductor.usage.output_tokens,
        cost_usd: totals.cost_usd,
        cost_complete: totals.cost_complete,
        latency_ms: totals.wall_ms,
    };
    h.store.put_eval_result(&ctx.id, &row).await?;
    let spent = ctx.purse.lock().unwrap_or_else(|e| e.into_inner()).spent;
    (ctx.progress)(Progress::Scored {
        strategy: job.strategy.clone(),
        item: item.id.clone(),
        correct: row.correct,
        cost_usd: row.cost_usd,
        spent_usd: spent,
    });
    Ok(Some(false))
}

/// An answer checked against the item.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    pub extracted: Option<String>,
    pub correct: bool,
    /// Why it could not be right beyond its content (no answer, the sandbox stopped it).
    pub error: Option<String>,
}

/// Scores `answer` for `item` (code items run in `sandbox`).
pub async fn score(sandbox: Option<&Sandbox>, item: &Item, answer: Option<&str>) -> Result<Scored, EvalError> {
    let Some(answer) = answer.filter(|a| !a.trim().is_empty()) else {
        return Ok(Scored { extracted: None, correct: false, error: Some("no answer".into()) });
    };
    Ok(match item.kind {
        Kind::Number => {
            let extracted = extract::extract_number(answer);
            let correct =
                match (extracted.as_deref().and_then(extract::parse_number), extract::parse_number(&item.answer)) {
                    (Some(a), Some(b)) => extract::same_number(a, b),
                    _ => false,
                };
            Scored { extracted, correct, error: None }
        }
        Kind::Choice => {
            let extracted = extract::extract_choice(answer, item.option_count()).map(String::from);
            let correct = extracted.as_deref() == Some(item.answer.as_str());
            Scored { extracted, correct, error: None }
        }
        Kind::Exact => {
            let extracted = extract::extract_exact(answer);
            let correct = extracted.as_deref().is_some_and(|e| {
                match (extract::parse_number(e), extract::parse_number(&item.answer)) {
                    (Some(a), Some(b)) => extract::same_number(a, b),
                    _ => extract::normalize_exact(e) == extract::normalize_exact(&item.answer),
                }
            });
            Scored { extracted, correct, error: None }
        }
        Kind::Code => {
            let code = extract::extract_code(answer);
            let sandbox = sandbox.ok_or_else(|| EvalError::Settings("code items need the sandbox".into()))?;
            // Only a stub goes before the answer: prose there would be a syntax error.
            let program = Sandbox::program(
                item.code_stub().unwrap_or_default(),
                &code,
                item.tests.as_deref().unwrap_or_default(),
                item.entry_point.as_deref().unwrap_or_default(),
            );
            let out = sandbox.run(&program).await?;
            Scored { extracted: Some(code), correct: out.passed, error: out.reason }
        }
    })
}

/// The key two answers agree on, for voting.
fn vote_key(item: &Item, answer: &str) -> Option<String> {
    match item.kind {
        Kind::Number => {
            extract::extract_number(answer).and_then(|e| extract::parse_number(&e)).map(|v| format!("{v:.9}"))
        }
        Kind::Choice => extract::extract_choice(answer, item.option_count()).map(String::from),
        Kind::Exact => extract::extract_exact(answer).map(|e| extract::normalize_exact(&e)),
        Kind::Code => None,
    }
}

/// Self-consistency: the answer whose extracted form is most common (ties: the earliest).
/// Code answers cannot be compared this way; the first sample stands.
fn vote<'a>(item: &Item, answers: impl Iterator<Item = &'a str>) -> Option<String> {
    let answers: Vec<&str> = answers.collect();
    let mut counts: Vec<(String, usize, usize)> = Vec::new(); // key, count, first index
    for (i, a) in answers.iter().enumerate() {
        let Some(k) = vote_key(item, a) else { continue };
        match counts.iter_mut().find(|(key, _, _)| *key == k) {
            Some(c) => c.1 += 1,
            None => counts.push((k, 1, i)),
        }
    }
    let best = counts.iter().max_by(|a, b| a.1.cmp(&b.1).then(b.2.cmp(&a.2)));
    match best {
        Some((_, _, first)) => Some(answers[*first].to_owned()),
        None => answers.first().map(|a| (*a).to_owned()),
    }
}

/// `limit` items drawn round-robin across categories, each category shuffled with `seed`, so
/// every category keeps its share. All items (in file order) without a limit.
fn select(items: &[Item], limit: Option<usize>, seed: u64) -> Vec<Item> {
    let Some(limit) = limit.filter(|l| *l < items.len()) else { return items.to_vec() };
    let mut groups: BTreeMap<&str, Vec<&Item>> = BTreeMap::new();
    for item in items {
        groups.entry(item.stratum()).or_default().push(item);
    }
    let mut rng = fastrand::Rng::with_seed(seed);
    for g in groups.values_mut() {
        rng.shuffle(g);
    }
    let mut out = Vec::new();
    let mut round = 0;
    while out.len() < limit {
        for g in groups.values() {
            if let Some(item) = g.get(round)
                && out.len() < limit
            {
                out.push((*item).clone());
            }
        }
        round += 1;
    }
    out
}

/// The share of calibration items when the suite pins its items to splits (any item has
/// `split`), else `None`.
fn pinned_share(items: &[Item]) -> Option<f64> {
    if !items.iter().any(|i| i.split.is_some()) {
        return None;
    }
    let calibration = items.iter().filter(|i| i.split.as_deref() == Some("calibration")).count();
    Some(calibration as f64 / items.len().max(1) as f64)
}

/// The items' own splits when the suite pins them (see [`Item::split`]); else marks `fraction`
/// of each category (rounded, at least one where a category has two or more items and the
/// fraction is not zero) as calibration.
fn split(items: &[Item], fraction: f64, seed: u64) -> Vec<bool> {
    if items.iter().any(|i| i.split.is_some()) {
        return items.iter().map(|i| i.split.as_deref() == Some("calibration")).collect();
    }
    let mut out = vec![false; items.len()];
    if fraction <= 0.0 {
        return out;
    }
    let mut groups: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (i, item) in items.iter().enumerate() {
        groups.entry(item.stratum()).or_default().push(i);
    }
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x5eed_ca1b);
    for g in groups.values_mut() {
        rng.shuffle(g);
        let take = if g.len() >= 2 { ((g.len() as f64 * fraction).round() as usize).clamp(1, g.len() - 1) } else { 0 };
        for &i in &g[..take] {
            out[i] = true;
        }
    }
    out
}

/// Per category, the worker with the best calibration accuracy (ties: the better overall, then
/// pool order); and the best worker overall (MoA's aggregator).
fn lookup_table(
    results: &[EvalResult],
    workers: &[String],
    items: &[Item],
) -> (BTreeMap<String, String>, Option<String>) {
    let ids: HashSet<&str> = items.iter().map(|i| i.id.as_str()).collect();
    let mut per: HashMap<(&str, usize), (u32, u32)> = HashMap::new();
    let mut overall: Vec<(u32, u32)> = vec![(0, 0); workers.len()];
    for r in results.iter().filter(|r| r.split == "calibration" && ids.contains(r.item_id.as_str())) {
        let Some(w) = workers.iter().position(|w| r.strategy == format!("single:{w}")) else { continue };
        let e = per.entry((r.category.as_str(), w)).or_default();
        e.0 += u32::from(r.correct);
        e.1 += 1;
        overall[w].0 += u32::from(r.correct);
        overall[w].1 += 1;
    }
    let rate = |(c, n): (u32, u32)| if n == 0 { -1.0 } else { f64::from(c) / f64::from(n) };
    let categories: HashSet<&str> = per.keys().map(|(c, _)| *c).collect();
    let mut table = BTreeMap::new();
    for c in categories {
        let best = (0..workers.len()).max_by(|&a, &b| {
            let ka = (rate(per.get(&(c, a)).copied().unwrap_or_default()), rate(overall[a]));
            let kb = (rate(per.get(&(c, b)).copied().unwrap_or_default()), rate(overall[b]));
            ka.partial_cmp(&kb).unwrap_or(std::cmp::Ordering::Equal).then(b.cmp(&a))
        });
        if let Some(w) = best {
            table.insert(c.to_owned(), workers[w].clone());
        }
    }
    let best = (0..workers.len())
        .filter(|&w| overall[w].1 > 0)
        .max_by(|&a, &b| {
            rate(overall[a]).partial_cmp(&rate(overall[b])).unwrap_or(std::cmp::Ordering::Equal).then(b.cmp(&a))
        })
        .map(|w| workers[w].clone());
    (table, best)
}

/// `n` for best-of-n: the conductor's mean cost per test item over the worker's (dollars, or
/// tokens where either is unpriced), rounded; 3 without conductor results.
fn matched_n(results: &[EvalResult], single: &str) -> u32 {
    let of =
        |s: &str| -> Vec<&EvalResult> { results.iter().filter(|r| r.strategy == s && r.split == "test").collect() };
    let (conductor, worker) = (of("conductor"), of(single));
    if conductor.is_empty() || worker.is_empty() {
        return 3;
    }
    let dollars = |rs: &[&EvalResult]| rs.iter().map(|r| r.cost_usd).sum::<f64>() / rs.len() as f64;
    let tokens = |rs: &[&EvalResult]| {
        rs.iter().map(|r| (r.input_tokens + r.output_tokens) as f64).sum::<f64>() / rs.len() as f64
    };
    let priced = conductor.iter().chain(&worker).all(|r| r.cost_complete) && dollars(&worker) > 0.0;
    let ratio =
        if priced { dollars(&conductor) / dollars(&worker) } else { tokens(&conductor) / tokens(&worker).max(1.0) };
    ratio.round().max(1.0) as u32
}

/// The derived strategy's rows, from the single workers' test results of each repeat.
#[allow(clippy::too_many_arguments)]
fn derive(
    strategy: &Strategy,
    results: &[EvalResult],
    workers: &[String],
    items: &[Item],
    test: &[usize],
    repeats: u32,
    lookup: &BTreeMap<String, String>,
    fallback: usize,
    seed: u64,
) -> Vec<EvalResult> {
    let single: HashMap<(&str, &str, u32), &EvalResult> = results
        .iter()
        .filter(|r| r.strategy.starts_with("single:"))
        .map(|r| ((r.strategy.as_str(), r.item_id.as_str(), r.repeat), r))
        .collect();
    let keys: Vec<String> = workers.iter().map(|w| format!("single:{w}")).collect();
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x7a4d_0e11);
    let mut out = Vec::new();
    for &i in test {
        let item = &items[i];
        for r in 0..repeats {
            let of = |w: usize| single.get(&(keys[w].as_str(), item.id.as_str(), r)).copied();
            let chosen = match strategy {
                Strategy::RouterLookup => {
                    let w = lookup
                        .get(item.stratum())
                        .and_then(|name| workers.iter().position(|x| x == name))
                        .unwrap_or(fallback);
                    of(w)
                }
                Strategy::RouterRandom => of(rng.usize(..workers.len().max(1))),
                Strategy::Oracle => {
                    // Right if any worker is; it had to ask them all, so it pays for all.
                    let all: Vec<&EvalResult> = (0..workers.len()).filter_map(of).collect();
                    let Some(first) = all.iter().find(|x| x.correct).or(all.first()).copied() else { continue };
                    let mut row = first.clone();
                    row.calls = all.iter().map(|x| x.calls).sum();
                    row.input_tokens = all.iter().map(|x| x.input_tokens).sum();
                    row.cached_input_tokens = all.iter().map(|x| x.cached_input_tokens).sum();
                    row.output_tokens = all.iter().map(|x| x.output_tokens).sum();
                    row.cost_usd = all.iter().map(|x| x.cost_usd).sum();
                    row.cost_complete = all.iter().all(|x| x.cost_complete);
                    row.latency_ms = all.iter().map(|x| x.latency_ms).max().unwrap_or(0);
                    row.strategy = strategy.key();
                    out.push(row);
                    continue;
                }
                _ => None,
            };
            if let Some(c) = chosen {
                let mut row = c.clone();
                row.strategy = strategy.key();
                out.push(row);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(id: &str, category: &str) -> Item {
        Item {
            id: id.into(),
            question: format!("q {id}"),
            answer: "1".into(),
            kind: Kind::Number,
            category: Some(category.into()),
            choices: None,
            entry_point: None,
            tests: None,
            prompt: None,
            split: None,
        }
    }

    #[test]
    fn items_that_name_their_split_keep_it() {
        let mut items: Vec<Item> = (0..10).map(|i| item(&i.to_string(), "a")).collect();
        assert_eq!(pinned_share(&items), None);
        items[3].split = Some("calibration".into());
        items[7].split = Some("calibration".into());
        items[0].split = Some("test".into());
        assert_eq!(pinned_share(&items), Some(0.2));
        let cal = split(&items, 0.5, 1);
        let marked: Vec<usize> = (0..10).filter(|i| cal[*i]).collect();
        assert_eq!(marked, [3, 7], "exactly the pinned items, whatever the fraction or seed");
    }

    #[test]
    fn selection_and_splits_are_stratified_and_seeded() {
        let items: Vec<Item> = (0..30).map(|i| item(&i.to_string(), if i < 20 { "a" } else { "b" })).collect();
        let picked = select(&items, Some(9), 1);
        assert_eq!(picked.len(), 9);
        let b = picked.iter().filter(|i| i.stratum() == "b").count();
        assert!((4..=5).contains(&b), "{b}");
        assert_eq!(picked, select(&items, Some(9), 1));
        let cal = split(&items, 0.3, 1);
        let in_a = items.iter().zip(&cal).filter(|(i, c)| **c && i.stratum() == "a").count();
        let in_b = items.iter().zip(&cal).filter(|(i, c)| **c && i.stratum() == "b").count();
        assert_eq!((in_a, in_b), (6, 3));
        assert!(split(&items, 0.0, 1).iter().all(|c| !c));
    }

    #[test]
    fn votes_take_the_most_common_answer() {
        let it = item("x", "a");
        let answers = ["#### 2", "so 1\n#### 1", "#### 1.0", "#### 2"];
        // 1 and 2 tie at two votes; 2 came first.
        assert_eq!(vote(&it, answers.iter().copied()).as_deref(), Some("#### 2"));
        let answers = ["#### 3", "#### 1", "#### 1.0"];
        assert_eq!(vote(&it, answers.iter().copied()).as_deref(), Some("#### 1"));
        assert_eq!(vote(&it, std::iter::empty()), None);
    }

    fn code_item(question: &str, prompt: Option<&str>) -> Item {
        Item {
            id: "c".into(),
            question: question.into(),
            answer: String::new(),
            kind: Kind::Code,
            category: None,
            choices: None,
            entry_point: Some("add".into()),
            tests: Some("def check(candidate):\n    assert candidate(2, 3) == 5\n".into()),
            prompt: prompt.map(str::to_owned),
            split: None,
        }
    }

    /// A prose item (MBPP's form), a stub item (HumanEval's) and prose with a separate stub are
    /// each worded for their form and scored right for a right answer, wrong for a wrong one.
    #[tokio::test]
    async fn code_items_are_scored_in_the_form_they_are_written() {
        let sandbox = Sandbox::new(crate::sandbox::Limits::default()).expect("python for the sandbox");
        let prose = code_item("Write a function that adds two numbers.", None);
        let stub = code_item("def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n", None);
        // A stub is valid Python on its own (HumanEval's have a docstring for a body), so a whole
        // function written after it replaces it.
        let both = code_item("Add two numbers.", Some("import math\n\ndef add(a, b):\n    \"\"\"Add.\"\"\"\n"));
        assert!(prompt(&prose).contains("Python function named `add`"), "{}", prompt(&prose));
        assert!(!prompt(&prose).contains("above"));
        assert!(
            prompt(&stub).starts_with("def add(a, b):") && prompt(&stub).contains("Complete the Python function above")
        );
        assert!(
            prompt(&both).contains("```python\nimport math\n\ndef add(a, b):\n    \"\"\"Add.\"\"\"\n```"),
            "{}",
            prompt(&both)
        );
        let right = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```";
        let wrong = "```python\ndef add(a, b):\n    return a - b\n```";
        for item in [&prose, &stub, &both] {
            let scored = score(Some(&sandbox), item, Some(right)).await.expect("scored");
            assert!(scored.correct, "{}: {scored:?}", item.question);
            let scored = score(Some(&sandbox), item, Some(wrong)).await.expect("scored");
            assert!(!scored.correct, "{}: {scored:?}", item.question);
        }
        // A body alone completes a stub (HumanEval's canonical form).
        let body = "```python\n    return a + b\n```";
        assert!(score(Some(&sandbox), &stub, Some(body)).await.expect("scored").correct);
    }
}

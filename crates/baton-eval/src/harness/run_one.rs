//! One run: the item worded as every strategy asks it, sent through the executor by the job's
//! plan, recorded in the history like any other run, scored, and its result kept. What a run is
//! given is here too (its `Job`, and the `RunCtx` every run of an evaluation shares, with the
//! `Purse` it spends from), so that `jobs.rs`, which makes many at once, depends on this module
//! and not the other way round.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use baton_engine::{Budget, Executor, RunEvent, RunOutcome, RunRequest, RunStatus, new_run_id};
use baton_plan::{Access, Plan, Step};
use baton_store::Store;
use baton_store::evaluations::EvalResult;
use tokio_util::sync::CancellationToken;

use super::scoring::{score, vote};
use super::{EvalError, Harness, Progress};
use crate::sandbox::Sandbox;
use crate::suite::{Item, Kind};

/// One run to make.
#[derive(Debug, Clone)]
pub(super) struct Job {
    /// The strategy's key, as results are stored under.
    pub(super) strategy: String,
    pub(super) what: Run,
    /// Index into the evaluation's items.
    pub(super) item: usize,
    pub(super) repeat: u32,
    pub(super) calibration: bool,
}

/// What a job sends to the executor (workers by their index in the pool).
#[derive(Debug, Clone)]
pub(super) enum Run {
    Conductor,
    Single(usize),
    Moa {
        aggregator: usize,
    },
    BestOfN {
        worker: usize,
        n: u32,
    },
    /// A workflow of a learning run's search.
    Workflow(baton_engine::workflow::Workflow),
}

/// The shared state of the runs in flight: what has been spent and what is promised to runs
/// still going, so their caps never add up past the evaluation's. `jobs::run_jobs` promises each
/// run its share; the run adds what it spent.
pub(super) struct Purse {
    pub(super) cap: Option<f64>,
    pub(super) spent: f64,
    pub(super) promised: f64,
    pub(super) over: bool,
}

/// What every run of one evaluation shares.
pub(super) struct RunCtx<'p> {
    pub(super) harness: Harness,
    /// The evaluation's id.
    pub(super) id: String,
    pub(super) items: Vec<Item>,
    pub(super) sandbox: Option<Arc<Sandbox>>,
    pub(super) purse: Mutex<Purse>,
    pub(super) progress: &'p (dyn Fn(Progress) + Send + Sync),
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

/// The plan `what` is run by; `None` leaves the planning to the conductor.
fn plan_for(h: &Harness, what: &Run, question: &str) -> Option<Plan> {
    let one = |w: usize, subtask: String, access: Access| Step { model_id: w, subtask, access };
    match what {
        Run::Conductor => None,
        Run::Single(w) => Some(Plan { steps: vec![one(*w, question.to_owned(), Access::Steps(vec![]))] }),
        Run::Moa { aggregator } => {
            let proposers = h.workers.len().min(h.executor.options().max_steps.saturating_sub(1).max(1));
            let mut steps: Vec<Step> =
                (0..proposers).map(|w| one(w, question.to_owned(), Access::Steps(vec![]))).collect();
            steps.push(one(*aggregator, aggregate_prompt(question), Access::All));
            Some(Plan { steps })
        }
        Run::BestOfN { worker, n } => {
            Some(Plan { steps: (0..*n).map(|_| one(*worker, question.to_owned(), Access::Steps(vec![]))).collect() })
        }
        Run::Workflow(flow) => Some(flow.plan(&[], question)),
    }
}

/// Makes one run and records its result. `Ok(Some(true))`: the run was refused by the
/// spending cap (not recorded; a resume with a higher cap redoes it). `Ok(None)`: stopped.
pub(super) async fn run_one(
    ctx: &RunCtx<'_>,
    job: &Job,
    share: Option<f64>,
    cancel: &CancellationToken,
) -> Result<Option<bool>, EvalError> {
    let h = &ctx.harness;
    let item = &ctx.items[job.item];
    let question = prompt(item);
    let plan = plan_for(h, &job.what, &question);
    let title = format!("{} · {} · {}", ctx.id, job.strategy, item.id);
    let conversation = h.store.create_evaluation_conversation(&ctx.id, &title).await?;
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
    let (outcome, seen) = run_noting(&h.store, &h.executor, conversation, request, cancel).await;
    let Seen { outputs, planned, steps, budget_hit, refused_key } = seen;
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
        kind: Some(item.kind.as_str().to_owned()),
        run_uid: Some(run_id),
        run_id: None,
        answer,
        extracted: scored.extracted,
        correct: scored.correct,
        error,
        plan_valid: matches!(job.what, Run::Conductor).then_some(planned),
        steps: Some(steps),
        figures: totals.all(),
        conductor_usage: totals.conductor.usage,
        latency_ms: totals.wall_ms,
    };
    h.store.put_eval_result(&ctx.id, &row).await?;
    let spent = ctx.purse.lock().unwrap_or_else(|e| e.into_inner()).spent;
    (ctx.progress)(Progress::Scored {
        strategy: job.strategy.clone(),
        item: item.id.clone(),
        correct: row.correct,
        cost_usd: row.figures.cost_usd,
        spent_usd: spent,
    });
    Ok(Some(false))
}

/// What the harness reads from a run's events, beyond what its outcome says.
#[derive(Debug, Default)]
struct Seen {
    /// The first round's step outputs, by step (best-of-n votes over them).
    outputs: BTreeMap<usize, String>,
    /// A first-round plan was ready (kept as the conductor's `plan_valid`).
    planned: bool,
    /// Steps started.
    steps: u32,
    /// A step failed on the run's budget (its share of the spending cap).
    budget_hit: bool,
    /// A worker's key refused, with the provider's message.
    refused_key: Option<String>,
}

impl Seen {
    fn note(&mut self, event: &RunEvent) {
        match event {
            RunEvent::PlanReady { round: 0, .. } => self.planned = true,
            RunEvent::StepStarted { .. } => self.steps += 1,
            RunEvent::StepFinished { round: 0, step, output, .. } => {
                self.outputs.insert(*step, output.clone());
            }
            RunEvent::StepFailed { error, .. } if error.kind == baton_engine::StepErrorKind::Budget => {
                self.budget_hit = true;
            }
            RunEvent::StepFailed { error, .. } if error.kind == baton_engine::StepErrorKind::Auth => {
                self.refused_key = Some(error.message.clone());
            }
            _ => {}
        }
    }
}

/// Makes the run through the executor, recording it in the history (in `conversation`) as its
/// events arrive, and notes what the harness reads from them once each is recorded.
async fn run_noting(
    store: &Store,
    executor: &Executor,
    conversation: i64,
    request: RunRequest,
    cancel: &CancellationToken,
) -> (RunOutcome, Seen) {
    let recorder = Some(store.recorder(Some(conversation)));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let noted = seen.clone();
    let note = move |event: RunEvent| noted.lock().unwrap_or_else(|e| e.into_inner()).note(&event);
    // A history write that fails must not lose the run's result: it is noted, and no more of
    // this run is recorded.
    let warn = |e: baton_store::StoreError| tracing::warn!("evaluation run not fully recorded: {e}");
    let (outcome, _) = baton_store::relay::run_kept(executor, request, cancel, recorder, note, warn).await;
    // `run_kept` returns once the relay has ended: every event is noted.
    let seen = std::mem::take(&mut *seen.lock().unwrap_or_else(|e| e.into_inner()));
    (outcome, seen)
}

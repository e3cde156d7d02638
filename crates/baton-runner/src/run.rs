//! Asking a question with its history recorded: the conductor plans (or a written plan is
//! given) and the pool runs it, each event kept in the history before a front end shows it.

use baton_engine::{Executor, Pool, RunEvent, RunOutcome, RunRequest, new_run_id};
use baton_plan::{Limits, Plan};
use baton_providers::Message;
use baton_store::{Recorder, Store, StoreError};
use tokio_util::sync::CancellationToken;

use crate::RunnerError;
use crate::build::{Conductor, Context};

/// A question to run.
#[derive(Debug, Clone, Default)]
pub struct Ask {
    pub question: String,
    /// Continue this conversation of the history (the conductor sees its earlier turns);
    /// `None` starts one.
    pub conversation: Option<i64>,
    /// A written (or reviewed) plan to run instead of asking the conductor. It runs without
    /// a conductor, so it may not hand steps back to one.
    pub plan: Option<Plan>,
}

/// A run that has ended, and where the history kept it.
#[derive(Debug)]
pub struct Recorded {
    pub outcome: RunOutcome,
    /// The run's id in the history; `None` when it was not (fully) recorded.
    pub run_id: Option<i64>,
    /// The conversation it was asked in: reported even if the history could not record the run.
    pub conversation_id: Option<i64>,
}

/// Asks `ask` of `pool` and records the run in `store` (none: nothing is recorded, and a
/// conversation cannot be continued), handing each event to `show` once it is kept.
///
/// Everything that can refuse the question does so before a call is made: an empty question,
/// a plan the pool cannot run, a conversation the history does not have, a conductor that
/// cannot load, a stop while models loaded.
pub async fn ask(
    pool: Pool,
    context: Context<'_>,
    store: Option<&Store>,
    ask: Ask,
    show: impl FnMut(RunEvent) + Send + 'static,
    on_history_error: impl FnOnce(StoreError) + Send + 'static,
    cancel: &CancellationToken,
) -> Result<Recorded, RunnerError> {
    let question = ask.question.trim().to_owned();
    if question.is_empty() {
        return Err(RunnerError::BadInput("the question is empty".into()));
    }
    if let Some(plan) = &ask.plan {
        check_plan(plan, &pool)?;
    }
    let history = match store {
        Some(store) => conversation_so_far(store, ask.conversation).await?,
        None if ask.conversation.is_some() => {
            return Err(RunnerError::BadInput("a conversation is continued only with the history on".into()));
        }
        None => Vec::new(),
    };
    let conductor = if ask.plan.is_none() { Conductor::Required } else { Conductor::None };
    let built = crate::build(pool, context.setup(conductor, store)).await?;
    // Stopped while the models loaded: nothing has started, so nothing is recorded.
    if cancel.is_cancelled() {
        return Err(RunnerError::Cancelled("the run was stopped before it started".into()));
    }
    let recorder = store.map(|s| s.recorder(ask.conversation));
    let request = RunRequest { run_id: new_run_id(), question, history, plan: ask.plan, ..RunRequest::default() };
    Ok(run_in_conversation(&built.executor, request, recorder, show, on_history_error, cancel).await)
}

/// Checks a written plan against `pool` with the rules a run applies: its workers exist, it
/// has at most the pool's steps, and it does not hand work back to a conductor.
pub fn check_plan(plan: &Plan, pool: &Pool) -> Result<(), RunnerError> {
    let limits = Limits { max_steps: pool.options.max_steps, pool_size: Some(pool.workers.len()), allow_stop: false };
    plan.validate(&limits).map_err(|e| RunnerError::BadInput(e.to_string()))
}

/// Runs `request` through the one recording driver ([`baton_store::relay::run_kept`]), kept by
/// `recorder` (none: not recorded) in its conversation, and says where it was kept; for a run
/// a front end composes itself (the app's compare in chat runs two side by side).
///
/// A history that fails mid-run must not cost the answer: the first error goes to
/// `on_history_error`, and the run goes on unrecorded.
pub async fn run_in_conversation(
    executor: &Executor,
    request: RunRequest,
    recorder: Option<Recorder>,
    show: impl FnMut(RunEvent) + Send + 'static,
    on_history_error: impl FnOnce(StoreError) + Send + 'static,
    cancel: &CancellationToken,
) -> Recorded {
    let asked_in = recorder.as_ref().and_then(Recorder::conversation_id);
    let (outcome, kept) =
        baton_store::relay::run_kept(executor, request, cancel, recorder, show, on_history_error).await;
    let run_id = kept.as_ref().and_then(Recorder::run_id);
    let conversation_id = kept.as_ref().and_then(Recorder::conversation_id).or(asked_in);
    Recorded { outcome, run_id, conversation_id }
}

/// The turns a follow-up in `conversation` is asked with (none for a new one). A conversation
/// the history does not have is refused before anything runs.
pub async fn conversation_so_far(store: &Store, conversation: Option<i64>) -> Result<Vec<Message>, RunnerError> {
    let Some(id) = conversation else { return Ok(Vec::new()) };
    if store.conversation_title(id).await?.is_none() {
        return Err(RunnerError::NotFound(format!("there is no conversation {id} in the history")));
    }
    Ok(store.messages(id).await?)
}

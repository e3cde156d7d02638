//! Runs: a question (or a reviewed plan) goes to the engine, and every `RunEvent` comes back on
//! the run's own IPC channel in order, after the history has recorded it.

use baton_engine::{Executor, Pool, RunEvent, RunRequest, RunStatus, new_run_id};
use baton_plan::Plan;
use baton_runner::run::run_in_conversation;
use baton_runner::{Ask, Conductor, ConductorChoice, Context, LoadNotice, Recorded};
use baton_store::Recorder;
use serde::{Deserialize, Serialize};
use tauri::ipc::Channel;
use tauri::{AppHandle, Emitter, Runtime, State};
use tokio_util::sync::CancellationToken;

use crate::error::{AppError, AppResult, ErrorKind};
use crate::state::AppState;
use crate::timing::TimingLog;

/// Broadcast to every window while a local model loads (mistral.rs reports no finer progress).
pub const CONDUCTOR_EVENT: &str = "conductor-status";
/// Broadcast when a run could not be (fully) recorded; the run itself goes on.
pub const HISTORY_WARNING_EVENT: &str = "history-warning";

#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum ModelLoad {
    Loading { what: String, path: String },
    Loaded { what: String, path: String, seconds: f64, device: String },
    Failed { what: String, path: String },
}

#[derive(Debug, Clone, PartialEq, Deserialize, ts_rs::TS)]
pub struct AskRequest {
    pub question: String,
    /// Continue this conversation (the conductor sees its earlier turns); `null` starts one.
    pub conversation_id: Option<i64>,
    /// The pool workers this conversation may use, by index; `null` for all of them.
    pub workers: Option<Vec<u32>>,
    /// A reviewed plan to run instead of asking the conductor; its worker numbers refer to
    /// `workers` in order.
    pub plan: Option<Plan>,
}

#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct AskResult {
    /// The run's id in the history (`null` if it could not be recorded).
    pub run_id: Option<i64>,
    pub conversation_id: Option<i64>,
    pub status: String,
}

/// Run one step of a finished run again with another worker; the steps that see it run again
/// too, every other step keeps its output. The re-run is a new run in the same conversation.
#[derive(Debug, Clone, PartialEq, Deserialize, ts_rs::TS)]
pub struct RerunRequest {
    /// The finished run, by its id in the history.
    pub run_id: i64,
    /// The step of the question's plan (round 0).
    pub step: u32,
    /// The worker to run it with, by name (numbers change when the pool file is edited).
    pub worker: String,
}

/// A plan for review, before anything runs.
#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct Draft {
    pub plan: Plan,
    /// The conductor's whole text (empty when routed).
    pub raw: String,
    /// Set when no conductor wrote the plan: what the pool learned sends the question to one
    /// worker, and why.
    pub routed: Option<String>,
    pub workers: Vec<baton_engine::WorkerInfo>,
    pub max_steps: u32,
}

/// The pool cut down to the workers a conversation may use, renumbered from 0 as the conductor
/// will see them.
pub fn subset(mut pool: Pool, workers: Option<&[u32]>) -> AppResult<Pool> {
    let Some(chosen) = workers else { return Ok(pool) };
    if chosen.is_empty() {
        return Err(AppError::bad_input("choose at least one worker for this conversation"));
    }
    let mut kept = Vec::with_capacity(chosen.len());
    for &i in chosen {
        let w = pool.workers.get(i as usize).ok_or_else(|| {
            AppError::bad_input(format!("worker {i} is not in the pool any more; choose the workers again"))
        })?;
        kept.push(w.clone());
    }
    pool.workers = kept;
    // The pool's own fallback worker, renumbered as the conversation's workers are; left out of
    // the conversation, it is no one's choice any more and what was learned chooses.
    let fallback = &mut pool.options.fallback;
    fallback.worker = fallback.worker.and_then(|w| chosen.iter().position(|&i| i as usize == w));
    Ok(pool)
}

fn notifier<R: Runtime>(app: &AppHandle<R>) -> impl Fn(LoadNotice<'_>) + Send + Sync + use<R> {
    let app = app.clone();
    move |notice| {
        let status = match notice {
            LoadNotice::Loading { what, path } => {
                ModelLoad::Loading { what: what.to_owned(), path: path.display().to_string() }
            }
            LoadNotice::Loaded { what, path, seconds, device } => ModelLoad::Loaded {
                what: what.to_owned(),
                path: path.display().to_string(),
                seconds,
                device: device.to_owned(),
            },
            LoadNotice::Failed { what, path } => {
                ModelLoad::Failed { what: what.to_owned(), path: path.display().to_string() }
            }
        };
        let _ = app.emit(CONDUCTOR_EVENT, status);
    }
}

/// What the app lends the application layer to load models with: the models it keeps loaded,
/// the pool's own conductor (the app has no override), and load news broadcast to every
/// window.
pub(crate) struct Loader {
    choice: ConductorChoice,
    notify: Box<dyn Fn(LoadNotice<'_>) + Send + Sync>,
}

impl Loader {
    pub(crate) fn new<R: Runtime>(app: &AppHandle<R>) -> Loader {
        Loader { choice: ConductorChoice::default(), notify: Box::new(notifier(app)) }
    }

    pub(crate) fn context<'a>(&'a self, state: &'a AppState) -> Context<'a> {
        Context { models: &state.models, choice: &self.choice, notify: &*self.notify }
    }
}

/// Loads the configured local conductor now, so the first question does not wait for it.
#[tauri::command]
pub async fn load_conductor<R: Runtime>(app: AppHandle<R>, state: State<'_, AppState>) -> AppResult<String> {
    let pool = state.pool()?;
    let planner =
        baton_conductor::setup::planner(&pool, &ConductorChoice::default(), &state.models, &notifier(&app)).await?;
    Ok(planner.describe())
}

/// Runs a question (or `request.plan`) and streams its events on `on_event`. Returns when the
/// run has ended and is recorded. `cancel_run(stop_id)` stops it from the moment this is
/// called: the window chooses the id, so Stop works before the run's first event (while a
/// model loads, say), and the run then ends `cancelled`, or with a `cancelled` error if it had
/// not started yet.
#[tauri::command]
pub async fn ask<R: Runtime>(
    app: AppHandle<R>,
    state: State<'_, AppState>,
    request: AskRequest,
    stop_id: String,
    on_event: Channel<RunEvent>,
) -> AppResult<AskResult> {
    let registration = state.register(&stop_id)?;
    let pool = subset(state.pool()?, request.workers.as_deref())?;
    // The history opens first, so a damaged database costs no provider calls.
    let store = state.store().await?;
    let loader = Loader::new(&app);
    let (show, warn) = on_channel(&app, on_event);
    let ask = Ask { question: request.question, conversation: request.conversation_id, plan: request.plan };
    let recorded =
        baton_runner::ask(pool, loader.context(&state), Some(store), ask, show, warn, &registration.token).await?;
    Ok(answered(recorded))
}

/// Re-runs one step of a finished run with another worker (see [`RerunRequest`]) and streams
/// the re-run's events on `on_event`; `cancel_run(stop_id)` stops it, as for [`ask`].
#[tauri::command]
pub async fn rerun_step<R: Runtime>(
    app: AppHandle<R>,
    state: State<'_, AppState>,
    request: RerunRequest,
    stop_id: String,
    on_event: Channel<RunEvent>,
) -> AppResult<AskResult> {
    let registration = state.register(&stop_id)?;
    let store = state.store().await?;
    let loader = Loader::new(&app);
    let (show, warn) = on_channel(&app, on_event);
    let (step, worker) = (request.step as usize, request.worker.as_str());
    let context = loader.context(&state);
    let recorded = baton_runner::rerun::rerun_step(
        || Pool::load(&state.paths.pool),
        context,
        store,
        request.run_id,
        step,
        worker,
        show,
        warn,
        &registration.token,
    )
    .await?;
    Ok(answered(recorded))
}

/// Compare in chat: the same question asked of the conductor and of one worker alone.
#[derive(Debug, Clone, PartialEq, Deserialize, ts_rs::TS)]
pub struct CompareRequest {
    pub question: String,
    /// Continue this conversation; `null` starts one.
    pub conversation_id: Option<i64>,
    /// The pool workers the conductor may use, by index; `null` for all of them.
    pub workers: Option<Vec<u32>>,
    /// The worker that answers alone, by name (any worker of the pool, chosen or not).
    pub worker: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct CompareResult {
    pub conductor: AskResult,
    pub single: AskResult,
    /// The comparison kept in the history, to mark the better answer (`null` if neither run
    /// could be recorded).
    pub comparison_id: Option<i64>,
}

/// Asks `request.question` of the conductor (streamed on `on_event`, as [`ask`] does) and, at
/// the same time, of `request.worker` alone (streamed on `on_single`); both runs are kept in
/// the conversation, only the conductor's answer joins its turns, and the pair is kept as a
/// comparison whose better answer the user may mark ([`mark_comparison`]). `cancel_run(stop_id)`
/// stops both.
#[tauri::command]
pub async fn ask_compared<R: Runtime>(
    app: AppHandle<R>,
    state: State<'_, AppState>,
    request: CompareRequest,
    stop_id: String,
    on_event: Channel<RunEvent>,
    on_single: Channel<RunEvent>,
) -> AppResult<CompareResult> {
    let registration = state.register(&stop_id)?;
    let question = request.question.trim().to_owned();
    if question.is_empty() {
        return Err(AppError::bad_input("the question is empty"));
    }
    let full = state.pool()?;
    let Some(alone) = full.workers.iter().position(|w| w.name == request.worker) else {
        return Err(AppError::not_found(format!(
            "there is no worker \"{}\" in the pool to compare with; choose another",
            request.worker
        )));
    };
    let identity = full.workers[alone].identity();
    let pool = subset(full.clone(), request.workers.as_deref())?;
    let single_pool = subset(full, Some(&[alone as u32]))?;
    let store = state.store().await?;
    let history = baton_runner::conversation_so_far(store, request.conversation_id).await?;
    let loader = Loader::new(&app);
    let with = |conductor| loader.context(&state).setup(conductor, Some(store));
    let conductor = baton_runner::build(pool, with(Conductor::Required)).await?.executor;
    let single = baton_runner::build(single_pool, with(Conductor::None)).await?.executor;
    // Both runs join one conversation, so a new chat's is made before either starts.
    let (conversation, made) = match request.conversation_id {
        Some(id) => (id, false),
        None => (store.new_conversation(&question).await?, true),
    };
    let single_run = RunRequest {
        run_id: new_run_id(),
        question: question.clone(),
        plan: Some(baton_engine::fallback::alone_plan(0, &history, &question)),
        ..RunRequest::default()
    };
    let conductor_run = RunRequest { run_id: new_run_id(), question, history, ..RunRequest::default() };
    let cancel = &registration.token;
    let (a, b) = tokio::join!(
        side(&app, &conductor, store.recorder(Some(conversation)), conductor_run, on_event, cancel),
        side(&app, &single, store.recorder(Some(conversation)).without_messages(), single_run, on_single, cancel),
    );
    // A side that never started (Stop before its first event) ends as cancelled; only when
    // neither started is there nothing to show.
    let not_started = || AskResult { run_id: None, conversation_id: Some(conversation), status: "cancelled".into() };
    let (a, b) = match (a, b) {
        (Err(e), Err(_)) => {
            // A conversation made for them would stay empty.
            if made && let Err(gone) = store.delete_conversation(conversation).await {
                tracing::warn!("an empty conversation {conversation} is left in the history: {gone}");
            }
            return Err(e);
        }
        (a, b) => (a.unwrap_or_else(|_| not_started()), b.unwrap_or_else(|_| not_started())),
    };
    // Both answers are paid for and recorded: a comparison that cannot be kept loses only the
    // pairing (and the mark), never the answers.
    let comparison_id = if a.run_id.is_some() || b.run_id.is_some() {
        match store.add_comparison(conversation, a.run_id, b.run_id, (&request.worker, &identity)).await {
            Ok(id) => Some(id),
            Err(e) => {
                let _ = app.emit(
                    HISTORY_WARNING_EVENT,
                    format!("the two answers are kept, but not as a comparison to mark: {e}"),
                );
                None
            }
        }
    } else {
        None
    };
    Ok(CompareResult { conductor: a, single: b, comparison_id })
}

/// Marks the better answer of a comparison (`null` takes the mark back).
#[tauri::command]
pub async fn mark_comparison(
    state: State<'_, AppState>,
    id: i64,
    preferred: Option<baton_store::comparisons::Preferred>,
) -> AppResult<()> {
    if !state.store().await?.mark_comparison(id, preferred).await? {
        return Err(AppError::not_found(format!("there is no comparison {id} in the history")));
    }
    Ok(())
}

/// One side of a comparison: `run` recorded by `recorder`, its events on `on_event`; `Err`
/// (cancelled) when stopped before it started, so nothing was recorded.
async fn side<R: Runtime>(
    app: &AppHandle<R>,
    executor: &Executor,
    recorder: Recorder,
    run: RunRequest,
    on_event: Channel<RunEvent>,
    cancel: &CancellationToken,
) -> AppResult<AskResult> {
    if cancel.is_cancelled() {
        return Err(AppError::new(ErrorKind::Cancelled, "the run was stopped before it started"));
    }
    let (show, warn) = on_channel(app, on_event);
    Ok(answered(run_in_conversation(executor, run, Some(recorder), show, warn, cancel).await))
}

/// Where a run's events go once the history keeps them: its `Channel` (a closed window only
/// stops the display, never the run or its record), the timing trace, and a warning to every
/// window when the history fails.
fn on_channel<R: Runtime>(
    app: &AppHandle<R>,
    on_event: Channel<RunEvent>,
) -> (impl FnMut(RunEvent) + Send + 'static, impl FnOnce(baton_store::StoreError) + Send + 'static) {
    let mut timing = TimingLog::for_a_run();
    let show = move |event: RunEvent| {
        if let Some(t) = &mut timing {
            t.observe(&event);
        }
        let _ = on_event.send(event);
    };
    let app = app.clone();
    let warn = move |e: baton_store::StoreError| {
        let _ = app.emit(HISTORY_WARNING_EVENT, format!("this run is not fully recorded in the history: {e}"));
    };
    (show, warn)
}

/// What the window is told of a run that ended.
fn answered(recorded: Recorded) -> AskResult {
    let status = match recorded.outcome.status {
        RunStatus::Finished => "finished",
        RunStatus::Failed => "failed",
        RunStatus::Cancelled => "cancelled",
    };
    AskResult { run_id: recorded.run_id, conversation_id: recorded.conversation_id, status: status.to_owned() }
}

/// Stops a run (calls in flight are dropped and it ends as cancelled) or a plan being drafted,
/// by the id the window gave it (`stop_id`, `draft_id`). `false` if it had ended.
#[tauri::command]
pub fn cancel_run(state: State<'_, AppState>, run_id: String) -> bool {
    match state.runs.lock().unwrap_or_else(|p| p.into_inner()).get(&run_id) {
        Some(token) => {
            token.cancel();
            true
        }
        None => false,
    }
}

/// Checks a plan edited in review against the pool (the same rules a run applies).
#[tauri::command]
pub fn validate_plan(state: State<'_, AppState>, plan: Plan, workers: Option<Vec<u32>>) -> AppResult<()> {
    Ok(baton_runner::run::check_plan(&plan, &subset(state.pool()?, workers.as_deref())?)?)
}

/// The conductor's plan for a question, for review; nothing runs. The conductor's text streams
/// on `on_delta` as it is written; `cancel_run(draft_id)` stops it (the error kind is then
/// `cancelled`).
#[tauri::command]
pub async fn draft_plan<R: Runtime>(
    app: AppHandle<R>,
    state: State<'_, AppState>,
    question: String,
    conversation_id: Option<i64>,
    workers: Option<Vec<u32>>,
    draft_id: String,
    on_delta: Channel<String>,
) -> AppResult<Draft> {
    // Stoppable from the start; a model still loading finishes loading (mistral.rs cannot stop
    // a load), and the draft stops right after.
    let registration = state.register(&draft_id)?;
    let pool = subset(state.pool()?, workers.as_deref())?;
    let store = state.store().await?;
    let deltas = Box::new(move |text: &str| {
        // A closed window only stops the display.
        let _ = on_delta.send(text.to_owned());
    });
    let loader = Loader::new(&app);
    let context = loader.context(&state);
    let cancel = &registration.token;
    let (planned, pool) =
        baton_runner::draft::draft(pool, context, Some(store), &question, conversation_id, deltas, cancel).await?;
    Ok(Draft {
        plan: planned.plan,
        raw: planned.raw,
        routed: planned.routed,
        workers: pool.infos(),
        max_steps: pool.options.max_steps as u32,
    })
}

#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct ConnectionCheck {
    /// The first words of the answer.
    pub reply: String,
    pub latency_ms: u64,
    /// Retries it took (rate limits, overload, timeouts), as a run's step would make them.
    pub retries: u32,
}

/// Sends worker `index` a tiny request with its real settings and key, under the same time
/// limit and retries as a run's step (the `baton pool check` implementation);
/// `cancel_run(stop_id)` stops it, and the error kind is then `cancelled`.
#[tauri::command]
pub async fn test_worker<R: Runtime>(
    app: AppHandle<R>,
    state: State<'_, AppState>,
    index: u32,
    stop_id: String,
) -> AppResult<ConnectionCheck> {
    let registration = state.register(&stop_id)?;
    let pool = state.pool()?;
    if index as usize >= pool.workers.len() {
        return Err(AppError::not_found(format!("there is no worker {index} in the pool")));
    }
    let pool = subset(pool, Some(&[index]))?;
    let loader = Loader::new(&app);
    let setup = loader.context(&state).setup(Conductor::None, Some(state.store().await?));
    let executor = baton_runner::build(pool.clone(), setup).await?.executor;
    let checked = baton_engine::calls::check_worker(&executor.workers()[0], &pool.options.retry, &registration.token)
        .await
        .map_err(|e| match e.kind {
            baton_providers::ErrorKind::Cancelled => AppError::new(ErrorKind::Cancelled, "the test was stopped"),
            _ => AppError::new(ErrorKind::Provider, e.to_string()),
        })?;
    Ok(ConnectionCheck {
        reply: checked.reply,
        latency_ms: checked.latency.as_millis() as u64,
        retries: checked.retries,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(conductor: &str) -> Pool {
        let mut text = format!("{conductor}\n");
        for name in ["a", "b", "c"] {
            text.push_str(&format!("[[worker]]\nname = \"{name}\"\nprovider = \"openai\"\nmodel = \"m-{name}\"\n\n"));
        }
        Pool::parse(&text, "pool.toml").expect("pool")
    }

    #[test]
    fn a_conversations_workers_keep_the_pools_own_fallback_worker_by_name() {
        let named = pool("[conductor]\nfallback_worker = \"c\"");
        let kept = subset(named.clone(), Some(&[0, 2])).expect("subset");
        let names: Vec<&str> = kept.workers.iter().map(|w| w.name.as_str()).collect();
        assert_eq!(names, ["a", "c"]);
        assert_eq!(kept.options.fallback.worker, Some(1), "c, renumbered");
        let without = subset(named, Some(&[0, 1])).expect("subset");
        assert_eq!(without.options.fallback.worker, None, "c left out");
        assert!(subset(pool(""), Some(&[])).is_err());
    }
}

//! Running a question with its history recorded: the one way every front end runs.

use baton_engine::{Executor, RunEvent, RunOutcome, RunRequest};
use baton_providers::Message;
use baton_store::{Recorder, Store, StoreError};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::RunnerError;

/// A run that has ended, and where the history kept it.
#[derive(Debug)]
pub struct Recorded {
    pub outcome: RunOutcome,
    /// The run's id in the history; `None` when it was not (fully) recorded.
    pub run_id: Option<i64>,
    /// The conversation it was asked in: reported even if the history could not record the run.
    pub conversation_id: Option<i64>,
}

/// Runs `request`, recording each event with `recorder` (none: not recorded) before handing it
/// to `show`; returns once the run has ended and is recorded.
///
/// Recording and showing happen on a task of their own, so a display that blocks (a terminal
/// piped into a pager) holds up only itself, never the run's calls. A history that fails
/// mid-run must not cost the answer: the first error goes to `on_history_error`, and the run
/// goes on unrecorded.
pub async fn run_recorded(
    executor: &Executor,
    request: RunRequest,
    recorder: Option<Recorder>,
    show: impl FnMut(RunEvent) + Send + 'static,
    on_history_error: impl FnOnce(StoreError) + Send + 'static,
    cancel: &CancellationToken,
) -> Recorded {
    let asked_in = recorder.as_ref().and_then(Recorder::conversation_id);
    let (tx, rx) = mpsc::unbounded_channel();
    let relay = tokio::spawn(baton_store::relay::relay(recorder, rx, show, on_history_error));
    let outcome = executor.run(request, &tx, cancel).await;
    // The relay ends once the last sender is gone.
    drop(tx);
    let kept = relay.await.ok().flatten();
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

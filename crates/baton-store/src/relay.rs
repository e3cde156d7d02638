//! A run whose events are kept in the history as they pass on to whoever shows them.
//!
//! Every surface runs questions the same way: the executor sends its events on a channel, each
//! event is kept first and shown second (so what was shown is in the history), and a history
//! that fails mid-run stops being written to without costing the run or its display. Where an
//! event is kept differs: a [`Recorder`] of the run's own (the command line, the app, an
//! evaluation), or the server's one batched writer; that is the [`EventLog`].

use std::future::Future;

use baton_engine::{Executor, RunEvent, RunOutcome, RunRequest};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::{Recorder, StoreError};

/// Where a run's events are kept as they pass.
pub trait EventLog: Send {
    /// Keeps one event. After an error the log is dropped: later events would refer to rows
    /// that are not there.
    fn keep(&mut self, event: &RunEvent) -> impl Future<Output = Result<(), StoreError>> + Send;
}

impl EventLog for Recorder {
    fn keep(&mut self, event: &RunEvent) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.record(event)
    }
}

/// Runs `request` on `executor`, keeping each event in `log` before handing it to `forward`:
/// the one way every surface runs a question with its history kept.
///
/// Keeping and handing on happen on a task of their own, so a `forward` that blocks (a terminal
/// piped into a pager) holds up only itself, never the run's calls. The first history error goes
/// to `on_error` and ends the keeping; the run and `forward` go on. Returns the run's outcome
/// and the log, `None` if it failed (or there was none), whose [`Recorder::run_id`] says where
/// the run was kept.
pub async fn run_kept<L: EventLog + 'static>(
    executor: &Executor,
    request: RunRequest,
    cancel: &CancellationToken,
    log: Option<L>,
    forward: impl FnMut(RunEvent) + Send + 'static,
    on_error: impl FnOnce(StoreError) + Send + 'static,
) -> (RunOutcome, Option<L>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let relay = tokio::spawn(relay(log, rx, forward, on_error));
    let outcome = executor.run(request, &tx, cancel).await;
    // The relay ends once the last sender is gone.
    drop(tx);
    // A relay that panicked (in `forward`) has kept what it kept; the run's outcome stands.
    (outcome, relay.await.ok().flatten())
}

/// Keeps and hands on every event until the channel closes (see [`run_kept`]).
async fn relay<L: EventLog>(
    mut log: Option<L>,
    mut events: mpsc::UnboundedReceiver<RunEvent>,
    mut forward: impl FnMut(RunEvent) + Send,
    on_error: impl FnOnce(StoreError) + Send,
) -> Option<L> {
    let mut on_error = Some(on_error);
    while let Some(event) = events.recv().await {
        if let Some(l) = &mut log
            && let Err(e) = l.keep(&event).await
        {
            log = None;
            if let Some(report) = on_error.take() {
                report(e);
            }
        }
        forward(event);
    }
    log
}

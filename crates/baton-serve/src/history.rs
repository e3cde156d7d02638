//! The server's history writer: one task records the events of every run the server makes.
//!
//! Runs send their events here as the client gets them, so a busy database never holds up an
//! answer. The writer takes all that waits at once and commits it in one transaction, where a
//! run's failure drops that run alone ([`Store::record_many`]): 64 runs that end together make
//! one commit, not 64, which keeps the database's share of a small machine's cores small when it is busiest.
//! A run counts among those the history is recording until its record is committed; when too
//! many wait, new requests are refused (see `handling::admit`), so a slow history slows the server
//! instead of falling behind without end.

use std::collections::HashMap;

use baton_engine::RunEvent;
use baton_store::{Recorder, Store};
use tokio::sync::{mpsc, oneshot};

use crate::{InFlightGuard, now_secs};

/// The sending end of the writer; the task stops when the service (its only owner) is dropped.
#[derive(Debug)]
pub(crate) struct Writer {
    to: mpsc::UnboundedSender<Entry>,
    next: std::sync::atomic::AtomicU64,
}

/// One run's way into the history.
#[derive(Debug)]
pub(crate) struct RunLog {
    run: u64,
    to: mpsc::UnboundedSender<Entry>,
}

#[derive(Debug)]
enum Entry {
    Begin {
        run: u64,
        recorder: Recorder,
        recording: InFlightGuard,
    },
    Event {
        run: u64,
        event: RunEvent,
    },
    /// The run sent its last event (a run that ended without its terminal event is let go here).
    End {
        run: u64,
    },
    /// Answered once everything sent before it is committed.
    Flush(oneshot::Sender<()>),
}

/// How long the writer waits, once woken, for more to record.
const GATHER: std::time::Duration = std::time::Duration::from_millis(5);

/// At most this many entries go into one transaction, so one commit stays short.
const BATCH: usize = 4096;

impl Writer {
    /// Starts the writer's task on the current runtime.
    pub(crate) fn spawn(store: Store) -> Writer {
        let (to, from) = mpsc::unbounded_channel();
        tokio::spawn(write(store, from));
        Writer { to, next: Default::default() }
    }

    /// Waits until everything sent so far is in the history (or could not be written): what a
    /// request that looks up an earlier run's record needs, since a client may have its answer a
    /// moment before the history does.
    pub(crate) async fn flush(&self) {
        let (done, flushed) = oneshot::channel();
        if self.to.send(Entry::Flush(done)).is_ok() {
            let _ = flushed.await;
        }
    }

    /// Registers a run that `recorder` records; `recording` is dropped once its record is whole.
    pub(crate) fn begin(&self, recorder: Recorder, recording: InFlightGuard) -> RunLog {
        let run = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let _ = self.to.send(Entry::Begin { run, recorder, recording });
        RunLog { run, to: self.to.clone() }
    }
}

impl baton_store::relay::EventLog for RunLog {
    /// Hands the event to the writer, which records it with the others waiting.
    async fn keep(&mut self, event: &RunEvent) -> Result<(), baton_store::StoreError> {
        let _ = self.to.send(Entry::Event { run: self.run, event: event.clone() });
        Ok(())
    }
}

/// The run is over (its events are all sent, or its task is gone): the writer lets it go once
/// what it sent is recorded.
impl Drop for RunLog {
    fn drop(&mut self) {
        let _ = self.to.send(Entry::End { run: self.run });
    }
}

/// A run being recorded: its recorder (`None` once a write of it failed: that is logged, and the
/// rest of its events are dropped), and its count among the runs recording.
struct Live {
    recorder: Option<Recorder>,
    _recording: InFlightGuard,
}

/// A batch the history could not take (another process held it past its busy timeout, say):
/// written again with the next one, before its runs are given up.
#[derive(Default)]
struct Failed {
    events: Vec<(u64, Vec<RunEvent>)>,
    ended: Vec<u64>,
    cost_usd: f64,
    attempts: u32,
}

/// Tries at a batch before its runs are given up (each waits out the database's busy timeout).
const ATTEMPTS: u32 = 3;

/// How long a failed batch waits for more entries before it is tried again.
const RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

async fn write(store: Store, mut from: mpsc::UnboundedReceiver<Entry>) {
    let mut live: HashMap<u64, Live> = HashMap::new();
    let mut entries = Vec::with_capacity(BATCH);
    let mut again = Failed::default();
    loop {
        let open = if again.events.is_empty() && again.ended.is_empty() {
            from.recv_many(&mut entries, BATCH).await > 0
        } else {
            tokio::time::timeout(RETRY_AFTER, from.recv_many(&mut entries, BATCH)).await.is_err() || !entries.is_empty()
        };
        if !open && again.events.is_empty() && again.ended.is_empty() {
            return;
        }
        // What wakes the writer is often the first of many events at once (requests that come
        // together, runs that end together): a moment's wait lets the server answer them first
        // and gathers the rest into this commit. Even a run alone waits, since it may be the
        // first of a burst; only a request that needs the history now does not.
        let flushing = entries.iter().any(|e| matches!(e, Entry::Flush(_)));
        if open && !flushing {
            tokio::time::sleep(GATHER).await;
        }
        while entries.len() < BATCH
            && let Ok(entry) = from.try_recv()
        {
            entries.push(entry);
        }
        // Each run's events, in the order the runs first appear (a failed batch's first); the
        // runs that ended, which leave the count once this is committed.
        let attempts = again.attempts;
        let mut events = std::mem::take(&mut again.events);
        let mut at: HashMap<u64, usize> = events.iter().enumerate().map(|(i, (run, _))| (*run, i)).collect();
        let mut ended = std::mem::take(&mut again.ended);
        let mut cost_usd = std::mem::take(&mut again.cost_usd);
        let mut flushes = Vec::new();
        for entry in entries.drain(..) {
            match entry {
                Entry::Begin { run, recorder, recording } => {
                    live.insert(run, Live { recorder: Some(recorder), _recording: recording });
                }
                Entry::Event { run, event } => {
                    // A run's cost counts in the day's spending in the commit that records its end.
                    if let Some(totals) = event.final_totals() {
                        cost_usd += totals.cost_usd;
                        ended.push(run);
                    }
                    let i = *at.entry(run).or_insert_with(|| {
                        events.push((run, Vec::new()));
                        events.len() - 1
                    });
                    events[i].1.push(event);
                }
                Entry::End { run } => ended.push(run),
                Entry::Flush(done) => flushes.push(done),
            }
        }
        // The recorders leave the map for the commit (each is borrowed mutably beside the others).
        let mut parts: Vec<(u64, Recorder, Vec<RunEvent>)> = events
            .into_iter()
            .filter_map(|(run, events)| {
                let recorder = live.get_mut(&run)?.recorder.take()?;
                Some((run, recorder, events))
            })
            .collect();
        let spend = (cost_usd > 0.0).then(|| (now_secs() / 86_400, cost_usd));
        let mut batch: Vec<(&mut Recorder, &[RunEvent])> =
            parts.iter_mut().map(|(_, recorder, events)| (recorder, events.as_slice())).collect();
        let kept: Vec<bool> = match store.record_many(&mut batch, spend).await {
            Ok(results) => results
                .into_iter()
                .map(|r| {
                    r.inspect_err(|e| tracing::warn!("a served run is not fully recorded in the history: {e}")).is_ok()
                })
                .collect(),
            Err(e) if attempts + 1 < ATTEMPTS => {
                // Nothing of the batch is kept and its recorders are as they were: it goes
                // again, less the text deltas the recorders have already seen.
                tracing::warn!("the history could not record {} served runs, trying again: {e}", parts.len());
                for (run, recorder, mut events) in parts {
                    if let Some(l) = live.get_mut(&run) {
                        l.recorder = Some(recorder);
                    }
                    events.retain(|e| !matches!(e, RunEvent::StepDelta { .. } | RunEvent::PlanDelta { .. }));
                    again.events.push((run, events));
                }
                again = Failed { ended, cost_usd, attempts: attempts + 1, ..again };
                for done in flushes {
                    let _ = done.send(());
                }
                continue;
            }
            Err(e) => {
                tracing::warn!("{} served runs are not fully recorded in the history: {e}", parts.len());
                // The runs are given up, not what they spent: the day's spending goes again
                // with the next commit, so a restart still counts it.
                again.cost_usd = cost_usd;
                vec![false; parts.len()]
            }
        };
        for ((run, recorder, _), kept) in parts.into_iter().zip(kept) {
            if let Some(l) = live.get_mut(&run)
                && kept
            {
                l.recorder = Some(recorder);
            }
        }
        for run in ended {
            live.remove(&run);
        }
        for done in flushes {
            let _ = done.send(());
        }
    }
}

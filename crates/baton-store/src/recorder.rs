//! From `RunEvent`s to rows, as they happen.
//!
//! Each event is one transaction (its row changes and its line in `events`), so a crash loses
//! at most what was in flight; a writer that fell behind may record the events waiting for it
//! in one ([`Recorder::record_all`]), and a server the events of all its runs that wait
//! ([`Store::record_many`], where one run's failure drops that run alone). While a run
//! records, its recorder holds one of its store's lock files (a [`Slot`], named in the run's
//! row); the lock dies with the process, which is how [`crate::Store::open`] tells a run that
//! is still going in another process from one whose process was killed (see [`crate::locks`]).
//!
//! Each text is stored once. A step's answer is in its row; the requests of later steps that
//! saw it refer to that row (see [`crate::stored`]), and events leave out the texts a row holds
//! (`events.elided` names them), so a run's history grows with its texts, not with how many
//! steps saw each. Text deltas are not stored; a step the run stopped mid-answer keeps the text
//! that had arrived, with status `cancelled`.

use std::collections::HashMap;

use baton_engine::{RerunOf, RunEvent, StepErrorKind, WorkerInfo};
use baton_plan::{Access, Plan};
use rusqlite::params;

use crate::locks::Slot;
use crate::stored::{self, StoredRequest, TextRef};
use crate::time::now_ms;
use crate::{Store, StoreError};

/// Records one run. Feed it every event of the run in order with [`Recorder::record`].
#[derive(Debug)]
pub struct Recorder {
    store: Store,
    conversation: Option<i64>,
    run: Option<i64>,
    seq: i64,
    workers: Vec<WorkerInfo>,
    plans: HashMap<u32, Plan>,
    /// Texts already in this run's step rows, and where: what a later request refers to.
    texts: HashMap<String, TextRef>,
    /// The text each running step has streamed since its last attempt began.
    partial: HashMap<(u32, usize), String>,
    /// Each round's rejected plan attempts, kept with the plan that runs.
    rejected: HashMap<u32, Vec<crate::RejectedPlan>>,
    /// The lock that says the run is being recorded, held from its start to its end.
    slot: Option<Slot>,
    /// Whether the run's question and answer join the conversation's turns (what a conductor
    /// sees in a follow-up). A worker's run beside the conductor's (compare in chat) does not.
    messages: bool,
}

/// What a recorder forgets when a batch it applied is not kept.
struct Undo {
    before: (Option<i64>, Option<i64>, i64),
    had_slot: bool,
    added: Vec<String>,
}

impl Store {
    /// Records several runs' waiting events in one transaction: a server with many runs at once
    /// makes one commit where it would make one per run (and per event). Each run's events are
    /// kept or dropped together: when one of them fails, that run's part is rolled back and its
    /// error returned in its place, and the other runs are kept. `serve_spend` (a day, dollars)
    /// adds to what the server spent that day, in the same commit. The outer error is one that
    /// was not a single run's (the transaction, a savepoint, the spending, the commit): then
    /// nothing is kept, and every recorder is as it was before (the same events can be given
    /// again, less their text deltas, which a recorder keeps as it sees them).
    pub async fn record_many(
        &self,
        runs: &mut [(&mut Recorder, &[RunEvent])],
        serve_spend: Option<(u64, f64)>,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let stored: Vec<Vec<&RunEvent>> = runs.iter_mut().map(|(r, events)| r.stored(events)).collect();
        let mut results: Vec<Result<(), StoreError>> = runs.iter().map(|_| Ok(())).collect();
        if stored.iter().all(Vec::is_empty) && serve_spend.is_none() {
            return Ok(results);
        }
        // Runs go in together, with no savepoint: one per run would cost each run a copy of the
        // pages it changes and a write-out of the full-text index's pending terms. Should one of
        // them fail, the transaction is rolled back and the batch applied again with a savepoint
        // per run, so that only that run's part is dropped.
        let mut mode = if alone(runs, serve_spend) { Mode::Alone } else { Mode::Together };
        loop {
            let mut undos: Vec<Option<Undo>> = Vec::new();
            let mut tx = self.write().await?;
            // The batch's statements run here, on SQLite's own handle, while sqlx's thread for
            // the connection waits: through sqlx each statement would be a round trip to that
            // thread, two thread switches, and a busy server's runs make about 16 statements each.
            let applied = {
                let mut handle = tx.lock_handle().await?;
                // SAFETY: the handle is sqlx's open connection, locked for us until `handle`
                // drops; `conn` drops first (it is declared later), finalizing the statements it
                // prepared, and does not close the connection (`from_handle` does not own it).
                #[allow(unsafe_code)]
                let conn = unsafe { rusqlite::Connection::from_handle(handle.as_raw_handle().as_ptr()) }?;
                record_batch(&conn, runs, &stored, serve_spend, mode, &mut results, &mut undos)
            };
            let failed = match applied {
                Ok(true) => tx.commit().await.err().map(StoreError::from),
                Err(e) => Some(e),
                // A run failed, and its recorders are as they were.
                Ok(false) => {
                    tx.rollback().await?;
                    match mode {
                        Mode::Together => {
                            mode = Mode::Each;
                            continue;
                        }
                        // The run's failure is the transaction's: nothing to commit.
                        Mode::Alone | Mode::Each => return Ok(results),
                    }
                }
            };
            if let Some(e) = failed {
                undo_all(runs, undos);
                return Err(e);
            }
            for (((recorder, _), events), result) in runs.iter_mut().zip(&stored).zip(&results) {
                if result.is_ok() && events.iter().any(|e| e.is_terminal()) {
                    recorder.release_slot();
                }
            }
            return Ok(results);
        }
    }
}

/// Nothing of a batch is kept: each recorder forgets what it applied.
fn undo_all(runs: &mut [(&mut Recorder, &[RunEvent])], undos: Vec<Option<Undo>>) {
    for ((recorder, _), undo) in runs.iter_mut().zip(undos) {
        if let Some(undo) = undo {
            recorder.undo(undo);
        }
    }
}

fn alone(runs: &[(&mut Recorder, &[RunEvent])], serve_spend: Option<(u64, f64)>) -> bool {
    runs.len() == 1 && serve_spend.is_none()
}

/// How a batch's runs go into its transaction.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    /// One run and nothing else: its failure is the transaction's.
    Alone,
    /// All runs with no savepoint: a run's failure fails the batch, to be applied again `Each`.
    Together,
    /// A savepoint per run: a run's failure drops that run's part alone.
    Each,
}

/// Applies each run's `stored` events and the day's spending in the open transaction on `conn`.
/// Returns `Ok(false)` when a run failed and the transaction is to be rolled back (`Alone`,
/// `Together`): then every recorder is as it was, and the run's error is in its `results`
/// (`Alone`). `Each` rolls a failed run's part back and puts its error in `results`. What `undos`
/// gets is what to undo of each run should the commit not keep them. An error is one that is
/// not a run's own (a savepoint, the spending): then nothing is to be kept.
fn record_batch(
    conn: &rusqlite::Connection,
    runs: &mut [(&mut Recorder, &[RunEvent])],
    stored: &[Vec<&RunEvent>],
    serve_spend: Option<(u64, f64)>,
    mode: Mode,
    results: &mut [Result<(), StoreError>],
    undos: &mut Vec<Option<Undo>>,
) -> Result<bool, StoreError> {
    for (((recorder, _), events), result) in runs.iter_mut().zip(stored).zip(results.iter_mut()) {
        if events.is_empty() {
            undos.push(None);
            continue;
        }
        if mode == Mode::Each {
            conn.prepare_cached("SAVEPOINT run")?.execute([])?;
        }
        let (undo, applied) = recorder.apply_all(conn, events);
        if mode == Mode::Each {
            let closed = match &applied {
                Ok(()) => conn.prepare_cached("RELEASE run")?.execute([]).map(drop),
                Err(_) => conn.execute_batch("ROLLBACK TO run; RELEASE run"),
            };
            if let Err(e) = closed {
                recorder.undo(undo);
                return Err(e.into());
            }
        }
        match applied {
            Ok(()) => undos.push(Some(undo)),
            Err(e) => {
                recorder.undo(undo);
                if mode == Mode::Each {
                    *result = Err(e);
                    undos.push(None);
                    continue;
                }
                if mode == Mode::Alone {
                    *result = Err(e);
                }
                undo_all(runs, std::mem::take(undos));
                return Ok(false);
            }
        }
    }
    if let Some((day, usd)) = serve_spend {
        crate::serve_spend::add(conn, day, usd)?;
    }
    Ok(true)
}

impl Recorder {
    pub(crate) fn new(store: Store, conversation: Option<i64>) -> Self {
        Recorder {
            store,
            conversation,
            run: None,
            seq: 0,
            workers: Vec::new(),
            plans: HashMap::new(),
            texts: HashMap::new(),
            partial: HashMap::new(),
            rejected: HashMap::new(),
            slot: None,
            messages: true,
        }
    }

    /// Records the run in its conversation without adding its question and answer to the
    /// conversation's turns: the second answer of a comparison, shown beside the conductor's.
    pub fn without_messages(mut self) -> Self {
        self.messages = false;
        self
    }

    /// The run's id in the history, once `RunStarted` was recorded.
    pub fn run_id(&self) -> Option<i64> {
        self.run
    }

    /// The conversation the run belongs to, once `RunStarted` was recorded.
    pub fn conversation_id(&self) -> Option<i64> {
        self.conversation
    }

    pub async fn record(&mut self, event: &RunEvent) -> Result<(), StoreError> {
        self.record_all(std::slice::from_ref(event)).await
    }

    /// Records `events`, in order, in one transaction: a writer that fell behind (a server with
    /// many runs at once) catches up in one commit instead of one per event. On an error none of
    /// them is recorded.
    pub async fn record_all(&mut self, events: &[RunEvent]) -> Result<(), StoreError> {
        let store = self.store.clone();
        let mut results = store.record_many(&mut [(self, events)], None).await?;
        results.pop().unwrap_or(Ok(()))
    }

    /// The events of `events` that make rows; text deltas are not stored (the finished texts
    /// arrive with PlanReady and StepFinished), but a step's text so far is kept in memory, for
    /// a stop that cuts it short.
    fn stored<'e>(&mut self, events: &'e [RunEvent]) -> Vec<&'e RunEvent> {
        events
            .iter()
            .filter(|event| match event {
                RunEvent::PlanDelta { .. } => false,
                RunEvent::StepDelta { round, step, text } => {
                    self.partial.entry((*round, *step)).or_default().push_str(text);
                    false
                }
                _ => true,
            })
            .collect()
    }

    /// Applies `events` on `conn` (in its open transaction); returns what to undo should they
    /// not be kept.
    fn apply_all(&mut self, conn: &rusqlite::Connection, events: &[&RunEvent]) -> (Undo, Result<(), StoreError>) {
        let mut undo =
            Undo { before: (self.conversation, self.run, self.seq), had_slot: self.slot.is_some(), added: Vec::new() };
        for event in events {
            if let Err(e) = self.apply(conn, event, &mut undo.added) {
                return (undo, Err(e));
            }
        }
        (undo, Ok(()))
    }

    /// Nothing of a batch is in the database: forget what it would have made.
    fn undo(&mut self, undo: Undo) {
        (self.conversation, self.run, self.seq) = undo.before;
        for text in undo.added {
            self.texts.remove(&text);
        }
        // A run this batch started is not in the history: nor is it live.
        if !undo.had_slot {
            self.release_slot();
        }
    }

    fn release_slot(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.store.slots.give_back(slot);
        }
    }

    /// One event's rows, in the batch's transaction. Texts it stores are known to later events
    /// at once (`added` lists them, to be forgotten if the batch fails).
    fn apply(
        &mut self,
        conn: &rusqlite::Connection,
        event: &RunEvent,
        added: &mut Vec<String>,
    ) -> Result<(), StoreError> {
        if let RunEvent::RunStarted { run_id, question, workers, conductor, rerun_of } = event {
            return self.start(conn, event, run_id, question, workers, conductor.as_deref(), rerun_of.as_ref());
        }
        let Some(run) = self.run else {
            return Err(StoreError::Sql(sqlx::Error::Protocol("an event arrived before run_started".into())));
        };
        // Texts this event puts in step rows; later requests may refer to them.
        let mut stored_texts: Vec<(String, TextRef)> = Vec::new();
        match event {
            RunEvent::PlanRejected { round, reason, raw, prompt, .. } => {
                let rejected = crate::RejectedPlan { reason: reason.clone(), raw: raw.clone(), prompt: prompt.clone() };
                self.rejected.entry(*round).or_default().push(rejected);
            }
            RunEvent::PlanReady { round, depth, parent, plan, raw, usage, stop_reason, prompt, fallback, .. } => {
                let rejected = self.rejected.remove(round).filter(|r| !r.is_empty());
                conn.prepare_cached(
                    "INSERT INTO plans (run_id, round, depth, parent_round, parent_step, raw, plan,
                                        input_tokens, cached_input_tokens, output_tokens, stop_reason,
                                        prompt, rejected, fallback)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)",
                )?
                .execute(params![
                    run,
                    round,
                    depth,
                    parent.map(|p| p.round),
                    parent.map(|p| p.step as i64),
                    raw,
                    plan.to_json(),
                    usage.map(|u| u.input_tokens as i64),
                    usage.map(|u| u.cached_input_tokens as i64),
                    usage.map(|u| u.output_tokens as i64),
                    stop_reason,
                    prompt.as_ref().map(|p| serde_json::to_string(p).unwrap_or_default()),
                    rejected.map(|r| serde_json::to_string(&r).unwrap_or_default()),
                    fallback,
                ])?;
                conn.prepare_cached("UPDATE runs SET rounds = max(rounds, ?2) WHERE id = ?1")?
                    .execute(params![run, round + 1])?;
                self.plans.insert(*round, plan.clone());
            }
            RunEvent::StepStarted { round, step, worker, system, messages } => {
                let (subtask, access) = self.planned(*round, *step);
                // The step's own subtask is in the row made here, so its request can refer to it.
                let own = TextRef::Subtask(*round, *step);
                let request = StoredRequest::refer(system.clone(), messages, |text| {
                    self.texts.get(text).copied().or((text == subtask).then_some(own))
                });
                conn.prepare_cached(
                    "INSERT INTO steps (run_id, round, step, worker_index, worker, subtask, access, request, status)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, 'running')",
                )?
                .execute(params![
                    run,
                    round,
                    *step as i64,
                    *worker as i64,
                    self.worker_name(*worker),
                    subtask,
                    access,
                    serde_json::to_string(&request).unwrap_or_default(),
                ])?;
                stored_texts.push((subtask, own));
            }
            RunEvent::StepRetrying { round, step, attempt, .. } => {
                // The next attempt starts its text over.
                self.partial.remove(&(*round, *step));
                conn.prepare_cached("UPDATE steps SET retries = ?4 WHERE run_id = ?1 AND round = ?2 AND step = ?3")?
                    .execute(params![run, round, *step as i64, attempt])?;
            }
            RunEvent::StepFinished { round, step, output, usage, cost_usd, latency_ms, retries } => {
                conn.prepare_cached(
                    "UPDATE steps SET status = 'finished', output = ?4, input_tokens = ?5, output_tokens = ?6,
                            cost_usd = ?7, latency_ms = ?8, retries = ?9, cached_input_tokens = ?10,
                            cache_write_input_tokens = ?11
                     WHERE run_id = ?1 AND round = ?2 AND step = ?3",
                )?
                .execute(params![
                    run,
                    round,
                    *step as i64,
                    output,
                    usage.input_tokens as i64,
                    usage.output_tokens as i64,
                    cost_usd,
                    *latency_ms as i64,
                    retries,
                    usage.cached_input_tokens as i64,
                    usage.cache_write_input_tokens as i64,
                ])?;
                self.partial.remove(&(*round, *step));
                stored_texts.push((output.clone(), TextRef::Output(*round, *step)));
            }
            RunEvent::StepFailed { round, step, error } => {
                // A step can fail without having started (a dependency failed): then its row is
                // made here, from the plan.
                let planned = self.plans.get(round).and_then(|p| p.steps.get(*step));
                let worker = planned.map_or(0, |s| s.model_id);
                let (subtask, access) = self.planned(*round, *step);
                let kind = serde_json::to_value(error.kind).ok().and_then(|v| v.as_str().map(str::to_owned));
                // Stopped: the step keeps what it had written, cut short. Any other failure voids
                // it (the provider broke off, or refused).
                let partial = self.partial.remove(&(*round, *step)).filter(|t| !t.is_empty());
                let (status, output) = match error.kind {
                    StepErrorKind::Cancelled => ("cancelled", partial),
                    _ => ("failed", None),
                };
                conn.prepare_cached(
                    "INSERT INTO steps (run_id, round, step, worker_index, worker, subtask, access, status, output,
                                        error_kind, error)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)
                     ON CONFLICT (run_id, round, step) DO UPDATE SET status = ?8, output = ?9, error_kind = ?10, error = ?11",
                )?
                .execute(params![
                    run,
                    round,
                    *step as i64,
                    worker as i64,
                    self.worker_name(worker),
                    subtask,
                    access,
                    status,
                    output,
                    kind,
                    &error.message,
                ])?;
            }
            RunEvent::StepReused { round, step, worker, output, from_run } => {
                let (subtask, access) = self.planned(*round, *step);
                conn.prepare_cached(
                    "INSERT INTO steps (run_id, round, step, worker_index, worker, subtask, access, status, output, reused_from)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 'finished', ?8, ?9)",
                )?
                .execute(params![
                    run,
                    round,
                    *step as i64,
                    *worker as i64,
                    self.worker_name(*worker),
                    subtask,
                    access,
                    output,
                    from_run,
                ])?;
                stored_texts.push((subtask, TextRef::Subtask(*round, *step)));
                stored_texts.push((output.clone(), TextRef::Output(*round, *step)));
            }
            RunEvent::RunFinished { answer, totals } => {
                self.finish(conn, run, "finished", Some(answer), None, totals)?;
                if let Some(conversation) = self.conversation.filter(|_| self.messages) {
                    add_message(conn, conversation, run, "assistant", answer)?;
                }
            }
            RunEvent::RunFailed { error, totals } => {
                let kind = serde_json::to_value(error.kind).ok().and_then(|v| v.as_str().map(str::to_owned));
                self.finish(conn, run, "failed", None, Some((kind, &error.message)), totals)?;
            }
            RunEvent::RunCancelled { totals } => {
                self.finish(conn, run, "cancelled", None, None, totals)?;
            }
            RunEvent::RunStarted { .. } | RunEvent::PlanDelta { .. } | RunEvent::StepDelta { .. } => {}
            RunEvent::PlanStarted { .. } => {}
        }
        self.append_event(conn, run, event)?;
        for (text, at) in stored_texts {
            if !self.texts.contains_key(&text) {
                self.texts.insert(text.clone(), at);
                added.push(text);
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn start(
        &mut self,
        conn: &rusqlite::Connection,
        event: &RunEvent,
        uid: &str,
        question: &str,
        workers: &[WorkerInfo],
        conductor: Option<&str>,
        rerun_of: Option<&RerunOf>,
    ) -> Result<(), StoreError> {
        let slot = self.slot.insert(self.store.slots.take()?).name().to_owned();
        self.workers = workers.to_vec();
        let now = now_ms();
        let conversation = match self.conversation {
            Some(id) => {
                let touched = conn
                    .prepare_cached("UPDATE conversations SET updated_at = ?2 WHERE id = ?1")?
                    .execute(params![id, now])?;
                if touched == 0 {
                    return Err(StoreError::Sql(sqlx::Error::RowNotFound));
                }
                id
            }
            None => conn
                .prepare_cached(
                    "INSERT INTO conversations (title, created_at, updated_at) VALUES (?1, ?2, ?2) RETURNING id",
                )?
                .query_row(params![title(question), now], |row| row.get(0))?,
        };
        let run: i64 = conn
            .prepare_cached(
                "INSERT INTO runs (uid, conversation_id, question, conductor, workers, status, started_at, rerun_of,
                                   rerun_step, recorder)
                 VALUES (?1, ?2, ?3, ?4, ?5, 'running', ?6, ?7, ?8, ?9) RETURNING id",
            )?
            .query_row(
                params![
                    uid,
                    conversation,
                    question,
                    conductor,
                    serde_json::to_string(workers).unwrap_or_else(|_| "[]".into()),
                    now,
                    rerun_of.map(|r| r.run_id.as_str()),
                    rerun_of.map(|r| r.step as i64),
                    slot,
                ],
                |row| row.get(0),
            )?;
        if self.messages {
            add_message(conn, conversation, run, "user", question)?;
        }
        self.append_event(conn, run, event)?;
        self.conversation = Some(conversation);
        self.run = Some(run);
        Ok(())
    }

    fn finish(
        &self,
        conn: &rusqlite::Connection,
        run: i64,
        status: &str,
        answer: Option<&String>,
        error: Option<(Option<String>, &String)>,
        totals: &baton_engine::Totals,
    ) -> Result<(), StoreError> {
        let (error_kind, error) = error.map_or((None, None), |(k, m)| (k, Some(m)));
        conn.prepare_cached(
            "UPDATE runs SET status = ?2, answer = ?3, error_kind = ?4, error = ?5, finished_at = ?6,
                    calls = ?7, input_tokens = ?8, output_tokens = ?9, cost_usd = ?10, cost_complete = ?11,
                    wall_ms = ?12, rounds = max(rounds, ?13), totals = ?14
             WHERE id = ?1",
        )?
        .execute(params![
            run,
            status,
            answer,
            error_kind,
            error,
            now_ms(),
            totals.calls,
            totals.usage.input_tokens as i64,
            totals.usage.output_tokens as i64,
            totals.cost_usd,
            totals.cost_complete,
            totals.wall_ms as i64,
            totals.rounds,
            serde_json::to_string(totals).unwrap_or_default(),
        ])?;
        Ok(())
    }

    fn append_event(&mut self, conn: &rusqlite::Connection, run: i64, event: &RunEvent) -> Result<(), StoreError> {
        let (event, elided) = stored::elide(event);
        conn.prepare_cached("INSERT INTO events (run_id, seq, event, elided) VALUES (?1, ?2, ?3, ?4)")?
            .execute(params![run, self.seq, event.to_string(), elided])?;
        self.seq += 1;
        Ok(())
    }

    /// The subtask and access (as stored) of a planned step.
    fn planned(&self, round: u32, step: usize) -> (String, String) {
        match self.plans.get(&round).and_then(|p| p.steps.get(step)) {
            Some(s) => (s.subtask.clone(), access_to_json(&s.access)),
            None => (String::new(), "[]".to_owned()),
        }
    }

    fn worker_name(&self, index: usize) -> String {
        match self.workers.get(index) {
            Some(w) => w.name.clone(),
            // The pool's size means the conductor itself (recursion).
            None if index == self.workers.len() => "conductor".to_owned(),
            None => format!("worker {index}"),
        }
    }
}

fn add_message(
    conn: &rusqlite::Connection,
    conversation: i64,
    run: i64,
    role: &str,
    content: &str,
) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT INTO messages (conversation_id, run_id, role, content, created_at) VALUES (?1, ?2, ?3, ?4, ?5)",
    )?
    .execute(params![conversation, run, role, content, now_ms()])?;
    Ok(())
}

/// A conversation's title: the first line of its first question, cut at 80 characters.
pub(crate) fn title(question: &str) -> String {
    let line = question.lines().find(|l| !l.trim().is_empty()).unwrap_or("").trim();
    match line.char_indices().nth(80) {
        Some((cut, _)) => format!("{}…", &line[..cut]),
        None => line.to_owned(),
    }
}

/// A step's access list as its `steps.access` column holds it (read back by `records`).
fn access_to_json(access: &Access) -> String {
    serde_json::to_string(access).unwrap_or_else(|_| "[]".into())
}

#[cfg(test)]
mod tests {
    use super::title;

    #[test]
    fn titles_are_the_first_line_cut_short() {
        assert_eq!(title("\n  Why is the sky blue?\nDetails"), "Why is the sky blue?");
        let long = "x".repeat(100);
        assert_eq!(title(&long).chars().count(), 81);
    }
}

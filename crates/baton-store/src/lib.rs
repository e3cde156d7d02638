//! Run history in one SQLite file: conversations and their messages, runs, the plan of every
//! round, and every step with exactly what its worker was sent and answered.
//!
//! A [`Recorder`] turns the executor's `RunEvent` stream into rows as it happens, one
//! transaction per event, so a crash loses at most the step in flight. [`Store::open`] applies
//! the embedded migrations and marks runs whose process died as `interrupted`. Queries list
//! (newest first, paged by id), search (FTS5, with snippets), load a run's whole tree, delete
//! (cascading), and export to Markdown or JSON (see [`export`]).
//!
//! Keys never reach this crate: runs hold questions, plans, messages and answers only.

pub mod comparisons;
pub mod evaluations;
pub mod export;
pub mod figures;
mod locks;
mod recorder;
mod serve_spend;
mod stored;
pub mod synthetic;
pub mod time;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use baton_engine::{RerunOf, StepRef, Totals, WorkerInfo};
use baton_plan::{Access, Plan};
use baton_providers::{Message, Usage};
use serde::Serialize;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{FromRow, Row};

/// The columns [`conversation_summary`] reads; a macro so queries can extend it with `concat!`.
macro_rules! conversation_select {
    () => {
        "SELECT c.id, c.title, c.created_at, c.updated_at, c.workers, c.review,
                (SELECT count(*) FROM runs r WHERE r.conversation_id = c.id) AS runs
         FROM conversations c"
    };
}

pub use recorder::Recorder;

/// The schema, embedded from the top-level `migrations/` directory.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations");

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{path}: cannot open the history database: {message}")]
    Open { path: String, message: String },
    #[error(
        "{path}: is not a Baton history database, or it is damaged ({message}); move it aside and Baton starts a new one"
    )]
    Corrupt { path: String, message: String },
    #[error(
        "{path}: the history database could not be brought up to date: {message}; it was written by another version of Baton"
    )]
    Migrate { path: String, message: String },
    #[error("run {run} is still going; stop it first, then delete it")]
    RunStillGoing { run: i64 },
    #[error("run {run} of conversation {conversation} is still going; stop it first, then delete the conversation")]
    ConversationStillGoing { conversation: i64, run: i64 },
    #[error("history database: {0}")]
    Sql(#[from] sqlx::Error),
    /// An error from the statements that record a run (see [`Recorder`]).
    #[error("history database: {0}")]
    Record(#[from] rusqlite::Error),
}

/// How a run ended, or that it has not (yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ts_rs::TS)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    Running,
    Finished,
    Failed,
    Cancelled,
    /// The process recording it died before the run ended.
    Interrupted,
}

impl RunStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Running => "running",
            RunStatus::Finished => "finished",
            RunStatus::Failed => "failed",
            RunStatus::Cancelled => "cancelled",
            RunStatus::Interrupted => "interrupted",
        }
    }
}

impl FromStr for RunStatus {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "running" => RunStatus::Running,
            "finished" => RunStatus::Finished,
            "failed" => RunStatus::Failed,
            "cancelled" => RunStatus::Cancelled,
            "interrupted" => RunStatus::Interrupted,
            other => return Err(format!("unknown run status {other:?}")),
        })
    }
}

/// One run in a list.
#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct RunSummary {
    pub id: i64,
    pub conversation_id: i64,
    pub question: String,
    pub status: RunStatus,
    /// Unix milliseconds.
    pub started_at: i64,
    pub wall_ms: Option<i64>,
    pub calls: i64,
    pub input_tokens: i64,
    pub output_tokens: i64,
    pub cost_usd: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct ConversationSummary {
    pub id: i64,
    pub title: String,
    pub created_at: i64,
    pub updated_at: i64,
    pub runs: i64,
    /// The workers (by name) this conversation may use; `None` for all of the pool.
    pub workers: Option<Vec<String>>,
    /// Whether its plans are shown for review before they run.
    pub review: bool,
}

/// A search result: the run, and where the words matched with the matches in `[` `]`.
#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct SearchHit {
    pub id: i64,
    pub conversation_id: i64,
    pub question: String,
    pub status: RunStatus,
    pub started_at: i64,
    /// `question`, `answer` or `subtask`.
    pub matched: String,
    pub snippet: String,
}

/// A whole run: the row, every round's plan, every step, and its events (without text deltas).
#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct RunTree {
    pub run: RunRecord,
    pub plans: Vec<PlanRecord>,
    pub steps: Vec<StepRecord>,
    pub events: Vec<serde_json::Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct RunRecord {
    pub id: i64,
    pub uid: String,
    pub conversation_id: i64,
    pub question: String,
    pub conductor: Option<String>,
    pub workers: Vec<WorkerInfo>,
    pub status: RunStatus,
    pub answer: Option<String>,
    pub error_kind: Option<String>,
    pub error: Option<String>,
    pub started_at: i64,
    pub finished_at: Option<i64>,
    pub rounds: i64,
    pub calls: i64,
    pub input_tokens: i64,
    pub output_tokens: i64,
    pub cost_usd: f64,
    /// False when a worker had no price, so `cost_usd` is a lower bound.
    pub cost_complete: bool,
    /// The engine's figures for the run (conductor and workers apart, cached tokens, who had
    /// no price); `None` while it runs, and for runs recorded before they were kept.
    pub totals: Option<Totals>,
    pub wall_ms: Option<i64>,
    /// The run and step this run re-ran with another worker, if it is a re-run.
    pub rerun_of: Option<RerunOf>,
}

#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct PlanRecord {
    pub round: u32,
    pub depth: u32,
    pub parent: Option<StepRef>,
    /// The conductor's whole text; `None` for a written plan.
    pub raw: Option<String>,
    pub plan: Plan,
    /// The conductor's tokens for this plan; `None` for a written plan (or one recorded before
    /// they were kept).
    pub usage: Option<Usage>,
    /// Why the conductor's generation ended (`stop`, `length`).
    pub stop_reason: Option<String>,
    /// The conductor's exact request for this plan; absent for a written plan, a fallback, or
    /// one recorded before requests were kept. (Absent fields keep older exports as they were.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<baton_engine::PlanPrompt>,
    /// The conductor's attempts that could not be used, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rejected: Vec<RejectedPlan>,
    /// Why this plan is one worker alone instead of the conductor's (absent: it is not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<String>,
}

/// A plan attempt the executor did not run, and why.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize, ts_rs::TS)]
pub struct RejectedPlan {
    pub reason: String,
    /// The attempt's text, when the conductor finished one.
    pub raw: Option<String>,
    /// What the conductor was asked for it.
    #[serde(default)]
    pub prompt: Option<baton_engine::PlanPrompt>,
}

#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct StepRecord {
    pub round: u32,
    pub step: u32,
    pub worker_index: u32,
    pub worker: String,
    pub subtask: String,
    pub access: Access,
    /// Exactly what the worker was sent; `None` when the step never ran.
    pub request: Option<SentRequest>,
    /// `running`, `finished`, `failed`, `cancelled` (the run stopped while the step waited or
    /// answered) or `interrupted`.
    pub status: String,
    /// The answer; for a `cancelled` step, the text that had arrived when the run stopped.
    pub output: Option<String>,
    pub error_kind: Option<String>,
    pub error: Option<String>,
    pub input_tokens: Option<i64>,
    /// Of `input_tokens`, read from a prompt cache; `None` before this was kept.
    pub cached_input_tokens: Option<i64>,
    /// Of `input_tokens`, written to a prompt cache.
    pub cache_write_input_tokens: Option<i64>,
    pub output_tokens: Option<i64>,
    pub cost_usd: Option<f64>,
    pub latency_ms: Option<i64>,
    pub retries: i64,
    /// For a step a re-run kept rather than ran: the run its output comes from.
    pub reused_from: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize, ts_rs::TS)]
pub struct SentRequest {
    pub system: Option<String>,
    pub messages: Vec<Message>,
}

/// The history database.
#[derive(Debug, Clone)]
pub struct Store {
    pool: SqlitePool,
    path: PathBuf,
    /// Lock files for the runs this store records (see [`locks`]); freed when the last clone goes.
    slots: std::sync::Arc<locks::Slots>,
}

/// `<data dir>/baton/history.sqlite`.
pub fn default_path(data_dir: &Path) -> PathBuf {
    data_dir.join("baton").join("history.sqlite")
}

impl Store {
    /// Opens (creating it and its directory if needed) and migrates the database at `path`,
    /// then marks runs whose recording process is gone as interrupted.
    pub async fn open(path: &Path) -> Result<Store, StoreError> {
        let shown = path.display().to_string();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| StoreError::Open {
                path: shown.clone(),
                message: format!("cannot create {}: {e}", dir.display()),
            })?;
        }
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(10));
        // sqlx cannot lock SQLite for migrating, so two processes opening a new history at
        // once (the app and the CLI, or two CLI runs) would both apply migration 1 and one
        // would fail. Opening is serialized by a lock file instead; it is held until the
        // database is migrated and its dead runs are marked.
        let _opening = locks::lock_opening(path).await?;
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await
            .map_err(|e| classify_open_error(&shown, &e))?;
        MIGRATOR.run(&pool).await.map_err(|e| {
            let message = e.to_string();
            if message.contains("not a database") || message.contains("malformed") {
                StoreError::Corrupt { path: shown.clone(), message }
            } else {
                StoreError::Migrate { path: shown.clone(), message }
            }
        })?;
        let store = Store { pool, path: path.to_path_buf(), slots: std::sync::Arc::new(locks::Slots::new(path)) };
        store.mark_interrupted().await?;
        locks::remove_dead_slots(path);
        Ok(store)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Closes the connections (and checkpoints the WAL).
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// A recorder for the next run, in `conversation` or (with `None`) in a new conversation
    /// titled after the question.
    pub fn recorder(&self, conversation: Option<i64>) -> Recorder {
        Recorder::new(self.clone(), conversation)
    }

    /// Runs still `running` whose recorder no longer holds their lock file died with their
    /// process: they become `interrupted`, with their finished steps intact.
    async fn mark_interrupted(&self) -> Result<(), StoreError> {
        let running: Vec<(i64, String)> =
            sqlx::query_as("SELECT id, coalesce(recorder, uid) FROM runs WHERE status = 'running'")
                .fetch_all(&self.pool)
                .await?;
        for (id, lock) in running {
            if locks::is_live(&self.path, &lock) {
                continue;
            }
            let mut tx = self.write().await?;
            sqlx::query("UPDATE runs SET status = 'interrupted' WHERE id = ?1 AND status = 'running'")
                .bind(id)
                .execute(&mut *tx)
                .await?;
            sqlx::query("UPDATE steps SET status = 'interrupted' WHERE run_id = ?1 AND status = 'running'")
                .bind(id)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            locks::remove_lock(&self.path, &lock);
        }
        Ok(())
    }

    /// Runs, newest first: `limit` of them with ids below `before` (the last id of the previous
    /// page), or the newest. An evaluation's runs are listed with the evaluation, not here
    /// (search still finds them).
    pub async fn list_runs(&self, limit: u32, before: Option<i64>) -> Result<Vec<RunSummary>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, conversation_id, question, status, started_at, wall_ms, calls, input_tokens, output_tokens, cost_usd
             FROM runs WHERE id < ?1
               AND NOT EXISTS (SELECT 1 FROM conversations c WHERE c.id = runs.conversation_id AND c.evaluation_id IS NOT NULL)
             ORDER BY id DESC LIMIT ?2",
        )
        .bind(before.unwrap_or(i64::MAX))
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(run_summary).collect()
    }

    /// The runs of one conversation, oldest first.
    pub async fn conversation_runs(&self, conversation: i64) -> Result<Vec<RunSummary>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, conversation_id, question, status, started_at, wall_ms, calls, input_tokens, output_tokens, cost_usd
             FROM runs WHERE conversation_id = ?1 ORDER BY id",
        )
        .bind(conversation)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(run_summary).collect()
    }

    /// Conversations, most recently active first, paged by `updated_at` like [`Self::list_runs`].
    pub async fn list_conversations(
        &self,
        limit: u32,
        before: Option<i64>,
    ) -> Result<Vec<ConversationSummary>, StoreError> {
        let rows = sqlx::query(concat!(
            conversation_select!(),
            // An evaluation's conversations are listed with the evaluation, not in the chat.
            " WHERE c.updated_at < ?1 AND c.evaluation_id IS NULL ORDER BY c.updated_at DESC, c.id DESC LIMIT ?2"
        ))
        .bind(before.unwrap_or(i64::MAX))
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(conversation_summary).collect()
    }

    /// One conversation, or `None` when there is no such conversation.
    pub async fn conversation(&self, id: i64) -> Result<Option<ConversationSummary>, StoreError> {
        let row = sqlx::query(concat!(conversation_select!(), " WHERE c.id = ?1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(conversation_summary).transpose()
    }

    /// Keeps a conversation's choices: the workers it may use (by name, `None` for all) and
    /// whether its plans are reviewed. False when there is no such conversation.
    pub async fn set_conversation_choices(
        &self,
        conversation: i64,
        workers: Option<&[String]>,
        review: bool,
    ) -> Result<bool, StoreError> {
        let workers = workers.map(|w| serde_json::to_string(w).unwrap_or_else(|_| "[]".into()));
        let done = sqlx::query("UPDATE conversations SET workers = ?2, review = ?3 WHERE id = ?1")
            .bind(conversation)
            .bind(workers)
            .bind(review)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// The conversation's messages, oldest first (the history a follow-up question is asked
    /// with), as turns that alternate: see [`alternating`].
    pub async fn messages(&self, conversation: i64) -> Result<Vec<Message>, StoreError> {
        let rows: Vec<MessageRow> = sqlx::query_as(
            "SELECT m.run_id, m.role, m.content, r.status, r.error_kind
             FROM messages m LEFT JOIN runs r ON r.id = m.run_id
             WHERE m.conversation_id = ?1 ORDER BY m.id",
        )
        .bind(conversation)
        .fetch_all(&self.pool)
        .await?;
        Ok(alternating(rows))
    }

    /// The conversation's messages before run `run` was asked, oldest first: the conversation
    /// as that run's conductor saw it (turns that alternate, like [`Self::messages`]).
    pub async fn messages_before_run(&self, conversation: i64, run: i64) -> Result<Vec<Message>, StoreError> {
        self.messages_around_run(conversation, run, false).await
    }

    /// The run with the executor's id `uid`: its number and its conversation's.
    pub async fn run_by_uid(&self, uid: &str) -> Result<Option<(i64, i64)>, StoreError> {
        Ok(sqlx::query_as("SELECT id, conversation_id FROM runs WHERE uid = ?1")
            .bind(uid)
            .fetch_optional(&self.pool)
            .await?)
    }

    /// The conversation's messages up to run `run`'s answer, oldest first: what a reply to
    /// that answer continues (the Responses API's `previous_response_id`).
    pub async fn messages_through_run(&self, conversation: i64, run: i64) -> Result<Vec<Message>, StoreError> {
        self.messages_around_run(conversation, run, true).await
    }

    /// The conversation's messages before run `run`'s first message, or through its last.
    async fn messages_around_run(
        &self,
        conversation: i64,
        run: i64,
        through: bool,
    ) -> Result<Vec<Message>, StoreError> {
        let rows: Vec<MessageRow> = sqlx::query_as(
            "SELECT m.run_id, m.role, m.content, r.status, r.error_kind
             FROM messages m LEFT JOIN runs r ON r.id = m.run_id
             WHERE m.conversation_id = ?1
               AND CASE WHEN ?3 THEN m.id <= coalesce((SELECT max(id) FROM messages WHERE run_id = ?2), -1)
                   ELSE m.id < coalesce((SELECT min(id) FROM messages WHERE run_id = ?2), 9223372036854775807) END
             ORDER BY m.id",
        )
        .bind(conversation)
        .bind(run)
        .bind(through)
        .fetch_all(&self.pool)
        .await?;
        Ok(alternating(rows))
    }

    /// The conversation (not an evaluation's) whose latest run asked `question` and answered
    /// `answer`: where a client that resends the whole conversation with each request (as the
    /// OpenAI API does) left off. The newest such, if several.
    pub async fn conversation_ending_with(&self, question: &str, answer: &str) -> Result<Option<i64>, StoreError> {
        Ok(sqlx::query_scalar(
            "SELECT r.conversation_id FROM runs r JOIN conversations c ON c.id = r.conversation_id
             WHERE r.question = ?1 AND r.answer = ?2 AND c.evaluation_id IS NULL
               AND r.id = (SELECT max(id) FROM runs WHERE conversation_id = r.conversation_id)
             ORDER BY r.id DESC LIMIT 1",
        )
        .bind(question)
        .bind(answer)
        .fetch_optional(&self.pool)
        .await?)
    }

    pub async fn conversation_title(&self, conversation: i64) -> Result<Option<String>, StoreError> {
        Ok(sqlx::query_scalar("SELECT title FROM conversations WHERE id = ?1")
            .bind(conversation)
            .fetch_optional(&self.pool)
            .await?)
    }

    /// Runs whose question, answer or step subtasks contain every word of `query` (the last
    /// word also as a prefix), newest first, one hit per run.
    pub async fn search(&self, query: &str, limit: u32) -> Result<Vec<SearchHit>, StoreError> {
        let Some(fts) = fts_query(query) else { return Ok(Vec::new()) };
        // Newest first: FTS5 walks an index in rowid order and stops at the limit, so a word
        // that matches most of the history costs as little as a rare one (ranking by relevance
        // would score every match first: ~0.6 s for a common word over 100k runs).
        // Matches are marked with \x02 and \x03 (which text never holds) to tell which column
        // matched; they become [ and ] for display.
        let rows = sqlx::query(
            "SELECT * FROM (
                 SELECT r.id, r.conversation_id, r.question, r.status, r.started_at,
                        snippet(run_text, 0, char(2), char(3), '…', 12) AS s0,
                        snippet(run_text, 1, char(2), char(3), '…', 12) AS s1
                 FROM run_text JOIN runs r ON r.id = run_text.rowid
                 WHERE run_text MATCH ?1 ORDER BY run_text.rowid DESC LIMIT ?2)
             UNION ALL
             SELECT * FROM (
                 SELECT r.id, r.conversation_id, r.question, r.status, r.started_at,
                        NULL AS s0, snippet(step_text, 0, char(2), char(3), '…', 12) AS s1
                 FROM step_text JOIN steps s ON s.id = step_text.rowid JOIN runs r ON r.id = s.run_id
                 WHERE step_text MATCH ?1 ORDER BY step_text.rowid DESC LIMIT ?2)
             ORDER BY id DESC",
        )
        .bind(&fts)
        .bind(limit.saturating_mul(4))
        .fetch_all(&self.pool)
        .await?;
        let mut seen = std::collections::HashSet::new();
        let mut hits = Vec::new();
        for r in &rows {
            let id: i64 = r.get("id");
            if !seen.insert(id) {
                continue;
            }
            let s0: Option<String> = r.get("s0");
            let s1: String = r.get("s1");
            let (matched, snippet) = match s0 {
                Some(q) if q.contains('\u{2}') => ("question", q),
                Some(_) => ("answer", s1),
                None => ("subtask", s1),
            };
            hits.push(SearchHit {
                id,
                conversation_id: r.get("conversation_id"),
                question: r.get("question"),
                status: status(r.get("status"))?,
                started_at: r.get("started_at"),
                matched: matched.to_owned(),
                snippet: snippet.replace('\u{2}', "[").replace('\u{3}', "]"),
            });
            if hits.len() == limit as usize {
                break;
            }
        }
        Ok(hits)
    }

    /// A run's whole tree, or `None` when there is no such run.
    pub async fn run(&self, id: i64) -> Result<Option<RunTree>, StoreError> {
        // One read transaction: the run, its plans, steps and events from one snapshot, though a
        // recorder may commit between the queries.
        let mut read = self.pool.begin().await?;
        let Some(r) = sqlx::query("SELECT * FROM runs WHERE id = ?1").bind(id).fetch_optional(&mut *read).await? else {
            return Ok(None);
        };
        let workers: String = r.get("workers");
        let run = RunRecord {
            id: r.get("id"),
            uid: r.get("uid"),
            conversation_id: r.get("conversation_id"),
            question: r.get("question"),
            conductor: r.get("conductor"),
            workers: serde_json::from_str(&workers).map_err(|e| decode("runs.workers", e))?,
            status: status(r.get("status"))?,
            answer: r.get("answer"),
            error_kind: r.get("error_kind"),
            error: r.get("error"),
            started_at: r.get("started_at"),
            finished_at: r.get("finished_at"),
            rounds: r.get("rounds"),
            calls: r.get("calls"),
            input_tokens: r.get("input_tokens"),
            output_tokens: r.get("output_tokens"),
            cost_usd: r.get("cost_usd"),
            cost_complete: r.get("cost_complete"),
            totals: r
                .get::<Option<String>, _>("totals")
                .map(|t| serde_json::from_str(&t))
                .transpose()
                .map_err(|e| decode("runs.totals", e))?,
            wall_ms: r.get("wall_ms"),
            rerun_of: match (r.get::<Option<String>, _>("rerun_of"), r.get::<Option<i64>, _>("rerun_step")) {
                (Some(run_id), Some(step)) => Some(RerunOf { run_id, step: step as usize }),
                _ => None,
            },
        };
        let plans: Vec<PlanRecord> =
            sqlx::query_as::<_, PlanRow>("SELECT * FROM plans WHERE run_id = ?1 ORDER BY round")
                .bind(id)
                .fetch_all(&mut *read)
                .await?
                .into_iter()
                .map(PlanRow::into_record)
                .collect::<Result<_, _>>()?;
        let rows = sqlx::query_as::<_, StepRow>("SELECT * FROM steps WHERE run_id = ?1 ORDER BY round, step")
            .bind(id)
            .fetch_all(&mut *read)
            .await?;
        let events: Vec<(String, Option<String>)> =
            sqlx::query_as("SELECT event, elided FROM events WHERE run_id = ?1 ORDER BY seq")
                .bind(id)
                .fetch_all(&mut *read)
                .await?;

        // Requests and events refer to texts the rows hold; they are put back here.
        let texts = stored::Texts {
            run: &run,
            plans: plans
                .iter()
                .map(|p| (p.round, (serde_json::to_value(&p.plan).unwrap_or_default(), p.raw.as_deref())))
                .collect(),
            steps: rows
                .iter()
                .map(|r| ((r.round as u32, r.step as usize), (r.subtask.as_str(), r.output.as_deref())))
                .collect(),
        };
        let mut requests = HashMap::new();
        for r in &rows {
            if let Some(request) = &r.request {
                let request = serde_json::from_str(request).map_err(|e| decode("steps.request", e))?;
                requests.insert((r.round as u32, r.step as usize), texts.request(request)?);
            }
        }
        let events = events
            .into_iter()
            .map(|(event, elided)| {
                let mut event: serde_json::Value = serde_json::from_str(&event).map_err(|e| decode("events", e))?;
                if let Some(elided) = elided {
                    texts.fill(&mut event, &elided, &requests)?;
                }
                Ok(event)
            })
            .collect::<Result<_, StoreError>>()?;
        let steps = rows
            .into_iter()
            .map(|r| {
                let request = requests.remove(&(r.round as u32, r.step as usize));
                r.into_record(request)
            })
            .collect::<Result<_, _>>()?;
        Ok(Some(RunTree { run, plans, steps, events }))
    }

    /// Deletes a run with its plans, steps, events and its question and answer in the conversation.
    /// False when there was no such run. A run that is still being recorded (here or by another
    /// process) is refused with [`StoreError::RunStillGoing`]: its recorder would go on writing
    /// rows of a run that is gone.
    pub async fn delete_run(&self, id: i64) -> Result<bool, StoreError> {
        // IMMEDIATE: no recorder can start or end a run between the check and the delete.
        let mut tx = self.write().await?;
        let running: Vec<(i64, String)> =
            sqlx::query_as("SELECT id, coalesce(recorder, uid) FROM runs WHERE id = ?1 AND status = 'running'")
                .bind(id)
                .fetch_all(&mut *tx)
                .await?;
        if let Some((run, _)) = running.iter().find(|(_, lock)| locks::is_live(&self.path, lock)) {
            return Err(StoreError::RunStillGoing { run: *run });
        }
        // Its question and answer go with it, so later runs in the conversation stop seeing them.
        sqlx::query("DELETE FROM messages WHERE run_id = ?1").bind(id).execute(&mut *tx).await?;
        let done = sqlx::query("DELETE FROM runs WHERE id = ?1").bind(id).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(done.rows_affected() > 0)
    }

    /// Deletes a conversation with all its runs and messages; refused, like [`Self::delete_run`],
    /// while one of its runs is still being recorded.
    pub async fn delete_conversation(&self, id: i64) -> Result<bool, StoreError> {
        let mut tx = self.write().await?;
        let running: Vec<(i64, String)> = sqlx::query_as(
            "SELECT id, coalesce(recorder, uid) FROM runs WHERE conversation_id = ?1 AND status = 'running'",
        )
        .bind(id)
        .fetch_all(&mut *tx)
        .await?;
        if let Some((run, _)) = running.iter().find(|(_, lock)| locks::is_live(&self.path, lock)) {
            return Err(StoreError::ConversationStillGoing { conversation: id, run: *run });
        }
        let done = sqlx::query("DELETE FROM conversations WHERE id = ?1").bind(id).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(done.rows_affected() > 0)
    }

    /// A transaction that writes. It takes the database's write lock when it begins (waiting
    /// out the busy timeout), not at its first write: a deferred transaction that read before
    /// another connection wrote cannot upgrade, and SQLite fails it at once whatever the
    /// timeout, which broke runs recorded side by side (an evaluation's, a comparison's).
    pub(crate) async fn write(&self) -> Result<sqlx::Transaction<'static, sqlx::Sqlite>, sqlx::Error> {
        self.pool.begin_with("BEGIN IMMEDIATE").await
    }
}

fn classify_open_error(path: &str, e: &sqlx::Error) -> StoreError {
    let message = e.to_string();
    if message.contains("not a database") || message.contains("malformed") {
        StoreError::Corrupt { path: path.to_owned(), message }
    } else {
        StoreError::Open { path: path.to_owned(), message }
    }
}

/// A row of the messages table, with the state of the run it belongs to.
#[derive(FromRow)]
struct MessageRow {
    run_id: Option<i64>,
    role: String,
    content: String,
    status: Option<String>,
    error_kind: Option<String>,
}

/// A conversation's messages as chat turns that alternate user, assistant, user, ...
///
/// A run that ended without an answer (failed, stopped, interrupted, or still going) leaves its
/// question alone in the table. Sent as it is, the next question would follow it as a second
/// user turn in a row, which many chat templates refuse (Mistral's, Gemma's, many GGUFs'), and
/// the conductor would not know the question went unanswered. So each question is followed by
/// its own run's answer, or by an assistant turn saying plainly what became of it; and any
/// other turns of the same role in a row (which no recorder writes) are joined into one.
fn alternating(rows: Vec<MessageRow>) -> Vec<Message> {
    let answers: HashMap<i64, usize> = rows
        .iter()
        .enumerate()
        .filter(|(_, m)| m.role == "assistant")
        .filter_map(|(i, m)| Some((m.run_id?, i)))
        .collect();
    let mut used = vec![false; rows.len()];
    let mut turns: Vec<Message> = Vec::with_capacity(rows.len() + 1);
    let mut push = |turn: Message| match turns.last_mut() {
        Some(last) if last.role == turn.role => {
            last.content.push_str("\n\n");
            last.content.push_str(&turn.content);
        }
        _ => turns.push(turn),
    };
    for (i, row) in rows.iter().enumerate() {
        if used[i] {
            continue;
        }
        used[i] = true;
        if row.role != "user" {
            push(Message::assistant(row.content.clone()));
            continue;
        }
        push(Message::user(row.content.clone()));
        let Some(run) = row.run_id else { continue };
        match answers.get(&run) {
            Some(&a) if !used[a] => {
                used[a] = true;
                push(Message::assistant(rows[a].content.clone()));
            }
            _ => push(Message::assistant(unanswered(row.status.as_deref(), row.error_kind.as_deref()))),
        }
    }
    turns
}

/// The assistant turn that stands for a question's missing answer. It names no worker, model
/// or error text: the conductor sees workers only as numbers.
fn unanswered(status: Option<&str>, error_kind: Option<&str>) -> String {
    let why = match (status, error_kind) {
        (Some("running"), _) => "(no answer yet: the question is still being worked on)",
        (Some("cancelled"), _) => "(no answer: the run was stopped before it finished)",
        (Some("interrupted"), _) => "(no answer: the run was interrupted before it finished)",
        (Some("failed"), Some("invalid_plan")) => "(no answer: the run failed: its plan was not valid for the workers)",
        (Some("failed"), Some("budget_exceeded")) => "(no answer: the run failed: a budget cap was reached)",
        (Some("failed"), Some("conductor")) => "(no answer: the run failed: no plan could be written)",
        (Some("failed"), _) => "(no answer: the run failed: a step of its plan failed)",
        _ => "(no answer)",
    };
    why.to_owned()
}

fn conversation_summary(r: &sqlx::sqlite::SqliteRow) -> Result<ConversationSummary, StoreError> {
    let workers: Option<String> = r.get("workers");
    Ok(ConversationSummary {
        id: r.get("id"),
        title: r.get("title"),
        created_at: r.get("created_at"),
        updated_at: r.get("updated_at"),
        runs: r.get("runs"),
        workers: workers
            .map(|w| serde_json::from_str(&w))
            .transpose()
            .map_err(|e| decode("conversations.workers", e))?,
        review: r.get("review"),
    })
}

fn decode(what: &str, e: serde_json::Error) -> StoreError {
    StoreError::Sql(sqlx::Error::Decode(format!("{what}: {e}").into()))
}

fn status(s: String) -> Result<RunStatus, StoreError> {
    s.parse().map_err(|e: String| StoreError::Sql(sqlx::Error::Decode(e.into())))
}

fn run_summary(r: &sqlx::sqlite::SqliteRow) -> Result<RunSummary, StoreError> {
    Ok(RunSummary {
        id: r.get("id"),
        conversation_id: r.get("conversation_id"),
        question: r.get("question"),
        status: status(r.get("status"))?,
        started_at: r.get("started_at"),
        wall_ms: r.get("wall_ms"),
        calls: r.get("calls"),
        input_tokens: r.get("input_tokens"),
        output_tokens: r.get("output_tokens"),
        cost_usd: r.get("cost_usd"),
    })
}

/// A user's words as an FTS5 query: each word quoted (so punctuation is never syntax), all of
/// them required, the last one also as a prefix so results come while typing.
fn fts_query(query: &str) -> Option<String> {
    let words: Vec<String> = query
        .split(|c: char| !c.is_alphanumeric() && c != '\'' && c != '_')
        .filter(|w| !w.is_empty())
        .map(|w| format!("\"{}\"", w.replace('"', "\"\"")))
        .collect();
    let (last, rest) = words.split_last()?;
    let mut q = rest.join(" ");
    if !q.is_empty() {
        q.push(' ');
    }
    q.push_str(last);
    q.push('*');
    Some(q)
}

#[derive(FromRow)]
struct PlanRow {
    round: i64,
    depth: i64,
    parent_round: Option<i64>,
    parent_step: Option<i64>,
    raw: Option<String>,
    plan: String,
    input_tokens: Option<i64>,
    cached_input_tokens: Option<i64>,
    output_tokens: Option<i64>,
    stop_reason: Option<String>,
    prompt: Option<String>,
    rejected: Option<String>,
    fallback: Option<String>,
}

impl PlanRow {
    fn into_record(self) -> Result<PlanRecord, StoreError> {
        Ok(PlanRecord {
            round: self.round as u32,
            depth: self.depth as u32,
            parent: match (self.parent_round, self.parent_step) {
                (Some(round), Some(step)) => Some(StepRef { round: round as u32, step: step as usize }),
                _ => None,
            },
            raw: self.raw,
            plan: serde_json::from_str(&self.plan).map_err(|e| decode("plans.plan", e))?,
            usage: match (self.input_tokens, self.output_tokens) {
                (Some(input), Some(output)) => Some(Usage {
                    input_tokens: input as u64,
                    output_tokens: output as u64,
                    cached_input_tokens: self.cached_input_tokens.unwrap_or(0) as u64,
                    ..Usage::default()
                }),
                _ => None,
            },
            stop_reason: self.stop_reason,
            prompt: match self.prompt {
                Some(p) => Some(serde_json::from_str(&p).map_err(|e| decode("plans.prompt", e))?),
                None => None,
            },
            rejected: match self.rejected {
                Some(r) => serde_json::from_str(&r).map_err(|e| decode("plans.rejected", e))?,
                None => Vec::new(),
            },
            fallback: self.fallback,
        })
    }
}

#[derive(FromRow)]
struct StepRow {
    round: i64,
    step: i64,
    worker_index: i64,
    worker: String,
    subtask: String,
    access: String,
    request: Option<String>,
    status: String,
    output: Option<String>,
    error_kind: Option<String>,
    error: Option<String>,
    input_tokens: Option<i64>,
    cached_input_tokens: Option<i64>,
    cache_write_input_tokens: Option<i64>,
    output_tokens: Option<i64>,
    cost_usd: Option<f64>,
    latency_ms: Option<i64>,
    retries: i64,
    reused_from: Option<String>,
}

impl StepRow {
    /// The record, with the request as it was sent (`self.request` read back by the caller).
    fn into_record(self, request: Option<SentRequest>) -> Result<StepRecord, StoreError> {
        Ok(StepRecord {
            round: self.round as u32,
            step: self.step as u32,
            worker_index: self.worker_index as u32,
            worker: self.worker,
            subtask: self.subtask,
            access: recorder::access_from_json(&self.access).map_err(|e| decode("steps.access", e))?,
            request,
            status: self.status,
            output: self.output,
            error_kind: self.error_kind,
            error: self.error,
            input_tokens: self.input_tokens,
            cached_input_tokens: self.cached_input_tokens,
            cache_write_input_tokens: self.cache_write_input_tokens,
            output_tokens: self.output_tokens,
            cost_usd: self.cost_usd,
            latency_ms: self.latency_ms,
            retries: self.retries,
            reused_from: self.reused_from,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::fts_query;

    #[test]
    fn search_words_are_quoted_and_the_last_is_a_prefix() {
        assert_eq!(fts_query("sky blue").as_deref(), Some("\"sky\" \"blue\"*"));
        assert_eq!(fts_query("  \"quote\" AND -x: ").as_deref(), Some("\"quote\" \"AND\" \"x\"*"));
        assert_eq!(fts_query(" -- "), None);
    }
}

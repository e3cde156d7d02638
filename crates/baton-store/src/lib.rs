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
mod conversations;
pub mod evaluations;
pub mod export;
pub mod figures;
mod locks;
mod open;
pub mod profiles;
mod recorder;
mod records;
pub mod relay;
mod runs;
mod search;
mod serve_spend;
mod stored;
pub mod synthetic;
pub mod time;

use std::path::PathBuf;

use sqlx::sqlite::SqlitePool;

pub use open::{MIGRATOR, default_path};
pub use recorder::Recorder;
pub use records::{
    ConversationSummary, PlanRecord, RejectedPlan, RunRecord, RunStatus, RunSummary, RunTree, SearchHit, SentRequest,
    StepRecord,
};
// `stored` reads rows back with it, as `crate::decode`.
pub(crate) use records::decode;

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

/// The history database.
#[derive(Debug, Clone)]
pub struct Store {
    pool: SqlitePool,
    path: PathBuf,
    /// Lock files for the runs this store records (see [`locks`]); freed when the last clone goes.
    slots: std::sync::Arc<locks::Slots>,
}

impl Store {
    /// A recorder for the next run, in `conversation` or (with `None`) in a new conversation
    /// titled after the question.
    pub fn recorder(&self, conversation: Option<i64>) -> Recorder {
        Recorder::new(self.clone(), conversation)
    }
}

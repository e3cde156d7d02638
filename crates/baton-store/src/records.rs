//! The records the history hands out (runs, conversations, search hits, a run's whole tree),
//! and how they are read back from the rows that hold them.

use std::str::FromStr;

use baton_engine::{RerunOf, StepRef, Totals, WorkerInfo};
use baton_plan::{Access, Plan};
use baton_providers::{Message, Usage};
use serde::Serialize;
use sqlx::{FromRow, Row};

use crate::StoreError;

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

/// The columns [`conversation_summary`] reads; a macro so queries can extend it with `concat!`.
macro_rules! conversation_select {
    () => {
        "SELECT c.id, c.title, c.created_at, c.updated_at, c.workers, c.review,
                (SELECT count(*) FROM runs r WHERE r.conversation_id = c.id) AS runs
         FROM conversations c"
    };
}
// Re-exported so the queries can name it by path (`crate::records::conversation_select`).
pub(crate) use conversation_select;

pub(crate) fn conversation_summary(r: &sqlx::sqlite::SqliteRow) -> Result<ConversationSummary, StoreError> {
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

pub(crate) fn decode(what: &str, e: serde_json::Error) -> StoreError {
    StoreError::Sql(sqlx::Error::Decode(format!("{what}: {e}").into()))
}

pub(crate) fn status(s: String) -> Result<RunStatus, StoreError> {
    s.parse().map_err(|e: String| StoreError::Sql(sqlx::Error::Decode(e.into())))
}

pub(crate) fn run_summary(r: &sqlx::sqlite::SqliteRow) -> Result<RunSummary, StoreError> {
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

#[derive(FromRow)]
pub(crate) struct PlanRow {
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
    pub(crate) fn into_record(self) -> Result<PlanRecord, StoreError> {
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

/// A row of the steps table. [`crate::Store::run`] reads the fields that are `pub(crate)` (to put
/// back the texts requests refer to) before it turns the row into a record.
#[derive(FromRow)]
pub(crate) struct StepRow {
    pub(crate) round: i64,
    pub(crate) step: i64,
    worker_index: i64,
    worker: String,
    pub(crate) subtask: String,
    access: String,
    pub(crate) request: Option<String>,
    status: String,
    pub(crate) output: Option<String>,
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
    pub(crate) fn into_record(self, request: Option<SentRequest>) -> Result<StepRecord, StoreError> {
        Ok(StepRecord {
            round: self.round as u32,
            step: self.step as u32,
            worker_index: self.worker_index as u32,
            worker: self.worker,
            subtask: self.subtask,
            access: serde_json::from_str(&self.access).map_err(|e| decode("steps.access", e))?,
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

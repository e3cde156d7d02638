//! Compare in chat: one question answered by the conductor and by one worker alone, side by
//! side, and the user's mark of the better answer. Marked comparisons become preference pairs
//! (`prompt`, `chosen`, `rejected`), the dataset form TRL's `DPOTrainer` and reward-model
//! trainers read, exported beside the GRPO data of `baton eval export-grpo`.

use serde::{Deserialize, Serialize};
use sqlx::Row;

use crate::time::now_ms;
use crate::{Store, StoreError};

/// Which answer of a comparison the user marked better.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ts_rs::TS)]
#[serde(rename_all = "snake_case")]
pub enum Preferred {
    Conductor,
    /// The worker alone.
    Single,
    /// Neither is better.
    Tie,
}

impl Preferred {
    fn as_str(self) -> &'static str {
        match self {
            Preferred::Conductor => "conductor",
            Preferred::Single => "single",
            Preferred::Tie => "tie",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "conductor" => Some(Preferred::Conductor),
            "single" => Some(Preferred::Single),
            "tie" => Some(Preferred::Tie),
            _ => None,
        }
    }
}

/// A comparison as kept: its two runs (by their id in the history; `None` once deleted, or if
/// the run could not be recorded) and the mark.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ts_rs::TS)]
pub struct ChatComparison {
    pub id: i64,
    pub conversation_id: i64,
    pub conductor_run: Option<i64>,
    pub single_run: Option<i64>,
    /// The worker that answered alone.
    pub worker: String,
    pub preferred: Option<Preferred>,
    pub created_at: i64,
    pub marked_at: Option<i64>,
}

/// A marked comparison whose two runs both answered, as a training example: the conversation
/// up to the question (`prompt`, chat messages), the answer marked better and the other.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreferencePair {
    pub prompt: Vec<serde_json::Value>,
    pub chosen: Vec<serde_json::Value>,
    pub rejected: Vec<serde_json::Value>,
    /// `conductor` or `single:<worker>`: who wrote `chosen`, and who `rejected`.
    pub chosen_by: String,
    pub rejected_by: String,
    pub comparison_id: i64,
    /// The runs' executor ids (`baton history show` finds them by number; these stay stable).
    pub conductor_run: String,
    pub single_run: String,
}

/// The columns [`comparison_row`] reads; a macro so queries can extend it with `concat!`.
macro_rules! comparison_select {
    () => {
        "SELECT id, conversation_id, conductor_run, single_run, worker, preferred, created_at, marked_at
         FROM comparisons"
    };
}

fn comparison_row(row: &sqlx::sqlite::SqliteRow) -> Result<ChatComparison, StoreError> {
    let preferred: Option<String> = row.try_get("preferred")?;
    Ok(ChatComparison {
        id: row.try_get("id")?,
        conversation_id: row.try_get("conversation_id")?,
        conductor_run: row.try_get("conductor_run")?,
        single_run: row.try_get("single_run")?,
        worker: row.try_get("worker")?,
        preferred: preferred.as_deref().and_then(Preferred::parse),
        created_at: row.try_get("created_at")?,
        marked_at: row.try_get("marked_at")?,
    })
}

fn message(role: &str, content: &str) -> serde_json::Value {
    serde_json::json!({ "role": role, "content": content })
}

impl Store {
    /// A new conversation for a question whose runs start side by side (each recorder then
    /// joins it rather than making its own). Titled like a conversation a run starts.
    pub async fn new_conversation(&self, question: &str) -> Result<i64, StoreError> {
        let now = now_ms();
        Ok(sqlx::query_scalar(
            "INSERT INTO conversations (title, created_at, updated_at) VALUES (?1, ?2, ?2) RETURNING id",
        )
        .bind(crate::recorder::title(question))
        .bind(now)
        .fetch_one(&self.pool)
        .await?)
    }

    /// Keeps a comparison of `conductor_run` and `single_run` (ids in the history) in
    /// `conversation`; returns its id. `worker` is the one that answered alone, by name and by
    /// [identity](baton_engine::WorkerSpec::identity): its marks add to the profile of that
    /// identity (see [`Store::learned`]).
    pub async fn add_comparison(
        &self,
        conversation: i64,
        conductor_run: Option<i64>,
        single_run: Option<i64>,
        worker: (&str, &str),
    ) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar(
            "INSERT INTO comparisons (conversation_id, conductor_run, single_run, worker, worker_identity, created_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6) RETURNING id",
        )
        .bind(conversation)
        .bind(conductor_run)
        .bind(single_run)
        .bind(worker.0)
        .bind(worker.1)
        .bind(now_ms())
        .fetch_one(&self.pool)
        .await?)
    }

    /// Marks the better answer of comparison `id` (`None` takes the mark back); `false` if
    /// there is no such comparison.
    pub async fn mark_comparison(&self, id: i64, preferred: Option<Preferred>) -> Result<bool, StoreError> {
        let done = sqlx::query("UPDATE comparisons SET preferred = ?2, marked_at = ?3 WHERE id = ?1")
            .bind(id)
            .bind(preferred.map(Preferred::as_str))
            .bind(preferred.map(|_| now_ms()))
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    pub async fn comparison(&self, id: i64) -> Result<Option<ChatComparison>, StoreError> {
        let row =
            sqlx::query(concat!(comparison_select!(), " WHERE id = ?1")).bind(id).fetch_optional(&self.pool).await?;
        row.as_ref().map(comparison_row).transpose()
    }

    /// A conversation's comparisons, oldest first.
    pub async fn comparisons(&self, conversation: i64) -> Result<Vec<ChatComparison>, StoreError> {
        let rows = sqlx::query(concat!(comparison_select!(), " WHERE conversation_id = ?1 ORDER BY id"))
            .bind(conversation)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(comparison_row).collect()
    }

    /// Every comparison marked with a winner (not a tie) whose two runs both answered, oldest
    /// first, as preference pairs.
    pub async fn preference_pairs(&self) -> Result<Vec<PreferencePair>, StoreError> {
        let rows = sqlx::query(
            "SELECT c.id, c.conversation_id, c.worker, c.preferred, c.conductor_run,
                    a.uid AS a_uid, a.question, a.answer AS a_answer, b.uid AS b_uid, b.answer AS b_answer
             FROM comparisons c
             JOIN runs a ON a.id = c.conductor_run
             JOIN runs b ON b.id = c.single_run
             WHERE c.preferred IN ('conductor', 'single')
               AND a.status = 'finished' AND b.status = 'finished'
             ORDER BY c.id",
        )
        .fetch_all(&self.pool)
        .await?;
        let mut pairs = Vec::with_capacity(rows.len());
        for row in rows {
            let conversation: i64 = row.try_get("conversation_id")?;
            let conductor_run: i64 = row.try_get("conductor_run")?;
            let worker: String = row.try_get("worker")?;
            let question: String = row.try_get("question")?;
            let conductor_answer: String = row.try_get::<Option<String>, _>("a_answer")?.unwrap_or_default();
            let single_answer: String = row.try_get::<Option<String>, _>("b_answer")?.unwrap_or_default();
            // The conversation as the question found it, then the question.
            let mut prompt: Vec<serde_json::Value> = self
                .messages_before_run(conversation, conductor_run)
                .await?
                .iter()
                .map(|m| serde_json::to_value(m).unwrap_or_default())
                .collect();
            prompt.push(message("user", &question));
            let single_by = format!("single:{worker}");
            let conductor_won = row.try_get::<String, _>("preferred")? == "conductor";
            let (chosen, rejected, chosen_by, rejected_by) = if conductor_won {
                (conductor_answer, single_answer, "conductor".to_owned(), single_by)
            } else {
                (single_answer, conductor_answer, single_by, "conductor".to_owned())
            };
            pairs.push(PreferencePair {
                prompt,
                chosen: vec![message("assistant", &chosen)],
                rejected: vec![message("assistant", &rejected)],
                chosen_by,
                rejected_by,
                comparison_id: row.try_get("id")?,
                conductor_run: row.try_get("a_uid")?,
                single_run: row.try_get("b_uid")?,
            });
        }
        Ok(pairs)
    }
}

//! Conversations: listing them, their choices and titles, their messages as the chat turns a
//! follow-up question is asked with, and deleting one.

use std::collections::HashMap;

use baton_providers::Message;
use sqlx::FromRow;

use crate::records::{conversation_select, conversation_summary};
use crate::{ConversationSummary, Store, StoreError, locks};

impl Store {
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

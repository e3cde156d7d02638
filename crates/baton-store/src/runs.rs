//! Reading runs back (a page of them, a conversation's, one by its executor id, one's whole
//! tree) and deleting one.

use std::collections::HashMap;

use baton_engine::RerunOf;
use sqlx::Row;

use crate::records::{PlanRow, StepRow, decode, run_summary, status};
use crate::{PlanRecord, RunRecord, RunSummary, RunTree, Store, StoreError, locks, stored};

impl Store {
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

    /// The run with the executor's id `uid`: its number and its conversation's.
    pub async fn run_by_uid(&self, uid: &str) -> Result<Option<(i64, i64)>, StoreError> {
        Ok(sqlx::query_as("SELECT id, conversation_id FROM runs WHERE uid = ?1")
            .bind(uid)
            .fetch_optional(&self.pool)
            .await?)
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
}

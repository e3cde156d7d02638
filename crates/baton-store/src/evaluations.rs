//! Evaluations in the history: what was asked for, and every item's result per strategy.
//! The harness (`baton-eval`) decides what to run; this module only keeps it, so a killed
//! evaluation resumes from what is here and nothing finished is paid for twice.

use baton_engine::accounting::Figures;
use baton_providers::Usage;
use serde::{Deserialize, Serialize};
use sqlx::Row;

use crate::time::now_ms;
use crate::{Store, StoreError};

macro_rules! evaluation_select {
    () => {
        "SELECT e.id, e.suite, e.suite_sha256, e.config, e.status, e.spent_usd, e.created_at, e.updated_at,
                (SELECT count(*) FROM eval_results r WHERE r.evaluation_id = e.id) AS results
         FROM evaluations e"
    };
}

/// An evaluation as listed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ts_rs::TS)]
pub struct Evaluation {
    pub id: String,
    pub suite: String,
    pub suite_sha256: String,
    /// The harness's own JSON (strategies, repeats, choices made along the way).
    pub config: serde_json::Value,
    pub status: String,
    pub spent_usd: f64,
    pub created_at: i64,
    pub updated_at: i64,
    /// Results recorded so far.
    pub results: i64,
}

/// One strategy's result on one item (one repeat).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ts_rs::TS)]
pub struct EvalResult {
    pub strategy: String,
    pub item_id: String,
    pub repeat: u32,
    /// `calibration` or `test`.
    pub split: String,
    pub category: String,
    /// The item's kind (`number`, `choice`, `code`, `exact`); none in results kept before
    /// kinds were (schema 12).
    #[serde(default)]
    pub kind: Option<String>,
    pub run_uid: Option<String>,
    /// The run's number in the history (`baton history show N`), while it is there; read, never
    /// written.
    #[serde(default)]
    pub run_id: Option<i64>,
    pub answer: Option<String>,
    pub extracted: Option<String>,
    pub correct: bool,
    pub error: Option<String>,
    pub plan_valid: Option<bool>,
    pub steps: Option<u32>,
    /// The run's calls, tokens and dollars, conductor and workers together. What the history
    /// keeps of a result: not the tokens written to a prompt cache, nor whether a count was
    /// estimated.
    pub figures: Figures,
    /// The conductor's tokens, a share of `figures.usage` (the same limits).
    pub conductor_usage: Usage,
    pub latency_ms: u64,
}

impl Store {
    /// The evaluation `id`, if there is one.
    pub async fn evaluation(&self, id: &str) -> Result<Option<Evaluation>, StoreError> {
        let row =
            sqlx::query(concat!(evaluation_select!(), " WHERE e.id = ?1")).bind(id).fetch_optional(&self.pool).await?;
        row.as_ref().map(evaluation_row).transpose()
    }

    /// Every evaluation, newest first.
    pub async fn evaluations(&self) -> Result<Vec<Evaluation>, StoreError> {
        let rows = sqlx::query(concat!(evaluation_select!(), " ORDER BY e.created_at DESC, e.id"))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(evaluation_row).collect()
    }

    /// Starts an evaluation (status `running`). Fails if the id is taken.
    pub async fn create_evaluation(
        &self,
        id: &str,
        suite: &str,
        suite_sha256: &str,
        config: &serde_json::Value,
    ) -> Result<(), StoreError> {
        let now = now_ms();
        sqlx::query(
            "INSERT INTO evaluations (id, suite, suite_sha256, config, status, created_at, updated_at)
             VALUES (?1, ?2, ?3, ?4, 'running', ?5, ?5)",
        )
        .bind(id)
        .bind(suite)
        .bind(suite_sha256)
        .bind(config.to_string())
        .bind(now)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Replaces the evaluation's config (choices made along the way) and status.
    pub async fn update_evaluation(
        &self,
        id: &str,
        config: &serde_json::Value,
        status: &str,
    ) -> Result<(), StoreError> {
        sqlx::query("UPDATE evaluations SET config = ?2, status = ?3, updated_at = ?4 WHERE id = ?1")
            .bind(id)
            .bind(config.to_string())
            .bind(status)
            .bind(now_ms())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Adds to what the evaluation has spent.
    pub async fn add_evaluation_spend(&self, id: &str, usd: f64) -> Result<(), StoreError> {
        sqlx::query("UPDATE evaluations SET spent_usd = spent_usd + ?2, updated_at = ?3 WHERE id = ?1")
            .bind(id)
            .bind(usd)
            .bind(now_ms())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// A conversation for one of the evaluation's runs, kept out of the chat's list.
    pub async fn create_evaluation_conversation(&self, evaluation: &str, title: &str) -> Result<i64, StoreError> {
        let now = now_ms();
        let title: String = title.chars().take(80).collect();
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO conversations (title, created_at, updated_at, evaluation_id) VALUES (?1, ?2, ?2, ?3) RETURNING id",
        )
        .bind(title)
        .bind(now)
        .bind(evaluation)
        .fetch_one(&self.pool)
        .await?;
        Ok(id)
    }

    /// Records (or replaces) one result.
    pub async fn put_eval_result(&self, evaluation: &str, r: &EvalResult) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT OR REPLACE INTO eval_results (evaluation_id, strategy, item_id, repeat, split, category, run_uid,
                 answer, extracted, correct, error, plan_valid, steps, calls, input_tokens, cached_input_tokens,
                 output_tokens, conductor_input_tokens, conductor_cached_input_tokens, conductor_output_tokens,
                 cost_usd, cost_complete, latency_ms, created_at, kind)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21, ?22, ?23, ?24, ?25)",
        )
        .bind(evaluation)
        .bind(&r.strategy)
        .bind(&r.item_id)
        .bind(r.repeat)
        .bind(&r.split)
        .bind(&r.category)
        .bind(&r.run_uid)
        .bind(&r.answer)
        .bind(&r.extracted)
        .bind(r.correct)
        .bind(&r.error)
        .bind(r.plan_valid)
        .bind(r.steps)
        .bind(r.figures.calls)
        .bind(r.figures.usage.input_tokens as i64)
        .bind(r.figures.usage.cached_input_tokens as i64)
        .bind(r.figures.usage.output_tokens as i64)
        .bind(r.conductor_usage.input_tokens as i64)
        .bind(r.conductor_usage.cached_input_tokens as i64)
        .bind(r.conductor_usage.output_tokens as i64)
        .bind(r.figures.cost_usd)
        .bind(r.figures.cost_complete)
        .bind(r.latency_ms as i64)
        .bind(now_ms())
        .bind(&r.kind)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Every result of the evaluation, by strategy, item and repeat.
    pub async fn eval_results(&self, evaluation: &str) -> Result<Vec<EvalResult>, StoreError> {
        let rows = sqlx::query(
            "SELECT e.strategy, e.item_id, e.repeat, e.split, e.category, e.kind, e.run_uid, r.id AS run_id, e.answer, e.extracted,
                    e.correct, e.error, e.plan_valid, e.steps, e.calls, e.input_tokens, e.cached_input_tokens,
                    e.output_tokens, e.conductor_input_tokens, e.conductor_cached_input_tokens,
                    e.conductor_output_tokens, e.cost_usd, e.cost_complete, e.latency_ms
             FROM eval_results e LEFT JOIN runs r ON r.uid = e.run_uid
             WHERE e.evaluation_id = ?1 ORDER BY e.strategy, e.item_id, e.repeat",
        )
        .bind(evaluation)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(EvalResult {
                    strategy: r.try_get("strategy")?,
                    item_id: r.try_get("item_id")?,
                    repeat: r.try_get::<i64, _>("repeat")? as u32,
                    split: r.try_get("split")?,
                    category: r.try_get("category")?,
                    kind: r.try_get("kind")?,
                    run_uid: r.try_get("run_uid")?,
                    run_id: r.try_get("run_id")?,
                    answer: r.try_get("answer")?,
                    extracted: r.try_get("extracted")?,
                    correct: r.try_get("correct")?,
                    error: r.try_get("error")?,
                    plan_valid: r.try_get("plan_valid")?,
                    steps: r.try_get::<Option<i64>, _>("steps")?.map(|s| s as u32),
                    figures: Figures {
                        calls: r.try_get::<i64, _>("calls")? as u32,
                        usage: usage(r, "")?,
                        cost_usd: r.try_get("cost_usd")?,
                        cost_complete: r.try_get("cost_complete")?,
                    },
                    conductor_usage: usage(r, "conductor_")?,
                    latency_ms: r.try_get::<i64, _>("latency_ms")? as u64,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(StoreError::from)
    }

    /// Deletes the evaluation, its results, and its runs with their conversations. False when
    /// there is no such evaluation.
    pub async fn delete_evaluation(&self, id: &str) -> Result<bool, StoreError> {
        let mut tx = self.write().await?;
        sqlx::query("DELETE FROM conversations WHERE evaluation_id = ?1").bind(id).execute(&mut *tx).await?;
        let done = sqlx::query("DELETE FROM evaluations WHERE id = ?1").bind(id).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(done.rows_affected() == 1)
    }
}

/// The `{prefix}input_tokens`, `…cached_input_tokens` and `…output_tokens` columns.
fn usage(r: &sqlx::sqlite::SqliteRow, prefix: &str) -> Result<Usage, sqlx::Error> {
    let tokens = |column: &str| r.try_get::<i64, _>(format!("{prefix}{column}").as_str()).map(|n| n as u64);
    Ok(Usage {
        input_tokens: tokens("input_tokens")?,
        cached_input_tokens: tokens("cached_input_tokens")?,
        output_tokens: tokens("output_tokens")?,
        ..Usage::default()
    })
}

fn evaluation_row(r: &sqlx::sqlite::SqliteRow) -> Result<Evaluation, StoreError> {
    let config: String = r.try_get("config")?;
    Ok(Evaluation {
        id: r.try_get("id")?,
        suite: r.try_get("suite")?,
        suite_sha256: r.try_get("suite_sha256")?,
        config: serde_json::from_str(&config).unwrap_or(serde_json::Value::Null),
        status: r.try_get("status")?,
        spent_usd: r.try_get("spent_usd")?,
        created_at: r.try_get("created_at")?,
        updated_at: r.try_get("updated_at")?,
        results: r.try_get("results")?,
    })
}

//! Per-worker figures from the whole history: how often each worker was called, how often it
//! failed, how long it took, what it cost, and how it scored in the latest evaluation that ran
//! it alone, so that an unreliable, slow or poor worker stands out.
//!
//! Workers are grouped by name, as each step recorded it (pool numbers change when the pool is
//! edited). Runs of evaluations count: they are real calls, paid for.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{Store, StoreError};

/// One worker's record over the history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ts_rs::TS)]
pub struct WorkerFigures {
    /// The worker's name (`conductor` for steps the conductor gave itself).
    pub worker: String,
    /// Steps that called the worker (a step re-used by a re-run, or one that never started
    /// because a step it needed failed, is no call).
    pub calls: u64,
    /// Calls that ended with an answer.
    pub finished: u64,
    /// Calls that ended with the worker's error (after the retries a step makes).
    pub failed: u64,
    /// Calls stopped by the user or a spending cap: neither a success nor a failure.
    pub cancelled: u64,
    /// `failed` over the calls that ended on their own (finished or failed); `None` if none did.
    pub failure_rate: Option<f64>,
    /// Retries the calls needed (rate limits, overload, timeouts).
    pub retries: u64,
    /// Over finished calls, from the request to the last token, retries included.
    pub latency_p50_ms: Option<u64>,
    pub latency_p95_ms: Option<u64>,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Of finished calls. A failed call has no usage (providers do not bill an error); a call
    /// stopped mid-answer was billed for what it wrote, which is not known.
    pub cost_usd: f64,
    /// False when a finished call had no known price, or a call was stopped mid-answer:
    /// `cost_usd` is then a lower bound.
    pub cost_complete: bool,
    /// When the worker was last called (Unix ms).
    pub last_called_at: Option<i64>,
    /// The worker alone (`single:<name>`) in the newest evaluation that ran it.
    pub evaluation: Option<WorkerAccuracy>,
}

/// A worker's accuracy alone on an evaluation's test items.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ts_rs::TS)]
pub struct WorkerAccuracy {
    pub evaluation_id: String,
    pub suite: String,
    pub accuracy: f64,
    /// Results scored (items × repeats).
    pub n: u64,
    pub at: i64,
}

/// One call as the steps table has it.
#[derive(sqlx::FromRow)]
struct CallRow {
    worker: String,
    status: String,
    latency_ms: Option<i64>,
    input_tokens: Option<i64>,
    output_tokens: Option<i64>,
    cost_usd: Option<f64>,
    retries: i64,
    started_at: i64,
}

/// The `p`-th percentile by nearest rank (the same rule `baton eval` reports).
fn percentile(sorted: &[u64], p: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    Some(sorted[rank.min(sorted.len()) - 1])
}

impl Store {
    /// Every worker the history has called, by name, most called first.
    pub async fn worker_figures(&self) -> Result<Vec<WorkerFigures>, StoreError> {
        // A call is a step that sent a request; `request` stays NULL for a step that never ran.
        let rows: Vec<CallRow> = sqlx::query_as(
            "SELECT s.worker, s.status, s.latency_ms, s.input_tokens, s.output_tokens, s.cost_usd, s.retries,
                    r.started_at
             FROM steps s JOIN runs r ON r.id = s.run_id
             WHERE s.request IS NOT NULL AND s.reused_from IS NULL",
        )
        .fetch_all(&self.pool)
        .await?;
        let mut by_worker: BTreeMap<String, (WorkerFigures, Vec<u64>)> = BTreeMap::new();
        for CallRow {
            worker,
            status,
            latency_ms: latency,
            input_tokens: input,
            output_tokens: output,
            cost_usd: cost,
            retries,
            started_at: started,
        } in rows
        {
            let (f, latencies) = by_worker.entry(worker.clone()).or_insert_with(|| {
                (
                    WorkerFigures {
                        worker,
                        calls: 0,
                        finished: 0,
                        failed: 0,
                        cancelled: 0,
                        failure_rate: None,
                        retries: 0,
                        latency_p50_ms: None,
                        latency_p95_ms: None,
                        input_tokens: 0,
                        output_tokens: 0,
                        cost_usd: 0.0,
                        cost_complete: true,
                        last_called_at: None,
                        evaluation: None,
                    },
                    Vec::new(),
                )
            });
            f.calls += 1;
            f.retries += retries.max(0) as u64;
            f.input_tokens += input.unwrap_or(0).max(0) as u64;
            f.output_tokens += output.unwrap_or(0).max(0) as u64;
            f.cost_usd += cost.unwrap_or(0.0);
            f.last_called_at = f.last_called_at.max(Some(started));
            match status.as_str() {
                "finished" => {
                    f.finished += 1;
                    if cost.is_none() {
                        f.cost_complete = false;
                    }
                    if let Some(ms) = latency {
                        latencies.push(ms.max(0) as u64);
                    }
                }
                "failed" => f.failed += 1,
                "cancelled" | "interrupted" => {
                    f.cancelled += 1;
                    f.cost_complete = false;
                }
                // Still running: a call, not yet an outcome.
                _ => {}
            }
        }
        let accuracies = self.latest_single_accuracies().await?;
        let mut out: Vec<WorkerFigures> = by_worker
            .into_values()
            .map(|(mut f, mut latencies)| {
                latencies.sort_unstable();
                let ended = f.finished + f.failed;
                f.failure_rate = (ended > 0).then(|| f.failed as f64 / ended as f64);
                f.latency_p50_ms = percentile(&latencies, 50.0);
                f.latency_p95_ms = percentile(&latencies, 95.0);
                f.evaluation = accuracies.get(&f.worker).cloned();
                f
            })
            .collect();
        // Workers evaluated but never called outside those runs cannot exist (an evaluation's
        // runs are in the history), so the steps above name every worker worth showing.
        out.sort_by(|a, b| b.calls.cmp(&a.calls).then_with(|| a.worker.cmp(&b.worker)));
        Ok(out)
    }

    /// Per worker name, its accuracy alone on the test items of the newest evaluation that
    /// ran `single:<name>`.
    async fn latest_single_accuracies(&self) -> Result<BTreeMap<String, WorkerAccuracy>, StoreError> {
        let rows: Vec<(String, String, String, f64, i64, i64)> = sqlx::query_as(
            "SELECT r.strategy, e.id, e.suite, avg(r.correct), count(*), e.created_at
             FROM eval_results r JOIN evaluations e ON e.id = r.evaluation_id
             WHERE r.strategy LIKE 'single:%' AND r.split = 'test'
             GROUP BY r.evaluation_id, r.strategy
             ORDER BY e.created_at DESC, e.id",
        )
        .fetch_all(&self.pool)
        .await?;
        let mut out = BTreeMap::new();
        for (strategy, evaluation_id, suite, accuracy, n, at) in rows {
            let Some(worker) = strategy.strip_prefix("single:") else { continue };
            out.entry(worker.to_owned()).or_insert(WorkerAccuracy {
                evaluation_id,
                suite,
                accuracy,
                n: n.max(0) as u64,
                at,
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn percentiles_by_nearest_rank() {
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[7], 95.0), Some(7));
        let v: Vec<u64> = (1..=20).collect();
        assert_eq!(percentile(&v, 50.0), Some(10));
        assert_eq!(percentile(&v, 95.0), Some(19));
    }
}

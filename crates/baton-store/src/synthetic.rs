//! Generated history, for benchmarks: runs with plans, steps and messages that look like real
//! ones to SQLite (sizes, word frequencies), written in large transactions.

use crate::time::now_ms;
use crate::{Store, StoreError};

/// Common words, so searches for them match many runs, as real ones do.
const WORDS: &[&str] = &[
    "the", "why", "how", "explain", "prove", "compare", "write", "function", "sky", "blue", "light", "rust", "python",
    "memory", "energy", "planet", "orbit", "protein", "market", "price", "history", "river", "music", "theorem",
    "prime", "graph", "network", "cache", "thread", "lock", "kernel", "model", "data", "error", "test", "review",
    "answer", "check", "solution", "step", "plan", "summary", "argument", "evidence", "climate", "ocean", "engine",
    "battery", "solar", "wind", "vector", "matrix", "integral", "series", "limit", "poem", "story",
];

/// Appends `runs` finished runs of `steps` steps each (one conversation per run), and returns
/// the id of the last run.
pub async fn populate(store: &Store, runs: u32, steps: u32, seed: u64) -> Result<i64, StoreError> {
    let mut rng = seed.max(1);
    let mut next = move || {
        // xorshift64: fast, deterministic, good enough for picking words.
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut words = |n: usize| -> String {
        (0..n).map(|_| WORDS[(next() % WORDS.len() as u64) as usize]).collect::<Vec<_>>().join(" ")
    };
    let now = now_ms();
    let mut last = 0;
    let batch = 2000;
    for start in (0..runs).step_by(batch) {
        let mut tx = store.write().await?;
        for i in start..(start + batch as u32).min(runs) {
            let question = format!("{}? (case {i})", words(12));
            let answer = words(120);
            let conversation: i64 = sqlx::query_scalar(
                "INSERT INTO conversations (title, created_at, updated_at) VALUES (?1, ?2, ?2) RETURNING id",
            )
            .bind(&question)
            .bind(now + i64::from(i))
            .fetch_one(&mut *tx)
            .await?;
            let run: i64 = sqlx::query_scalar(
                "INSERT INTO runs (uid, conversation_id, question, workers, status, answer, started_at, finished_at,
                                   rounds, calls, input_tokens, output_tokens, cost_usd, wall_ms)
                 VALUES (?1, ?2, ?3, '[]', 'finished', ?4, ?5, ?5, 1, ?6, 1000, 400, 0.01, 4000) RETURNING id",
            )
            .bind(format!("synthetic-{seed}-{i}"))
            .bind(conversation)
            .bind(&question)
            .bind(&answer)
            .bind(now + i64::from(i))
            .bind(steps)
            .fetch_one(&mut *tx)
            .await?;
            for (role, content) in [("user", &question), ("assistant", &answer)] {
                sqlx::query(
                    "INSERT INTO messages (conversation_id, run_id, role, content, created_at)
                     VALUES (?1, ?2, ?3, ?4, ?5)",
                )
                .bind(conversation)
                .bind(run)
                .bind(role)
                .bind(content)
                .bind(now + i64::from(i))
                .execute(&mut *tx)
                .await?;
            }
            let plan = serde_json::json!({
                "model_id": (0..steps).collect::<Vec<_>>(),
                "subtasks": (0..steps).map(|_| words(10)).collect::<Vec<_>>(),
                "access_list": (0..steps).map(|_| Vec::<u32>::new()).collect::<Vec<_>>(),
            });
            sqlx::query("INSERT INTO plans (run_id, round, depth, raw, plan) VALUES (?1, 0, 0, ?2, ?3)")
                .bind(run)
                .bind(words(60))
                .bind(plan.to_string())
                .execute(&mut *tx)
                .await?;
            for s in 0..steps {
                let subtask = plan["subtasks"][s as usize].as_str().unwrap_or_default().to_owned();
                let request = serde_json::json!({"system": null, "messages": [{"role": "user", "content": subtask}]});
                sqlx::query(
                    "INSERT INTO steps (run_id, round, step, worker_index, worker, subtask, access, request, status,
                                        output, input_tokens, output_tokens, cost_usd, latency_ms)
                     VALUES (?1, 0, ?2, ?2, 'worker', ?3, '[]', ?4, 'finished', ?5, 300, 130, 0.003, 1200)",
                )
                .bind(run)
                .bind(s)
                .bind(&subtask)
                .bind(request.to_string())
                .bind(words(150))
                .execute(&mut *tx)
                .await?;
            }
            last = run;
        }
        tx.commit().await?;
    }
    Ok(last)
}

//! The history on real SQLite files: migrations from empty, runs recorded from the real
//! executor's events over loopback HTTP, search, whole trees, deletes, exports, interrupted
//! runs, and a damaged file. The subjects are modules of one test binary, which links once;
//! the helpers they share are here.

mod batches;
mod conversations;
mod learning;
mod migrations;
mod recovery;
mod runs;

use std::sync::Arc;

use baton_engine::{Executor, Pool, RunEvent, RunRequest};
use baton_plan::Limits;
use baton_providers::ApiKey;
use baton_store::Store;
use baton_testserver::{TestServer, Wire};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Workers whose answers echo their subtasks (the answer step gets no question after its
/// subtask), so what a test reads back names the step that wrote it.
fn pool(server: &TestServer, workers: &[(&str, &str)]) -> Pool {
    let mut text = "question_to_answer_step = false\n[retry]\nmax_retries = 0\n".to_owned();
    for (name, model) in workers {
        text.push_str(&format!(
            "\n[[worker]]\nname = \"{name}\"\nprovider = \"openai\"\nmodel = \"{model}\"\nbase_url = \"{}\"\n",
            server.base_url(Wire::OpenAi)
        ));
    }
    Pool::parse(&text, "pool.toml").expect("valid pool")
}

/// Runs `plan` for `question` through the real executor, recording every event.
async fn run_recorded(store: &Store, pool: &Pool, conversation: Option<i64>, question: &str, plan: &str) -> i64 {
    let executor = Executor::from_pool_with_keys(pool, |_| Arc::new(|| Ok(Some(ApiKey::new("test-key")))));
    let plan = baton_plan::parse(plan, &Limits::default()).expect("plan parses");
    let request = RunRequest {
        run_id: baton_engine::new_run_id(),
        question: question.into(),
        plan: Some(plan),
        ..RunRequest::default()
    };
    record_request(store, &executor, conversation, request).await
}

async fn record_request(store: &Store, executor: &Executor, conversation: Option<i64>, request: RunRequest) -> i64 {
    record_with(store.recorder(conversation), executor, request).await
}

async fn record_with(mut recorder: baton_store::Recorder, executor: &Executor, request: RunRequest) -> i64 {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let record = async {
        while let Some(event) = rx.recv().await {
            recorder.record(&event).await.expect("recorded");
        }
    };
    let run = async {
        executor.run(request, &tx, &CancellationToken::new()).await;
        drop(tx);
    };
    tokio::join!(run, record);
    recorder.run_id().expect("a run id")
}

fn given(question: &str, plan: &str) -> RunRequest {
    RunRequest {
        run_id: baton_engine::new_run_id(),
        question: question.into(),
        plan: Some(baton_plan::parse(plan, &Limits::default()).expect("plan parses")),
        ..RunRequest::default()
    }
}

/// Runs `request`, recording it, and stops the run once `deltas` text deltas have arrived;
/// returns the run's id and the text streamed before the stop.
async fn record_stopped_after(
    store: &Store,
    executor: &Executor,
    conversation: Option<i64>,
    request: RunRequest,
    deltas: usize,
) -> (i64, String) {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let cancel = CancellationToken::new();
    let mut recorder = store.recorder(conversation);
    let mut streamed = String::new();
    let record = async {
        let mut seen = 0;
        while let Some(event) = rx.recv().await {
            if let RunEvent::StepDelta { text, .. } = &event
                && !cancel.is_cancelled()
            {
                streamed.push_str(text);
                seen += 1;
                if seen == deltas {
                    cancel.cancel();
                }
            }
            recorder.record(&event).await.expect("recorded");
        }
    };
    let run = async {
        executor.run(request, &tx, &cancel).await;
        drop(tx);
    };
    tokio::join!(run, record);
    (recorder.run_id().expect("a run id"), streamed)
}

const FANOUT: &str = "model_id = [0, 1, 2]\nsubtasks = [\"Explain Rayleigh scattering.\", \"Explain it for a child.\", \"Judge both explanations.\"]\naccess_list = [[], [], \"all\"]";

/// Deterministic prose of `bytes` bytes, different for each `seed`.
fn prose(seed: u64, bytes: usize) -> String {
    const WORDS: &[&str] = &[
        "light",
        "scatters",
        "molecules",
        "wavelength",
        "shorter",
        "blue",
        "violet",
        "sun",
        "atmosphere",
        "nitrogen",
        "oxygen",
        "intensity",
        "inverse",
        "fourth",
        "power",
        "observer",
        "horizon",
        "red",
        "sunset",
        "path",
        "longer",
        "photons",
        "eye",
        "cones",
        "sensitive",
        "sky",
        "appears",
        "because",
        "the",
        "of",
        "and",
        "a",
        "is",
        "in",
    ];
    let mut rng = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut out = String::with_capacity(bytes + 16);
    while out.len() < bytes {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let word = WORDS[(rng >> 33) as usize % WORDS.len()];
        out.push_str(word);
        out.push(if (rng >> 20).is_multiple_of(13) { '\n' } else { ' ' });
    }
    out.truncate(bytes);
    out
}

/// How many run lock files ("slots", held by a store for the runs it records, free or not) are
/// beside the database `db`.
fn slot_files(db: &std::path::Path) -> usize {
    let locks = db.with_extension("sqlite.locks");
    std::fs::read_dir(&locks)
        .map(|d| d.filter_map(Result::ok).filter(|e| e.file_name().to_string_lossy().starts_with("slot")).count())
        .unwrap_or_default()
}

//! The export formats are a promise to whoever reads the files: the JSON and the Markdown of
//! recorded runs are pinned by fixtures in `tests/fixtures/exports/`, made from recordings of
//! real runs (the executor over loopback HTTP, a real SQLite file). How the history stores a
//! run may change; what it gives back, and so what an export shows, may not.
//!
//! Times, durations, retry delays and run ids differ from one recording to the next; they are
//! set to fixed values before exporting. `UPDATE_FIXTURES=1` rewrites the fixtures (only for a
//! deliberate change of format, which also needs a new `format` version).
//!
//! `history-schema-4.sql` holds the rows this recording left in a history before migration 5
//! (every request and event whole), as `INSERT`s: the history of an earlier version, which
//! must read the same today.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use baton_engine::rerun::{self, Source};
use baton_engine::{Executor, Pool, RunProgress, RunRequest};
use baton_plan::Limits;
use baton_providers::ApiKey;
use baton_store::{RunTree, Store, export};
use baton_testserver::{TestServer, Wire};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

fn pool(server: &TestServer, options: &str, workers: &[(&str, &str)]) -> Pool {
    let mut text = format!("{options}\n[retry]\nmax_retries = 1\ninitial_delay_ms = 10\nmax_delay_ms = 20\n");
    for (name, model) in workers {
        text.push_str(&format!(
            "\n[[worker]]\nname = \"{name}\"\nprovider = \"openai\"\nmodel = \"{model}\"\nbase_url = \"{}\"\n",
            server.base_url(Wire::OpenAi)
        ));
    }
    Pool::parse(&text, "pool.toml").expect("valid pool")
}

async fn record(store: &Store, pool: &Pool, conversation: Option<i64>, request: RunRequest) -> i64 {
    let executor = Executor::from_pool_with_keys(pool, |_| Arc::new(|| Ok(Some(ApiKey::new("test-key")))));
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut recorder = store.recorder(conversation);
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

fn request(question: &str, plan: &str) -> RunRequest {
    RunRequest {
        run_id: baton_engine::new_run_id(),
        question: question.into(),
        plan: Some(baton_plan::parse(plan, &Limits::default()).expect("plan parses")),
        ..RunRequest::default()
    }
}

/// Sets what differs between recordings (times, durations, delays, run ids) to fixed values.
fn steady(mut tree: RunTree, uids: &HashMap<String, String>) -> RunTree {
    let uid = |u: &str| uids.get(u).cloned().unwrap_or_else(|| panic!("unknown run id {u}"));
    let r = &mut tree.run;
    r.uid = uid(&r.uid);
    r.started_at = 1_767_225_600_000 + r.id * 60_000;
    r.finished_at = r.finished_at.map(|_| r.started_at + 1234);
    r.wall_ms = r.wall_ms.map(|_| 1234);
    if let Some(t) = &mut r.totals {
        t.wall_ms = 1234;
    }
    if let Some(rerun) = &mut r.rerun_of {
        rerun.run_id = uid(&rerun.run_id);
    }
    for s in &mut tree.steps {
        s.latency_ms = s.latency_ms.map(|_| 250);
        s.reused_from = s.reused_from.as_deref().map(uid);
    }
    for e in &mut tree.events {
        for (key, value) in [("latency_ms", 250), ("delay_ms", 10)] {
            if e.get(key).is_some() {
                e[key] = value.into();
            }
        }
        if e.get("totals").is_some() {
            e["totals"]["wall_ms"] = 1234.into();
        }
        for key in ["run_id", "from_run"] {
            if let Some(u) = e.get(key).and_then(Value::as_str).map(str::to_owned) {
                e[key] = uid(&u).into();
            }
        }
        if let Some(u) = e.pointer("/rerun_of/run_id").and_then(Value::as_str).map(str::to_owned) {
            e["rerun_of"]["run_id"] = uid(&u).into();
        }
    }
    tree
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("fixtures").join("exports")
}

/// Compares `text` with the fixture `name` (or rewrites it with `UPDATE_FIXTURES=1`).
fn pinned(name: &str, text: &str) -> Option<String> {
    let path = fixtures().join(name);
    if std::env::var_os("UPDATE_FIXTURES").is_some() {
        std::fs::create_dir_all(fixtures()).expect("mkdir");
        std::fs::write(&path, text).expect("write fixture");
        return None;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (expected != text).then(|| {
        let line = expected.lines().zip(text.lines()).position(|(a, b)| a != b).unwrap_or(0);
        format!(
            "{name} differs from its fixture at line {}:\n  fixture: {:?}\n  now:     {:?}",
            line + 1,
            expected.lines().nth(line).unwrap_or(""),
            text.lines().nth(line).unwrap_or("")
        )
    })
}

/// A conversation of a four-step run (a retried call, a system prompt, a multi-line answer,
/// "all" and list access) and a re-run of it that keeps two steps, plus a failed run with a
/// step that failed and one that never ran: their exports are exactly the pinned ones.
#[tokio::test]
async fn exports_of_recorded_runs_match_the_pinned_format() {
    let server = TestServer::start().await.expect("server");
    let workers = [("physicist", "phys"), ("teacher", "teach;fail=429x1"), ("judge", "judge"), ("poet", "poet")];
    // As the fixture was recorded: the answer step gets its subtask only.
    let pool = pool(&server, "show_question = true\nquestion_to_answer_step = false", &workers);
    server.queue_replies(
        "phys",
        ["Sunlight scatters off air molecules.\n\n- shorter wavelengths scatter more\n- so blue dominates\n\n```text\nI ∝ 1/λ⁴\n```"],
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&dir.path().join("h.sqlite")).await.expect("opens");

    let plan = "model_id = [0, 1, 2, 0]\nsubtasks = [\"Explain Rayleigh scattering.\", \"Explain it for a child.\", \"Check the child's version.\", \"Write the final answer.\"]\naccess_list = [[], \"all\", [1], \"all\"]";
    let first = record(&store, &pool, None, request("Why is the sky blue?\nAnswer briefly.", plan)).await;
    let tree = store.run(first).await.expect("query").expect("run");
    let conversation = tree.run.conversation_id;

    // Step 2 again with the poet: steps 0 and 1 are kept, 2 and 3 run.
    let outputs: BTreeMap<usize, String> =
        tree.steps.iter().filter_map(|s| Some((s.step as usize, s.output.clone()?))).collect();
    let source =
        Source { run_id: &tree.run.uid, plan: &tree.plans[0].plan, workers: &tree.run.workers, outputs: &outputs };
    let again = rerun::prepare(source, &pool, 2, "poet").expect("prepare");
    let rerun_request =
        RunRequest { plan: Some(again.plan), reuse: Some(again.reuse), ..request(&tree.run.question, plan) };
    record(&store, &again.pool, Some(conversation), rerun_request).await;

    // As the fixture was recorded: the workers see their subtasks only. Steps 0 and 1 run
    // at once; "ok" answers 300 ms late so that its event comes after step 1's failure (an
    // export keeps the order in which events happened).
    let broken = self::pool(
        &server,
        "show_question = false\nquestion_to_answer_step = false",
        &[("ok", "fine;ttfb=300"), ("broken", "broken;fail=401"), ("judge", "judge")],
    );
    let plan = "model_id = [0, 1, 2]\nsubtasks = [\"A.\", \"B.\", \"Judge.\"]\naccess_list = [[], [], [1]]";
    let failed = record(&store, &broken, None, request("Will it fail?", plan)).await;

    let differences = differences(&store, conversation, failed).await;
    assert!(differences.is_empty(), "{}", differences.join("\n"));
}

/// How the exports of `conversation` and of the run `failed` differ from the pinned ones.
async fn differences(store: &Store, conversation: i64, failed: i64) -> Vec<String> {
    let mut uids = HashMap::new();
    for run in store.list_runs(10, None).await.expect("list") {
        let uid = store.run(run.id).await.expect("query").expect("run").run.uid;
        uids.insert(uid, format!("run-{}", run.id));
    }
    let title = store.conversation_title(conversation).await.expect("title").expect("a title");
    let mut trees = Vec::new();
    for run in store.conversation_runs(conversation).await.expect("runs") {
        trees.push(steady(store.run(run.id).await.expect("query").expect("run"), &uids));
    }
    let messages = store.messages(conversation).await.expect("messages");
    let failed = steady(store.run(failed).await.expect("query").expect("run"), &uids);
    let pretty = |v: &Value| serde_json::to_string_pretty(v).expect("json") + "\n";
    [
        ("conversation.json", pretty(&export::conversation_json(conversation, &title, &messages, &trees))),
        ("conversation.md", export::conversation_markdown(&title, &trees)),
        ("failed-run.json", pretty(&export::run_json(&failed))),
        ("failed-run.md", export::run_markdown(&failed)),
    ]
    .iter()
    .filter_map(|(name, text)| pinned(name, text))
    .collect()
}

/// A history written before texts were stored once (every request and event whole, steps
/// without `cancelled`) is brought up to date and reads exactly as it did: the rows of the
/// fixtures' recording, as that version of Baton wrote them, export to the same fixtures.
#[tokio::test]
async fn a_history_from_before_texts_were_stored_once_reads_the_same() {
    if std::env::var_os("UPDATE_FIXTURES").is_some() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("old.sqlite");
    {
        let options = sqlx::sqlite::SqliteConnectOptions::new().filename(&path).create_if_missing(true);
        let db = sqlx::SqlitePool::connect_with(options).await.expect("connect");
        baton_store::MIGRATOR.run_to(4, &db).await.expect("migrations 1-4");
        let rows = std::fs::read_to_string(fixtures().join("history-schema-4.sql")).expect("the old rows");
        sqlx::raw_sql(sqlx::AssertSqlSafe(rows)).execute(&db).await.expect("the old rows go in");
        db.close().await;
    }
    let store = Store::open(&path).await.expect("opens and upgrades");
    let differences = differences(&store, 1, 3).await;
    assert!(differences.is_empty(), "{}", differences.join("\n"));
    assert_eq!(store.search("rayleigh", 10).await.expect("search").len(), 2, "the subtask index kept its rows");

    // New rows go in beside the old ones, with the status the old table had no room for.
    let server = TestServer::start().await.expect("server");
    let pool = pool(&server, "", &[("slow", "slow;latency=3000")]);
    let executor = Executor::from_pool_with_keys(&pool, |_| Arc::new(|| Ok(Some(ApiKey::new("test-key")))));
    let (tx, mut rx) = mpsc::unbounded_channel();
    let cancel = CancellationToken::new();
    let mut recorder = store.recorder(Some(1));
    let record = async {
        while let Some(event) = rx.recv().await {
            if matches!(event, baton_engine::RunEvent::StepDelta { .. }) {
                cancel.cancel();
            }
            recorder.record(&event).await.expect("recorded");
        }
    };
    let plan = "model_id = [0]\nsubtasks = [\"Rayleigh, slowly.\"]\naccess_list = [[]]";
    let run = async {
        executor.run(request("Once more?", plan), &tx, &cancel).await;
        drop(tx);
    };
    tokio::join!(run, record);
    let id = recorder.run_id().expect("a run id");
    let step = &store.run(id).await.expect("query").expect("run").steps[0];
    assert_eq!(step.status, "cancelled");
    assert_eq!(store.search("rayleigh", 10).await.expect("search").len(), 3, "and indexes new ones");
}

/// The engine's one fold of run events ([`RunProgress`], behind the command line's progress and
/// the server's reasoning text) reads the pinned recordings as the history's rows say they went:
/// every step that started has its row's worker and status, every plan gives each row's worker,
/// and the answer is the last top-round step's. The app's topology is checked against the same
/// files (`ui/src/lib/recorded.test.ts`).
#[test]
fn the_progress_fold_reads_recorded_runs_as_the_history_does() {
    use baton_engine::RunEvent;
    use baton_engine::progress::StepStatus;

    let read = |name: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(fixtures().join(name)).expect("fixture")).expect("json")
    };
    let mut runs: Vec<Value> = read("conversation.json")["runs"].as_array().expect("runs").clone();
    runs.push(read("failed-run.json"));
    let statuses: Vec<&str> = runs.iter().map(|r| r["run"]["status"].as_str().expect("status")).collect();
    assert_eq!(statuses, ["finished", "finished", "failed"], "the recordings cover these endings");

    for recorded in &runs {
        let uid = recorded["run"]["uid"].as_str().expect("uid");
        let mut progress = RunProgress::default();
        for event in recorded["events"].as_array().expect("events") {
            progress.see(&serde_json::from_value::<RunEvent>(event.clone()).expect("a recorded event reads back"));
        }
        let rows = recorded["steps"].as_array().expect("steps");
        let number = |row: &Value, key: &str| row[key].as_u64().expect(key) as usize;
        for row in rows {
            let (round, step, worker) = (number(row, "round") as u32, number(row, "step"), number(row, "worker_index"));
            assert_eq!(progress.worker_of(round, step), Some(worker), "{uid}: the plan's worker for step {step}");
            if let Some(started) = progress.steps().iter().find(|s| (s.round, s.step) == (round, step)) {
                let status = match started.status {
                    StepStatus::Running => "running",
                    StepStatus::Finished => "finished",
                    StepStatus::Failed => "failed",
                };
                assert_eq!(
                    (started.worker, status),
                    (worker, row["status"].as_str().expect("status")),
                    "{uid}: step {step}"
                );
            }
        }
        let last = rows.iter().filter(|r| r["round"] == 0).max_by_key(|r| number(r, "step")).expect("a top-round step");
        assert_eq!(progress.answer_step(), Some((0, number(last, "step"))), "{uid}: the answer's step");
        assert_eq!(progress.answer_worker(), Some(number(last, "worker_index")), "{uid}: the answer's worker");
        let failed = last["status"] == "failed";
        assert_eq!(progress.answer_error().is_some(), failed, "{uid}: the answer's step failed or not");
    }
}

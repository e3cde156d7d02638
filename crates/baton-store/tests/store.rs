//! The history on real SQLite files: migrations from empty, runs recorded from the real
//! executor's events over loopback HTTP, search, whole trees, deletes, exports, interrupted
//! runs, and a damaged file.

use std::sync::Arc;

use std::collections::BTreeMap;

use baton_engine::profile::{ChatMarks, Freshness};
use baton_engine::rerun::{self, Source};
use baton_engine::{Executor, Pool, RerunOf, RunEvent, RunRequest};
use baton_plan::Limits;
use baton_providers::ApiKey;
use baton_store::comparisons::Preferred;
use baton_store::{RunStatus, Store, StoreError};
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

const FANOUT: &str = "model_id = [0, 1, 2]\nsubtasks = [\"Explain Rayleigh scattering.\", \"Explain it for a child.\", \"Judge both explanations.\"]\naccess_list = [[], [], \"all\"]";

#[tokio::test]
async fn migrations_apply_to_an_empty_file_and_released_ones_never_change() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("nested").join("history.sqlite");
    let store = Store::open(&path).await.expect("opens");
    assert!(path.exists());
    assert!(store.list_runs(10, None).await.expect("list").is_empty());
    store.close().await;
    // Opening again applies nothing new and keeps working.
    Store::open(&path).await.expect("reopens");

    // Editing a released migration breaks every existing database: sqlx refuses to run on a
    // checksum mismatch. Add a new migration file instead, and its checksum here.
    const RELEASED: &[(i64, &str)] = &[
        (1, "89a08f03767746845efb4936d1fface9315bbe04d0b54e459e4f1858711270934aadb624aa603f9b2f0f201bf5dec62a"),
        (2, "b97755a42f4e4dfb71ad8f55fd67b58466a4f5012e53a674024c6e570d5d83f491a9412f7baf6b5a5e50a0d1ea1cb313"),
        (3, "a92e0e8b46c3c8a8cbbab20d2f5e8f8b679b5542ef9eb324d91d24f603599ce634535ebe1cde99343c81ad355989e7e7"),
        (4, "4d18937e6a272e06829067468bb819194496efd22374e5ee226cd823195bdb476af8cc3d14302c548c25accd2326650e"),
        (5, "da128e48cf98e44b5c44ee75f31017ceeb720f372972a2a44e87cbcaadc03cc7cf631315476fc492a2d5029caf7af9ca"),
        (6, "e254f625c9b7377f0f89d752144ffe00a0f6b13c736b0eff0c446adcbe98e7069577853542304de703387403f3ba6aa8"),
        (7, "28cc92239ec280675bcf5be90601b9a0deaa5f3c95a3d8f87041d1bdc1f88ac4bca8efbfbf3c64fa9109fef1ad6be771"),
    ];
    let actual: Vec<(i64, String)> = baton_store::MIGRATOR
        .iter()
        .map(|m| (m.version, m.checksum.iter().map(|b| format!("{b:02x}")).collect()))
        .collect();
    for (version, checksum) in RELEASED {
        let found = actual.iter().find(|(v, _)| v == version).unwrap_or_else(|| panic!("migration {version} removed"));
        assert_eq!(&found.1, checksum, "migration {version} was edited after release; add a new migration instead");
    }
}

/// The app and the CLI (or several CLI runs) may open a history that does not exist yet at
/// the same moment; each must find it migrated once, never half-made by another.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_processes_opening_a_new_history_at_once_all_succeed() {
    for round in 0..5 {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = dir.path().join("history.sqlite");
        let opens: Vec<_> = (0..8)
            .map(|_| {
                tokio::spawn({
                    let db = db.clone();
                    async move { Store::open(&db).await }
                })
            })
            .collect();
        for open in opens {
            let store = open.await.expect("task").unwrap_or_else(|e| panic!("round {round}: {e}"));
            store.close().await;
        }
        let raw = sqlx::SqlitePool::connect(&format!("sqlite://{}", db.display())).await.expect("raw connection");
        let applied: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM _sqlx_migrations").fetch_one(&raw).await.expect("count");
        raw.close().await;
        assert_eq!(applied, baton_store::MIGRATOR.iter().count() as i64, "each migration applied once");
    }
}

#[tokio::test]
async fn a_run_is_recorded_with_its_whole_tree_and_found_again() {
    let server = TestServer::start().await.expect("server");
    let pool = pool(&server, &[("physicist", "phys"), ("teacher", "teach"), ("judge", "judge")]);
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&dir.path().join("h.sqlite")).await.expect("opens");
    let id = run_recorded(&store, &pool, None, "Why is the sky blue?", FANOUT).await;

    let tree = store.run(id).await.expect("query").expect("the run");
    assert_eq!(tree.run.status, RunStatus::Finished);
    assert_eq!(tree.run.question, "Why is the sky blue?");
    assert_eq!(tree.run.answer.as_deref(), Some("judge (saw 2 earlier answers) answers: Judge both explanations."));
    assert_eq!(tree.run.calls, 3);
    assert!(tree.run.input_tokens > 0 && tree.run.output_tokens > 0);
    assert_eq!(tree.run.workers.len(), 3);
    assert_eq!(tree.plans.len(), 1);
    assert_eq!(tree.plans[0].plan.to_python().trim_end(), FANOUT);
    assert_eq!(tree.steps.len(), 3);
    let judge = &tree.steps[2];
    assert_eq!((judge.worker.as_str(), judge.status.as_str()), ("judge", "finished"));
    assert_eq!(judge.access, baton_plan::Access::All);
    let sent = judge.request.as_ref().expect("what the judge was sent");
    let request = server.requests().into_iter().find(|r| r.body["model"] == "judge").expect("judge call");
    let wire: Vec<&str> =
        request.body["messages"].as_array().expect("messages").iter().filter_map(|m| m["content"].as_str()).collect();
    let stored: Vec<&str> =
        sent.system.iter().map(String::as_str).chain(sent.messages.iter().map(|m| m.content.as_str())).collect();
    assert_eq!(stored, wire, "the stored request is exactly what went over the wire");
    assert!(judge.input_tokens.is_some() && judge.latency_ms.is_some());
    assert!(tree.events.iter().all(|e| e["type"] != "step_delta"), "no deltas stored");
    let events: Vec<RunEvent> =
        tree.events.iter().map(|e| serde_json::from_value(e.clone()).expect("a RunEvent")).collect();
    baton_engine::event::check_sequence(&events).expect("the stored events keep the contract");

    // The conversation holds the question and the answer.
    let messages = store.messages(tree.run.conversation_id).await.expect("messages");
    assert_eq!(messages.len(), 2);
    assert_eq!(messages[1].content, tree.run.answer.clone().unwrap());

    // Search: a question word, an answer word, a subtask word; prefixes; punctuation is safe.
    let hits = store.search("sky", 10).await.expect("search");
    assert_eq!((hits.len(), hits[0].id, hits[0].matched.as_str()), (1, id, "question"));
    assert_eq!(hits[0].snippet, "Why is the [sky] blue?");
    let hits = store.search("judge", 10).await.expect("search");
    assert_eq!(hits.len(), 1, "one hit per run");
    assert_eq!(store.search("raylei", 10).await.expect("prefix")[0].matched, "subtask");
    assert!(store.search("\"unbalanced AND (", 10).await.expect("no syntax error").is_empty());
    assert!(store.search("nothing-like-this", 10).await.expect("search").is_empty());

    // Exports.
    let md = baton_store::export::run_markdown(&tree);
    assert!(md.starts_with("# Why is the sky blue?\n"), "{md}");
    assert!(md.contains("## Answer\n\njudge (saw 2 earlier answers)"), "{md}");
    assert!(md.contains("### Step 2 · judge (finished"), "{md}");
    assert!(md.contains("```python\nmodel_id = [0, 1, 2]"), "{md}");
    let json = baton_store::export::run_json(&tree);
    assert_eq!(json["format"], "baton-run/1");
    assert_eq!(json["run"]["status"], "finished");
    assert_eq!(json["plans"][0]["plan"]["access_list"], serde_json::json!([[], [], "all"]));
    assert_eq!(json["steps"][2]["request"]["messages"][0]["role"], "user");
}

#[tokio::test]
async fn follow_ups_share_a_conversation_and_deletes_cascade() {
    let server = TestServer::start().await.expect("server");
    let pool = pool(&server, &[("a", "alpha"), ("b", "beta"), ("c", "gamma")]);
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&dir.path().join("h.sqlite")).await.expect("opens");
    let first = run_recorded(&store, &pool, None, "First question about zebras", FANOUT).await;
    let conversation = store.run(first).await.unwrap().unwrap().run.conversation_id;
    let second = run_recorded(&store, &pool, Some(conversation), "And about okapis?", FANOUT).await;
    let other = run_recorded(&store, &pool, None, "Unrelated lemurs", FANOUT).await;
    assert_eq!(store.messages(conversation).await.unwrap().len(), 4);
    let conversations = store.list_conversations(10, None).await.unwrap();
    assert_eq!(conversations.len(), 2);
    assert_eq!(conversations[1].title, "First question about zebras");
    assert_eq!(conversations[1].runs, 2);
    let runs = store.list_runs(2, None).await.unwrap();
    assert_eq!(runs.iter().map(|r| r.id).collect::<Vec<_>>(), vec![other, second], "newest first");
    let page2 = store.list_runs(2, Some(second)).await.unwrap();
    assert_eq!(page2.iter().map(|r| r.id).collect::<Vec<_>>(), vec![first]);

    assert!(store.delete_run(second).await.unwrap());
    assert!(!store.delete_run(second).await.unwrap(), "already gone");
    assert!(store.run(second).await.unwrap().is_none());
    assert!(store.search("okapis", 10).await.unwrap().is_empty(), "the index forgets a deleted run");
    // Its question and answer leave the conversation too: a follow-up's conductor no longer
    // sees them.
    let left: Vec<String> = store.messages(conversation).await.unwrap().into_iter().map(|m| m.content).collect();
    assert_eq!(left.len(), 2, "{left:?}");
    assert!(left.iter().all(|m| !m.contains("okapis")), "{left:?}");
    assert!(store.delete_conversation(conversation).await.unwrap());
    assert!(store.run(first).await.unwrap().is_none());
    assert!(store.search("zebras", 10).await.unwrap().is_empty());
    assert!(store.search("rayleigh", 10).await.unwrap().iter().all(|h| h.id == other), "subtasks of deleted runs");
    assert_eq!(store.list_runs(10, None).await.unwrap().len(), 1);
}

#[tokio::test]
async fn failed_steps_and_their_dependents_are_recorded() {
    let server = TestServer::start().await.expect("server");
    let pool = pool(&server, &[("ok", "fine"), ("broken", "broken;fail=401"), ("judge", "judge")]);
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&dir.path().join("h.sqlite")).await.expect("opens");
    let plan = "model_id = [0, 1, 2]\nsubtasks = [\"A.\", \"B.\", \"Judge.\"]\naccess_list = [[], [], [1]]";
    let id = run_recorded(&store, &pool, None, "Will it fail?", plan).await;
    let tree = store.run(id).await.unwrap().unwrap();
    assert_eq!(tree.run.status, RunStatus::Failed);
    assert_eq!(tree.run.error_kind.as_deref(), Some("step_failed"));
    let kinds: Vec<(&str, Option<&str>)> =
        tree.steps.iter().map(|s| (s.status.as_str(), s.error_kind.as_deref())).collect();
    assert_eq!(kinds, vec![("finished", None), ("failed", Some("auth")), ("failed", Some("dependency_failed"))]);
    assert!(tree.steps[2].request.is_none(), "the judge never ran");
    assert_eq!(tree.steps[2].subtask, "Judge.");
    let messages = store.messages(tree.run.conversation_id).await.unwrap();
    assert_eq!(messages.len(), 2, "the question, and a turn that says it has no answer");
    assert_eq!(messages[1].content, "(no answer: the run failed: a step of its plan failed)");
}

#[tokio::test]
async fn a_run_whose_process_died_is_interrupted_with_its_finished_steps() {
    let server = TestServer::start().await.expect("server");
    let pool = pool(&server, &[("a", "alpha")]);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("h.sqlite");
    let store = Store::open(&path).await.expect("opens");
    // A finished run to take real events from, replayed without their end.
    let done = run_recorded(
        &store,
        &pool,
        None,
        "Complete run",
        "model_id=[0, 0]\nsubtasks=['x', 'y']\naccess_list=[[], [0]]",
    )
    .await;
    let events: Vec<RunEvent> = store
        .run(done)
        .await
        .unwrap()
        .unwrap()
        .events
        .into_iter()
        .map(|e| serde_json::from_value(e).unwrap())
        .collect();
    let cut = events.iter().position(|e| matches!(e, RunEvent::StepStarted { step: 1, .. })).expect("step 1 starts");
    let replay = |uid: &str| {
        let mut events = events[..=cut].to_vec();
        if let RunEvent::RunStarted { run_id, question, .. } = &mut events[0] {
            *run_id = uid.to_owned();
            *question = format!("Replayed {uid}");
        }
        events
    };

    // Still recording in a live "process" (its recorder holds the lock): left running.
    let mut live = store.recorder(None);
    for e in replay("live0001") {
        live.record(&e).await.unwrap();
    }
    // A recorder that is gone (as after kill -9: its lock is released by the OS).
    let mut dead = store.recorder(None);
    for e in replay("dead0001") {
        dead.record(&e).await.unwrap();
    }
    let dead_id = dead.run_id().unwrap();
    drop(dead);
    // A lock file a crashed process left behind, held by nobody.
    let locks = path.with_extension("sqlite.locks");
    std::fs::write(locks.join("slotleftbehind.lock"), "").unwrap();
    assert_eq!(slot_files(&path), 2, "the live run's lock and the one left behind");

    let reopened = Store::open(&path).await.expect("reopens");
    assert_eq!(slot_files(&path), 1, "the lock left behind is deleted, the live run's kept");
    let tree = reopened.run(dead_id).await.unwrap().unwrap();
    assert_eq!(tree.run.status, RunStatus::Interrupted);
    assert_eq!(tree.steps[0].status, "finished");
    assert_eq!(tree.steps[0].output.as_deref(), Some("alpha (saw 0 earlier answers) answers: x"));
    assert_eq!(tree.steps[1].status, "interrupted");
    let live_tree = reopened.run(live.run_id().unwrap()).await.unwrap().unwrap();
    assert_eq!(live_tree.run.status, RunStatus::Running, "a run another process still records is left alone");
}

#[tokio::test]
async fn a_damaged_file_is_reported_and_kept() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("h.sqlite");
    let garbage = "this is not SQLite at all, but somebody's notes. ".repeat(200);
    std::fs::write(&path, &garbage).unwrap();
    let e = Store::open(&path).await.expect_err("damaged");
    assert!(matches!(e, StoreError::Corrupt { .. }), "{e}");
    assert!(e.to_string().contains("move it aside"), "{e}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), garbage, "nothing is lost");
}

#[tokio::test]
async fn a_database_from_before_reruns_is_upgraded_and_keeps_its_runs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("old.sqlite");
    {
        // The schema as the first release left it, with a run in it.
        let options = sqlx::sqlite::SqliteConnectOptions::new().filename(&path).create_if_missing(true);
        let db = sqlx::SqlitePool::connect_with(options).await.expect("connect");
        baton_store::MIGRATOR.run_to(1, &db).await.expect("migration 1");
        sqlx::query("INSERT INTO conversations (id, title, created_at, updated_at) VALUES (1, 'old', 0, 0)")
            .execute(&db)
            .await
            .expect("conversation");
        sqlx::query(
            "INSERT INTO runs (id, uid, conversation_id, question, workers, status, started_at, answer)
             VALUES (1, 'u1', 1, 'Old question?', '[]', 'finished', 0, 'Old answer.')",
        )
        .execute(&db)
        .await
        .expect("run");
        db.close().await;
    }
    let store = Store::open(&path).await.expect("opens and upgrades");
    let tree = store.run(1).await.expect("query").expect("the old run");
    assert_eq!(tree.run.answer.as_deref(), Some("Old answer."));
    assert_eq!(tree.run.rerun_of, None);
    assert_eq!(store.search("old", 10).await.expect("search").len(), 1);
    let old = &store.list_conversations(10, None).await.expect("list")[0];
    assert_eq!((old.workers.as_deref(), old.review), (None, false), "all workers, no review");
}

/// A history made before accounting was split by caller (migration 3) opens: its runs keep
/// their flat totals and have no split; a run recorded afterwards has both.
#[tokio::test]
async fn a_database_from_before_the_accounting_split_is_upgraded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("old.sqlite");
    {
        let options = sqlx::sqlite::SqliteConnectOptions::new().filename(&path).create_if_missing(true);
        let db = sqlx::SqlitePool::connect_with(options).await.expect("connect");
        baton_store::MIGRATOR.run_to(3, &db).await.expect("migrations 1-3");
        sqlx::query("INSERT INTO conversations (id, title, created_at, updated_at) VALUES (1, 'old', 0, 0)")
            .execute(&db)
            .await
            .expect("conversation");
        sqlx::query(
            "INSERT INTO runs (id, uid, conversation_id, question, workers, status, started_at, answer,
                               calls, input_tokens, output_tokens, cost_usd, cost_complete)
             VALUES (1, 'u1', 1, 'Old question?', '[]', 'finished', 0, 'Old answer.', 3, 120, 40, 0.5, 1)",
        )
        .execute(&db)
        .await
        .expect("run");
        db.close().await;
    }
    let server = TestServer::start().await.expect("server");
    let pool = pool(&server, &[("physicist", "phys"), ("teacher", "teach"), ("judge", "judge")]);
    let store = Store::open(&path).await.expect("opens and upgrades");
    let old = store.run(1).await.expect("query").expect("the old run");
    assert_eq!((old.run.calls, old.run.input_tokens, old.run.output_tokens), (3, 120, 40));
    assert_eq!(old.run.totals, None, "no split was recorded for it");

    let new = run_recorded(&store, &pool, Some(1), "Why is the sky blue?", FANOUT).await;
    let tree = store.run(new).await.expect("query").expect("the new run");
    let totals = tree.run.totals.expect("the split is recorded");
    assert_eq!(totals.calls as i64, tree.run.calls);
    assert_eq!((totals.workers.calls, totals.conductor.calls), (3, 0), "a given plan: no conductor calls");
    assert_eq!(totals.usage.input_tokens as i64, tree.run.input_tokens);
    let step_inputs: i64 = tree.steps.iter().filter_map(|s| s.input_tokens).sum();
    assert_eq!(step_inputs, tree.run.input_tokens, "the steps add up to the run");
    assert!(tree.steps.iter().all(|s| s.cached_input_tokens == Some(0)), "recorded, and none cached here");
}

#[tokio::test]
async fn a_conversation_keeps_its_choice_of_workers_and_review() {
    let server = TestServer::start().await.expect("server");
    let pool = pool(&server, &[("physicist", "phys"), ("teacher", "teach"), ("judge", "judge")]);
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&dir.path().join("h.sqlite")).await.expect("opens");
    let run = run_recorded(&store, &pool, None, "Why is the sky blue?", FANOUT).await;
    let id = store.run(run).await.expect("query").expect("run").run.conversation_id;

    let chosen = ["judge".to_owned(), "physicist".to_owned()];
    assert!(store.set_conversation_choices(id, Some(&chosen), true).await.expect("set"));
    let c = &store.list_conversations(10, None).await.expect("list")[0];
    assert_eq!((c.workers.as_deref(), c.review), (Some(&chosen[..]), true));
    assert!(store.set_conversation_choices(id, None, false).await.expect("set"));
    let c = &store.list_conversations(10, None).await.expect("list")[0];
    assert_eq!((c.workers.as_deref(), c.review), (None, false));
    assert!(!store.set_conversation_choices(id + 100, None, true).await.expect("no such conversation"));
}

#[tokio::test]
async fn a_rerun_is_recorded_with_the_steps_it_kept() {
    let server = TestServer::start().await.expect("server");
    let pool = pool(&server, &[("physicist", "phys"), ("teacher", "teach"), ("judge", "judge"), ("poet", "poet")]);
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&dir.path().join("h.sqlite")).await.expect("opens");
    let first = run_recorded(&store, &pool, None, "Why is the sky blue?", FANOUT).await;
    let old = store.run(first).await.expect("query").expect("run");

    // Step 1 (the teacher) again, by the poet: the judge sees it and runs again; step 0 is kept.
    let outputs: BTreeMap<usize, String> =
        old.steps.iter().filter_map(|s| Some((s.step as usize, s.output.clone()?))).collect();
    let source =
        Source { run_id: &old.run.uid, plan: &old.plans[0].plan, workers: &old.run.workers, outputs: &outputs };
    let again = rerun::prepare(source, &pool, 1, "poet").expect("prepare");
    let executor = Executor::from_pool_with_keys(&again.pool, |_| Arc::new(|| Ok(Some(ApiKey::new("test-key")))));
    let request = RunRequest {
        run_id: baton_engine::new_run_id(),
        question: old.run.question.clone(),
        plan: Some(again.plan),
        reuse: Some(again.reuse),
        ..RunRequest::default()
    };
    let second = record_request(&store, &executor, Some(old.run.conversation_id), request).await;

    let tree = store.run(second).await.expect("query").expect("the re-run");
    assert_eq!(tree.run.status, RunStatus::Finished);
    assert_eq!(tree.run.conversation_id, old.run.conversation_id);
    assert_eq!(tree.run.rerun_of, Some(RerunOf { run_id: old.run.uid.clone(), step: 1 }));
    assert_eq!(tree.run.calls, 2);
    let kept = &tree.steps[0];
    assert_eq!(kept.reused_from.as_deref(), Some(old.run.uid.as_str()));
    assert_eq!((kept.status.as_str(), kept.output.as_deref()), ("finished", old.steps[0].output.as_deref()));
    assert!(kept.request.is_none(), "a kept step was sent nothing this time");
    assert_eq!((tree.steps[1].worker.as_str(), tree.steps[1].reused_from.as_deref()), ("poet", None));
    assert!(tree.steps[2].request.is_some());
    let events: Vec<RunEvent> =
        tree.events.iter().map(|e| serde_json::from_value(e.clone()).expect("a RunEvent")).collect();
    baton_engine::event::check_sequence(&events).expect("the stored events keep the contract");

    // The conversation as each run's conductor saw it: nothing before the first, the first
    // turn before the re-run.
    let conversation = old.run.conversation_id;
    assert!(store.messages_before_run(conversation, first).await.expect("messages").is_empty());
    let before = store.messages_before_run(conversation, second).await.expect("messages");
    assert_eq!(before.len(), 2);
    assert_eq!(before[1].content, old.run.answer.clone().expect("answer"));

    let md = baton_store::export::run_markdown(&tree);
    assert!(md.contains(&format!("Re-runs step 1 of run {}", old.run.uid)), "{md}");
    assert!(md.contains(&format!("kept from run {}, not run again", old.run.uid)), "{md}");
    let json = baton_store::export::run_json(&tree);
    assert_eq!(json["run"]["rerun_of"]["step"], 1);
    assert_eq!(json["steps"][0]["reused_from"], old.run.uid.as_str());
}

/// `page_count × page_size` of the database at `path`, its write-ahead log folded in.
async fn database_bytes(path: &std::path::Path) -> i64 {
    let raw = sqlx::SqlitePool::connect(&format!("sqlite://{}", path.display())).await.expect("raw connection");
    sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)").execute(&raw).await.expect("checkpoint");
    let pages: i64 = sqlx::query_scalar("PRAGMA page_count").fetch_one(&raw).await.expect("page_count");
    let size: i64 = sqlx::query_scalar("PRAGMA page_size").fetch_one(&raw).await.expect("page_size");
    raw.close().await;
    pages * size
}

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

/// Every step of an "all" plan is sent every earlier step's answer; the history keeps each
/// answer once rather than once per step that saw it, so it grows with the outputs, not their
/// square. Measured: bytes the run adds to the database file against the bytes of its outputs.
#[tokio::test]
async fn a_five_step_all_plan_stores_each_output_once() {
    let server = TestServer::start().await.expect("server");
    let pool = pool(&server, &[("writer", "long")]);
    let outputs: Vec<String> = (0..5).map(|i| prose(i, 20_000)).collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("h.sqlite");
    let store = Store::open(&path).await.expect("opens");
    // One run first, so the measured one adds rows to tables that already have pages.
    server.queue_replies("long", (10..15).map(|i| prose(i, 20_000)));
    let plan = "model_id = [0, 0, 0, 0, 0]\nsubtasks = [\"Draft.\", \"Extend.\", \"Check.\", \"Improve.\", \"Finish.\"]\naccess_list = [[], \"all\", \"all\", \"all\", \"all\"]";
    run_recorded(&store, &pool, None, "Warm-up", plan).await;

    let before = database_bytes(&path).await;
    server.queue_replies("long", outputs.clone());
    let executor = Executor::from_pool_with_keys(&pool, |_| Arc::new(|| Ok(Some(ApiKey::new("test-key")))));
    let (id, emitted) = record_collecting(&store, &executor, given("Why is the sky blue?", plan)).await;
    let after = database_bytes(&path).await;

    let tree = store.run(id).await.expect("query").expect("run");
    let stored: Vec<&str> = tree.steps.iter().filter_map(|s| s.output.as_deref()).collect();
    assert_eq!(stored, outputs.iter().map(String::as_str).collect::<Vec<_>>(), "the outputs as answered");
    let judge = tree.steps[4].request.as_ref().expect("what step 4 was sent");
    assert_eq!(judge.messages.len(), 9, "four subtask/answer pairs and its own subtask");
    assert_eq!(judge.messages[7].content, outputs[3]);
    // What the history gives back is what happened: every event but the deltas, as emitted,
    // and every request as the step's `step_started` carried it.
    let whole: Vec<serde_json::Value> = emitted
        .iter()
        .filter(|e| !matches!(e, RunEvent::StepDelta { .. }))
        .map(|e| serde_json::to_value(e).expect("json"))
        .collect();
    // (Compared as text: the fields in the order they were emitted, too.)
    let text = |v: &[serde_json::Value]| serde_json::to_string(v).expect("json");
    assert!(text(&tree.events) == text(&whole), "the stored events are the emitted ones");
    for e in &emitted {
        if let RunEvent::StepStarted { step, system, messages, .. } = e {
            let sent = tree.steps[*step].request.as_ref().expect("a request");
            assert!(sent.system == *system && sent.messages == *messages, "step {step}'s request");
        }
    }

    let output_bytes: usize = outputs.iter().map(String::len).sum();
    let grown = after - before;
    println!(
        "a 5-step \"all\" plan with {output_bytes} bytes of outputs grew the history by {grown} bytes ({:.2}x)",
        grown as f64 / output_bytes as f64
    );
    assert!(grown <= 3 * output_bytes as i64, "{grown} bytes for {output_bytes} bytes of outputs");
}

/// A writer that fell behind (a server under load) records the events waiting for it in one
/// transaction. The history it leaves is the one an event-by-event writer leaves, down to the
/// stored rows: later steps' requests refer to answers stored earlier in the same batch. A batch
/// that cannot be recorded leaves nothing of itself.
#[tokio::test]
async fn events_recorded_in_batches_leave_the_same_history_as_one_by_one() {
    let server = TestServer::start().await.expect("server");
    let events = three_steps_that_see_all(&server).await;

    let dir = tempfile::tempdir().expect("tempdir");
    let (mut stores, mut ids) = (Vec::new(), Vec::new());
    // One by one; in two batches split between a step's answer and the next step's request;
    // all at once.
    let split = events.iter().position(|e| matches!(e, RunEvent::StepFinished { step: 0, .. })).expect("step 0") + 1;
    let batches: [Vec<&[RunEvent]>; 3] =
        [events.chunks(1).collect(), vec![&events[..split], &events[split..]], vec![&events[..]]];
    for (i, batches) in batches.into_iter().enumerate() {
        let store = Store::open(&dir.path().join(format!("{i}.sqlite"))).await.expect("opens");
        let mut recorder = store.recorder(None);
        for batch in batches {
            recorder.record_all(batch).await.expect("recorded");
        }
        ids.push(recorder.run_id().expect("a run id"));
        stores.push(store);
    }
    let rows = async |store: &Store| -> Vec<(String, Option<String>, Option<String>)> {
        let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", store.path().display())).await.expect("connect");
        let rows = sqlx::query_as("SELECT status, output, request FROM steps ORDER BY step").fetch_all(&pool).await;
        pool.close().await;
        rows.expect("steps")
    };
    let tree = async |store: &Store, id: i64| {
        let mut tree = serde_json::to_value(store.run(id).await.expect("query").expect("run")).expect("json");
        tree["run"]["started_at"] = serde_json::Value::Null;
        tree["run"]["finished_at"] = serde_json::Value::Null;
        tree
    };
    let one_by_one = (tree(&stores[0], ids[0]).await, rows(&stores[0]).await);
    assert_eq!(one_by_one.0["run"]["status"], "finished");
    // Step 2's stored request refers to step 0's answer rather than holding it.
    let step2 = one_by_one.1[2].2.as_deref().expect("a request");
    let answer0 = one_by_one.1[0].1.as_deref().expect("step 0's answer");
    let as_json = serde_json::to_string(answer0).expect("json");
    assert!(answer0.len() > 1_000 && !step2.contains(as_json.trim_matches('"')), "{step2}");
    for (store, id) in stores.iter().zip(&ids).skip(1) {
        assert_eq!(tree(store, *id).await, one_by_one.0, "{}", store.path().display());
        assert_eq!(rows(store).await, one_by_one.1, "{}", store.path().display());
    }

    // A batch whose last event cannot be recorded (a step that starts twice) takes the events
    // before it down with it.
    let store = Store::open(&dir.path().join("failed.sqlite")).await.expect("opens");
    let mut recorder = store.recorder(None);
    let first_step = events.iter().position(|e| matches!(e, RunEvent::StepStarted { .. })).expect("step_started");
    let mut broken = events[..=first_step].to_vec();
    broken.push(events[first_step].clone());
    assert!(recorder.record_all(&broken).await.is_err(), "a step started twice");
    assert!(store.list_runs(10, None).await.expect("list").is_empty(), "nothing of the batch is kept");
    assert_eq!(recorder.run_id(), None);
    // Nor is the run live: its lock went back to the store with the batch, and the next run
    // takes it rather than a new one.
    let db = dir.path().join("failed.sqlite");
    assert_eq!(slot_files(&db), 1);
    let mut next = store.recorder(None);
    next.record_all(&events).await.expect("recorded");
    assert_eq!(slot_files(&db), 1, "the failed batch's lock was given back");
}

/// The events of a 3-step run whose later steps see all before them (long answers, so that
/// a stored request that copied them would show).
async fn three_steps_that_see_all(server: &TestServer) -> Vec<RunEvent> {
    let pool = pool(server, &[("writer", "long")]);
    server.queue_replies("long", (20..23).map(|i| prose(i, 2_000)));
    let plan =
        "model_id = [0, 0, 0]\nsubtasks = [\"Draft.\", \"Check.\", \"Finish.\"]\naccess_list = [[], \"all\", \"all\"]";
    let executor = Executor::from_pool_with_keys(&pool, |_| Arc::new(|| Ok(Some(ApiKey::new("test-key")))));
    let (tx, mut rx) = mpsc::unbounded_channel();
    executor.run(given("Why is the sky blue?", plan), &tx, &CancellationToken::new()).await;
    drop(tx);
    let mut events = Vec::new();
    while let Some(e) = rx.recv().await {
        events.push(e);
    }
    assert!(events.len() > 8, "{} events", events.len());
    events
}

/// How many run lock files ("slots", held by a store for the runs it records, free or not) are
/// beside the database `db`.
fn slot_files(db: &std::path::Path) -> usize {
    let locks = db.with_extension("sqlite.locks");
    std::fs::read_dir(&locks)
        .map(|d| d.filter_map(Result::ok).filter(|e| e.file_name().to_string_lossy().starts_with("slot")).count())
        .unwrap_or_default()
}

/// `events` as another run's: the same but for the run's id.
fn as_run(events: &[RunEvent], uid: &str) -> Vec<RunEvent> {
    let mut events = events.to_vec();
    if let Some(RunEvent::RunStarted { run_id, .. }) = events.first_mut() {
        *run_id = uid.to_owned();
    }
    events
}

/// A server records the events of many runs in one transaction: a run whose
/// events fail leaves nothing, and takes nothing of the others down with it.
#[tokio::test]
async fn runs_recorded_in_one_transaction_keep_apart() {
    let server = TestServer::start().await.expect("server");
    let events = three_steps_that_see_all(&server).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&dir.path().join("h.sqlite")).await.expect("opens");
    let (a, b, c) = (as_run(&events, "run-a"), as_run(&events, "run-b"), as_run(&events, "run-c"));
    // Run c's step starts twice: its batch cannot be recorded.
    let first_step = c.iter().position(|e| matches!(e, RunEvent::StepStarted { .. })).expect("step_started");
    let mut broken = c[..=first_step].to_vec();
    broken.push(c[first_step].clone());
    let split = events.iter().position(|e| matches!(e, RunEvent::StepFinished { step: 0, .. })).expect("step 0") + 1;
    let (mut ra, mut rb, mut rc) = (store.recorder(None), store.recorder(None), store.recorder(None));
    let results = store
        .record_many(&mut [(&mut ra, &a[..split]), (&mut rc, &broken), (&mut rb, &b[..split])], Some((7, 0.25)))
        .await
        .expect("committed");
    assert!(results[0].is_ok() && results[1].is_err() && results[2].is_ok(), "{results:?}");
    assert_eq!(rc.run_id(), None, "the failed run is forgotten");
    let results =
        store.record_many(&mut [(&mut rb, &b[split..]), (&mut ra, &a[split..])], None).await.expect("committed");
    assert!(results.iter().all(Result::is_ok), "{results:?}");

    let runs = store.list_runs(10, None).await.expect("list");
    let mut questions: Vec<_> = runs.iter().map(|r| (r.id, r.status)).collect();
    questions.sort_by_key(|r| r.0);
    let (ida, idb) = (ra.run_id().expect("a"), rb.run_id().expect("b"));
    assert_eq!(questions, vec![(ida, RunStatus::Finished), (idb, RunStatus::Finished)]);
    // Both runs are whole, and the same but for their ids.
    let tree = async |id: i64| {
        let mut tree = serde_json::to_value(store.run(id).await.expect("query").expect("run")).expect("json");
        for key in ["id", "uid", "conversation_id", "started_at", "finished_at"] {
            tree["run"][key] = serde_json::Value::Null;
        }
        for step in tree["steps"].as_array_mut().expect("steps") {
            step["run_id"] = serde_json::Value::Null;
        }
        tree
    };
    let (tree_a, tree_b) = (tree(ida).await, tree(idb).await);
    assert_eq!(tree_a["steps"].as_array().map(Vec::len), Some(3));
    for part in ["run", "plans", "steps"] {
        assert!(tree_a[part] == tree_b[part], "runs a and b differ in {part}");
    }
    assert_eq!(tree_a["events"].as_array().map(Vec::len), tree_b["events"].as_array().map(Vec::len));
    // The day's spending came in the first commit.
    assert!((store.serve_spend(7).await.expect("spend") - 0.25).abs() < 1e-12);
    // No run is left holding a lock: the failed run gave its back at once (b took it), the
    // finished ones at their end, so two more runs at once take no new one.
    let db = dir.path().join("h.sqlite");
    assert_eq!(slot_files(&db), 2);
    let (mut rd, mut re) = (store.recorder(None), store.recorder(None));
    let (d, e) = (as_run(&events, "run-d"), as_run(&events, "run-e"));
    let results = store.record_many(&mut [(&mut rd, &d[..1]), (&mut re, &e[..1])], None).await.expect("committed");
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    assert_eq!(slot_files(&db), 2, "the finished runs' locks were given back");
}

/// A batch that fails as a whole (here the day's spending cannot be written) keeps nothing and
/// leaves every recorder as it was: the same events, given again, make the same history.
#[tokio::test]
async fn a_batch_that_fails_as_a_whole_can_be_given_again() {
    let server = TestServer::start().await.expect("server");
    let events = three_steps_that_see_all(&server).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&dir.path().join("h.sqlite")).await.expect("opens");
    let (a, b) = (as_run(&events, "run-a"), as_run(&events, "run-b"));
    let raw = sqlx::SqlitePool::connect(&format!("sqlite://{}", store.path().display())).await.expect("connect");
    sqlx::query("ALTER TABLE serve_spend RENAME TO serve_spend_away").execute(&raw).await.expect("rename");
    let (mut ra, mut rb) = (store.recorder(None), store.recorder(None));
    let failed = store.record_many(&mut [(&mut ra, &a), (&mut rb, &b)], Some((3, 1.5))).await;
    assert!(failed.is_err(), "the spending cannot be written");
    assert!(store.list_runs(10, None).await.expect("list").is_empty(), "nothing of the batch is kept");
    assert_eq!((ra.run_id(), rb.run_id()), (None, None));
    sqlx::query("ALTER TABLE serve_spend_away RENAME TO serve_spend").execute(&raw).await.expect("rename back");
    raw.close().await;
    let results = store.record_many(&mut [(&mut ra, &a), (&mut rb, &b)], Some((3, 1.5))).await.expect("committed");
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let runs = store.list_runs(10, None).await.expect("list");
    assert_eq!(runs.len(), 2);
    assert!(runs.iter().all(|r| r.status == RunStatus::Finished), "{runs:?}");
    for id in [ra.run_id().expect("a"), rb.run_id().expect("b")] {
        let tree = store.run(id).await.expect("query").expect("run");
        assert_eq!(tree.steps.len(), 3);
    }
    assert!((store.serve_spend(3).await.expect("spend") - 1.5).abs() < 1e-12, "counted once");
    // The batch that failed gave back the locks its runs took: the second try took the same two.
    assert_eq!(slot_files(&dir.path().join("h.sqlite")), 2);
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

/// Runs `request` in a new conversation, recording it; returns the run's id and every event
/// the executor emitted.
async fn record_collecting(store: &Store, executor: &Executor, request: RunRequest) -> (i64, Vec<RunEvent>) {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut recorder = store.recorder(None);
    let mut emitted = Vec::new();
    let record = async {
        while let Some(event) = rx.recv().await {
            recorder.record(&event).await.expect("recorded");
            emitted.push(event);
        }
    };
    let run = async {
        executor.run(request, &tx, &CancellationToken::new()).await;
        drop(tx);
    };
    tokio::join!(run, record);
    (recorder.run_id().expect("a run id"), emitted)
}

fn given(question: &str, plan: &str) -> RunRequest {
    RunRequest {
        run_id: baton_engine::new_run_id(),
        question: question.into(),
        plan: Some(baton_plan::parse(plan, &Limits::default()).expect("plan parses")),
        ..RunRequest::default()
    }
}

/// A question whose run failed, was stopped, or was interrupted has no answer in the
/// conversation; the history a follow-up is asked with still alternates user and assistant,
/// each such question followed by a turn that says what became of it.
#[tokio::test]
async fn unanswered_questions_keep_the_conversation_alternating() {
    let server = TestServer::start().await.expect("server");
    let pool =
        pool(&server, &[("ok", "fine"), ("refused", "refused;fail=400"), ("slow", "slow;latency=5000;chunks=50")]);
    let executor = Executor::from_pool_with_keys(&pool, |_| Arc::new(|| Ok(Some(ApiKey::new("test-key")))));
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("h.sqlite");
    let store = Store::open(&path).await.expect("opens");

    let failed =
        run_recorded(&store, &pool, None, "First: fails", "model_id=[1]\nsubtasks=['x']\naccess_list=[[]]").await;
    let conversation = store.run(failed).await.unwrap().unwrap().run.conversation_id;
    let slow = given("Second: stopped", "model_id=[2]\nsubtasks=['x']\naccess_list=[[]]");
    let (stopped, _) = record_stopped_after(&store, &executor, Some(conversation), slow, 2).await;
    // A run whose process died: its recorder is dropped before the run ends.
    {
        let events: Vec<RunEvent> = store
            .run(failed)
            .await
            .unwrap()
            .unwrap()
            .events
            .into_iter()
            .map(|e| serde_json::from_value(e).unwrap())
            .take_while(|e| !matches!(e, RunEvent::StepStarted { .. }))
            .collect();
        let mut dead = store.recorder(Some(conversation));
        for mut e in events {
            if let RunEvent::RunStarted { run_id, question, .. } = &mut e {
                *run_id = "dead0002".into();
                *question = "Third: interrupted".into();
            }
            dead.record(&e).await.unwrap();
        }
    }
    let store = Store::open(&path).await.expect("reopens, marking the dead run");
    let answered = run_recorded(
        &store,
        &pool,
        Some(conversation),
        "Fourth: answered",
        "model_id=[0]\nsubtasks=['y']\naccess_list=[[]]",
    )
    .await;
    let statuses: Vec<RunStatus> =
        store.conversation_runs(conversation).await.unwrap().into_iter().map(|r| r.status).collect();
    assert_eq!(
        statuses,
        [RunStatus::Failed, RunStatus::Cancelled, RunStatus::Interrupted, RunStatus::Finished],
        "run {stopped} was stopped"
    );

    let turns: Vec<(String, String)> = store
        .messages(conversation)
        .await
        .unwrap()
        .into_iter()
        .map(|m| (format!("{:?}", m.role).to_lowercase(), m.content))
        .collect();
    let expected = [
        ("user", "First: fails"),
        ("assistant", "(no answer: the run failed: a step of its plan failed)"),
        ("user", "Second: stopped"),
        ("assistant", "(no answer: the run was stopped before it finished)"),
        ("user", "Third: interrupted"),
        ("assistant", "(no answer: the run was interrupted before it finished)"),
        ("user", "Fourth: answered"),
        ("assistant", "fine (saw 0 earlier answers) answers: y"),
    ];
    let expected: Vec<(String, String)> = expected.iter().map(|(r, c)| (r.to_string(), c.to_string())).collect();
    assert_eq!(turns, expected);
    // What the fourth run's conductor saw: the three unanswered questions, each answered.
    let before = store.messages_before_run(conversation, answered).await.unwrap();
    assert_eq!(before.len(), 6);
    assert!(before.windows(2).all(|w| w[0].role != w[1].role), "{before:?}");
    // The conversation's export shows the same turns.
    let title = store.conversation_title(conversation).await.unwrap().unwrap();
    let json =
        baton_store::export::conversation_json(conversation, &title, &store.messages(conversation).await.unwrap(), &[]);
    assert_eq!(json["messages"][3]["content"], "(no answer: the run was stopped before it finished)");
}

/// Stopping a run while a step streams its answer keeps the text that had arrived: the step is
/// stored `cancelled` with it, and reads back so from a reopened history and in exports.
#[tokio::test]
async fn a_step_stopped_mid_answer_keeps_what_it_had_streamed() {
    let server = TestServer::start().await.expect("server");
    let full = "Rayleigh scattering makes short wavelengths scatter far more than long ones, so the sky looks blue";
    server.queue_replies("slow", [full]);
    let pool = pool(&server, &[("slow", "slow;latency=4000")]);
    let executor = Executor::from_pool_with_keys(&pool, |_| Arc::new(|| Ok(Some(ApiKey::new("test-key")))));
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("h.sqlite");
    let store = Store::open(&path).await.expect("opens");
    let request = given("Why is the sky blue?", "model_id=[0]\nsubtasks=['Explain.']\naccess_list=[[]]");
    let (id, streamed) = record_stopped_after(&store, &executor, None, request, 3).await;
    store.close().await;

    let store = Store::open(&path).await.expect("reopens");
    let tree = store.run(id).await.expect("query").expect("run");
    assert_eq!(tree.run.status, RunStatus::Cancelled);
    let step = &tree.steps[0];
    assert_eq!((step.status.as_str(), step.error_kind.as_deref()), ("cancelled", Some("cancelled")));
    let kept = step.output.as_deref().expect("the text that had arrived");
    assert!(kept.starts_with(&streamed) && !streamed.is_empty(), "{kept:?} keeps {streamed:?}");
    assert!(full.starts_with(kept) && kept.len() < full.len(), "{kept:?} is a prefix of the answer");
    assert!(tree.events.iter().all(|e| e["type"] != "step_delta"), "deltas are still not stored");

    let json = baton_store::export::run_json(&tree);
    assert_eq!(
        (json["steps"][0]["status"].as_str(), json["steps"][0]["output"].as_str()),
        (Some("cancelled"), Some(kept))
    );
    let md = baton_store::export::run_markdown(&tree);
    assert!(
        md.contains(&format!("{}\n\n*(cut short: the run stopped while this step was answering)*", kept.trim_end())),
        "{md}"
    );
}

/// A run whose recorder still holds its lock cannot be deleted, alone or with its
/// conversation; once it ends, it can.
#[tokio::test]
async fn a_run_still_being_recorded_cannot_be_deleted() {
    let server = TestServer::start().await.expect("server");
    let pool = pool(&server, &[("a", "alpha")]);
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&dir.path().join("h.sqlite")).await.expect("opens");
    let done = run_recorded(&store, &pool, None, "Done", "model_id=[0]\nsubtasks=['x']\naccess_list=[[]]").await;
    let events: Vec<RunEvent> = store
        .run(done)
        .await
        .unwrap()
        .unwrap()
        .events
        .into_iter()
        .map(|e| serde_json::from_value(e).unwrap())
        .collect();
    let (end, going) = events.split_last().expect("events");
    let mut live = store.recorder(None);
    for e in going {
        let mut e = e.clone();
        if let RunEvent::RunStarted { run_id, .. } = &mut e {
            *run_id = "live0002".into();
        }
        live.record(&e).await.unwrap();
    }
    let (run, conversation) = (live.run_id().unwrap(), live.conversation_id().unwrap());

    let e = store.delete_run(run).await.expect_err("refused");
    assert!(matches!(e, StoreError::RunStillGoing { run: r } if r == run), "{e}");
    assert_eq!(e.to_string(), format!("run {run} is still going; stop it first, then delete it"));
    let e = store.delete_conversation(conversation).await.expect_err("refused");
    assert!(matches!(e, StoreError::ConversationStillGoing { .. }), "{e}");
    assert!(e.to_string().contains("stop it first, then delete the conversation"), "{e}");
    assert!(store.run(run).await.unwrap().is_some(), "nothing was deleted");
    assert!(store.delete_run(done).await.unwrap(), "a finished run still deletes");

    live.record(end).await.unwrap();
    assert!(store.delete_run(run).await.unwrap(), "ended: deleted");
    assert!(store.delete_conversation(conversation).await.unwrap());
}

/// Compare in chat: the conductor's run and a worker's run of the same question are recorded
/// side by side, at the same time, in one conversation; only the conductor's joins the turns a
/// follow-up sees. A mark of the better answer makes a preference pair; a tie, or no mark,
/// makes none.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn compared_runs_record_side_by_side_and_marks_become_preference_pairs() {
    let server = TestServer::start().await.expect("server");
    // Each answer streams over 150 ms, so the two runs' writes interleave.
    let pool = pool(&server, &[("a", "alpha;latency=150"), ("b", "beta;latency=150"), ("c", "gamma;latency=150")]);
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&dir.path().join("h.sqlite")).await.expect("opens");
    let executor = Executor::from_pool_with_keys(&pool, |_| Arc::new(|| Ok(Some(ApiKey::new("test-key")))));
    let question = "Why is the sky blue?";
    let conversation = store.new_conversation(question).await.unwrap();
    let request = |plan: &str| RunRequest {
        run_id: baton_engine::new_run_id(),
        question: question.into(),
        plan: Some(baton_plan::parse(plan, &Limits::default()).expect("plan")),
        ..RunRequest::default()
    };
    let single_plan = "model_id = [1]\nsubtasks = [\"Why is the sky blue?\"]\naccess_list = [[]]";
    let (conductor_run, single_run) = tokio::join!(
        record_with(store.recorder(Some(conversation)), &executor, request(FANOUT)),
        record_with(store.recorder(Some(conversation)).without_messages(), &executor, request(single_plan)),
    );
    let turns: Vec<String> = store.messages(conversation).await.unwrap().into_iter().map(|m| m.content).collect();
    let conductor_answer = store.run(conductor_run).await.unwrap().unwrap().run.answer.expect("answered");
    let single_answer = store.run(single_run).await.unwrap().unwrap().run.answer.expect("answered");
    assert_eq!(turns, [question.to_owned(), conductor_answer.clone()], "only the conductor's answer is a turn");
    assert_eq!(store.conversation_runs(conversation).await.unwrap().len(), 2, "both runs are the conversation's");

    let b = ("b", pool.workers[1].identity());
    let id = store.add_comparison(conversation, Some(conductor_run), Some(single_run), (b.0, &b.1)).await.unwrap();
    let kept = store.comparisons(conversation).await.unwrap();
    assert_eq!((kept.len(), kept[0].preferred, kept[0].single_run), (1, None, Some(single_run)));
    assert!(store.preference_pairs().await.unwrap().is_empty(), "not marked yet");
    assert!(store.mark_comparison(id, Some(Preferred::Tie)).await.unwrap());
    assert!(store.preference_pairs().await.unwrap().is_empty(), "a tie prefers neither");
    assert!(store.mark_comparison(id, Some(Preferred::Single)).await.unwrap());
    assert!(!store.mark_comparison(id + 1, Some(Preferred::Single)).await.unwrap(), "no such comparison");
    let pairs = store.preference_pairs().await.unwrap();
    assert_eq!(pairs.len(), 1);
    let pair = serde_json::to_value(&pairs[0]).unwrap();
    assert_eq!(pair["prompt"], serde_json::json!([{ "role": "user", "content": question }]));
    assert_eq!(pair["chosen"], serde_json::json!([{ "role": "assistant", "content": single_answer }]));
    assert_eq!(pair["rejected"], serde_json::json!([{ "role": "assistant", "content": conductor_answer }]));
    assert_eq!((pair["chosen_by"].as_str(), pair["rejected_by"].as_str()), (Some("single:b"), Some("conductor")));

    // A follow-up's pair carries the conversation before it as the prompt.
    let next = run_recorded(&store, &pool, Some(conversation), "And at sunset?", FANOUT).await;
    let alone = "model_id = [1]\nsubtasks = [\"And at sunset?\"]\naccess_list = [[]]";
    let mut follow_up = request(alone);
    follow_up.question = "And at sunset?".into();
    let next_single = record_with(store.recorder(Some(conversation)).without_messages(), &executor, follow_up).await;
    let second = store.add_comparison(conversation, Some(next), Some(next_single), (b.0, &b.1)).await.unwrap();
    store.mark_comparison(second, Some(Preferred::Conductor)).await.unwrap();
    let pairs = store.preference_pairs().await.unwrap();
    assert_eq!(pairs.len(), 2);
    let prompt: Vec<&str> = pairs[1].prompt.iter().map(|m| m["content"].as_str().unwrap()).collect();
    assert_eq!(prompt, [question, conductor_answer.as_str(), "And at sunset?"]);
    assert_eq!(pairs[1].chosen_by, "conductor");

    // The marks add to the profile of b as it is now, by identity: renamed, it keeps them;
    // defined otherwise, it has none; and a worker never compared has none.
    let identities = |b_identity: &str| {
        vec![("a".to_owned(), pool.workers[0].identity()), ("renamed".to_owned(), b_identity.to_owned())]
    };
    let learned = store.learned(&identities(&b.1), None).await.unwrap();
    let marks: Vec<ChatMarks> = learned.profiles.iter().map(|p| p.marks).collect();
    assert_eq!(marks, [ChatMarks::default(), ChatMarks { better: 1, tie: 0, worse: 1 }]);
    assert_eq!(learned.profiles[1].freshness, Freshness::None, "marks are no learning run");
    let changed = store.learned(&identities(&format!("{} temperature=0.9", b.1)), None).await.unwrap();
    assert_eq!(changed.profiles[1].marks, ChatMarks::default());

    // A deleted run leaves its comparison without that side, and without a pair.
    store.delete_run(next_single).await.unwrap();
    assert_eq!(store.comparison(second).await.unwrap().unwrap().single_run, None);
    assert_eq!(store.preference_pairs().await.unwrap().len(), 1);
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

/// A worker's profile is what learning runs measured of it alone, found by its identity: an
/// evaluation that was not a learning run says nothing, a renamed worker keeps its profile, a
/// changed one has a stale profile. The fallback worker is the profile's choice for the
/// question's category (told by the learned questions nearest to it), else the best overall.
#[tokio::test]
async fn profiles_come_from_learning_runs_by_identity_and_choose_the_fallback_worker() {
    use baton_engine::accounting::Figures;
    use baton_engine::fallback::fallback_worker;
    use baton_engine::profile::measure;
    use baton_store::evaluations::EvalResult;

    let server = TestServer::start().await.expect("server");
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&dir.path().join("history.sqlite")).await.expect("opens");
    let mut pool = pool(&server, &[("a", "model-a"), ("b", "model-b")]);
    let ids: Vec<(String, String)> = pool.workers.iter().map(|w| (w.name.clone(), w.identity())).collect();
    // An evaluation that was not a learning run teaches nothing, though its workers are these.
    let plain = serde_json::json!({"workers": ["a", "b"]});
    store.create_evaluation("evaluated", "s", "0", &plain).await.expect("created");
    let learning = serde_json::json!({"workers": ["a", "b"], "learn": true, "identities": [&ids[0].1, &ids[1].1]});
    store.create_evaluation("ours", "s", "0", &learning).await.expect("created");
    // The same items learned again: each counts once.
    store.create_evaluation("again", "s", "0", &learning).await.expect("created");
    let chemistry = [
        "What is the pH of a 0.01 M solution of hydrochloric acid?",
        "Which gas is released when zinc reacts with hydrochloric acid?",
        "What is the molar mass of sulfuric acid?",
        "How many moles of sodium chloride are in 117 grams of it?",
    ];
    let history = [
        "Who wrote the Federalist Papers with Madison and Jay?",
        "In which year did the Berlin Wall fall?",
        "Which treaty ended the Thirty Years' War?",
        "Who was the first emperor of Rome?",
        "Which empire built Machu Picchu?",
        "When did the Byzantine Empire fall?",
    ];
    let plan = "model_id = [0]\nsubtasks = [\"Answer it.\"]\naccess_list = [[]]";
    let mut item = 0;
    // History says its kind; chemistry's results are kept as before kinds were, and its
    // category is no kind, so it counts for none.
    let kinds = [("chemistry", None), ("history", Some("choice".to_owned()))];
    for (questions, category, a_right) in [(&chemistry[..], "chemistry", false), (&history[..], "history", true)] {
        for question in questions {
            item += 1;
            let run = run_recorded(&store, &pool, None, question, plan).await;
            let uid = store.run(run).await.expect("reads").expect("recorded").run.uid;
            for (worker, right) in [("a", a_right), ("b", !a_right)] {
                let result = EvalResult {
                    strategy: format!("single:{worker}"),
                    item_id: format!("item-{item}"),
                    split: "test".into(),
                    category: category.into(),
                    kind: kinds.iter().find(|(c, _)| *c == category).and_then(|(_, k)| k.clone()),
                    run_uid: Some(uid.clone()),
                    correct: right,
                    figures: Figures { calls: 1, ..Figures::default() },
                    ..EvalResult::default()
                };
                store.put_eval_result("ours", &result).await.expect("put");
                store.put_eval_result("again", &result).await.expect("put");
                store.put_eval_result("evaluated", &EvalResult { correct: !right, ..result }).await.expect("put");
            }
        }
    }

    let learned = store.learned(&ids, None).await.expect("reads");
    assert_eq!(learned.questions.len(), 10);
    // (The user's own `fallback_worker` standing over what was learned is the runner's:
    // crates/baton-runner/tests/runner.rs.)
    let [a, b] = &learned.profiles[..] else { panic!("two profiles") };
    assert_eq!((a.freshness, a.by_category["history"].right, a.by_category["history"].n), (Freshness::Current, 6, 6));
    assert_eq!((b.by_category["chemistry"].right, b.by_category["chemistry"].n), (4, 4));
    assert_eq!(a.by_kind.keys().collect::<Vec<_>>(), ["choice"], "chemistry's results name no kind");
    assert_eq!((a.by_kind["choice"].right, a.by_kind["choice"].n), (6, 6));
    assert_eq!(a.learned_in.len(), 1, "one of the two learning runs counts, the plain evaluation not at all");
    let measured = measure(&learned.profiles, learned.questions.clone());
    assert_eq!(measured.best, Some(0), "a is right on 6 of 10, b on 4");
    assert_eq!(measured.by_category.best, [("chemistry".to_owned(), 1), ("history".to_owned(), 0)].into());

    pool.options.fallback.measured = measured;
    let acid = "What is the pH of a 0.5 M solution of nitric acid?";
    let (worker, why) = fallback_worker(&pool.options.fallback, 2, acid);
    assert_eq!(worker, 1, "b is the best alone at chemistry");
    assert!(why.expect("measured").contains("chemistry"));

    // Renamed, a worker keeps its profile; with another model, its profile is stale.
    let renamed = [("alpha".to_owned(), ids[0].1.clone()), ("b".to_owned(), format!("{} temperature=1", ids[1].1))];
    let learned = store.learned(&renamed, None).await.expect("reads");
    assert_eq!(learned.profiles[0].freshness, Freshness::Current);
    assert_eq!(learned.profiles[1].freshness, Freshness::Stale);
    assert_eq!(learned.profiles[1].identity.as_deref(), Some(ids[1].1.as_str()), "as it was learned");
    let measured = measure(&learned.profiles, learned.questions);
    assert_eq!(measured.by_category.best.get("chemistry"), None, "a is right on no chemistry item, b is stale");
    let unknown = store.learned(&[("c".to_owned(), "openai other".to_owned())], None).await.expect("reads");
    assert_eq!(unknown.profiles[0].freshness, Freshness::None);

    // Kept before kinds were, a result whose category is a kind (its item had no category of
    // its own) counts for that kind.
    let legacy = serde_json::json!({"workers": ["c"], "learn": true, "identities": ["openai legacy"]});
    store.create_evaluation("legacy", "s", "0", &legacy).await.expect("created");
    let result = EvalResult {
        strategy: "single:c".into(),
        item_id: "x".into(),
        split: "test".into(),
        category: "number".into(),
        correct: true,
        ..EvalResult::default()
    };
    store.put_eval_result("legacy", &result).await.expect("put");
    let old = store.learned(&[("c".to_owned(), "openai legacy".to_owned())], None).await.expect("reads");
    assert_eq!((old.profiles[0].by_kind["number"].right, old.profiles[0].by_kind["number"].n), (1, 1));
}

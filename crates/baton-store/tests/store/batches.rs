//! Events recorded in batches and many runs in one transaction: the same history as one by one,
//! and a batch that fails keeps nothing and gives its locks back.

use std::sync::Arc;

use baton_engine::{Executor, RunEvent};
use baton_providers::ApiKey;
use baton_store::{RunStatus, Store};
use baton_testserver::TestServer;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::{given, pool, prose, slot_files};

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

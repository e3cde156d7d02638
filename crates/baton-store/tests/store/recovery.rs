//! Live and dead runs: a run whose process died is interrupted, one still being recorded cannot be
//! deleted, and a damaged file is reported and kept.

use baton_engine::RunEvent;
use baton_store::{RunStatus, Store, StoreError};
use baton_testserver::TestServer;

use crate::{pool, run_recorded, slot_files};

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

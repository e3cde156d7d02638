//! Conversations: follow-ups, deletes that cascade, the choice of workers and review, and the
//! turns a follow-up sees when earlier questions went unanswered.

use std::sync::Arc;

use baton_engine::{Executor, RunEvent};
use baton_providers::ApiKey;
use baton_store::{RunStatus, Store};
use baton_testserver::TestServer;

use crate::{FANOUT, given, pool, record_stopped_after, run_recorded};

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

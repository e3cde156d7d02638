//! A run recorded from the real executor's events: its whole tree, search and exports; failed
//! steps, re-runs, a step stopped mid-answer, and the space an "all" plan takes.

use std::collections::BTreeMap;
use std::sync::Arc;

use baton_engine::rerun::{self, Source};
use baton_engine::{Executor, RerunOf, RunEvent, RunRequest};
use baton_providers::ApiKey;
use baton_store::{RunStatus, Store};
use baton_testserver::TestServer;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::{FANOUT, given, pool, prose, record_request, record_stopped_after, run_recorded};

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

//! What the history teaches: compared answers and their marks (preference pairs, a worker's chat
//! marks), and the workers' profiles from learning runs, which choose the fallback worker.

use std::sync::Arc;

use baton_engine::profile::{ChatMarks, Freshness};
use baton_engine::{Executor, RunRequest};
use baton_plan::Limits;
use baton_providers::ApiKey;
use baton_store::Store;
use baton_store::comparisons::Preferred;
use baton_testserver::TestServer;

use crate::{FANOUT, pool, record_with, run_recorded};

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

    pool.learned = measured;
    let acid = "What is the pH of a 0.5 M solution of nitric acid?";
    let (worker, why) = fallback_worker(&pool.options.fallback, &pool.learned, 2, acid);
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

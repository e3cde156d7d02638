//! The runner over real parts: a pool of loopback workers speaking OpenAI's wire format, a real
//! SQLite history, the real executor.

use baton_engine::{Pool, RunEvent, RunStatus};
use baton_runner::rerun::Earlier;
use baton_runner::{Ask, Conductor, ConductorChoice, Context, LocalModels, RunnerError, Setup, SetupError};
use baton_store::Store;
use baton_testserver::{TestServer, Wire};
use tokio_util::sync::CancellationToken;

/// Keyless workers (an OpenAI-compatible server needs no key) whose answers echo their subtasks.
fn pool(server: &TestServer, extra: &str) -> Pool {
    let mut text = format!("question_to_answer_step = false\n{extra}\n[retry]\nmax_retries = 0\n");
    for name in ["first", "second"] {
        text.push_str(&format!(
            "\n[[worker]]\nname = \"{name}\"\nprovider = \"openai-compatible\"\nmodel = \"{name}-model\"\nbase_url = \"{}\"\n",
            server.base_url(Wire::OpenAi)
        ));
    }
    Pool::parse(&text, "pool.toml").expect("valid pool")
}

async fn store() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&dir.path().join("history.sqlite")).await.expect("opens");
    (dir, store)
}

fn setup<'a>(
    models: &'a LocalModels,
    choice: &'a ConductorChoice,
    conductor: Conductor,
    store: &'a Store,
) -> Setup<'a> {
    Setup { models, choice, conductor, store: Some(store), notify: &|_| {} }
}

const PLAN: &str =
    "model_id = [0, 1]\nsubtasks = [\"Name a colour.\", \"Say which colour was named.\"]\naccess_list = [[], \"all\"]";

/// `question` with the written plan [`PLAN`], in `conversation`.
fn asked(question: &str, conversation: Option<i64>) -> Ask {
    let plan = baton_plan::parse(PLAN, &baton_plan::Limits::default()).expect("plan parses");
    Ask { question: question.into(), conversation, plan: Some(plan) }
}

#[tokio::test]
async fn a_pool_without_a_conductor_builds_for_given_plans_and_is_refused_where_one_is_required() {
    let server = TestServer::start().await.expect("server");
    let (_dir, store) = store().await;
    let (models, choice) = (LocalModels::default(), ConductorChoice::default());

    let built = baton_runner::build(pool(&server, ""), setup(&models, &choice, Conductor::IfConfigured, &store))
        .await
        .expect("builds without a conductor");
    assert!(!built.conductor);
    assert_eq!(built.executor.workers().len(), 2);

    let refused = baton_runner::build(pool(&server, ""), setup(&models, &choice, Conductor::Required, &store)).await;
    assert!(matches!(refused, Err(SetupError::NotConfigured)), "{refused:?}");
}

#[tokio::test]
async fn a_question_is_recorded_before_each_event_is_shown_and_a_follow_up_sees_the_conversation() {
    let server = TestServer::start().await.expect("server");
    let (_dir, store) = store().await;
    let (models, choice) = (LocalModels::default(), ConductorChoice::default());
    let context = Context { models: &models, choice: &choice, notify: &|_| {} };
    let cancel = CancellationToken::new();

    let shown = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let into = shown.clone();
    let recorded = baton_runner::ask(
        pool(&server, ""),
        context,
        Some(&store),
        asked("What colour is the sky?", None),
        move |event: RunEvent| into.lock().unwrap().push(event),
        |e| panic!("the history failed: {e}"),
        &cancel,
    )
    .await
    .expect("runs");
    assert_eq!(recorded.outcome.status, RunStatus::Finished, "{:?}", recorded.outcome.error);
    let (run, conversation) = (recorded.run_id.expect("recorded"), recorded.conversation_id.expect("a conversation"));
    baton_engine::event::check_sequence(&shown.lock().unwrap()).expect("the events keep their contract");
    let tree = store.run(run).await.expect("reads").expect("the run is there");
    assert_eq!(tree.run.answer, recorded.outcome.answer);
    assert_eq!(tree.steps.len(), 2);

    // A follow-up is asked with the conversation's turns so far.
    let turns = baton_runner::conversation_so_far(&store, Some(conversation)).await.expect("the conversation");
    assert_eq!(turns.len(), 2, "{turns:?}");
    assert_eq!(turns[0].content, "What colour is the sky?");
    let follow_up = baton_runner::ask(
        pool(&server, ""),
        context,
        Some(&store),
        asked("And at night?", Some(conversation)),
        |_| {},
        |e| panic!("the history failed: {e}"),
        &cancel,
    )
    .await
    .expect("runs");
    assert_eq!(follow_up.conversation_id, Some(conversation));
    assert_eq!(baton_runner::conversation_so_far(&store, Some(conversation)).await.expect("turns").len(), 4);

    // Refused before a call is made: a conversation the history does not have, an empty
    // question, a plan the pool cannot run.
    let calls = server.requests().len();
    let (server, store, cancel) = (&server, &store, &cancel);
    let ask = move |ask: Ask| async move {
        let failed = |e| panic!("the history failed: {e}");
        baton_runner::ask(pool(server, ""), context, Some(store), ask, |_| {}, failed, cancel).await
    };
    let missing = ask(asked("And then?", Some(conversation + 100))).await;
    assert!(matches!(missing, Err(RunnerError::NotFound(_))), "{missing:?}");
    let empty = ask(asked("  ", None)).await;
    assert!(matches!(empty, Err(RunnerError::BadInput(_))), "{empty:?}");
    let mut too_far = asked("Who?", None);
    too_far.plan =
        Some(baton_plan::parse("model_id=[5]\nsubtasks=['x']\naccess_list=[[]]", &Default::default()).unwrap());
    let refused = ask(too_far).await;
    assert!(matches!(&refused, Err(RunnerError::BadInput(m)) if m.contains("5")), "{refused:?}");
    assert_eq!(server.requests().len(), calls, "nothing refused made a call");
}

#[tokio::test]
async fn a_rerun_runs_the_step_and_those_that_see_it_again_in_the_same_conversation() {
    let server = TestServer::start().await.expect("server");
    let (_dir, store) = store().await;
    let (models, choice) = (LocalModels::default(), ConductorChoice::default());
    let context = Context { models: &models, choice: &choice, notify: &|_| {} };
    let pool = pool(&server, "");
    let cancel = CancellationToken::new();
    let failed = |e| panic!("the history failed: {e}");
    let first = baton_runner::ask(
        pool.clone(),
        context,
        Some(&store),
        asked("What colour is the sky?", None),
        |_| {},
        failed,
        &cancel,
    )
    .await
    .expect("runs");
    let run = first.run_id.expect("recorded");

    // Step 1 again with the first worker: step 0 keeps its output.
    let earlier = Earlier::load(&store, run).await.expect("loads");
    let rerun = earlier.rerun(&store, &pool, 1, "first").await.expect("prepares");
    assert_eq!(Some(rerun.conversation), first.conversation_id);
    assert!(!rerun.needs_conductor);
    let requests_before = server.requests().len();
    let again =
        baton_runner::rerun::rerun_step(|| Ok(pool.clone()), context, &store, run, 1, "first", |_| {}, failed, &cancel)
            .await
            .expect("re-runs");
    assert_eq!(again.outcome.status, RunStatus::Finished, "{:?}", again.outcome.error);
    assert_eq!(server.requests().len() - requests_before, 1, "only the re-run step calls a worker");
    assert_eq!(again.conversation_id, first.conversation_id);

    let unknown = earlier.rerun(&store, &pool, 1, "nobody").await;
    assert!(matches!(unknown, Err(RunnerError::NotFound(_))), "{unknown:?}");
    // A run that is gone is the answer before a broken pool file; a run that is there needs it.
    let broken = || baton_engine::Pool::parse("[[worker]\n", "pool.toml");
    let no_run =
        baton_runner::rerun::rerun_step(broken, context, &store, run + 100, 1, "first", |_| {}, failed, &cancel).await;
    assert!(matches!(no_run, Err(RunnerError::NotFound(_))), "{no_run:?}");
    let no_pool =
        baton_runner::rerun::rerun_step(broken, context, &store, run, 1, "first", |_| {}, failed, &cancel).await;
    assert!(matches!(no_pool, Err(RunnerError::Pool(_))), "{no_pool:?}");
}

/// What the history's learning runs measured goes into the pool the runner builds: the best
/// worker as the fallback, each category's choice, where it is clear, and the questions that
/// place a new one. A worker the pool names as its fallback stands, and then nothing routes.
#[tokio::test]
async fn what_the_pool_learned_goes_into_the_pool_it_builds_unless_the_user_chose_the_worker() {
    use baton_engine::accounting::{Figures, Usage};
    use baton_store::evaluations::EvalResult;

    let server = TestServer::start().await.expect("server");
    let (_dir, store) = store().await;
    let pool = pool(&server, "");
    let identities = baton_runner::learned::identities(&pool);
    let config = serde_json::json!({
        "workers": ["first", "second"], "learn": true, "identities": [&identities[0].1, &identities[1].1],
    });
    store.create_evaluation("learned", "s", "0", &config).await.expect("created");
    for i in 0..8 {
        for (worker, right) in [("first", false), ("second", true)] {
            let result = EvalResult {
                strategy: format!("single:{worker}"),
                item_id: format!("item-{i}"),
                split: "test".into(),
                category: "geography".into(),
                correct: right,
                figures: Figures {
                    calls: 1,
                    usage: Usage { input_tokens: 10, output_tokens: 5, ..Usage::default() },
                    ..Figures::default()
                },
                latency_ms: 20,
                ..EvalResult::default()
            };
            store.put_eval_result("learned", &result).await.expect("put");
        }
    }

    let mut learned = pool.clone();
    baton_runner::learned::learned_into(&mut learned, &store).await;
    let measured = &learned.learned;
    assert_eq!(measured.best, Some(1), "second was right on all 8, first on none");
    assert_eq!(learned.options.fallback.worker, None, "what was learned is not the pool file's choice");
    assert_eq!(measured.by_category.best["geography"], 1);
    assert!(measured.by_category.clear["geography"].contains("8 of 8"), "{:?}", measured.by_category.clear);

    let mut chosen = self::pool(&server, "[conductor]\nfallback_worker = \"first\"\n");
    baton_runner::learned::learned_into(&mut chosen, &store).await;
    assert_eq!(chosen.options.fallback.worker, Some(0), "the user's choice stands");
    let fallback = &chosen.options.fallback;
    let question = "What is the capital of Peru? (geography)";
    assert_eq!(baton_engine::routing::route(fallback, &chosen.learned, 2, question), None, "and nothing routes");
    assert_eq!(baton_engine::fallback::fallback_worker(fallback, &chosen.learned, 2, question), (0, None));
    assert!(chosen.learned.strengths[&1].contains("8 of 8"), "the conductor is still told what was measured");
}

#[test]
fn the_servers_settings_are_the_front_ends_then_the_pool_files_then_the_defaults() {
    use baton_runner::serve::{ServeRequest, options};
    let spec = baton_engine::ServeSpec {
        host: Some("127.0.0.2".into()),
        port: Some(9000),
        max_queued_runs: Some(3),
        allow_origins: vec!["http://a.test".into()],
        ..Default::default()
    };
    let request =
        ServeRequest { port: Some(9100), allow_origins: vec!["http://b.test".into()], ..ServeRequest::default() };
    let chosen = options(&spec, &request);
    let defaults = baton_serve::ServeOptions::default();
    assert_eq!((chosen.host.as_str(), chosen.port, chosen.max_queued_runs), ("127.0.0.2", 9100, 3));
    assert_eq!(chosen.max_concurrent_runs, defaults.max_concurrent_runs);
    assert_eq!(chosen.allow_origins, ["http://b.test", "http://a.test"]);
    let plain = options(&Default::default(), &ServeRequest::default());
    assert_eq!((plain.host.as_str(), plain.port), ("127.0.0.1", baton_serve::DEFAULT_PORT));
}

#[tokio::test]
async fn an_evaluation_refuses_what_it_cannot_run_before_a_call_is_made() {
    use baton_runner::evaluate::{EvalRequest, evaluate};
    let server = TestServer::start().await.expect("server");
    let (_dir, store) = store().await;
    let (models, choice) = (LocalModels::default(), ConductorChoice::default());
    let context = Context { models: &models, choice: &choice, notify: &|_| {} };
    let cancel = CancellationToken::new();
    let singles = EvalRequest { strategies: "all-singles".into(), limit: Some(2), ..EvalRequest::new("mmlu") };
    let cases = [
        (EvalRequest { repeats: 0, ..singles.clone() }, "at least 1"),
        (EvalRequest { concurrency: 0, ..singles.clone() }, "at least 1"),
        (EvalRequest { max_cost_usd: Some(f64::NAN), ..singles.clone() }, "spending cap must be a number above 0"),
        (EvalRequest { max_cost_usd: Some(0.0), ..singles.clone() }, "above 0"),
        (EvalRequest { max_cost_usd: Some(f64::INFINITY), ..singles.clone() }, "at most 1000000"),
        (EvalRequest { strategies: "single:nobody".into(), ..singles.clone() }, "nobody"),
        (EvalRequest { suite: "no-such-suite.jsonl".into(), ..singles.clone() }, "no-such-suite"),
    ];
    for (request, says) in cases {
        let refused = evaluate(pool(&server, ""), &store, &request, context, &|_| {}, &cancel).await;
        assert!(matches!(&refused, Err(RunnerError::BadInput(m)) if m.contains(says)), "{request:?}: {refused:?}");
    }
    assert!(server.requests().is_empty(), "nothing refused made a call");
    assert!(store.evaluations().await.expect("reads").is_empty(), "nor was kept");
}

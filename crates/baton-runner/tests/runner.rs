//! The runner over real parts: a pool of loopback workers speaking OpenAI's wire format, a real
//! SQLite history, the real executor.

use baton_engine::{Pool, RunEvent, RunRequest, RunStatus, new_run_id};
use baton_runner::rerun::Earlier;
use baton_runner::{Conductor, ConductorChoice, LocalModels, RunnerError, Setup, SetupError};
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

fn request(question: &str, history: Vec<baton_providers::Message>) -> RunRequest {
    let plan = baton_plan::parse(PLAN, &baton_plan::Limits::default()).expect("plan parses");
    RunRequest { run_id: new_run_id(), question: question.into(), plan: Some(plan), history, ..RunRequest::default() }
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
async fn a_run_is_recorded_before_each_event_is_shown_and_a_follow_up_sees_the_conversation() {
    let server = TestServer::start().await.expect("server");
    let (_dir, store) = store().await;
    let (models, choice) = (LocalModels::default(), ConductorChoice::default());
    let built =
        baton_runner::build(pool(&server, ""), setup(&models, &choice, Conductor::None, &store)).await.expect("builds");
    let cancel = CancellationToken::new();

    let shown = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let into = shown.clone();
    let recorded = baton_runner::run_recorded(
        &built.executor,
        request("What colour is the sky?", Vec::new()),
        Some(store.recorder(None)),
        move |event: RunEvent| into.lock().unwrap().push(event),
        |e| panic!("the history failed: {e}"),
        &cancel,
    )
    .await;
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
    let follow_up = baton_runner::run_recorded(
        &built.executor,
        request("And at night?", turns),
        Some(store.recorder(Some(conversation))),
        |_| {},
        |e| panic!("the history failed: {e}"),
        &cancel,
    )
    .await;
    assert_eq!(follow_up.conversation_id, Some(conversation));
    assert_eq!(baton_runner::conversation_so_far(&store, Some(conversation)).await.expect("turns").len(), 4);

    // A conversation the history does not have is refused before anything runs.
    let missing = baton_runner::conversation_so_far(&store, Some(conversation + 100)).await;
    assert!(matches!(missing, Err(RunnerError::NotFound(_))), "{missing:?}");
}

#[tokio::test]
async fn a_rerun_runs_the_step_and_those_that_see_it_again_in_the_same_conversation() {
    let server = TestServer::start().await.expect("server");
    let (_dir, store) = store().await;
    let (models, choice) = (LocalModels::default(), ConductorChoice::default());
    let pool = pool(&server, "");
    let built =
        baton_runner::build(pool.clone(), setup(&models, &choice, Conductor::None, &store)).await.expect("builds");
    let cancel = CancellationToken::new();
    let first = baton_runner::run_recorded(
        &built.executor,
        request("What colour is the sky?", Vec::new()),
        Some(store.recorder(None)),
        |_| {},
        |e| panic!("the history failed: {e}"),
        &cancel,
    )
    .await;
    let run = first.run_id.expect("recorded");

    // Step 1 again with the first worker: step 0 keeps its output.
    let earlier = Earlier::load(&store, run).await.expect("loads");
    let rerun = earlier.rerun(&store, &pool, 1, "first").await.expect("prepares");
    assert_eq!(Some(rerun.conversation), first.conversation_id);
    assert!(!rerun.needs_conductor);
    let requests_before = server.requests().len();
    let again = baton_runner::run_recorded(
        &built.executor,
        rerun.request,
        Some(store.recorder(Some(rerun.conversation))),
        |_| {},
        |e| panic!("the history failed: {e}"),
        &cancel,
    )
    .await;
    assert_eq!(again.outcome.status, RunStatus::Finished, "{:?}", again.outcome.error);
    assert_eq!(server.requests().len() - requests_before, 1, "only the re-run step calls a worker");
    assert_eq!(again.conversation_id, first.conversation_id);

    let unknown = earlier.rerun(&store, &pool, 1, "nobody").await;
    assert!(matches!(unknown, Err(RunnerError::NotFound(_))), "{unknown:?}");
    let no_run = Earlier::load(&store, run + 100).await;
    assert!(matches!(no_run, Err(RunnerError::NotFound(_))), "{no_run:?}");
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
    let identities = baton_runner::build::identities(&pool);
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
    baton_runner::build::learned_into(&mut learned, &store).await;
    let fallback = &learned.options.fallback;
    assert_eq!(fallback.worker, Some(1), "second was right on all 8, first on none");
    assert_eq!(fallback.measured.by_category.best["geography"], 1);
    assert!(
        fallback.measured.by_category.clear["geography"].contains("8 of 8"),
        "{:?}",
        fallback.measured.by_category.clear
    );

    let mut chosen = self::pool(&server, "[conductor]\nfallback_worker = \"first\"\n");
    baton_runner::build::learned_into(&mut chosen, &store).await;
    assert_eq!(chosen.options.fallback.worker, Some(0), "the user's choice stands");
    let fallback = &chosen.options.fallback;
    let question = "What is the capital of Peru? (geography)";
    assert_eq!(baton_engine::fallback::route(fallback, 2, question), None, "and nothing routes");
    assert_eq!(baton_engine::fallback::fallback_worker(fallback, 2, question), (0, None));
    assert!(fallback.measured.strengths[&1].contains("8 of 8"), "the conductor is still told what was measured");
}

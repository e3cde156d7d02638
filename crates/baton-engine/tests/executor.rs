//! The executor over real HTTP against loopback provider servers: DAG concurrency, the
//! conversation each worker receives, retries, partial failure, caps and cancellation.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_engine::rerun::{self, Source};
use baton_engine::{
    Executor, Pool, RerunOf, Reuse, RunErrorKind, RunEvent, RunOutcome, RunRequest, RunStatus, StepErrorKind,
};
use baton_plan::Limits;
use baton_providers::{ApiKey, Role};
use baton_testserver::{TestServer, Wire};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// A pool whose workers all talk to `server`, one per `(name, provider, model)`.
fn pool(server: &TestServer, extra: &str, workers: &[(&str, &str, &str)]) -> Pool {
    let mut text = format!("{extra}\n[retry]\ninitial_delay_ms = 10\nmax_delay_ms = 50\n");
    for (name, provider, model) in workers {
        let wire = match *provider {
            "anthropic" => Wire::Anthropic,
            "gemini" => Wire::Gemini,
            _ => Wire::OpenAi,
        };
        text.push_str(&format!(
            "\n[[worker]]\nname = \"{name}\"\nprovider = \"{provider}\"\nmodel = \"{model}\"\nbase_url = \"{}\"\n",
            server.base_url(wire)
        ));
        if *provider != "openai-compatible" {
            text.push_str("api_key_env = \"BATON_TEST_KEY\"\n");
        }
    }
    Pool::parse(&text, "test-pool.toml").expect("valid pool")
}

/// An executor whose workers all present the key the test server expects.
fn executor(pool: &Pool) -> Executor {
    Executor::from_pool_with_keys(pool, |_| Arc::new(|| Ok(Some(ApiKey::new("test-key")))))
}

async fn run(
    executor: &Executor,
    plan: &str,
    cancel: Option<(CancellationToken, Duration)>,
) -> (RunOutcome, Vec<RunEvent>) {
    let plan = baton_plan::parse(plan, &Limits::default()).expect("plan parses");
    let request = RunRequest {
        run_id: "test".into(),
        question: "What is 2+2?".into(),
        plan: Some(plan),
        ..RunRequest::default()
    };
    run_request(executor, request, cancel).await
}

async fn run_request(
    executor: &Executor,
    request: RunRequest,
    cancel: Option<(CancellationToken, Duration)>,
) -> (RunOutcome, Vec<RunEvent>) {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let token = CancellationToken::new();
    if let Some((t, after)) = &cancel {
        let t = t.clone();
        let after = *after;
        let token = token.clone();
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            t.cancel();
            token.cancel();
        });
    }
    let outcome = executor.run(request, &tx, &token).await;
    drop(tx);
    let mut events = Vec::new();
    while let Some(e) = rx.recv().await {
        events.push(e);
    }
    check_event_order(&events);
    (outcome, events)
}

fn check_event_order(events: &[RunEvent]) {
    if let Err(e) = baton_engine::event::check_sequence(events) {
        panic!("{e}\n{events:#?}");
    }
}

fn compat(name: &'static str, model: &'static str) -> (&'static str, &'static str, &'static str) {
    (name, "openai-compatible", model)
}

#[tokio::test]
async fn independent_steps_run_at_the_same_time() {
    let server = TestServer::start().await.expect("server");
    let p = pool(
        &server,
        "",
        &[
            compat("a", "a;latency=300"),
            compat("b", "b;latency=300"),
            compat("c", "c;latency=300"),
            compat("judge", "judge;latency=300"),
        ],
    );
    let executor = executor(&p);
    let started = Instant::now();
    let (outcome, _) = run(
        &executor,
        "model_id = [0, 1, 2, 3]\nsubtasks = ['try A', 'try B', 'try C', 'judge']\naccess_list = [[], [], [], [0, 1, 2]]",
        None,
    )
    .await;
    let wall = started.elapsed();
    assert_eq!(outcome.status, RunStatus::Finished, "{outcome:?}");
    assert!(wall >= Duration::from_millis(590), "two 300 ms layers take at least 600 ms: {wall:?}");
    assert!(wall < Duration::from_millis(1000), "three 300 ms steps in parallel then one: ~600 ms, not 1200: {wall:?}");
    let reqs = server.requests();
    let first_three: Vec<u64> = reqs[..3].iter().map(|r| r.at_ms).collect();
    let spread = first_three.iter().max().unwrap_or(&0) - first_three.iter().min().unwrap_or(&0);
    assert!(spread < 100, "the three attempts start together: {first_three:?}");
    assert!(reqs[3].at_ms >= first_three[0] + 290, "the judge waits for all three");
}

#[tokio::test]
async fn the_concurrency_limit_per_provider_holds() {
    let server = TestServer::start().await.expect("server");
    let p = pool(
        &server,
        "max_concurrency_per_provider = 1",
        &[compat("a", "a;latency=200"), compat("b", "b;latency=200"), compat("c", "c;latency=200")],
    );
    let started = Instant::now();
    let (outcome, _) =
        run(&executor(&p), "model_id = [0, 1, 2]\nsubtasks = ['x', 'y', 'z']\naccess_list = [[], [], []]", None).await;
    assert_eq!(outcome.status, RunStatus::Finished);
    assert!(started.elapsed() >= Duration::from_millis(590), "one at a time: {:?}", started.elapsed());
}

#[tokio::test]
async fn workers_see_exactly_their_access_list_as_a_conversation() {
    let server = TestServer::start().await.expect("server");
    // The paper's setting: a worker sees its subtask and the steps it may see, nothing else.
    let p = pool(
        &server,
        "show_question = false\nquestion_to_answer_step = false",
        &[
            compat("solver", "solver;reply=x_=_4"),
            compat("checker", "checker;reply=looks_right"),
            compat("writer", "writer"),
        ],
    );
    let (outcome, events) = run(
        &executor(&p),
        "model_id = [0, 1, 2]\nsubtasks = ['Solve it.', 'Check it.', 'Write the answer.']\naccess_list = [[], 'all', [0]]",
        None,
    )
    .await;
    assert_eq!(outcome.status, RunStatus::Finished);
    assert_eq!(outcome.answer.as_deref(), Some("writer (saw 1 earlier answers) answers: Write the answer."));

    let reqs = server.requests();
    let by_model = |m: &str| reqs.iter().find(|r| r.model.starts_with(m)).expect("request").body["messages"].clone();
    let checker = by_model("checker");
    assert_eq!(
        checker,
        serde_json::json!([
            {"role": "user", "content": "Solve it."},
            {"role": "assistant", "content": "x = 4"},
            {"role": "user", "content": "Check it."},
        ])
    );
    let writer = by_model("writer");
    assert_eq!(writer.as_array().map(Vec::len), Some(3), "step 2 sees step 0 only: {writer}");
    assert_eq!(writer[1]["content"], "x = 4");

    // The StepStarted event carries those same messages.
    let started = events
        .iter()
        .find_map(|e| match e {
            RunEvent::StepStarted { step: 1, messages, .. } => Some(messages.clone()),
            _ => None,
        })
        .expect("step 1 started");
    assert_eq!(started.len(), 3);
    assert_eq!(started[1].role, Role::Assistant);
}

#[tokio::test]
async fn the_question_is_shown_only_when_the_pool_asks() {
    let server = TestServer::start().await.expect("server");
    let p = pool(&server, "show_question = true", &[compat("a", "a")]);
    run(&executor(&p), "model_id = [0]\nsubtasks = ['go']\naccess_list = [[]]", None).await;
    let body = &server.requests()[0].body;
    assert_eq!(body["messages"][0]["role"], "system");
    assert!(body["messages"][0]["content"].as_str().unwrap_or_default().contains("What is 2+2?"));
}

#[tokio::test]
async fn the_step_that_replies_is_asked_the_question_with_its_subtask_as_its_part() {
    let server = TestServer::start().await.expect("server");
    let last_user = |body: &serde_json::Value| {
        let messages = body["messages"].as_array().expect("messages").clone();
        messages.iter().rev().find(|m| m["role"] == "user").expect("a user message")["content"].clone()
    };
    let system = |body: &serde_json::Value| body["messages"][0]["content"].as_str().unwrap_or_default().to_owned();
    let two_steps = "model_id = [0, 0]\nsubtasks = ['Solve it.', 'Name the letter.']\naccess_list = [[], [0]]";

    let p = pool(&server, "show_question = false", &[compat("a", "a")]);
    let (outcome, events) = run(&executor(&p), two_steps, None).await;
    assert_eq!(outcome.status, RunStatus::Finished, "{outcome:?}");
    let reqs = server.requests();
    assert_eq!(last_user(&reqs[0].body), "Solve it.", "an earlier step gets its subtask");
    assert_eq!(reqs[0].body["messages"][0]["role"], "user", "and no system message");
    assert_eq!(last_user(&reqs[1].body), "What is 2+2?", "the step that replies is asked the question");
    assert_eq!(system(&reqs[1].body), "Your part in this workflow: Name the letter.");
    assert_eq!(
        reqs[1].body["messages"][2]["content"], "a (saw 0 earlier answers) answers: Solve it.",
        "after the work it sees"
    );
    let recorded = events
        .iter()
        .find_map(|e| match e {
            RunEvent::StepStarted { step: 1, system, messages, .. } => Some((system.clone(), messages.clone())),
            _ => None,
        })
        .expect("step 1 started");
    assert_eq!(recorded.0.as_deref(), Some("Your part in this workflow: Name the letter."), "the history records it");
    assert_eq!(recorded.1.last().map(|m| m.content.as_str()), Some("What is 2+2?"));

    // With the question shown to every worker, the part follows it.
    let shown = pool(&server, "show_question = true", &[compat("a", "a")]);
    let before = server.requests().len();
    run(&executor(&shown), two_steps, None).await;
    let reply = system(&server.requests()[before + 1].body);
    assert!(
        reply.contains("What is 2+2?") && reply.ends_with("\n\nYour part in this workflow: Name the letter."),
        "{reply}"
    );

    // A subtask that already holds the question is sent as written.
    let before = server.requests().len();
    run(&executor(&p), "model_id = [0]\nsubtasks = ['What is 2+2?']\naccess_list = [[]]", None).await;
    assert_eq!(last_user(&server.requests()[before].body), "What is 2+2?");
    assert_eq!(server.requests()[before].body["messages"][0]["role"], "user");

    // Off: the paper's setting, subtasks only.
    let p = pool(&server, "show_question = false\nquestion_to_answer_step = false", &[compat("a", "a")]);
    let before = server.requests().len();
    run(&executor(&p), two_steps, None).await;
    assert_eq!(last_user(&server.requests()[before + 1].body), "Name the letter.");
}

#[tokio::test]
async fn retries_rate_limits_and_server_errors_but_not_auth() {
    let server = TestServer::start().await.expect("server");
    let p = pool(
        &server,
        "",
        &[
            compat("limited", "limited;fail=429x2;retry_after=0"),
            compat("flaky", "flaky;fail=500x1"),
            compat("cut", "cut;cut=1"),
            compat("denied", "denied;fail=401"),
        ],
    );
    let (outcome, events) = run(
        &executor(&p),
        "model_id = [0, 1, 2, 3]\nsubtasks = ['a', 'b', 'c', 'd']\naccess_list = [[], [], [], []]",
        None,
    )
    .await;
    assert_eq!(outcome.status, RunStatus::Failed, "the last step fails on auth");
    let retries: Vec<(usize, u32)> = events
        .iter()
        .filter_map(|e| match e {
            RunEvent::StepFinished { step, retries, .. } => Some((*step, *retries)),
            _ => None,
        })
        .collect();
    assert!(retries.contains(&(0, 2)), "{retries:?}");
    assert!(retries.contains(&(1, 1)), "{retries:?}");
    assert!(retries.contains(&(2, 1)), "a cut stream is retried: {retries:?}");
    let denied = server.requests().iter().filter(|r| r.model.starts_with("denied")).count();
    assert_eq!(denied, 1, "auth errors are never retried");
    let failed = events.iter().find_map(|e| match e {
        RunEvent::StepFailed { step: 3, error, .. } => Some(error.clone()),
        _ => None,
    });
    assert_eq!(failed.map(|e| (e.kind, e.status)), Some((StepErrorKind::Auth, Some(401))));
    assert_eq!(outcome.totals.calls, 3 + 2 + 2 + 1);
}

#[tokio::test]
async fn retry_after_is_honoured() {
    let server = TestServer::start().await.expect("server");
    let p = pool(&server, "", &[compat("limited", "limited;fail=429x1;retry_after=1")]);
    let started = Instant::now();
    let (outcome, events) = run(&executor(&p), "model_id = [0]\nsubtasks = ['a']\naccess_list = [[]]", None).await;
    assert_eq!(outcome.status, RunStatus::Finished);
    assert!(started.elapsed() >= Duration::from_secs(1));
    let delay = events.iter().find_map(|e| match e {
        RunEvent::StepRetrying { delay_ms, error, .. } => Some((*delay_ms, error.kind)),
        _ => None,
    });
    assert_eq!(delay, Some((1000, StepErrorKind::RateLimited)));
}

#[tokio::test]
async fn a_slow_first_byte_times_out_and_is_retried() {
    let server = TestServer::start().await.expect("server");
    // The slow attempt is far slower than any busy machine: waiting for it is told apart from
    // giving up on it at the timeout.
    let mut p = pool(&server, "", &[compat("slow", "slow;slow=30000x1")]);
    p.workers[0].timeout = Duration::from_millis(300);
    let started = Instant::now();
    let (outcome, events) = run(&executor(&p), "model_id = [0]\nsubtasks = ['a']\naccess_list = [[]]", None).await;
    assert_eq!(outcome.status, RunStatus::Finished, "{outcome:?}");
    assert!(started.elapsed() < Duration::from_secs(15), "gave up on the slow attempt: {:?}", started.elapsed());
    assert!(
        events
            .iter()
            .any(|e| matches!(e, RunEvent::StepRetrying { error, .. } if error.kind == StepErrorKind::Timeout))
    );
}

/// A call cut before its first byte (a server that accepts the request and never answers)
/// counts the request's input bound, marked estimated, and is priced: the provider read the
/// prompt and may bill it, and a retried attempt would otherwise escape every cap. A
/// connection never made, and an error answer, count nothing of the prompt.
#[tokio::test]
async fn a_call_cut_before_its_first_byte_counts_its_input_and_one_never_made_does_not() {
    let server = TestServer::start().await.expect("server");
    let mut p =
        pool(&server, "", &[compat("silent", "silent;slow=30000x9"), compat("refusing", "refusing;fail=500x9")]);
    p.options.retry.max_retries = 1;
    for w in &mut p.workers {
        (w.price_in, w.price_out) = (Some(1.0), Some(2.0));
    }
    p.workers[0].timeout = Duration::from_millis(300);
    let (outcome, _) = run(&executor(&p), "model_id = [0]\nsubtasks = ['a']\naccess_list = [[]]", None).await;
    assert_eq!(outcome.status, RunStatus::Failed);
    let t = &outcome.totals;
    assert_eq!(t.calls, 2, "both attempts count");
    assert!(t.usage.input_tokens > 0 && t.usage.estimated, "{t:?}");
    assert_eq!(t.usage.output_tokens, 0, "{t:?}");
    assert!(t.cost_usd > 0.0 && t.cost_complete, "priced: {t:?}");
    let one = t.usage.input_tokens / 2;

    // An error answer (500) is not billed: its attempts count as calls and nothing more.
    let (outcome, _) = run(&executor(&p), "model_id = [1]\nsubtasks = ['a']\naccess_list = [[]]", None).await;
    assert_eq!((outcome.status, outcome.totals.calls, outcome.totals.usage.input_tokens), (RunStatus::Failed, 2, 0));

    // No server at all: the request never went out.
    p.workers[0].base_url = Some("http://127.0.0.1:9/v1".into());
    let (outcome, _) = run(&executor(&p), "model_id = [0]\nsubtasks = ['a']\naccess_list = [[]]", None).await;
    assert_eq!(outcome.status, RunStatus::Failed);
    assert_eq!(outcome.totals.usage.input_tokens, 0, "{:?}", outcome.totals);
    assert!(one > 0);
}

#[tokio::test]
async fn a_failed_step_fails_its_dependents_and_only_them() {
    let server = TestServer::start().await.expect("server");
    let p = pool(&server, "", &[compat("ok", "ok"), compat("bad", "bad;fail=400")]);
    let (outcome, events) = run(
        &executor(&p),
        "model_id = [0, 1, 0, 0]\nsubtasks = ['a', 'b', 'c', 'd']\naccess_list = [[], [], [1], [0]]",
        None,
    )
    .await;
    assert_eq!(outcome.status, RunStatus::Finished, "the last step only needs step 0");
    assert_eq!(outcome.totals.steps_failed, vec![1, 2]);
    assert_eq!(outcome.totals.steps_finished, vec![0, 3]);
    let kinds: Vec<(usize, StepErrorKind)> = events
        .iter()
        .filter_map(|e| match e {
            RunEvent::StepFailed { step, error, .. } => Some((*step, error.kind)),
            _ => None,
        })
        .collect();
    assert_eq!(kinds, vec![(1, StepErrorKind::ContextTooLong), (2, StepErrorKind::DependencyFailed)]);

    let (outcome, _) =
        run(&executor(&p), "model_id = [0, 1, 0]\nsubtasks = ['a', 'b', 'c']\naccess_list = [[], [], 'all']", None)
            .await;
    assert_eq!(outcome.status, RunStatus::Failed);
    let error = outcome.error.expect("error");
    assert_eq!(error.kind, RunErrorKind::StepFailed);
    assert!(error.message.contains("step 2"), "{}", error.message);
}

#[tokio::test]
async fn cancelling_mid_stream_stops_at_once_and_closes_the_call() {
    let server = TestServer::start().await.expect("server");
    // A ten-second stream: stopping at once is told apart from running it out on a busy machine.
    let p = pool(&server, "", &[compat("slow", "slow;latency=10000;chunks=20"), compat("fast", "fast")]);
    let token = CancellationToken::new();
    let started = Instant::now();
    let (outcome, events) = run(
        &executor(&p),
        "model_id = [1, 0, 1]\nsubtasks = ['a', 'b', 'c']\naccess_list = [[], [0], 'all']",
        Some((token, Duration::from_millis(800))),
    )
    .await;
    assert_eq!(outcome.status, RunStatus::Cancelled);
    assert!(started.elapsed() < Duration::from_secs(8), "{:?}", started.elapsed());
    assert!(events.iter().any(|e| matches!(e, RunEvent::StepDelta { step: 1, .. })), "step 1 was streaming");
    assert!(
        events.iter().any(
            |e| matches!(e, RunEvent::StepFailed { step: 1, error, .. } if error.kind == StepErrorKind::Cancelled)
        )
    );
    assert!(matches!(events.last(), Some(RunEvent::RunCancelled { .. })));
    assert!(!events.iter().any(|e| matches!(e, RunEvent::StepStarted { step: 2, .. })));
    // The server notices the closed connection at its next piece (every 500 ms).
    let deadline = Instant::now() + Duration::from_secs(2);
    while server.hangups() == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(server.hangups(), 1, "the cancelled call's connection was closed");
}

#[tokio::test]
async fn budget_caps_end_the_run_and_keep_what_finished() {
    let server = TestServer::start().await.expect("server");
    let chain = "model_id = [0, 0, 0]\nsubtasks = ['a', 'b', 'c']\naccess_list = [[], [0], [1]]";

    // Without the question in a system message, a step's worst case is its subtask's framing.
    let p = pool(&server, "show_question = false\n[budget]\nmax_calls = 2", &[compat("w", "w")]);
    let (outcome, events) = run(&executor(&p), chain, None).await;
    assert_eq!(outcome.status, RunStatus::Failed);
    let error = outcome.error.expect("error");
    assert_eq!(error.kind, RunErrorKind::BudgetExceeded);
    assert!(error.message.contains("2 of at most 2 calls"), "{}", error.message);
    assert_eq!(outcome.totals.steps_finished, vec![0, 1], "finished steps are kept");
    assert_eq!(events.iter().filter(|e| matches!(e, RunEvent::StepFinished { .. })).count(), 2);

    // A call reserves its worst case: step 0 (at most 1 byte + 2 × 16 framing in, 20 out = 53
    // tokens) fits under 80; step 1 sees step 0's answer and cannot fit beside what step 0 used.
    let mut p = pool(&server, "show_question = false\n[budget]\nmax_tokens = 80", &[compat("w", "w")]);
    p.workers[0].max_tokens = 20;
    let (outcome, _) = run(&executor(&p), chain, None).await;
    let error = outcome.error.expect("error");
    assert_eq!(error.kind, RunErrorKind::BudgetExceeded);
    assert!(error.message.contains("of at most 80 tokens"), "{}", error.message);
    assert_eq!(outcome.totals.steps_finished, vec![0]);
    assert!(outcome.totals.usage.total() <= 80);

    // The same in dollars: $0.001 a token, at most $0.053 for step 0, under a cap of $0.08.
    let mut p = pool(&server, "show_question = false\n[budget]\nmax_cost_usd = 0.08", &[compat("w", "w")]);
    p.workers[0].max_tokens = 20;
    p.workers[0].price_in = Some(1000.0);
    p.workers[0].price_out = Some(1000.0);
    let (outcome, _) = run(&executor(&p), chain, None).await;
    assert_eq!(outcome.error.map(|e| e.kind), Some(RunErrorKind::BudgetExceeded));
    assert_eq!(outcome.totals.steps_finished, vec![0]);
    assert!(outcome.totals.cost_usd > 0.0 && outcome.totals.cost_usd <= 0.08 && outcome.totals.cost_complete);

    // A call whose worst case alone passes the cap is never made.
    let p = pool(&server, "[budget]\nmax_tokens = 5", &[compat("w", "w")]);
    let before = server.requests().len();
    let (outcome, _) = run(&executor(&p), chain, None).await;
    assert_eq!(outcome.error.map(|e| e.kind), Some(RunErrorKind::BudgetExceeded));
    assert_eq!((outcome.totals.calls, server.requests().len()), (0, before), "no call made");
}

#[tokio::test]
async fn an_empty_answer_fails_its_step_with_the_reason() {
    let server = TestServer::start().await.expect("server");
    let p = pool(&server, "", &[compat("mute", "mute;reply="), compat("w", "w")]);
    let (outcome, events) =
        run(&executor(&p), "model_id = [0, 1]\nsubtasks = ['a', 'b']\naccess_list = [[], [0]]", None).await;
    assert_eq!(outcome.status, RunStatus::Failed);
    let error = events
        .iter()
        .find_map(|e| match e {
            RunEvent::StepFailed { step: 0, error, .. } => Some(error.clone()),
            _ => None,
        })
        .expect("step 0 failed");
    assert_eq!(error.kind, StepErrorKind::EmptyAnswer);
    assert!(error.message.contains("stop reason: stop"), "{}", error.message);
    assert_eq!(server.requests().len(), 1, "not retried, and the dependent step never ran");
}

#[tokio::test]
async fn a_plan_that_does_not_fit_the_pool_is_refused() {
    let server = TestServer::start().await.expect("server");
    let p = pool(&server, "", &[compat("w", "w")]);
    let (outcome, events) = run(&executor(&p), "model_id = [3]\nsubtasks = ['a']\naccess_list = [[]]", None).await;
    assert_eq!(outcome.error.as_ref().map(|e| e.kind), Some(RunErrorKind::InvalidPlan));
    assert!(outcome.error.map(|e| e.message).unwrap_or_default().contains("model 3 is not in the pool"));
    assert_eq!(events.len(), 2, "RunStarted and RunFailed only");
    assert!(server.requests().is_empty());
}

#[tokio::test]
async fn every_wire_format_works_in_one_run() {
    let server = TestServer::start().await.expect("server");
    let p = pool(
        &server,
        "",
        &[("o", "openai", "gpt-5"), ("a", "anthropic", "claude-sonnet-4-5"), ("g", "gemini", "gemini-2.5-pro")],
    );
    let (outcome, _) =
        run(&executor(&p), "model_id = [0, 1, 2]\nsubtasks = ['a', 'b', 'c']\naccess_list = [[], [0], 'all']", None)
            .await;
    assert_eq!(outcome.status, RunStatus::Finished, "{outcome:?}");
    assert!(outcome.totals.cost_complete, "all three models are in the price table");
    assert!(outcome.totals.cost_usd > 0.0);
    let reqs = server.requests();
    assert_eq!(reqs.len(), 3);
    assert_eq!(reqs[0].headers["authorization"], "Bearer test-key");
    assert_eq!(reqs[1].headers["x-api-key"], "test-key");
    assert_eq!(reqs[2].headers["x-goog-api-key"], "test-key");
}

/// The outputs of round 0's finished steps, as the history keeps them.
fn outputs(events: &[RunEvent]) -> BTreeMap<usize, String> {
    events
        .iter()
        .filter_map(|e| match e {
            RunEvent::StepFinished { round: 0, step, output, .. } => Some((*step, output.clone())),
            RunEvent::StepReused { round: 0, step, output, .. } => Some((*step, output.clone())),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_rerun_calls_only_the_changed_step_and_the_steps_that_see_it() {
    let server = TestServer::start().await.expect("server");
    let p = pool(
        &server,
        "",
        &[
            compat("solver", "solver;reply=x_=_4"),
            compat("checker", "checker;reply=looks_right"),
            compat("writer", "writer"),
            compat("critic", "critic;reply=x_=_5?"),
        ],
    );
    let text = "model_id = [0, 1, 2, 1]\nsubtasks = ['Solve.', 'Check.', 'Write.', 'Recheck.']\naccess_list = [[], [0], [1], [0]]";
    let (first, events) = run(&executor(&p), text, None).await;
    assert_eq!(first.status, RunStatus::Finished);
    let before = server.requests().len();
    assert_eq!(before, 4);

    // Step 1 again with the critic: step 2 sees it and runs again; steps 0 and 3 do not.
    let plan = baton_plan::parse(text, &Limits::default()).expect("plan");
    let workers = p.infos();
    let outs = outputs(&events);
    let source = Source { run_id: "first", plan: &plan, workers: &workers, outputs: &outs };
    let again = rerun::prepare(source, &p, 1, "critic").expect("prepare");
    assert_eq!(again.reuse.outputs.keys().copied().collect::<Vec<_>>(), [0, 3]);
    let request = RunRequest {
        run_id: "second".into(),
        question: "What is 2+2?".into(),
        plan: Some(again.plan),
        reuse: Some(again.reuse),
        ..RunRequest::default()
    };
    let (second, events) = run_request(&executor(&again.pool), request, None).await;
    assert_eq!(second.status, RunStatus::Finished, "{second:?}");

    let calls = &server.requests()[before..];
    let models: Vec<&str> = calls.iter().map(|r| r.model.split(';').next().unwrap_or("")).collect();
    assert_eq!(models, ["critic", "writer"], "only the changed step and its dependent are called");
    // The writer sees the critic's new answer, not the checker's old one.
    let seen: Vec<&serde_json::Value> =
        calls[1].body["messages"].as_array().expect("messages").iter().filter(|m| m["role"] == "assistant").collect();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0]["content"], "x = 5?");
    assert_eq!(second.totals.calls, 2);
    assert_eq!(second.totals.steps_finished, [0, 1, 2, 3]);

    assert!(matches!(
        &events[0],
        RunEvent::RunStarted { rerun_of: Some(RerunOf { run_id, step: 1 }), .. } if run_id == "first"
    ));
    let reused: Vec<(usize, &str)> = events
        .iter()
        .filter_map(|e| match e {
            RunEvent::StepReused { step, output, from_run, .. } => {
                assert_eq!(from_run, "first");
                Some((*step, output.as_str()))
            }
            _ => None,
        })
        .collect();
    assert_eq!(reused, [(0, "x = 4"), (3, "looks right")]);
}

#[tokio::test]
async fn a_reuse_that_would_keep_a_stale_output_is_refused() {
    let server = TestServer::start().await.expect("server");
    let p = pool(&server, "", &[compat("a", "a"), compat("b", "b")]);
    let plan =
        baton_plan::parse("model_id = [0, 1]\nsubtasks = ['x', 'y']\naccess_list = [[], [0]]", &Limits::default())
            .expect("plan");
    // Step 1 saw step 0's old output; keeping it while step 0 runs again would be wrong.
    let reuse = Reuse { from_run: "old".into(), step: 0, outputs: BTreeMap::from([(1, "old y".to_owned())]) };
    let request = RunRequest { plan: Some(plan), reuse: Some(reuse.clone()), ..RunRequest::default() };
    let (outcome, _) = run_request(&executor(&p), request, None).await;
    assert_eq!(outcome.status, RunStatus::Failed);
    let error = outcome.error.expect("error");
    assert_eq!(error.kind, RunErrorKind::InvalidPlan);
    assert!(error.message.contains("keeps step 1 but runs step 0"), "{}", error.message);

    let request = RunRequest { plan: None, reuse: Some(reuse), ..RunRequest::default() };
    let (outcome, _) = run_request(&executor(&p), request, None).await;
    assert!(outcome.error.expect("error").message.contains("needs the plan"));
    assert!(server.requests().is_empty(), "nothing was called");
}

#[tokio::test]
async fn a_rerun_keeps_a_conductor_step_without_a_conductor() {
    let server = TestServer::start().await.expect("server");
    // No planner and no recursion now; step 1 was the conductor's (number 2) in the first run.
    let p = pool(&server, "", &[compat("a", "a"), compat("b", "b;reply=again")]);
    let plan = baton_plan::parse(
        "model_id = [0, 2, 1]\nsubtasks = ['x', 'think more', 'finish']\naccess_list = [[], [0], [1]]",
        &Limits::default(),
    )
    .expect("plan");
    let outputs = BTreeMap::from([(0, "x done".to_owned()), (1, "thought".to_owned())]);
    let reuse = Reuse { from_run: "old".into(), step: 2, outputs };
    let request = RunRequest { plan: Some(plan), reuse: Some(reuse), ..RunRequest::default() };
    let (outcome, _) = run_request(&executor(&p), request, None).await;
    assert_eq!(outcome.status, RunStatus::Finished, "{outcome:?}");
    assert_eq!(outcome.answer.as_deref(), Some("again"));
    let calls: Vec<String> = server.requests().iter().map(|r| r.model.clone()).collect();
    assert_eq!(calls, ["b;reply=again"]);
}

/// Bytes of answer text the workers streamed.
fn streamed(events: &[RunEvent]) -> usize {
    events.iter().filter_map(|e| if let RunEvent::StepDelta { text, .. } = e { Some(text.len()) } else { None }).sum()
}

/// A stream cut off before the provider's usage came (OpenAI sends it only at the end) is still
/// billed: the run counts an upper estimate of what was read and sent, marked as estimated, and
/// its cost with it.
#[tokio::test]
async fn a_stream_cut_before_its_usage_counts_an_estimate_and_says_so() {
    let server = TestServer::start().await.expect("server");
    let p = pool(&server, "[budget]\nmax_cost_usd = 10", &[compat("cut", "cut;cut=1;chunks=4")]);
    let mut p = p;
    p.options.retry.max_retries = 0;
    p.workers[0].price_in = Some(1.0);
    p.workers[0].price_out = Some(2.0);
    let executor = Executor::from_pool(&p);
    let answer = "model_id = [0]\nsubtasks = ['Answer.']\naccess_list = [[]]";
    let (outcome, events) = run(&executor, answer, None).await;
    assert_eq!(outcome.status, RunStatus::Failed);
    let sent = streamed(&events);
    assert!(sent > 0, "some text came before the cut: {events:?}");
    let u = outcome.totals.usage;
    assert!(u.estimated, "{u:?}");
    assert_eq!(u.output_tokens, sent as u64, "one token per byte received");
    assert!(u.input_tokens > 0);
    assert!(outcome.totals.cost_usd > 0.0, "the estimate is priced");
    assert!(outcome.totals.all().summary().contains("estimated"), "{}", outcome.totals.all().summary());
    // The provider reported nothing for it.
    assert_eq!(server.requests()[0].reported().output_tokens, 0);

    // Anthropic reports the input as its stream opens, with a placeholder of one output token:
    // the input counts as reported, and the output from the bytes that came, not as 1.
    let mut p = pool(&server, "", &[("cut", "anthropic", "cut-anthropic;cut=1;chunks=4")]);
    p.options.retry.max_retries = 0;
    let keyed = Executor::from_pool_with_keys(&p, |_| Arc::new(|| Ok(Some(ApiKey::new("test-key")))));
    let (outcome, events) = run(&keyed, answer, None).await;
    assert_eq!(outcome.status, RunStatus::Failed);
    let sent = streamed(&events);
    assert!(sent > 1, "text came before the cut: {events:?}");
    let u = outcome.totals.usage;
    let reported = server.requests().last().expect("the call").reported();
    assert!(reported.input_tokens > 0);
    assert_eq!((u.input_tokens, u.output_tokens, u.estimated), (reported.input_tokens, sent as u64, true));
}

/// A conductor whose first plan loops and whose second attempt the run's token cap has no
/// room for: each attempt reserves 1,000 tokens in and 100 out, and the first spends them.
struct LoopsThenOverCap {
    attempts: std::sync::atomic::AtomicUsize,
}

impl baton_engine::Planner for LoopsThenOverCap {
    fn describe(&self) -> String {
        "a looping conductor".into()
    }

    fn plan<'a>(
        &'a self,
        _context: baton_engine::PlanningContext,
        _deltas: baton_engine::PlanDeltas<'a>,
        meter: baton_engine::accounting::Meter<'a>,
    ) -> futures::future::BoxFuture<'a, Result<baton_engine::Planned, baton_engine::PlannerError>> {
        Box::pin(async move {
            self.attempts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let worst = baton_engine::accounting::WorstCase::of_size(1000, 100, &baton_engine::prices::Pricing::Free);
            let reservation = meter
                .reserve("the conductor", worst, &baton_engine::prices::Pricing::Free)
                .await
                .map_err(baton_engine::PlannerError::refused)?;
            let usage = baton_providers::Usage { input_tokens: 1000, output_tokens: 100, ..Default::default() };
            reservation.settle(usage, Some(0.0));
            let raw = "model_id = [0]\nsubtasks = [\"The answer is 4. The answer is 4. The answer is 4. The answer is 4.\"]\naccess_list = [[]]";
            let plan = baton_plan::parse(raw, &Limits::default()).expect("plan parses");
            Ok(baton_engine::Planned { usage, ..baton_engine::Planned::bare(raw.into(), plan) })
        })
    }
}

/// A first plan that loops is rejected; a second attempt that would not fit under the run's
/// token cap is not made, and the question goes to one worker alone instead of the run failing.
#[tokio::test]
async fn a_second_plan_the_cap_has_no_room_for_falls_back_to_one_worker() {
    let server = TestServer::start().await.expect("server");
    let (planner, executor) = looping_pool(&server, "max_tokens = 2000");
    let request = RunRequest { run_id: "capped".into(), question: "What is 2+2?".into(), ..RunRequest::default() };
    let (outcome, events) = run_request(&executor, request, None).await;
    assert_eq!(outcome.status, RunStatus::Finished, "{events:#?}");
    assert_eq!(planner.attempts.load(std::sync::atomic::Ordering::SeqCst), 2, "the second attempt was asked for");
    let rejected: Vec<_> = events.iter().filter(|e| matches!(e, RunEvent::PlanRejected { .. })).collect();
    assert!(
        matches!(rejected.as_slice(), [RunEvent::PlanRejected { reason, retry: true, .. }] if reason.contains("repeats itself")),
        "{rejected:#?}"
    );
    let fallback = fallback_reason(&events);
    let fallback = fallback.expect("the plan that ran is the fallback");
    assert!(fallback.contains("a second plan did not fit under the run's caps"), "{fallback}");
    assert!(fallback.contains("the question went to w alone"), "{fallback}");
    let totals = events.iter().find_map(RunEvent::final_totals).expect("totals");
    assert_eq!(totals.conductor.calls, 1, "the refused attempt is no call: {totals:?}");
    assert_eq!(totals.workers.calls, 1);
    let asked: Vec<_> = server.requests().into_iter().filter(|r| r.model.starts_with('w')).collect();
    assert_eq!(asked.len(), 1);
    assert!(asked[0].body.to_string().contains("What is 2+2?"), "{}", asked[0].body);
}

/// Why the plan that ran is the fallback, if it is.
fn fallback_reason(events: &[RunEvent]) -> Option<String> {
    events.iter().find_map(|e| match e {
        RunEvent::PlanReady { fallback: Some(f), .. } => Some(f.clone()),
        _ => None,
    })
}

/// A pool with one worker `w` (64 tokens out at most) and the looping conductor, under `cap`.
fn looping_pool(server: &TestServer, cap: &str) -> (Arc<LoopsThenOverCap>, Executor) {
    let text = format!(
        "[budget]\n{cap}\n\n[[worker]]\nname = \"w\"\nprovider = \"openai-compatible\"\nmodel = \"w;reply=four\"\nbase_url = \"{}\"\nmax_tokens = 64\n",
        server.base_url(Wire::OpenAi)
    );
    let pool = Pool::parse(&text, "test-pool.toml").expect("valid pool");
    let planner = Arc::new(LoopsThenOverCap { attempts: Default::default() });
    let executor = executor(&pool).with_planner(planner.clone());
    (planner, executor)
}

/// While the conductor writes, the room of the fallback's answer (the question to one worker
/// alone) is held: an attempt that could only fit by taking it is not made, and the worker
/// answers instead of the run ending over its cap. Under 1,200 tokens, the conductor's 1,100
/// fit alone but not beside the fallback's; under one call, the call is the fallback's.
#[tokio::test]
async fn the_fallback_answers_whatever_the_conductor_would_have_spent() {
    let server = TestServer::start().await.expect("server");
    for cap in ["max_tokens = 1200", "max_calls = 1"] {
        let (planner, executor) = looping_pool(&server, cap);
        let before = server.requests().len();
        let request = RunRequest { run_id: "held".into(), question: "What is 2+2?".into(), ..RunRequest::default() };
        let (outcome, events) = run_request(&executor, request, None).await;
        assert_eq!(outcome.status, RunStatus::Finished, "{cap}: {events:#?}");
        assert_eq!(planner.attempts.load(std::sync::atomic::Ordering::SeqCst), 1, "{cap}");
        let fallback = fallback_reason(&events);
        let fallback = fallback.unwrap_or_else(|| panic!("{cap}: the plan that ran is the fallback"));
        assert!(fallback.starts_with("a plan did not fit under the run's caps"), "{fallback}");
        assert!(fallback.contains("held back for the answer of one worker alone"), "{fallback}");
        let totals = events.iter().find_map(RunEvent::final_totals).expect("totals");
        assert_eq!((totals.conductor.calls, totals.workers.calls), (0, 1), "{cap}: {totals:?}");
        assert_eq!(server.requests().len(), before + 1);
    }
}

/// A run whose caps cannot afford even the fallback's answer is refused before the conductor
/// is asked: nothing is spent on a plan that could never be answered.
#[tokio::test]
async fn a_run_that_cannot_afford_the_fallback_is_refused_before_the_conductor_spends() {
    let server = TestServer::start().await.expect("server");
    let (planner, executor) = looping_pool(&server, "max_tokens = 100");
    let request = RunRequest { run_id: "poor".into(), question: "What is 2+2?".into(), ..RunRequest::default() };
    let (outcome, events) = run_request(&executor, request, None).await;
    assert_eq!(outcome.status, RunStatus::Failed);
    let error = outcome.error.expect("error");
    assert_eq!(error.kind, RunErrorKind::BudgetExceeded);
    assert!(error.message.contains("not even the question to one worker alone (w) fits"), "{}", error.message);
    assert_eq!(planner.attempts.load(std::sync::atomic::Ordering::SeqCst), 0, "the conductor was not asked");
    assert_eq!(outcome.totals.calls, 0);
    assert!(server.requests().is_empty());
    assert!(!events.iter().any(|e| matches!(e, RunEvent::PlanStarted { .. })), "{events:#?}");
}

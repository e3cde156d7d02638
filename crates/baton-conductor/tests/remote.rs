//! A conductor behind an OpenAI-compatible endpoint: its answer is parsed; an unusable plan is
//! retried once with the error fed back, then fails clearly.

use baton_engine::accounting::unmetered;
use std::sync::Arc;

use baton_conductor::{ConductorOptions, RemoteConductor};
use baton_engine::{Planner, PlanningContext, WorkerInfo};
use baton_providers::{HttpModel, ModelSettings, ProviderKind};
use baton_testserver::{TestServer, Wire};

/// The plans here reason before their lists, as the v2 prompt asks (v3's grammar allows none).
fn conductor(server: &TestServer, model: &str) -> RemoteConductor {
    conductor_with(server, model, &ConductorOptions { max_reasoning_chars: 1200, ..ConductorOptions::default() })
}

fn conductor_with(server: &TestServer, model: &str, options: &ConductorOptions) -> RemoteConductor {
    let http = HttpModel::new(
        ProviderKind::OpenAiCompatible,
        &server.base_url(Wire::OpenAi),
        ModelSettings::new(model),
        Arc::new(|| Ok(None)),
        HttpModel::http_client(),
    );
    let workers = (0..2)
        .map(|i| WorkerInfo {
            index: i,
            name: format!("w{i}"),
            provider: ProviderKind::OpenAi,
            model: "m".into(),
            description: None,
        })
        .collect();
    RemoteConductor::new(Arc::new(http), "big-conductor".into(), workers, options)
}

fn context() -> PlanningContext {
    PlanningContext::question("What is 2+2?", 2, 5)
}

const GOOD: &str = "Simple arithmetic; one worker suffices.\n```python\nmodel_id = [1]\nsubtasks = [\"Compute 2+2.\"]\naccess_list = [[]]\n```";
const BAD: &str = "```python\nmodel_id = [7]\nsubtasks = [\"Compute 2+2.\"]\naccess_list = [[]]\n```";

#[tokio::test]
async fn a_good_plan_is_parsed_and_streamed() {
    let server = TestServer::start().await.expect("server");
    server.queue_replies("big", [GOOD]);
    let mut streamed = String::new();
    let planned = conductor(&server, "big")
        .plan(context(), Box::new(|t: &str| streamed.push_str(t)), unmetered())
        .await
        .expect("plan");
    assert_eq!(planned.plan.to_json(), r#"{"model_id":[1],"subtasks":["Compute 2+2."],"access_list":[[]]}"#);
    assert_eq!(streamed, GOOD);
    let request = &server.requests()[0];
    assert!(
        request.body["messages"][0]["content"].as_str().unwrap_or_default().contains("- Model 1:"),
        "the system prompt lists the workers"
    );
    assert_eq!(request.body["messages"][1]["content"], "Question: What is 2+2?");
}

#[tokio::test]
async fn an_unusable_plan_is_retried_once_with_the_error_fed_back() {
    let server = TestServer::start().await.expect("server");
    server.queue_replies("big", [BAD, GOOD]);
    let planned =
        conductor(&server, "big").plan(context(), Box::new(|_: &str| {}), unmetered()).await.expect("second try works");
    assert_eq!(planned.plan.steps[0].model_id, 1);
    let retry = &server.requests()[1].body["messages"];
    let n = retry.as_array().map_or(0, Vec::len);
    assert_eq!(retry[n - 2]["content"], BAD, "the first answer is shown back");
    let feedback = retry[n - 1]["content"].as_str().unwrap_or_default();
    assert!(feedback.contains("model 7 is not in the pool"), "{feedback}");
}

#[tokio::test]
async fn two_unusable_plans_fail_clearly() {
    let server = TestServer::start().await.expect("server");
    server.queue_replies("big", [BAD, "no lists at all"]);
    let e = conductor(&server, "big").plan(context(), Box::new(|_: &str| {}), unmetered()).await.expect_err("fails");
    assert!(e.message.contains("could not be used twice"), "{e}");
    assert!(e.message.contains("model 7 is not in the pool") && e.message.contains("no plan found"), "{e}");
    assert_eq!(server.requests().len(), 2, "exactly one retry");
}

#[tokio::test]
async fn each_server_gets_the_plan_grammar_in_its_own_field() {
    use baton_providers::ServerGrammar;
    let server = TestServer::start().await.expect("server");
    for (grammar, field) in [
        (ServerGrammar::Vllm, "/structured_outputs/regex"),
        (ServerGrammar::Sglang, "/regex"),
        (ServerGrammar::LlamaCpp, "/grammar"),
    ] {
        let model = format!("big-{}", grammar.as_str());
        server.queue_replies(&model, [GOOD]);
        let conductor = conductor(&server, &model).with_grammar(Some(grammar));
        assert!(conductor.describe().contains(&format!("{} grammar", grammar.as_str())), "{}", conductor.describe());
        conductor.plan(context(), Box::new(|_: &str| {}), unmetered()).await.expect("plan");
        let request = server.requests().into_iter().find(|r| r.body["model"] == model.as_str()).expect("sent");
        let sent = request.body.pointer(field).and_then(|v| v.as_str()).unwrap_or_else(|| panic!("{field} missing"));
        let others = ["/structured_outputs", "/regex", "/grammar"].into_iter().filter(|f| !field.starts_with(f));
        for other in others {
            assert!(request.body.pointer(other).is_none(), "{other} sent to {}", grammar.as_str());
        }
        if grammar == ServerGrammar::LlamaCpp {
            assert!(sent.starts_with("root ::= reasoning"), "{sent}");
            assert!(sent.contains("id ::= \"0\" | \"1\"\n"), "the pool's two workers: {sent}");
        } else {
            let re = regex::RegexBuilder::new(&format!("^(?:{sent})$")).size_limit(1 << 28).build().expect("regex");
            assert!(re.is_match(GOOD), "the regex takes a good plan");
            assert!(!re.is_match(BAD), "the regex refuses a worker outside the pool");
        }
    }
}

#[tokio::test]
async fn without_a_grammar_no_extension_field_is_sent() {
    let server = TestServer::start().await.expect("server");
    server.queue_replies("big", [GOOD]);
    conductor(&server, "big").plan(context(), Box::new(|_: &str| {}), unmetered()).await.expect("plan");
    let body = &server.requests()[0].body;
    for field in ["structured_outputs", "regex", "grammar"] {
        assert!(body.get(field).is_none(), "{field} sent to a server that may reject unknown fields");
    }
}

#[tokio::test]
async fn rate_limits_and_overload_are_retried_like_a_worker_s() {
    let server = TestServer::start().await.expect("server");
    // A failed call takes its queued reply too.
    server.queue_replies("busy", [GOOD, GOOD, GOOD]);
    let mut streamed = String::new();
    // Two failures, each with "come back in 0 s", then the plan.
    let planned = conductor(&server, "busy;fail=503x2;retry_after=0")
        .plan(context(), Box::new(|t: &str| streamed.push_str(t)), unmetered())
        .await
        .expect("the third attempt plans");
    assert_eq!(planned.plan.to_json(), r#"{"model_id":[1],"subtasks":["Compute 2+2."],"access_list":[[]]}"#);
    assert_eq!(server.requests().len(), 3);
    assert!(streamed.contains("trying again"), "the retries show in the conductor's text: {streamed}");

    let server = TestServer::start().await.expect("server");
    let err = conductor(&server, "gone;fail=401x*").plan(context(), Box::new(|_| {}), unmetered()).await.unwrap_err();
    assert_eq!(server.requests().len(), 1, "an auth error is never retried");
    assert!(err.to_string().contains("auth"), "{err}");
}

#[tokio::test]
async fn each_request_has_the_workers_time_limit() {
    let server = TestServer::start().await.expect("server");
    let options = ConductorOptions {
        call: baton_engine::calls::CallPolicy {
            timeout: std::time::Duration::from_millis(300),
            retry: baton_providers::RetryPolicy {
                max_retries: 1,
                initial_delay: std::time::Duration::from_millis(1),
                ..Default::default()
            },
        },
        ..ConductorOptions::default()
    };
    let started = std::time::Instant::now();
    let err = conductor_with(&server, "stuck;ttfb=20000", &options)
        .plan(context(), Box::new(|_| {}), unmetered())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("within 0.3 s"), "{err}");
    assert_eq!(server.requests().len(), 2, "the first attempt and one retry");
    // The answer would take 20 s: well under it is the time limit at work, on a busy machine too.
    assert!(started.elapsed() < std::time::Duration::from_secs(15), "{:?}", started.elapsed());
}

/// What a remote conductor's calls settled in `ledger`: calls, input, output, estimated.
fn conductor_figures(ledger: &baton_engine::accounting::Ledger) -> (u32, u64, u64, bool) {
    let c = ledger.spent().conductor;
    (c.calls, c.usage.input_tokens, c.usage.output_tokens, c.usage.estimated)
}

/// A conductor's answer cut off mid-stream, or past the plan's time limit, is billed as a
/// worker's is: the request's input bound and one token per byte of text that came, marked as
/// an estimate (the server reports usage only at the end, so it reported nothing).
#[tokio::test]
async fn a_cut_or_timed_out_answer_counts_what_was_sent_and_received() {
    let ledger = baton_engine::accounting::Ledger::new(baton_engine::accounting::Budget::default());
    let stop = tokio_util::sync::CancellationToken::new();
    let meter = baton_engine::accounting::Meter { ledger: &ledger, stop: &stop };
    let once = ConductorOptions {
        call: baton_engine::calls::CallPolicy {
            retry: baton_providers::RetryPolicy { max_retries: 0, ..Default::default() },
            ..Default::default()
        },
        ..ConductorOptions::default()
    };

    let server = TestServer::start().await.expect("server");
    server.queue_replies("cut", [GOOD]);
    let mut streamed = String::new();
    conductor_with(&server, "cut;cut=1;chunks=8", &once)
        .plan(context(), Box::new(|t: &str| streamed.push_str(t)), meter)
        .await
        .expect_err("the stream was cut");
    assert!(!streamed.is_empty(), "text came before the cut");
    let (calls, input, output, estimated) = conductor_figures(&ledger);
    assert_eq!((calls, output, estimated), (1, streamed.len() as u64, true));
    assert!(input > 100, "the prompt's bound: {input}");

    let ledger = baton_engine::accounting::Ledger::new(baton_engine::accounting::Budget::default());
    let meter = baton_engine::accounting::Meter { ledger: &ledger, stop: &stop };
    let slow = ConductorOptions { plan_time_limit: std::time::Duration::from_millis(700), ..once.clone() };
    server.queue_replies("slow", [GOOD]);
    let mut streamed = String::new();
    let e = conductor_with(&server, "slow;latency=4000;chunks=40", &slow)
        .plan(context(), Box::new(|t: &str| streamed.push_str(t)), meter)
        .await
        .expect_err("past its time limit");
    assert!(e.timed_out, "{e}");
    assert!(!streamed.is_empty() && streamed.len() < GOOD.len(), "part of the plan came: {streamed:?}");
    let (calls, input, output, estimated) = conductor_figures(&ledger);
    assert_eq!((calls, output, estimated), (1, streamed.len() as u64, true));
    assert!(input > 100, "the prompt's bound: {input}");

    // Cut before its first byte (the server read the request and said nothing within the time
    // limit): the prompt's bound still counts, each attempt's.
    let ledger = baton_engine::accounting::Ledger::new(baton_engine::accounting::Budget::default());
    let meter = baton_engine::accounting::Meter { ledger: &ledger, stop: &stop };
    let silent = ConductorOptions { plan_time_limit: std::time::Duration::from_millis(500), ..once };
    conductor_with(&server, "silent;ttfb=20000", &silent)
        .plan(context(), Box::new(|_: &str| {}), meter)
        .await
        .expect_err("past its time limit");
    let (calls, input, output, estimated) = conductor_figures(&ledger);
    assert_eq!((calls, output, estimated), (1, 0, true));
    assert!(input > 100, "the prompt's bound, with no byte back: {input}");
}

/// A server that ignores the output cap is not read without end: past a bound far above any
/// plan, the answer is cut off with an error that says why, and what came is counted.
#[tokio::test]
async fn an_answer_far_longer_than_any_plan_is_cut_off() {
    let server = TestServer::start().await.expect("server");
    // One piece the size of many plans: the server's own cap (tokens, as pieces) lets it through.
    let model = format!("flood;reply={}", "x".repeat(baton_conductor::REMOTE_MAX_PLAN_BYTES + 10));
    let ledger = baton_engine::accounting::Ledger::new(baton_engine::accounting::Budget::default());
    let stop = tokio_util::sync::CancellationToken::new();
    let meter = baton_engine::accounting::Meter { ledger: &ledger, stop: &stop };
    let e = conductor(&server, &model).plan(context(), Box::new(|_: &str| {}), meter).await.expect_err("cut off");
    assert!(e.to_string().contains("far beyond a plan's length"), "{e}");
    assert_eq!(server.requests().len(), 1, "not retried: the same server would flood again");
    let (calls, _, output, estimated) = conductor_figures(&ledger);
    assert!(calls == 1 && output > 0 && estimated, "what came is counted: {output}");
}

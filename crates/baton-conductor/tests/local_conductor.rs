//! The local conductor with a real (tiny, random) model through the real mistral.rs pipeline:
//! constrained plans that always parse, whatever the vocabulary or load settings, recursion and
//! its caps, its time limit. Loading itself and local workers are `baton-local`'s `local` test.

use baton_engine::accounting::unmetered;
use std::sync::Arc;

use baton_conductor::{ConductorOptions, LocalConductor};
use baton_engine::{
    Executor, Planner, PlanningContext, Pool, RunEvent, RunRequest, RunStatus, StepErrorKind, WorkerInfo,
};
use baton_local::{LocalModel, LocalModelConfig};
use baton_providers::{ApiKey, ProviderKind};
use baton_testserver::{TestServer, Wire};
use tokio::sync::{OnceCell, mpsc};
use tokio_util::sync::CancellationToken;

/// One tiny model for the whole test binary: loading is fast, but there is no need to repeat it.
async fn model() -> Arc<LocalModel> {
    static MODEL: OnceCell<(tempfile::TempDir, Arc<LocalModel>)> = OnceCell::const_new();
    let (_, m) = MODEL
        .get_or_init(|| async {
            let dir = tempfile::tempdir().expect("tempdir");
            baton_tinymodel::write_safetensors_model(dir.path(), &baton_tinymodel::TinySpec::default())
                .expect("write model");
            let config = LocalModelConfig { path: dir.path().to_path_buf(), force_cpu: true, ..Default::default() };
            let model = LocalModel::load(&config).await.unwrap_or_else(|e| panic!("the tiny model loads: {e}"));
            (dir, Arc::new(model))
        })
        .await;
    m.clone()
}

/// Short reasoning and subtasks keep a random model's plans quick.
fn quick() -> ConductorOptions {
    ConductorOptions {
        max_reasoning_chars: 24,
        max_subtask_chars: 16,
        temperature: Some(1.0),
        ..ConductorOptions::default()
    }
}

fn workers(n: usize) -> Vec<WorkerInfo> {
    (0..n)
        .map(|i| WorkerInfo {
            index: i,
            name: format!("w{i}"),
            provider: ProviderKind::OpenAiCompatible,
            model: format!("w{i}"),
            description: Some(format!("worker number {i}")),
        })
        .collect()
}

/// A tiny GGUF written to `spec` and loaded on the CPU; the directory holds the file.
async fn tiny_gguf(spec: &baton_tinymodel::TinySpec) -> (tempfile::TempDir, Arc<LocalModel>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("tiny.gguf");
    baton_tinymodel::write_gguf_model(&file, spec).expect("write gguf");
    let config = LocalModelConfig { path: file, force_cpu: true, ..Default::default() };
    let model = LocalModel::load(&config).await.unwrap_or_else(|e| panic!("the tiny GGUF loads: {e}"));
    (dir, Arc::new(model))
}

/// A plan for "Any question" from a quick conductor on `model` over two workers, with no
/// examples: what the loading tests ask of a model once it loads.
async fn plan_any_question(model: Arc<LocalModel>) -> Result<baton_engine::Planned, baton_engine::PlannerError> {
    let conductor = LocalConductor::new(model, workers(2), ConductorOptions { no_examples: true, ..quick() });
    conductor.plan(context("Any question", 2, 3), Box::new(|_: &str| {}), unmetered()).await
}

fn context(question: &str, pool_size: usize, max_steps: usize) -> PlanningContext {
    PlanningContext::question(question, pool_size, max_steps)
}

#[tokio::test(flavor = "multi_thread")]
async fn fifty_plans_for_fifty_questions_all_parse_and_validate() {
    let model = model().await;
    let mut steps_seen = std::collections::BTreeSet::new();
    for i in 0..50 {
        let pool_size = 1 + i % 5;
        let max_steps = 1 + (i * 7) % 5;
        // The few-shot workflows are left out to keep 50 prefills quick; what is tested here is
        // that the grammar makes every plan valid, whatever the prompt.
        let conductor =
            LocalConductor::new(model.clone(), workers(pool_size), ConductorOptions { no_examples: true, ..quick() });
        let question = format!("Question {i}: what is {i} times {}?", i + 3);
        let mut deltas = String::new();
        let planned = conductor
            .plan(context(&question, pool_size, max_steps), Box::new(|t: &str| deltas.push_str(t)), unmetered())
            .await
            .unwrap_or_else(|e| panic!("plan {i} (pool {pool_size}, max {max_steps}): {e}"));
        assert_eq!(deltas, planned.raw, "the deltas are the whole text, streamed");
        let limits = baton_plan::Limits { max_steps, pool_size: Some(pool_size), allow_stop: false };
        baton_plan::parse(&planned.raw, &limits).unwrap_or_else(|e| panic!("plan {i} reparses: {e}"));
        assert!(!planned.plan.steps.is_empty() && planned.plan.steps.len() <= max_steps);
        assert!(planned.plan.steps.iter().all(|s| s.model_id < pool_size));
        assert!(planned.usage.output_tokens > 0);
        steps_seen.insert(planned.plan.steps.len());
    }
    assert!(steps_seen.len() > 1, "plans of several lengths: {steps_seen:?}");
}

fn loopback_pool(server: &TestServer, extra: &str, n: usize) -> Pool {
    let mut text = format!("{extra}\n[retry]\ninitial_delay_ms = 10\n");
    for i in 0..n {
        text.push_str(&format!(
            "\n[[worker]]\nname = \"w{i}\"\nprovider = \"openai-compatible\"\nmodel = \"w{i}\"\nbase_url = \"{}\"\n",
            server.base_url(Wire::OpenAi)
        ));
    }
    Pool::parse(&text, "pool.toml").expect("valid pool")
}

async fn run(executor: &Executor, question: &str, plan: Option<&str>) -> (baton_engine::RunOutcome, Vec<RunEvent>) {
    let plan = plan.map(|p| {
        baton_plan::parse(p, &baton_plan::Limits { max_steps: 5, pool_size: None, allow_stop: false }).expect("plan")
    });
    let (tx, mut rx) = mpsc::unbounded_channel();
    let request = RunRequest { run_id: "t".into(), question: question.into(), plan, ..RunRequest::default() };
    let outcome = executor.run(request, &tx, &CancellationToken::new()).await;
    drop(tx);
    let mut events = Vec::new();
    while let Some(e) = rx.recv().await {
        events.push(e);
    }
    if let Err(e) = baton_engine::event::check_sequence(&events) {
        panic!("{e}\n{events:#?}");
    }
    (outcome, events)
}

fn executor(pool: &Pool, conductor: LocalConductor) -> Executor {
    Executor::from_pool_with_keys(pool, |_| Arc::new(|| Ok(Some(ApiKey::new("k"))))).with_planner(Arc::new(conductor))
}

#[tokio::test(flavor = "multi_thread")]
async fn the_conductor_plans_and_the_pool_answers() {
    let server = TestServer::start().await.expect("server");
    let pool = loopback_pool(&server, "", 3);
    let conductor = LocalConductor::new(model().await, pool.infos(), quick());
    let (outcome, events) = run(&executor(&pool, conductor), "What is 6 times 7?", None).await;
    assert_eq!(outcome.status, RunStatus::Finished, "{outcome:?}");
    assert!(events.iter().any(|e| matches!(e, RunEvent::PlanStarted { round: 0, .. })));
    assert!(events.iter().any(|e| matches!(e, RunEvent::PlanDelta { round: 0, .. })));
    let (plan, raw) = events
        .iter()
        .find_map(|e| match e {
            RunEvent::PlanReady { round: 0, plan, raw, .. } => Some((plan.clone(), raw.clone())),
            _ => None,
        })
        .expect("plan ready");
    assert!(raw.is_some_and(|r| r.contains("```python")));
    assert_eq!(server.requests().len(), plan.steps.len(), "one call per planned step");
    assert!(outcome.answer.is_some_and(|a| a.contains("answers:")));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_recursive_round_that_must_stop_keeps_the_latest_answer() {
    let server = TestServer::start().await.expect("server");
    // Two steps allowed in the whole run: the conductor's round gets none, so it must stop.
    let pool = loopback_pool(&server, "[recursion]\nenabled = true\nmax_total_steps = 2", 2);
    let conductor = LocalConductor::new(model().await, pool.infos(), quick());
    let given = "model_id = [1, 2]\nsubtasks = ['Solve it.', 'Check the work.']\naccess_list = [[], 'all']";
    let (outcome, events) = run(&executor(&pool, conductor), "Q", Some(given)).await;
    assert_eq!(outcome.status, RunStatus::Finished, "{outcome:?}");
    assert_eq!(outcome.answer.as_deref(), Some("w1 (saw 0 earlier answers) answers: Solve it."));
    let stop = events.iter().find_map(|e| match e {
        RunEvent::PlanReady { round: 1, depth, parent, plan, .. } => Some((*depth, *parent, plan.is_stop())),
        _ => None,
    });
    assert_eq!(stop, Some((1, Some(baton_engine::StepRef { round: 0, step: 1 }), true)));
    assert_eq!(outcome.totals.rounds, 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn forced_recursion_stays_within_its_depth_and_step_caps() {
    let server = TestServer::start().await.expect("server");
    let pool =
        loopback_pool(&server, "max_steps = 2\n[recursion]\nenabled = true\nmax_depth = 2\nmax_total_steps = 6", 2);
    let options = ConductorOptions { force_self: true, no_examples: true, ..quick() };
    let conductor = LocalConductor::new(model().await, pool.infos(), options);
    let (outcome, events) = run(&executor(&pool, conductor), "Q", None).await;

    let depths: Vec<u32> = events
        .iter()
        .filter_map(|e| match e {
            RunEvent::PlanReady { depth, .. } => Some(*depth),
            _ => None,
        })
        .collect();
    assert!(depths.contains(&1), "the conductor handed work to itself: {depths:?}");
    assert!(depths.iter().all(|d| *d <= 2), "depth cap 2: {depths:?}");
    // Below the depth cap the grammar offers only the conductor, so every round-0 and round-1
    // step is recursive; at depth 2 it offers only workers.
    for e in &events {
        if let RunEvent::PlanReady { depth, plan, .. } = e {
            let expected = |id: usize| if *depth < 2 { id == 2 } else { id < 2 };
            assert!(plan.steps.iter().all(|s| expected(s.model_id)), "depth {depth}: {plan:?}");
        }
    }
    let started = events.iter().filter(|e| matches!(e, RunEvent::StepStarted { .. })).count();
    let refused = events
        .iter()
        .filter(|e| matches!(e, RunEvent::StepFailed { error, .. } if error.kind == StepErrorKind::RecursionLimit))
        .count();
    assert!(started <= 6, "{started} steps started; the cap is 6");
    if outcome.status != RunStatus::Finished {
        let reasons: Vec<_> = events
            .iter()
            .filter_map(|e| match e {
                RunEvent::StepFailed { error, .. } => Some(error.kind),
                _ => None,
            })
            .collect();
        assert!(
            reasons.iter().all(|k| matches!(
                k,
                StepErrorKind::RecursionLimit | StepErrorKind::Conductor | StepErrorKind::DependencyFailed
            )),
            "a capped run fails only for its caps: {reasons:?}"
        );
        assert!(refused > 0 || reasons.contains(&StepErrorKind::Conductor), "{reasons:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gguf_conductor_writes_valid_plans_too() {
    let (_dir, model) = tiny_gguf(&baton_tinymodel::TinySpec::default()).await;
    let options = ConductorOptions { no_examples: true, ..quick() };
    for (i, pool_size) in [1usize, 3, 5].into_iter().enumerate() {
        let conductor = LocalConductor::new(model.clone(), workers(pool_size), options.clone());
        let planned = conductor
            .plan(context(&format!("GGUF question {i}"), pool_size, 4), Box::new(|_: &str| {}), unmetered())
            .await
            .unwrap_or_else(|e| panic!("GGUF plan {i}: {e}"));
        assert!(planned.plan.steps.iter().all(|s| s.model_id < pool_size));
        assert!((1..=4).contains(&planned.plan.steps.len()));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gguf_without_an_end_of_text_token_is_refused_with_what_to_do() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("no-end.gguf");
    let spec = baton_tinymodel::TinySpec { end_of_text: false, ..Default::default() };
    baton_tinymodel::write_gguf_model(&file, &spec).expect("write gguf");
    let config = LocalModelConfig { path: file.clone(), force_cpu: true, ..Default::default() };
    let no_end = Arc::new(LocalModel::load(&config).await.expect("it loads: it can still answer as a worker"));
    let started = std::time::Instant::now();
    let e = plan_any_question(no_end).await.expect_err("refused");
    assert!(started.elapsed() < std::time::Duration::from_secs(5), "refused before generating");
    assert!(e.message.starts_with(&file.display().to_string()), "names the file: {e}");
    assert!(e.message.contains("no end-of-text token (</s>, <|endoftext|>"), "{e}");
    assert!(e.message.contains("use another build of the model"), "says what to do: {e}");
}

/// Gemma's GGUFs hold their newlines as user-defined tokens (type 4), as Qwen2.5's do its
/// tool-call tags: text kept whole, not special. The engine once made them special, so the plan
/// grammar's newline, which llguidance spells with that token, failed every Gemma plan ("doesn't
/// satisfy the grammar"), and decoding dropped the newlines from a Gemma worker's answers.
#[tokio::test(flavor = "multi_thread")]
async fn a_gguf_whose_newline_is_a_user_defined_token_plans_and_keeps_its_newlines() {
    let (_dir, model) =
        tiny_gguf(&baton_tinymodel::TinySpec { user_defined_newline: true, ..Default::default() }).await;
    assert_eq!(model.token_count("a\nb").await, 3, "the newline is one token, counted as text");
    let conductor = LocalConductor::new(model.clone(), workers(2), ConductorOptions { no_examples: true, ..quick() });
    for i in 0..3 {
        let mut deltas = String::new();
        let planned = conductor
            .plan(context(&format!("Newline question {i}"), 2, 3), Box::new(|t: &str| deltas.push_str(t)), unmetered())
            .await
            .unwrap_or_else(|e| panic!("plan {i}: {e}"));
        assert!((1..=3).contains(&planned.plan.steps.len()));
        // The plan's fenced block is lines: its newlines came through as text.
        assert!(planned.raw.contains("```python\nmodel_id = ["), "plan {i}: {:?}", planned.raw);
        assert_eq!(deltas, planned.raw, "the deltas are the whole text, streamed");
    }
}

/// A SentencePiece GGUF (Gemma's, Mistral's, Phi-3's vocabulary) is tokenized as llama.cpp does:
/// pieces joined by score, with no space prefix where the file says so. The engine once read the
/// scores as a unigram model's and split words into letters ("the" as "t" + "he": a Gemma
/// conductor then copied its examples with letters doubled), and prefixed every text with a
/// space. A plan is written through its byte tokens.
#[tokio::test(flavor = "multi_thread")]
async fn a_sentencepiece_gguf_joins_pieces_by_score_and_plans() {
    let (_dir, model) = tiny_gguf(&baton_tinymodel::TinySpec { sentencepiece: true, ..Default::default() }).await;
    assert_eq!(model.token_count("the").await, 1, "\"th\" then \"the\", not three letters");
    assert_eq!(model.token_count("the the").await, 2, "\"the\" and \"\u{2581}the\"");
    assert_eq!(model.token_count("he").await, 1, "no space prefix: \"he\", not \"\u{2581}\" + \"he\"");
    assert_eq!(model.token_count("it").await, 2, "letters not in the vocabulary are bytes");
    let planned = plan_any_question(model).await.unwrap_or_else(|e| panic!("plans: {e}"));
    assert!((1..=3).contains(&planned.plan.steps.len()));
    assert!(planned.raw.contains("```python\nmodel_id = ["), "{:?}", planned.raw);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plan_past_its_time_limit_fails_naming_the_limit() {
    // Long reasoning on a random model takes far longer than any limit here. How much of the
    // plan is written by the limit depends on how busy the machine is (at 0.3 s, and once at
    // 1.5 s, the prompt had not even been read): the limit doubles until the plan had begun
    // when it was cut, so that what a cut plan counts is checked on any machine.
    let mut limit = std::time::Duration::from_millis(1500);
    let (e, streamed, ledger) = loop {
        let options =
            ConductorOptions { max_reasoning_chars: 20_000, plan_time_limit: limit, no_examples: true, ..quick() };
        let conductor = LocalConductor::new(model().await, workers(2), options);
        let ledger = baton_engine::accounting::Ledger::new(baton_engine::accounting::Budget::default());
        let stop = CancellationToken::new();
        let meter = baton_engine::accounting::Meter { ledger: &ledger, stop: &stop };
        let started = std::time::Instant::now();
        let mut streamed = String::new();
        let e = conductor
            .plan(context("A question", 2, 3), Box::new(|t: &str| streamed.push_str(t)), meter)
            .await
            .expect_err("times out");
        // Cut at the limit, not run to the end (which takes minutes), whatever the load.
        assert!(started.elapsed() < limit + std::time::Duration::from_secs(20), "{:?}", started.elapsed());
        let named = format!("did not finish its plan within the {} s time limit", limit.as_secs_f64());
        assert!(e.message.contains(&named), "{e}");
        if !streamed.is_empty() || limit >= std::time::Duration::from_secs(48) {
            break (e, streamed, ledger);
        }
        limit *= 2;
    };
    assert!(e.message.contains("plan_time_limit_secs"), "names the setting: {e}");
    // mistral.rs reports nothing for a generation cut off; the plan still counts its prompt,
    // exactly, and the text it wrote, one token per byte at most.
    assert!(!streamed.is_empty(), "the plan had begun within 48 s");
    let c = ledger.spent().conductor;
    assert_eq!(c.calls, 1);
    assert_eq!(c.usage.output_tokens, streamed.len() as u64, "{c:?}");
    assert!(c.usage.input_tokens > 50 && c.usage.estimated, "{c:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn quantized_and_typed_loads_still_write_valid_plans() {
    let dir = tempfile::tempdir().expect("tempdir");
    baton_tinymodel::write_safetensors_model(dir.path(), &baton_tinymodel::TinySpec::default()).expect("write");
    let base = LocalModelConfig { path: dir.path().to_path_buf(), force_cpu: true, ..Default::default() };
    for (isq, dtype) in [(Some("Q8_0"), None), (None, Some("f32"))] {
        let config = LocalModelConfig { isq: isq.map(Into::into), dtype: dtype.map(Into::into), ..base.clone() };
        let model = LocalModel::load(&config).await.unwrap_or_else(|e| panic!("{isq:?} {dtype:?} loads: {e}"));
        let conductor = LocalConductor::new(Arc::new(model), workers(2), quick());
        let planned = conductor
            .plan(context("Quantized?", 2, 3), Box::new(|_: &str| {}), unmetered())
            .await
            .unwrap_or_else(|e| panic!("{isq:?} {dtype:?} plans: {e}"));
        assert!(planned.plan.steps.iter().all(|s| s.model_id < 2));
    }
}

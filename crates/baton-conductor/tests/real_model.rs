//! The local conductor and a local worker on a real model: SmolLM2-135M-Instruct, a 98 MB Q4_1
//! GGUF fetched once by `scripts/fetch-test-model`. A random tiny model cannot show what these
//! check: that a plan ends as soon as its grammar is complete (the model's end-of-text token is
//! not its chat template's end-of-sequence token, and a GGUF has no generation config to say
//! so), that a worker's answer ends on its end-of-turn token, that greedy plans repeat exactly from the same cache,
//! and that the second plan for a pool reuses the prompt prefix the first one computed.

use baton_engine::accounting::unmetered;
use std::sync::Arc;

use baton_conductor::local::{Generated, LocalModel, LocalModelConfig, LocalWorker};
use baton_conductor::{ConductorOptions, LocalConductor};
use baton_engine::{PlanningContext, WorkerInfo};
use baton_providers::{ChatEvent, ChatModel, ChatRequest, Message, ProviderKind};
use futures::StreamExt;
use tokio::sync::OnceCell;

/// The tests take turns with the model: on two cores, plans written side by side are each
/// slower, and mistral.rs batches sequences that run together, which changes the arithmetic
/// enough that greedy plans are no longer the same from one run to the next.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The model, loaded once per test binary; `None` (with the reason printed) only when it
/// cannot be fetched outside CI.
async fn model() -> Option<Arc<LocalModel>> {
    static MODEL: OnceCell<Option<Arc<LocalModel>>> = OnceCell::const_new();
    MODEL
        .get_or_init(|| async {
            let path = baton_tests::real_model()?;
            let config = LocalModelConfig { path, force_cpu: true, ..Default::default() };
            let model = LocalModel::load(&config).await.unwrap_or_else(|e| panic!("SmolLM2 loads: {e}"));
            Some(Arc::new(model))
        })
        .await
        .clone()
}

fn workers(n: usize) -> Vec<WorkerInfo> {
    let descriptions = ["strong at math", "a careful reviewer", "fast and cheap", "strong at code", "a good writer"];
    (0..n)
        .map(|i| WorkerInfo {
            index: i,
            name: format!("w{i}"),
            provider: ProviderKind::OpenAi,
            model: "m".into(),
            description: Some(descriptions[i % descriptions.len()].into()),
        })
        .collect()
}

/// Shorter reasoning than the default keeps each plan to a few seconds on two CPU cores; the
/// ending is what is tested, and it does not depend on the length.
/// The greedy test's pool: other tests share the model (and its prefix cache), but not this
/// worker list, so at most the instructions before it can come from their prompts.
fn conductor_workers() -> Vec<WorkerInfo> {
    workers(3)
        .into_iter()
        .map(|w| WorkerInfo { description: Some(format!("{} (greedy test)", w.description.unwrap_or_default())), ..w })
        .collect()
}

fn options(temperature: f64) -> ConductorOptions {
    ConductorOptions {
        max_reasoning_chars: 150,
        max_subtask_chars: 150,
        temperature: Some(temperature),
        ..Default::default()
    }
}

/// Checks that `generated` ended by the model's own end token right after the closing fence:
/// not cut by Baton's guard, not by the length cap, and with no tokens past its text but the
/// end token.
async fn assert_ended_at_the_fence(model: &LocalModel, generated: &Generated, what: &str) {
    assert!(generated.text.ends_with("\n```"), "{what}: the plan ends with its closing fence: {:?}", generated.text);
    assert_eq!(generated.finish_reason.as_deref(), Some("stop"), "{what}: {:?}", generated.text);
    assert!(!generated.cut_after_complete, "{what}: the model stopped by itself, not by Baton's guard");
    let text_tokens = model.token_count(&generated.text).await as u64;
    // The model may split the text into more tokens than the tokenizer would: a grammar allows
    // any split, and a sampled plan can take a finer one throughout (on an AVX2 machine a
    // subtask of `[]; ` 38 times over took 179 tokens for 140). So half as many again; the
    // failure this catches is hundreds of silent tokens.
    let most = text_tokens + 1 + text_tokens / 2;
    assert!(
        generated.usage.output_tokens <= most,
        "{what}: {} tokens generated for a text of {text_tokens} tokens: {:?}",
        generated.usage.output_tokens,
        generated.text
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn plans_end_as_soon_as_their_grammar_is_complete() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let Some(model) = model().await else { return };
    let cases = [
        ("What is 17 times 23?", 1, 5),
        ("Is 2^31 - 1 prime? Justify the answer.", 3, 5),
        ("Write a Python function that reverses a linked list.", 4, 4),
        ("Explain the difference between TCP and UDP.", 5, 1),
    ];
    for (question, pool_size, max_steps) in cases {
        let conductor = LocalConductor::new(model.clone(), workers(pool_size), options(0.3));
        let ctx = PlanningContext::question(question, pool_size, max_steps);
        let (planned, generated) = conductor
            .plan_with_stats(&ctx, &mut |_| {}, unmetered())
            .await
            .unwrap_or_else(|e| panic!("{question} (pool {pool_size}, max {max_steps}): {e}"));
        let what = format!("{question} (pool {pool_size}, max {max_steps})");
        assert_ended_at_the_fence(&model, &generated, &what).await;
        assert!(!planned.plan.steps.is_empty() && planned.plan.steps.len() <= max_steps, "{what}");
        assert!(planned.plan.steps.iter().all(|s| s.model_id < pool_size), "{what}");
        assert_eq!(planned.stop_reason.as_deref(), Some("stop"));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn greedy_plans_repeat_exactly_and_the_second_reuses_the_prompt_prefix() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let Some(model) = model().await else { return };
    let conductor = LocalConductor::new(model.clone(), conductor_workers(), options(0.0));
    let ctx = PlanningContext::question("How many prime numbers are there below 50?", 3, 4);
    let (_, cold) = conductor.plan_with_stats(&ctx, &mut |_| {}, unmetered()).await.expect("first plan");
    assert_ended_at_the_fence(&model, &cold, "first greedy plan").await;
    assert!(cold.usage.cached_input_tokens < cold.usage.input_tokens, "{:?}", cold.usage);
    // The same prompt again comes from the cache but for its last token, which is forwarded for
    // the first new token's logits. One token's attention sums in another order than the whole
    // prompt's, so on a model this small the plan may differ from the cold one; asked from the
    // same cache it is the same every time.
    let (second, warm) = conductor.plan_with_stats(&ctx, &mut |_| {}, unmetered()).await.expect("second plan");
    let (third, again) = conductor.plan_with_stats(&ctx, &mut |_| {}, unmetered()).await.expect("third plan");
    assert_ended_at_the_fence(&model, &warm, "second greedy plan").await;
    assert_eq!(warm.usage.cached_input_tokens, warm.usage.input_tokens - 1, "{:?}", warm.usage);
    assert_eq!(again.usage.cached_input_tokens, again.usage.input_tokens - 1, "{:?}", again.usage);
    assert_eq!(second.raw, third.raw, "greedy plans for the same prompt from the same cache are the same");
    assert!(
        warm.time_to_first_token < cold.time_to_first_token,
        "warm {:?} vs cold {:?}",
        warm.time_to_first_token,
        cold.time_to_first_token
    );

    // Another question of the same kind for the same pool: the same examples fit it, so only
    // the question is new.
    let alike = PlanningContext::question("How many prime numbers are there below 70?", 3, 4);
    let (_, next) = conductor.plan_with_stats(&alike, &mut |_| {}, unmetered()).await.expect("fourth plan");
    assert_ended_at_the_fence(&model, &next, "a plan for a question of the same kind").await;
    let new_tokens = next.usage.input_tokens - next.usage.cached_input_tokens;
    assert!(new_tokens < 40, "only the question is prefilled again: {:?}", next.usage);
    assert!(
        next.time_to_first_token < cold.time_to_first_token,
        "warm {:?} vs cold {:?}",
        next.time_to_first_token,
        cold.time_to_first_token
    );

    // Another kind of question gets other examples: everything before them still comes from
    // the cache, and at most the examples and the question are prefilled (a token is at least
    // a byte).
    let other = PlanningContext::question("What is the capital of Australia?", 3, 4);
    let system = baton_conductor::PromptBuilder::new(conductor_workers()).system(&other);
    let examples_at = system.find("Example workflows").expect("v3 shows examples");
    let (_, next) = conductor.plan_with_stats(&other, &mut |_| {}, unmetered()).await.expect("fifth plan");
    assert_ended_at_the_fence(&model, &next, "a plan for another kind of question").await;
    let new_tokens = next.usage.input_tokens - next.usage.cached_input_tokens;
    let bound = (system.len() - examples_at + "What is the capital of Australia?".len() + 40) as u64;
    assert!(new_tokens <= bound, "at most the examples and the question are new: {:?}, bound {bound}", next.usage);
    assert!(next.usage.cached_input_tokens > 0, "the prefix before the examples is reused: {:?}", next.usage);
}

/// A worker's answer ends on its end-of-turn token, and its prompt is counted before the call
/// exactly as the model then reads it (what its reservation under a token cap counts).
#[tokio::test(flavor = "multi_thread")]
async fn a_local_worker_answer_ends_on_its_end_of_turn_token() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let Some(model) = model().await else { return };
    let worker = LocalWorker { model: model.clone(), max_tokens: 400, temperature: Some(0.0) };
    let request = ChatRequest {
        system: None,
        messages: vec![Message::user("What is the capital of France? Answer in one short sentence.")],
        constraint: None,
        ..ChatRequest::default()
    };
    // What the worker's reservation counts before the call: the tokens the model then reads.
    let counted = worker.input_tokens(&request).await;
    let mut stream = worker.stream(request).await.expect("stream");
    let mut text = String::new();
    let mut done = None;
    while let Some(item) = stream.next().await {
        match item.expect("no error") {
            ChatEvent::Text(t) => text.push_str(&t),
            ChatEvent::Usage(_) => {}
            ChatEvent::Done { usage, stop_reason } => done = Some((usage, stop_reason)),
        }
    }
    let (usage, stop_reason) = done.expect("a last event");
    assert!(text.contains("Paris"), "{text}");
    assert_eq!(stop_reason.as_deref(), Some("stop"), "{text}");
    assert!(usage.output_tokens < 100, "ended long before its cap: {usage:?}\n{text}");
    assert_eq!(counted, Some(usage.input_tokens), "counted before the call, as the model read it");
}

/// Two requests to one local worker at once, with prompts of the same length: what a plan sends
/// when two steps of the same shape run side by side (or `best-of-n` on a local worker). The
/// engine prefills them as one batch; each is answered in full.
#[tokio::test(flavor = "multi_thread")]
async fn two_prompts_of_one_length_at_once_are_both_answered() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let Some(model) = model().await else { return };
    let worker = Arc::new(LocalWorker { model: model.clone(), max_tokens: 60, temperature: Some(0.0) });
    let ask = |question: &'static str| {
        let worker = worker.clone();
        async move {
            let request = ChatRequest { messages: vec![Message::user(question)], ..ChatRequest::default() };
            let mut stream = worker.stream(request).await.map_err(|e| e.to_string())?;
            let mut text = String::new();
            while let Some(item) = stream.next().await {
                match item.map_err(|e| e.to_string())? {
                    ChatEvent::Text(t) => text.push_str(&t),
                    ChatEvent::Usage(_) | ChatEvent::Done { .. } => {}
                }
            }
            Ok::<String, String>(text)
        }
    };
    // Same words, other names: the same number of tokens, so neither is a cached prefix of the
    // other and both are prefilled together.
    let (sky, sea) = ("Name one colour of the sky.", "Name one colour of the sea.");
    let count =
        |q: &str| worker.input_tokens(&ChatRequest { messages: vec![Message::user(q)], ..ChatRequest::default() });
    assert_eq!(count(sky).await, count(sea).await, "the two prompts are the same length");
    let (a, b) = tokio::join!(ask(sky), ask(sea));
    for (question, answer) in [("sky", a), ("sea", b)] {
        let answer = answer.unwrap_or_else(|e| panic!("{question}: {e}"));
        assert!(!answer.trim().is_empty(), "{question}: an answer");
    }
}

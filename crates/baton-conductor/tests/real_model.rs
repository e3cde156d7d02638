//! The local conductor and a local worker on a real model: SmolLM2-135M-Instruct, a 98 MB Q4_1
//! GGUF fetched once by `scripts/fetch-test-model`. A random tiny model cannot show what these
//! check: that a plan ends as soon as its grammar is complete (the model's end-of-text token is
//! not its chat template's end-of-sequence token, and a GGUF has no generation config to say
//! so), that a worker's answer ends on its end-of-turn token, that greedy plans repeat exactly from the same cache,
//! and that the second plan for a pool reuses the prompt prefix the first one computed.

use baton_engine::accounting::unmetered;
use std::sync::Arc;

use baton_conductor::{ConductorOptions, LocalConductor};
use baton_engine::{PlanningContext, WorkerInfo};
use baton_local::{Generated, LocalModel, LocalModelConfig, LocalWorker};
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

/// Above a temperature of 0 the conductor really samples: the same prompt gives different
/// plans. The engine starts every request greedy (top-k 1), under which a temperature alone
/// changes nothing and a learning run's "samples" are one plan.
#[tokio::test(flavor = "multi_thread")]
async fn sampled_plans_differ_where_greedy_ones_repeat() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let Some(model) = model().await else { return };
    let conductor = LocalConductor::new(model.clone(), workers(3), options(1.0));
    let ctx = PlanningContext::question("Which of 91, 97 and 99 are prime numbers?", 3, 4);
    let mut texts = std::collections::BTreeSet::new();
    for sample in 0..4 {
        let (planned, _) = conductor
            .plan_with_stats(&ctx, &mut |_| {}, unmetered())
            .await
            .unwrap_or_else(|e| panic!("sample {sample}: {e}"));
        texts.insert(planned.raw);
    }
    assert!(texts.len() >= 2, "four samples at temperature 1 were one text: {texts:?}");
}

/// A worker's answer ends on its end-of-turn token, and its prompt is counted before the call
/// exactly as the model then reads it (what its reservation under a token cap counts).
#[tokio::test(flavor = "multi_thread")]
async fn a_local_worker_answer_ends_on_its_end_of_turn_token() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let Some(model) = model().await else { return };
    let worker = LocalWorker { model: model.clone(), max_tokens: 400, temperature: Some(0.0), top_p: None };
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

/// Eight requests to one local worker that runs up to four at once, batched, four in flight and
/// a new one as each ends: what a round of parallel steps on one local worker sends, or an eval
/// at its default concurrency. Each gets the answer it gets alone, word for word (greedy).
/// Before the engine's scheduler was mended, the fifth answer came back mangled every time ("A.
/// 200,0000" for "A. 200,000,000\nB. ..."): a sequence set aside mid-answer was restarted with
/// its whole text appended to its cache again.
#[tokio::test(flavor = "multi_thread")]
async fn requests_side_by_side_are_each_answered_as_alone() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let Some(path) = baton_tests::real_model() else { return };
    let config = LocalModelConfig { path, force_cpu: true, max_sequences: Some(4), ..Default::default() };
    let model = Arc::new(LocalModel::load(&config).await.expect("SmolLM2 loads"));
    let worker = Arc::new(LocalWorker { model, max_tokens: 128, temperature: Some(0.0), top_p: None });
    let ask = |question: &'static str| {
        let worker = worker.clone();
        async move {
            let task = format!(
                "{question}\n\nChoose one option. End your reply with a final line of the form `Answer: <letter>`."
            );
            let request = ChatRequest {
                system: Some(format!("You are one step of a larger workflow. The user's original question:\n\n{task}")),
                messages: vec![Message::user(task)],
                ..ChatRequest::default()
            };
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
    // Multiple-choice questions as a plan's step asks them: the question in the system prompt
    // after a fixed preamble (a prefix the cache shares), the subtask as the user turn.
    let questions = [
        "Of the following ions, which has the smallest radius?\n\nA. K+\nB. Ca2+\nC. Sc3+\nD. Rb+",
        "When did the first pharaohs emerge in Egypt?\n\nA. 3100 B.P.\nB. 4100 B.P.\nC. 5100 B.P.\nD. 6100 B.P.",
        "Which pair of expressions below are equivalent?\n\nA. 7(2x) and 9x\nB. 3x + 5x and 15x\nC. 4(2x — 6) and 8x — 24\nD. x+x+x+x and x^4",
        "Given two Boolean random variables, A and B, where P(A) = 1/2, P(B) = 1/3, and P(A | ¬B) = 1/4, what is P(A | B)?\n\nA. 1/6\nB. 1/4\nC. 3/4\nD. 1",
        "Approximately how many movies are watched in homes in the United States in one year?\n\nA. 200,000,000\nB. 2,000,000,000\nC. 20,000,000,000\nD. 200,000,000,000",
        "Applying irrelevant standards to the subject of the argument is the fallacy of\n\nA. ad crumenam\nB. ad antiquitatem\nC. false criteria\nD. hasty generalization",
        "The pattern of inheritance shown by glucose-6-phosphate dehydrogenase (G6PD) deficiency is:\n\nA. autosomal dominant.\nB. autosomal recessive.\nC. X-linked dominant.\nD. X-linked recessive.",
        "Which of the following is a fundamental aspect of the free market system?\n\nA. A high degree of government involvement.\nB. Public ownership of resources.\nC. Private property.\nD. Central planners set wages and prices.",
    ];
    // Together first: asked alone first, the prompts would be cached, and nothing prefilled.
    // Four in flight, a new one as each ends: requests arrive while others are decoding.
    let together: Vec<_> = futures::stream::iter(questions.map(ask)).buffered(4).collect().await;
    let mut alone = Vec::new();
    for q in questions {
        alone.push(ask(q).await.unwrap_or_else(|e| panic!("{q}: {e}")));
    }
    for ((q, alone), together) in questions.iter().zip(&alone).zip(together) {
        let together = together.unwrap_or_else(|e| panic!("{q}: {e}"));
        assert!(!alone.trim().is_empty(), "{q}: an answer");
        assert_eq!(&together, alone, "{q}: asked beside others, the answer it gets alone");
    }
}

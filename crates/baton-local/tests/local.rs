//! Local models with real (tiny, random) models through the real mistral.rs pipeline: loading
//! and why a load is refused, the end tokens found in a vocabulary, and local workers. What a
//! local conductor writes with them is `baton-conductor`'s `local_conductor` test.

use std::sync::Arc;

use baton_local::{LoadError, LocalModel, LocalModelConfig};
use tokio::sync::OnceCell;

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

#[tokio::test(flavor = "multi_thread")]
async fn loading_errors_name_the_file_and_what_to_do() {
    let missing =
        LocalModel::load(&LocalModelConfig { path: "/nonexistent/model.gguf".into(), ..Default::default() }).await;
    let e = missing.expect_err("missing");
    assert!(matches!(e, LoadError::NotFound { .. }), "{e}");
    assert!(e.to_string().starts_with("/nonexistent/model.gguf: not found; point to a .gguf file"), "{e}");

    let empty = tempfile::tempdir().expect("tempdir");
    let e = LocalModel::load(&LocalModelConfig { path: empty.path().to_path_buf(), ..Default::default() })
        .await
        .expect_err("no config.json");
    assert!(e.to_string().contains("config.json: not found"), "{e}");

    let dir = tempfile::tempdir().expect("tempdir");
    baton_tinymodel::write_safetensors_model(dir.path(), &baton_tinymodel::TinySpec::default()).expect("write");
    std::fs::write(dir.path().join("config.json"), r#"{"architectures": ["NoSuchModelForCausalLM"]}"#).expect("write");
    let e =
        LocalModel::load(&LocalModelConfig { path: dir.path().to_path_buf(), force_cpu: true, ..Default::default() })
            .await
            .expect_err("unknown architecture");
    assert!(e.to_string().starts_with(&dir.path().display().to_string()), "names the model: {e}");

    // A GGUF whose architecture the engine does not know: the tiny model's, renamed in its
    // `general.architecture` value.
    let gguf_dir = tempfile::tempdir().expect("tempdir");
    let file = gguf_dir.path().join("odd.gguf");
    baton_tinymodel::write_gguf_model(&file, &baton_tinymodel::TinySpec::default()).expect("write gguf");
    let mut bytes = std::fs::read(&file).expect("read gguf");
    let mut value = b"general.architecture".to_vec();
    value.extend(8u32.to_le_bytes()); // a string
    value.extend(5u64.to_le_bytes());
    let at = bytes.windows(value.len()).position(|w| w == value).expect("the architecture key") + value.len();
    assert_eq!(&bytes[at..at + 5], b"qwen2");
    bytes[at..at + 5].copy_from_slice(b"zorro");
    std::fs::write(&file, bytes).expect("write gguf");
    let e = LocalModel::load(&LocalModelConfig { path: file.clone(), force_cpu: true, ..Default::default() })
        .await
        .expect_err("unknown GGUF architecture");
    assert!(matches!(e, LoadError::Unsupported { .. }), "{e}");
    let shown = e.to_string();
    assert!(shown.starts_with(&file.display().to_string()), "names the file: {shown}");
    assert!(shown.contains("zorro"), "names the architecture: {shown}");
    assert!(shown.contains("run it in a server that supports it"), "says what to do: {shown}");

    // A BPE GGUF without its pre-tokenizer, as older conversions are: refused, saying what to use.
    let mut bytes = std::fs::read(gguf_dir.path().join("odd.gguf")).expect("read gguf");
    let key = b"tokenizer.ggml.pre";
    let at = bytes.windows(key.len()).position(|w| w == key).expect("the pre-tokenizer key");
    bytes[at..at + key.len()].copy_from_slice(b"tokenizer.ggml.prx");
    let at = bytes.windows(5).position(|w| w == b"zorro").expect("renamed architecture");
    bytes[at..at + 5].copy_from_slice(b"qwen2");
    let old = gguf_dir.path().join("old.gguf");
    std::fs::write(&old, bytes).expect("write gguf");
    let e = LocalModel::load(&LocalModelConfig { path: old, force_cpu: true, ..Default::default() })
        .await
        .expect_err("no pre-tokenizer");
    assert!(e.to_string().contains("tokenizer.ggml.pre"), "{e}");
    assert!(e.to_string().contains("a newer GGUF conversion"), "{e}");
}

/// A GGUF larger than the memory that is free is refused before the engine reads it, with the
/// figures. The file is the tiny model's, made sparse past its end: no disk or memory is used.
#[tokio::test(flavor = "multi_thread")]
async fn a_model_bigger_than_the_free_memory_is_refused_before_loading() {
    let Some(free) = baton_local::free_memory_bytes() else {
        eprintln!("skipped: no /proc/meminfo on this system");
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("big.gguf");
    baton_tinymodel::write_gguf_model(&file, &baton_tinymodel::TinySpec::default()).expect("write gguf");
    let size = free + (1 << 30);
    std::fs::OpenOptions::new().write(true).open(&file).and_then(|f| f.set_len(size)).expect("extend the file");

    let e = LocalModel::load(&LocalModelConfig { path: file.clone(), force_cpu: true, ..Default::default() })
        .await
        .expect_err("too big");
    let LoadError::TooBig { need, free_bytes, .. } = &e else { panic!("refused as too big, not {e:?}") };
    assert_eq!(need.weights_bytes, size);
    assert!(!need.fits(*free_bytes));
    let shown = e.to_string();
    assert!(shown.starts_with(&file.display().to_string()), "names the file: {shown}");
    assert!(shown.contains(&format!("{} MiB of weights", size >> 20)), "gives the figures: {shown}");
    assert!(shown.contains("pick a smaller model"), "says what to do: {shown}");
    assert!(shown.contains(baton_local::IGNORE_FREE_MEMORY), "says how to load it anyway: {shown}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_local_worker_streams_an_answer_and_stops_at_its_token_limit() {
    use baton_providers::{ChatEvent, ChatModel, ChatRequest, Message};
    use futures::StreamExt;
    let worker = baton_local::LocalWorker { model: model().await, max_tokens: 12, temperature: Some(1.0), top_p: None };
    let request = ChatRequest { messages: vec![Message::user("Say something.")], ..ChatRequest::default() };
    // What a call reserves for is what the model reads, and a remembered tokenization is never
    // taken for another prompt's.
    let reserved = worker.input_tokens(&request).await.expect("the prompt's tokens");
    let longer = ChatRequest { messages: vec![Message::user("Say something else.")], ..ChatRequest::default() };
    let reserved_longer = worker.input_tokens(&longer).await.expect("the prompt's tokens");
    assert!(reserved_longer > reserved, "{reserved_longer} > {reserved}");
    let run = async {
        let mut stream = worker.stream(request).await.expect("stream");
        let mut pieces = 0;
        let mut done = None;
        while let Some(item) = stream.next().await {
            match item.expect("no error") {
                ChatEvent::Text(_) => pieces += 1,
                ChatEvent::Usage(_) => {}
                ChatEvent::Done { usage, .. } => done = Some(usage),
            }
        }
        (pieces, done)
    };
    let (pieces, done) = tokio::time::timeout(std::time::Duration::from_secs(30), run).await.expect("finishes");
    let usage = done.expect("a Done event");
    assert!((1..=12).contains(&usage.output_tokens), "the usage counts what was generated: {usage:?}");
    assert_eq!(usage.input_tokens, reserved, "{usage:?}");
    assert!(pieces >= 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_local_worker_reports_usage_when_the_model_ends_its_answer() {
    use baton_providers::{ChatEvent, ChatModel, ChatRequest, Message};
    use futures::StreamExt;
    // A random model ends its answer with an end-of-text token after ~100 tokens on average, well
    // before this cap, so these runs finish by end of text rather than by length.
    let worker =
        baton_local::LocalWorker { model: model().await, max_tokens: 1000, temperature: Some(1.0), top_p: None };
    for i in 0..3 {
        let request = ChatRequest { messages: vec![Message::user(format!("Answer {i}."))], ..ChatRequest::default() };
        let mut stream = worker.stream(request).await.expect("stream");
        let mut done = None;
        while let Some(item) = stream.next().await {
            if let ChatEvent::Done { usage, stop_reason } = item.expect("no error") {
                done = Some((usage, stop_reason));
            }
        }
        let (usage, stop_reason) = done.expect("a Done event");
        assert!(usage.output_tokens >= 1 && usage.input_tokens > 0, "run {i}: {usage:?} ({stop_reason:?})");
    }
}

/// The end tokens are looked up in the model's own vocabulary; a model without an end-of-text
/// token loads (it can still answer as a worker) but is refused where a grammar must end.
#[tokio::test(flavor = "multi_thread")]
async fn the_end_tokens_come_from_the_vocabulary_and_without_end_of_text_no_grammar_can_end() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("no-end.gguf");
    let spec = baton_tinymodel::TinySpec { end_of_text: false, ..Default::default() };
    baton_tinymodel::write_gguf_model(&file, &spec).expect("write gguf");
    let config = LocalModelConfig { path: file.clone(), force_cpu: true, ..Default::default() };
    let no_end = LocalModel::load(&config).await.expect("it loads: it can still answer as a worker");
    assert!(no_end.end_tokens.end_of_text.is_empty(), "{:?}", no_end.end_tokens);
    assert_eq!(no_end.end_tokens.end_of_turn, vec![baton_tinymodel::IM_END]);
    let e = no_end.check_can_end_a_grammar().expect_err("refused");
    assert!(e.starts_with(&file.display().to_string()), "names the file: {e}");
    assert!(e.contains("no end-of-text token (</s>, <|endoftext|>"), "{e}");
    assert!(e.contains("use another build of the model"), "says what to do: {e}");

    // The vocabulary of the usual model has both kinds.
    let usual = model().await;
    assert_eq!(usual.end_tokens.end_of_text, vec![baton_tinymodel::ENDOFTEXT]);
    assert_eq!(usual.end_tokens.end_of_turn, vec![baton_tinymodel::IM_END]);
    assert_eq!(usual.check_can_end_a_grammar(), Ok(()));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gguf_without_a_chat_template_is_refused_at_load_and_answers_with_one_given() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("no-template.gguf");
    let spec = baton_tinymodel::TinySpec { chat_template: false, ..Default::default() };
    baton_tinymodel::write_gguf_model(&file, &spec).expect("write gguf");
    let config = LocalModelConfig { path: file.clone(), force_cpu: true, ..Default::default() };
    let e = match LocalModel::load(&config).await {
        Ok(_) => panic!("a GGUF without a chat template is refused at load, not at the first question"),
        Err(e) => e.to_string(),
    };
    assert!(e.starts_with(&file.display().to_string()), "names the file: {e}");
    assert!(e.contains("no chat template") && e.contains("--chat-template FILE"), "says what to do: {e}");

    let template = dir.path().join("chatml.jinja");
    std::fs::write(&template, baton_tinymodel::CHATML_TEMPLATE).expect("write template");
    let config = LocalModelConfig { chat_template: Some(template), ..config };
    let model = LocalModel::load(&config).await.unwrap_or_else(|e| panic!("loads with a template given: {e}"));
    let options = baton_local::GenerateOptions { max_tokens: 8, temperature: Some(1.0), ..Default::default() };
    let messages = [baton_providers::Message::user("Say something.")];
    let generated = model
        .generate(None, &messages, &options, &mut |_: &str| {})
        .await
        .unwrap_or_else(|e| panic!("answers with the template given: {e}"));
    assert!((1..=8).contains(&generated.usage.output_tokens), "{generated:?}");
}

/// In-situ quantization and dtypes apply to safetensors models, by their names; a GGUF is
/// quantized already.
#[tokio::test(flavor = "multi_thread")]
async fn isq_and_dtype_are_checked_when_loading() {
    let dir = tempfile::tempdir().expect("tempdir");
    baton_tinymodel::write_safetensors_model(dir.path(), &baton_tinymodel::TinySpec::default()).expect("write");
    let base = LocalModelConfig { path: dir.path().to_path_buf(), force_cpu: true, ..Default::default() };
    let bad_isq = LocalModel::load(&LocalModelConfig { isq: Some("Q9_Z".into()), ..base.clone() }).await;
    let e = bad_isq.expect_err("unknown isq");
    assert!(e.to_string().contains("isq \"Q9_Z\""), "{e}");
    let bad_dtype = LocalModel::load(&LocalModelConfig { dtype: Some("f7".into()), ..base.clone() }).await;
    assert!(bad_dtype.expect_err("unknown dtype").to_string().contains("dtype \"f7\""));

    let gguf = dir.path().join("tiny.gguf");
    baton_tinymodel::write_gguf_model(&gguf, &baton_tinymodel::TinySpec::default()).expect("write gguf");
    let e = LocalModel::load(&LocalModelConfig { path: gguf, isq: Some("Q4K".into()), ..base })
        .await
        .expect_err("GGUF is already quantized");
    assert!(e.to_string().contains("a GGUF file is already quantized"), "{e}");
}

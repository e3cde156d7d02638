//! Models that run in this process through mistral.rs: the conductor, and `local` workers.
//!
//! A model is a GGUF file (tokenizer and chat template from its metadata) or a safetensors
//! directory (config.json, tokenizer.json, weights, optional tokenizer_config.json or
//! chat_template.jinja), optionally with a LoRA adapter and a chat template override. Nothing
//! is fetched from the network: the token source is `None` and paths are local.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_providers::{ChatEvent, ChatModel, ChatRequest, ChatStream, ErrorKind, Message, ProviderError, Role, Usage};
use either::Either;
use futures::StreamExt;
use futures::future::BoxFuture;
use mistralrs::{
    Constraint, GgufModelBuilder, LoraModelBuilder, ModelDType, RequestBuilder, Response, TextMessageRole,
    TextMessages, TextModelBuilder, TokenSource,
};

/// Where and how to load a local model.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LocalModelConfig {
    /// A `.gguf` file or a safetensors model directory.
    pub path: PathBuf,
    /// A LoRA adapter directory (a fine-tuned conductor).
    pub lora: Option<PathBuf>,
    /// A chat template for models without one: `.jinja`, or a tokenizer_config-style `.json`.
    pub chat_template: Option<PathBuf>,
    /// Run on the CPU even when a GPU is available.
    pub force_cpu: bool,
    /// In-situ quantization of a safetensors model while loading, e.g. `Q4K`, `Q8_0`, `HQQ4`.
    pub isq: Option<String>,
    /// `auto`, `f32`, `f16` or `bf16`.
    pub dtype: Option<String>,
}

/// Why a model did not load. Each message names the file and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: not found; {hint}")]
    NotFound { path: String, hint: String },
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
    #[error("{path}: the model has no chat template; pass one with --chat-template FILE (a .jinja file)")]
    NoChatTemplate { path: String },
    #[error("{path}: this model's architecture is not supported: {message}")]
    Unsupported { path: String, message: String },
    #[error(
        "{path}: not enough memory to load the model ({message}); try a smaller model, a quantized GGUF, or `isq = \"Q4K\"`"
    )]
    OutOfMemory { path: String, message: String },
    #[error("{path}: could not load the model: {message}")]
    Failed { path: String, message: String },
}

/// A loaded model, shared by the conductor and any local workers that use the same file.
pub struct LocalModel {
    model: mistralrs::Model,
    path: PathBuf,
    pub load_time: Duration,
    pub device: String,
}

impl std::fmt::Debug for LocalModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalModel").field("path", &self.path).field("device", &self.device).finish_non_exhaustive()
    }
}

/// What one generation produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    pub text: String,
    pub usage: Usage,
    pub finish_reason: Option<String>,
    /// From the request to the first piece of text.
    pub time_to_first_token: Option<Duration>,
    pub prompt_tokens_per_sec: f32,
    pub decode_tokens_per_sec: f32,
}

/// Generation settings for one request.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GenerateOptions {
    /// A Lark grammar the output must follow.
    pub grammar: Option<String>,
    pub max_tokens: usize,
    /// `None` uses the model's generation defaults.
    pub temperature: Option<f64>,
}

/// Applies the options both of mistral.rs's builders take (device and chat template); the GGUF
/// and safetensors builders share no trait, hence a macro.
macro_rules! with_common_options {
    ($builder:expr, $config:expr, $template:expr) => {{
        let mut b = $builder;
        if $config.force_cpu {
            b = b.with_force_cpu();
        }
        if let Some(t) = &$template {
            b = if is_jinja(t) {
                b.with_jinja_explicit(t.display().to_string())
            } else {
                b.with_chat_template(t.display().to_string())
            };
        }
        b
    }};
}

impl LocalModel {
    pub async fn load(config: &LocalModelConfig) -> Result<LocalModel, LoadError> {
        let path = config.path.clone();
        let shown = path.display().to_string();
        if !path.exists() {
            return Err(LoadError::NotFound {
                path: shown,
                hint: "point to a .gguf file or a directory with config.json, tokenizer.json and *.safetensors".into(),
            });
        }
        let started = Instant::now();
        let template = match &config.chat_template {
            Some(t) if !t.exists() => {
                return Err(LoadError::NotFound {
                    path: t.display().to_string(),
                    hint: "the chat template file is missing".into(),
                });
            }
            other => other.clone(),
        };
        let is_gguf = path.is_file() && path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
        let built = if is_gguf {
            let dir = path.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf);
            let file = path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
            if config.lora.is_some() {
                return Err(LoadError::Invalid {
                    path: shown,
                    message: "LoRA adapters are supported with safetensors models; merge the adapter or use the safetensors base model".into(),
                });
            }
            if config.isq.is_some() || config.dtype.is_some() {
                return Err(LoadError::Invalid {
                    path: shown,
                    message: "isq and dtype apply to safetensors models; a GGUF file is already quantized (pick another GGUF file for another size)".into(),
                });
            }
            let b = GgufModelBuilder::new(dir.display().to_string(), vec![file]).with_token_source(TokenSource::None);
            with_common_options!(b, config, template).build().await
        } else if path.is_dir() {
            if !path.join("config.json").exists() {
                return Err(LoadError::NotFound {
                    path: path.join("config.json").display().to_string(),
                    hint: "a model directory needs config.json, tokenizer.json and *.safetensors".into(),
                });
            }
            let b = TextModelBuilder::new(path.display().to_string()).with_token_source(TokenSource::None);
            let mut b = with_common_options!(b, config, template);
            if let Some(isq) = &config.isq {
                let parsed = mistralrs::core::parse_isq_value(isq, None)
                    .map_err(|e| LoadError::Invalid { path: shown.clone(), message: format!("isq \"{isq}\": {e}") })?;
                b = b.with_isq(parsed);
            }
            if let Some(dtype) = &config.dtype {
                let parsed: ModelDType = dtype.parse().map_err(|e: String| LoadError::Invalid {
                    path: shown.clone(),
                    message: format!("dtype \"{dtype}\": {e}"),
                })?;
                b = b.with_dtype(parsed);
            }
            match &config.lora {
                Some(adapter) => {
                    if !adapter.exists() {
                        return Err(LoadError::NotFound {
                            path: adapter.display().to_string(),
                            hint: "the LoRA adapter directory is missing".into(),
                        });
                    }
                    LoraModelBuilder::from_text_model_builder(b, [adapter.display().to_string()]).build().await
                }
                None => b.build().await,
            }
        } else {
            return Err(LoadError::Invalid {
                path: shown,
                message: "expected a .gguf file or a safetensors model directory".into(),
            });
        };
        let model = built.map_err(|e| classify_load_error(&shown, &format!("{e:#}")))?;
        let device = if config.force_cpu { "cpu".to_owned() } else { device_name() };
        Ok(LocalModel { model, path, load_time: started.elapsed(), device })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Streams one generation; `on_text` sees each piece. Dropping the future stops it.
    pub async fn generate(
        &self,
        system: Option<&str>,
        messages: &[Message],
        options: &GenerateOptions,
        on_text: &mut (dyn FnMut(&str) + Send),
    ) -> Result<Generated, ProviderError> {
        let mut request = RequestBuilder::new();
        // The same turns again, to count the prompt's tokens if mistral.rs reports no usage.
        let mut turns = TextMessages::new();
        if let Some(system) = system {
            request = request.add_message(TextMessageRole::System, system);
            turns = turns.add_message(TextMessageRole::System, system);
        }
        for m in messages {
            let role = match m.role {
                Role::User => TextMessageRole::User,
                Role::Assistant => TextMessageRole::Assistant,
            };
            request = request.add_message(role.clone(), &m.content);
            turns = turns.add_message(role, &m.content);
        }
        if let Some(grammar) = &options.grammar {
            request = request.set_constraint(Constraint::Lark(grammar.clone()));
        }
        request = request.set_sampler_max_len(options.max_tokens);
        // Without a temperature the model's own generation defaults apply. (mistral.rs 0.8.1's
        // deterministic sampler never finished a stream here, so it is not used.)
        if let Some(t) = options.temperature {
            request = request.set_sampler_temperature(t);
        }
        let started = Instant::now();
        let mut stream =
            self.model.stream_chat_request(request).await.map_err(|e| generation_error(&format!("{e:#}")))?;
        let mut out = Generated {
            text: String::new(),
            usage: Usage::default(),
            finish_reason: None,
            time_to_first_token: None,
            prompt_tokens_per_sec: 0.0,
            decode_tokens_per_sec: 0.0,
        };
        while let Some(response) = stream.next().await {
            match response {
                Response::Chunk(chunk) => {
                    for choice in chunk.choices {
                        if let Some(text) = choice.delta.content
                            && !text.is_empty()
                        {
                            out.time_to_first_token.get_or_insert_with(|| started.elapsed());
                            on_text(&text);
                            out.text.push_str(&text);
                        }
                        if choice.finish_reason.is_some() {
                            out.finish_reason = choice.finish_reason;
                        }
                    }
                    if let Some(u) = chunk.usage {
                        out.usage =
                            Usage { input_tokens: u.prompt_tokens as u64, output_tokens: u.completion_tokens as u64 };
                        out.prompt_tokens_per_sec = u.avg_prompt_tok_per_sec;
                        out.decode_tokens_per_sec = u.avg_compl_tok_per_sec;
                    }
                    if out.finish_reason.is_some() {
                        break;
                    }
                }
                Response::Done(done) => {
                    out.usage = Usage {
                        input_tokens: done.usage.prompt_tokens as u64,
                        output_tokens: done.usage.completion_tokens as u64,
                    };
                    break;
                }
                Response::ModelError(message, _) => return Err(generation_error(&message)),
                Response::InternalError(e) | Response::ValidationError(e) => {
                    return Err(generation_error(&e.to_string()));
                }
                _ => {}
            }
        }
        if out.finish_reason.is_none() && out.usage == Usage::default() {
            // mistral.rs 0.8.1 sends no last chunk (so no finish reason and no usage) when the
            // model ends on an end-of-text token that decodes to nothing: the stream just ends.
            // Count the tokens here instead, so token caps and the history see real numbers.
            out.usage = self.count_tokens(turns, &out.text).await;
            let reason = if out.usage.output_tokens >= options.max_tokens as u64 { "length" } else { "stop" };
            out.finish_reason = Some(reason.to_owned());
        }
        Ok(out)
    }

    /// The prompt's tokens as the chat template renders it, and the answer's plus its
    /// end-of-text token.
    async fn count_tokens(&self, turns: TextMessages, answer: &str) -> Usage {
        let prompt = self.model.tokenize(Either::Left(turns), None, true, true, None).await;
        let answer = self.model.tokenize(Either::Right(answer.to_owned()), None, false, false, None).await;
        Usage {
            input_tokens: prompt.map_or(0, |t| t.len() as u64),
            output_tokens: answer.map_or(0, |t| t.len() as u64 + 1),
        }
    }
}

fn is_jinja(path: &Path) -> bool {
    !path.extension().is_some_and(|e| e.eq_ignore_ascii_case("json"))
}

fn device_name() -> String {
    match mistralrs::best_device(false) {
        Ok(d) if d.is_cuda() => "cuda".to_owned(),
        Ok(d) if d.is_metal() => "metal".to_owned(),
        _ => "cpu".to_owned(),
    }
}

fn classify_load_error(path: &str, message: &str) -> LoadError {
    let lower = message.to_ascii_lowercase();
    let path = path.to_owned();
    let message = message.lines().next().unwrap_or(message).to_owned();
    if lower.contains("chat template") || lower.contains("chat_template") {
        LoadError::NoChatTemplate { path }
    } else if lower.contains("out of memory") || lower.contains("outofmemory") || lower.contains("cannot allocate") {
        LoadError::OutOfMemory { path, message }
    } else if lower.contains("architecture") || lower.contains("unknown variant") || lower.contains("not supported") {
        LoadError::Unsupported { path, message }
    } else {
        LoadError::Failed { path, message }
    }
}

fn generation_error(message: &str) -> ProviderError {
    if message.to_ascii_lowercase().contains("chat template") {
        return ProviderError::new(
            ErrorKind::BadRequest,
            format!("{message}; give the model a chat template (chat_template = \"FILE.jinja\")"),
        );
    }
    ProviderError::new(ErrorKind::Overloaded, format!("local generation failed: {message}"))
}

/// A pool worker that runs on a local model (`provider = "local"`).
#[derive(Debug, Clone)]
pub struct LocalWorker {
    pub model: Arc<LocalModel>,
    pub max_tokens: usize,
    pub temperature: Option<f64>,
}

impl ChatModel for LocalWorker {
    fn stream(&self, request: ChatRequest) -> BoxFuture<'static, Result<ChatStream, ProviderError>> {
        let me = self.clone();
        Box::pin(async move {
            let (tx, rx) = futures::channel::mpsc::unbounded();
            // Generation runs while the stream is read; dropping the stream drops the task's
            // receiver side, and dropping this task's future stops generation.
            let task = async move {
                let mut send = |t: &str| {
                    let _ = tx.unbounded_send(Ok(ChatEvent::Text(t.to_owned())));
                };
                let options = GenerateOptions {
                    grammar: None,
                    max_tokens: request.max_tokens.map_or(me.max_tokens, |m| m as usize),
                    temperature: me.temperature,
                };
                let result = me.model.generate(request.system.as_deref(), &request.messages, &options, &mut send).await;
                match result {
                    Ok(g) => {
                        let _ = tx.unbounded_send(Ok(ChatEvent::Done { usage: g.usage, stop_reason: g.finish_reason }));
                    }
                    Err(e) => {
                        let _ = tx.unbounded_send(Err(e));
                    }
                }
            };
            let stream = futures::stream::select(rx, futures::stream::once(task).filter_map(|()| async { None }));
            Ok(stream.boxed())
        })
    }
}

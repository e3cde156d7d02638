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
    Constraint, GgufModelBuilder, LoraModelBuilder, ModelDType, RequestBuilder, Response, StopTokens, TextMessageRole,
    TextMessages, TextModelBuilder, TokenSource,
};

/// Where and how to load a local model. Two configs that differ in anything load two models.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
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
    /// How many requests the engine runs at once, batched; `None`: one (see `MAX_SEQUENCES`).
    pub max_sequences: Option<usize>,
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
    #[error(
        "{path}: this model is not supported by Baton's local engine: {message}; run it in a server that supports it (llama.cpp, vLLM, Ollama) and add that as an openai-compatible worker or remote conductor"
    )]
    Unsupported { path: String, message: String },
    #[error(
        "{path}: not enough memory to load the model ({message}); try a smaller model, a quantized GGUF, or `isq = \"Q4K\"`"
    )]
    OutOfMemory { path: String, message: String },
    #[error(
        "{path}: not enough free memory to load this model: it needs about {} MiB ({} MiB of weights and {} MiB for the engine) and {} MiB is free; close other programs or local models, or pick a smaller model or quantization (a 1.5B Q4_K_M GGUF needs about 1.3 GiB). To load it anyway (swap), set {}=1",
        .need.total_bytes() >> 20, .need.weights_bytes >> 20, .need.overhead_bytes >> 20, .free_bytes >> 20, IGNORE_FREE_MEMORY
    )]
    TooBig { path: String, need: MemoryNeed, free_bytes: u64 },
    #[error("{path}: could not load the model: {message}")]
    Failed { path: String, message: String },
}

mod cache;
mod memory;
mod tokenizer;

pub use memory::{IGNORE_FREE_MEMORY, MemoryNeed, free_memory_bytes, weights_bytes};

/// The name a LoRA adapter is loaded under; mistral.rs applies an adapter only to the requests
/// that name it.
const LORA_ALIAS: &str = "baton";

/// Spellings of end-of-text tokens, as llguidance's token trie recognizes them
/// (`toktrie_hf_tokenizers`): once a grammar is complete, llguidance allows only that token.
const END_OF_TEXT: &[&str] = &["</s>", "<|endoftext|>", "<|end_of_text|>", "<｜end▁of▁sentence｜>", "<eos>"];
/// Spellings of end-of-turn tokens that chat templates close an assistant turn with.
const END_OF_TURN: &[&str] = &["<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|eom_id|>"];

/// The tokens that end a generation, found in the model's own vocabulary.
///
/// mistral.rs stops on its chat template's end-of-sequence token (and a few end-of-turn
/// tokens). Once a grammar accepts, mistral.rs 0.9 lets that token through, but once the grammar
/// is complete llguidance still offers its own end-of-text token, which for many models (Qwen2
/// and 2.5, SmolLM2, Llama 3) is another one; a GGUF carries no generation_config.json to add it
/// to mistral.rs's list. A model that picks it (measured: the tiny random GGUF conductor, every
/// plan) would go on decoding that silent token until the length cap, unless these are stop
/// tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndTokens {
    pub end_of_text: Vec<u32>,
    pub end_of_turn: Vec<u32>,
}

impl EndTokens {
    /// Every token that ends a generation.
    pub fn all(&self) -> Vec<u32> {
        let mut all = self.end_of_text.clone();
        all.extend(self.end_of_turn.iter().filter(|t| !self.end_of_text.contains(t)));
        all
    }
}

/// A loaded model, shared by the conductor and any local workers that use the same file.
pub struct LocalModel {
    model: mistralrs::Model,
    path: PathBuf,
    pub load_time: Duration,
    pub device: String,
    /// How much the process's resident memory grew while the model loaded (Linux; `None`
    /// elsewhere). On a GPU the weights live in its memory instead and this stays small.
    pub memory_bytes: Option<u64>,
    /// The part of `memory_bytes` backed by files: the program's code, read in as loading first
    /// runs it (the GGUF's pages are given back as its tensors are copied out).
    pub code_bytes: Option<u64>,
    pub end_tokens: EndTokens,
    /// Whether requests apply the LoRA adapter loaded under [`LORA_ALIAS`].
    lora: bool,
    /// The latest generation's speed, for whoever shows how fast the model runs.
    last: std::sync::Mutex<Option<Speed>>,
    /// The sequences mistral.rs's prefix cache holds, for how much of a prompt came from it.
    cached: cache::PrefixMirror,
    /// The latest prompts tokenized, newest last: a call's reservation counts its prompt's
    /// tokens and the generation that follows needs the same tokens, so it reads them here.
    prompts: std::sync::Mutex<std::collections::VecDeque<(String, Arc<Vec<u32>>)>>,
}

/// How many tokenized prompts are kept: enough for the calls that reserve at about the same
/// time (a round's parallel steps on one local model) to find theirs when they generate.
const PROMPT_MEMO: usize = 8;

/// How many finished sequences' attention caches a model keeps for prompts that start as theirs
/// did, the oldest dropped first. A pool's fixed prompt needs one; a few more serve the app's
/// conversations and pools side by side. Each costs its sequence's cache: about 28 MiB for a
/// 1.5B conductor's plan, so 8 stay under a sixth of that model's memory.
const PREFIX_CACHE_SEQUENCES: usize = 8;

/// How many sequences a model runs at once unless its config says otherwise: one, and requests
/// queue. On two CPU cores that is faster than batching: 60 greedy MMLU items on SmolLM2 took
/// 35 s one at a time and 43 s four at a time, with the same 60 answers. The engine batches
/// only sequences of one length, so requests of different lengths take turns, and each turn
/// copies every cache of the batch anew.
const MAX_SEQUENCES: usize = 1;

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
    /// `stop` (an end token) or `length` (the token cap), as mistral.rs reports it; `complete`
    /// when Baton ended the stream itself after the text was complete (`cut_after_complete`).
    pub finish_reason: Option<String>,
    /// True when Baton ended the stream itself: the text was complete but the model had not
    /// stopped soon after (see [`GenerateOptions::complete_at`]).
    pub cut_after_complete: bool,
    /// From the request to the first piece of text.
    pub time_to_first_token: Option<Duration>,
    pub prompt_tokens_per_sec: f32,
    pub decode_tokens_per_sec: f32,
}

/// How fast one generation ran.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Speed {
    /// Prompt tokens the model computed (those the prefix cache did not hold) per second.
    pub prompt_tokens_per_sec: f64,
    pub decode_tokens_per_sec: f64,
    pub prompt_tokens: u64,
    pub cached_prompt_tokens: u64,
    pub output_tokens: u64,
}

/// Generation settings for one request.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GenerateOptions {
    /// A Lark grammar the output must follow.
    pub grammar: Option<String>,
    pub max_tokens: usize,
    /// `None` uses the model's generation defaults; `Some(0.0)` is greedy.
    pub temperature: Option<f64>,
    /// Text that can only end a complete answer (a plan's closing fence): once the text ends
    /// with it, after an earlier fence (the opening one, which passes through the same text as
    /// it is written), the model gets a short grace to stop by itself, then the stream is
    /// dropped. A guard behind the stop tokens, for a model whose end token Baton did not find.
    pub complete_at: Option<String>,
}

/// Applies the options both of mistral.rs's builders take (device and chat template); the GGUF
/// and safetensors builders share no trait, hence a macro.
macro_rules! with_common_options {
    ($builder:expr, $config:expr, $template:expr) => {{
        let mut b = $builder
            .with_prefix_cache_n(Some(PREFIX_CACHE_SEQUENCES))
            .with_max_num_seqs($config.max_sequences.unwrap_or(MAX_SEQUENCES).max(1));
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
        let shown = config.path.display().to_string();
        // The engine takes a directory it cannot find for a Hugging Face repository's name, as
        // it took the directory "" of a bare `model.gguf`.
        let path = std::path::absolute(&config.path).unwrap_or_else(|_| config.path.clone());
        if !path.exists() {
            return Err(LoadError::NotFound {
                path: shown,
                hint: "point to a .gguf file or a directory with config.json, tokenizer.json and *.safetensors".into(),
            });
        }
        let device = if config.force_cpu { "cpu".to_owned() } else { device_name() };
        memory::check_free_memory(&path, config, device == "cpu")?;
        let started = Instant::now();
        let resident_before = memory::Resident::now();
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
        // A safetensors model's window is not read: its cached counts assume none.
        let mut sliding_window = None;
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
            let header = tokenizer::read_gguf_header(&path);
            // The engine loads a GGUF without a chat template and then fails at its first request.
            if template.is_none() && !header.chat_template {
                return Err(LoadError::NoChatTemplate { path: shown });
            }
            sliding_window = header.sliding_window;
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
                    LoraModelBuilder::from_text_model_builder(b)
                        .with_adapter(LORA_ALIAS, adapter.display().to_string())
                        .build()
                        .await
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
        memory::release_free_heap();
        let end_tokens = find_end_tokens(&model).await;
        let (memory_bytes, code_bytes) = memory::Resident::now().growth_since(resident_before);
        Ok(LocalModel {
            model,
            path,
            load_time: started.elapsed(),
            device,
            memory_bytes,
            code_bytes,
            end_tokens,
            lora: config.lora.is_some(),
            last: std::sync::Mutex::new(None),
            cached: cache::PrefixMirror::new(PREFIX_CACHE_SEQUENCES, sliding_window),
            prompts: std::sync::Mutex::new(std::collections::VecDeque::new()),
        })
    }

    /// Refuses a model whose constrained generations could not end: llguidance ends a complete
    /// grammar with an end-of-text token, and falls back to token 0 (an ordinary piece of text
    /// in most vocabularies) when the vocabulary has none.
    pub fn check_can_end_a_grammar(&self) -> Result<(), String> {
        if self.end_tokens.end_of_text.is_empty() {
            return Err(format!(
                "{}: the model's tokenizer has no end-of-text token ({}), so a plan written under the plan grammar could not end; use another build of the model (its GGUF metadata or tokenizer.json should list one), or a remote conductor",
                self.path.display(),
                END_OF_TEXT.join(", ")
            ));
        }
        Ok(())
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
        for (role, content) in chat_turns(system, messages) {
            request = request.add_message(role, content);
        }
        if let Some(grammar) = &options.grammar {
            request = request.set_constraint(Constraint::Lark(grammar.clone()));
        }
        // Without a temperature the model's own generation defaults apply; 0 is greedy.
        if let Some(t) = options.temperature {
            request = request.set_sampler_temperature(t);
        }
        if self.lora {
            request = request.set_adapter(LORA_ALIAS);
        }
        request = request.set_sampler_max_len(options.max_tokens);
        request = request.set_sampler_stop_toks(StopTokens::Ids(self.end_tokens.all()));
        // The prompt's tokens (as the call's reservation counted them: remembered, not tokenized
        // again), to count them and what the prefix cache holds. mistral.rs tokenizes on its own.
        let prompt_tokens = self.prompt(system, messages).await.map(|t| t.to_vec()).unwrap_or_default();
        let cached_tokens = self.cached.cached_prefix(&prompt_tokens);

        let started = Instant::now();
        let mut stream =
            self.model.stream_chat_request(request).await.map_err(|e| generation_error(&format!("{e:#}")))?;
        let mut out = Generated {
            text: String::new(),
            usage: Usage::default(),
            finish_reason: None,
            cut_after_complete: false,
            time_to_first_token: None,
            prompt_tokens_per_sec: 0.0,
            decode_tokens_per_sec: 0.0,
        };
        let mut pieces = 0u32;
        // Set when the text first ends with `complete_at`: the moment Baton stops waiting for the
        // end token. Fixed then, so that tokens which decode to nothing (mistral.rs still sends a
        // chunk for each) cannot keep a finished answer alive; reset only by more text.
        let mut deadline: Option<tokio::time::Instant> = None;
        loop {
            // The opening fence (`\n```python\n`) passes through `\n```` on its way; only a
            // fence after an earlier one closes the plan (reasoning holds no backticks).
            let complete = options
                .complete_at
                .as_deref()
                .is_some_and(|end| out.text.strip_suffix(end).is_some_and(|before| before.contains(end.trim_start())));
            if !complete {
                deadline = None;
            } else if deadline.is_none() {
                // The answer is whole: its end token is the very next one. Wait a few tokens'
                // time for it (the finish reason and usage come with it), no longer.
                let per_piece = out
                    .time_to_first_token
                    .map_or(Duration::ZERO, |first| started.elapsed().saturating_sub(first) / pieces.max(1));
                let grace = (per_piece * 4).clamp(Duration::from_millis(500), Duration::from_secs(10));
                deadline = Some(tokio::time::Instant::now() + grace);
            }
            let next = match deadline {
                Some(deadline) => match tokio::time::timeout_at(deadline, stream.next()).await {
                    Ok(next) => next,
                    Err(_) => {
                        out.cut_after_complete = true;
                        break;
                    }
                },
                None => stream.next().await,
            };
            let Some(response) = next else { break };
            match response {
                Response::Chunk(chunk) => {
                    for choice in chunk.choices {
                        if let Some(text) = choice.delta.content
                            && !text.is_empty()
                        {
                            out.time_to_first_token.get_or_insert_with(|| started.elapsed());
                            pieces += 1;
                            on_text(&text);
                            out.text.push_str(&text);
                        }
                        if choice.finish_reason.is_some() {
                            out.finish_reason = choice.finish_reason;
                        }
                    }
                    if let Some(u) = chunk.usage {
                        out.usage = Usage {
                            input_tokens: u.prompt_tokens as u64,
                            output_tokens: u.completion_tokens as u64,
                            ..Usage::default()
                        };
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
                        ..Usage::default()
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
        drop(stream);
        let answer_tokens =
            self.model.tokenize(Either::Right(out.text.clone()), None, false, false, None).await.unwrap_or_default();
        if out.usage == Usage::default() {
            // mistral.rs sends no last chunk (so no finish reason and no usage) when Baton cut a
            // complete answer short by dropping the stream. Count the tokens here instead, so
            // token caps and the history see real numbers: the prompt as the chat template
            // renders it, and the answer plus its end token (none when Baton cut it).
            let end = u64::from(!out.cut_after_complete);
            out.usage = Usage {
                input_tokens: prompt_tokens.len() as u64,
                output_tokens: answer_tokens.len() as u64 + end,
                ..Usage::default()
            };
            let reason = if out.cut_after_complete {
                "complete"
            } else if out.usage.output_tokens >= options.max_tokens as u64 {
                "length"
            } else {
                "stop"
            };
            out.finish_reason = Some(reason.to_owned());
        }
        out.usage.cached_input_tokens = cached_tokens.min(out.usage.input_tokens as usize) as u64;
        self.note_speed(&mut out, started.elapsed());
        if !out.cut_after_complete {
            // mistral.rs caches a finished sequence's KV (not a dropped one), whether or not it
            // sent a last chunk.
            let mut sequence = prompt_tokens;
            sequence.extend(answer_tokens);
            self.cached.remember(sequence);
        }
        Ok(out)
    }

    /// The latest generation's speed (`None` before the first).
    pub fn last_speed(&self) -> Option<Speed> {
        *self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Fills in the rates mistral.rs did not report (it sends no usage chunk when a sequence
    /// ends on a silent end token or is cut) from the timings, and keeps them as the latest.
    fn note_speed(&self, out: &mut Generated, total: Duration) {
        let fresh = out.usage.input_tokens.saturating_sub(out.usage.cached_input_tokens);
        if let Some(first) = out.time_to_first_token {
            if out.prompt_tokens_per_sec <= 0.0 && !first.is_zero() {
                out.prompt_tokens_per_sec = fresh as f32 / first.as_secs_f32();
            }
            let decoding = total.saturating_sub(first);
            if out.decode_tokens_per_sec <= 0.0 && !decoding.is_zero() {
                out.decode_tokens_per_sec = out.usage.output_tokens.saturating_sub(1) as f32 / decoding.as_secs_f32();
            }
        }
        *self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Speed {
            prompt_tokens_per_sec: f64::from(out.prompt_tokens_per_sec),
            decode_tokens_per_sec: f64::from(out.decode_tokens_per_sec),
            prompt_tokens: out.usage.input_tokens,
            cached_prompt_tokens: out.usage.cached_input_tokens,
            output_tokens: out.usage.output_tokens,
        });
    }

    /// How many tokens the model reads for this prompt, its chat template applied: what a call's
    /// reservation counts (its bytes, the bound for a model whose tokenizer Baton does not hold,
    /// are about four times as many). `None` when the template cannot be applied.
    pub async fn prompt_tokens(&self, system: Option<&str>, messages: &[Message]) -> Option<u64> {
        self.prompt(system, messages).await.map(|tokens| tokens.len() as u64)
    }

    /// The prompt's tokens as the model reads them: the chat template applied, then tokenized
    /// (once per prompt: a recent prompt's tokens are remembered).
    async fn prompt(&self, system: Option<&str>, messages: &[Message]) -> Option<Arc<Vec<u32>>> {
        let key = prompt_key(system, messages);
        let memo = || self.prompts.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, tokens)) = memo().iter().find(|(k, _)| *k == key) {
            return Some(tokens.clone());
        }
        let mut turns = TextMessages::new();
        for (role, content) in chat_turns(system, messages) {
            turns = turns.add_message(role, content);
        }
        let tokens = Arc::new(self.model.tokenize(Either::Left(turns), None, true, true, None).await.ok()?);
        let mut memo = memo();
        if memo.len() == PROMPT_MEMO {
            memo.pop_front();
        }
        memo.push_back((key, tokens.clone()));
        Some(tokens)
    }

    /// How many tokens `text` is, as the model's tokenizer splits it (no special tokens added).
    pub async fn token_count(&self, text: &str) -> usize {
        self.model.tokenize(Either::Right(text.to_owned()), None, false, false, None).await.map_or(0, |t| t.len())
    }
}

/// Looks each end-token spelling up in the model's vocabulary: a spelling that tokenizes to one
/// token is one of its added (special) tokens.
async fn find_end_tokens(model: &mistralrs::Model) -> EndTokens {
    let mut found = EndTokens::default();
    for (names, into) in [(END_OF_TEXT, &mut found.end_of_text), (END_OF_TURN, &mut found.end_of_turn)] {
        for name in names {
            if let Ok(ids) = model.tokenize(Either::Right((*name).to_owned()), None, false, false, None).await
                && let [id] = ids[..]
                && !into.contains(&id)
            {
                into.push(id);
            }
        }
    }
    found
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
    if lower.contains("tokenizer.ggml.pre") {
        // Older GGUF conversions lack the pre-tokenizer; the engine will not guess it.
        LoadError::Unsupported {
            path,
            message: format!(
                "{message} (a newer GGUF conversion of the model has it: llama.cpp's convert_hf_to_gguf.py writes it; or use the model's safetensors directory)"
            ),
        }
    } else if lower.contains("chat template") || lower.contains("chat_template") {
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

/// A prompt as mistral.rs's chat turns: the system message, if any, then each message.
fn chat_turns<'a>(
    system: Option<&'a str>,
    messages: &'a [Message],
) -> impl Iterator<Item = (TextMessageRole, &'a str)> + 'a {
    let rest = messages.iter().map(|m| {
        let role = match m.role {
            Role::User => TextMessageRole::User,
            Role::Assistant => TextMessageRole::Assistant,
        };
        (role, m.content.as_str())
    });
    system.map(|s| (TextMessageRole::System, s)).into_iter().chain(rest)
}

/// A prompt's turns as one string that tells any two prompts apart: each part is preceded by
/// its length, so no content can pass for a boundary.
fn prompt_key(system: Option<&str>, messages: &[Message]) -> String {
    let mut key = String::new();
    for (role, content) in chat_turns(system, messages) {
        key.push_str(&format!("{role:?}:{}:", content.len()));
        key.push_str(content);
    }
    key
}

/// A pool worker that runs on a local model (`provider = "local"`).
#[derive(Debug, Clone)]
pub struct LocalWorker {
    pub model: Arc<LocalModel>,
    pub max_tokens: usize,
    pub temperature: Option<f64>,
}

impl ChatModel for LocalWorker {
    fn input_tokens(&self, request: &ChatRequest) -> BoxFuture<'static, Option<u64>> {
        let (model, system, messages) = (self.model.clone(), request.system.clone(), request.messages.clone());
        Box::pin(async move { model.prompt_tokens(system.as_deref(), &messages).await })
    }

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
                    temperature: request.temperature.map(f64::from).or(me.temperature),
                    complete_at: None,
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

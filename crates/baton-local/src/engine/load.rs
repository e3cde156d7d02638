//! Loading a model, and why a load is refused: each refusal names the file and what to do.

use std::path::{Path, PathBuf};
use std::time::Instant;

use mistralrs::{GgufModelBuilder, LoraModelBuilder, ModelDType, TextModelBuilder, TokenSource};

use super::memory::{self, IGNORE_FREE_MEMORY, MemoryNeed};
use super::{LORA_ALIAS, LocalModel, cache, find_end_tokens, gguf};

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
    /// Loads the model `config` names. Refused before the engine reads it when a file is
    /// missing, a setting does not apply to the kind of model, a GGUF has no chat template, or
    /// the free memory cannot hold it on the CPU.
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
        if let Some((need, free_bytes)) = memory::shortfall(&path, config.isq.is_some(), device == "cpu") {
            return Err(LoadError::TooBig { path: path.display().to_string(), need, free_bytes });
        }
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
            let header = gguf::read_gguf_header(&path);
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

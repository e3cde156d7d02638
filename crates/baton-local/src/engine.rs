//! Models that run in this process through mistral.rs: the one module that touches the engine.
//!
//! A model is a GGUF file (tokenizer and chat template from its metadata) or a safetensors
//! directory (config.json, tokenizer.json, weights, optional tokenizer_config.json or
//! chat_template.jinja), optionally with a LoRA adapter and a chat template override. Nothing
//! is fetched from the network: the token source is `None` and paths are local.
//!
//! This file holds [`LocalModel`] and what reads its vocabulary; its children `load` (loading,
//! and why a load is refused, after `memory` has checked that the model fits and `gguf` has read
//! a GGUF's header) and `generate` (one streamed generation); `cache` mirrors what the engine's
//! prefix cache holds.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use baton_providers::{Message, Role};
use either::Either;
use mistralrs::{TextMessageRole, TextMessages};

mod cache;
mod generate;
mod gguf;
mod load;
mod memory;

pub use generate::{GenerateOptions, Generated};
pub use load::{LoadError, LocalModelConfig};
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

impl std::fmt::Debug for LocalModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalModel").field("path", &self.path).field("device", &self.device).finish_non_exhaustive()
    }
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

impl LocalModel {
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

    /// The latest generation's speed (`None` before the first).
    pub fn last_speed(&self) -> Option<Speed> {
        *self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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
        self.text_tokens(text).await.len()
    }

    /// `text`'s tokens, no special tokens added; none when the tokenizer fails.
    async fn text_tokens(&self, text: &str) -> Vec<u32> {
        self.model.tokenize(Either::Right(text.to_owned()), None, false, false, None).await.unwrap_or_default()
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

//! Writes a tiny random-weight chat model that loads through the real mistral.rs pipeline, so
//! tests run a real model with no download: a Qwen2-architecture `model.safetensors`,
//! `config.json`, a byte-level BPE `tokenizer.json` (256 byte tokens plus three specials), a
//! ChatML chat template (optionally one that refuses two turns of the same role in a row) and
//! `generation_config.json`. The same seed gives the same files.
//!
//! The weights are random, so the text is noise; what the tests check is everything around it:
//! loading, templating, constrained decoding, streaming, cancellation.

use std::collections::BTreeMap;
use std::io;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};
use serde_json::json;

/// Shape of the tiny model. The defaults give ≈ 0.2 M parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct TinySpec {
    pub seed: u64,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// Scale of the uniform random weights.
    pub init: f32,
    /// Whether token 256 is `<|endoftext|>`; without it (named `<|padding|>` instead) the
    /// vocabulary has no end-of-text token, which a constrained generation needs to end.
    pub end_of_text: bool,
    /// Whether the chat template refuses two turns of the same role in a row (it raises, as
    /// Mistral's, Gemma's and many GGUF templates do) instead of rendering them.
    pub alternating_turns: bool,
    /// Whether the GGUF's metadata holds the chat template (`tokenizer.chat_template`); base
    /// models' GGUFs often have none.
    pub chat_template: bool,
    /// Whether the vocabulary ends with a user-defined newline token ([`USER_NEWLINE`]): text
    /// the tokenizer keeps whole but not a special token, as Gemma's GGUFs hold their newlines
    /// and Qwen2.5's its tool-call tags (token type 4).
    pub user_defined_newline: bool,
    /// Whether the GGUF's vocabulary is SentencePiece's (`tokenizer.ggml.model` "llama", as
    /// Gemma's, Mistral's and Phi-3's are) instead of byte-level BPE: byte tokens `<0x00>`…,
    /// the special tokens, then [`SENTENCEPIECE_PIECES`] and `<unk>`, with no space prefix
    /// (Gemma's `add_space_prefix = false`). GGUF only.
    pub sentencepiece: bool,
}

impl Default for TinySpec {
    fn default() -> Self {
        TinySpec {
            seed: 7,
            hidden: 64,
            intermediate: 128,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            init: 0.08,
            end_of_text: true,
            alternating_turns: false,
            chat_template: true,
            user_defined_newline: false,
            sentencepiece: false,
        }
    }
}

/// Token ids of the special tokens, after the 256 byte tokens.
pub const ENDOFTEXT: u32 = 256;
pub const IM_START: u32 = 257;
pub const IM_END: u32 = 258;
/// The vocabulary is exactly the tokenizer's: a larger `vocab_size` makes constrained decoding
/// reject the padding ids.
pub const VOCAB: usize = 259;
/// The user-defined newline token, where [`TinySpec::user_defined_newline`] asks for one.
pub const USER_NEWLINE: u32 = 259;

/// The vocabulary's size for `spec`.
fn vocab(spec: &TinySpec) -> usize {
    let sentencepiece = if spec.sentencepiece { SENTENCEPIECE_PIECES.len() + 1 } else { 0 };
    VOCAB + usize::from(spec.user_defined_newline) + sentencepiece
}

/// The text pieces of the SentencePiece vocabulary and their scores, as llama.cpp writes them
/// for Gemma: single characters score 0 and joined pieces below that, the first joined the
/// highest. Joined by score, "the" is one token ("th", then "the"); read as a unigram model's
/// log-probabilities, the best split is three characters.
pub const SENTENCEPIECE_PIECES: &[(&str, f32)] = &[
    ("\u{2581}", 0.0),
    ("t", 0.0),
    ("h", 0.0),
    ("e", 0.0),
    ("th", -1.0),
    ("he", -2.0),
    ("the", -3.0),
    ("\u{2581}the", -4.0),
];

pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// ChatML that raises, with the words of Mistral's and Gemma's templates, when two messages in a
/// row have the same role.
pub const ALTERNATING_CHATML_TEMPLATE: &str = "{% for message in messages %}{% if loop.index0 > 0 and message['role'] == messages[loop.index0 - 1]['role'] %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// The chat template `spec` asks for.
pub fn chat_template(spec: &TinySpec) -> &'static str {
    if spec.alternating_turns { ALTERNATING_CHATML_TEMPLATE } else { CHATML_TEMPLATE }
}

/// Writes the model files into `dir` (created if missing).
pub fn write_safetensors_model(dir: &Path, spec: &TinySpec) -> io::Result<()> {
    if spec.sentencepiece {
        return Err(io::Error::other("a SentencePiece vocabulary is written to GGUF files only"));
    }
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("config.json"), config(spec).to_string())?;
    std::fs::write(dir.join("tokenizer.json"), tokenizer(spec).to_string())?;
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({
            "chat_template": chat_template(spec),
            "bos_token": null,
            "eos_token": "<|im_end|>",
            "pad_token": end_of_text_name(spec),
            "unk_token": null,
            "add_bos_token": false,
            "model_max_length": 32768,
        })
        .to_string(),
    )?;
    // The constraint engine ends on <|endoftext|>; the chat ends on <|im_end|>. Both must stop
    // generation or it runs invisibly to the length cap.
    std::fs::write(
        dir.join("generation_config.json"),
        json!({"bos_token_id": ENDOFTEXT, "eos_token_id": [IM_END, ENDOFTEXT], "do_sample": false}).to_string(),
    )?;
    let tensors = weights(spec);
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, (shape, bytes))| {
            let view = TensorView::new(Dtype::F32, shape.clone(), bytes).map_err(io::Error::other)?;
            Ok((name.clone(), view))
        })
        .collect::<io::Result<_>>()?;
    let bytes = safetensors::serialize(views, None).map_err(io::Error::other)?;
    std::fs::write(dir.join("model.safetensors"), bytes)?;
    Ok(())
}

fn config(spec: &TinySpec) -> serde_json::Value {
    json!({
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab(spec),
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "max_position_embeddings": 32768,
        "sliding_window": 32768,
        "max_window_layers": spec.layers,
        "use_sliding_window": false,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": false,
        "torch_dtype": "float32",
        "bos_token_id": ENDOFTEXT,
        "eos_token_id": IM_END,
    })
}

/// GPT-2's reversible map from bytes to printable characters, used by byte-level BPE.
pub fn byte_to_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    if printable(b) {
        return char::from(b);
    }
    // The others are numbered in byte order from U+0100.
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + rank).unwrap_or('?')
}

/// The name of token 256.
fn end_of_text_name(spec: &TinySpec) -> &'static str {
    if spec.end_of_text { "<|endoftext|>" } else { "<|padding|>" }
}

fn tokenizer(spec: &TinySpec) -> serde_json::Value {
    let vocab: BTreeMap<String, u32> = (0..=255u8).map(|b| (byte_to_char(b).to_string(), u32::from(b))).collect();
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
               "normalized": false, "special": true})
    };
    let mut added = vec![
        special(ENDOFTEXT, end_of_text_name(spec)),
        special(IM_START, "<|im_start|>"),
        special(IM_END, "<|im_end|>"),
    ];
    if spec.user_defined_newline {
        added.push(json!({"id": USER_NEWLINE, "content": "\n", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": false}));
    }
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": [],
        },
    })
}

/// Tensor name → (shape, little-endian f32 bytes), in the Hugging Face Qwen2 layout.
fn weights(spec: &TinySpec) -> BTreeMap<String, (Vec<usize>, Vec<u8>)> {
    let mut rng = fastrand::Rng::with_seed(spec.seed);
    let mut out = BTreeMap::new();
    let h = spec.hidden;
    let head_dim = h / spec.heads;
    let kv = spec.kv_heads * head_dim;
    let mut random = |name: String, shape: Vec<usize>| {
        let n: usize = shape.iter().product();
        let bytes = (0..n).flat_map(|_| ((rng.f32() * 2.0 - 1.0) * spec.init).to_le_bytes()).collect();
        out.insert(name, (shape, bytes));
    };
    random("model.embed_tokens.weight".into(), vec![vocab(spec), h]);
    random("lm_head.weight".into(), vec![vocab(spec), h]);
    for l in 0..spec.layers {
        let p = format!("model.layers.{l}");
        random(format!("{p}.self_attn.q_proj.weight"), vec![h, h]);
        random(format!("{p}.self_attn.q_proj.bias"), vec![h]);
        random(format!("{p}.self_attn.k_proj.weight"), vec![kv, h]);
        random(format!("{p}.self_attn.k_proj.bias"), vec![kv]);
        random(format!("{p}.self_attn.v_proj.weight"), vec![kv, h]);
        random(format!("{p}.self_attn.v_proj.bias"), vec![kv]);
        random(format!("{p}.self_attn.o_proj.weight"), vec![h, h]);
        random(format!("{p}.mlp.gate_proj.weight"), vec![spec.intermediate, h]);
        random(format!("{p}.mlp.up_proj.weight"), vec![spec.intermediate, h]);
        random(format!("{p}.mlp.down_proj.weight"), vec![h, spec.intermediate]);
    }
    let ones = |n: usize| (0..n).flat_map(|_| 1.0f32.to_le_bytes()).collect::<Vec<u8>>();
    for l in 0..spec.layers {
        let p = format!("model.layers.{l}");
        out.insert(format!("{p}.input_layernorm.weight"), (vec![h], ones(h)));
        out.insert(format!("{p}.post_attention_layernorm.weight"), (vec![h], ones(h)));
    }
    out.insert("model.norm.weight".into(), (vec![h], ones(h)));
    out
}

/// Writes the same tiny model as one GGUF file (F32 tensors, the tokenizer and chat template in
/// the metadata), the other format a conductor can come in.
pub fn write_gguf_model(path: &Path, spec: &TinySpec) -> io::Result<()> {
    let mut kv: Vec<(String, GgufValue)> = vec![
        ("general.architecture".into(), GgufValue::Str("qwen2".into())),
        ("general.name".into(), GgufValue::Str("baton-tiny".into())),
        ("general.alignment".into(), GgufValue::U32(ALIGN as u32)),
        ("qwen2.context_length".into(), GgufValue::U64(32768)),
        ("qwen2.embedding_length".into(), GgufValue::U32(spec.hidden as u32)),
        ("qwen2.block_count".into(), GgufValue::U32(spec.layers as u32)),
        ("qwen2.feed_forward_length".into(), GgufValue::U32(spec.intermediate as u32)),
        ("qwen2.attention.head_count".into(), GgufValue::U32(spec.heads as u32)),
        ("qwen2.attention.head_count_kv".into(), GgufValue::U32(spec.kv_heads as u32)),
        ("qwen2.attention.layer_norm_rms_epsilon".into(), GgufValue::F32(1e-6)),
        ("qwen2.rope.freq_base".into(), GgufValue::F32(10000.0)),
    ];
    // Token types: normal (1), unknown (2), control (3: the special tokens), user-defined (4),
    // byte (6).
    let (mut tokens, mut types): (Vec<String>, Vec<i32>) = if spec.sentencepiece {
        (0..=255u8).map(|b| (format!("<0x{b:02X}>"), 6)).unzip()
    } else {
        (0..=255u8).map(|b| (byte_to_char(b).to_string(), 1)).unzip()
    };
    for name in [end_of_text_name(spec), "<|im_start|>", "<|im_end|>"] {
        tokens.push(name.into());
        types.push(3);
    }
    if spec.user_defined_newline {
        tokens.push("\n".into());
        types.push(4);
    }
    if spec.sentencepiece {
        let mut scores = vec![0.0f32; tokens.len()];
        for (piece, score) in SENTENCEPIECE_PIECES {
            tokens.push((*piece).into());
            types.push(1);
            scores.push(*score);
        }
        kv.push(("tokenizer.ggml.unknown_token_id".into(), GgufValue::U32(tokens.len() as u32)));
        tokens.push("<unk>".into());
        types.push(2);
        scores.push(0.0);
        kv.push(("tokenizer.ggml.model".into(), GgufValue::Str("llama".into())));
        kv.push(("tokenizer.ggml.scores".into(), GgufValue::F32Array(scores)));
        kv.push(("tokenizer.ggml.add_space_prefix".into(), GgufValue::Bool(false)));
    } else {
        kv.push(("tokenizer.ggml.model".into(), GgufValue::Str("gpt2".into())));
        // The pre-tokenizer (how text is split before byte-pair merges); mistral.rs refuses a
        // BPE GGUF without it rather than guess.
        kv.push(("tokenizer.ggml.pre".into(), GgufValue::Str("qwen2".into())));
        kv.push(("tokenizer.ggml.merges".into(), GgufValue::StrArray(Vec::new())));
    }
    debug_assert_eq!(tokens.len(), vocab(spec));
    kv.push(("tokenizer.ggml.tokens".into(), GgufValue::StrArray(tokens)));
    kv.push(("tokenizer.ggml.token_type".into(), GgufValue::I32Array(types)));
    kv.push(("tokenizer.ggml.bos_token_id".into(), GgufValue::U32(ENDOFTEXT)));
    kv.push(("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(IM_END)));
    kv.push(("tokenizer.ggml.padding_token_id".into(), GgufValue::U32(ENDOFTEXT)));
    if spec.chat_template {
        kv.push(("tokenizer.chat_template".into(), GgufValue::Str(chat_template(spec).into())));
    }

    // Hugging Face names and shapes → GGUF names, with dimensions innermost first.
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = weights(spec)
        .into_iter()
        .map(|(name, (shape, bytes))| (gguf_name(&name), shape.into_iter().rev().collect(), bytes))
        .collect();

    let mut out = Vec::new();
    out.extend_from_slice(b"GGUF");
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(kv.len() as u64).to_le_bytes());
    for (key, value) in &kv {
        put_str(&mut out, key);
        value.write(&mut out);
    }
    let mut offset = 0u64;
    for (name, dims, bytes) in &tensors {
        put_str(&mut out, name);
        out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in dims {
            out.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        out.extend_from_slice(&0u32.to_le_bytes()); // GGML_TYPE_F32
        out.extend_from_slice(&offset.to_le_bytes());
        offset += (bytes.len() as u64).next_multiple_of(ALIGN as u64);
    }
    out.resize(out.len().next_multiple_of(ALIGN), 0);
    for (_, _, bytes) in &tensors {
        out.extend_from_slice(bytes);
        out.resize(out.len().next_multiple_of(ALIGN), 0);
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, out)
}

const ALIGN: usize = 32;

enum GgufValue {
    U32(u32),
    U64(u64),
    F32(f32),
    Bool(bool),
    Str(String),
    StrArray(Vec<String>),
    I32Array(Vec<i32>),
    F32Array(Vec<f32>),
}

impl GgufValue {
    fn write(&self, out: &mut Vec<u8>) {
        match self {
            GgufValue::U32(v) => {
                out.extend_from_slice(&4u32.to_le_bytes());
                out.extend_from_slice(&v.to_le_bytes());
            }
            GgufValue::U64(v) => {
                out.extend_from_slice(&10u32.to_le_bytes());
                out.extend_from_slice(&v.to_le_bytes());
            }
            GgufValue::F32(v) => {
                out.extend_from_slice(&6u32.to_le_bytes());
                out.extend_from_slice(&v.to_le_bytes());
            }
            GgufValue::Bool(v) => {
                out.extend_from_slice(&7u32.to_le_bytes());
                out.push(u8::from(*v));
            }
            GgufValue::Str(s) => {
                out.extend_from_slice(&8u32.to_le_bytes());
                put_str(out, s);
            }
            GgufValue::StrArray(items) => {
                out.extend_from_slice(&9u32.to_le_bytes());
                out.extend_from_slice(&8u32.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for s in items {
                    put_str(out, s);
                }
            }
            GgufValue::I32Array(items) => put_array(out, 5, items.iter().map(|v| v.to_le_bytes())),
            GgufValue::F32Array(items) => put_array(out, 6, items.iter().map(|v| v.to_le_bytes())),
        }
    }
}

/// An array of fixed-size numbers: the array type, the elements' type, their count, then each.
fn put_array<const N: usize>(out: &mut Vec<u8>, element_type: u32, items: impl ExactSizeIterator<Item = [u8; N]>) {
    out.extend_from_slice(&9u32.to_le_bytes());
    out.extend_from_slice(&element_type.to_le_bytes());
    out.extend_from_slice(&(items.len() as u64).to_le_bytes());
    for bytes in items {
        out.extend_from_slice(&bytes);
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn gguf_name(hf: &str) -> String {
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.").unwrap_or(hf);
    let (layer, tail) = rest.split_once('.').unwrap_or(("0", rest));
    let tail = tail
        .replace("self_attn.q_proj", "attn_q")
        .replace("self_attn.k_proj", "attn_k")
        .replace("self_attn.v_proj", "attn_v")
        .replace("self_attn.o_proj", "attn_output")
        .replace("mlp.gate_proj", "ffn_gate")
        .replace("mlp.up_proj", "ffn_up")
        .replace("mlp.down_proj", "ffn_down")
        .replace("input_layernorm", "attn_norm")
        .replace("post_attention_layernorm", "ffn_norm");
    format!("blk.{layer}.{tail}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_a_bijection_onto_printable_chars() {
        let chars: std::collections::HashSet<char> = (0..=255u8).map(byte_to_char).collect();
        assert_eq!(chars.len(), 256);
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        assert_eq!(byte_to_char(b'a'), 'a');
    }

    #[test]
    fn same_seed_same_files() {
        let a = tempdir();
        let b = tempdir();
        write_safetensors_model(&a, &TinySpec::default()).expect("write");
        write_safetensors_model(&b, &TinySpec::default()).expect("write");
        for f in ["config.json", "tokenizer.json", "model.safetensors", "generation_config.json"] {
            assert_eq!(std::fs::read(a.join(f)).expect("read"), std::fs::read(b.join(f)).expect("read"), "{f}");
        }
        let _ = std::fs::remove_dir_all(&a);
        let _ = std::fs::remove_dir_all(&b);
    }

    fn tempdir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("baton-tiny-{}-{}", std::process::id(), fastrand::u64(..)));
        std::fs::create_dir_all(&dir).expect("mkdir");
        dir
    }
}

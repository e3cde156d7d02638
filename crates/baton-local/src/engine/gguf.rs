//! What a GGUF's metadata says before the model is loaded: whether it carries a chat template,
//! and how far its sliding-window attention layers look back.

use std::path::Path;

/// What Baton reads from a GGUF file's header (the metadata only), with the engine's own reader.
pub(super) struct GgufHeader {
    /// Whether the metadata holds a chat template (`tokenizer.chat_template`).
    pub chat_template: bool,
    /// `{architecture}.attention.sliding_window`: how many positions the model's local attention
    /// layers keep (Gemma 2 and 3, Phi-3), when it has such layers.
    pub sliding_window: Option<usize>,
}

/// A file the reader cannot read counts as having a chat template and no window: loading it
/// then says what is wrong with it.
pub(super) fn read_gguf_header(path: &Path) -> GgufHeader {
    let unread = GgufHeader { chat_template: true, sliding_window: None };
    let Ok(file) = std::fs::File::open(path) else { return unread };
    let Ok(content) = candle_core::quantized::gguf_file::Content::read(&mut std::io::BufReader::new(file)) else {
        return unread;
    };
    let metadata = &content.metadata;
    let sliding_window = metadata
        .get("general.architecture")
        .and_then(|a| a.to_string().ok())
        .and_then(|arch| metadata.get(&format!("{arch}.attention.sliding_window")))
        .and_then(|w| w.to_u32().ok())
        .map(|w| w as usize)
        .filter(|&w| w > 0);
    GgufHeader { chat_template: metadata.contains_key("tokenizer.chat_template"), sliding_window }
}

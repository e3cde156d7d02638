//! What a GGUF's metadata says before the model is loaded: whether it carries a chat template.

use std::path::Path;

/// Whether a GGUF file's metadata holds a chat template (`tokenizer.chat_template`), read with
/// the engine's own GGUF reader (the header only). A file it cannot read counts as having one:
/// loading it then says what is wrong with it.
pub(super) fn gguf_has_chat_template(path: &Path) -> bool {
    let Ok(file) = std::fs::File::open(path) else { return true };
    match candle_core::quantized::gguf_file::Content::read(&mut std::io::BufReader::new(file)) {
        Ok(content) => content.metadata.contains_key("tokenizer.chat_template"),
        Err(_) => true,
    }
}

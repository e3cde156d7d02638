//! What a model's tokenizer metadata holds: the chat template a GGUF carries, read before
//! loading it, and the end tokens its vocabulary has, looked up once it is loaded.

use std::path::Path;

use either::Either;

use super::{END_OF_TEXT, END_OF_TURN, EndTokens};

/// Looks each end-token spelling up in the model's vocabulary: a spelling that tokenizes to one
/// token is one of its added (special) tokens.
pub(super) async fn find_end_tokens(model: &mistralrs::Model) -> EndTokens {
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

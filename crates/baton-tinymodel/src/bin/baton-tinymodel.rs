//! Writes a tiny random-weight Qwen2 chat model into a directory: a stand-in conductor or local
//! worker for trying Baton without downloading a model. Its text is noise; its plans are valid.
//!
//! Usage: baton-tinymodel DIR [SEED]

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let Some(dir) = args.next() else {
        eprintln!("usage: baton-tinymodel DIR [SEED]");
        return ExitCode::from(2);
    };
    let seed = match args.next().map(|s| s.parse::<u64>()) {
        None => 7,
        Some(Ok(seed)) => seed,
        Some(Err(_)) => {
            eprintln!("error: SEED must be a whole number");
            return ExitCode::from(2);
        }
    };
    let spec = baton_tinymodel::TinySpec { seed, ..Default::default() };
    match baton_tinymodel::write_safetensors_model(std::path::Path::new(&dir), &spec) {
        Ok(()) => {
            eprintln!("wrote a tiny random Qwen2 model to {dir}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {dir}: {e}");
            ExitCode::from(1)
        }
    }
}

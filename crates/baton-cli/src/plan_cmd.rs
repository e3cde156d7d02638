//! `baton plan parse`: read a conductor's answer, print the normalized plan as JSON.

use std::io::Read;
use std::path::PathBuf;

use baton_plan::{DEFAULT_MAX_STEPS, Limits};

use crate::{Failure, Outcome};

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Parse and validate a plan; print `{"model_id":[…],"subtasks":[…],"access_list":[…]}`.
    Parse {
        /// The conductor's text (stdin when omitted or `-`).
        file: Option<PathBuf>,
        /// Also check model ids against this pool file.
        #[arg(long, value_name = "FILE")]
        pool: Option<PathBuf>,
        /// Longest plan accepted (default: the pool's `max_steps`, else 5).
        #[arg(long, value_name = "N")]
        max_steps: Option<usize>,
    },
}

pub fn run(cmd: Command) -> Outcome {
    match cmd {
        Command::Parse { file, pool, max_steps } => {
            let (text, source) = read_input(file.as_ref())?;
            let pool = match &pool {
                Some(path) => Some(baton_engine::Pool::load(path).map_err(|e| Failure::BadInput(e.to_string()))?),
                None => None,
            };
            let limits = Limits {
                max_steps: max_steps.or(pool.as_ref().map(|p| p.options.max_steps)).unwrap_or(DEFAULT_MAX_STEPS),
                pool_size: pool.as_ref().map(|p| p.workers.len()),
                allow_stop: true,
            };
            let plan = baton_plan::parse(&text, &limits).map_err(|e| Failure::BadInput(format!("{source}: {e}")))?;
            println!("{}", plan.to_json());
            Ok(())
        }
    }
}

/// Reads a file, or stdin for `None` / `-`. Returns the text and a name for messages.
pub fn read_input(file: Option<&PathBuf>) -> Result<(String, String), Failure> {
    match file {
        Some(path) if path.as_os_str() != "-" => std::fs::read_to_string(path)
            .map(|t| (t, path.display().to_string()))
            .map_err(|e| Failure::BadInput(format!("{}: cannot read: {e}", path.display()))),
        _ => {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .map_err(|e| Failure::BadInput(format!("stdin: cannot read: {e}")))?;
            Ok((text, "stdin".to_owned()))
        }
    }
}

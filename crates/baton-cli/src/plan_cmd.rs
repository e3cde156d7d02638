//! `baton plan "question"`: the conductor's plan, without running it. `baton plan parse`:
//! read a conductor's answer, print the normalized plan as JSON.

use std::io::Read;
use std::path::PathBuf;

use baton_plan::{DEFAULT_MAX_STEPS, Limits};

use crate::{Failure, Outcome};

#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// The question to plan for.
    #[arg(required = true)]
    question: Option<String>,
    #[command(flatten)]
    pool: crate::PoolArg,
    #[command(flatten)]
    conductor: crate::conductor_setup::ConductorArgs,
    /// The history whose learned profiles and plans the conductor plans with, as `baton ask`
    /// does (read only; a missing file is a history with nothing learned).
    #[command(flatten)]
    db: crate::history_cmd::DbArg,
    /// Print the normalized plan as JSON (as `plan parse` does) instead of the conductor's text.
    #[arg(long)]
    json: bool,
}

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

pub async fn run(args: Args) -> Outcome {
    match (args.command, args.question) {
        (Some(cmd), _) => parse_command(cmd),
        (None, Some(question)) => write(&question, &args.pool, &args.conductor, &args.db, args.json).await,
        (None, None) => Err(Failure::BadInput("give a question, or `baton plan parse FILE`".into())),
    }
}

/// Asks the conductor for a plan and prints it: its text (reasoning included) on stdout, or
/// with `--json` the normalized lists.
async fn write(
    question: &str,
    pool: &crate::PoolArg,
    conductor: &crate::conductor_setup::ConductorArgs,
    db: &crate::history_cmd::DbArg,
    json: bool,
) -> Outcome {
    let pool = pool.load()?;
    // Opening a history creates it: a plan, which records nothing, only reads one that exists.
    let store = if db.path().exists() { Some(db.open().await?) } else { None };
    let models = baton_runner::LocalModels::default();
    let stream_text = !json;
    let deltas = Box::new(move |t: &str| {
        if stream_text {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(t.as_bytes());
            let _ = out.flush();
        }
    });
    let build = crate::conductor_setup::Build {
        args: conductor,
        conductor: baton_runner::Conductor::Required,
        store: store.as_ref(),
        quiet: json,
    };
    let planned = build.draft(pool, &models, question, deltas).await?;
    if let Some(why) = &planned.routed {
        // Nothing was written: say where the question goes instead, as `ask` would send it.
        if json {
            println!("{}", planned.plan.to_json());
        } else {
            println!("No plan: {why}.\n{}", planned.plan.to_json());
        }
        eprintln!("plan: none written (the conductor was not asked)");
        return Ok(());
    }
    if json {
        println!("{}", planned.plan.to_json());
    } else {
        println!();
    }
    let u = planned.usage;
    eprintln!(
        "plan: {} tokens written (ended: {}), prompt {} tokens ({} cached)",
        u.output_tokens,
        planned.stop_reason.as_deref().unwrap_or("unknown"),
        u.input_tokens,
        u.cached_input_tokens
    );
    Ok(())
}

fn parse_command(cmd: Command) -> Outcome {
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

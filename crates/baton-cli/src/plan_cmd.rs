//! `baton plan "question"`: the conductor's plan, without running it. `baton plan parse`:
//! read a conductor's answer (or a plan printed as JSON), print the normalized plan as JSON.

use std::path::PathBuf;

use baton_plan::{DEFAULT_MAX_STEPS, Limits};

use crate::io::{Io, errln, outln};
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
    /// Parse and validate a plan; print
    /// `{"version":1,"model_id":[…],"subtasks":[…],"access_list":[…]}` (docs/json.md).
    Parse {
        /// The conductor's text, or a plan as `plan --json` prints it (stdin when omitted or `-`).
        file: Option<PathBuf>,
        /// Also check model ids against this pool file.
        #[arg(long, value_name = "FILE")]
        pool: Option<PathBuf>,
        /// Longest plan accepted (default: the pool's `max_steps`, else 5).
        #[arg(long, value_name = "N")]
        max_steps: Option<usize>,
    },
}

impl Args {
    /// Whether this command loads a local conductor, so that the warm helper runs it (`None`
    /// when not, or when the pool does not load: the command says why itself). A plan reads no
    /// standard input.
    pub fn helper_route(&self) -> Option<bool> {
        if self.command.is_some() || self.question.is_none() {
            return None;
        }
        let pool = self.pool.load().ok()?;
        baton_conductor::setup::uses_local_models(&pool, &self.conductor.choice(), true).then_some(false)
    }
}

/// Runs the command with `models` (empty, or those a warm helper keeps loaded), writing to
/// `io`.
pub async fn run(args: Args, io: &Io, models: &baton_runner::LocalModels) -> Outcome {
    match (args.command, args.question) {
        (Some(cmd), _) => parse_command(cmd, io),
        (None, Some(question)) => {
            let Args { pool, conductor, db, json, .. } = args;
            write(&question, &Sources { pool: &pool, conductor: &conductor, db: &db }, json, io, models).await
        }
        (None, None) => Err(Failure::BadInput("give a question, or `baton plan parse FILE`".into())),
    }
}

/// Where a plan's pool, conductor and learned history come from.
struct Sources<'a> {
    pool: &'a crate::PoolArg,
    conductor: &'a crate::conductor_setup::ConductorArgs,
    db: &'a crate::history_cmd::DbArg,
}

/// Asks the conductor for a plan and prints it: its text (reasoning included) on stdout, or
/// with `--json` the normalized lists.
async fn write(question: &str, from: &Sources<'_>, json: bool, io: &Io, models: &baton_runner::LocalModels) -> Outcome {
    let pool = from.pool.load()?;
    // Opening a history creates it: a plan, which records nothing, only reads one that exists.
    let store = if from.db.path().exists() { Some(from.db.open().await?) } else { None };
    let stream_text = !json;
    let to = io.clone();
    let deltas = Box::new(move |t: &str| {
        if stream_text {
            to.out(t);
        }
    });
    let loader = crate::conductor_setup::Loader::new(from.conductor, json, io);
    let context = loader.context(&pool, models);
    let drafted = baton_runner::draft::draft(pool, context, store.as_ref(), question, None, deltas, &io.cancel).await;
    if let Some(store) = &store {
        store.close().await;
    }
    let (planned, _) = drafted?;
    if let Some(why) = &planned.routed {
        // Nothing was written: say where the question goes instead, as `ask` would send it.
        if json {
            outln!(io, "{}", crate::json::plan_line(&planned.plan));
        } else {
            outln!(io, "No plan: {why}.\n{}", planned.plan.to_json());
        }
        errln!(io, "plan: none written (the conductor was not asked)");
        return Ok(());
    }
    if json {
        outln!(io, "{}", crate::json::plan_line(&planned.plan));
    } else {
        outln!(io);
    }
    let u = planned.usage;
    errln!(
        io,
        "plan: {} tokens written (ended: {}), prompt {} tokens ({} cached)",
        u.output_tokens,
        planned.stop_reason.as_deref().unwrap_or("unknown"),
        u.input_tokens,
        u.cached_input_tokens
    );
    Ok(())
}

fn parse_command(cmd: Command, io: &Io) -> Outcome {
    match cmd {
        Command::Parse { file, pool, max_steps } => {
            let (text, source) = read_input(file.as_ref(), io)?;
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
            outln!(io, "{}", crate::json::plan_line(&plan));
            Ok(())
        }
    }
}

/// Reads a file, or stdin for `None` / `-`. Returns the text and a name for messages.
pub fn read_input(file: Option<&PathBuf>, io: &Io) -> Result<(String, String), Failure> {
    match file {
        Some(path) if path.as_os_str() != "-" => std::fs::read_to_string(path)
            .map(|t| (t, path.display().to_string()))
            .map_err(|e| Failure::BadInput(format!("{}: cannot read: {e}", path.display()))),
        _ => {
            let text = io.read_stdin().map_err(|e| Failure::BadInput(format!("stdin: cannot read: {e}")))?;
            Ok((text, "stdin".to_owned()))
        }
    }
}

//! `baton ask`: the conductor writes a plan (or `--plan` gives one) and the pool runs it. The answer goes to stdout, progress to stderr; with
//! `--json`, every RunEvent goes to stdout as one JSON object per line instead.

use std::path::PathBuf;

use baton_engine::{RunEvent, RunStatus};
use baton_plan::Limits;
use baton_runner::{Ask, LocalModels};

use crate::conductor_setup::Loader;
use crate::io::{Io, errln, outln};
use crate::progress::Progress;
use crate::{Failure, Outcome, PoolArg};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The question (`-` reads it from stdin).
    question: String,
    #[command(flatten)]
    pool: PoolArg,
    /// Run this plan (the conductor's format; a file, or `-` for stdin) instead of asking the
    /// conductor for one.
    #[arg(long, value_name = "FILE")]
    plan: Option<PathBuf>,
    #[command(flatten)]
    conductor: crate::conductor_setup::ConductorArgs,
    /// Write every run event to stdout as JSON lines instead of the answer.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    db: crate::history_cmd::DbArg,
    /// Do not record this run in the history.
    #[arg(long, conflicts_with = "conversation")]
    no_history: bool,
    /// Ask a follow-up in this conversation of the history: the conductor sees the earlier
    /// questions and answers.
    #[arg(long, value_name = "ID")]
    conversation: Option<i64>,
}

impl Args {
    /// Whether this question loads a local model, so that the warm helper runs it (`None`
    /// when not, or when the pool does not load: the command says why itself); if so, whether
    /// it reads its standard input.
    pub fn helper_route(&self) -> Option<bool> {
        let pool = self.pool.load().ok()?;
        let asks_conductor = self.plan.is_none();
        baton_conductor::setup::uses_local_models(&pool, &self.conductor.choice(), asks_conductor)
            .then(|| self.question == "-" || self.plan.as_ref().is_some_and(|p| p.as_os_str() == "-"))
    }
}

/// Runs the question with `models` (empty, or those a warm helper keeps loaded), writing to
/// `io`.
pub async fn run(args: Args, io: &Io, models: &LocalModels) -> Outcome {
    let pool = args.pool.load()?;
    if args.question == "-" && args.plan.as_ref().is_some_and(|p| p.as_os_str() == "-") {
        return Err(Failure::BadInput("the question and the plan cannot both come from stdin".into()));
    }
    let plan = match &args.plan {
        Some(path) => {
            let (plan_text, plan_source) = crate::plan_cmd::read_input(Some(path), io)?;
            // A written plan runs without a conductor, so it cannot hand work back to one.
            let limits =
                Limits { max_steps: pool.options.max_steps, pool_size: Some(pool.workers.len()), allow_stop: false };
            Some(baton_plan::parse(&plan_text, &limits).map_err(|e| Failure::BadInput(format!("{plan_source}: {e}")))?)
        }
        None => None,
    };
    let question = if args.question == "-" {
        crate::plan_cmd::read_input(None, io)?.0.trim().to_owned()
    } else {
        args.question.clone()
    };

    if pool.options.budget.max_cost_usd.is_some() {
        crate::warn_unpriced(&pool, "budget.max_cost_usd", io);
    }
    // The history opens before anything runs, so a database problem costs no provider calls.
    let store = if args.no_history { None } else { Some(args.db.open().await?) };
    let ctrl_c = io.watch_ctrl_c();
    let json = args.json;
    let names: Vec<String> = pool.workers.iter().map(|w| w.name.clone()).collect();
    let mut progress = Progress::new(names, io.clone());
    let out = io.clone();
    let show = move |event: RunEvent| {
        if json {
            outln!(out, "{}", crate::json::line(&event));
        } else {
            progress.show(&event);
        }
    };
    let to = io.clone();
    let warn =
        move |e: baton_store::StoreError| errln!(to, "warning: this run is not fully recorded in the history: {e}");
    let loader = Loader::new(&args.conductor, json, io);
    let context = loader.context(&pool, models);
    let ask = Ask { question, conversation: args.conversation, plan };
    let recorded = baton_runner::ask(pool, context, store.as_ref(), ask, show, warn, &io.cancel).await;
    if let Some(ctrl_c) = ctrl_c {
        ctrl_c.abort();
    }
    if let Some(store) = &store {
        store.close().await;
    }
    let recorded = recorded?;
    if let (Some(run), Some(conversation), false) = (recorded.run_id, recorded.conversation_id, json) {
        errln!(io, "recorded as run {run} in conversation {conversation} (baton history show {run})");
    }
    let outcome = recorded.outcome;

    match outcome.status {
        RunStatus::Finished => {
            if !json {
                let answer = outcome.answer.unwrap_or_default();
                outln!(io, "{}", answer.trim_end());
            }
            Ok(())
        }
        RunStatus::Cancelled => Err(Failure::Interrupted),
        RunStatus::Failed => {
            let message = outcome.error.map_or_else(|| "the run failed".to_owned(), |e| e.message);
            Err(Failure::Failed(message))
        }
    }
}

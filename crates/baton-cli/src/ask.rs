//! `baton ask`: the conductor writes a plan (or `--plan` gives one) and the pool runs it. The answer goes to stdout, progress to stderr; with
//! `--json`, every RunEvent goes to stdout as one JSON object per line instead.

use std::io::Write;
use std::path::PathBuf;

use baton_engine::{Executor, RunRequest, RunStatus, new_run_id};
use baton_plan::Limits;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

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

pub async fn run(args: Args) -> Outcome {
    let mut pool = args.pool.load()?;
    if args.question == "-" && args.plan.as_ref().is_some_and(|p| p.as_os_str() == "-") {
        return Err(Failure::BadInput("the question and the plan cannot both come from stdin".into()));
    }
    let plan = match &args.plan {
        Some(path) => {
            let (plan_text, plan_source) = crate::plan_cmd::read_input(Some(path))?;
            // A written plan runs without a conductor, so it cannot hand work back to one.
            let limits =
                Limits { max_steps: pool.options.max_steps, pool_size: Some(pool.workers.len()), allow_stop: false };
            Some(baton_plan::parse(&plan_text, &limits).map_err(|e| Failure::BadInput(format!("{plan_source}: {e}")))?)
        }
        None => None,
    };
    let question = if args.question == "-" {
        crate::plan_cmd::read_input(None)?.0.trim().to_owned()
    } else {
        args.question.clone()
    };
    if question.trim().is_empty() {
        return Err(Failure::BadInput("the question is empty".into()));
    }

    if pool.options.budget.max_cost_usd.is_some() {
        crate::warn_unpriced(&pool, "budget.max_cost_usd");
    }
    // The history opens before anything runs, so a database problem costs no provider calls.
    let store = if args.no_history { None } else { Some(args.db.open().await?) };
    let history = match (&store, args.conversation) {
        (Some(store), Some(id)) => {
            if store.conversation_title(id).await.map_err(|e| Failure::Failed(e.to_string()))?.is_none() {
                return Err(Failure::BadInput(format!("there is no conversation {id} in the history")));
            }
            store.messages(id).await.map_err(|e| Failure::Failed(e.to_string()))?
        }
        _ => Vec::new(),
    };
    let mut recorder = store.as_ref().map(|s| s.recorder(args.conversation));
    if let Some(store) = &store {
        store.choose_fallback_worker(&mut pool).await;
    }

    let mut executor = Executor::from_pool(&pool);
    let models = crate::conductor_setup::LocalModels::default();
    if plan.is_none() {
        let planner = crate::conductor_setup::planner(&pool, &args.conductor, &models, args.json).await?;
        executor = executor.with_planner(planner);
    }
    let force_cpu = args.conductor.cpu || pool.options.conductor.device.as_deref() == Some("cpu");
    crate::conductor_setup::attach_local_workers(&mut executor, &pool, &models, force_cpu, args.json).await?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let cancel = CancellationToken::new();
    let ctrl_c = crate::cancel_on_ctrl_c(&cancel);

    let json = args.json;
    let names: Vec<String> = pool.workers.iter().map(|w| w.name.clone()).collect();
    let consumer = tokio::spawn(async move {
        let mut progress = Progress::new(names);
        let stdout = std::io::stdout();
        while let Some(event) = rx.recv().await {
            // A history that fails mid-run must not cost the answer: warn once, go on.
            if let Some(r) = &mut recorder
                && let Err(e) = r.record(&event).await
            {
                eprintln!("warning: this run is not fully recorded in the history: {e}");
                recorder = None;
            }
            if json {
                let mut out = stdout.lock();
                // A closed stdout (e.g. `| head`) must not abort the run.
                let _ = serde_json::to_writer(&mut out, &event).map(|()| writeln!(out));
                let _ = out.flush();
            } else {
                progress.show(&event);
            }
        }
        recorder.and_then(|r| Some((r.run_id()?, r.conversation_id()?)))
    });

    let request = RunRequest { run_id: new_run_id(), question, plan, history, ..RunRequest::default() };
    let outcome = executor.run(request, &tx, &cancel).await;
    drop(tx);
    let recorded = consumer.await.ok().flatten();
    ctrl_c.abort();
    if let Some(store) = &store {
        store.close().await;
    }
    if let (Some((run, conversation)), false) = (recorded, json) {
        eprintln!("recorded as run {run} in conversation {conversation} (baton history show {run})");
    }

    match outcome.status {
        RunStatus::Finished => {
            if !json {
                let answer = outcome.answer.unwrap_or_default();
                println!("{}", answer.trim_end());
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

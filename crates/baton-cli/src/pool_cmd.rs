//! `baton pool`: show the pool as the conductor sees it, and check that every worker answers.

use std::time::{Duration, Instant};

use baton_engine::Pool;
use baton_engine::calls::check_worker;
use baton_engine::prices::Pricing;
use baton_runner::{Conductor, LocalModels};

use crate::{Failure, Outcome, PoolArg};

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Print where the pool file is.
    Path(PoolArg),
    /// List the workers, numbered as the conductor sees them, with what each was measured to
    /// get right (`baton pool learn`).
    Show {
        #[command(flatten)]
        pool: PoolArg,
        #[command(flatten)]
        db: crate::history_cmd::DbArg,
    },
    /// Learn the pool: each worker alone on a suite's items; runs then send each kind of
    /// question to the cheapest worker that is as good at it.
    Learn(crate::learn_cmd::LearnArgs),
    /// Make a minimal call to each worker; report reachability, auth and latency.
    Check {
        #[command(flatten)]
        pool: PoolArg,
        /// One JSON object per worker on stdout.
        #[arg(long)]
        json: bool,
        /// Give up on one attempt after this many seconds (default: each worker's
        /// `timeout_secs`); failed attempts are retried as the pool's `[retry]` table says.
        #[arg(long)]
        timeout_secs: Option<u64>,
    },
}

pub async fn run(cmd: Command) -> Outcome {
    match cmd {
        Command::Path(pool) => {
            println!("{}", pool.path().display());
            Ok(())
        }
        Command::Show { pool, db } => {
            let pool = pool.load()?;
            show(&pool);
            // The history is read only when it is there: showing a pool creates nothing.
            if db.path().exists() {
                let store = db.open().await?;
                let learning = baton_runner::learned::pool_learning(&pool, &store)
                    .await
                    .map_err(|e| Failure::Failed(e.to_string()))?;
                store.close().await;
                print!("{}", crate::learn_cmd::profiles_table(&learning));
            }
            Ok(())
        }
        Command::Learn(args) => crate::learn_cmd::learn(args).await,
        Command::Check { pool, json, timeout_secs } => {
            let pool = pool.load()?;
            check(&pool, json, timeout_secs.map(Duration::from_secs)).await
        }
    }
}

fn show(pool: &Pool) {
    for (i, w) in pool.workers.iter().enumerate() {
        let price = match w.pricing() {
            Pricing::Pool(p) => match p.cached_input {
                Some(c) => format!("${}/${} per 1M tokens, ${c} cached, from the pool file", p.input, p.output),
                None => format!("${}/${} per 1M tokens, from the pool file", p.input, p.output),
            },
            Pricing::Data { provider, model } => format!("priced by the genai-prices data as {provider} {model}"),
            Pricing::Free => "local, $0".to_owned(),
            Pricing::Unknown => "price unknown: set price_in and price_out".to_owned(),
        };
        println!("Model {i}: {} ({} {} at {}; {price})", w.name, w.provider, w.model, w.effective_base_url());
        if let Some(d) = &w.description {
            println!("         {d}");
        }
    }
    let o = &pool.options;
    println!(
        "max_steps = {}, show_question = {}, question_to_answer_step = {}, max_concurrency_per_provider = {}",
        o.max_steps, o.show_question, o.question_to_answer_step, o.max_concurrency_per_provider
    );
}

async fn check(pool: &Pool, json: bool, timeout: Option<Duration>) -> Outcome {
    let mut pool = pool.clone();
    for w in pool.workers.iter_mut() {
        w.timeout = timeout.unwrap_or(w.timeout);
    }
    // Local workers are loaded and asked too, as the app's *Test connection* does.
    let io = crate::io::Io::terminal();
    let loader = crate::conductor_setup::Loader::new(&Default::default(), json, &io);
    let models = LocalModels::default();
    let executor = loader.executor(pool.clone(), &models, Conductor::None).await?.executor;
    let stop = tokio_util::sync::CancellationToken::new();
    let checks = executor.workers().iter().map(|worker| {
        let (retry, stop) = (&pool.options.retry, &stop);
        async move {
            let started = Instant::now();
            let result = check_worker(worker, retry, stop).await;
            (worker, result, started.elapsed())
        }
    });
    let results = futures::future::join_all(checks).await;
    let mut failures = 0;
    for (worker, result, elapsed) in results {
        let ms = elapsed.as_millis() as u64;
        if json {
            let line = match &result {
                Ok(_) => {
                    serde_json::json!({"worker": worker.info.index, "name": worker.info.name, "ok": true, "latency_ms": ms})
                }
                Err(e) => serde_json::json!({"worker": worker.info.index, "name": worker.info.name, "ok": false,
                    "latency_ms": ms, "error": {"kind": e.kind, "message": e.message, "status": e.status}}),
            };
            println!("{}", crate::json::line(&line));
        } else {
            match &result {
                Ok(_) => println!("ok      {:<16} {:<24} {ms} ms", worker.info.name, worker.info.model),
                Err(e) => println!(
                    "FAILED  {:<16} {:<24} {ms} ms  {}: {}",
                    worker.info.name, worker.info.model, e.kind, e.message
                ),
            }
        }
        if result.is_err() {
            failures += 1;
        }
    }
    if failures > 0 {
        Err(Failure::Failed(format!("{failures} of {} workers failed the check", pool.workers.len())))
    } else {
        Ok(())
    }
}

//! `baton pool learn`: run every worker alone on a suite's items and keep what each got right,
//! per category, with its cost and time: the workers' profiles. Runs then send each kind of
//! question to the cheapest worker that is as good at it (see `baton_engine::profile`).

use std::sync::Arc;

use baton_engine::Route;
use baton_engine::profile::{Freshness, PoolLearning, RouteHow};
use baton_eval::learn::{self, LearnOptions};
use baton_eval::{Ended, Harness};
use baton_runner::{Conductor, LocalModels};

use crate::conductor_setup::Build;
use crate::history_cmd::DbArg;
use crate::{Failure, Outcome, PoolArg};

#[derive(Debug, clap::Args)]
pub struct LearnArgs {
    /// A built-in suite (humaneval, math500, mmlu) or a JSONL file of items with answers. Its
    /// items' `category` is the kind of question a profile is kept for.
    suite: String,
    #[command(flatten)]
    pool: PoolArg,
    #[command(flatten)]
    db: DbArg,
    /// Names the learning run; the same command again goes on where a stopped one ended
    /// (default: the suite's name and the pool's workers as they are now).
    #[arg(long)]
    id: Option<String>,
    /// Learn from this many items, drawn stratified by category (default: all).
    #[arg(long, value_name = "N")]
    limit: Option<usize>,
    /// Runs in flight at once.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Spend at most this much in total (resumes included); unpriced calls count as $0.
    #[arg(long, value_name = "USD")]
    max_cost_usd: Option<f64>,
    /// Seed for drawing `--limit` items.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Plans the conductor writes (sampled) and runs for each item; the right ones become its
    /// examples. 0: learn the workers alone only. Needs a conductor in the pool.
    #[arg(long, value_name = "N", default_value_t = learn::DEFAULT_PLANS)]
    plans: u32,
}

pub async fn learn(args: LearnArgs) -> Outcome {
    let pool = args.pool.load()?;
    let options = LearnOptions {
        suite: args.suite.clone(),
        id: args.id.clone(),
        limit: args.limit,
        seed: args.seed,
        concurrency: args.concurrency,
        max_cost_usd: args.max_cost_usd,
        plans: args.plans,
    };
    let mut spec = learn::spec(&pool, &options).map_err(|e| Failure::BadInput(e.to_string()))?;
    let plans = learn::plan_samples(&spec);
    if args.plans > 0 && plans == 0 {
        eprintln!("note: the pool has no conductor, so only the workers alone are learned (no plans)");
    }
    if args.max_cost_usd.is_some() {
        crate::warn_unpriced(&pool, "--max-cost-usd", &crate::io::Io::terminal());
    }
    let store = args.db.open().await?;
    let left_out =
        learn::leave_out_learned(&mut spec, &pool, &store).await.map_err(|e| Failure::Failed(e.to_string()))?;
    for w in &left_out {
        eprintln!("note: {}", learn::left_out_note(w));
    }
    if spec.strategies.is_empty() {
        eprintln!("every worker is already learned on these items; nothing to ask");
        let learning =
            baton_runner::build::pool_learning(&pool, &store).await.map_err(|e| Failure::Failed(e.to_string()))?;
        store.close().await;
        print!("{}", profiles_table(&learning));
        return Ok(());
    }
    let workers: Vec<String> = pool.workers.iter().map(|w| w.name.clone()).collect();
    // What was learned before stays out: the samples show what the conductor does on its own.
    let conductor_args = crate::conductor_setup::ConductorArgs::default();
    let conductor = if plans > 0 { Conductor::Required } else { Conductor::None };
    let io = crate::io::Io::terminal();
    let build = Build { args: &conductor_args, conductor, store: None, quiet: false, io: &io };
    let models = LocalModels::default();
    let executor = build.executor(learn::sampling_pool(&pool), &models).await?.executor;
    let harness = Harness::new(Arc::new(executor), workers.clone(), store.clone(), plans > 0);
    let sampled = if plans > 0 { format!(", and {plans} conductor plans per item") } else { String::new() };
    eprintln!(
        "learning {}: each of {} workers alone on {} items of {}{sampled}",
        spec.id,
        workers.len() - left_out.len(),
        learn::items(&spec),
        spec.suite.name
    );
    let ended = crate::eval_cmd::run_with_bar(&harness, &spec, false).await?;
    let learning =
        baton_runner::build::pool_learning(&pool, &store).await.map_err(|e| Failure::Failed(e.to_string()))?;
    store.close().await;
    print!("{}", profiles_table(&learning));
    match ended {
        Ended::Finished => Ok(()),
        Ended::Stopped => {
            eprintln!("stopped; what was measured is kept, and the same command goes on from there");
            Err(Failure::Interrupted)
        }
        Ended::OverBudget => Err(Failure::Failed(
            "the spending cap was reached; the same command with a higher --max-cost-usd goes on".into(),
        )),
    }
}

/// One block per worker: whether its profile is current, then a line per category (and per
/// kind over categories, "any multiple-choice") with right of n, the 95% interval, cost and
/// time per item; and what runs do with it.
pub fn profiles_table(learning: &PoolLearning) -> String {
    let mut out = String::new();
    for w in learning.workers.iter().chain(&learning.plans) {
        let marks = &w.marks;
        let marked = (marks.total() > 0).then(|| {
            format!(
                "  marked in chat against the conductor: better {}, as good {}, worse {}\n",
                marks.better, marks.tie, marks.worse
            )
        });
        match w.freshness {
            Freshness::None => {
                out.push_str(&format!("{}: not learned (`baton pool learn SUITE`)\n", w.worker));
                out.push_str(marked.as_deref().unwrap_or_default());
                continue;
            }
            Freshness::Stale => out.push_str(&format!(
                "{}: STALE, not used: learned as `{}`, now `{}`; learn again\n",
                w.worker,
                w.identity_learned.as_deref().unwrap_or("?"),
                w.identity_now
            )),
            Freshness::Current => out.push_str(&format!("{}: learned in {}\n", w.worker, w.learned_in.join(", "))),
        }
        // Wide enough for MMLU's longest subjects, so the figures stay in columns.
        let width = w.categories.iter().chain(&w.kinds).map(|r| r.label.chars().count()).max().unwrap_or(0).max(20);
        for row in w.categories.iter().chain(&w.kinds) {
            let f = &row.figures;
            let cost = if w.priced { format!("${:.6}/item", f.cost_per_item_usd) } else { "price unknown".to_owned() };
            out.push_str(&format!(
                "  {:<width$} {:>3} of {:<3} right  (95%: {:>3.0}-{:>3.0}%)  {cost}  {} ms p50  {} tokens/item\n",
                row.label,
                f.right,
                f.n,
                row.low * 100.0,
                row.high * 100.0,
                f.latency_p50_ms,
                f.tokens_per_item
            ));
        }
        out.push_str(marked.as_deref().unwrap_or_default());
    }
    if let Some(name) = &learning.named_fallback {
        out.push_str(&match learning.route {
            Route::Always => {
                format!("Every question goes to the pool's fallback worker ({name}) alone (route = \"always\").\n")
            }
            _ => format!("The pool names its fallback worker ({name}): what was learned does not route runs.\n"),
        });
        return out;
    }
    if !learning.routes.is_empty() {
        out.push_str("Runs send each kind of question to:\n");
        let width = learning.routes.iter().map(|r| r.label.chars().count()).max().unwrap_or(0).max(20);
        for route in &learning.routes {
            let how = match route.how {
                RouteHow::Always => "alone, without a plan (route = \"always\")",
                RouteHow::Clear => "alone, without a plan (a clear margin)",
                RouteHow::NoGain => "alone, without a plan (plans not shown to do better)",
                RouteHow::Lead => "as the plan's lead (the conductor plans)",
            };
            out.push_str(&format!("  {:<width$} {}, {how}\n", route.label, route.worker));
        }
    }
    out
}

//! `baton pool learn`: run every worker alone on a suite's items and keep what each got right,
//! per category, with its cost and time: the workers' profiles. Runs then send each kind of
//! question to the cheapest worker that is as good at it (see `baton_engine::profile`).

use baton_engine::Route;
use baton_engine::profile::{Freshness, PoolLearning, RouteHow};
use baton_eval::Ended;
use baton_eval::learn::{self, LearnOptions};
use baton_runner::LocalModels;

use crate::conductor_setup::{ConductorArgs, Loader};
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
    #[arg(long, value_name = "USD", value_parser = crate::numbers::cost_usd)]
    max_cost_usd: Option<f64>,
    /// Seed for drawing `--limit` items.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Plans the conductor writes (sampled) and runs for each item; the right ones become its
    /// examples. 0: learn the workers alone only. Needs a conductor in the pool.
    #[arg(long, value_name = "N", default_value_t = learn::DEFAULT_PLANS)]
    plans: u32,
    /// Do not search for workflows (chains of two workers, then a fan-out) on the items that
    /// no worker alone and no plan answered.
    #[arg(long)]
    no_search: bool,
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
        search: !args.no_search,
    };
    let store = args.db.open().await?;
    let io = crate::io::Io::terminal();
    let loader = Loader::new(&ConductorArgs::default(), false, &io);
    let models = LocalModels::default();
    let context = loader.context(&pool, &models);
    let watch = crate::eval_cmd::Watch::new("learning", false);
    let learned = baton_runner::learn::learn(&pool, &store, &options, context, &|p| watch.show(p), &watch.cancel).await;
    watch.finish();
    store.close().await;
    let learned = learned?;
    print!("{}", profiles_table(&learned.learning));
    match learned.ended {
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
    for w in learning.workers.iter().chain(&learning.plans).chain(&learning.workflows) {
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
    if let Some(v) = learning.plan_variety {
        let share = f64::from(v.distinct) / f64::from(v.samples.max(1)) * 100.0;
        out.push_str(&format!(
            "The conductor's samples: {} distinct plans of {} ({share:.0}%), counted per item.\n",
            v.distinct, v.samples
        ));
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
                RouteHow::Workflow => "without a plan (a clear margin over every worker alone)",
            };
            let to = route.workflow.as_deref().unwrap_or(&route.worker);
            out.push_str(&format!("  {:<width$} {to}, {how}\n", route.label));
        }
    }
    out
}

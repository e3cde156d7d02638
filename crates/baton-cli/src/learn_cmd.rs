//! `baton pool learn`: run every worker alone on a suite's items and keep what each got right,
//! per category, with its cost and time: the workers' profiles. Runs then send each kind of
//! question to the cheapest worker that is as good at it (see `baton_engine::profile`).

use std::sync::Arc;

use baton_engine::prices::Pricing;
use baton_engine::profile::{self, Freshness, Profile};
use baton_engine::{Pool, Route};
use baton_eval::{Ended, Harness, Purpose, Spec, Strategy};
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
}

pub async fn learn(args: LearnArgs) -> Outcome {
    let suite = baton_eval::suite::load(&args.suite).map_err(|e| Failure::BadInput(e.to_string()))?;
    let pool = args.pool.load()?;
    if pool.workers.len() < 2 {
        return Err(Failure::BadInput(format!(
            "the pool has one worker ({}): learning finds which worker to send each kind of question to, so it needs two or more",
            pool.workers[0].name
        )));
    }
    if args.concurrency == 0 || args.max_cost_usd.is_some_and(|c| c.is_nan() || c <= 0.0) {
        return Err(Failure::BadInput("--concurrency must be at least 1 and --max-cost-usd above 0".into()));
    }
    if args.max_cost_usd.is_some() {
        crate::warn_unpriced(&pool, "--max-cost-usd");
    }
    let identities: Vec<(String, String)> = baton_runner::build::identities(&pool);
    let id = args.id.clone().unwrap_or_else(|| default_id(&suite, &identities, args.limit, args.seed));
    let store = args.db.open().await?;
    let workers: Vec<String> = pool.workers.iter().map(|w| w.name.clone()).collect();
    let strategies = Strategy::parse_list("all-singles", &workers).map_err(Failure::BadInput)?;
    let no_conductor = crate::conductor_setup::ConductorArgs::default();
    let build = Build { args: &no_conductor, conductor: Conductor::None, store: None, quiet: false };
    let models = LocalModels::default();
    let executor = build.executor(pool.clone(), &models).await?.executor;
    let harness = Harness::new(Arc::new(executor), workers.clone(), store.clone(), false);
    let spec = Spec {
        id: id.clone(),
        suite,
        suite_source: args.suite.clone(),
        strategies,
        repeats: 1,
        concurrency: args.concurrency,
        max_cost_usd: args.max_cost_usd,
        calibration: None,
        limit: args.limit,
        seed: args.seed,
        purpose: Purpose::Learn { identities: identities.iter().map(|(_, i)| i.clone()).collect() },
    };
    let items = args.limit.map_or(spec.suite.items.len(), |l| l.min(spec.suite.items.len()));
    eprintln!("learning {id}: each of {} workers alone on {items} items of {}", workers.len(), spec.suite.name);
    let ended = crate::eval_cmd::run_with_bar(&harness, &spec, false).await?;
    let learned = store.learned(&identities).await.map_err(|e| Failure::Failed(e.to_string()))?;
    store.close().await;
    print!("{}", profiles_table(&pool, &learned.profiles));
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

/// `learn-SUITE-HASH`, the hash over what a learning run is: the suite's items, which of them
/// (`--limit`, `--seed`) and the workers' identities. The same command on the same pool gives
/// the same id, so it goes on where a stopped one ended; a changed worker or suite a new one.
fn default_id(
    suite: &baton_eval::suite::Suite,
    identities: &[(String, String)],
    limit: Option<usize>,
    seed: u64,
) -> String {
    // FNV-1a: stable across builds and platforms, unlike the standard library's hasher.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let parts = [suite.sha256.clone(), format!("{limit:?} {seed}")];
    for part in parts.iter().chain(identities.iter().map(|(_, identity)| identity)) {
        for byte in part.bytes().chain([0]) {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("learn-{}-{:08x}", suite.name, hash >> 32)
}

/// One block per worker: whether its profile is current, then a line per category with right
/// of n, the 95% interval, cost and time per item; and what runs do with it.
pub fn profiles_table(pool: &Pool, profiles: &[Profile]) -> String {
    let mut out = String::new();
    for (w, p) in pool.workers.iter().zip(profiles) {
        match p.freshness {
            Freshness::None => {
                out.push_str(&format!("{}: not learned (`baton pool learn SUITE`)\n", p.worker));
                continue;
            }
            Freshness::Stale => out.push_str(&format!(
                "{}: STALE, not used: learned as `{}`, now `{}`; learn again\n",
                p.worker,
                p.identity.as_deref().unwrap_or("?"),
                w.identity()
            )),
            Freshness::Current => out.push_str(&format!("{}: learned in {}\n", p.worker, p.learned_in.join(", "))),
        }
        let unpriced = matches!(w.pricing(), Pricing::Unknown);
        for (category, f) in &p.by_category {
            let (low, high) = f.interval();
            let cost = if unpriced { "price unknown".to_owned() } else { format!("${:.6}/item", f.cost_per_item_usd) };
            out.push_str(&format!(
                "  {category:<20} {:>3} of {:<3} right  (95%: {:>3.0}-{:>3.0}%)  {cost}  {} ms p50  {} tokens/item\n",
                f.right,
                f.n,
                low * 100.0,
                high * 100.0,
                f.latency_p50_ms,
                f.tokens_per_item
            ));
        }
    }
    let fallback = &pool.options.fallback;
    if fallback.chosen {
        let name = fallback.worker.and_then(|w| pool.workers.get(w)).map_or("?", |w| w.name.as_str());
        out.push_str(&format!("The pool names its fallback worker ({name}): what was learned does not route runs.\n"));
        return out;
    }
    let measured = profile::measure(profiles, Vec::new());
    if !measured.best_by_category.is_empty() {
        out.push_str("Runs send each kind of question to:\n");
        for (category, w) in &measured.best_by_category {
            let name = pool.workers.get(*w).map_or("?", |w| w.name.as_str());
            let alone = match fallback.route {
                Route::Always => true,
                Route::Never => false,
                Route::Auto => measured.clear.contains_key(category),
            };
            let how = match (alone, fallback.route) {
                (true, Route::Always) => "alone, without a plan (route = \"always\")",
                (true, _) => "alone, without a plan (a clear margin)",
                (false, _) => "as the plan's lead (the conductor plans)",
            };
            out.push_str(&format!("  {category:<20} {name}, {how}\n"));
        }
    }
    out
}

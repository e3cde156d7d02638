//! Learning runs: every worker of a pool alone on a suite's items, kept as an evaluation under
//! the workers' identities, from which the history reads their profiles
//! (`baton_store::Store::learned`); and, where the pool has a conductor, several sampled plans
//! of the conductor's for each item, run and scored, whose right ones become its examples.
//! `baton pool learn` and the Workers screen's *Learn this pool* both start one here, so both
//! refuse the same input and resume the same run.

use baton_engine::{Pool, Route};

use baton_store::Store;

use crate::harness::{Ended, EvalError, Purpose, Spec};
use crate::strategy::Strategy;
use crate::suite::{self, Suite};

/// What the user asks to learn from.
#[derive(Debug, Clone, PartialEq)]
pub struct LearnOptions {
    /// A built-in suite's name or a JSONL file of items with answers.
    pub suite: String,
    /// Names the run; `None`: [`default_id`], so the same request resumes a stopped run.
    pub id: Option<String>,
    /// Learn from this many items, drawn stratified by category (`None`: all).
    pub limit: Option<usize>,
    pub seed: u64,
    /// Runs in flight at once.
    pub concurrency: usize,
    /// Spend at most this much in total, resumes included.
    pub max_cost_usd: Option<f64>,
    /// Plans the conductor writes (sampled) and runs for each item; 0, or a pool without a
    /// conductor: the workers alone only.
    pub plans: u32,
    /// Search for workflows (chains of two workers, then a fan-out) on the items no worker
    /// alone and no sampled plan answered.
    pub search: bool,
}

/// Plans per item by default: enough that a group of samples differs, few enough that
/// learning costs a few times what the workers alone cost.
pub const DEFAULT_PLANS: u32 = 3;

/// The conductor's temperature while it samples plans, where the pool's is lower: at 0 every
/// sample would be the same plan.
pub const SAMPLE_TEMPERATURE: f64 = 0.8;

impl LearnOptions {
    pub fn new(suite: impl Into<String>) -> LearnOptions {
        LearnOptions {
            suite: suite.into(),
            id: None,
            limit: None,
            seed: 1,
            concurrency: 4,
            max_cost_usd: None,
            plans: DEFAULT_PLANS,
            search: true,
        }
    }
}

/// Whether `pool` names a conductor model (local or remote), which learning samples plans of.
pub fn has_conductor(pool: &Pool) -> bool {
    pool.options.conductor.is_set()
}

/// The pool a learning run runs on: its conductor samples (at [`SAMPLE_TEMPERATURE`] at least)
/// and always plans, since a plan routed by what was learned before teaches nothing new.
pub fn sampling_pool(pool: &Pool) -> Pool {
    let mut pool = pool.clone();
    let conductor = &mut pool.options.conductor;
    conductor.temperature = Some(conductor.temperature.unwrap_or(0.0).max(SAMPLE_TEMPERATURE));
    pool.options.fallback.route = Route::Never;
    pool
}

/// The evaluation that teaches `pool`: each worker alone on the suite's items. Refused, before
/// any call, for a pool of one worker (there is nothing to choose between), a suite that cannot
/// be read or has an item without an answer, and settings that cannot run.
pub fn spec(pool: &Pool, options: &LearnOptions) -> Result<Spec, EvalError> {
    let mut suite = suite::load(&options.suite).map_err(|e| EvalError::Settings(e.to_string()))?;
    // Items pinned `test` are the held-out set that evaluations and conductor training score
    // on: learning never sees them.
    let before = suite.items.len();
    suite.items.retain(|i| i.split.as_deref() != Some("test"));
    let held_out = before - suite.items.len();
    // What is left is all learned from: an evaluation's calibration split means nothing here
    // (learning runs every item, none held back for a router).
    for item in &mut suite.items {
        item.split = None;
    }
    if suite.items.is_empty() {
        return Err(EvalError::Settings(format!(
            "every item of {} is pinned to the `test` split, which is held out from learning; learn from items pinned `calibration`, or without a split",
            suite.name
        )));
    }
    if pool.workers.len() < 2 {
        let only = pool.workers.first().map_or("none", |w| w.name.as_str());
        return Err(EvalError::Settings(format!(
            "the pool has one worker ({only}): learning finds which worker to send each kind of question to, so it needs two or more"
        )));
    }
    if options.concurrency == 0 {
        return Err(EvalError::Settings("runs at once must be at least 1".into()));
    }
    if let Some(cap) = options.max_cost_usd {
        baton_engine::limits::COST_USD.check("the spending cap", cap).map_err(EvalError::Settings)?;
    }
    if options.limit == Some(0) {
        return Err(EvalError::Settings("learn from at least one item".into()));
    }
    let workers: Vec<String> = pool.workers.iter().map(|w| w.name.clone()).collect();
    let identities: Vec<String> = pool.workers.iter().map(|w| w.identity()).collect();
    let plan_samples = if has_conductor(pool) { options.plans } else { 0 };
    let conductor = (plan_samples > 0).then(|| pool.options.conductor.identity());
    let list = if plan_samples > 0 { "conductor,all-singles" } else { "all-singles" };
    let strategies = Strategy::parse_list(list, &workers).map_err(EvalError::Settings)?;
    let id = match options.id.as_deref().map(str::trim) {
        Some(id) if !id.is_empty() => id.to_owned(),
        _ => default_id(&suite, &identities, options.limit, options.seed, plan_samples, conductor.as_deref()),
    };
    Ok(Spec {
        id,
        suite,
        suite_source: options.suite.clone(),
        strategies,
        repeats: 1,
        concurrency: options.concurrency,
        max_cost_usd: options.max_cost_usd,
        calibration: None,
        limit: options.limit,
        seed: options.seed,
        purpose: Purpose::Learn { identities, plan_samples, conductor, held_out, search: options.search },
    })
}

/// Leaves out of learning run `spec` each worker that a finished learning run already measured
/// alone on the same items (same suite, `limit` and `seed`) as it is defined now: after one
/// worker of a pool changed, learning again asks only that one (and the conductor, whose plans
/// use it). Returns each worker left out with the run it was measured in; profiles read those
/// runs too. The run `spec` names is not looked at, so a stopped run resumes as it started.
pub async fn leave_out_learned(
    spec: &mut Spec,
    pool: &Pool,
    store: &Store,
) -> Result<Vec<(String, String)>, EvalError> {
    if !matches!(spec.purpose, Purpose::Learn { .. }) {
        return Ok(Vec::new());
    }
    let mut measured: Vec<(String, String)> = Vec::new();
    for evaluation in store.evaluations().await? {
        let config = &evaluation.config;
        if evaluation.id == spec.id
            || evaluation.status != Ended::Finished.as_str()
            || evaluation.suite_sha256 != spec.suite.sha256
            || config["learn"] != serde_json::json!(true)
            || config["limit"] != serde_json::json!(spec.limit)
            || config["seed"] != serde_json::json!(spec.seed)
        {
            continue;
        }
        let strings = |key: &str| -> Vec<String> {
            config[key].as_array().into_iter().flatten().filter_map(|v| v.as_str().map(str::to_owned)).collect()
        };
        let (names, then, ran) = (strings("workers"), strings("identities"), strings("strategies"));
        for (name, identity) in names.iter().zip(&then) {
            if ran.contains(&format!("single:{name}")) && !measured.iter().any(|(i, _)| i == identity) {
                measured.push((identity.clone(), evaluation.id.clone()));
            }
        }
    }
    let mut left_out = Vec::new();
    spec.strategies.retain(|strategy| {
        let Strategy::Single(name) = strategy else { return true };
        let identity = pool.workers.iter().find(|w| &w.name == name).map(|w| w.identity());
        let Some((_, run)) = identity.and_then(|i| measured.iter().find(|(m, _)| *m == i)) else {
            return true;
        };
        left_out.push((name.clone(), run.clone()));
        false
    });
    Ok(left_out)
}

/// What to tell the user of a worker [`leave_out_learned`] left out.
pub fn left_out_note((worker, run): &(String, String)) -> String {
    format!("{worker} is not asked again: {run} measured it on these items as it is defined now")
}

/// How many items a learning run of `spec` asks each worker.
pub fn items(spec: &Spec) -> usize {
    spec.limit.map_or(spec.suite.items.len(), |l| l.min(spec.suite.items.len()))
}

/// What to tell the user of the items a learning run of `spec` held out (pinned `test`), if any.
pub fn held_out_note(spec: &Spec) -> Option<String> {
    match spec.purpose {
        Purpose::Learn { held_out, .. } if held_out > 0 => Some(format!(
            "{held_out} items of {} are pinned to the `test` split and held out: learning never sees them, evaluations score on them",
            spec.suite.name
        )),
        _ => None,
    }
}

/// How many plans a learning run of `spec` samples for each item (0: none).
pub fn plan_samples(spec: &Spec) -> u32 {
    match spec.purpose {
        Purpose::Learn { plan_samples, .. } => plan_samples,
        Purpose::Evaluate { .. } => 0,
    }
}

/// `learn-SUITE-HASH`, the hash over what a learning run is: the suite's items, which of them
/// (`limit`, `seed`), the plans per item, the conductor that writes them and the workers'
/// identities. The same request on the same pool gives the same id, so it goes on where a
/// stopped one ended; a changed worker, conductor or suite a new one.
pub fn default_id(
    suite: &Suite,
    identities: &[String],
    limit: Option<usize>,
    seed: u64,
    plans: u32,
    conductor: Option<&str>,
) -> String {
    // FNV-1a: stable across builds and platforms, unlike the standard library's hasher.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    // A run without plans hashes as it did before plans were learned, so it still resumes.
    let samples = match conductor {
        Some(conductor) if plans > 0 => format!(" {plans} plans by {conductor}"),
        _ => String::new(),
    };
    let parts = [suite.sha256.clone(), format!("{limit:?} {seed}{samples}")];
    for part in parts.iter().chain(identities) {
        for byte in part.bytes().chain([0]) {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("learn-{}-{:08x}", suite.name, hash >> 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(second_model: &str) -> Pool {
        let text = format!(
            "[[worker]]\nname = \"a\"\nprovider = \"openai\"\nmodel = \"m-1\"\n\n\
             [[worker]]\nname = \"b\"\nprovider = \"openai\"\nmodel = \"{second_model}\"\n"
        );
        Pool::parse(&text, "pool.toml").expect("pool")
    }

    #[test]
    fn the_same_request_on_the_same_pool_resumes_the_same_run_and_a_changed_worker_starts_another() {
        let options = LearnOptions { limit: Some(6), ..LearnOptions::new("mmlu") };
        let first = spec(&pool("m-2"), &options).expect("spec");
        assert!(first.id.starts_with("learn-mmlu-"), "{}", first.id);
        assert_eq!(spec(&pool("m-2"), &options).expect("spec").id, first.id);
        assert_ne!(spec(&pool("m-3"), &options).expect("spec").id, first.id);
        let other_seed = LearnOptions { seed: 2, ..options.clone() };
        assert_ne!(spec(&pool("m-2"), &other_seed).expect("spec").id, first.id);
        let named = LearnOptions { id: Some(" mine ".into()), ..options.clone() };
        assert_eq!(spec(&pool("m-2"), &named).expect("spec").id, "mine");
        assert_eq!(items(&first), 6);
        let Purpose::Learn { identities, plan_samples, .. } = &first.purpose else { panic!("a learning run") };
        assert_eq!(*plan_samples, 0, "a pool without a conductor learns no plans");
        assert_eq!(identities.len(), 2);
        assert_eq!(first.strategies.len(), 2, "each worker alone");
    }

    #[test]
    fn a_pool_with_a_conductor_also_samples_its_plans_and_runs_them_unrouted() {
        let text = "[conductor]\nmodel = \"c.gguf\"\nroute = \"always\"\n\n\
                    [[worker]]\nname = \"a\"\nprovider = \"openai\"\nmodel = \"m-1\"\n\n\
                    [[worker]]\nname = \"b\"\nprovider = \"openai\"\nmodel = \"m-2\"\n";
        let pool = Pool::parse(text, "pool.toml").expect("pool");
        let options = LearnOptions { limit: Some(6), ..LearnOptions::new("mmlu") };
        let with_plans = spec(&pool, &options).expect("spec");
        assert_eq!(plan_samples(&with_plans), DEFAULT_PLANS);
        assert_eq!(with_plans.strategies.len(), 3, "the conductor and each worker alone");
        let without = spec(&pool, &LearnOptions { plans: 0, ..options.clone() }).expect("spec");
        assert_eq!((plan_samples(&without), without.strategies.len()), (0, 2));
        assert_ne!(with_plans.id, without.id, "plans or none are two runs");
        // The workers-only run keeps the id it had before plans were learned.
        assert_eq!(
            without.id,
            spec(&super::tests::pool("m-2"), &LearnOptions { plans: 0, ..options }).expect("spec").id
        );

        let sampling = sampling_pool(&pool);
        assert_eq!(sampling.options.conductor.temperature, Some(SAMPLE_TEMPERATURE));
        assert_eq!(sampling.options.fallback.route, Route::Never);
    }

    #[test]
    fn what_cannot_be_learned_is_refused_with_the_reason() {
        let one =
            Pool::parse("[[worker]]\nname = \"a\"\nprovider = \"openai\"\nmodel = \"m\"\n", "pool.toml").expect("pool");
        let refused = |pool: &Pool, options: LearnOptions| spec(pool, &options).expect_err("refused").to_string();
        assert!(refused(&one, LearnOptions::new("mmlu")).contains("two or more"));
        assert!(refused(&pool("m-2"), LearnOptions::new("no-such-suite.jsonl")).contains("no-such-suite"));
        let broke = LearnOptions { concurrency: 0, ..LearnOptions::new("mmlu") };
        assert!(refused(&pool("m-2"), broke).contains("at least 1"));
        let capped = LearnOptions { max_cost_usd: Some(0.0), ..LearnOptions::new("mmlu") };
        assert!(refused(&pool("m-2"), capped).contains("spending cap must be a number above 0"));
        let none = LearnOptions { limit: Some(0), ..LearnOptions::new("mmlu") };
        assert!(refused(&pool("m-2"), none).contains("at least one item"));
    }
}

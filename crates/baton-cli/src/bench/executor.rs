//! `bench executor`: the executor's own overhead against the critical path of fake workers
//! whose latency is fixed, so every step's real duration is known.

use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_engine::prices;
use baton_engine::{Budget, Executor, PoolOptions, RunRequest, RunStatus, Worker, WorkerInfo};
use baton_plan::{Limits, Plan};
use baton_providers::ProviderKind;
use baton_providers::fake::FakeModel;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::median_max;
use crate::{Failure, Outcome};

const PLANS: &[(&str, &str)] = &[
    ("1-step", "model_id = [0]\nsubtasks = ['a']\naccess_list = [[]]"),
    (
        "chain",
        "model_id = [0, 1, 2, 3, 4]\nsubtasks = ['a', 'b', 'c', 'd', 'e']\naccess_list = [[], [0], [1], [2], [3]]",
    ),
    (
        "fan-out",
        "model_id = [0, 1, 2, 3, 4]\nsubtasks = ['a', 'b', 'c', 'd', 'e']\naccess_list = [[], [], [], [], [0, 1, 2, 3]]",
    ),
    (
        "all",
        "model_id = [0, 1, 2, 3, 4]\nsubtasks = ['a', 'b', 'c', 'd', 'e']\naccess_list = [[], 'all', 'all', 'all', 'all']",
    ),
];

pub(super) async fn run(latency_ms: u64, runs: usize, json: bool) -> Outcome {
    if runs == 0 {
        return Err(Failure::BadInput("--runs must be at least 1".into()));
    }
    let latency = Duration::from_millis(latency_ms);
    if !json {
        println!("executor overhead, fake workers at {latency_ms} ms, {runs} runs per plan (median / worst)");
        println!(
            "{:<8} {:>5} {:>14} {:>12} {:>17} {:>22}",
            "plan", "steps", "critical path", "wall", "wall / critical", "overhead per step"
        );
    }
    for (name, text) in PLANS {
        let plan = baton_plan::parse(text, &Limits::default()).map_err(|e| Failure::Failed(e.to_string()))?;
        let mut samples = Vec::with_capacity(runs);
        for _ in 0..runs {
            samples.push(measure(&plan, latency).await?);
        }
        let n = plan.steps.len() as f64;
        let mut ratios: Vec<f64> = samples.iter().map(|s| s.wall / s.critical).collect();
        let mut per_step_us: Vec<f64> = samples.iter().map(|s| (s.wall - s.critical) * 1e6 / n).collect();
        let mut walls: Vec<f64> = samples.iter().map(|s| s.wall).collect();
        let mut crits: Vec<f64> = samples.iter().map(|s| s.critical).collect();
        let (ratio_med, ratio_max) = median_max(&mut ratios);
        let (over_med, over_max) = median_max(&mut per_step_us);
        let (wall_med, _) = median_max(&mut walls);
        let (crit_med, _) = median_max(&mut crits);
        if json {
            println!(
                "{}",
                crate::json::line(&serde_json::json!({
                    "plan": name, "steps": plan.steps.len(), "runs": runs, "latency_ms": latency_ms,
                    "critical_path_ms": crit_med * 1e3, "wall_ms": wall_med * 1e3,
                    "ratio_median": ratio_med, "ratio_max": ratio_max,
                    "overhead_per_step_us_median": over_med, "overhead_per_step_us_max": over_max,
                }))
            );
        } else {
            println!(
                "{:<8} {:>5} {:>11.2} ms {:>9.2} ms {:>8.4} / {:<6.4} {:>7.0} µs / {:<7.0} µs",
                name,
                plan.steps.len(),
                crit_med * 1e3,
                wall_med * 1e3,
                ratio_med,
                ratio_max,
                over_med,
                over_max
            );
        }
    }
    Ok(())
}

struct Sample {
    /// Seconds.
    wall: f64,
    critical: f64,
}

async fn measure(plan: &Plan, latency: Duration) -> Result<Sample, Failure> {
    let fakes: Vec<FakeModel> = (0..plan.steps.len()).map(|i| FakeModel::new(format!("w{i}"), latency)).collect();
    let workers = fakes
        .iter()
        .enumerate()
        .map(|(i, f)| Worker {
            info: WorkerInfo {
                index: i,
                name: f.name.clone(),
                provider: ProviderKind::OpenAiCompatible,
                model: "fake".into(),
                description: None,
            },
            model: Arc::new(f.clone()),
            // Priced from the data set, and under caps that never bind (below), so every call
            // takes the whole accounting path: reserve, price, settle.
            // (Looked up as a pool does, which also decodes the data before the first run.)
            pricing: prices::lookup(ProviderKind::OpenAi, "", "gpt-4o"),
            output_cap: 4096,
            timeout: Duration::from_secs(60),
            endpoint: "fake".into(),
        })
        .collect();
    let budget = Budget { max_calls: Some(u32::MAX), max_tokens: Some(u64::MAX / 4), max_cost_usd: Some(1e12) };
    let options = PoolOptions { max_concurrency_per_provider: 16, budget, ..PoolOptions::default() };
    let executor = Executor::new(workers, options);
    let (tx, mut rx) = mpsc::unbounded_channel();
    // Drain events as a real consumer would, so their cost is in the measurement.
    let drain = tokio::spawn(async move {
        let mut n = 0usize;
        while let Some(e) = rx.recv().await {
            n += serde_json::to_string(&e).map_or(0, |s| s.len());
        }
        n
    });
    let request = RunRequest {
        run_id: "bench".into(),
        question: "bench".into(),
        plan: Some(plan.clone()),
        ..RunRequest::default()
    };
    let started = Instant::now();
    let outcome = executor.run(request, &tx, &CancellationToken::new()).await;
    let wall = started.elapsed().as_secs_f64();
    drop(tx);
    let _ = drain.await;
    if outcome.status != RunStatus::Finished {
        return Err(Failure::Failed(format!("benchmark run failed: {:?}", outcome.error)));
    }
    // Each step ran on its own fake, so a fake's busy time is that step's duration.
    let durations: Vec<f64> = fakes.iter().map(|f| f.busy().as_secs_f64()).collect();
    let deps = plan.dependencies();
    let mut finish = vec![0.0f64; durations.len()];
    for i in 0..durations.len() {
        let ready = deps[i].iter().map(|&j| finish[j]).fold(0.0, f64::max);
        finish[i] = ready + durations[i];
    }
    let critical = finish.iter().copied().fold(0.0, f64::max);
    Ok(Sample { wall, critical })
}

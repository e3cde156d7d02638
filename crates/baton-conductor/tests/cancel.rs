//! Cancelling a plan stops generation. In its own test binary: it measures the process's CPU
//! time, which other tests running in parallel would disturb.

use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_conductor::{ConductorOptions, LocalConductor};
use baton_engine::{Planner, PlanningContext, WorkerInfo};
use baton_local::{LocalModel, LocalModelConfig};
use baton_providers::ProviderKind;
use tokio::sync::mpsc;

async fn model() -> (tempfile::TempDir, Arc<LocalModel>) {
    let dir = tempfile::tempdir().expect("tempdir");
    baton_tinymodel::write_safetensors_model(dir.path(), &baton_tinymodel::TinySpec::default()).expect("write model");
    let config = LocalModelConfig { path: dir.path().to_path_buf(), force_cpu: true, ..Default::default() };
    let model = LocalModel::load(&config).await.unwrap_or_else(|e| panic!("the tiny model loads: {e}"));
    (dir, Arc::new(model))
}

fn workers(n: usize) -> Vec<WorkerInfo> {
    (0..n)
        .map(|i| WorkerInfo {
            index: i,
            name: format!("w{i}"),
            provider: ProviderKind::OpenAiCompatible,
            model: "m".into(),
            description: None,
        })
        .collect()
}

fn context(question: &str, pool_size: usize, max_steps: usize) -> PlanningContext {
    PlanningContext::question(question, pool_size, max_steps)
}

/// Process CPU time, from /proc (user + system, in clock ticks of 10 ms).
fn cpu_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    let after = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or_default();
    let fields: Vec<&str> = after.split_whitespace().collect();
    fields[11].parse::<u64>().unwrap_or(0) + fields[12].parse::<u64>().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn cancelling_a_plan_stops_generation() {
    let (_dir, model) = model().await;
    // Long reasoning allowed: left alone this generates for many seconds.
    let options = ConductorOptions {
        max_reasoning_chars: 4000,
        max_subtask_chars: 400,
        temperature: Some(1.0),
        ..ConductorOptions::default()
    };
    let conductor = LocalConductor::new(model.clone(), workers(3), options);
    // Bytes of plan text streamed.
    let (tx, mut rx) = mpsc::unbounded_channel::<usize>();
    let mut streamed = 0;
    let ledger = baton_engine::accounting::Ledger::new(baton_engine::accounting::Budget::default());
    let stop = tokio_util::sync::CancellationToken::new();
    // A BoxFuture, so `drop` below really drops it (tokio::pin! would only drop a reference).
    let mut plan = conductor.plan(
        context("Think at length.", 3, 5),
        Box::new(move |t: &str| {
            let _ = tx.send(t.len());
        }),
        baton_engine::accounting::Meter { ledger: &ledger, stop: &stop },
    );
    tokio::select! {
        _ = &mut plan => panic!("the plan finished before any text arrived"),
        first = rx.recv() => streamed += first.unwrap_or(0),
    }
    tokio::select! {
        _ = &mut plan => panic!("the plan finished within 300 ms of streaming; it should take seconds"),
        () = tokio::time::sleep(Duration::from_millis(300)) => {}
    }
    // Dropping the future drops the stream, which must end the sequence.
    drop(plan);
    while let Ok(bytes) = rx.try_recv() {
        streamed += bytes;
    }
    assert!(streamed > 0, "text was streaming");
    // The stopped plan counts its prompt and the text it wrote (mistral.rs reported nothing).
    let c = ledger.spent().conductor;
    assert_eq!((c.calls, c.usage.output_tokens), (1, streamed as u64), "{c:?}");
    assert!(c.usage.input_tokens > 50, "{c:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = cpu_ticks();
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let used = (cpu_ticks() - before) as f64 / 100.0 / started.elapsed().as_secs_f64();
    assert!(used < 0.3, "after cancelling, the process uses {used:.2} CPU-seconds per second");
}

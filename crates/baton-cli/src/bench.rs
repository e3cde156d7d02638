//! `baton bench`: measurements a user can repeat.
//!
//! `bench executor`: the executor's own overhead. Workers are in-process fakes with a fixed
//! latency, one per step, so each step's real duration is known exactly; the critical path is
//! the longest chain of those durations through the plan's DAG, and anything above it is the
//! executor's (scheduling, message building, events). `bench history`: the history database at
//! scale. `bench serve`: what `baton serve` adds to a run. `bench conductor`: a local
//! conductor model's speed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_engine::prices;
use baton_engine::{Budget, Executor, PoolOptions, RunRequest, RunStatus, Worker, WorkerInfo};
use baton_plan::{Limits, Plan};
use baton_providers::ProviderKind;
use baton_providers::fake::FakeModel;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::{Failure, Outcome};

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Wall time of 1-step, chain, fan-out and "all" plans against their critical path.
    Executor {
        /// Latency of every fake worker call.
        #[arg(long, default_value_t = 50)]
        latency_ms: u64,
        /// Runs per plan.
        #[arg(long, default_value_t = 20)]
        runs: usize,
        /// One JSON object per plan on stdout.
        #[arg(long)]
        json: bool,
    },
    /// The history at scale: fills a database with generated runs, then times listing the latest
    /// 50, searching (a common and a rare word), and loading one run's whole tree.
    History {
        /// The database to fill (created; an existing one gets more runs).
        #[arg(long, value_name = "FILE")]
        db: std::path::PathBuf,
        /// Runs to add before measuring.
        #[arg(long, default_value_t = 100_000)]
        runs: u32,
        /// Steps per generated run.
        #[arg(long, default_value_t = 3)]
        steps: u32,
        /// Repetitions of each query.
        #[arg(long, default_value_t = 50)]
        repeat: usize,
        /// One JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// What `baton serve` adds to a run: concurrent streamed requests over loopback to fake
    /// workers with a fixed latency, each one's time at the client against the executor's own
    /// wall time for its run (the difference is HTTP, checks, recording and streaming). The
    /// burst is sent on new connections, then `--bursts` times on the ones the first opened.
    Serve {
        /// Requests sent at once.
        #[arg(long, default_value_t = 64)]
        requests: usize,
        /// Bursts on open connections, each once the history has recorded the one before: the
        /// figures are over all of them (one burst's median moves by a millisecond from one go
        /// to the next on a small machine).
        #[arg(long, default_value_t = 5)]
        bursts: usize,
        /// Latency of every fake worker call.
        #[arg(long, default_value_t = 200)]
        latency_ms: u64,
        /// Serve without a history, to see what recording adds.
        #[arg(long)]
        no_history: bool,
        /// Pin the runtime's worker threads one per core, as `baton serve --pin-threads` does.
        #[arg(long)]
        pin_threads: bool,
        /// One JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// A local conductor model's speed: load time, prompt and decode rates, time to the first
    /// plan token cold (the first plan) and warm (later plans, whose prompts share the pool's
    /// prefix), plan tokens and time, and what the plan grammar costs per token.
    Conductor(ConductorArgs),
}

#[derive(Debug, clap::Args)]
pub struct ConductorArgs {
    /// A .gguf file or a safetensors model directory.
    #[arg(long, value_name = "PATH")]
    model: std::path::PathBuf,
    /// Plans to write; the first is cold, the others warm.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Workers in the pool the plans are for.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// The conductor's prompt version (v2, v3).
    #[arg(long, default_value = baton_conductor::PROMPT_VERSION)]
    prompt: String,
    /// Longest reasoning before the lists (default: the prompt version's: 1200 for v2, 0 for v3).
    #[arg(long)]
    max_reasoning_chars: Option<usize>,
    /// Sampling temperature of the plans (0 is greedy); default the conductor's.
    #[arg(long)]
    temperature: Option<f64>,
    /// Run on the CPU even when a GPU is available.
    #[arg(long)]
    cpu: bool,
    /// In-situ quantization while loading a safetensors model (e.g. Q4K).
    #[arg(long)]
    isq: Option<String>,
    /// A chat template (.jinja) for a model that lacks one.
    #[arg(long, value_name = "FILE")]
    chat_template: Option<std::path::PathBuf>,
    /// One JSON object on stdout.
    #[arg(long)]
    json: bool,
}

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

pub async fn run(cmd: Command) -> Outcome {
    match cmd {
        Command::Executor { latency_ms, runs, json } => executor(latency_ms, runs, json).await,
        Command::History { db, runs, steps, repeat, json } => history(&db, runs, steps, repeat, json).await,
        Command::Serve { requests, bursts, latency_ms, no_history, pin_threads, json } => {
            serve(requests, bursts, latency_ms, !no_history, pin_threads, json).await
        }
        #[cfg(feature = "local")]
        Command::Conductor(args) => conductor::run(args).await,
        #[cfg(not(feature = "local"))]
        Command::Conductor(_) => Err(Failure::BadInput("this build of baton runs no local models".into())),
    }
}

async fn executor(latency_ms: u64, runs: usize, json: bool) -> Outcome {
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
                serde_json::json!({
                    "plan": name, "steps": plan.steps.len(), "runs": runs, "latency_ms": latency_ms,
                    "critical_path_ms": crit_med * 1e3, "wall_ms": wall_med * 1e3,
                    "ratio_median": ratio_med, "ratio_max": ratio_max,
                    "overhead_per_step_us_median": over_med, "overhead_per_step_us_max": over_max,
                })
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

async fn serve(requests: usize, bursts: usize, latency_ms: u64, history: bool, pinned: bool, json: bool) -> Outcome {
    if requests == 0 || bursts == 0 {
        return Err(Failure::BadInput("--requests and --bursts must be at least 1".into()));
    }
    let failed = |e: &dyn std::fmt::Display| Failure::Failed(e.to_string());
    let latency = Duration::from_millis(latency_ms);
    let fake = FakeModel::new("w0", latency);
    let worker = Worker {
        info: WorkerInfo {
            index: 0,
            name: "w0".into(),
            provider: ProviderKind::OpenAiCompatible,
            model: "fake".into(),
            description: None,
        },
        model: Arc::new(fake),
        pricing: prices::lookup(ProviderKind::OpenAi, "", "gpt-4o"),
        output_cap: 4096,
        timeout: Duration::from_secs(60),
        endpoint: "fake".into(),
    };
    let options = PoolOptions { max_concurrency_per_provider: requests, ..PoolOptions::default() };
    let executor = Arc::new(Executor::new(vec![worker], options));
    // The same burst on the executor alone first (twice: the first warms it, as the server's
    // first burst does), for what the load costs a run wherever it is started.
    in_process(&executor, requests).await;
    let mut alone = Vec::with_capacity(bursts * requests);
    for _ in 0..bursts {
        alone.extend(in_process(&executor, requests).await);
    }
    alone.sort_by(f64::total_cmp);
    let dir = tempfile::tempdir().map_err(|e| failed(&e))?;
    let store = baton_store::Store::open(&dir.path().join("history.sqlite")).await.map_err(|e| failed(&e))?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.map_err(|e| failed(&e))?;
    let port = listener.local_addr().map_err(|e| failed(&e))?.port();
    let token = "bench-token";
    let serve_options = baton_serve::ServeOptions {
        port,
        token: Some(token.into()),
        // Room for both bursts, and for the first one's runs still waiting for the history.
        max_concurrent_runs: 2 * requests,
        ..baton_serve::ServeOptions::default()
    };
    let service = Arc::new(
        baton_serve::Service::new(executor, false, history.then(|| store.clone()), serve_options)
            .map_err(|e| failed(&e))?,
    );
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(baton_serve::serve(listener, service.clone(), shutdown.clone()));
    let body = serde_json::json!({
        "model": "baton/w0",
        "messages": [{ "role": "user", "content": "How fast is the server?" }],
        "stream": true,
    })
    .to_string();
    let request: Arc<[u8]> = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
    .into();
    // Each request is its own task, as each would be its own client.
    let burst = async move |connections: Vec<Option<tokio::net::TcpStream>>| {
        let tasks: Vec<_> = connections
            .into_iter()
            .map(|open| {
                let request = request.clone();
                tokio::spawn(async move {
                    let started = Instant::now();
                    let mut connection = match open {
                        Some(c) => c,
                        None => tokio::net::TcpStream::connect(("127.0.0.1", port)).await.map_err(|e| e.to_string())?,
                    };
                    let (head, received) = load::post(&mut connection, &request).await?;
                    let wall = started.elapsed().as_secs_f64() * 1000.0;
                    let head = (head - started).as_secs_f64() * 1000.0;
                    Ok::<_, String>((wall, head, received, connection))
                })
            })
            .collect();
        let mut overhead: Vec<f64> = Vec::new();
        let mut heads: Vec<f64> = Vec::new();
        let mut errors = Vec::new();
        let mut open = Vec::new();
        // Every response is read whole before any is decoded: decoding one would hold up the
        // reading of the others, and count as the server's time.
        let mut received = Vec::with_capacity(tasks.len());
        for task in tasks {
            received.push(task.await.map_err(|e| e.to_string()).and_then(|r| r));
        }
        for response in received {
            let decoded = response.and_then(|(wall, head, received, connection)| {
                let body = load::body(received)?;
                Ok((wall, head, load::run_wall_ms(&body)?, connection))
            });
            match decoded {
                Ok((wall, head, run, connection)) => {
                    overhead.push((wall - run).max(0.0));
                    heads.push(head);
                    open.push(Some(connection));
                }
                Err(e) => errors.push(e),
            }
        }
        (overhead, heads, errors, open)
    };
    // The first burst opens a connection per request, as new clients would; the others reuse
    // them, as a client with a connection pool (every SDK) does. The server's own cost is
    // theirs; the first adds the kernel's and the client's connection set-up.
    // The clients run on their own thread and runtime, as clients in another process would: the
    // server's threads serve, and the machine's cores are shared between the two by the OS.
    let settle = service.clone();
    let clients = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
        runtime.block_on(async move {
            let started = Instant::now();
            let (mut cold, _, mut errors, mut open) = burst((0..requests).map(|_| None).collect()).await;
            let cold_s = started.elapsed().as_secs_f64();
            cold.sort_by(f64::total_cmp);
            let (mut overhead, mut heads, mut total_s) = (Vec::new(), Vec::new(), 0.0);
            for _ in 0..bursts {
                // The records of the burst before are written before the next starts, so that
                // each measures serving alone.
                settle.settle().await;
                let started = Instant::now();
                let (o, h, more, reopened) = burst(open).await;
                total_s += started.elapsed().as_secs_f64();
                open = reopened;
                overhead.extend(o);
                heads.extend(h);
                errors.extend(more);
            }
            overhead.sort_by(f64::total_cmp);
            heads.sort_by(f64::total_cmp);
            Ok::<_, String>((cold, cold_s, errors, overhead, heads, total_s))
        })
    });
    let (cold, cold_s, errors, overhead, heads, total_s) = tokio::task::spawn_blocking(move || clients.join())
        .await
        .map_err(|e| failed(&e))?
        .map_err(|_| Failure::Failed("the load's clients panicked".into()))?
        .map_err(|e| failed(&e))?;
    let runs = (1 + bursts) * requests;
    // The history records beside the answers: give it a moment to catch up, then count.
    let mut finished = 0;
    for _ in 0..if history { 100 } else { 0 } {
        let recorded =
            store.list_runs(u32::try_from(runs + 10).unwrap_or(u32::MAX), None).await.map_err(|e| failed(&e))?;
        finished = recorded.iter().filter(|r| r.status == baton_store::RunStatus::Finished).count();
        if finished == runs {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    let _ = server.await;
    store.close().await;
    let pct = |v: &[f64], p: f64| v.get(((v.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(f64::NAN);
    let (p50, p99, max) = (pct(&overhead, 0.5), pct(&overhead, 0.99), overhead.last().copied().unwrap_or(f64::NAN));
    let (cold_p50, cold_p99) = (pct(&cold, 0.5), pct(&cold, 0.99));
    let (head_p50, head_p99) = (pct(&heads, 0.5), pct(&heads, 0.99));
    let (alone_p50, alone_p99) = (pct(&alone, 0.5), pct(&alone, 0.99));
    if json {
        println!(
            "{}",
            serde_json::json!({
                "requests": requests, "bursts": bursts, "latency_ms": latency_ms, "ok": overhead.len(), "errors": errors,
                "history": history, "pinned_threads": pinned, "recorded_finished": finished, "runs": runs, "overhead_ms_p50": p50,
                "overhead_ms_p99": p99, "overhead_ms_max": max, "head_ms_p50": head_p50, "head_ms_p99": head_p99,
                "total_s": total_s, "in_process": { "overhead_ms_p50": alone_p50, "overhead_ms_p99": alone_p99 },
                "new_connections": {
                    "ok": cold.len(), "overhead_ms_p50": cold_p50, "overhead_ms_p99": cold_p99, "total_s": cold_s,
                },
            })
        );
    } else {
        println!(
            "{requests} streamed requests at once over loopback, on new connections, then {bursts} times on them; \
             fake worker at {latency_ms} ms{}",
            if pinned { "; worker threads pinned one per core" } else { "" }
        );
        let answered = cold.len() + overhead.len();
        if history {
            println!("  answered: {answered} of {runs}; runs finished in the history: {finished}");
        } else {
            println!("  answered: {answered} of {runs}; no history");
        }
        println!("  added by the server (client wall − run wall; the run's wall is to the nearest ms, so ±0.5 ms)");
        println!(
            "    on open connections:  p50 {p50:.2} ms, p99 {p99:.2} ms, max {max:.2} ms ({total_s:.2} s in all, \
             {bursts} bursts)"
        );
        println!(
            "    time to the response's head (sent with the run's first events): p50 {head_p50:.2} ms, p99 {head_p99:.2} ms"
        );
        println!("    on new connections:   p50 {cold_p50:.2} ms, p99 {cold_p99:.2} ms ({cold_s:.2} s in all)");
        println!(
            "  the same burst on the executor alone, in this process (no HTTP, no history): each run's time at its caller \
             against its own wall, p50 {alone_p50:.2} ms, p99 {alone_p99:.2} ms"
        );
        for e in errors.iter().take(5) {
            println!("  error: {e}");
        }
    }
    if !errors.is_empty() || (history && finished != runs) {
        return Err(Failure::Failed(format!(
            "{} requests failed and {finished} of {runs} runs finished in the history",
            errors.len()
        )));
    }
    Ok(())
}

/// `requests` runs at once on `executor`, each on its own task, its events taken as they come:
/// how much longer each takes at its caller than its own wall time (sorted, in ms). Under load
/// the runs' own work queues on the same cores; this is that share, which a run started by the
/// app or the command line pays as well as a served one.
async fn in_process(executor: &Arc<Executor>, requests: usize) -> Vec<f64> {
    let question = "How fast is the server?";
    let tasks: Vec<_> = (0..requests)
        .map(|i| {
            let executor = executor.clone();
            // From the moment the run is asked for, as a client's time starts when it sends.
            let started = Instant::now();
            tokio::spawn(async move {
                let request = RunRequest {
                    run_id: format!("bench-{i}"),
                    question: question.into(),
                    plan: Some(baton_engine::fallback::alone_plan(0, &[], question)),
                    ..RunRequest::default()
                };
                let (tx, mut rx) = mpsc::unbounded_channel();
                let run = async move { executor.run(request, &tx, &CancellationToken::new()).await };
                let drain = async { while rx.recv().await.is_some() {} };
                let (outcome, ()) = tokio::join!(run, drain);
                (outcome.status == RunStatus::Finished)
                    .then(|| started.elapsed().as_secs_f64() * 1000.0 - outcome.totals.wall_ms as f64)
            })
        })
        .collect();
    let mut overhead = Vec::with_capacity(requests);
    for task in tasks {
        if let Ok(Some(ms)) = task.await {
            overhead.push(ms.max(0.0));
        }
    }
    overhead.sort_by(f64::total_cmp);
    overhead
}

async fn history(db: &std::path::Path, runs: u32, steps: u32, repeat: usize, json: bool) -> Outcome {
    let failed = |e: baton_store::StoreError| Failure::Failed(e.to_string());
    if repeat == 0 {
        return Err(Failure::BadInput("--repeat must be at least 1".into()));
    }
    let store = baton_store::Store::open(db).await.map_err(|e| Failure::BadInput(e.to_string()))?;
    let started = Instant::now();
    let last = baton_store::synthetic::populate(&store, runs, steps, 7).await.map_err(failed)?;
    let fill_s = started.elapsed().as_secs_f64();
    eprintln!("added {runs} runs of {steps} steps in {fill_s:.1} s");
    let total: Vec<baton_store::RunSummary> = store.list_runs(1, None).await.map_err(failed)?;
    let newest = total.first().map_or(last, |r| r.id);
    let time = async |label: &str, f: &mut dyn FnMut() -> futures::future::BoxFuture<'static, usize>| {
        let mut ms = Vec::with_capacity(repeat);
        let mut n = 0;
        for _ in 0..repeat {
            let t = Instant::now();
            n = f().await;
            ms.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        let (median, max) = median_max(&mut ms);
        eprintln!("{label:<28} {median:>8.2} ms median  {max:>8.2} ms worst  ({n} results)");
        (label.to_owned(), median, max, n)
    };
    let s = store.clone();
    let list = time("list latest 50", &mut || {
        let s = s.clone();
        Box::pin(async move { s.list_runs(50, None).await.map_or(0, |r| r.len()) })
    })
    .await;
    let s = store.clone();
    let common = time("search a common word", &mut || {
        let s = s.clone();
        Box::pin(async move { s.search("energy", 50).await.map_or(0, |r| r.len()) })
    })
    .await;
    let s = store.clone();
    let rare = time("search a rare phrase", &mut || {
        let s = s.clone();
        Box::pin(async move { s.search(&format!("case {}", newest / 2), 50).await.map_or(0, |r| r.len()) })
    })
    .await;
    let s = store.clone();
    let open = time("open one run", &mut || {
        let s = s.clone();
        Box::pin(async move { s.run(newest / 2).await.ok().flatten().map_or(0, |t| t.steps.len()) })
    })
    .await;
    store.close().await;
    if json {
        let figures: Vec<serde_json::Value> = [list, common, rare, open]
            .into_iter()
            .map(|(label, median, max, n)| serde_json::json!({"query": label, "median_ms": median, "max_ms": max, "results": n}))
            .collect();
        println!("{}", serde_json::json!({"runs_in_db": newest, "fill_s": fill_s, "queries": figures}));
    }
    Ok(())
}

/// The serve bench's client: HTTP/1.1 by hand, one request at a time per connection. A client
/// library's own work (pools, header maps, body streams) would run on the same two cores as the
/// server and count as the server's; this one does little more than copy bytes.
mod load {
    use std::time::Instant;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// Sends `request` and reads its response to the end of its chunked body; returns when its
    /// first bytes (the head) arrived, and the response (for [`body`]).
    pub(super) async fn post(connection: &mut TcpStream, request: &[u8]) -> Result<(Instant, Vec<u8>), String> {
        connection.write_all(request).await.map_err(|e| e.to_string())?;
        let mut received = Vec::with_capacity(4096);
        let mut first = None;
        let mut status_read = false;
        // Every chunked body ends with an empty chunk; an SSE body never holds a `\r`.
        while !received.ends_with(b"\r\n0\r\n\r\n") {
            if connection.read_buf(&mut received).await.map_err(|e| e.to_string())? == 0 {
                return Err("the server closed the connection mid-response".into());
            }
            first.get_or_insert_with(Instant::now);
            if !status_read && let Some(end) = received.windows(2).position(|w| w == b"\r\n") {
                if !received.starts_with(b"HTTP/1.1 200 ") {
                    return Err(String::from_utf8_lossy(&received[..end]).into_owned());
                }
                status_read = true;
            }
        }
        Ok((first.unwrap_or_else(Instant::now), received))
    }

    /// The body of a response `post` received.
    pub(super) fn body(received: Vec<u8>) -> Result<String, String> {
        let text = String::from_utf8(received).map_err(|e| e.to_string())?;
        let (head, mut chunked) = text.split_once("\r\n\r\n").ok_or("no end to the response's headers")?;
        if !head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
            return Err("the response is not chunked".into());
        }
        let mut body = String::new();
        loop {
            let (size, rest) = chunked.split_once("\r\n").ok_or("a chunk without its size")?;
            let size = usize::from_str_radix(size, 16).map_err(|e| format!("chunk size {size:?}: {e}"))?;
            if size == 0 {
                return Ok(body);
            }
            body.push_str(rest.get(..size).ok_or("a chunk shorter than its size")?);
            chunked = rest.get(size + 2..).ok_or("a chunk without its end")?;
        }
    }

    /// The run's own wall time, from the `baton` object of a stream's last chunk.
    pub(super) fn run_wall_ms(body: &str) -> Result<f64, String> {
        let body = body.strip_suffix("data: [DONE]\n\n").ok_or("the stream did not end with [DONE]")?;
        let last = body.rsplit("data: ").next().unwrap_or_default();
        let chunk: serde_json::Value = serde_json::from_str(last.trim()).map_err(|e| e.to_string())?;
        chunk["baton"]["wall_ms"].as_f64().ok_or_else(|| "no wall_ms in the last chunk".to_owned())
    }
}

fn median_max(values: &mut [f64]) -> (f64, f64) {
    values.sort_by(f64::total_cmp);
    (values[values.len() / 2], values[values.len() - 1])
}

#[cfg(feature = "local")]
mod conductor {
    use std::sync::Arc;
    use std::time::Instant;

    use baton_conductor::local::{GenerateOptions, Generated, LocalModel, LocalModelConfig};
    use baton_conductor::{ConductorOptions, LocalConductor, PromptBuilder};
    use baton_engine::{PlanningContext, WorkerInfo};
    use baton_providers::ProviderKind;

    use super::{ConductorArgs, median_max};
    use crate::{Failure, Outcome};

    const QUESTIONS: &[&str] = &[
        "What is the sum of the first 100 prime numbers?",
        "Write a Python function that checks whether a string is a palindrome, ignoring punctuation.",
        "Who wrote 'The Master and Margarita', and when was it first published?",
        "A rectangle's perimeter is 46 cm and its area is 120 cm^2. What are its sides?",
        "Explain the difference between TCP and UDP to a new programmer.",
        "Is 2^31 - 1 prime? Justify the answer.",
    ];

    /// One plan's figures.
    struct Sample {
        plan_s: f64,
        first_token_s: f64,
        prompt_tokens: u64,
        cached_tokens: u64,
        tokens: u64,
        /// Tokens after the first, per second of the time after the first.
        decode_tps: f64,
        stop_reason: String,
        cut: bool,
    }

    impl Sample {
        fn new(generated: &Generated, secs: f64) -> Sample {
            let first = generated.time_to_first_token.map_or(secs, |d| d.as_secs_f64());
            let tokens = generated.usage.output_tokens;
            let decode_tps = if secs > first { tokens.saturating_sub(1) as f64 / (secs - first) } else { 0.0 };
            Sample {
                plan_s: secs,
                first_token_s: first,
                prompt_tokens: generated.usage.input_tokens,
                cached_tokens: generated.usage.cached_input_tokens,
                tokens,
                decode_tps,
                stop_reason: generated.finish_reason.clone().unwrap_or_default(),
                cut: generated.cut_after_complete,
            }
        }
    }

    fn median(values: impl Iterator<Item = f64>) -> f64 {
        let mut v: Vec<f64> = values.collect();
        if v.is_empty() { f64::NAN } else { median_max(&mut v).0 }
    }

    fn mib(bytes: u64) -> f64 {
        bytes as f64 / (1024.0 * 1024.0)
    }

    /// The process's peak resident memory (`VmHWM` in `/proc/self/status`; Linux only).
    fn peak_rss_bytes() -> Option<u64> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }

    /// The threads candle's CPU kernels use: `RAYON_NUM_THREADS` when set, else every core.
    fn threads() -> usize {
        std::env::var("RAYON_NUM_THREADS")
            .ok()
            .and_then(|n| n.parse().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get))
    }

    pub async fn run(a: ConductorArgs) -> Outcome {
        if a.runs == 0 || a.workers == 0 {
            return Err(Failure::BadInput("--runs and --workers must be at least 1".into()));
        }
        let config = LocalModelConfig {
            path: a.model.clone(),
            chat_template: a.chat_template.clone(),
            force_cpu: a.cpu,
            isq: a.isq.clone(),
            ..LocalModelConfig::default()
        };
        eprintln!("loading {} …", a.model.display());
        let model = Arc::new(LocalModel::load(&config).await.map_err(|e| Failure::BadInput(e.to_string()))?);
        eprintln!("loaded in {:.2} s on {}", model.load_time.as_secs_f64(), model.device);
        let workers: Vec<WorkerInfo> = (0..a.workers)
            .map(|i| WorkerInfo {
                index: i,
                name: format!("w{i}"),
                provider: ProviderKind::OpenAi,
                model: "m".into(),
                description: Some(
                    ["strong at math", "careful reviewer", "fast and cheap", "strong at code"][i % 4].into(),
                ),
            })
            .collect();
        let defaults = ConductorOptions::default();
        let version = baton_conductor::PromptVersion::parse(&a.prompt).ok_or_else(|| {
            Failure::BadInput(format!(
                "--prompt {}: expected one of {}",
                a.prompt,
                baton_conductor::PromptVersion::NAMES.join(", ")
            ))
        })?;
        let options = ConductorOptions {
            prompt_version: version,
            max_reasoning_chars: a.max_reasoning_chars.unwrap_or(version.default_reasoning_chars()),
            temperature: a.temperature.or(defaults.temperature),
            ..defaults
        };
        let prompts = PromptBuilder::new(workers.clone()).with_version(version);
        let conductor = LocalConductor::new(model.clone(), workers, options.clone());
        let stop = tokio_util::sync::CancellationToken::new();
        let mut samples = Vec::with_capacity(a.runs);
        for i in 0..a.runs {
            let question = QUESTIONS[i % QUESTIONS.len()];
            let ctx = PlanningContext::question(question, a.workers, 5);
            let started = Instant::now();
            let mut progress = LiveLine::new(format!("[{}/{}]", i + 1, a.runs));
            let mut on_text = |t: &str| progress.add(t);
            let ledger = baton_engine::accounting::Ledger::new(baton_engine::Budget::default());
            let meter = baton_engine::accounting::Meter { ledger: &ledger, stop: &stop };
            let (planned, stats) = conductor
                .plan_with_stats(&ctx, &mut on_text, meter)
                .await
                .map_err(|e| Failure::Failed(e.to_string()))?;
            progress.clear();
            let sample = Sample::new(&stats, started.elapsed().as_secs_f64());
            eprintln!(
                "[{}/{}] {} steps; prompt {} tokens ({} cached), first token {:.2} s; {} tokens in {:.2} s ({})",
                i + 1,
                a.runs,
                planned.plan.steps.len(),
                sample.prompt_tokens,
                sample.cached_tokens,
                sample.first_token_s,
                sample.tokens,
                sample.plan_s,
                if sample.cut { "cut after the fence".to_owned() } else { sample.stop_reason.clone() },
            );
            samples.push(sample);
        }

        // The same prompt and length again without the grammar: what the grammar costs per
        // token. The prompt is cached by now, so this is decoding alone.
        let plan_tokens = median(samples.iter().map(|s| s.tokens as f64));
        let ctx = PlanningContext::question(QUESTIONS[0], a.workers, 5);
        let free = GenerateOptions {
            grammar: None,
            max_tokens: plan_tokens.max(16.0) as usize,
            temperature: options.temperature,
            complete_at: None,
        };
        let started = Instant::now();
        let generated = model
            .generate(Some(&prompts.system(&ctx)), &prompts.messages(&ctx), &free, &mut |_| {})
            .await
            .map_err(|e| Failure::Failed(e.to_string()))?;
        let free = Sample::new(&generated, started.elapsed().as_secs_f64());

        let cold = &samples[0];
        let warm = &samples[1..];
        let prompt_tps_cold = (cold.prompt_tokens - cold.cached_tokens) as f64 / cold.first_token_s;
        let decode = median(samples.iter().map(|s| s.decode_tps));
        let grammar_ms = 1000.0 / decode - 1000.0 / free.decode_tps;
        let first_warm = median(warm.iter().map(|s| s.first_token_s));
        let plan_warm = median(warm.iter().map(|s| s.plan_s));
        let cached_warm = median(warm.iter().map(|s| s.cached_tokens as f64));
        let plan_max = samples.iter().map(|s| s.plan_s).fold(0.0, f64::max);
        let cut = samples.iter().filter(|s| s.cut).count();
        let stopped = samples.iter().filter(|s| s.stop_reason == "stop").count();
        if a.json {
            println!(
                "{}",
                serde_json::json!({
                    "model": a.model.display().to_string(), "device": model.device,
                    "simd": baton_conductor::cpu::simd_level(), "threads": threads(), "runs": a.runs,
                    "load_s": model.load_time.as_secs_f64(),
                    "prompt_tokens": cold.prompt_tokens, "prompt_tokens_per_s_cold": prompt_tps_cold,
                    "cached_prompt_tokens_warm": cached_warm,
                    "first_token_s_cold": cold.first_token_s, "first_token_s_warm": first_warm,
                    "plan_s_cold": cold.plan_s, "plan_s_warm": plan_warm, "plan_s_max": plan_max,
                    "plan_tokens_median": plan_tokens,
                    "decode_tokens_per_s": decode, "decode_tokens_per_s_without_grammar": free.decode_tps,
                    "grammar_ms_per_token": grammar_ms,
                    "plans_ended_by_stop_token": stopped, "plans_cut_after_fence": cut,
                    "model_memory_mb": model.memory_bytes.map(mib), "peak_rss_mb": peak_rss_bytes().map(mib),
                })
            );
        } else {
            let na = |v: f64| if v.is_nan() { "n/a (one run)".to_owned() } else { format!("{v:.2} s") };
            println!("model        {} on {}", a.model.display(), model.device);
            println!("build        {}, {} threads", baton_conductor::cpu::simd_level(), threads());
            println!("load         {:.2} s", model.load_time.as_secs_f64());
            println!(
                "prompt       {} tokens, {prompt_tps_cold:.0} tokens/s cold; {cached_warm:.0} cached when warm (median)",
                cold.prompt_tokens
            );
            println!("first token  {:.2} s cold, {} warm (median)", cold.first_token_s, na(first_warm));
            println!(
                "plan         {:.2} s cold, {} warm (median), {plan_max:.2} s worst; {plan_tokens:.0} tokens (median)",
                cold.plan_s,
                na(plan_warm)
            );
            println!(
                "decode       {decode:.1} tokens/s under the grammar, {:.1} without: the grammar adds {grammar_ms:.1} ms a token",
                free.decode_tps
            );
            println!("ended        {stopped} of {} by the end token, {cut} cut after the closing fence", a.runs);
            let shown = |b: Option<u64>| b.map_or_else(|| "n/a".to_owned(), |b| format!("{:.0} MiB", mib(b)));
            println!(
                "memory       {} taken by loading the model; {} peak resident",
                shown(model.memory_bytes),
                shown(peak_rss_bytes())
            );
        }
        Ok(())
    }

    /// A progress line on a terminal's stderr, redrawn at most ten times a second while the plan
    /// is written: characters so far and their rate. Nothing when stderr is not a terminal.
    struct LiveLine {
        label: String,
        tty: bool,
        started: Instant,
        drawn: Option<Instant>,
        chars: usize,
    }

    impl LiveLine {
        fn new(label: String) -> Self {
            use std::io::IsTerminal;
            LiveLine { label, tty: std::io::stderr().is_terminal(), started: Instant::now(), drawn: None, chars: 0 }
        }

        fn add(&mut self, text: &str) {
            self.chars += text.chars().count();
            if !self.tty || self.drawn.is_some_and(|d| d.elapsed().as_millis() < 100) {
                return;
            }
            self.drawn = Some(Instant::now());
            let secs = self.started.elapsed().as_secs_f64();
            eprint!("\r{} writing the plan: {} chars, {:.1} s\x1b[K", self.label, self.chars, secs);
        }

        fn clear(&self) {
            if self.tty && self.drawn.is_some() {
                eprint!("\r\x1b[K");
            }
        }
    }
}

//! `bench serve`: what `baton serve` adds to a run, measured by a hand-written client over
//! loopback against the same runs on the executor alone.

use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_engine::prices;
use baton_engine::{Executor, PoolOptions, RunRequest, RunStatus, Worker, WorkerInfo};
use baton_providers::ProviderKind;
use baton_providers::fake::FakeModel;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::{Failure, Outcome};

pub(super) async fn run(
    requests: usize,
    bursts: usize,
    latency_ms: u64,
    history: bool,
    slots: usize,
    pinned: bool,
    json: bool,
) -> Outcome {
    if requests == 0 || bursts == 0 || slots == 0 {
        return Err(Failure::BadInput("--requests, --bursts and --max-concurrent-runs must be at least 1".into()));
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
        max_concurrent_runs: slots,
        ..baton_serve::ServeOptions::default()
    };
    let queue = serve_options.max_queued_runs;
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
            crate::json::line(&serde_json::json!({
                "requests": requests, "bursts": bursts, "latency_ms": latency_ms, "ok": overhead.len(), "errors": errors,
                "history": history, "slots": slots, "queue_depth": queue, "pinned_threads": pinned, "recorded_finished": finished, "runs": runs, "overhead_ms_p50": p50,
                "overhead_ms_p99": p99, "overhead_ms_max": max, "head_ms_p50": head_p50, "head_ms_p99": head_p99,
                "total_s": total_s, "in_process": { "overhead_ms_p50": alone_p50, "overhead_ms_p99": alone_p99 },
                "new_connections": {
                    "ok": cold.len(), "overhead_ms_p50": cold_p50, "overhead_ms_p99": cold_p99, "total_s": cold_s,
                },
            }))
        );
    } else {
        println!(
            "{requests} streamed requests at once over loopback, on new connections, then {bursts} times on them; \
             fake worker at {latency_ms} ms{}",
            if pinned { "; worker threads pinned one per core" } else { "" }
        );
        println!("  {slots} run slots; up to {queue} more requests wait their turn (the server's default queue)");
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

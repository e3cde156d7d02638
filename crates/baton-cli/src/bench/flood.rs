//! `bench flood`: what a flood costs `baton serve` in resident memory, one bound at a time: idle
//! connections, the bodies of requests waiting in the queue, the responses kept for
//! `Idempotency-Key`, and a remote conductor whose plan never ends. Each is sent far past its
//! bound, each in a process of its own; the figures are that process's resident memory (server
//! and clients) before, while flooded, and after.
//!
//! Resident memory counts what the allocator keeps as well as what is in use: "after" shows
//! what was not handed back to the system, not a leak by itself. Linux only (`/proc`).

use std::sync::Arc;
use std::time::Duration;

use baton_engine::{Executor, PoolOptions, Worker, WorkerInfo, prices};
use baton_providers::fake::FakeModel;
use baton_providers::{ChatEvent, ChatModel, ChatRequest, ChatStream, ProviderError, ProviderKind, Usage};
use futures::StreamExt;
use futures::future::BoxFuture;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use crate::{Failure, Outcome};

/// Idle connections opened, against the server's [`baton_serve::MAX_CONNECTIONS`].
const CONNECTIONS: usize = 3000;
/// Requests with a large body sent while the one run slot is taken.
const QUEUED_REQUESTS: usize = 120;
const QUEUED_BODY_BYTES: usize = 3 << 20;
/// Keyed requests, each answered with a large response the server keeps for a repeat.
const KEYED_REQUESTS: usize = 800;
const KEYED_RESPONSE_BYTES: usize = 128 << 10;
const TOKEN: &str = "bench-flood-token-0123456789abcdef";

/// One bound, flooded.
struct Phase {
    name: &'static str,
    offered: String,
    bound: String,
    outcome: String,
    before: Option<u64>,
    flooded: Option<u64>,
    after: Option<u64>,
}

/// The floods, in the order they run.
const PHASES: usize = 4;

/// Runs each flood in a process of its own (this program, `--only N`), so that what one leaves
/// in the allocator does not hide what the next costs; with `only`, runs that one here.
pub(super) async fn run(only: Option<usize>, json: bool) -> Outcome {
    let failed = |e: &dyn std::fmt::Display| Failure::Failed(e.to_string());
    if let Some(n) = only {
        let descriptors = raise_descriptor_limit();
        let phase = match n {
            0 => connections(descriptors).await,
            1 => queued_bodies().await,
            2 => kept_responses().await,
            3 => endless_plan().await,
            _ => return Err(Failure::BadInput(format!("--only takes 0 to {}", PHASES - 1))),
        }
        .map_err(|e| failed(&e))?;
        println!(
            "{}",
            serde_json::json!({
                "flood": phase.name, "offered": phase.offered, "bound": phase.bound, "outcome": phase.outcome,
                "rss_kib_before": phase.before, "rss_kib_flooded": phase.flooded, "rss_kib_after": phase.after,
                "rss_kib_peak": status_kib("VmHWM:"),
            })
        );
        return Ok(());
    }
    let exe = std::env::current_exe().map_err(|e| failed(&e))?;
    let mut phases = Vec::with_capacity(PHASES);
    for n in 0..PHASES {
        let out = tokio::process::Command::new(&exe)
            .args(["bench", "flood", "--only", &n.to_string()])
            .stdin(std::process::Stdio::null())
            .output()
            .await
            .map_err(|e| failed(&e))?;
        if !out.status.success() {
            return Err(Failure::Failed(format!("flood {n} failed: {}", String::from_utf8_lossy(&out.stderr).trim())));
        }
        let phase: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| failed(&e))?;
        phases.push(phase);
    }
    if json {
        println!("{}", crate::json::line(&serde_json::json!({ "phases": phases })));
        return Ok(());
    }
    let mib = |v: &serde_json::Value| {
        v.as_u64().map_or_else(|| "unknown".to_owned(), |k| format!("{:.1} MiB", k as f64 / 1024.0))
    };
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_owned();
    println!("resident memory of a server and its clients in one process, a process for each flood:");
    for p in &phases {
        println!("  {}: {}", text(&p["flood"]), text(&p["offered"]));
        println!("    bound: {}", text(&p["bound"]));
        println!("    {}", text(&p["outcome"]));
        println!(
            "    resident: before {}, flooded {}, after {} (peak {})",
            mib(&p["rss_kib_before"]),
            mib(&p["rss_kib_flooded"]),
            mib(&p["rss_kib_after"]),
            mib(&p["rss_kib_peak"])
        );
    }
    Ok(())
}

/// A server on a loopback port with workers `slow` (20 s a call) and `big` (answers
/// [`KEYED_RESPONSE_BYTES`] at once), `slots` runs at a time, no history.
async fn start(slots: usize) -> Result<(u16, CancellationToken, tokio::task::JoinHandle<()>), String> {
    let worker = |index: usize, name: &str, model: Arc<dyn ChatModel>| Worker {
        info: WorkerInfo {
            index,
            name: name.into(),
            provider: ProviderKind::OpenAiCompatible,
            model: "fake".into(),
            description: None,
        },
        model,
        pricing: prices::lookup(ProviderKind::OpenAi, "", "gpt-4o"),
        output_cap: 1 << 20,
        timeout: Duration::from_secs(60),
        endpoint: "fake".into(),
    };
    let workers = vec![
        worker(0, "slow", Arc::new(FakeModel::new("slow", Duration::from_secs(20)))),
        worker(1, "big", Arc::new(Big)),
    ];
    let executor = Arc::new(Executor::new(workers, PoolOptions::default()));
    let listener = TcpListener::bind("127.0.0.1:0").await.map_err(|e| e.to_string())?;
    let port = listener.local_addr().map_err(|e| e.to_string())?.port();
    let options = baton_serve::ServeOptions {
        port,
        token: Some(TOKEN.into()),
        max_concurrent_runs: slots,
        ..baton_serve::ServeOptions::default()
    };
    let service = Arc::new(baton_serve::Service::new(executor, false, None, options).map_err(|e| e.to_string())?);
    let shutdown = CancellationToken::new();
    let server = tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            let _ = baton_serve::serve(listener, service, shutdown).await;
        }
    });
    Ok((port, shutdown, server))
}

/// Stops a server started by [`start`], without waiting for its runs (the slow worker's last
/// twenty seconds would be the bench's).
async fn stop(shutdown: CancellationToken, server: tokio::task::JoinHandle<()>) {
    shutdown.cancel();
    server.abort();
    let _ = server.await;
    settle().await;
}

async fn settle() {
    tokio::time::sleep(Duration::from_millis(500)).await;
}

/// A non-streamed chat request to worker `worker` with `content` as the question; shared by
/// every client that sends it, so that the clients' own memory stays small beside the server's.
fn request(port: u16, worker: &str, content: &str, key: Option<&str>) -> Arc<[u8]> {
    let body = serde_json::json!({
        "model": format!("baton/{worker}"),
        "messages": [{ "role": "user", "content": content }],
    })
    .to_string();
    let key = key.map(|k| format!("Idempotency-Key: {k}\r\n")).unwrap_or_default();
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {TOKEN}\r\n{key}\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
    .into()
}

/// Sends `request` on a new connection and reads the whole response (the server closes it);
/// returns its status code.
async fn send(port: u16, request: Arc<[u8]>) -> Result<u16, String> {
    let mut connection = TcpStream::connect(("127.0.0.1", port)).await.map_err(|e| e.to_string())?;
    connection.write_all(&request).await.map_err(|e| e.to_string())?;
    let mut received = Vec::new();
    connection.read_to_end(&mut received).await.map_err(|e| e.to_string())?;
    let status = received.get(9..12).and_then(|s| std::str::from_utf8(s).ok()).and_then(|s| s.parse().ok());
    status.ok_or_else(|| "no status line".to_owned())
}

async fn connections(descriptors: u64) -> Result<Phase, String> {
    let (port, shutdown, server) = start(1).await?;
    let before = rss_kib();
    // Each open connection takes a descriptor on both ends until the server stops accepting.
    let wanted = CONNECTIONS.min(descriptors.saturating_sub(256) as usize);
    let mut open = Vec::with_capacity(wanted);
    let mut refused = None;
    for _ in 0..wanted {
        // Once the kernel's backlog is full too, a connection waits for the server to accept
        // one; the flood has then reached the bound.
        match tokio::time::timeout(Duration::from_secs(1), TcpStream::connect(("127.0.0.1", port))).await {
            Ok(Ok(c)) => open.push(c),
            Ok(Err(e)) => {
                refused = Some(e.to_string());
                break;
            }
            Err(_) => {
                refused = Some("the next connection waited (the server accepts no more, the backlog is full)".into());
                break;
            }
        }
    }
    settle().await;
    let flooded = rss_kib();
    let opened = open.len();
    drop(open);
    stop(shutdown, server).await;
    Ok(Phase {
        name: "idle connections",
        offered: format!("{opened} connections opened that send nothing"),
        bound: format!(
            "the server holds at most {} open; the rest wait in the kernel's backlog",
            baton_serve::MAX_CONNECTIONS
        ),
        outcome: refused.map_or_else(|| "every connection was opened".to_owned(), |e| format!("then: {e}")),
        before,
        flooded,
        after: rss_kib(),
    })
}

async fn queued_bodies() -> Result<Phase, String> {
    let (port, shutdown, server) = start(1).await?;
    let before = rss_kib();
    // The one slot, taken for twenty seconds; everything after it waits or is refused.
    let first = tokio::spawn(send(port, request(port, "slow", "Take the slot.", None)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let big = request(port, "slow", &"x".repeat(QUEUED_BODY_BYTES), None);
    let tasks: Vec<_> = (0..QUEUED_REQUESTS).map(|_| tokio::spawn(send(port, big.clone()))).collect();
    drop(big);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let flooded = rss_kib();
    let mut statuses = Vec::new();
    let mut waiting = 0;
    for task in tasks {
        if task.is_finished() {
            if let Ok(Ok(status)) = task.await {
                statuses.push(status);
            }
        } else {
            waiting += 1;
            task.abort();
        }
    }
    first.abort();
    stop(shutdown, server).await;
    let refused = statuses.iter().filter(|s| **s == 429 || **s == 503).count();
    Ok(Phase {
        name: "queued request bodies",
        offered: format!(
            "{QUEUED_REQUESTS} requests of {} MiB each ({} MiB) while the one run slot is taken",
            QUEUED_BODY_BYTES >> 20,
            (QUEUED_REQUESTS * QUEUED_BODY_BYTES) >> 20
        ),
        bound: format!("at most {} MiB of waiting bodies; past it, 429 at once", baton_serve::MAX_QUEUED_BYTES >> 20),
        outcome: format!("{waiting} waited in the queue, {refused} were refused at once"),
        before,
        flooded,
        after: rss_kib(),
    })
}

async fn kept_responses() -> Result<Phase, String> {
    let (port, shutdown, server) = start(8).await?;
    let before = rss_kib();
    let mut ok = 0;
    // Eight at a time, each with its own key: every answer is kept for a repeat, up to the bound.
    for batch in (0..KEYED_REQUESTS).collect::<Vec<_>>().chunks(8) {
        let tasks: Vec<_> = batch
            .iter()
            .map(|i| tokio::spawn(send(port, request(port, "big", "Answer at length.", Some(&format!("flood-{i}"))))))
            .collect();
        for task in tasks {
            if matches!(task.await, Ok(Ok(200))) {
                ok += 1;
            }
        }
    }
    settle().await;
    let flooded = rss_kib();
    stop(shutdown, server).await;
    Ok(Phase {
        name: "kept idempotent responses",
        offered: format!(
            "{KEYED_REQUESTS} keyed requests answered with {} KiB each ({} MiB)",
            KEYED_RESPONSE_BYTES >> 10,
            (KEYED_REQUESTS * KEYED_RESPONSE_BYTES) >> 20
        ),
        bound: format!(
            "at most {} responses and {} MiB kept; the oldest answered go first",
            baton_serve::KEPT_AT_MOST,
            baton_serve::KEPT_BYTES_AT_MOST >> 20
        ),
        outcome: format!("{ok} of {KEYED_REQUESTS} answered"),
        before,
        flooded,
        after: rss_kib(),
    })
}

/// A remote conductor whose server streams plan text without end.
async fn endless_plan() -> Result<Phase, String> {
    use baton_engine::Planner;
    let listener = TcpListener::bind("127.0.0.1:0").await.map_err(|e| e.to_string())?;
    let port = listener.local_addr().map_err(|e| e.to_string())?.port();
    let streamed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let server = tokio::spawn(endless_server(listener, streamed.clone()));
    let before = rss_kib();
    let http = baton_providers::HttpModel::new(
        ProviderKind::OpenAiCompatible,
        &format!("http://127.0.0.1:{port}/v1"),
        baton_providers::ModelSettings::new("endless"),
        Arc::new(|| Ok(None)),
        baton_providers::HttpModel::http_client(),
    );
    let workers = vec![WorkerInfo {
        index: 0,
        name: "w".into(),
        provider: ProviderKind::OpenAi,
        model: "m".into(),
        description: None,
    }];
    let options = baton_conductor::ConductorOptions::default();
    let conductor = baton_conductor::RemoteConductor::new(Arc::new(http), "endless".into(), workers, &options);
    let planned = tokio::time::timeout(
        Duration::from_secs(60),
        conductor.plan(
            baton_engine::PlanningContext::question("What is 2+2?", 1, 5),
            Box::new(|_: &str| {}),
            baton_engine::accounting::unmetered(),
        ),
    )
    .await;
    let flooded = rss_kib();
    server.abort();
    let outcome = match planned {
        Ok(Ok(_)) => "a plan came back (the bound did not hold)".to_owned(),
        Ok(Err(e)) => format!("refused: {e}"),
        Err(_) => "still reading after 60 s (the bound did not hold)".to_owned(),
    };
    settle().await;
    Ok(Phase {
        name: "a remote conductor's endless plan",
        offered: format!(
            "a server that never ends its plan ({} KiB sent before the conductor hung up)",
            streamed.load(std::sync::atomic::Ordering::Relaxed) >> 10
        ),
        bound: format!("at most {} KiB of plan text", baton_conductor::REMOTE_MAX_PLAN_BYTES >> 10),
        outcome,
        before,
        flooded,
        after: rss_kib(),
    })
}

/// Answers every connection with an OpenAI-style stream of plan text that never ends, counting
/// the bytes it sends into `streamed`.
async fn endless_server(listener: TcpListener, streamed: Arc<std::sync::atomic::AtomicUsize>) {
    let piece = serde_json::json!({ "choices": [{ "index": 0, "delta": { "content": "x".repeat(8 << 10) } }] });
    let event = format!("data: {piece}\n\n");
    let chunk: Arc<[u8]> = format!("{:x}\r\n{event}\r\n", event.len()).into_bytes().into();
    while let Ok((mut connection, _)) = listener.accept().await {
        let (chunk, streamed) = (chunk.clone(), streamed.clone());
        tokio::spawn(async move {
            let mut head = [0u8; 64 << 10];
            // The request's head and body; what they say does not matter.
            if connection.read(&mut head).await.is_err() {
                return;
            }
            let response = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";
            if connection.write_all(response.as_bytes()).await.is_err() {
                return;
            }
            while connection.write_all(&chunk).await.is_ok() {
                streamed.fetch_add(chunk.len(), std::sync::atomic::Ordering::Relaxed);
            }
        });
    }
}

/// A worker that answers at once with [`KEYED_RESPONSE_BYTES`] of text.
struct Big;

impl ChatModel for Big {
    fn stream(&self, _request: ChatRequest) -> BoxFuture<'static, Result<ChatStream, ProviderError>> {
        Box::pin(async move {
            let text = "y".repeat(KEYED_RESPONSE_BYTES);
            let usage = Usage { input_tokens: 10, output_tokens: text.len() as u64 / 4, ..Usage::default() };
            let items =
                vec![Ok(ChatEvent::Text(text)), Ok(ChatEvent::Done { usage, stop_reason: Some("stop".into()) })];
            Ok(futures::stream::iter(items).boxed())
        })
    }
}

/// This process's resident memory in KiB, where the system says it.
fn rss_kib() -> Option<u64> {
    status_kib("VmRSS:")
}

fn status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line[field.len()..].trim().trim_end_matches("kB").trim().parse().ok()
}

/// Raises this process's open-file limit to its hard limit (the connections flood needs a
/// descriptor per connection on each end); returns the limit now in force.
fn raise_descriptor_limit() -> u64 {
    #[cfg(unix)]
    {
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit and setrlimit only read and write the struct passed to them.
        #[allow(unsafe_code)]
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
                return 1024;
            }
            let raised = libc::rlimit { rlim_cur: limit.rlim_max.min(65536), rlim_max: limit.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                return raised.rlim_cur;
            }
        }
        limit.rlim_cur
    }
    #[cfg(not(unix))]
    {
        1024
    }
}

//! `baton serve`: the orchestrated pool as one OpenAI-compatible model, over HTTP.
//!
//! `GET /v1/models` lists `baton` (the conductor over the whole pool) and `baton/<worker>` for
//! each worker alone; `POST /v1/chat/completions` (and `POST /v1/responses`, its text form) runs a question through the same executor,
//! accounting and history as the app and `baton ask`, streamed (SSE) or not. Every request
//! passes the [`guard`] first (token, `Host`, `Origin`). What a client cannot be given (tools,
//! several choices, images, …) is refused by name with a 400, never ignored.
//!
//! The server holds a built [`Executor`], so the CLI and the app can each serve the conductor
//! they already loaded.

mod chat;
mod day;
mod error;
pub mod guard;
mod handling;
mod history;
mod idempotency;
mod models;
mod request;
mod responses;
mod stall;
mod token;

use std::sync::Arc;

use axum::Router;
use axum::routing::{get, post};
use baton_engine::Executor;
use baton_store::Store;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

pub use error::ApiError;
pub use guard::Guard;
pub use idempotency::{KEPT_AT_MOST, KEPT_BYTES_AT_MOST};
pub use token::{TOKEN_ACCOUNT, TokenError, token};

/// How a server is bound and bounded.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub host: String,
    pub port: u16,
    /// The bearer token clients must send; `None` (`--no-token`) is refused off loopback.
    pub token: Option<String>,
    /// Web origins allowed to call (browsers are refused otherwise).
    pub allow_origins: Vec<String>,
    /// The largest request body, in bytes (413 above).
    pub max_body_bytes: usize,
    /// The most messages in one request (400 above).
    pub max_messages: usize,
    /// Runs at once; requests beyond them wait their turn in a queue.
    pub max_concurrent_runs: usize,
    /// Requests that may wait for a run slot, first in first out; one beyond them gets 429
    /// with `Retry-After`. A client that hangs up leaves the queue.
    pub max_queued_runs: usize,
    /// How long a write to a client may wait (a client that stopped reading) before the
    /// connection is closed and its run cancelled, as a disconnect would.
    pub write_stall: std::time::Duration,
    /// The most the server spends in a day (UTC), all requests together: each run holds its
    /// worst case of what is left and is capped at it, so the runs in flight together never
    /// pass it (see `day.rs`); once it is spent requests get 429 until midnight. The day's
    /// count is kept in the history, so it survives a restart.
    pub daily_max_cost_usd: Option<f64>,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            host: "127.0.0.1".into(),
            port: DEFAULT_PORT,
            token: None,
            allow_origins: Vec::new(),
            max_body_bytes: 4 << 20,
            max_messages: 500,
            max_concurrent_runs: 8,
            max_queued_runs: DEFAULT_QUEUE,
            write_stall: std::time::Duration::from_secs(30),
            daily_max_cost_usd: None,
        }
    }
}

/// What every request handler shares.
#[derive(Debug)]
pub struct Service {
    executor: Arc<Executor>,
    /// Worker names, in pool order (model `baton/<name>` is worker `index`).
    workers: Vec<String>,
    /// Whether `baton` (the whole pool) is served: the executor has a planner, or the pool
    /// routes every question without one.
    conductor: bool,
    store: Option<Store>,
    options: ServeOptions,
    guard: Guard,
    /// The run slots; tokio's semaphore hands them out first come, first served.
    runs: Arc<Semaphore>,
    /// Requests waiting for a run slot.
    queued: Arc<std::sync::atomic::AtomicUsize>,
    /// The bytes of the bodies being read or waiting for a run slot.
    queued_bytes: Arc<std::sync::atomic::AtomicUsize>,
    /// The responses of requests sent with an `Idempotency-Key`.
    idempotent: idempotency::Responses,
    /// Runs whose events the history is still recording (it records beside the answer).
    recording: Arc<InFlight>,
    /// The history's writer, started with the first run (on the runtime that serves).
    writer: std::sync::OnceLock<history::Writer>,
    /// What the server spent on the day it is counting (days since 1970, UTC; dollars), and
    /// what the runs in flight hold of it.
    day: day::Day,
    /// Unix seconds the server started: the models' `created`.
    created: u64,
    /// Requests seen, and those answered with an error (refused by the guard included).
    requests: std::sync::atomic::AtomicU64,
    failed: std::sync::atomic::AtomicU64,
}

/// What a server has done since it started, for the app's Local API section.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Stats {
    /// Every request that reached the server, refused ones included.
    pub requests: u64,
    /// Those answered with an error status (4xx or 5xx).
    pub failed: u64,
    /// Runs going now (each holds a place under `max_concurrent_runs` until it ends).
    pub runs_in_flight: usize,
    /// Requests waiting for a run slot.
    pub runs_queued: usize,
    /// What the runs finished today (UTC) cost, in dollars.
    pub spent_today_usd: f64,
}

impl Service {
    /// A service over `executor` (serving `baton` when `conductor`: it plans, or routes every
    /// question), recording every run in
    /// `store` when there is one. Fails on a bind that needs a token and has none.
    pub fn new(
        executor: Arc<Executor>,
        conductor: bool,
        store: Option<Store>,
        options: ServeOptions,
    ) -> Result<Service, String> {
        guard::check_bind(&options.host, options.token.is_some())?;
        if let Some(token) = &options.token {
            guard::check_token(&options.host, token)?;
        }
        // NaN or infinity would cap nothing (every comparison with NaN is false), 0 or less
        // would refuse every request: a server never starts with either.
        if let Some(cap) = options.daily_max_cost_usd {
            baton_engine::limits::COST_USD
                .check("the day's spending cap (--daily-max-cost-usd, or [serve] daily_max_cost_usd)", cap)?;
        }
        let guard = Guard {
            token: options.token.clone(),
            hosts: guard::allowed_hosts(&options.host, options.port),
            origins: options.allow_origins.iter().map(|o| guard::normalize_origin(o)).collect(),
        };
        let workers = executor.workers().iter().map(|w| w.info.name.clone()).collect();
        Ok(Service {
            executor,
            workers,
            conductor,
            store,
            runs: Arc::new(Semaphore::new(options.max_concurrent_runs.max(1))),
            queued: Arc::default(),
            queued_bytes: Arc::default(),
            idempotent: idempotency::Responses::default(),
            recording: Arc::default(),
            writer: std::sync::OnceLock::new(),
            day: day::Day::default(),
            guard,
            options,
            created: now_secs(),
            requests: Default::default(),
            failed: Default::default(),
        })
    }

    /// What the server has done since it started.
    pub fn stats(&self) -> Stats {
        use std::sync::atomic::Ordering::Relaxed;
        let spent_today_usd = self.today().spent;
        Stats {
            requests: self.requests.load(Relaxed),
            failed: self.failed.load(Relaxed),
            runs_in_flight: self.options.max_concurrent_runs.max(1) - self.runs.available_permits(),
            runs_queued: self.queued.load(Relaxed),
            spent_today_usd,
        }
    }

    /// The model ids served, in order: `baton` when there is a conductor, then each worker.
    pub fn model_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.conductor.then(|| "baton".to_owned()).into_iter().collect();
        ids.extend(self.workers.iter().map(|w| format!("baton/{w}")));
        ids
    }

    /// A model id's target: `None` for the conductor, `Some(i)` for worker `i` alone.
    fn target(&self, model: &str) -> Result<Option<usize>, ApiError> {
        let unknown = || {
            ApiError::not_found(
                Some("model"),
                format!("The model `{model}` does not exist on this server; GET /v1/models lists its models"),
            )
        };
        if model == "baton" {
            return if self.conductor {
                Ok(None)
            } else {
                Err(ApiError::not_found(
                    Some("model"),
                    "this server has no conductor (its pool names none); ask a worker alone as `baton/<worker>`",
                ))
            };
        }
        let name = model.strip_prefix("baton/").ok_or_else(unknown)?;
        self.workers.iter().position(|w| w == name).map(Some).ok_or_else(unknown)
    }
}

/// A count of tasks in flight, and a way to wait for none.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    count: std::sync::atomic::AtomicUsize,
    idle: tokio::sync::Notify,
}

impl InFlight {
    pub(crate) fn enter(self: &Arc<Self>) -> InFlightGuard {
        self.count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        InFlightGuard(self.clone())
    }

    /// Tasks in flight now.
    pub(crate) fn count(&self) -> usize {
        self.count.load(std::sync::atomic::Ordering::SeqCst)
    }

    async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            if self.count.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// Leaves the count when dropped.
#[derive(Debug)]
pub(crate) struct InFlightGuard(Arc<InFlight>);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, std::sync::atomic::Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// Seconds since 1970 (UTC).
fn now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl Service {
    /// What the server spent today (UTC) and what its runs hold; a new day starts at 0 spent.
    fn today(&self) -> std::sync::MutexGuard<'_, day::Today> {
        self.day.today(now_secs() / 86_400)
    }

    /// A 429 once the day's cap is spent (nothing to do on a server without one).
    pub(crate) fn check_today(&self) -> Result<(), ApiError> {
        let Some(cap) = self.options.daily_max_cost_usd else { return Ok(()) };
        let spent = self.today().spent;
        if spent < cap {
            return Ok(());
        }
        let until_midnight = 86_400 - now_secs() % 86_400;
        Err(ApiError {
            code: Some("daily_cap_reached"),
            ..ApiError::capped(
                format!(
                    "this server's daily spending cap of ${cap:.2} is reached (spent ${spent:.4} today, UTC); it resets at midnight UTC"
                ),
                Some(until_midnight),
            )
        })
    }

    /// Holds `call`'s worst case of what is free of the day's cap (the cap less what was spent
    /// and what the runs in flight hold), and caps the run at what it holds (see `day.rs`).
    /// `None` on a server without a daily cap; a 429 when nothing is free.
    pub(crate) fn hold_for_run(&self, call: &mut request::Call) -> Result<Option<day::DayHold>, ApiError> {
        let Some(cap) = self.options.daily_max_cost_usd else { return Ok(None) };
        self.check_today()?;
        // The run's own cap where it has one (the request's, else the pool's; the executor
        // applies the tighter), else its worst case at the dearest prices.
        let own = [call.budget.and_then(|b| b.max_cost_usd), self.executor.options().budget.max_cost_usd]
            .into_iter()
            .flatten()
            .reduce(f64::min);
        let worst = own.unwrap_or_else(|| day::worst_run_cost(&self.executor, call));
        let mut today = self.today();
        let free = cap - today.spent - today.held;
        if free <= 0.0 {
            return Err(ApiError {
                code: Some("daily_cap_reached"),
                ..ApiError::capped(
                    format!(
                        "what is left of this server's daily spending cap of ${cap:.2} (spent ${:.4} today, UTC) is held by the runs in flight (${:.4}); try again once they end",
                        today.spent, today.held
                    ),
                    Some(5),
                )
            });
        }
        let hold = self.day.hold(&mut today, worst.min(free));
        let budget = call.budget.get_or_insert_with(Default::default);
        budget.max_cost_usd = Some(budget.max_cost_usd.map_or(hold.amount(), |c| c.min(hold.amount())));
        Ok(Some(hold))
    }

    /// Takes up what servers on this history spent today (UTC), so a server that restarts goes
    /// on counting the day's cap instead of starting it again. Called before it serves.
    pub async fn restore_spend(&self) {
        let Some(store) = &self.store else { return };
        let day = now_secs() / 86_400;
        match store.serve_spend(day).await {
            Ok(usd) => {
                let mut today = self.day.today(day);
                today.spent = usd;
            }
            Err(e) => tracing::warn!("today's spending so far could not be read from the history: {e}"),
        }
    }

    /// The history and its writer, when the server keeps a history.
    fn history(&self) -> Option<(&Store, &history::Writer)> {
        let store = self.store.as_ref()?;
        Some((store, self.writer.get_or_init(|| history::Writer::spawn(store.clone()))))
    }

    /// Waits (at most a couple of seconds) until the history holds every run that ended before
    /// now: a follow-up request may come the moment its client has the earlier answer.
    async fn caught_up(&self) {
        if let Some(writer) = self.writer.get() {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(2), writer.flush()).await;
        }
    }

    /// Counts a finished run's cost against the day.
    fn spend(&self, usd: f64) {
        self.today().spent += usd;
    }

    /// Waits until the history has recorded every run so far (a server that stops calls it
    /// before closing the history, so no run is lost).
    pub async fn settle(&self) {
        self.recording.idle().await;
    }
}

/// Requests that may wait for a run slot by default: enough that a burst of 64 streamed
/// requests from one client all finish on the default 8 slots, as a local model server's
/// queue lets them (Ollama queues 512).
pub const DEFAULT_QUEUE: usize = 256;

/// The most bytes of request bodies a server holds at once, being read or waiting for a run
/// slot (each waits with its parsed copy, about as many bytes again), counted by their declared
/// length: past it, a request gets 429 with `Retry-After` before its body is read, as with a
/// full queue.
pub const MAX_QUEUED_BYTES: usize = 64 << 20;

/// The most connections a server holds open at once; past them it accepts no more until one
/// closes. Each holds a little memory even idle; 1,024 is far above what the run slots and the
/// queue can use.
pub const MAX_CONNECTIONS: usize = 1024;

/// The port served on when neither the pool's `[serve]` table nor the user names one.
pub const DEFAULT_PORT: u16 = 8765;

/// The fewest runs that may wait for the history (ended, not yet recorded) before new runs are
/// refused with 429; more with a larger `max_concurrent_runs` (twice it).
pub const HISTORY_BACKLOG: usize = 64;

/// The routes, behind the guard.
pub fn router(service: Arc<Service>) -> Router {
    Router::new()
        .route("/v1/models", get(models::list))
        .route("/v1/models/{*id}", get(models::one))
        .route("/v1/chat/completions", post(chat::completions))
        .route("/v1/responses", post(responses::create))
        .fallback(|| async {
            ApiError::not_found(
                None,
                "no such route; this server serves /v1/models, /v1/chat/completions and /v1/responses",
            )
        })
        .method_not_allowed_fallback(|method: axum::http::Method| async move {
            ApiError::method_not_allowed(format!(
                "{method} is not served here; /v1/models takes GET, /v1/chat/completions and /v1/responses take POST"
            ))
        })
        // Inside the guard: only a caller with the token has its responses kept.
        .layer(axum::middleware::from_fn_with_state(service.clone(), idempotency::replay))
        // Outside the replay, which reads the body too; inside the guard, so that a caller
        // without the token never has its body read.
        .layer(axum::middleware::from_fn_with_state(service.clone(), handling::bound_body))
        .layer(axum::middleware::from_fn_with_state(service.clone(), guard::check))
        .layer(axum::middleware::from_fn_with_state(service.clone(), count))
        .with_state(service)
}

/// Counts every request and every error answer (outside the guard, so refusals count too), and
/// makes sure each error answer says whether to retry: one that axum or a layer makes itself,
/// not Baton's [`ApiError`], gets `x-should-retry: false`, since the official SDKs otherwise
/// retry 408, 409, 429 and 5xx.
async fn count(
    axum::extract::State(service): axum::extract::State<Arc<Service>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use std::sync::atomic::Ordering::Relaxed;
    service.requests.fetch_add(1, Relaxed);
    let mut response = next.run(request).await;
    if response.status().is_client_error() || response.status().is_server_error() {
        service.failed.fetch_add(1, Relaxed);
        let headers = response.headers_mut();
        let retry = axum::http::HeaderName::from_static("x-should-retry");
        if !headers.contains_key(&retry) {
            headers.insert(retry, axum::http::HeaderValue::from_static("false"));
        }
    }
    response
}

/// Serves until `shutdown` is cancelled, then waits for the history to record every run
/// (runs still in flight are cancelled with their requests).
pub async fn serve(
    listener: tokio::net::TcpListener,
    service: Arc<Service>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    service.restore_spend().await;
    // Streamed answers are many small writes: with Nagle's algorithm on, a write may wait for
    // the client's acknowledgement of the one before, which a client across a network can hold
    // back for tens of milliseconds (delayed ACK). (Over loopback Linux acknowledges at once,
    // and pieces 10 ms apart arrived 10 ms apart either way.)
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp: &mut tokio::net::TcpStream| {
        let _ = tcp.set_nodelay(true);
    });
    let connections = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let listener = stall::Stalling { inner: listener, stall: service.options.write_stall, connections };
    let served =
        axum::serve(listener, router(service.clone())).with_graceful_shutdown(shutdown.cancelled_owned()).await;
    service.settle().await;
    served
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_run_holds_its_worst_case_of_what_is_left_and_the_day_refuses_once_spent() {
        let executor = Arc::new(Executor::new(Vec::new(), baton_engine::PoolOptions::default()));
        let options =
            ServeOptions { token: Some("t".into()), daily_max_cost_usd: Some(1.0), ..ServeOptions::default() };
        let service = Service::new(executor, false, None, options).expect("service");
        let capped = |usd: f64| {
            let mut call = request::Call::for_tests();
            call.budget = Some(baton_engine::Budget { max_cost_usd: Some(usd), ..Default::default() });
            call
        };
        // Runs capped at 0.4 each: two fit, the third holds what is free and is capped at it.
        let (mut a, mut b, mut c) = (capped(0.4), capped(0.4), capped(0.4));
        let hold_a = service.hold_for_run(&mut a).expect("fits").expect("a hold");
        let hold_b = service.hold_for_run(&mut b).expect("fits").expect("a hold");
        let hold_c = service.hold_for_run(&mut c).expect("what is free").expect("a hold");
        assert_eq!((hold_a.amount(), hold_b.amount()), (0.4, 0.4));
        assert!((hold_c.amount() - 0.2).abs() < 1e-9, "{}", hold_c.amount());
        assert_eq!(c.budget.and_then(|b| b.max_cost_usd), Some(hold_c.amount()), "the run is capped at its hold");
        let refused = service.hold_for_run(&mut capped(0.4)).unwrap_err();
        assert_eq!((refused.status.as_u16(), refused.retry), (429, false));
        assert!(refused.message.contains("held by the runs in flight"), "{}", refused.message);
        // A run ends having spent 0.1 of its 0.4: 0.3 is free again.
        service.spend(0.1);
        drop(hold_a);
        let mut d = capped(1.0);
        let hold_d = service.hold_for_run(&mut d).expect("fits").expect("a hold");
        assert!((hold_d.amount() - 0.3).abs() < 1e-9, "{}", hold_d.amount());
        drop((hold_b, hold_c, hold_d));
        service.spend(0.95);
        let refused = service.hold_for_run(&mut request::Call::for_tests()).unwrap_err();
        assert_eq!((refused.status.as_u16(), refused.code), (429, Some("daily_cap_reached")));
        assert!(refused.retry_after.is_some_and(|s| (1..=86_400).contains(&s)), "{refused:?}");
        // Without a cap nothing is held or added.
        let executor = Arc::new(Executor::new(Vec::new(), baton_engine::PoolOptions::default()));
        let free =
            Service::new(executor, false, None, ServeOptions { token: Some("t".into()), ..ServeOptions::default() })
                .expect("service");
        let mut call = request::Call::for_tests();
        assert!(free.hold_for_run(&mut call).expect("no cap").is_none());
        assert_eq!(call.budget, None);
    }
}

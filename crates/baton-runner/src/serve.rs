//! Serving the pool as an OpenAI-compatible model: the server's settings from the pool's
//! `[serve]` table under what a front end overrides, the executor built, the token read, the
//! port bound. `baton serve` and the app's Local API are this one call, then
//! [`baton_serve::serve`] on what it returns.

use std::sync::Arc;

use baton_engine::{Pool, ServeSpec};
use baton_serve::{ServeOptions, Service};
use baton_store::Store;

use crate::RunnerError;
use crate::build::{Conductor, Context};

/// What a front end sets over the pool's `[serve]` table (the command line's flags); `None`
/// keeps the table's setting, and then the server's default.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServeRequest {
    pub host: Option<String>,
    pub port: Option<u16>,
    /// The environment variable that holds the token, instead of the keychain's.
    pub token_env: Option<String>,
    /// Accept requests without a token (loopback only).
    pub no_token: bool,
    /// Web origins allowed beside the table's.
    pub allow_origins: Vec<String>,
    pub max_concurrent_runs: Option<usize>,
    pub max_queued_runs: Option<usize>,
    pub daily_max_cost_usd: Option<f64>,
}

/// The server's options from `spec` (the pool's `[serve]` table) under `request`, before the
/// token and the bound port are known.
pub fn options(spec: &ServeSpec, request: &ServeRequest) -> ServeOptions {
    let defaults = ServeOptions::default();
    ServeOptions {
        host: request.host.clone().or_else(|| spec.host.clone()).unwrap_or(defaults.host.clone()),
        port: request.port.or(spec.port).unwrap_or(defaults.port),
        allow_origins: [request.allow_origins.clone(), spec.allow_origins.clone()].concat(),
        max_concurrent_runs: request
            .max_concurrent_runs
            .or(spec.max_concurrent_runs)
            .unwrap_or(defaults.max_concurrent_runs),
        max_queued_runs: request.max_queued_runs.or(spec.max_queued_runs).unwrap_or(defaults.max_queued_runs),
        daily_max_cost_usd: request.daily_max_cost_usd.or(spec.daily_max_cost_usd),
        ..defaults
    }
}

/// Where the token clients send comes from, in words.
pub fn token_source(spec: &ServeSpec, request: &ServeRequest) -> String {
    match request.token_env.as_ref().or(spec.token_env.as_ref()) {
        Some(var) => format!("the environment variable {var}"),
        None => "the keychain (`baton serve token` prints it)".to_owned(),
    }
}

/// A server ready to serve: hand its parts to [`baton_serve::serve`].
#[derive(Debug)]
pub struct Serving {
    pub service: Arc<Service>,
    pub listener: tokio::net::TcpListener,
    /// The base URL clients use (`http://127.0.0.1:8765/v1`), with the port bound.
    pub url: String,
    /// Whether the whole pool answers as `baton`: a conductor plans, or the pool routes every
    /// question by what it learned; otherwise only the workers alone are served.
    pub answers_as_pool: bool,
    /// Whether a conductor was loaded.
    pub conductor: bool,
    /// What to tell the user of a day's cap that cannot count some workers (no price).
    pub warning: Option<String>,
}

/// Prepares the server `request` asks for over `pool`, recording runs in `store` (none: not
/// recorded). An address that needs a token and has none is refused before anything loads;
/// the conductor loads if the pool names one.
pub async fn start(
    pool: Pool,
    store: Option<&Store>,
    request: &ServeRequest,
    context: Context<'_>,
) -> Result<Serving, RunnerError> {
    let spec = pool.options.serve.clone();
    let mut options = options(&spec, request);
    baton_serve::guard::check_bind(&options.host, !request.no_token).map_err(RunnerError::BadInput)?;
    options.token = if request.no_token {
        None
    } else {
        Some(baton_serve::token(request.token_env.as_deref().or(spec.token_env.as_deref()), false)?)
    };
    let warning = options.daily_max_cost_usd.and_then(|_| crate::unpriced_warning(&pool, "the day's spending cap"));
    let built = crate::build(pool, context.setup(Conductor::IfConfigured, store)).await?;
    let (answers_as_pool, conductor) = (built.answers_as_pool(), built.conductor);
    let listener = tokio::net::TcpListener::bind((options.host.as_str(), options.port)).await.map_err(|e| {
        RunnerError::Io(format!(
            "cannot listen on {}:{}: {e}; choose another port (0 picks a free one), or stop what uses it",
            options.host, options.port
        ))
    })?;
    options.port = listener.local_addr().map_or(options.port, |a| a.port());
    let host = if options.host.contains(':') { format!("[{}]", options.host) } else { options.host.clone() };
    let url = format!("http://{host}:{}/v1", options.port);
    let service = Service::new(Arc::new(built.executor), answers_as_pool, store.cloned(), options)
        .map_err(RunnerError::BadInput)?;
    Ok(Serving { service: Arc::new(service), listener, url, answers_as_pool, conductor, warning })
}

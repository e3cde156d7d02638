//! The Local API: `baton serve` inside the app (see the `baton-serve` crate), so any OpenAI
//! client can ask the pool while the app is open. It shares what the app already has: the
//! loaded conductor and local workers, the history (its runs open in the topology view like
//! any other), the keychain and the pool file. Its settings are the pool file's `[serve]`
//! table, which `baton serve` reads too; `app = true` there is the on switch, so the app
//! serves again when it next opens.
//!
//! The server is built from the pool as it was when it started: an edit to the pool while it
//! runs shows as `stale` and applies on a restart (a restart cancels the runs in flight, so
//! it is the user's choice, not automatic).

use baton_engine::pool::edit;
use baton_engine::{Pool, ServeSpec};
use baton_runner::serve::ServeRequest;
use serde::Serialize;
use tauri::{AppHandle, Runtime, State};
use tokio_util::sync::CancellationToken;

use crate::error::{AppError, AppResult, ErrorKind};
use crate::settings::edit_error;
use crate::state::{AppState, Running};

/// The `[serve]` table as the Local API screen edits it: the engine's own edit of the pool file.
pub use baton_engine::pool::edit::ServeEdit as LocalApiForm;

/// What the Local API screen shows.
#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct LocalApiStatus {
    /// The settings as the pool file has them.
    pub form: LocalApiForm,
    pub running: bool,
    /// It is starting, stopping or restarting now (a conductor may be loading).
    pub busy: bool,
    /// The base URL clients use (`http://127.0.0.1:8765/v1`) while it runs.
    pub url: Option<String>,
    /// The model ids served (`baton`, `baton/<worker>`).
    pub models: Vec<String>,
    /// Where the token comes from: the keychain, or the environment variable `[serve]` names.
    pub token_source: String,
    pub requests: u64,
    pub failed_requests: u64,
    pub runs_in_flight: u32,
    /// Requests waiting for a run slot.
    pub runs_queued: u32,
    pub spent_today_usd: f64,
    /// The pool file changed since the server started; a restart applies it.
    pub stale: bool,
    /// Why the server is not running when it should be (the last start failed).
    pub error: Option<String>,
}

fn form_of(spec: &ServeSpec) -> LocalApiForm {
    // What the server would be started with: the table's settings, else the server's defaults.
    let options = baton_runner::serve::options(spec, &ServeRequest::default());
    LocalApiForm {
        enabled: spec.app,
        host: options.host,
        port: options.port,
        max_concurrent_runs: options.max_concurrent_runs as u32,
        daily_max_cost_usd: options.daily_max_cost_usd,
        allow_origins: spec.allow_origins.clone(),
    }
}

fn token_source(spec: &ServeSpec) -> String {
    match &spec.token_env {
        Some(var) => format!("the environment variable {var} (the pool file's [serve] token_env)"),
        None => "the keychain (`baton serve token` prints the same one)".to_owned(),
    }
}

/// The token clients must send: `[serve] token_env`'s variable, else the keychain's, made the
/// first time (or anew when `new`). The CLI's `baton serve token` keeps the same entry.
fn token(spec: &ServeSpec, new: bool) -> AppResult<String> {
    baton_serve::token(spec.token_env.as_deref(), new).map_err(|e| baton_runner::RunnerError::Token(e).into())
}

fn read_pool(state: &AppState) -> AppResult<(String, Pool)> {
    let path = &state.paths.pool;
    let text = std::fs::read_to_string(path)
        .map_err(|e| AppError::new(ErrorKind::Pool, format!("{}: cannot read the pool file: {e}", path.display())))?;
    let pool = Pool::parse(&text, &path.display().to_string())?;
    Ok((text, pool))
}

/// Starts the server over the pool as it is now (the caller holds the lock and has stopped
/// any server before).
async fn start<R: Runtime>(app: &AppHandle<R>, state: &AppState) -> AppResult<Running> {
    let (pool_text, pool) = read_pool(state)?;
    let store = state.store().await?;
    let loader = crate::chat::Loader::new(app);
    let serving =
        baton_runner::serve::start(pool, Some(store), &ServeRequest::default(), loader.context(state)).await?;
    let shutdown = CancellationToken::new();
    let service = serving.service;
    let task = tokio::spawn(baton_serve::serve(serving.listener, service.clone(), shutdown.clone()));
    tracing::info!("the Local API serves on {}", serving.url);
    if let Some(warning) = &serving.warning {
        tracing::warn!("{warning}");
    }
    Ok(Running { service, shutdown, task, url: serving.url, pool_text })
}

/// Stops the server: runs in flight are cancelled (and recorded so), then the port is free.
async fn stop(running: Running) {
    running.shutdown.cancel();
    let _ = running.task.await;
    tracing::info!("the Local API stopped");
}

/// Brings the server in line with the pool file: started when `[serve] app` is on and it is
/// not running (or `restart`), stopped when it is off.
async fn apply<R: Runtime>(app: &AppHandle<R>, state: &AppState, restart: bool) -> AppResult<()> {
    let wanted = read_pool(state).map(|(_, pool)| pool.options.serve.app);
    let mut slot = state.local_api.running.lock().await;
    let (running, error) = &mut *slot;
    let on = matches!(wanted, Ok(true));
    if running.is_some() && (!on || restart) {
        stop(running.take().expect("checked")).await;
    }
    *error = None;
    if on && running.is_none() {
        match start(app, state).await {
            Ok(r) => *running = Some(r),
            Err(e) => {
                *error = Some(e.message.clone());
                return Err(e);
            }
        }
    }
    wanted.map(|_| ())
}

/// Starts the Local API when the app opens, if the pool file has it on. A failure is kept for
/// the Local API screen (and logged); the app opens regardless.
pub async fn start_at_launch<R: Runtime>(app: AppHandle<R>) {
    let state = tauri::Manager::state::<AppState>(&app);
    let on = read_pool(&state).is_ok_and(|(_, pool)| pool.options.serve.app);
    if on && let Err(e) = apply(&app, &state, false).await {
        tracing::warn!("the Local API did not start: {}", e.message);
    }
}

#[tauri::command]
pub async fn local_api_status(state: State<'_, AppState>) -> AppResult<LocalApiStatus> {
    status(&state).await
}

async fn status(state: &AppState) -> AppResult<LocalApiStatus> {
    let pool = read_pool(state);
    let spec = pool.as_ref().map(|(_, p)| p.options.serve.clone()).unwrap_or_default();
    let now_text = pool.as_ref().ok().map(|(t, _)| t.as_str());
    // A start may take minutes (the conductor loads): the screen polls, so it is told, not held.
    let slot = state.local_api.running.try_lock();
    let (running, error) = match &slot {
        Ok(slot) => (slot.0.as_ref(), slot.1.clone()),
        Err(_) => (None, None),
    };
    let stats = running.map(|r| r.service.stats());
    Ok(LocalApiStatus {
        form: form_of(&spec),
        running: running.is_some(),
        busy: slot.is_err(),
        url: running.map(|r| r.url.clone()),
        models: running.map(|r| r.service.model_ids()).unwrap_or_default(),
        token_source: token_source(&spec),
        requests: stats.map_or(0, |s| s.requests),
        failed_requests: stats.map_or(0, |s| s.failed),
        runs_in_flight: stats.map_or(0, |s| s.runs_in_flight as u32),
        runs_queued: stats.map_or(0, |s| s.runs_queued as u32),
        spent_today_usd: stats.map_or(0.0, |s| s.spent_today_usd),
        stale: running.is_some_and(|r| now_text != Some(r.pool_text.as_str())),
        error: error.or_else(|| pool.as_ref().err().map(|e| e.message.clone())),
    })
}

/// Saves the Local API's settings to the pool file's `[serve]` table (keeping what the form
/// does not show), then starts, stops or restarts the server to match.
#[tauri::command]
pub async fn save_local_api<R: Runtime>(
    app: AppHandle<R>,
    state: State<'_, AppState>,
    form: LocalApiForm,
) -> AppResult<LocalApiStatus> {
    let path = &state.paths.pool;
    let text = std::fs::read_to_string(path).map_err(|e| {
        AppError::new(
            ErrorKind::Pool,
            format!("{}: cannot read the pool file: {e}; add a worker first (Workers & keys)", path.display()),
        )
    })?;
    let file = path.display().to_string();
    let new = apply_form(&text, &form, &file)?;
    let after = Pool::parse(&new, &file).map_err(|e| AppError::bad_input(e.to_string()))?.options.serve;
    let before = Pool::parse(&text, &file).map(|p| p.options.serve).ok();
    edit::write_atomically(path, &new).map_err(edit_error)?;
    // A restart only when what the server was built from changed (not for switching it on).
    let restart = before.is_some_and(|b| ServeSpec { app: after.app, ..b } != after);
    apply(&app, &state, restart).await?;
    status(&state).await
}

/// Restarts the server over the pool file as it is now (cancelling the runs in flight).
#[tauri::command]
pub async fn restart_local_api<R: Runtime>(app: AppHandle<R>, state: State<'_, AppState>) -> AppResult<LocalApiStatus> {
    apply(&app, &state, true).await?;
    status(&state).await
}

/// The token clients send (`Authorization: Bearer TOKEN`), for the user to copy; `new`
/// replaces it (clients with the old one are refused once the server restarts, which this does).
/// It is the server's own token, not a provider key: it opens this server, and nothing else.
#[tauri::command]
pub async fn local_api_token<R: Runtime>(
    app: AppHandle<R>,
    state: State<'_, AppState>,
    new: bool,
) -> AppResult<String> {
    let (_, pool) = read_pool(&state)?;
    let token = token(&pool.options.serve, new)?;
    if new && state.local_api.running.lock().await.0.is_some() {
        apply(&app, &state, true).await?;
    }
    Ok(token)
}

/// Writes `form` into the `[serve]` table of pool TOML `text` and checks the result; `file`
/// names the file in errors.
pub fn apply_form(text: &str, form: &LocalApiForm, file: &str) -> AppResult<String> {
    edit::apply_serve(text, form, file).map_err(edit_error)
}

#[cfg(test)]
mod tests {
    use super::*;

    const POOL: &str = "# mine\n[serve]\nport = 9000 # fixed for my editor\ntoken_env = \"T\"\n\n[[worker]]\nname = \"a\"\nprovider = \"openai\"\nmodel = \"m\"\n";

    fn form() -> LocalApiForm {
        form_of(&Pool::parse(POOL, "pool.toml").unwrap().options.serve)
    }

    // Saving is tested with the engine (`baton_engine::pool::edit`); here, what the form shows.
    #[test]
    fn the_form_shows_what_the_file_says() {
        let f = form();
        assert_eq!((f.port, f.enabled, f.host.as_str(), f.daily_max_cost_usd), (9000, false, "127.0.0.1", None));
        assert!(f.allow_origins.is_empty());
    }
}

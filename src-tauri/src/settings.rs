//! The settings screens edit the pool file itself, so the app and the `baton` command line
//! always agree. The engine does the editing ([`baton_engine::pool::edit`]): comments, unknown
//! tables and the keys a form does not show (retry, timeouts, …) survive a save, and nothing is
//! written unless the result parses as a pool, except a pool with no workers yet (a new user
//! sets the conductor first). Here are the forms as the UI sees them.

use baton_conductor::setup::KeepForPool;
use baton_engine::Pool;
use baton_engine::pool::edit::{self, EditError};
use serde::Serialize;
use tauri::State;

use crate::error::{AppError, AppResult, ErrorKind};
use crate::state::AppState;

// The forms are the engine's own edits of the pool file, so what the UI sends is what is written.
pub use baton_engine::pool::edit::{
    ConductorEdit as ConductorForm, SettingsEdit as PoolForm, WorkerEdit as WorkerForm,
};

/// What the settings screens show.
#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct Settings {
    pub pool_path: String,
    pub history_path: String,
    pub pool_exists: bool,
    /// `null` when the file is not valid TOML (see `pool_error`).
    pub form: Option<PoolForm>,
    /// What is wrong with the pool as it stands, if anything; runs are refused until it is fixed.
    pub pool_error: Option<String>,
    /// The workers the conductor sees, in order (empty while the pool has errors).
    pub workers: Vec<baton_engine::WorkerInfo>,
    /// Whether a conductor (local model or server) is set.
    pub conductor_configured: bool,
    /// False when the pool routes every question by what it learned (`route = "always"`), so
    /// it runs without a conductor.
    pub conductor_needed: bool,
    /// Whether this build runs local models (mistral.rs).
    pub local_models: bool,
    /// Workers with no known price (neither the pool nor the price data has one): a cost cap
    /// cannot count them, and their runs' costs are lower bounds.
    pub unpriced: Vec<String>,
}

#[tauri::command]
pub async fn get_settings(state: State<'_, AppState>) -> AppResult<Settings> {
    Ok(settings(&state.paths))
}

pub fn settings(paths: &crate::state::Paths) -> Settings {
    let path = &paths.pool;
    let (exists, text) = match std::fs::read_to_string(path) {
        Ok(text) => (true, Ok(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => (false, Ok(String::new())),
        Err(e) => (true, Err(format!("{}: cannot read the pool file: {e}", path.display()))),
    };
    let form = text.clone().and_then(|t| read_form(&t).map_err(|e| format!("{}: {e}", path.display())));
    let pool = text.and_then(|t| Pool::parse(&t, &path.display().to_string()).map_err(|e| e.to_string()));
    let conductor_needed = pool.as_ref().map_or(true, |p| p.options.fallback.route != baton_engine::Route::Always);
    let conductor_configured = form.as_ref().is_ok_and(|f| f.conductor.model.is_some() || f.conductor.url.is_some());
    Settings {
        pool_path: path.display().to_string(),
        history_path: paths.db.display().to_string(),
        pool_exists: exists,
        workers: pool.as_ref().map(Pool::infos).unwrap_or_default(),
        pool_error: match (&form, &pool) {
            (Err(e), _) => Some(e.clone()),
            // No pool file, or one with a conductor and no worker yet, is how every user
            // starts: the screens ask for a worker, nothing is wrong.
            (Ok(f), Err(_)) if f.workers.is_empty() => None,
            (_, Err(e)) => Some(e.clone()),
            _ => None,
        },
        unpriced: pool
            .as_ref()
            .map(|p| p.workers.iter().filter(|w| !w.pricing().is_known()).map(|w| w.name.clone()).collect())
            .unwrap_or_default(),
        form: form.ok(),
        conductor_configured,
        conductor_needed,
        local_models: cfg!(feature = "local"),
    }
}

/// Writes the form into the pool file (keeping what the form does not show) and returns the new settings.
#[tauri::command]
pub async fn save_settings(state: State<'_, AppState>, form: PoolForm) -> AppResult<Settings> {
    let path = &state.paths.pool;
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => {
            return Err(AppError::new(ErrorKind::Io, format!("{}: cannot read the pool file: {e}", path.display())));
        }
    };
    let new = apply_form(&text, &form, &path.display().to_string())?;
    edit::write_atomically(path, &new).map_err(edit_error)?;
    // A conductor or local worker whose settings changed is loaded afresh on the next run; the
    // others stay loaded. This never waits for a model being loaded.
    if let Ok(pool) = Pool::parse(&new, &path.display().to_string()) {
        state.models.keep_only(&pool);
    }
    Ok(settings(&state.paths))
}

/// Reads the form from pool TOML; a missing file is an empty form.
pub fn read_form(text: &str) -> Result<PoolForm, String> {
    edit::read_settings(text).map_err(|e| e.to_string())
}

/// Applies `form` to the pool TOML `text` and checks the result; returns the new text.
pub fn apply_form(text: &str, form: &PoolForm, file: &str) -> AppResult<String> {
    edit::apply_settings(text, form, file).map_err(edit_error)
}

/// What a pool-file edit's error is to the UI (the Local API screen's too): what the form asks
/// is refused as bad input, a file that is not TOML is the pool's problem, a failed write is I/O.
pub(crate) fn edit_error(e: EditError) -> AppError {
    let kind = match &e {
        EditError::NotToml { .. } => ErrorKind::Pool,
        EditError::Refused(_) | EditError::Invalid(_) => ErrorKind::BadInput,
        EditError::Write { .. } => ErrorKind::Io,
    };
    AppError::new(kind, e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    // The editing itself is tested with the engine (`baton_engine::pool::edit`); here, what
    // its refusals are to the UI.
    #[test]
    fn a_refused_form_is_bad_input_and_a_file_that_is_not_toml_is_the_pools_problem() {
        let mut form = read_form("[[worker]]\nname = \"w\"\nprovider = \"openai\"\nmodel = \"m\"\n").unwrap();
        form.workers[0].provider = baton_providers::ProviderKind::OpenAiCompatible; // needs a base_url
        let err = apply_form("", &form, "pool.toml").unwrap_err();
        assert_eq!(err.kind, ErrorKind::BadInput);
        assert!(err.message.contains("base_url"), "{}", err.message);
        let err = apply_form("[[worker]\nname=", &read_form("").unwrap(), "pool.toml").unwrap_err();
        assert_eq!(err.kind, ErrorKind::Pool);
        assert!(err.message.contains("will not rewrite"), "{}", err.message);
    }
}

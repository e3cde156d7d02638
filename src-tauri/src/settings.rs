//! The settings screens edit the pool file itself, so the app and the `baton` command line
//! always agree. The engine does the editing ([`baton_engine::pool::edit`]): comments, unknown
//! tables and the keys a form does not show (retry, timeouts, …) survive a save, and nothing is
//! written unless the result parses as a pool, except a pool with no workers yet (a new user
//! sets the conductor first). Here are the forms as the UI sees them.

use baton_engine::Pool;
use baton_engine::pool::edit::{self, ConductorEdit, EditError, SettingsEdit, WorkerEdit};
use baton_providers::ProviderKind;
use serde::{Deserialize, Serialize};
use tauri::State;

use crate::error::{AppError, AppResult, ErrorKind};
use crate::state::AppState;

/// One `[[worker]]` table as the form shows it. `None` fields are absent from the file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ts_rs::TS)]
pub struct WorkerForm {
    /// Index of the table this form was read from, so a save keeps its other keys and comments;
    /// `null` for a new worker.
    pub original: Option<u32>,
    pub name: String,
    pub provider: ProviderKind,
    pub model: String,
    pub base_url: Option<String>,
    pub api_key_env: Option<String>,
    pub max_tokens: Option<u32>,
    pub temperature: Option<f64>,
    pub reasoning_effort: Option<String>,
    pub thinking_budget: Option<u32>,
    /// $ per million input tokens.
    pub price_in: Option<f64>,
    pub price_out: Option<f64>,
    /// $ per million input tokens read from a prompt cache (default: `price_in`).
    pub price_cached_in: Option<f64>,
    pub description: Option<String>,
}

/// The `[conductor]`, `[recursion]` and `[budget]` tables and `max_steps`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ts_rs::TS)]
pub struct ConductorForm {
    /// A local `.gguf` file or safetensors directory; with `url`, the model name the server serves.
    pub model: Option<String>,
    /// An OpenAI-compatible server that runs the conductor.
    pub url: Option<String>,
    /// With `url`: the server's plan-grammar field (`vllm`, `sglang`, `llama.cpp`), or `None`
    /// to parse its answers.
    #[serde(default)]
    pub grammar: Option<String>,
    /// `auto` (GPU when there is one) or `cpu`.
    pub device: String,
    pub max_steps: u32,
    pub recursion: bool,
    pub max_depth: u32,
    /// When the conductor's plans cannot be used (they fail, copy an example, or keep the
    /// question from the workers), answer with one worker alone (`[conductor] fallback`).
    #[serde(default = "yes")]
    pub fallback: bool,
    pub max_calls: Option<u32>,
    pub max_tokens: Option<u32>,
    pub max_cost_usd: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ts_rs::TS)]
pub struct PoolForm {
    pub workers: Vec<WorkerForm>,
    pub conductor: ConductorForm,
}

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
    edit::read_settings(text).map(PoolForm::from).map_err(|e| e.to_string())
}

fn yes() -> bool {
    true
}

/// Applies `form` to the pool TOML `text` and checks the result; returns the new text.
pub fn apply_form(text: &str, form: &PoolForm, file: &str) -> AppResult<String> {
    edit::apply_settings(text, &SettingsEdit::from(form), file).map_err(edit_error)
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

impl From<SettingsEdit> for PoolForm {
    fn from(s: SettingsEdit) -> Self {
        let c = s.conductor;
        PoolForm {
            workers: s.workers.into_iter().map(WorkerForm::from).collect(),
            conductor: ConductorForm {
                model: c.model,
                url: c.url,
                grammar: c.grammar,
                device: c.device,
                max_steps: c.max_steps,
                recursion: c.recursion,
                max_depth: c.max_depth,
                fallback: c.fallback,
                max_calls: c.max_calls,
                max_tokens: c.max_tokens,
                max_cost_usd: c.max_cost_usd,
            },
        }
    }
}

impl From<WorkerEdit> for WorkerForm {
    fn from(w: WorkerEdit) -> Self {
        WorkerForm {
            original: w.original.map(|i| i as u32),
            name: w.name,
            provider: w.provider,
            model: w.model,
            base_url: w.base_url,
            api_key_env: w.api_key_env,
            max_tokens: w.max_tokens,
            temperature: w.temperature,
            reasoning_effort: w.reasoning_effort,
            thinking_budget: w.thinking_budget,
            price_in: w.price_in,
            price_out: w.price_out,
            price_cached_in: w.price_cached_in,
            description: w.description,
        }
    }
}

impl From<&PoolForm> for SettingsEdit {
    fn from(form: &PoolForm) -> Self {
        let c = form.conductor.clone();
        SettingsEdit {
            workers: form.workers.iter().cloned().map(WorkerEdit::from).collect(),
            conductor: ConductorEdit {
                model: c.model,
                url: c.url,
                grammar: c.grammar,
                device: c.device,
                max_steps: c.max_steps,
                recursion: c.recursion,
                max_depth: c.max_depth,
                fallback: c.fallback,
                max_calls: c.max_calls,
                max_tokens: c.max_tokens,
                max_cost_usd: c.max_cost_usd,
            },
        }
    }
}

impl From<WorkerForm> for WorkerEdit {
    fn from(w: WorkerForm) -> Self {
        WorkerEdit {
            original: w.original.map(|i| i as usize),
            name: w.name,
            provider: w.provider,
            model: w.model,
            base_url: w.base_url,
            api_key_env: w.api_key_env,
            max_tokens: w.max_tokens,
            temperature: w.temperature,
            reasoning_effort: w.reasoning_effort,
            thinking_budget: w.thinking_budget,
            price_in: w.price_in,
            price_out: w.price_out,
            price_cached_in: w.price_cached_in,
            description: w.description,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"# my pool
max_steps = 4

[retry]
max_retries = 1

[[worker]]
name = "gpt"   # the strong one
provider = "openai"
model = "gpt-5"
timeout_secs = 90
"#;

    #[test]
    fn an_invalid_worker_is_refused_with_the_pool_error() {
        let mut form = read_form(FILE).unwrap();
        form.workers[0].provider = ProviderKind::OpenAiCompatible; // needs a base_url
        let err = apply_form(FILE, &form, "pool.toml").unwrap_err();
        assert_eq!(err.kind, ErrorKind::BadInput);
        assert!(err.message.contains("base_url"), "{}", err.message);
    }

    #[test]
    fn broken_toml_is_never_rewritten() {
        let err = apply_form("[[worker]\nname=", &read_form("").unwrap(), "pool.toml").unwrap_err();
        assert_eq!(err.kind, ErrorKind::Pool);
        assert!(err.message.contains("will not rewrite"), "{}", err.message);
    }
}

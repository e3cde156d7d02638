//! The settings screens edit the pool file itself, so the app and the `baton` command line
//! always agree. Edits go through `toml_edit`: comments, unknown tables and the keys a form does
//! not show (retry, timeouts, …) survive a save. Nothing is written unless the result parses as
//! a pool, except a pool with no workers yet (a new user sets the conductor first).

use std::path::Path;

use baton_engine::Pool;
use baton_providers::ProviderKind;
use serde::{Deserialize, Serialize};
use tauri::State;
use toml_edit::{ArrayOfTables, DocumentMut, Item, Table};

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
    write_atomically(path, &new)?;
    // A conductor or local worker whose settings changed is loaded afresh on the next run; the
    // others stay loaded. This never waits for a model being loaded.
    if let Ok(pool) = Pool::parse(&new, &path.display().to_string()) {
        state.models.keep_only(&pool);
    }
    Ok(settings(&state.paths))
}

/// Reads the form from pool TOML; a missing file is an empty form.
pub fn read_form(text: &str) -> Result<PoolForm, String> {
    let doc: DocumentMut = text.parse().map_err(|e: toml_edit::TomlError| e.to_string())?;
    let workers = match doc.get("worker").and_then(Item::as_array_of_tables) {
        Some(tables) => tables.iter().enumerate().map(|(i, t)| worker_form(i, t)).collect::<Result<_, _>>()?,
        None => Vec::new(),
    };
    let conductor = doc.get("conductor").and_then(Item::as_table_like);
    let recursion = doc.get("recursion").and_then(Item::as_table_like);
    let budget = doc.get("budget").and_then(Item::as_table_like);
    let string = |t: Option<&dyn toml_edit::TableLike>, k: &str| t.and_then(|t| t.get(k)?.as_str().map(str::to_owned));
    let int = |t: Option<&dyn toml_edit::TableLike>, k: &str| t.and_then(|t| t.get(k)?.as_integer());
    let form = ConductorForm {
        model: string(conductor, "model"),
        url: string(conductor, "url"),
        grammar: string(conductor, "grammar").filter(|g| g != "none"),
        device: string(conductor, "device").unwrap_or_else(|| "auto".to_owned()),
        max_steps: doc.get("max_steps").and_then(Item::as_integer).unwrap_or(baton_plan::DEFAULT_MAX_STEPS as i64)
            as u32,
        recursion: recursion.and_then(|t| t.get("enabled")?.as_bool()).unwrap_or(false),
        max_depth: int(recursion, "max_depth").unwrap_or(2) as u32,
        fallback: conductor.and_then(|t| t.get("fallback")?.as_bool()).unwrap_or(true),
        max_calls: int(budget, "max_calls").map(|n| n as u32),
        max_tokens: int(budget, "max_tokens").map(|n| n as u32),
        max_cost_usd: budget.and_then(|t| float(t.get("max_cost_usd")?)),
    };
    Ok(PoolForm { workers, conductor: form })
}

fn yes() -> bool {
    true
}

fn float(item: &Item) -> Option<f64> {
    item.as_float().or_else(|| item.as_integer().map(|n| n as f64))
}

/// One worker's form; an error when its provider is one the form cannot show (saving the form
/// would replace what the file says).
fn worker_form(index: usize, t: &Table) -> Result<WorkerForm, String> {
    let string = |k: &str| t.get(k).and_then(Item::as_str).map(str::to_owned);
    let int = |k: &str| t.get(k).and_then(Item::as_integer).map(|n| n as u32);
    let name = string("name").unwrap_or_default();
    let provider = string("provider").unwrap_or_default();
    let provider: ProviderKind = serde_json::from_value(serde_json::Value::String(provider.clone())).map_err(|_| {
        format!(
            "worker {index} (\"{name}\"): provider \"{provider}\" is not one of openai, anthropic, gemini, openai-compatible, local; fix it in the pool file"
        )
    })?;
    Ok(WorkerForm {
        original: Some(index as u32),
        name,
        provider,
        model: string("model").unwrap_or_default(),
        base_url: string("base_url"),
        api_key_env: string("api_key_env"),
        max_tokens: int("max_tokens"),
        temperature: t.get("temperature").and_then(float),
        reasoning_effort: string("reasoning_effort"),
        thinking_budget: int("thinking_budget"),
        price_in: t.get("price_in").and_then(float),
        price_out: t.get("price_out").and_then(float),
        price_cached_in: t.get("price_cached_in").and_then(float),
        description: string("description"),
    })
}

/// Applies `form` to the pool TOML `text` and checks the result; returns the new text.
pub fn apply_form(text: &str, form: &PoolForm, file: &str) -> AppResult<String> {
    let mut doc: DocumentMut = text.parse().map_err(|e: toml_edit::TomlError| {
        AppError::new(
            ErrorKind::Pool,
            format!(
                "{file}: is not valid TOML, so the app will not rewrite it ({}); fix or move it aside",
                e.message()
            ),
        )
    })?;
    let old: Vec<Table> =
        doc.get("worker").and_then(Item::as_array_of_tables).map(|a| a.iter().cloned().collect()).unwrap_or_default();
    let mut workers = ArrayOfTables::new();
    for w in &form.workers {
        let mut t = w.original.and_then(|i| old.get(i as usize).cloned()).unwrap_or_default();
        keeps_env_key_where_it_was(&t, w, file)?;
        set_str(&mut t, "name", Some(w.name.trim()));
        set_str(&mut t, "provider", Some(w.provider.as_str()));
        set_str(&mut t, "model", Some(w.model.trim()));
        set_str(&mut t, "base_url", w.base_url.as_deref());
        set_int(&mut t, "max_tokens", w.max_tokens.map(i64::from));
        set_float(&mut t, "temperature", w.temperature);
        set_str(&mut t, "reasoning_effort", w.reasoning_effort.as_deref());
        set_int(&mut t, "thinking_budget", w.thinking_budget.map(i64::from));
        set_float(&mut t, "price_in", w.price_in);
        set_float(&mut t, "price_out", w.price_out);
        set_float(&mut t, "price_cached_in", w.price_cached_in);
        set_str(&mut t, "description", w.description.as_deref());
        workers.push(t);
    }
    if workers.is_empty() {
        doc.remove("worker");
    } else {
        doc.insert("worker", Item::ArrayOfTables(workers));
    }

    let c = &form.conductor;
    put(doc.as_table_mut(), "max_steps", i64::from(c.max_steps));
    let conductor = table(&mut doc, "conductor");
    set_str(conductor, "model", c.model.as_deref());
    set_str(conductor, "url", c.url.as_deref());
    // A grammar applies to a server only (the pool refuses one beside a local model).
    set_str(conductor, "grammar", c.grammar.as_deref().filter(|_| c.url.is_some()));
    set_str(conductor, "device", (c.device != "auto").then_some(c.device.as_str()));
    // On is the default: only "off" is written.
    match c.fallback {
        true => {
            conductor.remove("fallback");
        }
        false => put(conductor, "fallback", false),
    }
    let recursion = table(&mut doc, "recursion");
    put(recursion, "enabled", c.recursion);
    put(recursion, "max_depth", i64::from(c.max_depth));
    let budget = table(&mut doc, "budget");
    set_int(budget, "max_calls", c.max_calls.map(i64::from));
    set_int(budget, "max_tokens", c.max_tokens.map(i64::from));
    set_float(budget, "max_cost_usd", c.max_cost_usd);
    for name in ["conductor", "budget"] {
        if doc.get(name).and_then(Item::as_table).is_some_and(Table::is_empty) {
            doc.remove(name);
        }
    }
    let text = doc.to_string();
    if let Err(e) = Pool::parse(&text, file)
        && !form.workers.is_empty()
    {
        return Err(AppError::bad_input(e.to_string()));
    }
    Ok(text)
}

/// Refuses a form that would change where an environment variable's value goes.
///
/// `api_key_env` names a variable whose value Baton sends to the worker's server, whatever the
/// variable holds. The window is untrusted: if it could set that name, or move a worker that has
/// one to another server, a script there could send `AWS_SECRET_ACCESS_KEY` (say) to a host of
/// its choosing. So the user sets it, and the server it goes to, in the pool file itself.
fn keeps_env_key_where_it_was(old: &Table, w: &WorkerForm, file: &str) -> AppResult<()> {
    let text = |k: &str| old.get(k).and_then(Item::as_str).map(str::trim).filter(|s| !s.is_empty());
    let env = text("api_key_env");
    let asked = w.api_key_env.as_deref().map(str::trim).filter(|s| !s.is_empty());
    let name = w.name.trim();
    if asked != env {
        return Err(AppError::bad_input(format!(
            "worker \"{name}\": api_key_env can only be set in the pool file itself ({file}): it names an environment variable whose value is sent to the worker's server"
        )));
    }
    let moved = text("provider") != Some(w.provider.as_str())
        || text("base_url").map(|u| u.trim_end_matches('/'))
            != w.base_url.as_deref().map(|u| u.trim().trim_end_matches('/')).filter(|u| !u.is_empty());
    if let Some(var) = env
        && moved
    {
        return Err(AppError::bad_input(format!(
            "worker \"{name}\" takes its key from the environment variable {var}: change its provider or base_url in the pool file itself ({file}), so that the key goes only where you send it"
        )));
    }
    Ok(())
}

fn table<'a>(doc: &'a mut DocumentMut, name: &str) -> &'a mut Table {
    if !doc.get(name).is_some_and(Item::is_table) {
        doc.insert(name, Item::Table(Table::new()));
    }
    doc[name].as_table_mut().expect("inserted above")
}

/// Sets `key` to `new`, keeping the comments around the old value and its key.
fn put(t: &mut Table, key: &str, new: impl Into<toml_edit::Value>) {
    let new = new.into();
    match t.get_mut(key).and_then(Item::as_value_mut) {
        Some(old) => {
            let decor = old.decor().clone();
            *old = new;
            *old.decor_mut() = decor;
        }
        None => {
            t.insert(key, Item::Value(new));
        }
    }
}

fn set<V: Into<toml_edit::Value>>(t: &mut Table, key: &str, v: Option<V>) {
    match v {
        Some(v) => put(t, key, v),
        None => {
            t.remove(key);
        }
    }
}

fn set_str(t: &mut Table, key: &str, v: Option<&str>) {
    set(t, key, v.map(str::trim).filter(|s| !s.is_empty()));
}

fn set_int(t: &mut Table, key: &str, v: Option<i64>) {
    set(t, key, v);
}

fn set_float(t: &mut Table, key: &str, v: Option<f64>) {
    set(t, key, v);
}

/// Writes the file whole or not at all: a crash mid-save leaves the old pool.
pub fn write_atomically(path: &Path, text: &str) -> AppResult<()> {
    let io = |e: std::io::Error| {
        AppError::new(ErrorKind::Io, format!("{}: cannot write the pool file: {e}", path.display()))
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let tmp = path.with_extension("toml.saving");
    std::fs::write(&tmp, text).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
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
    fn a_save_keeps_comments_and_keys_the_form_does_not_show() {
        let mut form = read_form(FILE).unwrap();
        assert_eq!(form.conductor.max_steps, 4);
        assert_eq!(form.workers[0].name, "gpt");
        form.workers[0].description = Some("math".into());
        form.workers.push(WorkerForm {
            original: None,
            name: "local".into(),
            provider: ProviderKind::OpenAiCompatible,
            model: "llama".into(),
            base_url: Some("http://127.0.0.1:11434/v1".into()),
            api_key_env: None,
            max_tokens: None,
            temperature: None,
            reasoning_effort: None,
            thinking_budget: None,
            price_in: Some(0.0),
            price_out: Some(0.0),
            price_cached_in: None,
            description: None,
        });
        form.conductor.model = Some("/models/qwen.gguf".into());
        let text = apply_form(FILE, &form, "pool.toml").unwrap();
        for kept in ["# my pool", "# the strong one", "timeout_secs = 90", "[retry]", "max_retries = 1"] {
            assert!(text.contains(kept), "{kept} lost:\n{text}");
        }
        let pool = Pool::parse(&text, "pool.toml").unwrap();
        assert_eq!(pool.workers.len(), 2);
        assert_eq!(pool.workers[0].description.as_deref(), Some("math"));
        assert_eq!(pool.options.conductor.model.as_deref(), Some("/models/qwen.gguf"));
        assert_eq!(read_form(&text).unwrap().conductor, form.conductor);
    }

    #[test]
    fn an_invalid_worker_is_refused_with_the_pool_error() {
        let mut form = read_form(FILE).unwrap();
        form.workers[0].provider = ProviderKind::OpenAiCompatible; // needs a base_url
        let err = apply_form(FILE, &form, "pool.toml").unwrap_err();
        assert_eq!(err.kind, ErrorKind::BadInput);
        assert!(err.message.contains("base_url"), "{}", err.message);
    }

    #[test]
    fn a_provider_the_form_cannot_show_is_named_not_replaced() {
        let text = FILE.replace("provider = \"openai\"", "provider = \"openia\"");
        let err = read_form(&text).unwrap_err();
        assert!(err.contains("worker 0 (\"gpt\"): provider \"openia\""), "{err}");
    }

    #[test]
    fn broken_toml_is_never_rewritten() {
        let err = apply_form("[[worker]\nname=", &read_form("").unwrap(), "pool.toml").unwrap_err();
        assert_eq!(err.kind, ErrorKind::Pool);
        assert!(err.message.contains("will not rewrite"), "{}", err.message);
    }
}

//! Rewriting a pool file for the app's settings screens, which edit the file itself so the app
//! and the `baton` command line always agree. Edits go through `toml_edit`: comments, unknown
//! tables and the keys a form does not show (retry, timeouts, …) survive a save. Nothing is
//! written unless the result parses as a pool, except a pool with no workers yet (a new user
//! sets the conductor first).

use std::path::{Path, PathBuf};

use baton_plan::DEFAULT_MAX_STEPS;
use baton_providers::ProviderKind;
use serde::{Deserialize, Serialize};
use toml_edit::{Array, ArrayOfTables, DocumentMut, Item, Table, TableLike};

use super::{Device, Pool, PoolError};

/// One `[[worker]]` table as the Settings form edits it. `None` fields are absent from the file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ts_rs::TS)]
#[ts(rename = "WorkerForm")]
pub struct WorkerEdit {
    /// Index of the table this worker was read from, so a save keeps its other keys and
    /// comments; `None` for a new worker.
    pub original: Option<usize>,
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

/// The `[conductor]`, `[recursion]` and `[budget]` tables and `max_steps`, as the Settings form
/// edits them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ts_rs::TS)]
#[ts(rename = "ConductorForm")]
pub struct ConductorEdit {
    /// A local `.gguf` file or safetensors directory; with `url`, the model name the server serves.
    pub model: Option<String>,
    /// An OpenAI-compatible server that runs the conductor.
    pub url: Option<String>,
    /// With `url`: the server's plan-grammar field (`vllm`, `sglang`, `llama.cpp`), or `None`
    /// to parse its answers.
    #[serde(default)]
    pub grammar: Option<String>,
    /// `auto` (GPU when there is one) or `cpu` ([`Device`]), as the file says it: a name the
    /// pool refuses is shown and refused on save, not replaced unseen.
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

/// What the Settings form edits: the workers, in order, and the conductor's options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ts_rs::TS)]
#[ts(rename = "PoolForm")]
pub struct SettingsEdit {
    pub workers: Vec<WorkerEdit>,
    pub conductor: ConductorEdit,
}

/// The `[serve]` table as the Local API form edits it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ts_rs::TS)]
#[ts(rename = "LocalApiForm")]
pub struct ServeEdit {
    /// Serve while the app is open (`app`).
    pub enabled: bool,
    /// Must be what the file says (`127.0.0.1` when it says nothing): only the pool file can
    /// change it, since anything but loopback opens the server to the network.
    pub host: String,
    /// 0 picks a free port each time.
    pub port: u16,
    pub max_concurrent_runs: u32,
    pub daily_max_cost_usd: Option<f64>,
    /// Web clients (origins such as `http://localhost:3000`) allowed to call from a browser.
    pub allow_origins: Vec<String>,
}

/// Why a pool file cannot be shown in the Settings form.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error(transparent)]
    NotToml(#[from] toml_edit::TomlError),
    /// A worker's provider is one the form cannot show: saving the form would replace what the
    /// file says.
    #[error(
        "worker {index} (\"{name}\"): provider \"{provider}\" is not one of openai, anthropic, gemini, openai-compatible, local; fix it in the pool file"
    )]
    UnknownProvider { index: usize, name: String, provider: String },
}

/// Why an edit was not made.
#[derive(Debug, thiserror::Error)]
pub enum EditError {
    /// What the app cannot read, it does not rewrite.
    #[error("{file}: is not valid TOML, so the app will not rewrite it ({}); fix or move it aside", .source.message())]
    NotToml { file: String, source: toml_edit::TomlError },
    /// The form asks for what only the pool file itself may say, or for a value that is not one.
    #[error("{0}")]
    Refused(String),
    /// The edited file is not a valid pool.
    #[error(transparent)]
    Invalid(#[from] PoolError),
    #[error("{}: cannot write the pool file: {source}", .path.display())]
    Write { path: PathBuf, source: std::io::Error },
}

fn yes() -> bool {
    true
}

/// Reads the Settings form from pool TOML; empty text (no file yet) is an empty form.
pub fn read_settings(text: &str) -> Result<SettingsEdit, ReadError> {
    let doc: DocumentMut = text.parse()?;
    let workers = match doc.get("worker").and_then(Item::as_array_of_tables) {
        Some(tables) => tables.iter().enumerate().map(|(i, t)| worker_edit(i, t)).collect::<Result<_, _>>()?,
        None => Vec::new(),
    };
    let conductor = doc.get("conductor").and_then(Item::as_table_like);
    let recursion = doc.get("recursion").and_then(Item::as_table_like);
    let budget = doc.get("budget").and_then(Item::as_table_like);
    let string = |t: Option<&dyn TableLike>, k: &str| t.and_then(|t| t.get(k)?.as_str().map(str::to_owned));
    let int = |t: Option<&dyn TableLike>, k: &str| t.and_then(|t| t.get(k)?.as_integer());
    let form = ConductorEdit {
        model: string(conductor, "model"),
        url: string(conductor, "url"),
        grammar: string(conductor, "grammar").filter(|g| g != "none"),
        device: string(conductor, "device").unwrap_or_else(|| Device::Auto.as_str().to_owned()),
        max_steps: doc.get("max_steps").and_then(Item::as_integer).unwrap_or(DEFAULT_MAX_STEPS as i64) as u32,
        recursion: recursion.and_then(|t| t.get("enabled")?.as_bool()).unwrap_or(false),
        max_depth: int(recursion, "max_depth").unwrap_or(2) as u32,
        fallback: conductor.and_then(|t| t.get("fallback")?.as_bool()).unwrap_or(true),
        max_calls: int(budget, "max_calls").map(|n| n as u32),
        max_tokens: int(budget, "max_tokens").map(|n| n as u32),
        max_cost_usd: budget.and_then(|t| float(t.get("max_cost_usd")?)),
    };
    Ok(SettingsEdit { workers, conductor: form })
}

fn float(item: &Item) -> Option<f64> {
    item.as_float().or_else(|| item.as_integer().map(|n| n as f64))
}

/// One worker's form; an error when its provider is one the form cannot show.
fn worker_edit(index: usize, t: &Table) -> Result<WorkerEdit, ReadError> {
    let string = |k: &str| t.get(k).and_then(Item::as_str).map(str::to_owned);
    let int = |k: &str| t.get(k).and_then(Item::as_integer).map(|n| n as u32);
    let name = string("name").unwrap_or_default();
    let provider = string("provider").unwrap_or_default();
    let Some(provider) = ProviderKind::ALL.into_iter().find(|k| k.as_str() == provider) else {
        return Err(ReadError::UnknownProvider { index, name, provider });
    };
    Ok(WorkerEdit {
        original: Some(index),
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

/// Parses `text` for an edit: a file that is not TOML is never rewritten.
fn document(text: &str, file: &str) -> Result<DocumentMut, EditError> {
    text.parse().map_err(|source| EditError::NotToml { file: file.to_owned(), source })
}

/// Applies `edit` to the pool TOML `text` and checks the result; returns the new text. `file`
/// names the file in errors.
pub fn apply_settings(text: &str, edit: &SettingsEdit, file: &str) -> Result<String, EditError> {
    let mut doc = document(text, file)?;
    let old: Vec<Table> =
        doc.get("worker").and_then(Item::as_array_of_tables).map(|a| a.iter().cloned().collect()).unwrap_or_default();
    let mut workers = ArrayOfTables::new();
    for w in &edit.workers {
        let mut t = w.original.and_then(|i| old.get(i).cloned()).unwrap_or_default();
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

    let c = &edit.conductor;
    put(doc.as_table_mut(), "max_steps", i64::from(c.max_steps));
    let conductor = table(&mut doc, "conductor");
    set_str(conductor, "model", c.model.as_deref());
    set_str(conductor, "url", c.url.as_deref());
    // A grammar applies to a server only (the pool refuses one beside a local model).
    set_str(conductor, "grammar", c.grammar.as_deref().filter(|_| c.url.is_some()));
    // The default is not written.
    set_str(conductor, "device", (c.device != Device::Auto.as_str()).then_some(c.device.as_str()));
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
        && !edit.workers.is_empty()
    {
        return Err(EditError::Invalid(e));
    }
    Ok(text)
}

/// Refuses a form that would change where an environment variable's value goes.
///
/// `api_key_env` names a variable whose value Baton sends to the worker's server, whatever the
/// variable holds. The window is untrusted: if it could set that name, or move a worker that has
/// one to another server, a script there could send `AWS_SECRET_ACCESS_KEY` (say) to a host of
/// its choosing. So the user sets it, and the server it goes to, in the pool file itself.
fn keeps_env_key_where_it_was(old: &Table, w: &WorkerEdit, file: &str) -> Result<(), EditError> {
    let text = |k: &str| old.get(k).and_then(Item::as_str).map(str::trim).filter(|s| !s.is_empty());
    let env = text("api_key_env");
    let asked = w.api_key_env.as_deref().map(str::trim).filter(|s| !s.is_empty());
    let name = w.name.trim();
    if asked != env {
        return Err(EditError::Refused(format!(
            "worker \"{name}\": api_key_env can only be set in the pool file itself ({file}): it names an environment variable whose value is sent to the worker's server"
        )));
    }
    let moved = text("provider") != Some(w.provider.as_str())
        || text("base_url").map(|u| u.trim_end_matches('/'))
            != w.base_url.as_deref().map(|u| u.trim().trim_end_matches('/')).filter(|u| !u.is_empty());
    if let Some(var) = env
        && moved
    {
        return Err(EditError::Refused(format!(
            "worker \"{name}\" takes its key from the environment variable {var}: change its provider or base_url in the pool file itself ({file}), so that the key goes only where you send it"
        )));
    }
    Ok(())
}

/// Writes `edit` into the `[serve]` table of pool TOML `text` and checks the result; returns
/// the new text. `file` names the file in errors.
pub fn apply_serve(text: &str, edit: &ServeEdit, file: &str) -> Result<String, EditError> {
    let mut doc = document(text, file)?;
    let t = table(&mut doc, "serve");
    let host = edit.host.trim();
    let host = (!host.is_empty() && host != "127.0.0.1").then(|| host.to_owned());
    if host.as_deref() != t.get("host").and_then(Item::as_str) {
        return Err(EditError::Refused(
            "the Local API's address (host) can only be changed in the pool file itself: anything but loopback opens the server to the network".to_owned(),
        ));
    }
    let origins: Vec<String> = edit
        .allow_origins
        .iter()
        .map(|o| o.trim().trim_end_matches('/').to_owned())
        .filter(|o| !o.is_empty())
        .collect();
    for origin in &origins {
        let after_scheme = origin.strip_prefix("http://").or_else(|| origin.strip_prefix("https://"));
        if after_scheme.is_none_or(|rest| rest.is_empty() || rest.contains('/')) {
            return Err(EditError::Refused(format!(
                "{origin:?} is not a web origin: write it as the browser shows it, e.g. http://localhost:3000 (scheme, host and port, no path)"
            )));
        }
    }
    t["app"] = toml_edit::value(edit.enabled);
    t["port"] = toml_edit::value(i64::from(edit.port));
    t["max_concurrent_runs"] = toml_edit::value(i64::from(edit.max_concurrent_runs));
    match edit.daily_max_cost_usd {
        Some(usd) => t["daily_max_cost_usd"] = toml_edit::value(usd),
        None => {
            t.remove("daily_max_cost_usd");
        }
    }
    if origins.is_empty() {
        t.remove("allow_origins");
    } else {
        t["allow_origins"] = toml_edit::value(origins.into_iter().collect::<Array>());
    }
    let text = doc.to_string();
    Pool::parse(&text, file)?;
    Ok(text)
}

/// Writes the file whole or not at all: a crash mid-save leaves the old pool.
pub fn write_atomically(path: &Path, text: &str) -> Result<(), EditError> {
    let io = |source: std::io::Error| EditError::Write { path: path.to_owned(), source };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let tmp = path.with_extension("toml.saving");
    std::fs::write(&tmp, text).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
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
        let mut form = read_settings(FILE).unwrap();
        assert_eq!(form.conductor.max_steps, 4);
        assert_eq!(form.workers[0].name, "gpt");
        form.workers[0].description = Some("math".into());
        form.workers.push(WorkerEdit {
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
        let text = apply_settings(FILE, &form, "pool.toml").unwrap();
        for kept in ["# my pool", "# the strong one", "timeout_secs = 90", "[retry]", "max_retries = 1"] {
            assert!(text.contains(kept), "{kept} lost:\n{text}");
        }
        let pool = Pool::parse(&text, "pool.toml").unwrap();
        assert_eq!(pool.workers.len(), 2);
        assert_eq!(pool.workers[0].description.as_deref(), Some("math"));
        assert_eq!(pool.options.conductor.model.as_deref(), Some("/models/qwen.gguf"));
        assert_eq!(read_settings(&text).unwrap().conductor, form.conductor);
    }

    #[test]
    fn an_invalid_worker_is_refused_with_the_pool_error() {
        let mut form = read_settings(FILE).unwrap();
        form.workers[0].provider = ProviderKind::OpenAiCompatible; // needs a base_url
        let err = apply_settings(FILE, &form, "pool.toml").unwrap_err();
        assert!(matches!(err, EditError::Invalid(_)), "{err:?}");
        assert!(err.to_string().contains("base_url"), "{err}");
    }

    #[test]
    fn a_provider_the_form_cannot_show_is_named_not_replaced() {
        let text = FILE.replace("provider = \"openai\"", "provider = \"openia\"");
        let err = read_settings(&text).unwrap_err().to_string();
        assert!(err.contains("worker 0 (\"gpt\"): provider \"openia\""), "{err}");
    }

    #[test]
    fn broken_toml_is_never_rewritten() {
        let err = apply_settings("[[worker]\nname=", &read_settings("").unwrap(), "pool.toml").unwrap_err();
        assert!(matches!(err, EditError::NotToml { .. }), "{err:?}");
        assert!(err.to_string().contains("will not rewrite"), "{err}");
        let serve = ServeEdit {
            enabled: true,
            host: "127.0.0.1".into(),
            port: 8765,
            max_concurrent_runs: 4,
            daily_max_cost_usd: None,
            allow_origins: Vec::new(),
        };
        assert!(matches!(apply_serve("[[worker]\nname=", &serve, "pool.toml"), Err(EditError::NotToml { .. })));
    }

    const POOL: &str = "# mine\n[serve]\nport = 9000 # fixed for my editor\ntoken_env = \"T\"\n\n[[worker]]\nname = \"a\"\nprovider = \"openai\"\nmodel = \"m\"\n";

    /// The `[serve]` table of [`POOL`] as the Local API form shows it.
    fn form() -> ServeEdit {
        let spec = Pool::parse(POOL, "pool.toml").unwrap().options.serve;
        ServeEdit {
            enabled: spec.app,
            host: spec.host.unwrap_or_else(|| "127.0.0.1".into()),
            port: spec.port.unwrap_or(8765),
            max_concurrent_runs: spec.max_concurrent_runs.map_or(4, |n| n as u32),
            daily_max_cost_usd: spec.daily_max_cost_usd,
            allow_origins: spec.allow_origins,
        }
    }

    #[test]
    fn a_serve_edit_keeps_what_the_form_does_not_show() {
        let mut f = form();
        f.enabled = true;
        f.daily_max_cost_usd = Some(2.5);
        f.allow_origins = vec!["http://localhost:3000/".into()];
        let text = apply_serve(POOL, &f, "pool.toml").unwrap();
        assert!(text.contains("# mine") && text.contains("token_env = \"T\""), "{text}");
        let spec = Pool::parse(&text, "pool.toml").unwrap().options.serve;
        assert!(spec.app);
        assert_eq!((spec.port, spec.daily_max_cost_usd), (Some(9000), Some(2.5)));
        assert_eq!(spec.allow_origins, ["http://localhost:3000"]);
        f.daily_max_cost_usd = None;
        let text = apply_serve(&text, &f, "pool.toml").unwrap();
        assert_eq!(Pool::parse(&text, "pool.toml").unwrap().options.serve.daily_max_cost_usd, None);
    }

    #[test]
    fn the_form_cannot_open_the_server_to_the_network_or_name_a_page_as_an_origin() {
        let refused = |f: &ServeEdit| match apply_serve(POOL, f, "pool.toml") {
            Err(EditError::Refused(message)) => message,
            other => panic!("{other:?}"),
        };
        let mut f = form();
        f.host = "0.0.0.0".into();
        assert!(refused(&f).contains("pool file itself"));
        let mut f = form();
        f.allow_origins = vec!["localhost:3000".into()];
        assert!(refused(&f).contains("not a web origin"));
        f.allow_origins = vec!["https://chat.example.com/page".into()];
        assert!(refused(&f).contains("no path"));
    }
}

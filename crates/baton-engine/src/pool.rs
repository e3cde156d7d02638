//! The worker pool: a TOML file of `[[worker]]` tables plus run-wide options.
//!
//! Workers are numbered in file order; the conductor knows them only as "Model 0", "Model 1", …
//! Every mistake in the file is reported with the file, the line, the worker and the field.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use baton_plan::DEFAULT_MAX_STEPS;
use baton_providers::{ModelSettings, ProviderKind, RetryPolicy, ServerGrammar};
use serde::Serialize;

use crate::prices::{self, Price, Pricing};

/// A pool file, parsed and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Pool {
    pub workers: Vec<WorkerSpec>,
    pub options: PoolOptions,
}

/// Run-wide settings, all optional in the file.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolOptions {
    /// Longest plan accepted (the paper uses 5).
    pub max_steps: usize,
    /// Tell every worker the user's original question, in its system message (the paper does
    /// not: its workers see only their subtasks). On by default: a small conductor's subtasks
    /// often leave out what the question says, and the default prompt (v3) relies on it.
    pub show_question: bool,
    /// Ask the step that writes the reply the question itself (what a worker alone is asked),
    /// with its subtask as "your part in this workflow" in its system message, unless the
    /// subtask already holds the question. On by default: a small conductor's last subtask
    /// often narrows the question ("Identify the author.") and drops the form the reply must
    /// take, and the user was answered with that narrower reply.
    pub question_to_answer_step: bool,
    /// Calls in flight at once per provider endpoint.
    pub max_concurrency_per_provider: usize,
    pub budget: Budget,
    pub retry: RetryPolicy,
    pub recursion: RecursionOptions,
    /// The `[conductor]` table: which model writes plans.
    pub conductor: ConductorSpec,
    /// What runs when the conductor's plans cannot be used (`[conductor] fallback`).
    pub fallback: FallbackOptions,
    /// The `[serve]` table: `baton serve`'s settings (its flags override them).
    pub serve: ServeSpec,
}

/// `baton serve`'s settings from the pool file; `None` leaves the server's default.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ServeSpec {
    /// Whether the desktop app serves its Local API while it is open (`baton serve` always serves).
    pub app: bool,
    pub host: Option<String>,
    pub port: Option<u16>,
    /// The environment variable that holds the token (else the keychain's).
    pub token_env: Option<String>,
    /// Web origins allowed to call the server from a browser.
    pub allow_origins: Vec<String>,
    pub max_concurrent_runs: Option<usize>,
    /// The most the server spends in a day (UTC), all requests together.
    pub daily_max_cost_usd: Option<f64>,
}

/// When the conductor's plan for a question cannot be used (it failed, loops, copies an
/// example, or keeps the question from the workers), it is asked once more, and then (or when
/// the run's caps leave no room for a second attempt) the question goes to one worker alone.
/// See [`crate::fallback`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FallbackOptions {
    /// Off: the conductor's plan runs as written, and a plan that fails fails the run.
    pub enabled: bool,
    /// The worker that answers alone: `[conductor] fallback_worker` when the pool names one,
    /// else the best worker of this pool's latest evaluation (set from the history), else the
    /// first. [`crate::fallback::fallback_worker`] prefers the best for the question's category.
    pub worker: Option<usize>,
    /// Whether `worker` is the user's choice (`fallback_worker`), which an evaluation's does not
    /// replace.
    pub chosen: bool,
    /// What the pool's latest evaluation measured of each worker alone, per category, so the
    /// question can go to the best worker for its kind (set by the app and the CLI from the
    /// history; empty otherwise). Not used when the user chose the worker.
    pub measured: crate::fallback::Measured,
}

impl Default for FallbackOptions {
    fn default() -> Self {
        FallbackOptions { enabled: true, worker: None, chosen: false, measured: Default::default() }
    }
}

/// Which model writes plans, and how. Either `model` is a local path (a `.gguf` file or a
/// safetensors directory), or `url` names an OpenAI-compatible endpoint serving `model`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ConductorSpec {
    pub model: Option<String>,
    pub url: Option<String>,
    /// Environment variable holding the remote endpoint's key.
    pub api_key_env: Option<String>,
    /// The remote server's structured-output extension (`grammar = "vllm"` …); without one,
    /// the remote conductor's answers are parsed and retried once on an error.
    pub grammar: Option<ServerGrammar>,
    pub lora: Option<String>,
    pub chat_template: Option<String>,
    /// `auto` (GPU when there is one) or `cpu`.
    pub device: Option<String>,
    pub isq: Option<String>,
    pub dtype: Option<String>,
    pub temperature: Option<f64>,
    pub max_reasoning_chars: Option<usize>,
    pub max_subtask_chars: Option<usize>,
    /// Longest a plan may take, in seconds, before it fails with an error naming this limit.
    pub plan_time_limit_secs: Option<u64>,
    /// A remote conductor's limit per request, in seconds (retries follow `[retry]`).
    pub timeout_secs: Option<u64>,
    /// The conductor prompt's version (`v2`, `v3`); the conductor checks the name.
    pub prompt: Option<String>,
}

/// The conductor as its own worker ("Model k: yourself").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecursionOptions {
    pub enabled: bool,
    /// Rounds nested below the question's plan.
    pub max_depth: u32,
    /// Steps in the whole run, recursive rounds included; default twice the first plan's.
    pub max_total_steps: Option<usize>,
}

impl Default for RecursionOptions {
    fn default() -> Self {
        RecursionOptions { enabled: false, max_depth: 2, max_total_steps: None }
    }
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            max_steps: DEFAULT_MAX_STEPS,
            show_question: true,
            question_to_answer_step: true,
            max_concurrency_per_provider: 4,
            budget: Budget::default(),
            retry: RetryPolicy::default(),
            recursion: RecursionOptions::default(),
            conductor: ConductorSpec::default(),
            fallback: FallbackOptions::default(),
            serve: ServeSpec::default(),
        }
    }
}

/// Caps per run, checked before every call.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Budget {
    /// Provider calls, retries included.
    pub max_calls: Option<u32>,
    /// Input plus output tokens.
    pub max_tokens: Option<u64>,
    pub max_cost_usd: Option<f64>,
}

/// One worker as the pool file describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerSpec {
    /// Shown to the user, never to the conductor.
    pub name: String,
    pub provider: ProviderKind,
    pub model: String,
    /// Replaces the provider's default base URL; required for `openai-compatible`.
    pub base_url: Option<String>,
    /// Environment variable holding the key; it takes precedence over the key store.
    pub api_key_env: Option<String>,
    pub max_tokens: u32,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub reasoning_effort: Option<String>,
    pub thinking_budget: Option<u32>,
    pub stream: bool,
    /// Limit for one call, first byte to last.
    pub timeout: Duration,
    /// Longest silence allowed inside a streamed answer.
    pub idle_timeout: Duration,
    /// $ per million input tokens; with `price_out`, replaces the price data's figures.
    pub price_in: Option<f64>,
    pub price_out: Option<f64>,
    /// $ per million input tokens read from a prompt cache (default: `price_in`).
    pub price_cached_in: Option<f64>,
    /// Anthropic: set cache breakpoints on the shared prefix of a step's conversation.
    pub prompt_cache: bool,
    /// What the conductor is told about this worker.
    pub description: Option<String>,
}

impl WorkerSpec {
    /// The base URL calls go to: the pool's, else the provider's default.
    pub fn effective_base_url(&self) -> &str {
        self.base_url.as_deref().or(self.provider.default_base_url()).unwrap_or_default()
    }

    /// How this worker's calls are priced: the pool's prices, else the price data's (see
    /// [`prices`]); [`Pricing::Unknown`] when neither knows the model.
    pub fn pricing(&self) -> Pricing {
        match (self.price_in, self.price_out) {
            (Some(input), Some(output)) => Pricing::Pool(Price { input, output, cached_input: self.price_cached_in }),
            _ => prices::lookup(self.provider, self.effective_base_url(), &self.model),
        }
    }

    pub fn settings(&self) -> ModelSettings {
        ModelSettings {
            model: self.model.clone(),
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            reasoning_effort: self.reasoning_effort.clone(),
            thinking_budget: self.thinking_budget,
            stream: self.stream,
            idle_timeout: self.idle_timeout,
            prompt_cache: self.prompt_cache,
        }
    }
}

/// What is wrong with a pool file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct PoolError {
    pub file: String,
    pub line: Option<usize>,
    /// Index and name of the worker, when the problem is inside one.
    pub worker: Option<(usize, Option<String>)>,
    pub field: Option<String>,
    pub message: String,
}

impl fmt::Display for PoolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file)?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        f.write_str(": ")?;
        if let Some((index, name)) = &self.worker {
            match name {
                Some(name) => write!(f, "worker {index} (\"{name}\"): ")?,
                None => write!(f, "worker {index}: ")?,
            }
        }
        if let Some(field) = &self.field {
            write!(f, "field `{field}`: ")?;
        }
        f.write_str(&self.message)
    }
}

const TOP_LEVEL_KEYS: &[&str] = &[
    "max_steps",
    "show_question",
    "question_to_answer_step",
    "max_concurrency_per_provider",
    "budget",
    "retry",
    "recursion",
    "conductor",
    "serve",
    "worker",
];
const SERVE_KEYS: &[&str] =
    &["app", "host", "port", "token_env", "allow_origins", "max_concurrent_runs", "daily_max_cost_usd"];
const RECURSION_KEYS: &[&str] = &["enabled", "max_depth", "max_total_steps"];
const CONDUCTOR_KEYS: &[&str] = &[
    "model",
    "url",
    "api_key_env",
    "grammar",
    "lora",
    "chat_template",
    "device",
    "isq",
    "dtype",
    "temperature",
    "max_reasoning_chars",
    "max_subtask_chars",
    "plan_time_limit_secs",
    "timeout_secs",
    "prompt",
    "fallback",
    "fallback_worker",
];
const BUDGET_KEYS: &[&str] = &["max_calls", "max_tokens", "max_cost_usd"];
const RETRY_KEYS: &[&str] = &["max_retries", "initial_delay_ms", "max_delay_ms", "max_retry_after_secs"];
const WORKER_KEYS: &[&str] = &[
    "name",
    "provider",
    "model",
    "base_url",
    "api_key_env",
    "max_tokens",
    "temperature",
    "top_p",
    "reasoning_effort",
    "thinking_budget",
    "stream",
    "timeout_secs",
    "idle_timeout_secs",
    "price_in",
    "price_out",
    "price_cached_in",
    "prompt_cache",
    "description",
];

impl Pool {
    pub fn load(path: &Path) -> Result<Pool, PoolError> {
        let text = std::fs::read_to_string(path).map_err(|e| PoolError {
            file: path.display().to_string(),
            line: None,
            worker: None,
            field: None,
            message: if e.kind() == std::io::ErrorKind::NotFound {
                "no such file; create a pool file (see examples/pool.toml) or pass --pool FILE".to_owned()
            } else {
                format!("cannot read: {e}")
            },
        })?;
        Pool::parse(&text, &path.display().to_string())
    }

    /// Parses pool TOML; `file` names the source in errors.
    pub fn parse(text: &str, file: &str) -> Result<Pool, PoolError> {
        let err =
            |line: Option<usize>, worker: Option<(usize, Option<String>)>, field: Option<&str>, message: String| {
                PoolError { file: file.to_owned(), line, worker, field: field.map(str::to_owned), message }
            };
        let doc: toml::Spanned<toml::Table> = toml::from_str(text).map_err(|e| {
            let line = e.span().map(|s| line_of(text, s.start));
            err(line, None, None, e.message().trim().to_owned())
        })?;
        let table = doc.into_inner();
        // Spans of each [[worker]] table, for line numbers.
        let worker_spans: Vec<usize> = toml::from_str::<WorkerSpans>(text)
            .map(|w| w.worker.iter().map(|s| line_of(text, s.span().start)).collect())
            .unwrap_or_default();

        if let Some(key) = table.keys().find(|k| !TOP_LEVEL_KEYS.contains(&k.as_str())) {
            return Err(err(
                None,
                None,
                Some(key),
                format!("unknown setting; expected one of {}", TOP_LEVEL_KEYS.join(", ")),
            ));
        }

        let mut options = PoolOptions::default();
        let mut fallback_worker: Option<String> = None;
        let top = Fields { table: &table, allowed: TOP_LEVEL_KEYS };
        let field_err = |e: FieldError| err(None, None, Some(&e.field), e.message);
        if let Some(n) = top.int("max_steps", 1, 64).map_err(field_err)? {
            options.max_steps = n as usize;
        }
        if let Some(b) = top.bool("show_question").map_err(field_err)? {
            options.show_question = b;
        }
        if let Some(b) = top.bool("question_to_answer_step").map_err(field_err)? {
            options.question_to_answer_step = b;
        }
        if let Some(n) = top.int("max_concurrency_per_provider", 1, 1024).map_err(field_err)? {
            options.max_concurrency_per_provider = n as usize;
        }
        if let Some(budget) = top.table("budget").map_err(field_err)? {
            let b = Fields { table: budget, allowed: BUDGET_KEYS };
            let field_err = |e: FieldError| err(None, None, Some(&format!("budget.{}", e.field)), e.message);
            b.check_unknown().map_err(field_err)?;
            options.budget.max_calls = b.int("max_calls", 1, u32::MAX as i64).map_err(field_err)?.map(|n| n as u32);
            options.budget.max_tokens = b.int("max_tokens", 1, i64::MAX).map_err(field_err)?.map(|n| n as u64);
            options.budget.max_cost_usd = b.float("max_cost_usd", 0.0).map_err(field_err)?;
        }
        if let Some(retry) = top.table("retry").map_err(field_err)? {
            let r = Fields { table: retry, allowed: RETRY_KEYS };
            let field_err = |e: FieldError| err(None, None, Some(&format!("retry.{}", e.field)), e.message);
            r.check_unknown().map_err(field_err)?;
            if let Some(n) = r.int("max_retries", 0, 20).map_err(field_err)? {
                options.retry.max_retries = n as u32;
            }
            if let Some(n) = r.int("initial_delay_ms", 0, 600_000).map_err(field_err)? {
                options.retry.initial_delay = Duration::from_millis(n as u64);
            }
            if let Some(n) = r.int("max_delay_ms", 0, 3_600_000).map_err(field_err)? {
                options.retry.max_delay = Duration::from_millis(n as u64);
            }
            if let Some(n) = r.int("max_retry_after_secs", 0, 86_400).map_err(field_err)? {
                options.retry.max_retry_after = Duration::from_secs(n as u64);
            }
        }

        if let Some(recursion) = top.table("recursion").map_err(field_err)? {
            let r = Fields { table: recursion, allowed: RECURSION_KEYS };
            let field_err = |e: FieldError| err(None, None, Some(&format!("recursion.{}", e.field)), e.message);
            r.check_unknown().map_err(field_err)?;
            if let Some(b) = r.bool("enabled").map_err(field_err)? {
                options.recursion.enabled = b;
            }
            if let Some(n) = r.int("max_depth", 1, 8).map_err(field_err)? {
                options.recursion.max_depth = n as u32;
            }
            options.recursion.max_total_steps =
                r.int("max_total_steps", 1, 1000).map_err(field_err)?.map(|n| n as usize);
        }

        if let Some(serve) = top.table("serve").map_err(field_err)? {
            let s = Fields { table: serve, allowed: SERVE_KEYS };
            let field_err = |e: FieldError| err(None, None, Some(&format!("serve.{}", e.field)), e.message);
            s.check_unknown().map_err(field_err)?;
            options.serve.app = s.bool("app").map_err(field_err)?.unwrap_or(false);
            options.serve.host = s.string("host").map_err(field_err)?;
            options.serve.port = s.int("port", 0, 65_535).map_err(field_err)?.map(|n| n as u16);
            options.serve.token_env = s.string("token_env").map_err(field_err)?;
            options.serve.allow_origins = s.strings("allow_origins").map_err(field_err)?;
            options.serve.max_concurrent_runs =
                s.int("max_concurrent_runs", 1, 10_000).map_err(field_err)?.map(|n| n as usize);
            options.serve.daily_max_cost_usd = s.float("daily_max_cost_usd", 0.0).map_err(field_err)?;
        }

        if let Some(conductor) = top.table("conductor").map_err(field_err)? {
            let c = Fields { table: conductor, allowed: CONDUCTOR_KEYS };
            let field_err = |e: FieldError| err(None, None, Some(&format!("conductor.{}", e.field)), e.message);
            c.check_unknown().map_err(field_err)?;
            let spec = &mut options.conductor;
            spec.model = c.string("model").map_err(field_err)?;
            spec.url = match c.string("url").map_err(field_err)? {
                Some(u) => {
                    Some(check_url(&u).map_err(|message| field_err(FieldError { field: "url".into(), message }))?)
                }
                None => None,
            };
            if spec.url.is_some() && spec.model.is_none() {
                return Err(field_err(FieldError {
                    field: "model".into(),
                    message: "missing; a remote conductor needs the model name the server serves".into(),
                }));
            }
            spec.api_key_env = c.string("api_key_env").map_err(field_err)?;
            if let Some(var) = &spec.api_key_env
                && !is_env_var_name(var)
            {
                return Err(field_err(FieldError {
                    field: "api_key_env".into(),
                    message: "must be the NAME of an environment variable, not the key itself".into(),
                }));
            }
            spec.grammar = match c.string("grammar").map_err(field_err)? {
                None => None,
                Some(name) if name == "none" => None,
                Some(name) => Some(ServerGrammar::parse(&name).ok_or_else(|| {
                    field_err(FieldError {
                        field: "grammar".into(),
                        message: format!(
                            "\"{name}\"; expected one of {}, or none (plans are then parsed and retried once)",
                            ServerGrammar::NAMES.join(", ")
                        ),
                    })
                })?),
            };
            if spec.grammar.is_some() && spec.url.is_none() {
                return Err(field_err(FieldError {
                    field: "grammar".into(),
                    message:
                        "only applies to a remote conductor (url); a local conductor is always held to the plan grammar"
                            .into(),
                }));
            }
            spec.lora = c.string("lora").map_err(field_err)?;
            spec.chat_template = c.string("chat_template").map_err(field_err)?;
            spec.device = c.string("device").map_err(field_err)?;
            if let Some(d) = &spec.device
                && !["auto", "cpu"].contains(&d.as_str())
            {
                return Err(field_err(FieldError {
                    field: "device".into(),
                    message: format!("\"{d}\"; expected auto (the GPU when Baton is built for one) or cpu"),
                }));
            }
            spec.isq = c.string("isq").map_err(field_err)?;
            spec.dtype = c.string("dtype").map_err(field_err)?;
            spec.temperature = c.float("temperature", 0.0).map_err(field_err)?;
            spec.max_reasoning_chars = c.int("max_reasoning_chars", 0, 100_000).map_err(field_err)?.map(|n| n as usize);
            spec.max_subtask_chars = c.int("max_subtask_chars", 1, 100_000).map_err(field_err)?.map(|n| n as usize);
            spec.plan_time_limit_secs = c.int("plan_time_limit_secs", 1, 86_400).map_err(field_err)?.map(|n| n as u64);
            spec.timeout_secs = c.int("timeout_secs", 1, 86_400).map_err(field_err)?.map(|n| n as u64);
            spec.prompt = c.string("prompt").map_err(field_err)?;
            if let Some(b) = c.bool("fallback").map_err(field_err)? {
                options.fallback.enabled = b;
            }
            fallback_worker = c.string("fallback_worker").map_err(field_err)?;
        }

        let raw_workers = match table.get("worker") {
            None => Vec::new(),
            Some(toml::Value::Array(items)) => items.clone(),
            Some(_) => {
                return Err(err(None, None, Some("worker"), "must be an array of tables: write [[worker]]".into()));
            }
        };
        if raw_workers.is_empty() {
            return Err(err(None, None, None, "the pool has no workers; add at least one [[worker]] table".into()));
        }
        let mut workers = Vec::with_capacity(raw_workers.len());
        for (index, raw) in raw_workers.iter().enumerate() {
            let line = worker_spans.get(index).copied();
            let toml::Value::Table(t) = raw else {
                return Err(err(line, Some((index, None)), None, "must be a table".into()));
            };
            let name = t.get("name").and_then(|v| v.as_str()).map(str::to_owned);
            let spec = worker(t).map_err(|e| err(line, Some((index, name.clone())), Some(&e.field), e.message))?;
            if let Some(first) = workers.iter().position(|w: &WorkerSpec| w.name == spec.name) {
                return Err(err(
                    line,
                    Some((index, name)),
                    Some("name"),
                    format!("worker {first} already has this name; names must be unique"),
                ));
            }
            workers.push(spec);
        }
        if let Some(name) = fallback_worker {
            let Some(index) = workers.iter().position(|w| w.name == name) else {
                let names: Vec<&str> = workers.iter().map(|w| w.name.as_str()).collect();
                return Err(err(
                    None,
                    None,
                    Some("conductor.fallback_worker"),
                    format!("\"{name}\" is not a worker of this pool; expected one of {}", names.join(", ")),
                ));
            };
            options.fallback.worker = Some(index);
            options.fallback.chosen = true;
        }
        Ok(Pool { workers, options })
    }
}

#[derive(serde::Deserialize)]
struct WorkerSpans {
    #[serde(default)]
    worker: Vec<toml::Spanned<toml::Table>>,
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

struct FieldError {
    field: String,
    message: String,
}

/// Typed access to a TOML table that names the field in every error.
struct Fields<'a> {
    table: &'a toml::Table,
    allowed: &'static [&'static str],
}

impl<'a> Fields<'a> {
    fn check_unknown(&self) -> Result<(), FieldError> {
        match self.table.keys().find(|k| !self.allowed.contains(&k.as_str())) {
            Some(k) => Err(FieldError {
                field: k.clone(),
                message: format!("unknown field; expected one of {}", self.allowed.join(", ")),
            }),
            None => Ok(()),
        }
    }

    fn wrong_type(field: &'static str, want: &str, got: &toml::Value) -> FieldError {
        FieldError { field: field.into(), message: format!("expected {want}, found {} `{got}`", got.type_str()) }
    }

    fn string(&self, field: &'static str) -> Result<Option<String>, FieldError> {
        match self.table.get(field) {
            None => Ok(None),
            Some(toml::Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(Self::wrong_type(field, "a string", v)),
        }
    }

    fn strings(&self, field: &'static str) -> Result<Vec<String>, FieldError> {
        match self.table.get(field) {
            None => Ok(Vec::new()),
            Some(toml::Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    toml::Value::String(s) => Ok(s.clone()),
                    v => Err(Self::wrong_type(field, "a list of strings", v)),
                })
                .collect(),
            Some(v) => Err(Self::wrong_type(field, "a list of strings", v)),
        }
    }

    fn required(&self, field: &'static str) -> Result<String, FieldError> {
        match self.string(field)? {
            Some(s) if !s.trim().is_empty() => Ok(s),
            Some(_) => Err(FieldError { field: field.into(), message: "must not be empty".into() }),
            None => Err(FieldError { field: field.into(), message: "missing; every worker needs one".into() }),
        }
    }

    fn int(&self, field: &'static str, min: i64, max: i64) -> Result<Option<i64>, FieldError> {
        match self.table.get(field) {
            None => Ok(None),
            Some(toml::Value::Integer(n)) if (min..=max).contains(n) => Ok(Some(*n)),
            Some(toml::Value::Integer(n)) => {
                Err(FieldError { field: field.into(), message: format!("{n} is out of range ({min} to {max})") })
            }
            Some(v) => Err(Self::wrong_type(field, "a whole number", v)),
        }
    }

    fn float(&self, field: &'static str, min: f64) -> Result<Option<f64>, FieldError> {
        let value = match self.table.get(field) {
            None => return Ok(None),
            Some(toml::Value::Float(f)) => *f,
            Some(toml::Value::Integer(n)) => *n as f64,
            Some(v) => return Err(Self::wrong_type(field, "a number", v)),
        };
        if value.is_finite() && value >= min {
            Ok(Some(value))
        } else {
            Err(FieldError { field: field.into(), message: format!("{value} is out of range (at least {min})") })
        }
    }

    fn bool(&self, field: &'static str) -> Result<Option<bool>, FieldError> {
        match self.table.get(field) {
            None => Ok(None),
            Some(toml::Value::Boolean(b)) => Ok(Some(*b)),
            Some(v) => Err(Self::wrong_type(field, "true or false", v)),
        }
    }

    fn table(&self, field: &'static str) -> Result<Option<&'a toml::Table>, FieldError> {
        match self.table.get(field) {
            None => Ok(None),
            Some(toml::Value::Table(t)) => Ok(Some(t)),
            Some(v) => Err(Self::wrong_type(field, "a table", v)),
        }
    }
}

fn worker(t: &toml::Table) -> Result<WorkerSpec, FieldError> {
    let f = Fields { table: t, allowed: WORKER_KEYS };
    if let Some(k) = t.keys().find(|k| !WORKER_KEYS.contains(&k.as_str())) {
        return Err(FieldError {
            field: k.clone(),
            message: format!("unknown field; expected one of {}", WORKER_KEYS.join(", ")),
        });
    }
    let name = f.required("name")?;
    let provider_name = f.required("provider")?;
    let provider = ProviderKind::ALL.into_iter().find(|k| k.as_str() == provider_name).ok_or_else(|| FieldError {
        field: "provider".into(),
        message: format!(
            "unknown provider \"{provider_name}\"; expected one of {}",
            ProviderKind::ALL.map(|k| k.as_str()).join(", ")
        ),
    })?;
    let model = f.required("model")?;
    let base_url = match f.string("base_url")? {
        Some(u) => Some(check_url(&u).map_err(|message| FieldError { field: "base_url".into(), message })?),
        None if provider == ProviderKind::OpenAiCompatible => {
            return Err(FieldError {
                field: "base_url".into(),
                message: "missing; an openai-compatible worker needs the server's URL, e.g. http://127.0.0.1:11434/v1"
                    .into(),
            });
        }
        None => None,
    };
    if provider == ProviderKind::Local {
        if base_url.is_some() {
            return Err(FieldError {
                field: "base_url".into(),
                message: "a local worker runs in process; give its model file or directory as `model`".into(),
            });
        }
        if !std::path::Path::new(&model).exists() {
            return Err(FieldError {
                field: "model".into(),
                message: format!(
                    "\"{model}\" does not exist; a local worker's model is a .gguf file or a safetensors directory"
                ),
            });
        }
    }
    let api_key_env = f.string("api_key_env")?;
    if let Some(var) = &api_key_env
        && !is_env_var_name(var)
    {
        // Never echo the value: a key pasted here by mistake must not reach the terminal.
        return Err(FieldError {
            field: "api_key_env".into(),
            message: "must be the NAME of an environment variable (letters, digits and _, e.g. OPENAI_API_KEY), not the key itself".into(),
        });
    }
    let reasoning_effort = f.string("reasoning_effort")?;
    if let Some(effort) = &reasoning_effort
        && !["minimal", "low", "medium", "high"].contains(&effort.as_str())
    {
        return Err(FieldError {
            field: "reasoning_effort".into(),
            message: format!("\"{effort}\"; expected minimal, low, medium or high"),
        });
    }
    let thinking_budget = f.int("thinking_budget", 0, 10_000_000)?.map(|n| n as u32);
    if provider == ProviderKind::Anthropic
        && let Some(budget) = thinking_budget
        && budget < 1024
    {
        return Err(FieldError {
            field: "thinking_budget".into(),
            message: format!("{budget} is below Anthropic's minimum of 1024 tokens"),
        });
    }
    let price_in = f.float("price_in", 0.0)?;
    let price_out = f.float("price_out", 0.0)?;
    let price_cached_in = f.float("price_cached_in", 0.0)?;
    if price_in.is_some() != price_out.is_some() || (price_cached_in.is_some() && price_in.is_none()) {
        return Err(FieldError {
            field: if price_in.is_some() { "price_out" } else { "price_in" }.into(),
            message: "price_in and price_out go together (and price_cached_in needs them): give both, or neither to use the price data".into(),
        });
    }
    Ok(WorkerSpec {
        name,
        provider,
        model,
        base_url,
        api_key_env,
        max_tokens: f.int("max_tokens", 1, 10_000_000)?.map_or(4096, |n| n as u32),
        temperature: f.float("temperature", 0.0)?.map(|x| x as f32),
        top_p: f.float("top_p", 0.0)?.map(|x| x as f32),
        reasoning_effort,
        thinking_budget,
        stream: f.bool("stream")?.unwrap_or(true),
        timeout: Duration::from_secs(f.int("timeout_secs", 1, 86_400)?.map_or(300, |n| n as u64)),
        idle_timeout: Duration::from_secs(f.int("idle_timeout_secs", 1, 86_400)?.map_or(120, |n| n as u64)),
        price_in,
        price_out,
        price_cached_in,
        prompt_cache: f.bool("prompt_cache")?.unwrap_or(true),
        description: f.string("description")?,
    })
}

/// A portable environment variable name, and not a key pasted in its place. Keys with dashes
/// (`sk-…`, `AIza…`) never match; keys of letters, digits and `_` only (Mistral's, Groq's
/// `gsk_…`) are long runs mixing lower-case letters and digits, which names are not.
fn is_env_var_name(name: &str) -> bool {
    let mut chars = name.chars();
    let portable = chars.next().is_some_and(|c| c == '_' || c.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric())
        && name.len() <= 64;
    let looks_like_a_key =
        name.len() >= 20 && name.chars().any(|c| c.is_ascii_lowercase()) && name.chars().any(|c| c.is_ascii_digit());
    portable && !looks_like_a_key
}

fn check_url(raw: &str) -> Result<String, String> {
    let url = url::Url::parse(raw).map_err(|e| format!("\"{raw}\" is not a URL ({e})"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("\"{raw}\" must start with http:// or https://"));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(format!("\"{raw}\" must not have a query or fragment"));
    }
    Ok(url.as_str().trim_end_matches('/').to_owned())
}

/// What the conductor and the UI may know of a pool: no URLs, no key names.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize, ts_rs::TS)]
pub struct WorkerInfo {
    pub index: usize,
    pub name: String,
    pub provider: ProviderKind,
    pub model: String,
    pub description: Option<String>,
}

impl Pool {
    pub fn infos(&self) -> Vec<WorkerInfo> {
        self.workers
            .iter()
            .enumerate()
            .map(|(index, w)| WorkerInfo {
                index,
                name: w.name.clone(),
                provider: w.provider,
                model: w.model.clone(),
                description: w.description.clone(),
            })
            .collect()
    }
}

/// Where a pool file normally lives: `<config dir>/baton/pool.toml`.
pub fn default_pool_path(config_dir: &Path) -> PathBuf {
    config_dir.join("baton").join("pool.toml")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_serve_table_is_read_and_checked() {
        let pool = Pool::parse(
            "[serve]\napp = true\nhost = \"0.0.0.0\"\nport = 9000\ntoken_env = \"T\"\nallow_origins = [\"http://localhost:3000\"]\nmax_concurrent_runs = 2\ndaily_max_cost_usd = 5\n\n[[worker]]\nname = \"a\"\nprovider = \"openai\"\nmodel = \"m\"\n",
            "pool.toml",
        )
        .expect("parses");
        let s = &pool.options.serve;
        assert_eq!((s.host.as_deref(), s.port, s.token_env.as_deref()), (Some("0.0.0.0"), Some(9000), Some("T")));
        assert_eq!(s.allow_origins, ["http://localhost:3000"]);
        assert_eq!((s.max_concurrent_runs, s.daily_max_cost_usd, s.app), (Some(2), Some(5.0), true));
        let e = Pool::parse(
            &format!(
                "[serve]\napp = \"yes\"{worker}",
                worker = "\n[[worker]]\nname = \"a\"\nprovider = \"openai\"\nmodel = \"m\"\n"
            ),
            "pool.toml",
        );
        assert!(e.unwrap_err().to_string().contains("serve.app"));
        let worker = "\n[[worker]]\nname = \"a\"\nprovider = \"openai\"\nmodel = \"m\"\n";
        let e = Pool::parse(&format!("[serve]\nprot = 1\n{worker}"), "pool.toml").unwrap_err().to_string();
        assert!(e.contains("serve.prot"), "{e}");
        let e = Pool::parse(&format!("[serve]\nallow_origins = \"x\"\n{worker}"), "pool.toml").unwrap_err().to_string();
        assert!(e.contains("serve.allow_origins") && e.contains("a list of strings"), "{e}");
        let e = Pool::parse(&format!("[serve]\nport = 70000\n{worker}"), "pool.toml").unwrap_err().to_string();
        assert!(e.contains("out of range"), "{e}");
    }

    const GOOD: &str = r#"
max_steps = 4
[budget]
max_calls = 10
max_cost_usd = 0.5

[[worker]]
name = "gpt"
provider = "openai"
model = "gpt-5"
base_url = "http://127.0.0.1:8080/v1/"
api_key_env = "OPENAI_API_KEY"
max_tokens = 4096
temperature = 0.2
price_in = 1.25
price_out = 10.0
description = "strong at math"

[[worker]]
name = "claude"
provider = "anthropic"
model = "claude-sonnet-4-5"
thinking_budget = 2048

[[worker]]
name = "local"
provider = "openai-compatible"
model = "llama3"
base_url = "http://localhost:11434/v1"
"#;

    #[test]
    fn parses_the_documented_format() {
        let pool = Pool::parse(GOOD, "pool.toml").expect("valid");
        assert_eq!(pool.workers.len(), 3);
        assert_eq!(pool.options.max_steps, 4);
        assert_eq!(pool.options.budget.max_calls, Some(10));
        let gpt = &pool.workers[0];
        assert_eq!(gpt.effective_base_url(), "http://127.0.0.1:8080/v1");
        assert_eq!(gpt.pricing(), Pricing::Pool(Price { input: 1.25, output: 10.0, cached_input: None }));
        assert_eq!(pool.workers[1].effective_base_url(), "https://api.anthropic.com");
        assert!(matches!(pool.workers[1].pricing(), Pricing::Data { .. }), "claude-sonnet-4-5 is in the price data");
        assert_eq!(pool.workers[2].pricing(), Pricing::Unknown);
    }

    fn error(text: &str) -> String {
        Pool::parse(text, "pool.toml").expect_err("invalid").to_string()
    }

    #[test]
    fn errors_name_file_line_worker_and_field() {
        let bad_provider = GOOD.replace("provider = \"anthropic\"", "provider = \"antropic\"");
        assert_eq!(
            error(&bad_provider),
            "pool.toml:19: worker 1 (\"claude\"): field `provider`: unknown provider \"antropic\"; expected one of openai, anthropic, gemini, openai-compatible, local"
        );
        let unknown = GOOD.replace("thinking_budget = 2048", "thinking_budgt = 2048");
        assert!(
            error(&unknown).starts_with("pool.toml:19: worker 1 (\"claude\"): field `thinking_budgt`: unknown field")
        );
        let missing = GOOD.replace("model = \"llama3\"\n", "");
        assert_eq!(
            error(&missing),
            "pool.toml:25: worker 2 (\"local\"): field `model`: missing; every worker needs one"
        );
        let bad_url = GOOD.replace("http://localhost:11434/v1", "localhost:11434");
        assert!(error(&bad_url).contains("worker 2 (\"local\"): field `base_url`:"), "{}", error(&bad_url));
        let bad_type = GOOD.replace("max_tokens = 4096", "max_tokens = \"many\"");
        assert!(error(&bad_type).contains("field `max_tokens`: expected a whole number, found string"));
        assert!(error("[[worker]\nname=1").starts_with("pool.toml:1: "), "{}", error("[[worker]\nname=1"));
        assert!(error("").contains("no workers"));
        assert!(
            error("max_step = 3\n[[worker]]\nname='a'\nprovider='openai'\nmodel='m'")
                .contains("field `max_step`: unknown setting")
        );
        let dup = GOOD.replace("name = \"claude\"", "name = \"gpt\"");
        assert!(error(&dup).contains("names must be unique"));
        let pasted_key = GOOD.replace("api_key_env = \"OPENAI_API_KEY\"", "api_key_env = \"sk-proj-abc123-secret\"");
        assert!(error(&pasted_key).contains("field `api_key_env`: must be the NAME"), "{}", error(&pasted_key));
        assert!(!error(&pasted_key).contains("secret"), "the value is never echoed");
        // Keys made only of letters, digits and _ (Mistral's, Groq's) are refused too.
        for key in ["k3Hq9ZtLw2Xv8RbN4mYp7CdF1sGj6TaE", "gsk_w8Yq2Lr5Tn9Kv3Xb7Mz1Pc4Hd6Fs0Ja"] {
            let pasted = GOOD.replace("api_key_env = \"OPENAI_API_KEY\"", &format!("api_key_env = \"{key}\""));
            assert!(error(&pasted).contains("field `api_key_env`: must be the NAME"), "{}", error(&pasted));
            assert!(!error(&pasted).contains(key), "the value is never echoed");
        }
        for name in ["OPENAI_API_KEY", "MISTRAL_API_KEY_2024", "my_key", "groq_key_2"] {
            let named = GOOD.replace("api_key_env = \"OPENAI_API_KEY\"", &format!("api_key_env = \"{name}\""));
            assert!(Pool::parse(&named, "pool.toml").is_ok(), "{name} is a name");
        }
        let low = GOOD.replace("thinking_budget = 2048", "thinking_budget = 512");
        assert!(error(&low).contains("field `thinking_budget`: 512 is below Anthropic's minimum"), "{}", error(&low));
        let no_url = GOOD.replace("base_url = \"http://localhost:11434/v1\"\n", "");
        assert!(error(&no_url).contains("field `base_url`: missing"));
    }

    #[test]
    fn the_conductor_table_names_a_local_model_or_a_server() {
        let remote =
            format!("{GOOD}\n[conductor]\nurl = \"http://gpu:8000/v1\"\nmodel = \"qwen\"\ngrammar = \"llama.cpp\"\n");
        let spec = Pool::parse(&remote, "pool.toml").expect("valid").options.conductor;
        assert_eq!(spec.url.as_deref(), Some("http://gpu:8000/v1"));
        assert_eq!(spec.grammar, Some(ServerGrammar::LlamaCpp));
        let none = remote.replace("\"llama.cpp\"", "\"none\"");
        assert_eq!(Pool::parse(&none, "pool.toml").expect("valid").options.conductor.grammar, None);
        let unknown = remote.replace("\"llama.cpp\"", "\"ollama\"");
        assert!(
            error(&unknown)
                .contains("field `conductor.grammar`: \"ollama\"; expected one of vllm, sglang, llama.cpp, or none"),
            "{}",
            error(&unknown)
        );
        let local = format!("{GOOD}\n[conductor]\nmodel = \"/m/q.gguf\"\ngrammar = \"vllm\"\n");
        assert!(error(&local).contains("only applies to a remote conductor"), "{}", error(&local));
        let nameless = format!("{GOOD}\n[conductor]\nurl = \"http://gpu:8000/v1\"\n");
        assert!(error(&nameless).contains("field `conductor.model`: missing"), "{}", error(&nameless));
    }
}

//! The worker pool: a TOML file of `[[worker]]` tables plus run-wide options.
//!
//! Workers are numbered in file order; the conductor knows them only as "Model 0", "Model 1", …
//! Every mistake in the file is reported with the file, the line, the worker and the field.
//!
//! The file's format is defined here once, for every reader and writer: `pool/format.rs` holds
//! its serde types, [`Pool::parse`] (`pool/read.rs`) reads and checks them, and [`edit`]
//! rewrites a file for the app's settings forms, keeping what they do not show.
//!
//! A [`Pool`] also holds what it learned of its workers ([`Pool::learned`]), which comes from
//! the history, never from the file.

pub mod edit;
mod format;
mod read;

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use baton_plan::DEFAULT_MAX_STEPS;
use baton_providers::{ModelSettings, ProviderKind, RetryPolicy, ServerGrammar};
use serde::{Deserialize, Serialize};

use crate::learned::Measured;
use crate::prices::{self, Price, Pricing};

// The caps are the ledger's type (the pool file only sets them); kept here under its old path.
pub use crate::accounting::Budget;
pub use read::is_env_var_name;

/// A pool file, parsed and checked, and what the pool learned of its workers.
#[derive(Debug, Clone, PartialEq)]
pub struct Pool {
    pub workers: Vec<WorkerSpec>,
    pub options: PoolOptions,
    /// What the pool learned of its workers (`baton pool learn`): filled from the history's
    /// profiles when a run is built, never read from the pool file, and empty until then.
    /// Routing, the fallback worker and the conductor's prompt read it.
    pub learned: Measured,
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
    /// Requests that may wait for a run slot.
    pub max_queued_runs: Option<usize>,
    /// The most the server spends in a day (UTC), all requests together.
    pub daily_max_cost_usd: Option<f64>,
}

/// When the conductor's plan for a question cannot be used (it failed, loops, copies an
/// example, or keeps the question from the workers), it is asked once more, and then (or when
/// the run's caps leave no room for a second attempt) the question goes to one worker alone.
/// See [`crate::plan_check`] and [`crate::fallback`]; what the pool learned may also route a
/// question to one worker ([`crate::routing`]).
#[derive(Debug, Clone, PartialEq)]
pub struct FallbackOptions {
    /// Off: the conductor's plan runs as written, and a plan that fails fails the run.
    pub enabled: bool,
    /// `[conductor] fallback_worker`: the worker that answers alone, when the pool names one.
    /// It is the user's choice, which what was learned does not replace: it turns routing by
    /// measurement off (with `route = "always"`, every question goes to it). Else
    /// [`crate::fallback::fallback_worker`] chooses by what the pool learned ([`Pool::learned`]).
    pub worker: Option<usize>,
    /// When a question goes straight to the worker its kind's profile names, with no plan.
    pub route: Route,
}

/// `[conductor] route`: when the learned profile, not the conductor, picks the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ts_rs::TS)]
#[serde(rename_all = "lowercase")]
pub enum Route {
    /// When the profile names one worker by a clear margin for the question's kind; else the
    /// conductor plans.
    #[default]
    Auto,
    /// Always: the lookup router, one call and no plan (the best worker overall where the
    /// question's kind is unknown). Needs no conductor.
    Always,
    /// Never: the conductor plans every question.
    Never,
}

impl Route {
    pub fn parse(text: &str) -> Option<Route> {
        match text {
            "auto" => Some(Route::Auto),
            "always" => Some(Route::Always),
            "never" => Some(Route::Never),
            _ => None,
        }
    }
}

impl Default for FallbackOptions {
    fn default() -> Self {
        FallbackOptions { enabled: true, worker: None, route: Route::default() }
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
    pub device: Device,
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

impl ConductorSpec {
    /// Whether it names a model that writes plans (a local path or an endpoint); a pool
    /// without one routes every question or cannot plan.
    pub fn is_set(&self) -> bool {
        self.model.is_some() || self.url.is_some()
    }

    /// What defines the plans this conductor writes, as one line: the model (local path, or
    /// endpoint and model), the prompt's version and the settings that shape a plan. The
    /// measured figures of its plans (`baton pool learn`) are kept under this; a conductor whose
    /// identity changes has to be learned again. Temperature is not part of it (learning
    /// samples at its own), nor are device, time limits and key.
    pub fn identity(&self) -> String {
        let model = match (&self.url, &self.model) {
            (Some(url), model) => format!("remote {url} {}", model.as_deref().unwrap_or_default()),
            (None, model) => format!("local {}", model.as_deref().unwrap_or_default()),
        };
        let optional = [
            ("prompt", self.prompt.clone()),
            ("lora", self.lora.clone()),
            ("chat_template", self.chat_template.clone()),
            ("isq", self.isq.clone()),
            ("dtype", self.dtype.clone()),
            ("max_reasoning_chars", self.max_reasoning_chars.map(|n| n.to_string())),
            ("max_subtask_chars", self.max_subtask_chars.map(|n| n.to_string())),
        ];
        let mut parts = vec![model];
        parts.extend(optional.into_iter().filter_map(|(key, value)| Some(format!("{key}={}", value?))));
        parts.join(" ")
    }
}

/// Where local models run (`[conductor] device`): the conductor, when it is a local model, and
/// the pool's `local` workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    /// The GPU when Baton is built for one, else the CPU.
    #[default]
    Auto,
    /// The CPU, whatever the machine has.
    Cpu,
}

impl Device {
    /// The device a pool file's `device` names; `None` for a name that is not one.
    pub fn from_name(name: &str) -> Option<Device> {
        match name {
            "auto" => Some(Device::Auto),
            "cpu" => Some(Device::Cpu),
            _ => None,
        }
    }

    /// The name the pool file uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Device::Auto => "auto",
            Device::Cpu => "cpu",
        }
    }

    /// Whether local models must run on the CPU whatever the machine has (the front ends add
    /// their own `--cpu`).
    pub fn forces_cpu(self) -> bool {
        self == Device::Cpu
    }
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

    /// What defines this worker's answers, as one line: provider, model, endpoint and the
    /// settings that shape what it writes. Its learned profile is kept under this; a worker
    /// whose identity changes (another model, a new temperature) has to be learned again.
    /// Name, key, prices, time limits and description are not part of it.
    pub fn identity(&self) -> String {
        let mut parts = vec![self.provider.to_string(), self.model.clone(), self.effective_base_url().to_owned()];
        parts.push(format!("max_tokens={}", self.max_tokens));
        let optional = [
            ("temperature", self.temperature.map(|t| t.to_string())),
            ("top_p", self.top_p.map(|t| t.to_string())),
            ("reasoning_effort", self.reasoning_effort.clone()),
            ("thinking_budget", self.thinking_budget.map(|t| t.to_string())),
        ];
        parts.extend(optional.into_iter().filter_map(|(key, value)| Some(format!("{key}={}", value?))));
        parts.join(" ")
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

/// What the conductor and the UI may know of a pool: no URLs, no key names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ts_rs::TS)]
pub struct WorkerInfo {
    pub index: usize,
    pub name: String,
    pub provider: ProviderKind,
    pub model: String,
    pub description: Option<String>,
}

impl Pool {
    /// The workers as the conductor is told of them: each one's description, then what the
    /// pool learned of it ([`Measured::strengths`], in [`Pool::learned`]). Measured figures say
    /// more than a line of description; they change only when the pool learns again, so every
    /// question shares them and a local conductor's prefix cache keeps serving them.
    pub fn conductor_infos(&self) -> Vec<WorkerInfo> {
        let strengths = &self.learned.strengths;
        let mut infos = self.infos();
        for info in &mut infos {
            if let Some(learned) = strengths.get(&info.index) {
                let described = info.description.as_deref().map(str::trim).filter(|d| !d.is_empty());
                info.description = Some(match described {
                    Some(d) if d.ends_with(['.', '!', '?']) => format!("{d} {learned}"),
                    Some(d) => format!("{d}. {learned}"),
                    None => learned.clone(),
                });
            }
        }
        infos
    }

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

//! Reading a pool file: TOML into the serde types of `format.rs`, then the checks that need
//! more than one value, into a [`Pool`].

use std::path::Path;
use std::time::Duration;

use baton_providers::{ProviderKind, ServerGrammar};

use super::format::{self, Bounds, ConductorFile, FieldError, Number, PoolFile, Text, WorkerFile};
use super::{ConductorSpec, Device, Pool, PoolError, PoolOptions, Route, WorkerSpec};
use crate::learned::Measured;

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

        let raw: PoolFile = format::read(&table, "unknown setting")
            .map_err(|e| err(None, None, (!e.field.is_empty()).then_some(e.field.as_str()), e.message))?;

        let mut options = PoolOptions::default();
        if let Some(n) = raw.max_steps {
            options.max_steps = n.0 as usize;
        }
        if let Some(b) = raw.show_question {
            options.show_question = b.0;
        }
        if let Some(b) = raw.question_to_answer_step {
            options.question_to_answer_step = b.0;
        }
        if let Some(n) = raw.max_concurrency_per_provider {
            options.max_concurrency_per_provider = n.0 as usize;
        }
        if let Some(b) = raw.budget {
            options.budget.max_calls = b.max_calls.map(|n| n.0 as u32);
            options.budget.max_tokens = b.max_tokens.map(|n| n.0 as u64);
            options.budget.max_cost_usd = b.max_cost_usd.map(|x| x.0);
        }
        if let Some(r) = raw.retry {
            if let Some(n) = r.max_retries {
                options.retry.max_retries = n.0 as u32;
            }
            if let Some(n) = r.initial_delay_ms {
                options.retry.initial_delay = Duration::from_millis(n.0 as u64);
            }
            if let Some(n) = r.max_delay_ms {
                options.retry.max_delay = Duration::from_millis(n.0 as u64);
            }
            if let Some(n) = r.max_retry_after_secs {
                options.retry.max_retry_after = Duration::from_secs(n.0 as u64);
            }
        }
        if let Some(r) = raw.recursion {
            if let Some(b) = r.enabled {
                options.recursion.enabled = b.0;
            }
            if let Some(n) = r.max_depth {
                options.recursion.max_depth = n.0 as u32;
            }
            options.recursion.max_total_steps = r.max_total_steps.map(|n| n.0 as usize);
        }
        if let Some(s) = raw.serve {
            options.serve.app = s.app.is_some_and(|b| b.0);
            options.serve.host = s.host.map(|t| t.0);
            options.serve.port = s.port.map(|n| n.0 as u16);
            options.serve.token_env = s.token_env.map(|t| t.0);
            options.serve.allow_origins = s.allow_origins.map(|t| t.0).unwrap_or_default();
            options.serve.max_concurrent_runs = s.max_concurrent_runs.map(|n| n.0 as usize);
            options.serve.max_queued_runs = s.max_queued_runs.map(|n| n.0 as usize);
            options.serve.daily_max_cost_usd = s.daily_max_cost_usd.map(|x| x.0);
        }

        let mut fallback_worker: Option<String> = None;
        if let Some(c) = raw.conductor {
            if let Some(b) = &c.fallback {
                options.fallback.enabled = b.0;
            }
            fallback_worker = c.fallback_worker.as_ref().map(|t| t.0.clone());
            if let Some(t) = &c.route {
                options.fallback.route = Route::parse(&t.0).ok_or_else(|| {
                    err(None, None, Some("conductor.route"), format!("\"{}\" is not auto, always or never", t.0))
                })?;
            }
            options.conductor =
                conductor(c).map_err(|e| err(None, None, Some(&format!("conductor.{}", e.field)), e.message))?;
        }

        let raw_workers = raw.worker.map(|w| w.0).unwrap_or_default();
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
        }
        Ok(Pool { workers, options, learned: Measured::default() })
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

fn string(value: Option<Text>) -> Option<String> {
    value.map(|t| t.0)
}

fn number<B: Bounds>(value: Option<Number<B>>) -> Option<f64> {
    value.map(|x| x.0)
}

/// The `[conductor]` table's checks that need more than one value; errors name the field
/// inside the table.
fn conductor(c: ConductorFile) -> Result<ConductorSpec, FieldError> {
    let model = string(c.model);
    let url = match string(c.url) {
        Some(u) => Some(check_url(&u).map_err(|message| FieldError { field: "url".into(), message })?),
        None => None,
    };
    if url.is_some() && model.is_none() {
        return Err(FieldError {
            field: "model".into(),
            message: "missing; a remote conductor needs the model name the server serves".into(),
        });
    }
    let api_key_env = string(c.api_key_env);
    if let Some(var) = &api_key_env
        && !is_env_var_name(var)
    {
        return Err(FieldError {
            field: "api_key_env".into(),
            message: "must be the NAME of an environment variable, not the key itself".into(),
        });
    }
    let grammar = match string(c.grammar) {
        None => None,
        Some(name) if name == "none" => None,
        Some(name) => Some(ServerGrammar::parse(&name).ok_or_else(|| FieldError {
            field: "grammar".into(),
            message: format!(
                "\"{name}\"; expected one of {}, or none (plans are then parsed and retried once)",
                ServerGrammar::NAMES.join(", ")
            ),
        })?),
    };
    if grammar.is_some() && url.is_none() {
        return Err(FieldError {
            field: "grammar".into(),
            message: "only applies to a remote conductor (url); a local conductor is always held to the plan grammar"
                .into(),
        });
    }
    let device = match string(c.device) {
        None => Device::default(),
        Some(d) => Device::from_name(&d).ok_or_else(|| FieldError {
            field: "device".into(),
            message: format!("\"{d}\"; expected auto (the GPU when Baton is built for one) or cpu"),
        })?,
    };
    Ok(ConductorSpec {
        model,
        url,
        api_key_env,
        grammar,
        lora: string(c.lora),
        chat_template: string(c.chat_template),
        device,
        isq: string(c.isq),
        dtype: string(c.dtype),
        temperature: number(c.temperature),
        max_reasoning_chars: c.max_reasoning_chars.map(|n| n.0 as usize),
        max_subtask_chars: c.max_subtask_chars.map(|n| n.0 as usize),
        plan_time_limit_secs: c.plan_time_limit_secs.map(|n| n.0 as u64),
        timeout_secs: c.timeout_secs.map(|n| n.0 as u64),
        prompt: string(c.prompt),
    })
}

/// `name`, `provider` and `model`: present and not blank.
fn required(field: &'static str, value: Option<Text>) -> Result<String, FieldError> {
    match value {
        Some(Text(s)) if !s.trim().is_empty() => Ok(s),
        Some(_) => Err(FieldError { field: field.into(), message: "must not be empty".into() }),
        None => Err(FieldError { field: field.into(), message: "missing; every worker needs one".into() }),
    }
}

fn worker(t: &toml::Table) -> Result<WorkerSpec, FieldError> {
    let w: WorkerFile = format::read(t, "unknown field")?;
    let name = required("name", w.name)?;
    let provider_name = required("provider", w.provider)?;
    let provider = ProviderKind::ALL.into_iter().find(|k| k.as_str() == provider_name).ok_or_else(|| FieldError {
        field: "provider".into(),
        message: format!(
            "unknown provider \"{provider_name}\"; expected one of {}",
            ProviderKind::ALL.map(|k| k.as_str()).join(", ")
        ),
    })?;
    let model = required("model", w.model)?;
    let base_url = match string(w.base_url) {
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
    let api_key_env = string(w.api_key_env);
    if let Some(var) = &api_key_env
        && !is_env_var_name(var)
    {
        // Never echo the value: a key pasted here by mistake must not reach the terminal.
        return Err(FieldError {
            field: "api_key_env".into(),
            message: "must be the NAME of an environment variable (letters, digits and _, e.g. OPENAI_API_KEY), not the key itself".into(),
        });
    }
    let reasoning_effort = string(w.reasoning_effort);
    if let Some(effort) = &reasoning_effort
        && !["minimal", "low", "medium", "high"].contains(&effort.as_str())
    {
        return Err(FieldError {
            field: "reasoning_effort".into(),
            message: format!("\"{effort}\"; expected minimal, low, medium or high"),
        });
    }
    let thinking_budget = w.thinking_budget.map(|n| n.0 as u32);
    if provider == ProviderKind::Anthropic
        && let Some(budget) = thinking_budget
        && budget < 1024
    {
        return Err(FieldError {
            field: "thinking_budget".into(),
            message: format!("{budget} is below Anthropic's minimum of 1024 tokens"),
        });
    }
    let price_in = number(w.price_in);
    let price_out = number(w.price_out);
    let price_cached_in = number(w.price_cached_in);
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
        max_tokens: w.max_tokens.map_or(4096, |n| n.0 as u32),
        temperature: number(w.temperature).map(|x| x as f32),
        top_p: number(w.top_p).map(|x| x as f32),
        reasoning_effort,
        thinking_budget,
        stream: w.stream.is_none_or(|b| b.0),
        timeout: Duration::from_secs(w.timeout_secs.map_or(300, |n| n.0 as u64)),
        idle_timeout: Duration::from_secs(w.idle_timeout_secs.map_or(120, |n| n.0 as u64)),
        price_in,
        price_out,
        price_cached_in,
        prompt_cache: w.prompt_cache.is_none_or(|b| b.0),
        description: string(w.description),
    })
}

/// A portable environment variable name, and not a key pasted in its place. Keys with dashes
/// (`sk-…`, `AIza…`) never match; keys of letters, digits and `_` only (Mistral's, Groq's
/// `gsk_…`) are long runs mixing lower-case letters and digits, which names are not.
pub fn is_env_var_name(name: &str) -> bool {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prices::{Price, Pricing};

    #[test]
    fn the_serve_table_is_read_and_checked() {
        let pool = Pool::parse(
            "[serve]\napp = true\nhost = \"0.0.0.0\"\nport = 9000\ntoken_env = \"T\"\nallow_origins = [\"http://localhost:3000\"]\nmax_concurrent_runs = 2\nmax_queued_runs = 0\ndaily_max_cost_usd = 5\n\n[[worker]]\nname = \"a\"\nprovider = \"openai\"\nmodel = \"m\"\n",
            "pool.toml",
        )
        .expect("parses");
        let s = &pool.options.serve;
        assert_eq!((s.host.as_deref(), s.port, s.token_env.as_deref()), (Some("0.0.0.0"), Some(9000), Some("T")));
        assert_eq!(s.allow_origins, ["http://localhost:3000"]);
        assert_eq!((s.max_concurrent_runs, s.daily_max_cost_usd, s.app), (Some(2), Some(5.0), true));
        assert_eq!(s.max_queued_runs, Some(0), "a server that refuses rather than queues");
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
        // Every number has a range with two ends, named in the error.
        for (table, field, says) in [
            ("[serve]\ndaily_max_cost_usd = 0", "serve.daily_max_cost_usd", "above 0 and at most 1000000"),
            ("[serve]\ndaily_max_cost_usd = nan", "serve.daily_max_cost_usd", "above 0"),
            ("[serve]\ndaily_max_cost_usd = inf", "serve.daily_max_cost_usd", "at most 1000000"),
            ("[budget]\nmax_cost_usd = -1.0", "budget.max_cost_usd", "above 0"),
            ("[conductor]\ntemperature = 3.0", "conductor.temperature", "at least 0 and at most 2"),
        ] {
            let e = Pool::parse(&format!("{table}\n{worker}"), "pool.toml").unwrap_err().to_string();
            assert!(e.contains(field) && e.contains(says), "{table}: {e}");
        }
        for (line, field, says) in [
            ("price_in = 1e9\nprice_out = 1.0", "price_in", "at most 10000"),
            ("price_in = 1.0\nprice_out = -2.0", "price_out", "at least 0"),
            ("temperature = 2.5", "temperature", "at most 2"),
            ("top_p = 1.5", "top_p", "at most 1"),
        ] {
            let e = Pool::parse(&format!("{worker}{line}\n"), "pool.toml").unwrap_err().to_string();
            assert!(e.contains(field) && e.contains(says), "{line}: {e}");
        }
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

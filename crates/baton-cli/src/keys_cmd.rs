//! `baton keys`: store, list and delete provider API keys in the OS keychain.
//!
//! A key is never taken as an argument (it would land in shell history and in `ps`), never
//! printed, and never written anywhere but the keychain; listings show at most its last four
//! characters.

use std::io::{IsTerminal, Read};

use baton_engine::Pool;
use baton_providers::ProviderKind;
use baton_secrets::{KeyStore, SecretsError};
use serde_json::json;

use crate::{Failure, Outcome, PoolArg};

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Store a provider's key; it is read from stdin when piped, otherwise typed without echo.
    Set(Target),
    /// Show which keys are stored (with their last four characters) and which the pool overrides.
    List {
        #[command(flatten)]
        pool: PoolArg,
        /// One JSON object per key on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Remove a provider's key from the keychain.
    Delete(Target),
    /// Allow the key in an environment variable that a pool names (`api_key_env`) to be sent to
    /// a server. OPENAI_API_KEY, ANTHROPIC_API_KEY and GEMINI_API_KEY go to their provider's
    /// official host without asking; any other pairing needs this, once.
    AllowEnv(EnvPairing),
    /// Withdraw what `allow-env` allowed.
    ForbidEnv(EnvPairing),
}

/// An environment variable and the server its key would go to.
#[derive(Debug, clap::Args)]
pub struct EnvPairing {
    /// The variable's name, as the pool's api_key_env gives it.
    #[arg(value_name = "VAR")]
    var: String,
    /// The server's URL; its scheme, host and port are what is allowed.
    #[arg(value_name = "URL")]
    url: String,
}

impl EnvPairing {
    /// The variable and the origin its key may go to, or why they name none.
    fn checked(&self) -> Result<(&str, String), Failure> {
        if !baton_engine::pool::is_env_var_name(&self.var) {
            return Err(Failure::BadInput(
                "VAR must be the NAME of an environment variable (letters, digits and _), not a key".to_owned(),
            ));
        }
        let origin = baton_secrets::origin(&self.url)
            .ok_or_else(|| Failure::BadInput(format!("\"{}\" is not an http:// or https:// URL", self.url)))?;
        Ok((&self.var, origin))
    }
}

/// Whose key: a provider, and for OpenAI-compatible servers the server.
#[derive(Debug, clap::Args)]
pub struct Target {
    /// openai, anthropic, gemini or openai-compatible (also `PROVIDER:URL`); huggingface for a
    /// hub access token (gated models).
    #[arg(value_name = "PROVIDER")]
    provider: String,
    /// The server's base URL: each OpenAI-compatible server has its own key, and so does a
    /// hosted provider pointed at any host but its official one.
    #[arg(long, value_name = "URL")]
    base_url: Option<String>,
}

/// Refuses input bigger than any real key: a misdirected file should not end up in the keychain.
const MAX_KEY_BYTES: u64 = 16 * 1024;

pub async fn run(cmd: Command) -> Outcome {
    match cmd {
        Command::Set(target) => {
            let account = target.account()?;
            let store = open()?;
            let key = read_key(&account)?;
            store.set(&account, &key).map_err(failed)?;
            match baton_secrets::last4(&key) {
                Some(end) => println!("stored the {account} key (…{end})"),
                None => println!("stored the {account} key"),
            }
            Ok(())
        }
        Command::List { pool, json } => list(&pool, json),
        Command::AllowEnv(pairing) => {
            let (var, origin) = pairing.checked()?;
            if baton_secrets::is_well_known_pairing(var, &origin) {
                println!("${var} already goes to {origin}, its provider's official host; nothing to allow");
                return Ok(());
            }
            open()?.allow_env(var, &origin).map_err(failed)?;
            println!("allowed: a pool's api_key_env = \"{var}\" may now send ${var} to {origin}");
            Ok(())
        }
        Command::ForbidEnv(pairing) => {
            let (var, origin) = pairing.checked()?;
            if open()?.forbid_env(var, &origin).map_err(failed)? {
                println!("${var} may no longer be sent to {origin}");
            } else {
                println!("${var} was not allowed to go to {origin}; nothing changed");
            }
            Ok(())
        }
        Command::Delete(target) => {
            let account = target.account()?;
            if open()?.delete(&account).map_err(failed)? {
                println!("deleted the {account} key");
            } else {
                println!("no {account} key was stored");
            }
            Ok(())
        }
    }
}

impl Target {
    /// The keychain account this target names, or why it names none.
    fn account(&self) -> Result<String, Failure> {
        let (name, url) = match self.provider.split_once(':') {
            Some((name, url)) if name == "huggingface" || ProviderKind::ALL.iter().any(|p| p.as_str() == name) => {
                if self.base_url.is_some() {
                    return Err(Failure::BadInput(format!(
                        "give the server's URL once: either {name}:URL or --base-url URL"
                    )));
                }
                (name, Some(url))
            }
            _ => (self.provider.as_str(), self.base_url.as_deref()),
        };
        if name == "huggingface" {
            // A Hugging Face access token, for gated models: kept for the hub it was saved for
            // (`--base-url` names a mirror, as HF_ENDPOINT does for `baton models pull`).
            return Ok(baton_models::token_account(url.unwrap_or("https://huggingface.co")));
        }
        let provider = ProviderKind::ALL.into_iter().find(|p| p.as_str() == name).ok_or_else(|| {
            Failure::BadInput(format!(
                "unknown provider \"{name}\"; valid providers: openai, anthropic, gemini, openai-compatible (with --base-url URL), and huggingface (a hub token for gated models)"
            ))
        })?;
        let url = url.map(|u| u.trim().trim_end_matches('/')).filter(|u| !u.is_empty());
        match provider {
            ProviderKind::Local => Err(Failure::BadInput("local models run inside Baton and take no key".to_owned())),
            ProviderKind::OpenAiCompatible if url.is_none() => Err(Failure::BadInput(
                "each OpenAI-compatible server has its own key: give its --base-url URL".to_owned(),
            )),
            _ => Ok(baton_secrets::account(provider, url)),
        }
    }
}

fn open() -> Result<KeyStore, Failure> {
    KeyStore::open().map_err(failed)
}

fn failed(e: SecretsError) -> Failure {
    Failure::Failed(e.to_string())
}

/// The key from stdin when it is piped (so scripts and password managers can feed it), else
/// typed at a prompt that does not echo. Error messages never include what was read.
fn read_key(account: &str) -> Result<String, Failure> {
    let stdin = std::io::stdin();
    let raw = if stdin.is_terminal() {
        rpassword::prompt_password(format!("{account} key (not shown): "))
            .map_err(|e| Failure::Failed(format!("cannot read the key from the terminal: {e}")))?
    } else {
        let mut raw = String::new();
        stdin
            .lock()
            .take(MAX_KEY_BYTES + 1)
            .read_to_string(&mut raw)
            .map_err(|e| Failure::BadInput(format!("cannot read the key from stdin: {e}")))?;
        if raw.len() as u64 > MAX_KEY_BYTES {
            return Err(Failure::BadInput(format!("stdin holds more than {MAX_KEY_BYTES} bytes; that is not a key")));
        }
        raw
    };
    let key = raw.trim();
    if key.is_empty() {
        return Err(Failure::BadInput(format!("no key given; the {account} key was left as it was")));
    }
    if key.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(Failure::BadInput(
            "the key contains spaces or line breaks; give just the key, on one line".to_owned(),
        ));
    }
    Ok(key.to_owned())
}

/// A pool worker whose environment variable is used instead of the keychain entry.
struct Override {
    account: String,
    worker: String,
    var: String,
    /// Whether the variable may go to the worker's server (see `allow-env`).
    allowed: Result<(), baton_engine::keys::KeyNotAllowed>,
}

fn list(pool: &PoolArg, json: bool) -> Outcome {
    let path = pool.path();
    // Listing keys should work before any pool exists; an existing but broken pool is still an
    // error, since its overrides would be silently missing.
    let pool = if path.exists() { Some(pool.load()?) } else { None };
    let (accounts, overrides) = accounts(pool.as_ref());
    let statuses = open()?.list(&accounts).map_err(failed)?;
    let width = accounts.iter().map(|a| a.chars().count()).max().unwrap_or(0);
    for status in statuses {
        let overridden: Vec<&Override> = overrides.iter().filter(|o| o.account == status.account).collect();
        if json {
            let by: Vec<_> = overridden
                .iter()
                .map(|o| {
                    json!({
                        "worker": o.worker,
                        "env": o.var,
                        "env_set": std::env::var_os(&o.var).is_some(),
                        "env_allowed": o.allowed.is_ok(),
                    })
                })
                .collect();
            let line = json!({
                "account": status.account,
                "stored": status.stored,
                "last4": status.last4,
                "overridden_by": by,
            });
            println!("{}", crate::json::line(&line));
            continue;
        }
        let mut text = match (status.stored, &status.last4) {
            (true, Some(end)) => format!("stored (…{end})"),
            (true, None) => "stored".to_owned(),
            (false, _) => "not stored".to_owned(),
        };
        for o in overridden {
            let set = if std::env::var_os(&o.var).is_some() { "set" } else { "not set in this shell" };
            let allowed = match &o.allowed {
                Ok(()) => String::new(),
                Err(refused) => format!(
                    ", not allowed to go to {}: `baton keys allow-env {} {}`",
                    refused.origin, refused.var, refused.origin
                ),
            };
            text.push_str(&format!("; worker \"{}\" uses ${} instead ({set}{allowed})", o.worker, o.var));
        }
        println!("{:width$}  {text}", status.account);
    }
    Ok(())
}

/// Every account worth showing: the providers with one key each, then each OpenAI-compatible
/// server in the pool; and the workers whose `api_key_env` overrides an account.
fn accounts(pool: Option<&Pool>) -> (Vec<String>, Vec<Override>) {
    let mut accounts: Vec<String> = baton_secrets::KEYED_PROVIDERS.iter().map(|p| p.as_str().to_owned()).collect();
    let mut overrides = Vec::new();
    for w in pool.map(|p| p.workers.as_slice()).unwrap_or_default() {
        if w.provider == ProviderKind::Local {
            continue;
        }
        let account = baton_secrets::account(w.provider, w.base_url.as_deref());
        if !accounts.contains(&account) {
            accounts.push(account.clone());
        }
        if let Some(var) = &w.api_key_env {
            let allowed = baton_engine::keys::check_env_key(var, w.effective_base_url(), &w.name);
            overrides.push(Override { account, worker: w.name.clone(), var: var.clone(), allowed });
        }
    }
    (accounts, overrides)
}

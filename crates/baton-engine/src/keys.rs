//! Where a worker's API key comes from when a request is built, and where it may go.
//!
//! The environment variable the pool names (`api_key_env`) wins; without one the key comes from
//! the OS keychain entry for the worker's provider (see [`baton_secrets::account`]). Either way
//! the key is read per request and handed only to the request builder, so a key changed or
//! removed between two requests takes effect at once and none outlives the request.
//!
//! A keychain key is bound to the host it was stored for by its account. A variable's key is
//! bound the same way, by [`check_env_key`]: pool files are shared, and one could otherwise send
//! `AWS_SECRET_ACCESS_KEY` to a server of its author's. The well-known variables go to their
//! provider's official host; any other pairing of variable and host needs the user's consent,
//! given once and kept in the keychain (or, without one, in `BATON_ALLOW_KEY_ENV`).

use std::sync::Arc;

use baton_providers::{ApiKey, ErrorKind, KeySource, ProviderError, ProviderKind};
use baton_secrets::{KeyStore, SecretsError};

use crate::pool::{Pool, WorkerSpec};

/// A pool would send a variable's key to a host the user has not allowed it to go to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{owner} would send the key in the environment variable {var} to {origin}, and you have not \
     allowed that variable to go there. A pool file decides where its variables go, so Baton asks \
     once: if {origin} should get ${var}, run `baton keys allow-env {var} {origin}` (the app asks \
     the same in a dialog){no_keychain}",
    no_keychain = self.keychain.as_ref().map(|cause| format!(
        ". The keychain, where that consent is kept, could not be read ({cause}); without one, \
         export {}=\"{var}={origin}\" instead", baton_secrets::ALLOW_KEY_ENV
    )).unwrap_or_default()
)]
pub struct KeyNotAllowed {
    /// Who sends it: `worker "gpt"`, `the conductor`.
    pub owner: String,
    pub var: String,
    /// Where it would go ([`baton_secrets::origin`]; the URL as written when it has none).
    pub origin: String,
    /// Why the consent could not be looked up, when the keychain failed.
    pub keychain: Option<String>,
}

/// Whether the key in environment variable `var` may be sent to `url` on behalf of `owner`:
/// a well-known variable to its provider's official host, or a pairing the user allowed. Reads
/// the keychain, so it blocks: call it off async workers.
pub fn check_env_key(var: &str, url: &str, owner: &str) -> Result<(), KeyNotAllowed> {
    if baton_secrets::is_well_known_pairing(var, url) {
        return Ok(());
    }
    let refused = |keychain: Option<String>| KeyNotAllowed {
        owner: owner.to_owned(),
        var: var.to_owned(),
        origin: baton_secrets::origin(url).unwrap_or_else(|| url.to_owned()),
        keychain,
    };
    let Some(origin) = baton_secrets::origin(url) else { return Err(refused(None)) };
    if std::env::var(baton_secrets::ALLOW_KEY_ENV)
        .is_ok_and(|allowed| baton_secrets::allowed_by_variable(&allowed, var, &origin))
    {
        return Ok(());
    }
    match KeyStore::open().and_then(|store| store.env_allowed(var, &origin)) {
        Ok(true) => Ok(()),
        Ok(false) => Err(refused(None)),
        Err(e) => Err(refused(Some(e.to_string()))),
    }
}

/// Checks every worker of `pool` whose key comes from a variable (the conductor is checked where
/// its address is known, as it is set up). The first refusal is returned.
pub fn check_pool_env_keys(pool: &Pool) -> Result<(), KeyNotAllowed> {
    for w in &pool.workers {
        if let (Some(var), true) = (&w.api_key_env, w.provider != ProviderKind::Local) {
            check_env_key(var, w.effective_base_url(), &format!("worker \"{}\"", w.name))?;
        }
    }
    Ok(())
}

/// A key source for `spec`, read anew for every request.
pub fn key_source(spec: &WorkerSpec) -> KeySource {
    // A local model takes no key; asking the keychain for one would only fail on machines
    // without a keychain.
    if spec.api_key_env.is_some() || spec.provider == ProviderKind::Local {
        let to = (spec.provider != ProviderKind::Local).then(|| spec.effective_base_url().to_owned());
        return env_key_source(spec.api_key_env.clone(), format!("worker \"{}\"", spec.name), spec.provider, to);
    }
    keychain_key_source(baton_secrets::account(spec.provider, spec.base_url.as_deref()), spec.provider)
}

/// A key read from the keychain entry `account` for every request.
///
/// Without an entry, providers whose key is optional send none. A machine without any keychain
/// cannot have a key stored for a keyless local server either, so that is not an error for
/// them; a locked or failing keychain is, since the key may well be in it.
pub fn keychain_key_source(account: String, provider: ProviderKind) -> KeySource {
    Arc::new(move || match KeyStore::open().and_then(|store| store.get(&account)) {
        Ok(Some(key)) => Ok(Some(key)),
        Ok(None) | Err(SecretsError::NoKeychain { .. }) if provider.key_optional() => Ok(None),
        Ok(None) => Err(ProviderError::new(
            ErrorKind::Auth,
            format!("no {provider} key: run `baton keys set {account}` or set api_key_env in the pool"),
        )),
        Err(e) => Err(ProviderError::new(ErrorKind::Auth, e.to_string())),
    })
}

/// A key read from the environment variable `var` for every request, sent to `to`; `owner`
/// names who needs it in error messages. The pairing of `var` and `to` is checked on every
/// read too ([`check_env_key`]), so no path around the up-front check sends a key astray; `to`
/// is `None` only for a local model, whose key goes nowhere. Without a variable, providers
/// whose key is optional send none.
pub fn env_key_source(var: Option<String>, owner: String, provider: ProviderKind, to: Option<String>) -> KeySource {
    Arc::new(move || match &var {
        Some(var) => {
            if let Some(url) = &to {
                check_env_key(var, url, &owner).map_err(|e| ProviderError::new(ErrorKind::Auth, e.to_string()))?;
            }
            match std::env::var(var) {
                Ok(key) if !key.trim().is_empty() => Ok(Some(ApiKey::new(key.trim()))),
                _ => Err(ProviderError::new(
                    ErrorKind::Auth,
                    format!(
                        "the environment variable {var} (api_key_env of {owner}) is not set; export it with the {provider} key"
                    ),
                )),
            }
        }
        None if provider.key_optional() => Ok(None),
        None => Err(ProviderError::new(
            ErrorKind::Auth,
            format!(
                "{owner} has no key: set api_key_env in the pool to the name of an environment variable holding the {provider} key"
            ),
        )),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Pool;

    #[test]
    fn a_missing_variable_is_a_clear_auth_error() {
        let pool = Pool::parse(
            "[[worker]]\nname = 'local'\nprovider = 'openai-compatible'\nmodel = 'llama'\nbase_url = 'http://127.0.0.1:1/v1'\n",
            "p.toml",
        )
        .expect("valid");
        // No host here: the variable is read whatever the pairing, to show what an unset one says.
        let source =
            env_key_source(Some("BATON_SURELY_UNSET_VAR".into()), "worker \"w\"".into(), ProviderKind::OpenAi, None);
        let e = source().expect_err("unset");
        assert_eq!(e.kind, ErrorKind::Auth);
        assert!(e.message.contains("BATON_SURELY_UNSET_VAR") && e.message.contains("not set"), "{}", e.message);
        assert_eq!(key_source(&pool.workers[0])(), Ok(None), "local servers may need no key");
    }

    #[test]
    fn a_variable_goes_only_to_a_host_it_is_allowed_to() {
        // A documentation address no other test allows: the tests share one keyring.
        let pool = Pool::parse(
            "[[worker]]\nname = 'gpt'\nprovider = 'openai'\nmodel = 'gpt-5'\napi_key_env = 'OPENAI_API_KEY'\n\
             [[worker]]\nname = 'rogue'\nprovider = 'openai'\nmodel = 'gpt-5'\nbase_url = 'http://192.0.2.7:9/v1'\napi_key_env = 'PATH'\n",
            "p.toml",
        )
        .expect("valid");
        // The well-known variable, to its official host: no consent needed, no keychain read.
        assert_eq!(check_env_key("OPENAI_API_KEY", pool.workers[0].effective_base_url(), "worker \"gpt\""), Ok(()));
        // PATH is always set, so only the binding stands between its value and the server.
        let refused = check_pool_env_keys(&pool).expect_err("PATH was never allowed to go to that server");
        assert_eq!((refused.var.as_str(), refused.origin.as_str()), ("PATH", "http://192.0.2.7:9"));
        assert_eq!(refused.owner, "worker \"rogue\"");
        let message = refused.to_string();
        assert!(message.contains("`baton keys allow-env PATH http://192.0.2.7:9`"), "{message}");
        // And a request built some other way is refused as it reads the key.
        let e = key_source(&pool.workers[1])().expect_err("refused per request too");
        assert_eq!(e.kind, ErrorKind::Auth);
        assert!(e.message.contains("allow-env PATH") && !e.message.contains(&std::env::var("PATH").expect("PATH")));
    }

    #[test]
    fn without_api_key_env_a_missing_keychain_key_says_how_to_store_one() {
        // An account nobody has a key under, so that a developer's own keychain (when these
        // tests run outside scripts/test) neither changes the outcome nor gets read for a key.
        let account = format!("baton-unit-test-absent-{}", std::process::id());
        let e = keychain_key_source(account.clone(), ProviderKind::Anthropic)().expect_err("no key stored");
        assert_eq!(e.kind, ErrorKind::Auth);
        // With a keychain: no entry. Without one: the keychain's own explanation. Both point at
        // the environment variable alternative.
        assert!(e.message.contains("api_key_env"), "{}", e.message);
        if e.message.starts_with("no anthropic key") {
            assert!(e.message.contains(&format!("`baton keys set {account}`")), "{}", e.message);
        }
        let keyless = keychain_key_source(account, ProviderKind::OpenAiCompatible)();
        assert!(matches!(keyless, Ok(None)) || keyless.as_ref().is_err_and(|e| e.message.contains("locked")));
    }

    #[test]
    fn the_path_variable_is_read_per_call() {
        // PATH is always set; reading it proves the variable is looked up, not cached.
        let key = env_key_source(Some("PATH".into()), "worker \"w\"".into(), ProviderKind::Gemini, None)()
            .expect("PATH is set")
            .expect("some key");
        assert_eq!(key.expose(), std::env::var("PATH").expect("PATH").trim());
        assert_eq!(format!("{key:?}"), "ApiKey(<redacted>)");
    }
}

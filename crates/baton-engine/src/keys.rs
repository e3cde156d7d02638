//! Where a worker's API key comes from when a request is built.
//!
//! The environment variable the pool names (`api_key_env`) wins; without one the key comes from
//! the OS keychain entry for the worker's provider (see [`baton_secrets::account`]). Either way
//! the key is read per request and handed only to the request builder, so a key changed or
//! removed between two requests takes effect at once and none outlives the request.

use std::sync::Arc;

use baton_providers::{ApiKey, ErrorKind, KeySource, ProviderError, ProviderKind};
use baton_secrets::{KeyStore, SecretsError};

use crate::pool::WorkerSpec;

/// A key source for `spec`, read anew for every request.
pub fn key_source(spec: &WorkerSpec) -> KeySource {
    // A local model takes no key; asking the keychain for one would only fail on machines
    // without a keychain.
    if spec.api_key_env.is_some() || spec.provider == ProviderKind::Local {
        return env_key_source(spec.api_key_env.clone(), format!("worker \"{}\"", spec.name), spec.provider);
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

/// A key read from the environment variable `var` for every request; `owner` names who needs
/// it in error messages. Without a variable, providers whose key is optional send none.
pub fn env_key_source(var: Option<String>, owner: String, provider: ProviderKind) -> KeySource {
    Arc::new(move || match &var {
        Some(var) => match std::env::var(var) {
            Ok(key) if !key.trim().is_empty() => Ok(Some(ApiKey::new(key.trim()))),
            _ => Err(ProviderError::new(
                ErrorKind::Auth,
                format!(
                    "the environment variable {var} (api_key_env of {owner}) is not set; export it with the {provider} key"
                ),
            )),
        },
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
            "[[worker]]\nname = 'gpt'\nprovider = 'openai'\nmodel = 'gpt-5'\napi_key_env = 'BATON_SURELY_UNSET_VAR'\n\
             [[worker]]\nname = 'bare'\nprovider = 'anthropic'\nmodel = 'claude'\n\
             [[worker]]\nname = 'local'\nprovider = 'openai-compatible'\nmodel = 'llama'\nbase_url = 'http://127.0.0.1:1/v1'\n",
            "p.toml",
        )
        .expect("valid");
        let e = key_source(&pool.workers[0])().expect_err("unset");
        assert_eq!(e.kind, ErrorKind::Auth);
        assert!(e.message.contains("BATON_SURELY_UNSET_VAR"), "{}", e.message);
        assert_eq!(key_source(&pool.workers[2])(), Ok(None), "local servers may need no key");
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
        let pool =
            Pool::parse("[[worker]]\nname = 'w'\nprovider = 'gemini'\nmodel = 'g'\napi_key_env = 'PATH'\n", "p.toml")
                .expect("valid");
        let key = key_source(&pool.workers[0])().expect("PATH is set").expect("some key");
        assert_eq!(key.expose(), std::env::var("PATH").expect("PATH").trim());
        assert_eq!(format!("{key:?}"), "ApiKey(<redacted>)");
    }
}

//! Where a worker's API key comes from when a request is built.
//!
//! Today: the environment variable the pool names (`api_key_env`). The OS keychain plugs in
//! here too; either way the key is read per request and handed only to the request builder.

use std::sync::Arc;

use baton_providers::{ApiKey, ErrorKind, KeySource, ProviderError, ProviderKind};

use crate::pool::WorkerSpec;

/// A key source for `spec`, read anew for every request.
pub fn key_source(spec: &WorkerSpec) -> KeySource {
    env_key_source(spec.api_key_env.clone(), format!("worker \"{}\"", spec.name), spec.provider)
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
        let e = key_source(&pool.workers[1])().expect_err("no key configured");
        assert!(e.message.contains("api_key_env"), "{}", e.message);
        assert_eq!(key_source(&pool.workers[2])(), Ok(None), "local servers may need no key");
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

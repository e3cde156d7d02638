//! Where a worker's API key comes from when a request is built.
//!
//! Today: the environment variable the pool names (`api_key_env`). The OS keychain plugs in
//! here too; either way the key is read per request and handed only to the request builder.

use std::sync::Arc;

use baton_providers::{ApiKey, ErrorKind, KeySource, ProviderError};

use crate::pool::WorkerSpec;

/// A key source for `spec`, read anew for every request.
pub fn key_source(spec: &WorkerSpec) -> KeySource {
    let var = spec.api_key_env.clone();
    let name = spec.name.clone();
    let provider = spec.provider;
    Arc::new(move || match &var {
        Some(var) => match std::env::var(var) {
            Ok(key) if !key.trim().is_empty() => Ok(Some(ApiKey::new(key.trim()))),
            _ => Err(ProviderError::new(
                ErrorKind::Auth,
                format!("the environment variable {var} (api_key_env of worker \"{name}\") is not set; export it with the {provider} key"),
            )),
        },
        None if provider.key_optional() => Ok(None),
        None => Err(ProviderError::new(
            ErrorKind::Auth,
            format!(
                "worker \"{name}\" has no key: set api_key_env in the pool to the name of an environment variable holding the {provider} key"
            ),
        )),
    })
}

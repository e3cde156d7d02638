//! Provider keys in the OS keychain. A key goes from the masked field straight into the
//! keychain; what comes back to the window is whether one is stored and its last 4 characters.

use baton_providers::ProviderKind;
use baton_secrets::KeyStore;
use serde::Serialize;
use tauri::State;

use crate::error::{AppError, AppResult};
use crate::state::AppState;

/// One keychain entry the pool needs.
#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct KeyRow {
    /// The keychain account (`openai`, `openai-compatible:<url>`, …).
    pub account: String,
    pub provider: ProviderKind,
    /// The server the key is for, when that is not the provider's official host (always for
    /// `openai-compatible` keys).
    pub base_url: Option<String>,
    /// The pool's workers (and the conductor) that use this key.
    pub used_by: Vec<String>,
    pub stored: bool,
    pub last4: Option<String>,
    /// Set when the pool takes this key from an environment variable, which wins over the keychain.
    pub env_override: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, ts_rs::TS)]
pub struct KeysView {
    /// `null` when the keychain works; otherwise what is missing and how to fix it.
    pub keychain_error: Option<String>,
    pub keys: Vec<KeyRow>,
}

/// The keys every provider of the pool needs (plus the three hosted providers, so a key can be
/// entered before the worker is added).
#[tauri::command]
pub async fn list_keys(state: State<'_, AppState>) -> AppResult<KeysView> {
    let mut rows: Vec<KeyRow> = Vec::new();
    let mut add = |provider: ProviderKind, base_url: Option<&str>, user: Option<String>, env: Option<&String>| {
        let account = baton_secrets::account(provider, base_url);
        let row = match rows.iter_mut().find(|r| r.account == account) {
            Some(row) => row,
            None => {
                rows.push(KeyRow {
                    account: account.clone(),
                    provider,
                    // Set for every entry bound to an address other than the provider's own.
                    base_url: account.split_once(':').map(|(_, url)| url.to_owned()),
                    used_by: Vec::new(),
                    stored: false,
                    last4: None,
                    env_override: None,
                });
                rows.last_mut().expect("just pushed")
            }
        };
        row.used_by.extend(user);
        if row.env_override.is_none() {
            row.env_override = env.cloned();
        }
    };
    for provider in [ProviderKind::OpenAi, ProviderKind::Anthropic, ProviderKind::Gemini] {
        add(provider, None, None, None);
    }
    // A pool that does not parse still lists the hosted providers: keys can be set regardless.
    if let Ok(pool) = state.pool() {
        for w in pool.workers.iter().filter(|w| w.provider != ProviderKind::Local) {
            add(w.provider, w.base_url.as_deref(), Some(w.name.clone()), w.api_key_env.as_ref());
        }
        let c = &pool.options.conductor;
        if let Some(url) = &c.url {
            add(ProviderKind::OpenAiCompatible, Some(url), Some("the conductor".into()), c.api_key_env.as_ref());
        }
    }
    let accounts: Vec<String> = rows.iter().map(|r| r.account.clone()).collect();
    // Secret Service calls block on D-Bus: keep them off the async workers.
    let listed = tokio::task::spawn_blocking(move || KeyStore::open()?.list(&accounts))
        .await
        .map_err(|e| AppError::new(crate::error::ErrorKind::Keychain, e.to_string()))?;
    let keychain_error = match listed {
        Ok(statuses) => {
            for (row, status) in rows.iter_mut().zip(statuses) {
                row.stored = status.stored;
                row.last4 = status.last4;
            }
            None
        }
        Err(e) => Some(e.to_string()),
    };
    Ok(KeysView { keychain_error, keys: rows })
}

fn account(provider: ProviderKind, base_url: Option<&str>) -> AppResult<String> {
    match (provider, base_url.map(str::trim).filter(|u| !u.is_empty())) {
        (ProviderKind::Local, _) => Err(AppError::bad_input("local models need no key")),
        (ProviderKind::OpenAiCompatible, None) => {
            Err(AppError::bad_input("an openai-compatible key is stored per server: give its base URL"))
        }
        (provider, url) => Ok(baton_secrets::account(provider, url)),
    }
}

/// Stores `key` in the keychain. It is not logged, not stored anywhere else, not returned.
#[tauri::command]
pub async fn set_key(provider: ProviderKind, base_url: Option<String>, key: String) -> AppResult<()> {
    let account = account(provider, base_url.as_deref())?;
    let key = key.trim().to_owned();
    tokio::task::spawn_blocking(move || KeyStore::open()?.set(&account, &key))
        .await
        .map_err(|e| AppError::new(crate::error::ErrorKind::Keychain, e.to_string()))??;
    Ok(())
}

#[tauri::command]
pub async fn delete_key(provider: ProviderKind, base_url: Option<String>) -> AppResult<()> {
    let account = account(provider, base_url.as_deref())?;
    tokio::task::spawn_blocking(move || KeyStore::open()?.delete(&account))
        .await
        .map_err(|e| AppError::new(crate::error::ErrorKind::Keychain, e.to_string()))??;
    Ok(())
}

/// Records the user's consent, given in the dialog a [`KeyNotAllowed`](crate::error::ErrorKind::KeyNotAllowed)
/// error opens, that the key in environment variable `var` may go to `origin`. Only a pairing
/// the current pool names is accepted: the window cannot allow a variable to go anywhere the
/// pool does not already send it.
#[tauri::command]
pub async fn allow_env_key(state: State<'_, AppState>, var: String, origin: String) -> AppResult<()> {
    let pool = state.pool()?;
    let conductor = &pool.options.conductor;
    let named = pool
        .workers
        .iter()
        .filter(|w| w.provider != ProviderKind::Local)
        .map(|w| (w.api_key_env.as_deref(), w.effective_base_url()))
        .chain(std::iter::once((conductor.api_key_env.as_deref(), conductor.url.as_deref().unwrap_or_default())))
        .any(|(env, url)| env == Some(var.as_str()) && baton_secrets::origin(url).as_deref() == Some(origin.as_str()));
    if !named {
        return Err(AppError::bad_input(format!(
            "the pool sends no environment variable {var} to {origin}; there is nothing to allow"
        )));
    }
    tokio::task::spawn_blocking(move || KeyStore::open()?.allow_env(&var, &origin))
        .await
        .map_err(|e| AppError::new(crate::error::ErrorKind::Keychain, e.to_string()))??;
    Ok(())
}

//! Provider API keys in the OS keychain: the Secret Service on Linux (gnome-keyring, KeePassXC),
//! the Keychain on macOS, the Credential Manager on Windows.
//!
//! Every key is one entry under the service `baton`; the entry's account says whose key it is
//! (see [`account`]). Keys are read when a request needs them and are never copied anywhere
//! else: there is deliberately no fallback to a file or to memory, because a key the user
//! believes is in the keychain must not quietly end up on disk. Without a usable keychain every
//! operation fails with a [`SecretsError`] that says what is missing and points at the
//! alternative, an environment variable named by `api_key_env` in the pool.

use baton_providers::{ApiKey, ProviderKind};
use keyring::Entry;
use keyring::Error as KeyringError;

/// The keychain service every Baton entry is filed under.
pub const SERVICE: &str = "baton";

/// The providers that have one key each, whatever their base URL.
pub const KEYED_PROVIDERS: [ProviderKind; 3] = [ProviderKind::OpenAi, ProviderKind::Anthropic, ProviderKind::Gemini];

/// The keychain account holding `provider`'s key for requests to `base_url`.
///
/// A key is bound to the host it was saved for. OpenAI, Anthropic and Gemini keys are saved for
/// the provider's official host: a pool that points one of them at any other address (a proxy,
/// or a server a rogue edit slipped in) gets that address's own entry, `openai:https://…`,
/// which holds nothing until the user stores a key for it. OpenAI-compatible servers are
/// unrelated to each other, so each base URL has its own entry. URLs are normalised so that
/// `http://host/v1/` and `http://host/v1` share one.
pub fn account(provider: ProviderKind, base_url: Option<&str>) -> String {
    let url = base_url.map(|u| u.trim().trim_end_matches('/')).filter(|u| !u.is_empty());
    match (provider, url) {
        (ProviderKind::OpenAiCompatible, Some(url)) => format!("{}:{url}", provider.as_str()),
        (_, Some(url)) if !is_official_host(provider, url) => format!("{}:{url}", provider.as_str()),
        _ => provider.as_str().to_owned(),
    }
}

/// Whether `url` is on `provider`'s official host (same scheme, host and port as its default
/// base URL). Anything unusual (user info, another port, plain http) is not.
pub fn is_official_host(provider: ProviderKind, url: &str) -> bool {
    let origin = |u: &str| -> Option<String> {
        let (scheme, rest) = u.trim().split_once("://")?;
        let authority = rest.split(['/', '?', '#']).next()?;
        Some(format!("{}://{}", scheme.to_ascii_lowercase(), authority.to_ascii_lowercase()))
    };
    match provider.default_base_url() {
        Some(official) => origin(url).is_some_and(|o| Some(o) == origin(official)),
        None => false,
    }
}

/// The environment variables whose key Baton sends, without asking, to their provider's official
/// host (and only there).
pub const WELL_KNOWN_KEY_VARS: [(&str, ProviderKind); 3] = [
    ("OPENAI_API_KEY", ProviderKind::OpenAi),
    ("ANTHROPIC_API_KEY", ProviderKind::Anthropic),
    ("GEMINI_API_KEY", ProviderKind::Gemini),
];

/// The environment variable that allows variable/host pairs where there is no keychain to record
/// the consent in: `VAR=URL` pairs separated by spaces or commas. A pool file cannot set it, so
/// it is the user's own word, like a keychain entry.
pub const ALLOW_KEY_ENV: &str = "BATON_ALLOW_KEY_ENV";

/// `url`'s origin, the part a key is bound to: scheme, host and port, lower-cased, with the
/// scheme's default port left out (`https://Host:443/v1` → `https://host`). `None` for anything
/// that is not an absolute http(s) URL.
pub fn origin(url: &str) -> Option<String> {
    let (scheme, rest) = url.trim().split_once("://")?;
    let scheme = scheme.to_ascii_lowercase();
    let default_port = match scheme.as_str() {
        "https" => ":443",
        "http" => ":80",
        _ => return None,
    };
    let authority = rest.split(['/', '?', '#']).next()?.to_ascii_lowercase();
    let authority = authority.strip_suffix(default_port).unwrap_or(&authority);
    (!authority.is_empty()).then(|| format!("{scheme}://{authority}"))
}

/// Whether the key in environment variable `var` may go to `url` without asking: the variable
/// is one of the [`WELL_KNOWN_KEY_VARS`] and `url` is on its provider's official host.
pub fn is_well_known_pairing(var: &str, url: &str) -> bool {
    WELL_KNOWN_KEY_VARS.iter().any(|(name, provider)| *name == var && is_official_host(*provider, url))
}

/// The keychain account recording that the user allowed `var`'s key to go to `origin`. The
/// entry holds no secret, only the pairing, filed beside the keys it guards.
pub fn env_consent_account(var: &str, origin: &str) -> String {
    format!("allow-env:{var}@{origin}")
}

/// Whether [`ALLOW_KEY_ENV`]'s value `allowed` holds the pairing of `var` and `origin`.
pub fn allowed_by_variable(allowed: &str, var: &str, origin: &str) -> bool {
    allowed
        .split([' ', ',', '\n', '\t'])
        .filter_map(|pair| pair.split_once('='))
        .any(|(name, url)| name == var && self::origin(url).as_deref() == Some(origin))
}

/// What went wrong with the keychain. Messages never contain a key.
#[derive(Debug, thiserror::Error)]
pub enum SecretsError {
    /// There is no keychain to talk to (no Secret Service, no D-Bus session bus).
    #[error("no OS keychain is available: {missing} ({cause}). {hint}", missing = MISSING, hint = NO_KEYCHAIN_HINT)]
    NoKeychain { cause: String },
    /// The keychain is there but refused access, typically because its collection is locked.
    #[error(
        "the OS keychain is locked, has no default keyring or refused access ({cause}); unlock it (log in \
         to the desktop session, or unlock or create the login keyring in your keyring manager) and try \
         again, or export the key in the environment variable named by api_key_env in the pool"
    )]
    Locked { cause: String },
    /// Any other failure of the platform's keychain.
    #[error("the OS keychain failed: {cause}")]
    Platform { cause: String },
    /// An empty key would only turn into confusing authentication errors later.
    #[error("refusing to store an empty key")]
    EmptyKey,
}

#[cfg(all(unix, not(any(target_os = "macos", target_os = "ios", target_os = "android"))))]
const MISSING: &str = "no Secret Service could be reached over the D-Bus session bus";

#[cfg(all(unix, not(any(target_os = "macos", target_os = "ios", target_os = "android"))))]
const NO_KEYCHAIN_HINT: &str = "Install and start gnome-keyring (`apt install gnome-keyring`) or enable \
     KeePassXC's Secret Service integration; either needs a D-Bus session (DBUS_SESSION_BUS_ADDRESS). Or \
     export the key in the environment variable named by api_key_env in the pool instead";

#[cfg(not(all(unix, not(any(target_os = "macos", target_os = "ios", target_os = "android")))))]
const MISSING: &str = "the platform's credential store could not be opened";

#[cfg(not(all(unix, not(any(target_os = "macos", target_os = "ios", target_os = "android")))))]
const NO_KEYCHAIN_HINT: &str = "Export the key in the environment variable named by api_key_env in the pool instead";

/// Whether a key is stored for an account, and enough of it to recognise which one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyStatus {
    pub account: String,
    pub stored: bool,
    /// The key's last four characters; `None` when nothing is stored or the key is too short
    /// for four characters to be harmless (see [`last4`]).
    pub last4: Option<String>,
}

/// The last four characters of `key`, but only for keys of 12 characters or more: on a short
/// key four characters are too large a share of the secret to print.
pub fn last4(key: &str) -> Option<String> {
    let count = key.chars().count();
    (count >= 12).then(|| key.chars().skip(count - 4).collect())
}

/// The keychain, opened. Holds nothing itself: every call reaches the platform store, so a key
/// is never kept in this process longer than the caller keeps the returned [`ApiKey`].
#[derive(Debug, Clone, Copy)]
pub struct KeyStore {
    _opened: (),
}

impl KeyStore {
    /// Connects to the platform's keychain, or says why there is none.
    ///
    /// keyring sets its store up once per process, on first use, and does not retry; the cause
    /// of a failure is kept and reported on every later call.
    pub fn open() -> Result<KeyStore, SecretsError> {
        match Entry::store_status() {
            Ok(()) => Ok(KeyStore { _opened: () }),
            Err(e) => Err(SecretsError::NoKeychain { cause: setup_cause(e) }),
        }
    }

    /// Stores `key` for `account`, replacing any key stored before.
    pub fn set(&self, account: &str, key: &str) -> Result<(), SecretsError> {
        if key.is_empty() {
            return Err(SecretsError::EmptyKey);
        }
        entry(account)?.set_password(key).map_err(|e| classify(e, account))
    }

    /// The key stored for `account`, if any.
    pub fn get(&self, account: &str) -> Result<Option<ApiKey>, SecretsError> {
        let mut looks = 0;
        loop {
            looks += 1;
            match entry(account)?.get_password() {
                Ok(key) => return Ok(Some(ApiKey::new(key))),
                Err(KeyringError::NoEntry) => return Ok(None),
                // Deleted while it was read (by another process, or just before): look again,
                // and after a few looks it is gone.
                Err(e) if vanished(&e) => {
                    if looks == VANISHED_LOOKS {
                        return Ok(None);
                    }
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                Err(e) => return Err(classify(e, account)),
            }
        }
    }

    /// Removes the key stored for `account`; `false` when there was none.
    pub fn delete(&self, account: &str) -> Result<bool, SecretsError> {
        match entry(account)?.delete_credential() {
            Ok(()) => Ok(true),
            // Deleted by another call as this one found it.
            Err(KeyringError::NoEntry) => Ok(false),
            Err(e) if vanished(&e) => Ok(false),
            Err(e) => Err(classify(e, account)),
        }
    }

    /// Records that the user allows the key in environment variable `var` to go to `origin`.
    pub fn allow_env(&self, var: &str, origin: &str) -> Result<(), SecretsError> {
        self.set(&env_consent_account(var, origin), "allowed")
    }

    /// Withdraws that consent; `false` when there was none.
    pub fn forbid_env(&self, var: &str, origin: &str) -> Result<bool, SecretsError> {
        self.delete(&env_consent_account(var, origin))
    }

    /// Whether the user allowed the key in `var` to go to `origin`.
    pub fn env_allowed(&self, var: &str, origin: &str) -> Result<bool, SecretsError> {
        Ok(self.get(&env_consent_account(var, origin))?.is_some())
    }

    /// Whether each of `accounts` has a key, with its last four characters; never the key.
    pub fn list(&self, accounts: &[String]) -> Result<Vec<KeyStatus>, SecretsError> {
        accounts
            .iter()
            .map(|account| {
                let key = self.get(account)?;
                Ok(KeyStatus {
                    account: account.clone(),
                    stored: key.is_some(),
                    last4: key.and_then(|k| last4(k.expose())),
                })
            })
            .collect()
    }
}

/// How many times [`KeyStore::get`] looks for a key whose item vanished as it was read.
const VANISHED_LOOKS: u32 = 3;

/// Whether the Secret Service found an item but it was gone when it was read: gnome-keyring
/// can still list an item for a moment after it was deleted, and reading its path then fails
/// with `UnknownMethod` ("No such interface org.freedesktop.Secret.Item").
fn vanished(e: &KeyringError) -> bool {
    let text = describe(e);
    text.contains("UnknownMethod") && text.contains("Secret.Item")
}

fn entry(account: &str) -> Result<Entry, SecretsError> {
    Entry::new(SERVICE, account).map_err(|e| match e {
        // Only reachable if the store vanished after `open`; report the setup's own cause.
        KeyringError::NoDefaultStore => SecretsError::NoKeychain {
            cause: Entry::store_status().as_ref().err().map_or_else(|| describe(&e), setup_cause),
        },
        e => classify(e, account),
    })
}

/// Maps keyring's errors onto ours. Variants that carry secret bytes are described without them.
fn classify(e: KeyringError, account: &str) -> SecretsError {
    match e {
        KeyringError::NoStorageAccess(cause) => SecretsError::Locked { cause: cause.to_string() },
        KeyringError::NoDefaultStore => SecretsError::NoKeychain { cause: describe(&e) },
        KeyringError::BadEncoding(_) | KeyringError::BadDataFormat(..) => SecretsError::Platform {
            cause: format!("the stored {account} key is not valid UTF-8 text; store it again with `baton keys set`"),
        },
        KeyringError::Ambiguous(items) => SecretsError::Platform {
            cause: format!(
                "{} keychain items match service {SERVICE}, account {account}; delete them all and store the key again",
                items.len()
            ),
        },
        e => SecretsError::Platform { cause: describe(&e) },
    }
}

/// Why the store could not be set up. The commonest cause, a process started outside any
/// desktop session (ssh, cron, containers), is named outright: zbus's own words for it are a
/// failed connection to a socket path the user never chose.
fn setup_cause(e: &KeyringError) -> String {
    let cause = describe(e);
    if cfg!(all(unix, not(any(target_os = "macos", target_os = "ios", target_os = "android"))))
        && std::env::var_os("DBUS_SESSION_BUS_ADDRESS").is_none()
    {
        return format!("DBUS_SESSION_BUS_ADDRESS is unset, so there is no D-Bus session: {cause}");
    }
    cause
}

fn describe(e: &KeyringError) -> String {
    match e {
        // keyring's own words for these name its internals ("default store", "platform
        // failure"); the platform's cause is what helps the user.
        KeyringError::PlatformFailure(cause) | KeyringError::NoStorageAccess(cause) => cause.to_string(),
        KeyringError::NoDefaultStore => "no credential store could be set up".to_owned(),
        e => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accounts_are_provider_names_and_compatible_servers_are_told_apart_by_url() {
        assert_eq!(account(ProviderKind::OpenAi, None), "openai");
        assert_eq!(account(ProviderKind::OpenAi, Some("https://api.openai.com/v1/")), "openai");
        assert_eq!(account(ProviderKind::OpenAi, Some("https://API.openai.com/v2")), "openai", "same host");
        assert_eq!(account(ProviderKind::Anthropic, Some("https://api.anthropic.com")), "anthropic");
        assert_eq!(account(ProviderKind::Anthropic, None), "anthropic");
        assert_eq!(account(ProviderKind::Gemini, None), "gemini");
        assert_eq!(
            account(ProviderKind::OpenAiCompatible, Some("http://127.0.0.1:8000/v1/")),
            "openai-compatible:http://127.0.0.1:8000/v1"
        );
        assert_eq!(
            account(ProviderKind::OpenAiCompatible, Some("http://127.0.0.1:8000/v1//")),
            account(ProviderKind::OpenAiCompatible, Some("http://127.0.0.1:8000/v1"))
        );
        assert_ne!(
            account(ProviderKind::OpenAiCompatible, Some("http://a/v1")),
            account(ProviderKind::OpenAiCompatible, Some("http://b/v1"))
        );
    }

    #[test]
    fn a_hosted_provider_pointed_elsewhere_gets_that_address_s_own_entry() {
        assert_eq!(account(ProviderKind::OpenAi, Some("http://proxy/v1/")), "openai:http://proxy/v1");
        for elsewhere in [
            "http://api.openai.com/v1",                         // plain http
            "https://api.openai.com:8443/v1",                   // another port
            "https://api.openai.com@evil.example/v1",           // user info: the host is evil.example
            "https://api.openai.com.evil.example/v1",           // a look-alike host
            "https://generativelanguage.googleapis.com/v1beta", // another provider's host
        ] {
            assert_ne!(account(ProviderKind::OpenAi, Some(elsewhere)), "openai", "{elsewhere}");
        }
        assert_eq!(account(ProviderKind::Gemini, Some("https://generativelanguage.googleapis.com/v1beta")), "gemini");
    }

    #[test]
    fn origins_keep_scheme_host_and_port_and_drop_the_rest() {
        assert_eq!(origin("https://API.example.com:443/v1/").as_deref(), Some("https://api.example.com"));
        assert_eq!(origin("http://127.0.0.1:8000/v1").as_deref(), Some("http://127.0.0.1:8000"));
        assert_eq!(origin("http://h:80").as_deref(), Some("http://h"));
        assert_ne!(origin("http://h:8000"), origin("http://h:8001"), "another port is another server");
        assert_ne!(origin("http://h"), origin("https://h"), "plain http is not https");
        assert_eq!(origin("ftp://h"), None);
        assert_eq!(origin("h:8000"), None);
        assert_eq!(origin("https://"), None);
    }

    #[test]
    fn well_known_variables_go_only_to_their_provider_s_official_host() {
        assert!(is_well_known_pairing("OPENAI_API_KEY", "https://api.openai.com/v1"));
        assert!(is_well_known_pairing("ANTHROPIC_API_KEY", "https://api.anthropic.com"));
        assert!(is_well_known_pairing("GEMINI_API_KEY", "https://generativelanguage.googleapis.com/v1beta"));
        assert!(!is_well_known_pairing("OPENAI_API_KEY", "https://api.anthropic.com"), "another provider's host");
        assert!(!is_well_known_pairing("OPENAI_API_KEY", "http://127.0.0.1:8000/v1"));
        assert!(!is_well_known_pairing("OPENAI_API_KEY", "https://api.openai.com.evil.example/v1"));
        assert!(!is_well_known_pairing("AWS_SECRET_ACCESS_KEY", "https://api.openai.com/v1"));
    }

    #[test]
    fn the_allow_variable_names_exact_pairs() {
        let allowed = "MY_KEY=http://127.0.0.1:8000/v1, OTHER=https://h.example";
        assert!(allowed_by_variable(allowed, "MY_KEY", "http://127.0.0.1:8000"));
        assert!(allowed_by_variable(allowed, "OTHER", "https://h.example"));
        assert!(!allowed_by_variable(allowed, "MY_KEY", "http://127.0.0.1:8001"), "another port");
        assert!(!allowed_by_variable(allowed, "OTHER", "http://127.0.0.1:8000"), "another variable's host");
        assert!(!allowed_by_variable("MY_KEY", "MY_KEY", "http://127.0.0.1:8000"), "no host, no pairing");
        assert!(!allowed_by_variable("", "MY_KEY", "http://127.0.0.1:8000"));
    }

    #[test]
    fn only_long_keys_show_their_last_four_characters() {
        assert_eq!(last4("sk-0123456789"), Some("6789".to_owned()));
        assert_eq!(last4("123456789012"), Some("9012".to_owned()), "12 is long enough");
        assert_eq!(last4("12345678901"), None, "11 is not");
        assert_eq!(last4(""), None);
        assert_eq!(last4("ключ-ключ-ключ"), Some("ключ".to_owned()), "characters, not bytes");
    }

    #[test]
    fn no_keychain_says_what_to_install_and_mentions_api_key_env() {
        let message = SecretsError::NoKeychain { cause: "no dbus session found".into() }.to_string();
        assert!(message.contains("no dbus session found"), "{message}");
        assert!(message.contains("api_key_env"), "{message}");
        #[cfg(target_os = "linux")]
        assert!(message.contains("apt install gnome-keyring") && message.contains("D-Bus"), "{message}");
        let locked = SecretsError::Locked { cause: "object locked".into() }.to_string();
        assert!(locked.contains("unlock") && locked.contains("api_key_env"), "{locked}");
    }
}

//! The one error type commands return. It crosses the IPC boundary as `{kind, message}`: the UI
//! branches on `kind` and shows `message`, which says what happened and what to do.

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ts_rs::TS)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// Something the user typed or chose is not acceptable (a pool field, a plan, a question).
    BadInput,
    /// The pool file cannot be read or parsed; settings can rewrite it.
    Pool,
    /// No conductor is configured, or it could not be loaded.
    Conductor,
    /// The OS keychain is missing or locked.
    Keychain,
    /// The history database cannot be opened or written.
    History,
    /// A provider refused or failed a call (test connection).
    Provider,
    /// The run, conversation or file asked for does not exist.
    NotFound,
    /// Reading or writing a file failed.
    Io,
    /// The user stopped the work (a plan being drafted, a download).
    Cancelled,
    /// A model download failed: the hub refused or could not be reached, the file was corrupt,
    /// or the disk is full (the message says which, and what to do).
    Download,
    /// The pool would send an environment variable's key to a host the user has not allowed it
    /// to go to; `consent` names both, for the dialog that asks.
    KeyNotAllowed,
}

/// What a [`ErrorKind::KeyNotAllowed`] error asks the user to allow (`allow_env_key`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ts_rs::TS)]
pub struct KeyConsent {
    /// The environment variable the pool names (`api_key_env`).
    pub var: String,
    /// Where its key would go: scheme, host and port.
    pub origin: String,
    /// Who sends it: `worker "gpt"`, `the conductor`.
    pub owner: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, ts_rs::TS, thiserror::Error)]
#[error("{message}")]
pub struct AppError {
    pub kind: ErrorKind,
    pub message: String,
    /// Set only for [`ErrorKind::KeyNotAllowed`].
    #[serde(skip_serializing_if = "Option::is_none")]
    #[ts(optional)]
    pub consent: Option<KeyConsent>,
}

impl AppError {
    /// Every error a command returns passes here, so each is in the log (messages never hold
    /// a key: see the invariants).
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        let message = message.into();
        tracing::info!(?kind, "a command refused or failed: {message}");
        AppError { kind, message, consent: None }
    }

    pub fn bad_input(message: impl Into<String>) -> Self {
        AppError::new(ErrorKind::BadInput, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        AppError::new(ErrorKind::NotFound, message)
    }
}

impl From<baton_store::StoreError> for AppError {
    fn from(e: baton_store::StoreError) -> Self {
        use baton_store::StoreError;
        // Deleting a run that is still going is a request to refuse, not a broken history.
        let kind = match e {
            StoreError::RunStillGoing { .. } | StoreError::ConversationStillGoing { .. } => ErrorKind::BadInput,
            _ => ErrorKind::History,
        };
        AppError::new(kind, e.to_string())
    }
}

impl From<baton_eval::EvalError> for AppError {
    fn from(e: baton_eval::EvalError) -> Self {
        match e {
            baton_eval::EvalError::Settings(m) => AppError::bad_input(m),
            baton_eval::EvalError::Store(e) => e.into(),
            other => AppError::new(ErrorKind::Io, other.to_string()),
        }
    }
}

impl From<baton_secrets::SecretsError> for AppError {
    fn from(e: baton_secrets::SecretsError) -> Self {
        AppError::new(ErrorKind::Keychain, e.to_string())
    }
}

impl From<baton_engine::PoolError> for AppError {
    fn from(e: baton_engine::PoolError) -> Self {
        AppError::new(ErrorKind::Pool, e.to_string())
    }
}

impl From<baton_conductor::setup::SetupError> for AppError {
    fn from(e: baton_conductor::setup::SetupError) -> Self {
        match e {
            baton_conductor::setup::SetupError::KeyNotAllowed(refused) => refused.into(),
            e => AppError::new(ErrorKind::Conductor, e.to_string()),
        }
    }
}

impl From<baton_engine::keys::KeyNotAllowed> for AppError {
    fn from(e: baton_engine::keys::KeyNotAllowed) -> Self {
        // The Chat screen asks in a dialog (from `consent`); other screens show the message.
        let message = format!(
            "{} would send the key in the environment variable {} to {}, and you have not allowed that \
             variable to go there. Allow it when the Chat screen asks, or run `baton keys allow-env {} {}`",
            e.owner, e.var, e.origin, e.var, e.origin
        );
        let consent = KeyConsent { var: e.var, origin: e.origin, owner: e.owner };
        AppError { consent: Some(consent), ..AppError::new(ErrorKind::KeyNotAllowed, message) }
    }
}

impl From<baton_runner::RunnerError> for AppError {
    fn from(e: baton_runner::RunnerError) -> Self {
        use baton_runner::RunnerError;
        match e {
            RunnerError::Setup(e) => e.into(),
            RunnerError::Store(e) => e.into(),
            RunnerError::Pool(e) => e.into(),
            RunnerError::NotFound(m) => AppError::not_found(m),
            RunnerError::BadInput(m) => AppError::bad_input(m),
            RunnerError::Cancelled(m) => AppError::new(ErrorKind::Cancelled, m),
            RunnerError::Conductor(m) => AppError::new(ErrorKind::Conductor, m),
            RunnerError::Sandbox(e) => AppError::new(ErrorKind::Io, e.to_string()),
            RunnerError::Token(e) => match e {
                baton_serve::TokenError::Keychain(e) => e.into(),
                baton_serve::TokenError::NoRandom(_) => AppError::new(ErrorKind::Io, e.to_string()),
                baton_serve::TokenError::VariableUnset(_) | baton_serve::TokenError::FromVariable(_) => {
                    AppError::bad_input(e.to_string())
                }
            },
            RunnerError::Io(m) => AppError::new(ErrorKind::Io, m),
        }
    }
}

pub type AppResult<T> = Result<T, AppError>;

//! The application layer: what a user does with a pool, written once for every front end. The
//! command line, the desktop app and the server's front ends parse their input, make one call
//! here, and render the progress and the result that come back:
//!
//! - [`ask`]: a question (or a written plan) run with its history recorded, and
//!   [`run::run_in_conversation`], the same for a run a front end composes itself (the app's
//!   compare in chat);
//! - [`draft`]: a plan for review through the executor's own planning round;
//! - [`rerun`]: one step of an earlier run again, with another worker;
//! - [`learn`]: every worker (and the conductor's sampled plans) on a suite's items, kept as
//!   what the pool learned;
//! - [`evaluate`]: strategies side by side on a suite, with their report;
//! - [`serve`]: the pool as an OpenAI-compatible server, from the pool's `[serve]` table and
//!   what the front end overrides;
//! - [`build`]: the executor every one of these runs on, with what the pool learned put in.
//!
//! Workflow search and conductor training belong here too, beside learning.

pub mod build;
pub mod draft;
pub mod evaluate;
pub mod learn;
pub mod learned;
pub mod rerun;
pub mod run;
pub mod serve;

pub use baton_conductor::setup::{ConductorChoice, KeepForPool, SetupError};
pub use baton_local::{LoadNotice, LocalModels, Notify};
pub use build::{Built, Conductor, Context, Setup, build};
pub use run::{Ask, Recorded, ask, conversation_so_far};

/// Why work could not be done (a run that starts and then fails is a [`Recorded`] run; an
/// evaluation that stops says so in its [`baton_eval::Ended`]).
#[derive(Debug, thiserror::Error)]
pub enum RunnerError {
    /// The conductor or a local worker could not be set up.
    #[error(transparent)]
    Setup(#[from] SetupError),
    #[error(transparent)]
    Store(#[from] baton_store::StoreError),
    /// The pool file could not be read or is not valid.
    #[error(transparent)]
    Pool(#[from] baton_engine::PoolError),
    /// The run, conversation or worker asked for does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The request cannot be run as it is; the message says why and what to do.
    #[error("{0}")]
    BadInput(String),
    /// The user stopped it.
    #[error("{0}")]
    Cancelled(String),
    /// The conductor failed to write a plan.
    #[error("{0}")]
    Conductor(String),
    /// Model-written code could not be run in the sandbox.
    #[error(transparent)]
    Sandbox(#[from] baton_eval::sandbox::SandboxError),
    /// The token a server's clients send could not be had.
    #[error(transparent)]
    Token(#[from] baton_serve::TokenError),
    /// The operating system refused (a port to listen on); the message says what to do.
    #[error("{0}")]
    Io(String),
}

impl From<baton_eval::EvalError> for RunnerError {
    fn from(e: baton_eval::EvalError) -> Self {
        match e {
            baton_eval::EvalError::Settings(m) => RunnerError::BadInput(m),
            baton_eval::EvalError::Store(e) => RunnerError::Store(e),
            baton_eval::EvalError::Sandbox(e) => RunnerError::Sandbox(e),
        }
    }
}

/// What to tell a user whose cost cap (`cap`, as they know it) cannot count some workers: they
/// have no price, so their calls count as $0.
pub fn unpriced_warning(pool: &baton_engine::Pool, cap: &str) -> Option<String> {
    let unpriced: Vec<&str> =
        pool.workers.iter().filter(|w| !w.pricing().is_known()).map(|w| w.name.as_str()).collect();
    (!unpriced.is_empty()).then(|| {
        format!(
            "warning: {cap} does not count workers without a price ({}); set price_in and price_out for them",
            unpriced.join(", ")
        )
    })
}

//! Running questions on a pool, the one way the command line, the desktop app and the server
//! do it: building an executor from a pool and the user's settings ([`build`]), running a
//! question with its history recorded ([`run`]), drafting a plan for review through the
//! executor's own planning round ([`draft`]), and continuing a conversation or re-running a
//! step of an earlier run ([`rerun`]).
//!
//! The front ends only turn their input into these calls and the [`baton_engine::RunEvent`]s
//! that come back into their output.

pub mod build;
pub mod draft;
pub mod rerun;
pub mod run;

pub use baton_conductor::setup::{ConductorChoice, LoadNotice, LocalModels, Notify, SetupError};
pub use build::{Built, Conductor, Setup, build};
pub use run::{Recorded, conversation_so_far, run_recorded};

/// Why a question could not be run (a run that starts and then fails is a [`Recorded`] run).
#[derive(Debug, thiserror::Error)]
pub enum RunnerError {
    /// The conductor or a local worker could not be set up.
    #[error(transparent)]
    Setup(#[from] SetupError),
    #[error(transparent)]
    Store(#[from] baton_store::StoreError),
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
}

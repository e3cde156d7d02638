//! The conductor: the model that reads a question and writes the workflow — which worker does
//! what, and which earlier results each step sees.
//!
//! - [`prompt`]: the versioned prompt (task, format, "Model 0 … Model k", few-shot workflows).
//! - [`grammar`]: the Lark grammar that makes a local conductor's output a valid plan for the
//!   current pool, always.
//! - [`conductor`]: the [`Planner`](baton_engine::Planner)s: [`LocalConductor`] on a local model
//!   (`baton-local`) and [`RemoteConductor`] on any OpenAI-compatible endpoint.
//! - [`setup`]: from a pool (and overrides) to a planner and the models of its `local` workers,
//!   shared by the command line and the desktop app.

pub mod conductor;
pub mod grammar;
pub mod prompt;
pub mod setup;

#[cfg(feature = "local")]
pub use conductor::LocalConductor;
pub use conductor::{ConductorOptions, REMOTE_MAX_PLAN_BYTES, RemoteConductor, grammar_for};
pub use grammar::PlanGrammar;
pub use prompt::{PROMPT_VERSION, PromptBuilder, PromptVersion};

//! The conductor: the model that reads a question and writes the workflow — which worker does
//! what, and which earlier results each step sees.
//!
//! - [`prompt`]: the versioned prompt (task, format, "Model 0 … Model k", few-shot workflows).
//! - [`grammar`]: the Lark grammar that makes a local conductor's output a valid plan for the
//!   current pool, always.
//! - [`conductor`]: the [`Planner`](baton_engine::Planner)s: [`LocalConductor`] on mistral.rs
//!   and [`RemoteConductor`] on any OpenAI-compatible endpoint.
//! - [`local`]: loading GGUF/safetensors models in process, for the conductor and `local` workers.
//! - [`cpu`]: the SIMD level the binary was built for, and a check at start-up that the CPU has it.
//! - [`setup`]: from a pool (and overrides) to a planner and in-process workers, shared by the
//!   command line and the desktop app.

pub mod conductor;
pub mod cpu;
pub mod grammar;
#[cfg(feature = "local")]
pub mod local;
pub mod prompt;
pub mod setup;

#[cfg(feature = "local")]
pub use conductor::LocalConductor;
pub use conductor::{ConductorOptions, RemoteConductor, grammar_for};
pub use grammar::PlanGrammar;
pub use prompt::{PROMPT_VERSION, PromptBuilder, PromptVersion};

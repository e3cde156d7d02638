//! Local models: GGUF and safetensors models loaded and run in this process through mistral.rs,
//! for the conductor and `local` workers, and what the process does for them.
//!
//! - [`LocalModel`] (feature `engine`): a model loaded from a [`LocalModelConfig`] (refused
//!   with a [`LoadError`] that says what to do, before the engine reads it when the free memory
//!   cannot hold it) and its streamed generations, optionally under a Lark grammar.
//! - [`LocalWorker`]: a local model as a pool worker, a [`ChatModel`](baton_providers::ChatModel).
//! - [`LocalModels`]: the models a process has loaded, shared by all its runs.
//! - [`set_engine_environment`]: the environment the engine reads, set before any thread starts;
//!   [`BUILD_DEVICE`]: what this build runs models on.
//! - [`cpu`]: the SIMD level the binary was built for, and a check at start-up that the CPU has it.
//!
//! Nothing here knows of pools, plans or conductors: the crates above say which model to load
//! and what to ask it.

pub mod cpu;
#[cfg(feature = "engine")]
mod engine;
mod environment;
mod models;
#[cfg(feature = "engine")]
mod worker;

#[cfg(feature = "engine")]
pub use engine::{
    EndTokens, GenerateOptions, Generated, IGNORE_FREE_MEMORY, LoadError, LocalModel, LocalModelConfig, MemoryNeed,
    Speed, free_memory_bytes, weights_bytes,
};
pub use environment::{BUILD_DEVICE, set_engine_environment};
pub use models::{LoadNotice, LoadedModel, LocalModels, Notify};
#[cfg(feature = "engine")]
pub use worker::LocalWorker;

//! Evaluations: does the conductor beat the pool's best worker, a lookup table, a mixture of
//! agents or plain self-consistency — on this user's own pool, at what cost?
//!
//! - [`suite`]: JSONL items with checkable answers, and the built-in suites (with licences);
//! - [`hf`]: the standard sets as the Hugging Face hub publishes them, made into items;
//! - [`extract`]: the documented rules that read an answer out of a model's text;
//! - [`sandbox`]: where model-written code runs (limits, isolation, a guard inside Python);
//! - [`strategy`]: the ways of answering that are compared;
//! - [`harness`]: runs them over the same items through the executor, records every run in the
//!   history and every result beside it, resumes, keeps to a spending cap;
//! - [`learn`]: learning runs, which teach a pool its workers' strengths by the same harness;
//! - [`stats`] and [`report`]: accuracy with standard errors, paired tests, the Pareto front
//!   and its AIQ, as a table, JSON, Markdown, HTML and SVG.
//!
//! No Tauri: `baton eval` is its command line.

pub mod extract;
pub mod harness;
pub mod hf;
pub mod learn;
pub mod report;
pub mod sandbox;
pub mod stats;
pub mod strategy;
pub mod suite;

pub use harness::{Ended, EvalError, Harness, Progress, Purpose, Spec};
pub use strategy::Strategy;

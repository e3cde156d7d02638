//! The vendored engine's CPU kernels, each against plain arithmetic: what a local model's
//! layers compute on the CPU (`vendor/mistral.rs`, `vendor/candle`; each BATON.md says what
//! Baton changed in them). One test binary for all three.

mod activation;
mod attention;
mod quantized_matmul;

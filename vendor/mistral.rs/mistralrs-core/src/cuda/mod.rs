pub mod ffi;
pub mod gdn;
#[cfg(feature = "cuda")]
pub mod graph;
pub mod moe;
#[cfg(feature = "cuda")]
pub(crate) mod preload;
pub mod ssm;

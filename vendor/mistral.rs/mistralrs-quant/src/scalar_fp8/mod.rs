#[cfg(feature = "cuda")]
pub(crate) mod ffi;

pub(crate) mod ops;

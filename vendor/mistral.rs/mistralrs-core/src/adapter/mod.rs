mod generation;
mod registry;
mod runtime;
mod selection;

pub use generation::{
    AdapterGenerationId, AdapterGenerationParseError, LoraAdapterInfo, LoraAdapterRoute,
    LoraAdapterSpec, LoraAdapterSpecParseError, LoraResidentGenerationInfo,
};
pub use runtime::{
    LoraAdapterError, LoraAdapterFiles, LoraAdapterLoadPolicy, LoraRuntimeConfig,
    LoraRuntimeStatus, DEFAULT_LORA_MAX_ADAPTERS, DEFAULT_LORA_MAX_BYTES, DEFAULT_LORA_MAX_RANK,
    MAX_LORA_ALIAS_BYTES,
};
pub use selection::AdapterSelection;

pub(crate) use registry::AdapterLease;
pub use runtime::DynamicLoraRuntime;

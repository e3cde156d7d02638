mod cache;
mod gather_kv;
mod paged_attention;
mod scale_update;

pub use cache::{copy_blocks, swap_blocks};
pub use gather_kv::gather_kv_cache;
pub use paged_attention::{paged_attention, reshape_and_cache};
pub use scale_update::kv_scale_update;

mod backend;
mod kernels;

pub use backend::{
    copy_blocks, gather_kv_cache, kv_scale_update, paged_attention, reshape_and_cache, swap_blocks,
};

//! Hybrid cache for models that mix attention and recurrent layers (e.g., GraniteMoeHybrid, Qwen3 Next)
//!
//! This implements vLLM-style continuous batching for hybrid models:
//! - Attention layers use standard KV cache batching
//! - Recurrent layers (Mamba SSM or GDN) use a pool-based state with indexed access
//!
//! The key insight is that recurrent state is accessed via `state_indices` which map
//! each sequence in the current batch to its slot in the pool.

use candle_core::{DType, Device, IndexOp, Result, Tensor};

use super::KvCache;
use crate::layers_masker::PastKvLenCache;

/// Pool-based recurrent state cache for continuous batching.
///
/// Works for both Mamba SSM and GDN (Gated Delta Net) recurrent layers.
/// Instead of dynamically sized state tensors, we maintain a pool of
/// state slots that grows dynamically. Each sequence is assigned a slot index; CUDA GDN kernels
/// address the pool rows in place through the batch's slot table, other backends gather the rows
/// with `index_select` and scatter them back after the layer.
#[derive(Debug)]
pub struct RecurrentStatePool {
    /// Convolution state pool: (capacity, conv_dim, conv_width)
    pub conv_state: Tensor,
    /// Recurrent state pool: (capacity, ...state_dims)
    /// For Mamba: (capacity, n_heads, head_dim, d_state)
    /// For GDN: (capacity, n_v_heads, key_dim, value_dim)
    pub recurrent_state: Tensor,
    /// Stack of free slot indices (for allocation)
    free_slots: Vec<usize>,
    /// Current capacity (grows dynamically)
    capacity: usize,
    /// Shape parameters for growing
    conv_dim: usize,
    conv_width: usize,
    state_dims: Vec<usize>,
    conv_dtype: DType,
    recurrent_dtype: DType,
    device: Device,
}

/// Initial pool capacity before dynamic growth: the pre-captured CUDA graph batch range plus the
/// graph pad slot, so growth (which invalidates captured graphs) only happens past that.
const INITIAL_POOL_CAPACITY: usize = 9;

impl RecurrentStatePool {
    /// Create a new recurrent state pool.
    ///
    /// - `conv_dim`: dimension of the convolution state
    /// - `conv_width`: kernel size / d_conv for causal conv1d
    /// - `state_dims`: shape of the recurrent state per slot (e.g. `[n_heads, head_dim, d_state]`)
    pub fn new(
        conv_dim: usize,
        conv_width: usize,
        state_dims: Vec<usize>,
        conv_dtype: DType,
        recurrent_dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let capacity = INITIAL_POOL_CAPACITY;

        let conv_state = Tensor::zeros((capacity, conv_dim, conv_width), conv_dtype, device)?;

        let mut recurrent_shape = vec![capacity];
        recurrent_shape.extend_from_slice(&state_dims);
        let recurrent_state = Tensor::zeros(recurrent_shape, recurrent_dtype, device)?;

        let free_slots: Vec<usize> = (0..capacity).rev().collect();

        Ok(Self {
            conv_state,
            recurrent_state,
            free_slots,
            capacity,
            conv_dim,
            conv_width,
            state_dims,
            conv_dtype,
            recurrent_dtype,
            device: device.clone(),
        })
    }

    /// Grow the pool by doubling capacity.
    fn grow(&mut self) -> Result<()> {
        let new_capacity = self.capacity * 2;

        // Allocate new larger conv_state and copy existing data
        let new_conv = Tensor::zeros(
            (new_capacity, self.conv_dim, self.conv_width),
            self.conv_dtype,
            &self.device,
        )?;
        new_conv.slice_set(&self.conv_state, 0, 0)?;

        // Allocate new larger recurrent_state and copy existing data
        let mut recurrent_shape = vec![new_capacity];
        recurrent_shape.extend_from_slice(&self.state_dims);
        let new_recurrent = Tensor::zeros(recurrent_shape, self.recurrent_dtype, &self.device)?;
        new_recurrent.slice_set(&self.recurrent_state, 0, 0)?;

        // Add new slots to free list
        self.free_slots.extend((self.capacity..new_capacity).rev());

        self.conv_state = new_conv;
        self.recurrent_state = new_recurrent;
        self.capacity = new_capacity;

        tracing::info!("Recurrent state pool grew to capacity {new_capacity}");
        Ok(())
    }

    /// Allocate a state slot for a new sequence. Returns the slot index.
    /// The pool grows dynamically if no free slots are available.
    /// The slot's state is reset to zeros to prevent state bleeding.
    pub fn allocate(&mut self) -> Option<usize> {
        if self.free_slots.is_empty() {
            if let Err(e) = self.grow() {
                tracing::error!("Failed to grow recurrent state pool: {e}");
                return None;
            }
        }
        let slot_idx = self.free_slots.pop()?;
        if self.reset_slot(slot_idx).is_err() {
            tracing::warn!("Failed to reset recurrent state slot {slot_idx}, state may be stale");
        }
        Some(slot_idx)
    }

    /// Free a state slot when a sequence completes.
    pub fn free(&mut self, slot_idx: usize) {
        debug_assert!(slot_idx < self.capacity);
        self.free_slots.push(slot_idx);
    }

    /// Gather conv states for the given slot indices
    pub fn gather_conv_state(&self, state_indices: &Tensor) -> Result<Tensor> {
        self.conv_state.index_select(state_indices, 0)
    }

    /// Gather recurrent states for the given slot indices
    pub fn gather_recurrent_state(&self, state_indices: &Tensor) -> Result<Tensor> {
        self.recurrent_state.index_select(state_indices, 0)
    }

    /// Scatter conv states back to the pool for the given slot indices
    pub fn scatter_conv_state(&mut self, state_indices: &Tensor, values: &Tensor) -> Result<()> {
        let indices: Vec<u32> = state_indices.to_vec1()?;
        self.scatter_conv_state_for_indices(&indices, values)
    }

    pub fn scatter_conv_state_for_indices(
        &mut self,
        indices: &[u32],
        values: &Tensor,
    ) -> Result<()> {
        for (batch_idx, &slot_idx) in indices.iter().enumerate() {
            let value = values.i(batch_idx)?.unsqueeze(0)?.contiguous()?;
            self.conv_state.slice_set(&value, 0, slot_idx as usize)?;
        }
        Ok(())
    }

    pub fn scatter_conv_state_with_host_indices(
        &mut self,
        state_indices: &Tensor,
        host_indices: Option<&[u32]>,
        values: &Tensor,
    ) -> Result<()> {
        if let Some(indices) = host_indices {
            self.scatter_conv_state_for_indices(indices, values)
        } else {
            self.scatter_conv_state(state_indices, values)
        }
    }

    /// Scatter recurrent states back to the pool for the given slot indices
    pub fn scatter_recurrent_state(
        &mut self,
        state_indices: &Tensor,
        values: &Tensor,
    ) -> Result<()> {
        let indices: Vec<u32> = state_indices.to_vec1()?;
        self.scatter_recurrent_state_for_indices(&indices, values)
    }

    pub fn scatter_recurrent_state_for_indices(
        &mut self,
        indices: &[u32],
        values: &Tensor,
    ) -> Result<()> {
        for (batch_idx, &slot_idx) in indices.iter().enumerate() {
            let value = values.i(batch_idx)?.unsqueeze(0)?.contiguous()?;
            self.recurrent_state
                .slice_set(&value, 0, slot_idx as usize)?;
        }
        Ok(())
    }

    pub fn scatter_recurrent_state_with_host_indices(
        &mut self,
        state_indices: &Tensor,
        host_indices: Option<&[u32]>,
        values: &Tensor,
    ) -> Result<()> {
        if let Some(indices) = host_indices {
            self.scatter_recurrent_state_for_indices(indices, values)
        } else {
            self.scatter_recurrent_state(state_indices, values)
        }
    }

    /// Reset a specific slot's state to zeros
    pub fn reset_slot(&mut self, slot_idx: usize) -> Result<()> {
        let zero_conv = Tensor::zeros(
            (1, self.conv_dim, self.conv_width),
            self.conv_dtype,
            &self.device,
        )?;

        let mut recurrent_shape = vec![1usize];
        recurrent_shape.extend_from_slice(&self.state_dims);
        let zero_recurrent = Tensor::zeros(recurrent_shape, self.recurrent_dtype, &self.device)?;

        self.conv_state.slice_set(&zero_conv, 0, slot_idx)?;
        self.recurrent_state
            .slice_set(&zero_recurrent, 0, slot_idx)?;
        Ok(())
    }

    /// Reset all slots
    pub fn reset(&mut self) -> Result<()> {
        self.conv_state = self.conv_state.zeros_like()?;
        self.recurrent_state = self.recurrent_state.zeros_like()?;
        self.free_slots = (0..self.capacity).rev().collect();
        Ok(())
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn num_free_slots(&self) -> usize {
        self.free_slots.len()
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn conv_dtype(&self) -> DType {
        self.conv_dtype
    }

    pub fn recurrent_dtype(&self) -> DType {
        self.recurrent_dtype
    }
}

impl Clone for RecurrentStatePool {
    fn clone(&self) -> Self {
        Self {
            conv_state: self.conv_state.clone(),
            recurrent_state: self.recurrent_state.clone(),
            free_slots: self.free_slots.clone(),
            capacity: self.capacity,
            conv_dim: self.conv_dim,
            conv_width: self.conv_width,
            state_dims: self.state_dims.clone(),
            conv_dtype: self.conv_dtype,
            recurrent_dtype: self.recurrent_dtype,
            device: self.device.clone(),
        }
    }
}

/// Per-layer cache that can be either attention (KV) or recurrent (state pool)
#[derive(Clone, Debug)]
pub enum HybridLayerCache {
    Attention(KvCache),
    Recurrent(RecurrentStatePool),
}

impl HybridLayerCache {
    pub fn reset(&mut self) {
        match self {
            Self::Attention(kv) => kv.reset(),
            Self::Recurrent(pool) => {
                let _ = pool.reset();
            }
        }
    }

    pub fn as_kv_cache(&self) -> Option<&KvCache> {
        match self {
            Self::Attention(kv) => Some(kv),
            Self::Recurrent(_) => None,
        }
    }

    pub fn as_kv_cache_mut(&mut self) -> Option<&mut KvCache> {
        match self {
            Self::Attention(kv) => Some(kv),
            Self::Recurrent(_) => None,
        }
    }

    pub fn as_recurrent_pool(&self) -> Option<&RecurrentStatePool> {
        match self {
            Self::Attention(_) => None,
            Self::Recurrent(pool) => Some(pool),
        }
    }

    pub fn as_recurrent_pool_mut(&mut self) -> Option<&mut RecurrentStatePool> {
        match self {
            Self::Attention(_) => None,
            Self::Recurrent(pool) => Some(pool),
        }
    }
}

/// Layer type indicator for hybrid models
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HybridLayerType {
    Attention,
    Recurrent,
}

/// Configuration for the recurrent layer state dimensions
#[derive(Clone, Debug)]
pub struct RecurrentLayerConfig {
    /// Dimension of the convolution state
    pub conv_dim: usize,
    /// Kernel size for causal conv1d
    pub conv_width: usize,
    /// Shape of the recurrent state per slot.
    /// For Mamba: [n_heads, head_dim, d_state]
    /// For GDN: [n_v_heads, key_dim, value_dim]
    pub state_dims: Vec<usize>,
    pub recurrent_dtype: Option<DType>,
}

/// Configuration for creating a hybrid cache
#[derive(Clone, Debug)]
pub struct HybridCacheConfig {
    pub layer_types: Vec<HybridLayerType>,
    pub max_seq_len: usize,
    pub recurrent: RecurrentLayerConfig,
}

/// Hybrid cache that stores per-layer caches for mixed attention/recurrent models
///
/// For continuous batching:
/// - Attention layers use standard KV cache with batching support
/// - Recurrent layers use RecurrentStatePool with indexed access via state_indices
#[derive(Clone, Debug)]
pub struct HybridCache {
    pub caches: Vec<HybridLayerCache>,
    config: HybridCacheConfig,
    /// Current batch's state indices for recurrent pool access.
    /// Set by clone_in_cache before forward, used by model during forward.
    /// Shape: (batch_size,) containing pool slot indices.
    state_indices: Option<Tensor>,
    state_indices_host: Option<Vec<u32>>,
    device_state_indices: Vec<(Device, Tensor)>,
    // Scratch slot CUDA graph pad rows write into; allocated on first use, dropped on reset
    graph_pad_slot: Option<usize>,
}

impl HybridCache {
    pub const CACHE_GROW_SIZE: usize = 512;

    pub fn new(
        config: HybridCacheConfig,
        dtype: candle_core::DType,
        layer_devices: &[Device],
    ) -> Result<Self> {
        if layer_devices.len() != config.layer_types.len() {
            candle_core::bail!(
                "Hybrid cache has {} layers but {} layer devices",
                config.layer_types.len(),
                layer_devices.len()
            );
        }
        let mut caches = Vec::with_capacity(config.layer_types.len());

        for (layer_type, device) in config.layer_types.iter().zip(layer_devices) {
            let cache = match layer_type {
                HybridLayerType::Attention => HybridLayerCache::Attention(KvCache::new_normal(
                    2,
                    config.max_seq_len,
                    Self::CACHE_GROW_SIZE,
                )),
                HybridLayerType::Recurrent => HybridLayerCache::Recurrent(RecurrentStatePool::new(
                    config.recurrent.conv_dim,
                    config.recurrent.conv_width,
                    config.recurrent.state_dims.clone(),
                    dtype,
                    config.recurrent.recurrent_dtype.unwrap_or(dtype),
                    device,
                )?),
            };
            caches.push(cache);
        }

        Ok(Self {
            caches,
            config,
            state_indices: None,
            state_indices_host: None,
            device_state_indices: Vec::new(),
            graph_pad_slot: None,
        })
    }

    /// Slot reserved for CUDA graph pad rows; never handed to a sequence while it lives.
    pub fn graph_pad_slot(&mut self) -> Option<usize> {
        if self.graph_pad_slot.is_none() {
            self.graph_pad_slot = self.allocate_seq();
        }
        self.graph_pad_slot
    }

    pub fn recurrent_devices(&self) -> Vec<Device> {
        self.caches
            .iter()
            .filter_map(|cache| cache.as_recurrent_pool().map(|pool| pool.device().clone()))
            .fold(Vec::new(), |mut devices, device| {
                if !devices.iter().any(|d: &Device| d.same_device(&device)) {
                    devices.push(device);
                }
                devices
            })
    }

    /// Install caller-owned per-device index tensors (e.g. CUDA graph buffers) as the batch's state indices.
    pub fn set_state_indices_tensors(
        &mut self,
        host: Vec<u32>,
        mut tensors: Vec<(Device, Tensor)>,
    ) {
        self.state_indices = (!tensors.is_empty()).then(|| tensors.remove(0).1);
        self.device_state_indices = tensors;
        self.state_indices_host = Some(host);
    }

    /// Slot capacity of the recurrent pools; changes whenever the pool storage is reallocated.
    pub fn recurrent_capacity(&self) -> usize {
        self.caches
            .iter()
            .find_map(|cache| cache.as_recurrent_pool().map(RecurrentStatePool::capacity))
            .unwrap_or(0)
    }

    /// Allocate state slots for a new sequence across all recurrent layers.
    /// Returns the slot index (same for all layers).
    pub fn allocate_seq(&mut self) -> Option<usize> {
        // Collect recurrent layer indices once so rollback can target only recurrent pools.
        let recurrent_layers: Vec<usize> = self
            .caches
            .iter()
            .enumerate()
            .filter_map(|(idx, cache)| match cache {
                HybridLayerCache::Recurrent(_) => Some(idx),
                HybridLayerCache::Attention(_) => None,
            })
            .collect();

        let mut expected_slot = None;
        let mut allocated_slots = Vec::new();

        for &layer_idx in &recurrent_layers {
            let slot_idx = {
                let HybridLayerCache::Recurrent(pool) = &mut self.caches[layer_idx] else {
                    unreachable!("recurrent_layers only contains recurrent entries");
                };
                match pool.allocate() {
                    Some(idx) => idx,
                    None => {
                        for (&rollback_layer_idx, &rollback_slot_idx) in
                            recurrent_layers.iter().zip(allocated_slots.iter())
                        {
                            if let HybridLayerCache::Recurrent(pool) =
                                &mut self.caches[rollback_layer_idx]
                            {
                                pool.free(rollback_slot_idx);
                            }
                        }
                        return None;
                    }
                }
            };

            if let Some(expected) = expected_slot {
                if slot_idx != expected {
                    tracing::warn!(
                        "Hybrid recurrent pool slot mismatch: expected {expected}, got {slot_idx}. Rolling back allocation."
                    );
                    if let HybridLayerCache::Recurrent(pool) = &mut self.caches[layer_idx] {
                        pool.free(slot_idx);
                    }
                    for (&rollback_layer_idx, &rollback_slot_idx) in
                        recurrent_layers.iter().zip(allocated_slots.iter())
                    {
                        if let HybridLayerCache::Recurrent(pool) =
                            &mut self.caches[rollback_layer_idx]
                        {
                            pool.free(rollback_slot_idx);
                        }
                    }
                    return None;
                }
            } else {
                expected_slot = Some(slot_idx);
            }

            allocated_slots.push(slot_idx);
        }

        expected_slot
    }

    /// Free state slots for a sequence across all recurrent layers.
    pub fn free_seq(&mut self, slot_idx: usize) {
        for cache in &mut self.caches {
            if let HybridLayerCache::Recurrent(pool) = cache {
                pool.free(slot_idx);
            }
        }
    }

    /// Reset a specific sequence's state in all recurrent layers.
    pub fn reset_seq(&mut self, slot_idx: usize) -> Result<()> {
        for cache in &mut self.caches {
            if let HybridLayerCache::Recurrent(pool) = cache {
                pool.reset_slot(slot_idx)?;
            }
        }
        Ok(())
    }

    pub fn reset(&mut self) {
        for cache in &mut self.caches {
            cache.reset();
        }
        self.state_indices = None;
        self.state_indices_host = None;
        self.device_state_indices.clear();
        self.graph_pad_slot = None;
    }

    /// Reset the attention caches and only the given recurrent slots; other sequences keep their state.
    pub fn reset_attention_and_slots(&mut self, slots: &[usize]) -> Result<()> {
        for cache in &mut self.caches {
            match cache {
                HybridLayerCache::Attention(kv) => kv.reset(),
                HybridLayerCache::Recurrent(pool) => {
                    for slot in slots {
                        pool.reset_slot(*slot)?;
                    }
                }
            }
        }
        self.state_indices = None;
        self.state_indices_host = None;
        self.device_state_indices.clear();
        Ok(())
    }

    pub fn num_layers(&self) -> usize {
        self.caches.len()
    }

    pub fn layer_types(&self) -> &[HybridLayerType] {
        &self.config.layer_types
    }

    pub fn config(&self) -> &HybridCacheConfig {
        &self.config
    }

    /// Get a mutable reference to a specific layer's cache
    pub fn get_mut(&mut self, layer: usize) -> Option<&mut HybridLayerCache> {
        self.caches.get_mut(layer)
    }

    /// Get a reference to a specific layer's cache
    pub fn get(&self, layer: usize) -> Option<&HybridLayerCache> {
        self.caches.get(layer)
    }

    /// Set the state indices for the current batch.
    /// Called by HybridCacheManager::clone_in_cache before forward.
    pub fn set_state_indices(&mut self, indices: Option<Tensor>) {
        self.state_indices = indices;
        self.state_indices_host = None;
        self.cache_device_state_indices();
    }

    pub fn set_state_indices_with_host(
        &mut self,
        indices: Option<Tensor>,
        host_indices: Option<Vec<u32>>,
    ) {
        self.state_indices = indices;
        self.state_indices_host = host_indices;
        self.cache_device_state_indices();
    }

    fn cache_device_state_indices(&mut self) {
        self.device_state_indices.clear();
        let devices = self
            .caches
            .iter()
            .filter_map(|cache| match cache {
                HybridLayerCache::Recurrent(pool) => Some(pool.device().clone()),
                HybridLayerCache::Attention(_) => None,
            })
            .fold(Vec::<Device>::new(), |mut devices, device| {
                if !devices
                    .iter()
                    .any(|cached_device| cached_device.same_device(&device))
                {
                    devices.push(device);
                }
                devices
            });
        for device in devices {
            if self
                .state_indices
                .as_ref()
                .is_some_and(|indices| indices.device().same_device(&device))
            {
                continue;
            }
            let indices = if let Some(host_indices) = &self.state_indices_host {
                Tensor::from_vec(host_indices.clone(), (host_indices.len(),), &device)
            } else if let Some(indices) = &self.state_indices {
                indices.to_device(&device)
            } else {
                continue;
            };
            if let Ok(indices) = indices {
                self.device_state_indices.push((device, indices));
            }
        }
    }

    /// Get the state indices for the current batch.
    /// Used by the model during forward to access recurrent state pool.
    pub fn state_indices(&self) -> Option<&Tensor> {
        self.state_indices.as_ref()
    }

    pub fn state_indices_host(&self) -> Option<&[u32]> {
        self.state_indices_host.as_deref()
    }

    pub fn state_indices_for_layer(&mut self, layer: usize) -> Result<Option<Tensor>> {
        let device = match self.caches.get(layer) {
            Some(HybridLayerCache::Recurrent(pool)) => pool.device().clone(),
            _ => return Ok(None),
        };
        if let Some(indices) = &self.state_indices {
            if indices.device().same_device(&device) {
                return Ok(Some(indices.clone()));
            }
        }
        if let Some((_, indices)) = self
            .device_state_indices
            .iter()
            .find(|(cached_device, _)| cached_device.same_device(&device))
        {
            return Ok(Some(indices.clone()));
        }
        let indices = if let Some(host_indices) = &self.state_indices_host {
            Tensor::from_vec(host_indices.clone(), (host_indices.len(),), &device)?
        } else if let Some(indices) = &self.state_indices {
            indices.to_device(&device)?
        } else {
            return Ok(None);
        };
        self.device_state_indices.push((device, indices.clone()));
        Ok(Some(indices))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(layer_types: Vec<HybridLayerType>) -> HybridCacheConfig {
        HybridCacheConfig {
            layer_types,
            max_seq_len: 32,
            recurrent: RecurrentLayerConfig {
                conv_dim: 2,
                conv_width: 3,
                state_dims: vec![2, 2],
                recurrent_dtype: None,
            },
        }
    }

    #[test]
    fn requires_one_device_per_layer() {
        let error = HybridCache::new(
            config(vec![HybridLayerType::Attention, HybridLayerType::Recurrent]),
            DType::F32,
            &[Device::Cpu],
        )
        .unwrap_err();
        assert!(error.to_string().contains("1 layer devices"));
    }

    #[test]
    fn recurrent_indices_are_local_to_the_layer_pool() -> Result<()> {
        let devices = vec![Device::Cpu, Device::Cpu, Device::Cpu];
        let mut cache = HybridCache::new(
            config(vec![
                HybridLayerType::Recurrent,
                HybridLayerType::Attention,
                HybridLayerType::Recurrent,
            ]),
            DType::F32,
            &devices,
        )?;
        let state_indices = Tensor::from_vec(vec![1u32, 3], (2,), &Device::Cpu)?;
        cache.set_state_indices_with_host(Some(state_indices), Some(vec![1, 3]));

        assert!(cache.state_indices_for_layer(1)?.is_none());
        for layer in [0, 2] {
            let indices = cache.state_indices_for_layer(layer)?.unwrap();
            let HybridLayerCache::Recurrent(pool) = cache.get(layer).unwrap() else {
                unreachable!()
            };
            assert!(indices.device().same_device(pool.device()));
            assert_eq!(indices.to_vec1::<u32>()?, vec![1, 3]);
        }
        Ok(())
    }
}

impl PastKvLenCache for HybridCache {
    fn get_past_kv_len(&self) -> Result<usize> {
        for cache in &self.caches {
            if let HybridLayerCache::Attention(kv) = cache {
                return Ok(kv.current_seq_len());
            }
        }
        Ok(0)
    }
}

impl HybridCache {
    /// Truncate all attention layer KV caches to the given sequence length.
    /// Recurrent layers are unchanged, use snapshot/restore for recurrent rollback.
    pub fn truncate_attention_to(&mut self, len: usize) -> Result<()> {
        for cache in &mut self.caches {
            if let HybridLayerCache::Attention(kv) = cache {
                kv.set_len(len)?;
            }
        }
        Ok(())
    }
}

/// Snapshot of a single recurrent layer's state for prefix caching.
#[derive(Clone, Debug)]
pub struct RecurrentStateSnapshot {
    pub conv_state: Tensor,
    pub recurrent_state: Tensor,
}

impl HybridCache {
    /// Snapshot the recurrent state for a sequence at the given slot index.
    /// Returns one snapshot per recurrent layer, in layer order.
    #[allow(clippy::cast_possible_truncation)]
    pub fn snapshot_recurrent_state(&self, slot_idx: usize) -> Result<Vec<RecurrentStateSnapshot>> {
        let mut snapshots = Vec::new();
        for cache in &self.caches {
            if let HybridLayerCache::Recurrent(pool) = cache {
                let idx_tensor = Tensor::from_vec(vec![slot_idx as u32], (1,), pool.device())?;
                let conv = pool.gather_conv_state(&idx_tensor)?;
                let recurrent = pool.gather_recurrent_state(&idx_tensor)?;
                snapshots.push(RecurrentStateSnapshot {
                    conv_state: conv,
                    recurrent_state: recurrent,
                });
            }
        }
        Ok(snapshots)
    }

    /// Restore recurrent state snapshots into the pool at the given slot index.
    /// Snapshots must be in the same layer order as returned by `snapshot_recurrent_state`.
    #[allow(clippy::cast_possible_truncation)]
    pub fn restore_recurrent_state(
        &mut self,
        slot_idx: usize,
        snapshots: &[RecurrentStateSnapshot],
    ) -> Result<()> {
        let mut snap_iter = snapshots.iter();
        for cache in &mut self.caches {
            if let HybridLayerCache::Recurrent(pool) = cache {
                if let Some(snap) = snap_iter.next() {
                    let conv = snap.conv_state.to_device(pool.device())?;
                    let recurrent = snap.recurrent_state.to_device(pool.device())?;
                    let idx_tensor = Tensor::from_vec(vec![slot_idx as u32], (1,), pool.device())?;
                    pool.scatter_conv_state(&idx_tensor, &conv)?;
                    pool.scatter_recurrent_state(&idx_tensor, &recurrent)?;
                }
            }
        }
        Ok(())
    }
}

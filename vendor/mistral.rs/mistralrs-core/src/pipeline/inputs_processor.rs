#![allow(clippy::cast_possible_truncation)]

use std::{any::Any, sync::Arc};

use anyhow::Result;
use candle_core::Device;
use text_models_inputs_processor::PagedAttentionMeta;
use tokenizers::Tokenizer;

use crate::{device_map::DeviceMapper, sequence::Sequence};

#[derive(PartialEq)]
pub enum InputsProcessorType {
    Text,
    Vision,
    Embedding,
}

pub struct InputProcessorOutput {
    pub inputs: Box<dyn Any>,
    pub seq_indices: Vec<usize>,
}

/// Processor: Prepare inputs for the model (potentially preparing the images if applicable)
pub trait InputsProcessor {
    fn prepare_for_paged_prompt_planning(
        &self,
        _tokenizer: Option<Arc<Tokenizer>>,
        _input_seqs: &mut [&mut Sequence],
        _device: &Device,
        _other_config: Option<Arc<dyn Any>>,
        _paged_attn_metadata: Option<&mut PagedAttentionMeta>,
    ) -> Result<()> {
        Ok(())
    }

    /// This should also enable matmul via f16 if prompt and the sequence length is greater than 32.
    /// Otherwise, matmul via f16 is disabled.
    ///
    /// This should return a type which can be downcasted to the proper type as used in `forward_inputs`
    #[allow(clippy::too_many_arguments)]
    fn process_inputs(
        &self,
        tokenizer: Option<Arc<Tokenizer>>,
        input_seqs: &mut [&mut Sequence],
        is_prompt: bool,
        is_xlora: bool,
        device: &Device,
        no_kv_cache: bool,
        last_n_context_len: Option<(usize, usize)>,
        return_raw_logits: bool,
        sliding_window: Option<usize>,
        other_config: Option<Arc<dyn Any>>,
        paged_attn_metadata: Option<PagedAttentionMeta>,
        mapper: Option<&dyn DeviceMapper>,
    ) -> Result<InputProcessorOutput>;

    fn get_type(&self) -> InputsProcessorType;
}

// ========================= Test models input processor

pub mod text_models_inputs_processor {
    use std::{any::Any, collections::HashMap, fmt::Debug, sync::Arc};

    use anyhow::Result;
    use candle_core::{DType, Device, DeviceLocation, Tensor, WithDType};
    use tokenizers::Tokenizer;

    use crate::{
        device_map::DeviceMapper,
        flashinfer::{
            decode_split_capacity_pages as flashinfer_decode_split_capacity_pages,
            decode_split_pages as flashinfer_decode_split_pages, flashinfer_metadata,
            flashinfer_paged_kv, flashinfer_tile_plan, flashinfer_view,
            make_paged_kv_decode_tensors, make_paged_kv_decode_tensors_from_lens,
            make_paged_kv_tensors, FlashInferMetadata, FlashInferPagedAttentionView,
            FlashInferPagedAttentionViews,
        },
        get_mut_arcmutex,
        paged_attention::{
            block_aligned_sliding_window_start,
            block_hash::{noncausal_mm_ranges, MultimodalAttentionPolicy},
            AttentionBackendKind, KVCacheManager, _PAD_SLOT_ID,
        },
        pipeline::RecurrentBatchKind,
        sequence::Sequence,
        AdapterLease,
    };

    use super::{InputProcessorOutput, InputsProcessor, InputsProcessorType};

    const CUDA_GRAPH_CONTEXT_BUCKET_TOKENS: usize = 2048;

    fn cuda_graph_block_table_len_with_cap(
        blocks: usize,
        block_size: usize,
        enable_cuda_graph_padding: bool,
        max_context_len: Option<usize>,
    ) -> usize {
        if !enable_cuda_graph_padding || !crate::perf_flags::cuda_graphs_enabled() {
            return blocks;
        }
        if let Some(max_context_len) = max_context_len {
            return max_context_len.div_ceil(block_size).max(blocks).max(1);
        }
        let block_bucket = CUDA_GRAPH_CONTEXT_BUCKET_TOKENS.div_ceil(block_size).max(1);
        blocks.div_ceil(block_bucket).max(1) * block_bucket
    }

    fn _make_tensor_with_pad<D: WithDType>(
        x: Vec<Vec<D>>,
        max_len: usize,
        pad: D,
        device: &Device,
    ) -> Result<Tensor> {
        let mut padded_x = Vec::new();
        for mut x_i in x {
            assert!(x_i.len() <= max_len);
            x_i.extend([pad].repeat(max_len - x_i.len()));
            let shape = (x_i.len(),);
            padded_x.push(Tensor::from_vec(x_i, shape, device)?);
        }
        Tensor::cat(&padded_x[..], 0).map_err(anyhow::Error::msg)
    }

    #[derive(Clone)]
    pub struct PagedAttentionMeta {
        pub sliding_window: Option<usize>,
        pub block_size: usize,
        pub max_paged_context_len: usize,
        pub attention_backend: AttentionBackendKind,
        pub has_flashinfer_decode_layers: bool,
        pub prefill_attention_heads: usize,
        pub prefill_key_value_heads: usize,
        pub prefill_head_dim: usize,
        pub kv_cache_manager: Arc<tokio::sync::Mutex<KVCacheManager>>,
        pub prompt_chunk_attention_policy: MultimodalAttentionPolicy,
        pub has_noncausal_mm_context: bool,
        pub mm_prefix_ranges_by_seq_id: HashMap<usize, Vec<(usize, usize)>>,
        pub full_mm_prefix_ranges_by_seq_id: HashMap<usize, Vec<(usize, usize)>>,
        pub(crate) enable_packed_prefill: bool,
        /// False only for non-final chunks of a chunked prompt; block-diffusion models skip
        /// canvas generation until the prompt is fully encoded.
        pub is_final_prompt_chunk: bool,
    }

    impl PagedAttentionMeta {
        pub(crate) fn set_noncausal_mm_context(&mut self, input_seqs: &[&mut Sequence]) {
            self.set_noncausal_mm_context_views(input_seqs, true);
        }

        pub(crate) fn set_noncausal_mm_context_views(
            &mut self,
            input_seqs: &[&mut Sequence],
            include_full_attention: bool,
        ) {
            self.mm_prefix_ranges_by_seq_id.clear();
            self.full_mm_prefix_ranges_by_seq_id.clear();
            for seq in input_seqs {
                let full_ranges = noncausal_mm_ranges(seq.mm_features(), None);
                if !full_ranges.is_empty() {
                    if include_full_attention {
                        self.full_mm_prefix_ranges_by_seq_id
                            .insert(*seq.id(), full_ranges.clone());
                    }
                    self.mm_prefix_ranges_by_seq_id
                        .insert(*seq.id(), full_ranges);
                }
            }
            self.has_noncausal_mm_context = !self.mm_prefix_ranges_by_seq_id.is_empty()
                || !self.full_mm_prefix_ranges_by_seq_id.is_empty();
        }
    }

    #[derive(Clone, Debug)]
    #[allow(dead_code)]
    pub struct PagedAttentionInputMetadata {
        /// Block tables, windowed when a global sliding_window is set.
        pub block_tables: Option<HashMap<DeviceLocation, Tensor>>,
        /// Context lens, capped by sliding_window when set.
        pub context_lens: Option<HashMap<DeviceLocation, Tensor>>,
        pub block_size: Option<usize>,
        pub paged_context_lens_cpu: Option<Vec<usize>>,
        pub full_paged_context_lens_cpu: Option<Vec<usize>>,
        pub slot_mappings: HashMap<DeviceLocation, Tensor>,
        pub max_context_len: Option<usize>,
        /// Full (unwindowed) block tables, always covering the entire context.
        /// For models with per-layer sliding windows (GPT-OSS, Gemma2), layers
        /// without a sliding window should use these instead of `block_tables`.
        pub full_block_tables: Option<HashMap<DeviceLocation, Tensor>>,
        /// Full context lens (not capped by sliding_window).
        pub full_context_lens: Option<HashMap<DeviceLocation, Tensor>>,
        pub full_max_context_len: Option<usize>,
        pub is_first_prompt_chunk: bool,
        pub is_final_prompt_chunk: bool,
        pub prompt_chunk_attention_policy: MultimodalAttentionPolicy,
        pub has_noncausal_mm_context: bool,
        pub mm_prefix_ranges: Option<HashMap<DeviceLocation, Tensor>>,
        pub full_mm_prefix_ranges: Option<HashMap<DeviceLocation, Tensor>>,
        pub prefill_attention_heads: usize,
        pub prefill_key_value_heads: usize,
        pub prefill_head_dim: usize,
        pub flashinfer: Option<FlashInferMetadata>,
        pub rope_positions: Option<HashMap<DeviceLocation, Tensor>>,
        /// Number of cached tokens per sequence (from prefix cache hits).
        /// When present and > 0, gather_kv_cache + Sdpa is used during prefill
        /// instead of flash attention. The Q/K/V tensors should only contain
        /// the NEW (non-cached) tokens.
        pub num_cached_tokens: Option<Vec<usize>>,
        /// Number of new tokens per sequence (query lengths).
        pub query_lens: Option<Vec<usize>>,
        /// Cumulative query lengths [batch+1], u32, for Sdpa varlen flash path.
        /// Precomputed to avoid Tensor::new in the forward hot path.
        pub cu_seqlens_q: Option<HashMap<DeviceLocation, Tensor>>,
        /// Cumulative KV lengths [batch+1], u32, for gather_kv_cache and flash_attn_varlen.
        /// Each entry is sum of (cached + new) tokens.
        pub cu_seqlens_kv: Option<HashMap<DeviceLocation, Tensor>>,
        /// Host rows this decode metadata was built from (decode steps only).
        pub decode_rows: Option<Arc<DecodePagedRows>>,
    }

    impl PagedAttentionInputMetadata {
        /// Create a dummy input metadata, assuming that this will NOT be used for decoding.
        /// This is used for the case of imatrix generation.
        pub fn dummy(dev: &Device) -> candle_core::Result<Self> {
            Ok(PagedAttentionInputMetadata {
                block_tables: None,
                context_lens: None,
                block_size: None,
                paged_context_lens_cpu: None,
                full_paged_context_lens_cpu: None,
                max_context_len: None,
                full_block_tables: None,
                full_context_lens: None,
                full_max_context_len: None,
                slot_mappings: HashMap::from([(dev.location(), Tensor::new(&[0f32], dev)?)]),
                is_first_prompt_chunk: true,
                is_final_prompt_chunk: true,
                prompt_chunk_attention_policy: MultimodalAttentionPolicy::Causal,
                has_noncausal_mm_context: false,
                mm_prefix_ranges: None,
                full_mm_prefix_ranges: None,
                prefill_attention_heads: 1,
                prefill_key_value_heads: 1,
                prefill_head_dim: 1,
                flashinfer: None,
                rope_positions: None,
                num_cached_tokens: None,
                query_lens: None,
                cu_seqlens_q: None,
                cu_seqlens_kv: None,
                decode_rows: None,
            })
        }

        /// Build metadata for a prefill whose query tensor has been reduced to
        /// selected logits positions while K/V still live in the original paged
        /// cache. This is used by KV-sharing models that can skip hidden-state
        /// work for prompt tokens that will not produce logits.
        pub(crate) fn for_reduced_prefill_queries(
            &self,
            devices: &[Device],
            num_cached_tokens: &[usize],
            query_lens: &[usize],
        ) -> Result<Self> {
            if num_cached_tokens.len() != query_lens.len() {
                anyhow::bail!(
                    "reduced prefill metadata length mismatch: cached={} query={}",
                    num_cached_tokens.len(),
                    query_lens.len()
                );
            }
            if query_lens.is_empty() || query_lens.contains(&0) {
                anyhow::bail!("reduced prefill metadata requires at least one query token");
            }

            let batch_size = query_lens.len();
            let max_query_len = query_lens.iter().copied().max().unwrap_or(0);
            let slot_mappings_cpu = _make_tensor_with_pad(
                query_lens.iter().map(|len| vec![0i64; *len]).collect(),
                max_query_len,
                _PAD_SLOT_ID,
                &Device::Cpu,
            )?
            .reshape((batch_size, max_query_len))?;

            let context_lens = num_cached_tokens
                .iter()
                .zip(query_lens.iter())
                .map(|(cached, query)| cached + query)
                .collect::<Vec<_>>();
            let context_lens_cpu = Tensor::from_vec(
                context_lens
                    .iter()
                    .map(|len| *len as u32)
                    .collect::<Vec<_>>(),
                (batch_size,),
                &Device::Cpu,
            )?;
            let mut rope_positions = Vec::with_capacity(batch_size * max_query_len);
            for (&cached, &query_len) in num_cached_tokens.iter().zip(query_lens.iter()) {
                for seq_idx in 0..max_query_len {
                    let seq_idx = seq_idx.min(query_len - 1);
                    rope_positions.push((cached + seq_idx) as u32);
                }
            }
            let rope_positions_cpu =
                Tensor::from_vec(rope_positions, (batch_size * max_query_len,), &Device::Cpu)?;

            let mut cu_q = Vec::with_capacity(batch_size + 1);
            cu_q.push(0u32);
            for &query_len in query_lens {
                cu_q.push(cu_q.last().copied().unwrap_or(0) + query_len as u32);
            }
            let cu_q_cpu = Tensor::from_vec(cu_q, (batch_size + 1,), &Device::Cpu)?;

            let mut cu_kv = Vec::with_capacity(batch_size + 1);
            cu_kv.push(0u32);
            for (&cached, &query_len) in num_cached_tokens.iter().zip(query_lens.iter()) {
                cu_kv.push(cu_kv.last().copied().unwrap_or(0) + (cached + query_len) as u32);
            }
            let cu_kv_cpu = Tensor::from_vec(cu_kv, (batch_size + 1,), &Device::Cpu)?;
            let block_size = self
                .block_size
                .ok_or_else(|| anyhow::anyhow!("missing paged attention block size"))?;
            let paged_decode_context_lens = self
                .paged_context_lens_cpu
                .as_deref()
                .unwrap_or(&context_lens);
            let full_decode_context_lens = self
                .full_paged_context_lens_cpu
                .as_deref()
                .unwrap_or(paged_decode_context_lens);
            let (
                decode_request_indices_cpu,
                decode_kv_tile_indices_cpu,
                decode_o_indptr_cpu,
                decode_kv_chunk_size_cpu,
                decode_block_valid_mask_cpu,
            ) = make_paged_kv_decode_tensors_from_lens(
                paged_decode_context_lens,
                block_size,
                Some(flashinfer_decode_split_pages(
                    block_size,
                    batch_size,
                    self.prefill_key_value_heads,
                    paged_decode_context_lens.iter().copied().max().unwrap_or(0),
                )),
            )?;
            let (
                full_decode_request_indices_cpu,
                full_decode_kv_tile_indices_cpu,
                full_decode_o_indptr_cpu,
                full_decode_kv_chunk_size_cpu,
                full_decode_block_valid_mask_cpu,
            ) = make_paged_kv_decode_tensors_from_lens(
                full_decode_context_lens,
                block_size,
                Some(flashinfer_decode_split_pages(
                    block_size,
                    batch_size,
                    self.prefill_key_value_heads,
                    full_decode_context_lens.iter().copied().max().unwrap_or(0),
                )),
            )?;

            let mut slot_mappings = HashMap::new();
            let mut context_lens_map = HashMap::new();
            let mut rope_positions = HashMap::new();
            let mut cu_q_map = HashMap::new();
            let mut cu_kv_map = HashMap::new();
            let mut decode_request_indices_map = HashMap::new();
            let mut decode_kv_tile_indices_map = HashMap::new();
            let mut decode_o_indptr_map = HashMap::new();
            let mut decode_kv_chunk_size_map = HashMap::new();
            let mut decode_block_valid_mask_map = HashMap::new();
            let mut full_decode_request_indices_map = HashMap::new();
            let mut full_decode_kv_tile_indices_map = HashMap::new();
            let mut full_decode_o_indptr_map = HashMap::new();
            let mut full_decode_kv_chunk_size_map = HashMap::new();
            let mut full_decode_block_valid_mask_map = HashMap::new();
            for device in devices {
                slot_mappings.insert(device.location(), slot_mappings_cpu.to_device(device)?);
                context_lens_map.insert(device.location(), context_lens_cpu.to_device(device)?);
                rope_positions.insert(device.location(), rope_positions_cpu.to_device(device)?);
                cu_q_map.insert(device.location(), cu_q_cpu.to_device(device)?);
                cu_kv_map.insert(device.location(), cu_kv_cpu.to_device(device)?);
                decode_request_indices_map.insert(
                    device.location(),
                    decode_request_indices_cpu.to_device(device)?,
                );
                decode_kv_tile_indices_map.insert(
                    device.location(),
                    decode_kv_tile_indices_cpu.to_device(device)?,
                );
                decode_o_indptr_map
                    .insert(device.location(), decode_o_indptr_cpu.to_device(device)?);
                decode_kv_chunk_size_map.insert(
                    device.location(),
                    decode_kv_chunk_size_cpu.to_device(device)?,
                );
                decode_block_valid_mask_map.insert(
                    device.location(),
                    decode_block_valid_mask_cpu.to_device(device)?,
                );
                full_decode_request_indices_map.insert(
                    device.location(),
                    full_decode_request_indices_cpu.to_device(device)?,
                );
                full_decode_kv_tile_indices_map.insert(
                    device.location(),
                    full_decode_kv_tile_indices_cpu.to_device(device)?,
                );
                full_decode_o_indptr_map.insert(
                    device.location(),
                    full_decode_o_indptr_cpu.to_device(device)?,
                );
                full_decode_kv_chunk_size_map.insert(
                    device.location(),
                    full_decode_kv_chunk_size_cpu.to_device(device)?,
                );
                full_decode_block_valid_mask_map.insert(
                    device.location(),
                    full_decode_block_valid_mask_cpu.to_device(device)?,
                );
            }
            let full_context_lens = self
                .full_block_tables
                .as_ref()
                .map(|_| context_lens_map.clone());
            let full_max_context_len = self
                .full_block_tables
                .as_ref()
                .and_then(|_| context_lens.iter().copied().max());
            let flashinfer =
                self.flashinfer.as_ref().map(|flashinfer| {
                    let decode_tile_plan = flashinfer_tile_plan(
                        decode_request_indices_map.clone(),
                        decode_kv_tile_indices_map.clone(),
                        decode_o_indptr_map.clone(),
                        decode_kv_chunk_size_map.clone(),
                        decode_block_valid_mask_map.clone(),
                    );
                    let full_decode_tile_plan = flashinfer_tile_plan(
                        full_decode_request_indices_map.clone(),
                        full_decode_kv_tile_indices_map.clone(),
                        full_decode_o_indptr_map.clone(),
                        full_decode_kv_chunk_size_map.clone(),
                        full_decode_block_valid_mask_map.clone(),
                    );
                    let logical_tile_plan = if flashinfer.views.sliding.is_some() {
                        full_decode_tile_plan
                    } else {
                        decode_tile_plan.clone()
                    };
                    let logical = FlashInferPagedAttentionView {
                        tile_plan: logical_tile_plan,
                        ..flashinfer.views.logical.clone()
                    };
                    let sliding = flashinfer.views.sliding.as_ref().map(|view| {
                        FlashInferPagedAttentionView {
                            tile_plan: decode_tile_plan,
                            ..view.clone()
                        }
                    });
                    FlashInferMetadata {
                        views: FlashInferPagedAttentionViews { logical, sliding },
                        decode_tmp_v: None,
                        decode_tmp_s: None,
                    }
                });

            Ok(PagedAttentionInputMetadata {
                block_tables: self.block_tables.clone(),
                context_lens: Some(context_lens_map),
                block_size: self.block_size,
                paged_context_lens_cpu: Some(paged_decode_context_lens.to_vec()),
                full_paged_context_lens_cpu: Some(full_decode_context_lens.to_vec()),
                slot_mappings,
                max_context_len: context_lens.iter().copied().max(),
                full_block_tables: self.full_block_tables.clone(),
                full_context_lens,
                full_max_context_len,
                is_first_prompt_chunk: false,
                is_final_prompt_chunk: self.is_final_prompt_chunk,
                prompt_chunk_attention_policy: MultimodalAttentionPolicy::Causal,
                has_noncausal_mm_context: self.has_noncausal_mm_context,
                mm_prefix_ranges: self.mm_prefix_ranges.clone(),
                full_mm_prefix_ranges: self.full_mm_prefix_ranges.clone(),
                prefill_attention_heads: self.prefill_attention_heads,
                prefill_key_value_heads: self.prefill_key_value_heads,
                prefill_head_dim: self.prefill_head_dim,
                flashinfer,
                rope_positions: Some(rope_positions),
                num_cached_tokens: Some(num_cached_tokens.to_vec()),
                query_lens: Some(query_lens.to_vec()),
                cu_seqlens_q: Some(cu_q_map),
                cu_seqlens_kv: Some(cu_kv_map),
                decode_rows: None,
            })
        }
    }

    /// Flash attention sequence length metadata.
    ///
    /// `cumulative_seqlens_q/k` describe the physical Q/K layout. They use padded
    /// lengths for normal batches and logical lengths when `packed` is true.
    ///
    /// `logical_k` describes full logical K lengths. `sliding_k`, when present,
    /// describes the physical K lengths returned by a rotating/sliding KV cache.
    ///
    /// For the **prefix cache path**, K/V are gathered from the paged cache into a
    /// packed (non-padded) layout via `gather_kv_cache`. The packed K/V lengths are
    /// given by `PagedAttentionInputMetadata::cu_seqlens_kv`, NOT by the normal
    /// `logical_k/sliding_k` metadata here. The prefix cache attention call must
    /// build a local `FlashParams` matching the gathered KV layout.
    #[derive(Clone, Debug)]
    pub struct FlashKMeta {
        pub max: u32,
        pub cumulative_seqlens: HashMap<DeviceLocation, Tensor>,
    }

    impl FlashKMeta {
        pub fn empty() -> Self {
            Self {
                max: 0,
                cumulative_seqlens: HashMap::new(),
            }
        }
    }

    #[derive(Clone, Debug)]
    pub struct FlashParams {
        pub max_q: u32,
        pub cumulative_seqlens_q: HashMap<DeviceLocation, Tensor>,
        pub logical_k: FlashKMeta,
        pub sliding_k: Option<FlashKMeta>,
        pub causal: bool,
        pub(crate) packed: bool,
        #[cfg_attr(
            not(any(all(feature = "cuda", target_family = "unix"), feature = "metal")),
            allow(dead_code)
        )]
        pub(crate) varlen_segment_lens: Option<Vec<usize>>,
    }

    impl FlashParams {
        pub fn empty(causal: bool) -> Self {
            Self {
                max_q: 0,
                cumulative_seqlens_q: HashMap::new(),
                logical_k: FlashKMeta::empty(),
                sliding_k: None,
                causal,
                packed: false,
                varlen_segment_lens: None,
            }
        }

        pub fn k_meta(&self, sliding_window: Option<usize>) -> &FlashKMeta {
            if sliding_window.is_some() {
                self.sliding_k.as_ref().unwrap_or(&self.logical_k)
            } else {
                &self.logical_k
            }
        }
    }

    pub struct InputMetadata {
        pub input: Tensor,
        pub positions: Vec<usize>,
        pub context_lens: Vec<(usize, usize)>, // (start index, len)
        pub position_ids: Vec<usize>,
        pub paged_attn_meta: Option<PagedAttentionInputMetadata>, // For paged attention
        pub flash_meta: FlashParams,
    }

    pub struct InnerInputProcessorOutput {
        pub inputs: InputMetadata,
        pub seq_indices: Vec<usize>,
    }

    fn flash_param_devices(device: &Device, mapper: Option<&dyn DeviceMapper>) -> Vec<Device> {
        mapper
            .map(|mapper| mapper.get_unique_devices())
            .unwrap_or_else(|| vec![device.clone()])
    }

    fn cumulative_seqlens_map(
        lengths: &[u32],
        devices: &[Device],
    ) -> Result<(u32, HashMap<DeviceLocation, Tensor>)> {
        let max = *lengths.iter().max().unwrap_or(&0);
        if devices.is_empty() {
            return Ok((max, HashMap::new()));
        }

        // Create tensors on CPU first to avoid CUDA context issues when copying
        // between different GPU devices. Each GPU has its own CUDA context, and
        // candle/cudarc doesn't properly switch contexts when doing GPU-to-GPU
        // transfers (which go through CPU). By creating on CPU first, we avoid
        // the cross-context memory access that causes CUDA_ERROR_INVALID_VALUE.
        let cumulative_seqlens = Tensor::new(lengths, &Device::Cpu)?
            .to_dtype(DType::F32)?
            .cumsum(0)?
            .to_dtype(DType::U32)?;

        let mut cumulative_seqlens_map = HashMap::new();
        for device in devices {
            cumulative_seqlens_map.insert(device.location(), cumulative_seqlens.to_device(device)?);
        }

        Ok((max, cumulative_seqlens_map))
    }

    fn packed_rope_positions(seqlen_offsets: &[usize], query_lens: &[usize]) -> Result<Vec<u32>> {
        if seqlen_offsets.len() != query_lens.len() {
            anyhow::bail!(
                "packed RoPE position length mismatch: {} offsets for {} queries",
                seqlen_offsets.len(),
                query_lens.len()
            );
        }
        let mut positions = Vec::with_capacity(query_lens.iter().sum());
        for (&offset, &query_len) in seqlen_offsets.iter().zip(query_lens) {
            for position in offset..offset + query_len {
                positions.push(u32::try_from(position)?);
            }
        }
        Ok(positions)
    }

    fn sliding_k_lengths(
        seqlens_q: &[u32],
        seqlens_k: &[u32],
        sliding_window: usize,
    ) -> Result<Vec<u32>> {
        if seqlens_q.len() != seqlens_k.len() {
            anyhow::bail!(
                "sliding FlashAttention metadata length mismatch: q={} k={}",
                seqlens_q.len(),
                seqlens_k.len()
            );
        }
        let window = u32::try_from(sliding_window)?;
        seqlens_q
            .iter()
            .zip(seqlens_k)
            .map(|(&query_len, &logical_k_len)| {
                let past_len = logical_k_len.checked_sub(query_len).ok_or_else(|| {
                    anyhow::anyhow!(
                        "sliding FlashAttention query length {query_len} exceeds K length {logical_k_len}"
                    )
                })?;
                if query_len > 1 {
                    past_len
                        .min(window)
                        .checked_add(query_len)
                        .ok_or_else(|| anyhow::anyhow!("sliding FlashAttention K length overflow"))
                } else {
                    Ok(logical_k_len.min(window))
                }
            })
            .collect()
    }

    pub(crate) fn make_flash_params(
        device: &Device,
        mapper: Option<&dyn DeviceMapper>,
        seqlens_q: &[u32],
        seqlens_k: &[u32],
        sliding_window: Option<usize>,
        causal: bool,
        packed: bool,
    ) -> Result<FlashParams> {
        let devices = flash_param_devices(device, mapper);
        let (max_q, cumulative_seqlens_q) = cumulative_seqlens_map(seqlens_q, &devices)?;
        let (logical_max_k, logical_cumulative_seqlens_k) =
            cumulative_seqlens_map(seqlens_k, &devices)?;
        let logical_k = FlashKMeta {
            max: logical_max_k,
            cumulative_seqlens: logical_cumulative_seqlens_k,
        };
        let sliding_k = sliding_window
            .map(|window| -> Result<FlashKMeta> {
                let sliding_seqlens_k = sliding_k_lengths(seqlens_q, seqlens_k, window)?;
                let (sliding_max_k, sliding_cumulative_seqlens_k) =
                    cumulative_seqlens_map(&sliding_seqlens_k, &devices)?;
                Ok(FlashKMeta {
                    max: sliding_max_k,
                    cumulative_seqlens: sliding_cumulative_seqlens_k,
                })
            })
            .transpose()?;

        Ok(FlashParams {
            max_q,
            cumulative_seqlens_q,
            logical_k,
            sliding_k,
            causal,
            packed,
            varlen_segment_lens: None,
        })
    }

    // chunk_offset_toks is the number of tokens by which the tokens are offset,
    // chunk_offset_toks / prompt_chunksize = number of batches
    //
    // prefix_cache_lens: when provided, indicates how many tokens per sequence are already
    // cached in the paged KV cache. Only new (non-cached) tokens will be included in the
    // input tensor, and slot_mappings will only cover new token slots. Block tables still
    // cover the entire context so that context_attention_fwd can read cached blocks.
    #[allow(clippy::too_many_arguments)]
    pub fn make_prompt_chunk<T: WithDType + Debug>(
        chunk_offset_toks: usize,
        toks: Vec<&[T]>,
        seq_ids: &[usize],
        device: &Device,
        last_n_context_len: Option<(usize, usize)>,
        return_raw_logits: bool,
        mut paged_attn_metadata: Option<&mut PagedAttentionMeta>,
        mapper: Option<&dyn DeviceMapper>,
        prefix_cache_lens: Option<&[usize]>,
        sliding_window: Option<usize>,
        allow_packed_prefill: bool,
    ) -> Result<InputMetadata> {
        // Determine effective tokens per sequence after prefix cache trimming
        let effective_lens: Vec<usize> = toks
            .iter()
            .enumerate()
            .map(|(i, seq)| {
                let cached = prefix_cache_lens.map_or(0, |lens| lens[i]);
                seq.len().saturating_sub(cached)
            })
            .collect();
        let max_len = *effective_lens.iter().max().expect("No sequences");
        let padding_tok = T::zero();
        let has_any_cache_hit = prefix_cache_lens.is_some_and(|lens| lens.iter().any(|&l| l > 0));
        let prompt_chunk_causal = paged_attn_metadata.as_ref().is_none_or(|metadata| {
            metadata.prompt_chunk_attention_policy == MultimodalAttentionPolicy::Causal
        });
        let all_model_devices_cuda = mapper.is_none_or(|mapper| {
            mapper
                .get_unique_devices()
                .iter()
                .all(|device| device.is_cuda())
        });
        let packed_prefill = allow_packed_prefill
            && effective_lens.len() > 1
            && effective_lens.iter().any(|len| *len != max_len)
            && device.is_cuda()
            && all_model_devices_cuda
            && crate::using_flash_attn()
            && !return_raw_logits
            && last_n_context_len.is_none()
            && chunk_offset_toks == 0
            && !has_any_cache_hit
            && paged_attn_metadata.as_ref().is_some_and(|metadata| {
                metadata.enable_packed_prefill
                    && metadata.is_final_prompt_chunk
                    && metadata.prompt_chunk_attention_policy == MultimodalAttentionPolicy::Causal
            });
        if packed_prefill {
            tracing::debug!(
                sequences = effective_lens.len(),
                tokens = effective_lens.iter().sum::<usize>(),
                padded_tokens = effective_lens.len() * max_len,
                "Using packed prompt prefill"
            );
        }
        let mut seqs_tensors = Vec::new();
        let mut seqlen_offsets = Vec::new();
        let mut context_lens = Vec::new();
        let mut position_ids = Vec::new();
        let mut slot_mappings = Vec::new();
        let mut block_tables = Vec::new();
        let mut full_block_tables = Vec::new();
        let mut paged_attn_context_lens = Vec::new();
        let mut full_paged_attn_context_lens = Vec::new();
        let flash_attn = crate::using_flash_attn();
        let mut seqlens_q = if flash_attn { vec![0] } else { Vec::new() };
        let mut seqlens_k = if flash_attn { vec![0] } else { Vec::new() };
        let mut num_cached_tokens_vec: Vec<usize> = Vec::new();
        let mut query_lens_vec: Vec<usize> = Vec::new();
        for (seq_idx, (seq_id, ctxt)) in seq_ids.iter().zip(&toks).enumerate() {
            let cached = prefix_cache_lens.map_or(0, |lens| lens[seq_idx]);
            let full_prompt_len = ctxt.len();
            // The new (non-cached) tokens to process
            let new_toks = &ctxt[cached..];
            let new_len = new_toks.len();

            let offset = last_n_context_len.unwrap_or_default();
            // seqlen_offset includes cached prefix so position IDs are correct
            seqlen_offsets.push(offset.1 + chunk_offset_toks + cached);

            position_ids.push(new_len + chunk_offset_toks + cached);
            let mut input_toks = new_toks.to_vec();
            if !packed_prefill {
                input_toks.extend(std::iter::repeat_n(
                    padding_tok,
                    max_len.saturating_sub(input_toks.len()),
                ));
            }
            // If we are returning raw logits, we want to not trim the logits at all.
            if return_raw_logits {
                if last_n_context_len.is_some() {
                    anyhow::bail!("`return_raw_logits` is incompatible with `last_n_context_len`");
                }

                context_lens.push((0, input_toks.len()));
            } else {
                context_lens.push((
                    new_len.saturating_sub(last_n_context_len.map(|(a, _)| a).unwrap_or(1)),
                    last_n_context_len.map(|(a, _)| a).unwrap_or(1),
                ));
            }

            if flash_attn {
                seqlens_q.push(input_toks.len() as u32);
                seqlens_k.push((input_toks.len() + chunk_offset_toks + cached) as u32);
            }

            seqs_tensors.push(Tensor::new(input_toks, device)?.unsqueeze(0)?);

            if has_any_cache_hit {
                num_cached_tokens_vec.push(cached);
                query_lens_vec.push(new_len);
            }

            if let Some(paged_attn_metadata) = &mut paged_attn_metadata {
                let kv_mgr = get_mut_arcmutex!(paged_attn_metadata.kv_cache_manager);
                let block_ids = kv_mgr.get_block_ids(*seq_id);

                if block_ids.is_none() {
                    // Will be None during profiling.
                    slot_mappings.push([_PAD_SLOT_ID].repeat(new_len));
                    continue;
                }
                let table: Vec<usize> = block_ids.unwrap().to_vec();
                drop(kv_mgr);

                // Slot mappings only for new tokens (cached tokens are already in cache)
                let slot_start = cached + chunk_offset_toks;
                let slot_end = full_prompt_len + chunk_offset_toks;
                let mut slot_mapping = Vec::new();
                let mut ctxt_len = Vec::new();
                for i in slot_start..slot_end {
                    ctxt_len.push(i);

                    let block_number = if i / paged_attn_metadata.block_size >= table.len() {
                        panic!(
                            "Block table is too small (prompt)! i={} block_size={} table_len={}",
                            i,
                            paged_attn_metadata.block_size,
                            table.len()
                        );
                    } else {
                        table.get(i / paged_attn_metadata.block_size).unwrap()
                    };
                    let block_offset = i % paged_attn_metadata.block_size;
                    // Use checked arithmetic to prevent overflow
                    let slot = block_number
                        .checked_mul(paged_attn_metadata.block_size)
                        .and_then(|v| v.checked_add(block_offset))
                        .expect("Slot calculation overflowed");
                    slot_mapping.push(
                        slot.try_into()
                            .expect("Slot value too large for target integer type"),
                    );
                }
                slot_mappings.push(slot_mapping);
                let full_context_len = chunk_offset_toks + cached + new_len;
                full_block_tables.push(table.clone());
                full_paged_attn_context_lens.push(full_context_len);

                if let Some(sliding_window) = paged_attn_metadata.sliding_window {
                    let mut block_aligned_start = block_aligned_sliding_window_start(
                        full_context_len,
                        new_len,
                        sliding_window,
                        paged_attn_metadata.block_size,
                    );
                    if let Some(mm_start) = paged_attn_metadata
                        .mm_prefix_ranges_by_seq_id
                        .get(seq_id)
                        .into_iter()
                        .flatten()
                        .filter(|&&(start, end)| start < slot_end && slot_start < end)
                        .map(|&(start, _)| start)
                        .min()
                    {
                        block_aligned_start = block_aligned_start.min(
                            mm_start / paged_attn_metadata.block_size
                                * paged_attn_metadata.block_size,
                        );
                    }
                    let paged_context_len = full_context_len - block_aligned_start;
                    let slide_idx = block_aligned_start / paged_attn_metadata.block_size;
                    let needed_blocks = paged_context_len.div_ceil(paged_attn_metadata.block_size);
                    let slide_end = (slide_idx + needed_blocks).min(table.len());
                    block_tables.push(table.get(slide_idx..slide_end).unwrap_or(&[]).to_vec());
                    paged_attn_context_lens.push((0..paged_context_len).collect());
                } else {
                    block_tables.push(table.clone());
                    paged_attn_context_lens.push(ctxt_len);
                }
            }
        }

        let flash_meta = if flash_attn {
            make_flash_params(
                device,
                mapper,
                &seqlens_q,
                &seqlens_k,
                sliding_window,
                prompt_chunk_causal,
                packed_prefill,
            )?
        } else {
            FlashParams::empty(prompt_chunk_causal)
        };

        let input_concat_dim = if packed_prefill { 1 } else { 0 };
        let input = Tensor::cat(&seqs_tensors, input_concat_dim).unwrap();

        let paged_attn_meta = if let Some(paged_attn_metadata) = &paged_attn_metadata {
            // Create paged attention tensors on CPU first (see comment above about CUDA contexts)
            let prefill_query_lens = slot_mappings.iter().map(Vec::len).collect::<Vec<_>>();
            let slot_mappings = if packed_prefill {
                let slots = slot_mappings.into_iter().flatten().collect::<Vec<_>>();
                let slot_count = slots.len();
                Tensor::from_vec(slots, (slot_count,), &Device::Cpu)?
            } else {
                let max_slot_mapping_len = slot_mappings.iter().map(Vec::len).max().unwrap();
                _make_tensor_with_pad(
                    slot_mappings,
                    max_slot_mapping_len,
                    _PAD_SLOT_ID,
                    &Device::Cpu,
                )?
            };

            let max_block_table_len = block_tables.iter().map(|x| x.len()).max().unwrap();
            let block_size = paged_attn_metadata.block_size;
            let full_context_lens_for_fi = if has_any_cache_hit {
                num_cached_tokens_vec
                    .iter()
                    .zip(query_lens_vec.iter())
                    .map(|(cached, query_len)| cached + query_len)
                    .collect::<Vec<_>>()
            } else {
                prefill_query_lens.clone()
            };
            let paged_context_lens_for_fi = if sliding_window.is_some() {
                paged_attn_context_lens
                    .iter()
                    .map(Vec::len)
                    .collect::<Vec<_>>()
            } else {
                full_context_lens_for_fi.clone()
            };
            let (paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len) =
                make_paged_kv_tensors(
                    &block_tables,
                    &paged_context_lens_for_fi,
                    block_size,
                    block_tables.len() * max_block_table_len,
                )?;
            let decode_split_pages = flashinfer_decode_split_pages(
                block_size,
                block_tables.len(),
                paged_attn_metadata.prefill_key_value_heads,
                paged_context_lens_for_fi.iter().copied().max().unwrap_or(0),
            );
            let tiles_per_row = max_block_table_len
                .max(1)
                .div_ceil(flashinfer_decode_split_capacity_pages(block_size));
            let (request_indices, kv_tile_indices, o_indptr, kv_chunk_size, block_valid_mask) =
                make_paged_kv_decode_tensors(
                    &block_tables,
                    &paged_context_lens_for_fi,
                    block_size,
                    Some(decode_split_pages),
                    block_tables.len() * tiles_per_row,
                )?;
            let block_tables = _make_tensor_with_pad(
                block_tables
                    .iter()
                    .map(|x| x.iter().map(|x| *x as u32).collect::<Vec<_>>())
                    .collect::<Vec<_>>(),
                max_block_table_len,
                0,
                &Device::Cpu,
            )?;
            let block_tables = block_tables.reshape(((), max_block_table_len))?;

            let max_context_len = paged_attn_context_lens
                .iter()
                .map(|x| x.len())
                .max()
                .unwrap();

            let context_lens = _make_tensor_with_pad(
                paged_attn_context_lens
                    .iter()
                    .map(|x| x.iter().map(|x| *x as u32).collect::<Vec<_>>())
                    .collect::<Vec<_>>(),
                max_context_len,
                0,
                &Device::Cpu,
            )?
            .reshape(((),))?;
            let packed_rope_positions = if packed_prefill {
                let positions = packed_rope_positions(&seqlen_offsets, &prefill_query_lens)?;
                let position_count = positions.len();
                Some(Tensor::from_vec(
                    positions,
                    (position_count,),
                    &Device::Cpu,
                )?)
            } else {
                None
            };

            // For device mapping, make a copy of each tensor for each device
            let devices = mapper.unwrap().get_unique_devices();
            let mut slot_mappings_map = HashMap::new();
            let mut rope_positions_map = HashMap::new();
            let mut block_tables_map = HashMap::new();
            let mut context_lens_map = HashMap::new();
            let mut mm_prefix_ranges_map = HashMap::new();
            let mut full_mm_prefix_ranges_map = HashMap::new();
            let mut full_block_tables_map = HashMap::new();
            let mut full_context_lens_map = HashMap::new();
            let mut paged_kv_indptr_map = HashMap::new();
            let mut paged_kv_indices_map = HashMap::new();
            let mut paged_kv_last_page_len_map = HashMap::new();
            let mut request_indices_map = HashMap::new();
            let mut kv_tile_indices_map = HashMap::new();
            let mut o_indptr_map = HashMap::new();
            let mut kv_chunk_size_map = HashMap::new();
            let mut block_valid_mask_map = HashMap::new();
            let mut full_paged_kv_indptr_map = HashMap::new();
            let mut full_paged_kv_indices_map = HashMap::new();
            let mut full_paged_kv_last_page_len_map = HashMap::new();
            let mut full_request_indices_map = HashMap::new();
            let mut full_kv_tile_indices_map = HashMap::new();
            let mut full_o_indptr_map = HashMap::new();
            let mut full_kv_chunk_size_map = HashMap::new();
            let mut full_block_valid_mask_map = HashMap::new();

            let (
                full_block_tables_tensor,
                full_context_lens_tensor,
                full_max_context_len,
                full_paged_kv_tensors,
                full_decode_tensors,
            ) = if sliding_window.is_some() {
                let full_max_block_table_len =
                    full_block_tables.iter().map(|x| x.len()).max().unwrap_or(1);
                let full_paged_kv_tensors = Some(make_paged_kv_tensors(
                    &full_block_tables,
                    &full_paged_attn_context_lens,
                    block_size,
                    full_block_tables.len() * full_max_block_table_len,
                )?);
                let full_decode_split_pages = flashinfer_decode_split_pages(
                    block_size,
                    full_block_tables.len(),
                    paged_attn_metadata.prefill_key_value_heads,
                    full_context_lens_for_fi.iter().copied().max().unwrap_or(0),
                );
                let full_tiles_per_row = full_max_block_table_len
                    .max(1)
                    .div_ceil(flashinfer_decode_split_capacity_pages(block_size));
                let full_decode_tensors = Some(make_paged_kv_decode_tensors(
                    &full_block_tables,
                    &full_paged_attn_context_lens,
                    block_size,
                    Some(full_decode_split_pages),
                    full_block_tables.len() * full_tiles_per_row,
                )?);
                let full_block_tables_tensor = _make_tensor_with_pad(
                    full_block_tables
                        .iter()
                        .map(|x| x.iter().map(|x| *x as u32).collect::<Vec<_>>())
                        .collect::<Vec<_>>(),
                    full_max_block_table_len,
                    0,
                    &Device::Cpu,
                )?
                .reshape(((), full_max_block_table_len))?;
                let full_context_lens_tensor = Tensor::from_vec(
                    full_paged_attn_context_lens
                        .iter()
                        .map(|x| *x as u32)
                        .collect::<Vec<_>>(),
                    (full_paged_attn_context_lens.len(),),
                    &Device::Cpu,
                )?;
                let full_max_context_len = full_paged_attn_context_lens.iter().copied().max();
                (
                    Some(full_block_tables_tensor),
                    Some(full_context_lens_tensor),
                    full_max_context_len,
                    full_paged_kv_tensors,
                    full_decode_tensors,
                )
            } else {
                (None, None, None, None, None)
            };
            let kv_window_starts = full_paged_attn_context_lens
                .iter()
                .zip(paged_context_lens_for_fi.iter())
                .map(|(full_len, paged_len)| full_len.saturating_sub(*paged_len))
                .collect::<Vec<_>>();
            let mm_prefix_ranges_tensor = crate::paged_attention::mm_prefix::make_ranges_tensor(
                seq_ids,
                &paged_attn_metadata.mm_prefix_ranges_by_seq_id,
                &kv_window_starts,
                &paged_context_lens_for_fi,
                &prefill_query_lens,
            )?;
            let full_kv_window_starts = vec![0; seq_ids.len()];
            let full_mm_prefix_ranges_tensor = if sliding_window.is_some() {
                crate::paged_attention::mm_prefix::make_ranges_tensor(
                    seq_ids,
                    &paged_attn_metadata.full_mm_prefix_ranges_by_seq_id,
                    &full_kv_window_starts,
                    &full_paged_attn_context_lens,
                    &prefill_query_lens,
                )?
            } else {
                None
            };

            for device in devices {
                slot_mappings_map
                    .insert(device.location(), slot_mappings.clone().to_device(&device)?);
                if let Some(positions) = &packed_rope_positions {
                    rope_positions_map
                        .insert(device.location(), positions.clone().to_device(&device)?);
                }
                block_tables_map
                    .insert(device.location(), block_tables.clone().to_device(&device)?);
                context_lens_map
                    .insert(device.location(), context_lens.clone().to_device(&device)?);
                if let Some(mm_prefix_ranges_tensor) = &mm_prefix_ranges_tensor {
                    mm_prefix_ranges_map.insert(
                        device.location(),
                        mm_prefix_ranges_tensor.clone().to_device(&device)?,
                    );
                }
                if let Some(full_mm_prefix_ranges_tensor) = &full_mm_prefix_ranges_tensor {
                    full_mm_prefix_ranges_map.insert(
                        device.location(),
                        full_mm_prefix_ranges_tensor.clone().to_device(&device)?,
                    );
                }
                paged_kv_indptr_map.insert(
                    device.location(),
                    paged_kv_indptr.clone().to_device(&device)?,
                );
                paged_kv_indices_map.insert(
                    device.location(),
                    paged_kv_indices.clone().to_device(&device)?,
                );
                paged_kv_last_page_len_map.insert(
                    device.location(),
                    paged_kv_last_page_len.clone().to_device(&device)?,
                );
                request_indices_map.insert(
                    device.location(),
                    request_indices.clone().to_device(&device)?,
                );
                kv_tile_indices_map.insert(
                    device.location(),
                    kv_tile_indices.clone().to_device(&device)?,
                );
                o_indptr_map.insert(device.location(), o_indptr.clone().to_device(&device)?);
                kv_chunk_size_map
                    .insert(device.location(), kv_chunk_size.clone().to_device(&device)?);
                block_valid_mask_map.insert(
                    device.location(),
                    block_valid_mask.clone().to_device(&device)?,
                );
                if let Some(full_block_tables_tensor) = &full_block_tables_tensor {
                    full_block_tables_map.insert(
                        device.location(),
                        full_block_tables_tensor.clone().to_device(&device)?,
                    );
                }
                if let Some(full_context_lens_tensor) = &full_context_lens_tensor {
                    full_context_lens_map.insert(
                        device.location(),
                        full_context_lens_tensor.clone().to_device(&device)?,
                    );
                }
                if let Some((indptr, indices, last_page_len)) = &full_paged_kv_tensors {
                    full_paged_kv_indptr_map
                        .insert(device.location(), indptr.clone().to_device(&device)?);
                    full_paged_kv_indices_map
                        .insert(device.location(), indices.clone().to_device(&device)?);
                    full_paged_kv_last_page_len_map
                        .insert(device.location(), last_page_len.clone().to_device(&device)?);
                }
                if let Some((req, kv, o, chunk, valid)) = &full_decode_tensors {
                    full_request_indices_map
                        .insert(device.location(), req.clone().to_device(&device)?);
                    full_kv_tile_indices_map
                        .insert(device.location(), kv.clone().to_device(&device)?);
                    full_o_indptr_map.insert(device.location(), o.clone().to_device(&device)?);
                    full_kv_chunk_size_map
                        .insert(device.location(), chunk.clone().to_device(&device)?);
                    full_block_valid_mask_map
                        .insert(device.location(), valid.clone().to_device(&device)?);
                }
            }

            let prompt_chunk_attention_policy = paged_attn_metadata.prompt_chunk_attention_policy;
            let sliding_flashinfer_view = if sliding_window.is_some() {
                Some(flashinfer_view(
                    Some(block_tables_map.clone()),
                    Some(context_lens_map.clone()),
                    Some(max_context_len),
                    flashinfer_paged_kv(
                        paged_kv_indptr_map.clone(),
                        paged_kv_indices_map.clone(),
                        paged_kv_last_page_len_map.clone(),
                    ),
                    flashinfer_tile_plan(
                        request_indices_map.clone(),
                        kv_tile_indices_map.clone(),
                        o_indptr_map.clone(),
                        kv_chunk_size_map.clone(),
                        block_valid_mask_map.clone(),
                    ),
                ))
            } else {
                None
            };
            let logical_flashinfer_view = if sliding_window.is_some() {
                flashinfer_view(
                    Some(full_block_tables_map.clone()),
                    Some(full_context_lens_map.clone()),
                    full_max_context_len,
                    flashinfer_paged_kv(
                        full_paged_kv_indptr_map.clone(),
                        full_paged_kv_indices_map.clone(),
                        full_paged_kv_last_page_len_map.clone(),
                    ),
                    flashinfer_tile_plan(
                        full_request_indices_map.clone(),
                        full_kv_tile_indices_map.clone(),
                        full_o_indptr_map.clone(),
                        full_kv_chunk_size_map.clone(),
                        full_block_valid_mask_map.clone(),
                    ),
                )
            } else {
                flashinfer_view(
                    Some(block_tables_map.clone()),
                    Some(context_lens_map.clone()),
                    Some(max_context_len),
                    flashinfer_paged_kv(
                        paged_kv_indptr_map.clone(),
                        paged_kv_indices_map.clone(),
                        paged_kv_last_page_len_map.clone(),
                    ),
                    flashinfer_tile_plan(
                        request_indices_map.clone(),
                        kv_tile_indices_map.clone(),
                        o_indptr_map.clone(),
                        kv_chunk_size_map.clone(),
                        block_valid_mask_map.clone(),
                    ),
                )
            };
            let flashinfer = Some(flashinfer_metadata(
                logical_flashinfer_view,
                sliding_flashinfer_view,
            ));

            Some(PagedAttentionInputMetadata {
                slot_mappings: slot_mappings_map,
                block_tables: Some(block_tables_map),
                context_lens: Some(context_lens_map),
                block_size: Some(block_size),
                paged_context_lens_cpu: Some(paged_context_lens_for_fi.clone()),
                full_paged_context_lens_cpu: Some(full_paged_attn_context_lens.clone()),
                max_context_len: Some(max_context_len),
                full_block_tables: if full_block_tables_map.is_empty() {
                    None
                } else {
                    Some(full_block_tables_map)
                },
                full_context_lens: if full_context_lens_map.is_empty() {
                    None
                } else {
                    Some(full_context_lens_map)
                },
                full_max_context_len,
                is_first_prompt_chunk: chunk_offset_toks == 0 && !has_any_cache_hit,
                is_final_prompt_chunk: paged_attn_metadata.is_final_prompt_chunk,
                prompt_chunk_attention_policy,
                // Keep the slow path local to chunks whose query rows overlap a noncausal range.
                has_noncausal_mm_context: mm_prefix_ranges_tensor.is_some()
                    || full_mm_prefix_ranges_tensor.is_some(),
                mm_prefix_ranges: if mm_prefix_ranges_map.is_empty() {
                    None
                } else {
                    Some(mm_prefix_ranges_map)
                },
                full_mm_prefix_ranges: if full_mm_prefix_ranges_map.is_empty() {
                    None
                } else {
                    Some(full_mm_prefix_ranges_map)
                },
                prefill_attention_heads: paged_attn_metadata.prefill_attention_heads,
                prefill_key_value_heads: paged_attn_metadata.prefill_key_value_heads,
                prefill_head_dim: paged_attn_metadata.prefill_head_dim,
                flashinfer,
                rope_positions: if rope_positions_map.is_empty() {
                    None
                } else {
                    Some(rope_positions_map)
                },
                num_cached_tokens: if has_any_cache_hit {
                    Some(num_cached_tokens_vec.clone())
                } else {
                    None
                },
                // Always set: saves a per-layer GPU->CPU slot-mapping sync in forward_prefix.
                query_lens: Some(prefill_query_lens.clone()),
                cu_seqlens_q: if has_any_cache_hit {
                    // Cumulative query lengths for Sdpa varlen: [0, q0, q0+q1, ...]
                    let mut cu_q = vec![0u32];
                    for &ql in &query_lens_vec {
                        cu_q.push(cu_q.last().unwrap() + ql as u32);
                    }
                    let cu_q_t = Tensor::new(&cu_q[..], &Device::Cpu)?;
                    let devices = mapper.unwrap().get_unique_devices();
                    let mut map = HashMap::new();
                    for device in &devices {
                        map.insert(device.location(), cu_q_t.to_device(device)?);
                    }
                    Some(map)
                } else {
                    None
                },
                cu_seqlens_kv: if has_any_cache_hit {
                    // Cumulative KV lengths: [0, c0+q0, c0+q0+c1+q1, ...]
                    // U32 to match flash-attn varlen expectations
                    let mut cu_kv = vec![0u32];
                    for (&nc, &ql) in num_cached_tokens_vec.iter().zip(query_lens_vec.iter()) {
                        cu_kv.push(cu_kv.last().unwrap() + (nc + ql) as u32);
                    }
                    let cu_kv_t = Tensor::new(&cu_kv[..], &Device::Cpu)?;
                    let devices = mapper.unwrap().get_unique_devices();
                    let mut map = HashMap::new();
                    for device in &devices {
                        map.insert(device.location(), cu_kv_t.to_device(device)?);
                    }
                    Some(map)
                } else {
                    None
                },
                decode_rows: None,
            })
        } else {
            None
        };

        Ok(InputMetadata {
            input,
            positions: seqlen_offsets,
            context_lens,
            position_ids,
            paged_attn_meta,
            flash_meta,
        })
    }

    fn make_completion_chunk<T: WithDType + From<u32> + Clone + std::fmt::Debug>(
        toks: Vec<&[T]>,
        input_seqs: &[&mut Sequence],
        device: &Device,
        mut paged_attn_metadata: Option<&mut PagedAttentionMeta>,
        mapper: Option<&dyn DeviceMapper>,
        sliding_window: Option<usize>,
        decode_window: usize,
    ) -> Result<InputMetadata> {
        // Pad each sequence by the padding token to the max len.
        let flash_attn = crate::using_flash_attn();
        let mut seqs_tensors = Vec::new();
        let mut seqlen_offsets = Vec::new();
        let mut context_lens = Vec::new();
        let mut position_ids = Vec::new();

        let mut slot_mappings = Vec::new();
        let mut block_tables = Vec::new();
        let mut paged_attn_context_lens = Vec::new();
        let mut full_block_tables = Vec::new();
        let mut full_paged_attn_context_lens = Vec::new();
        let mut seqlens_q = if flash_attn { vec![0] } else { Vec::new() };
        let mut seqlens_k = if flash_attn { vec![0] } else { Vec::new() };
        // Staged speculative tokens are appended to the decode input only when
        // the whole batch has the same fixed proposal width. The generic
        // verifier keeps the target forward rectangular in this first batched
        // implementation; mixed staged/no-staged batches fall back to a normal
        // one-token decode and the driver clears the stale staged proposals.
        let use_staged_speculative =
            crate::speculative::staging::staged_batch_width(input_seqs).is_some();
        for (seq, ctxt) in input_seqs.iter().zip(toks) {
            let staged_speculative = if use_staged_speculative {
                seq.active_staged_speculative_tokens()
            } else {
                &[]
            };
            let start_pos = ctxt.len().saturating_sub(decode_window);
            let mut ctxt = ctxt[start_pos..].to_vec();
            ctxt.extend(staged_speculative.iter().copied().map(T::from));
            let query_len = ctxt.len();
            let effective_context_len = start_pos + query_len;
            seqlen_offsets.push(start_pos);
            context_lens.push((0, query_len));
            position_ids.push(effective_context_len);

            if flash_attn {
                seqlens_q.push(query_len as u32);
                seqlens_k.push(effective_context_len as u32);
            }

            seqs_tensors.push(Tensor::new(ctxt, device)?.unsqueeze(0)?);

            if let Some(paged_attn_metadata) = &mut paged_attn_metadata {
                let kv_mgr = get_mut_arcmutex!(paged_attn_metadata.kv_cache_manager);
                let table: Vec<usize> = kv_mgr
                    .get_block_ids(*seq.id())
                    .expect("Sequence must have allocated blocks for completion")
                    .to_vec();
                drop(kv_mgr);

                let block_start = start_pos - seq.token_offset();
                let block_end = block_start + query_len;
                let mut slot_mapping = Vec::with_capacity(query_len);
                for block_pos in block_start..block_end {
                    let block_number = if block_pos / paged_attn_metadata.block_size >= table.len()
                    {
                        panic!("Block table is too small (completion)! block_pos={} block_size={} table_len={}", block_pos, paged_attn_metadata.block_size, table.len());
                    } else {
                        table
                            .get(block_pos / paged_attn_metadata.block_size)
                            .unwrap()
                    };
                    let block_offset = block_pos % paged_attn_metadata.block_size;
                    // Use checked arithmetic to prevent overflow
                    let slot = block_number
                        .checked_mul(paged_attn_metadata.block_size)
                        .and_then(|v| v.checked_add(block_offset))
                        .expect("Slot calculation overflowed");
                    let slot = slot
                        .try_into()
                        .expect("Slot value too large for target integer type");
                    slot_mapping.push(slot);
                }
                slot_mappings.push(slot_mapping);

                for row in 0..query_len {
                    let full_context_len = start_pos + row + 1;

                    // Always collect the full (unwindowed) block tables.
                    full_block_tables.push(table.clone());
                    full_paged_attn_context_lens.push(full_context_len);

                    let paged_attn_context_len = if let Some(sliding_window) =
                        paged_attn_metadata.sliding_window
                    {
                        let window_start = full_context_len.saturating_sub(sliding_window);
                        let block_aligned_start = (window_start / paged_attn_metadata.block_size)
                            * paged_attn_metadata.block_size;
                        full_context_len - block_aligned_start
                    } else {
                        full_context_len
                    };
                    if let Some(sliding_window) = paged_attn_metadata.sliding_window {
                        let window_start = full_context_len.saturating_sub(sliding_window);
                        let slide_idx = window_start / paged_attn_metadata.block_size;
                        let needed_blocks =
                            paged_attn_context_len.div_ceil(paged_attn_metadata.block_size);
                        let slide_end = (slide_idx + needed_blocks).min(table.len());
                        block_tables.push(table.get(slide_idx..slide_end).unwrap_or(&[]).to_vec());
                    } else {
                        block_tables.push(table.clone());
                    }
                    paged_attn_context_lens.push(paged_attn_context_len);
                }
            }
        }

        let flash_meta = if flash_attn {
            make_flash_params(
                device,
                mapper,
                &seqlens_q,
                &seqlens_k,
                sliding_window,
                true,
                false,
            )?
        } else {
            FlashParams::empty(true)
        };

        let paged_attn_meta = if let Some(paged_attn_input) = &paged_attn_metadata {
            let rows = Arc::new(DecodePagedRows {
                slot_mappings,
                block_tables,
                context_lens: paged_attn_context_lens,
                full_block_tables,
                full_context_lens: full_paged_attn_context_lens,
                query_len: context_lens.first().map_or(1, |(_, q)| *q),
                block_size: paged_attn_input.block_size,
                use_standard_metadata: paged_attn_input.attention_backend
                    == AttentionBackendKind::Standard,
                max_paged_context_len: paged_attn_input.max_paged_context_len,
                sliding_window: paged_attn_input.sliding_window,
                decode_window,
                devices: mapper.unwrap().get_unique_devices(),
                num_kv_heads: paged_attn_input.prefill_key_value_heads,
            });
            Some(rows.build()?)
        } else {
            None
        };

        Ok(InputMetadata {
            input: Tensor::cat(&seqs_tensors, 0).unwrap(),
            positions: seqlen_offsets,
            context_lens,
            position_ids,
            paged_attn_meta,
            flash_meta,
        })
    }

    /// Host-side per-row decode inputs plus everything needed to materialize the paged-attention
    /// metadata from them. Kept on the metadata so the CUDA graph layer can rebuild a batch-padded
    /// twin through the same code path.
    #[derive(Clone, Debug)]
    pub struct DecodePagedRows {
        pub slot_mappings: Vec<Vec<i64>>,
        pub block_tables: Vec<Vec<usize>>,
        pub context_lens: Vec<usize>,
        pub full_block_tables: Vec<Vec<usize>>,
        pub full_context_lens: Vec<usize>,
        pub query_len: usize,
        pub block_size: usize,
        pub use_standard_metadata: bool,
        pub max_paged_context_len: usize,
        pub sliding_window: Option<usize>,
        pub decode_window: usize,
        pub devices: Vec<Device>,
        pub num_kv_heads: usize,
    }

    impl DecodePagedRows {
        pub fn batch_size(&self) -> usize {
            self.slot_mappings.len()
        }

        /// Pad to `batch_size` rows. Pad rows alias row 0 for every read (same block table and context)
        /// and carry `_PAD_SLOT_ID` slot mappings, so the cache kernels skip their KV writes.
        pub fn padded(&self, batch_size: usize) -> Self {
            let mut rows = self.clone();
            let q = self.query_len;
            while rows.slot_mappings.len() < batch_size {
                rows.slot_mappings
                    .push(vec![_PAD_SLOT_ID; self.slot_mappings[0].len()]);
                rows.block_tables.extend_from_slice(&self.block_tables[..q]);
                rows.context_lens.extend_from_slice(&self.context_lens[..q]);
                rows.full_block_tables
                    .extend_from_slice(&self.full_block_tables[..q]);
                rows.full_context_lens
                    .extend_from_slice(&self.full_context_lens[..q]);
            }
            rows
        }

        pub fn build(self: &Arc<Self>) -> Result<PagedAttentionInputMetadata> {
            // Create paged attention tensors on CPU first (see make_prompt_chunk for explanation)
            let max_slot_mapping_len = self.slot_mappings.iter().map(Vec::len).max().unwrap_or(1);
            let slot_mappings = _make_tensor_with_pad(
                self.slot_mappings.clone(),
                max_slot_mapping_len,
                _PAD_SLOT_ID,
                &Device::Cpu,
            )?;

            let block_tables = &self.block_tables;
            let paged_attn_context_lens = &self.context_lens;
            let full_block_tables = &self.full_block_tables;
            let full_paged_attn_context_lens = &self.full_context_lens;
            let block_size = self.block_size;
            let use_standard_metadata = self.use_standard_metadata;
            let decode_window = self.decode_window;
            let max_block_table_len = block_tables
                .iter()
                .map(|x| x.len())
                .max()
                .expect("block_tables should not be empty when paged attention is enabled");
            let full_max_block_table_len = full_block_tables
                .iter()
                .map(|x| x.len())
                .max()
                .unwrap_or(0)
                .max(1);
            let graph_capacity = (!use_standard_metadata).then_some(self.max_paged_context_len);
            let paged_graph_capacity = self
                .sliding_window
                .map(|window| {
                    window
                        .saturating_add(block_size.saturating_sub(1))
                        .min(self.max_paged_context_len)
                })
                .or(graph_capacity);
            let max_block_table_len = cuda_graph_block_table_len_with_cap(
                max_block_table_len,
                block_size,
                true,
                paged_graph_capacity,
            );

            let batch_size = block_tables.len();
            let (paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len) =
                make_paged_kv_tensors(
                    block_tables,
                    paged_attn_context_lens,
                    block_size,
                    batch_size * max_block_table_len,
                )?;

            let decode_split_pages = flashinfer_decode_split_pages(
                block_size,
                batch_size,
                self.num_kv_heads,
                paged_attn_context_lens.iter().copied().max().unwrap_or(0),
            );
            let split_pages = Some(decode_split_pages);
            let tiles_per_row = max_block_table_len
                .max(1)
                .div_ceil(flashinfer_decode_split_capacity_pages(block_size));
            let (request_indices, kv_tile_indices, o_indptr, kv_chunk_size, block_valid_mask) =
                make_paged_kv_decode_tensors(
                    block_tables,
                    paged_attn_context_lens,
                    block_size,
                    split_pages,
                    batch_size * tiles_per_row,
                )?;
            let full_matches_paged = self.sliding_window.is_none();

            let block_tables = _make_tensor_with_pad(
                block_tables
                    .iter()
                    .map(|x| x.iter().map(|x| *x as u32).collect::<Vec<_>>())
                    .collect::<Vec<_>>(),
                max_block_table_len,
                0,
                &Device::Cpu,
            )?;
            let block_tables = block_tables.reshape(((), max_block_table_len))?;

            let max_context_len = paged_attn_context_lens.iter().max().unwrap();

            let context_lens = Tensor::from_vec(
                paged_attn_context_lens
                    .iter()
                    .map(|x| *x as u32)
                    .collect::<Vec<_>>(),
                (paged_attn_context_lens.len(),),
                &Device::Cpu,
            )?;
            // Build full (unwindowed) block tables and context lens.
            let full_max_block_table_len = cuda_graph_block_table_len_with_cap(
                full_max_block_table_len,
                block_size,
                true,
                graph_capacity,
            );

            let full_block_tables_tensor = _make_tensor_with_pad(
                full_block_tables
                    .iter()
                    .map(|x| x.iter().map(|x| *x as u32).collect::<Vec<_>>())
                    .collect::<Vec<_>>(),
                full_max_block_table_len,
                0,
                &Device::Cpu,
            )?;
            let full_block_tables_tensor =
                full_block_tables_tensor.reshape(((), full_max_block_table_len))?;

            let full_max_context_len = full_paged_attn_context_lens
                .iter()
                .max()
                .copied()
                .unwrap_or(0);

            let (full_paged_kv_indptr, full_paged_kv_indices, full_paged_kv_last_page_len) =
                make_paged_kv_tensors(
                    full_block_tables,
                    full_paged_attn_context_lens,
                    block_size,
                    full_block_tables.len() * full_max_block_table_len,
                )?;
            let full_decode_split_pages = flashinfer_decode_split_pages(
                block_size,
                batch_size,
                self.num_kv_heads,
                full_paged_attn_context_lens
                    .iter()
                    .copied()
                    .max()
                    .unwrap_or(0),
            );
            let full_split_pages = Some(full_decode_split_pages);
            let full_tiles_per_row = full_max_block_table_len
                .max(1)
                .div_ceil(flashinfer_decode_split_capacity_pages(block_size));
            let (
                full_paged_kv_request_indices,
                full_paged_kv_tile_indices,
                full_paged_kv_o_indptr,
                full_paged_kv_chunk_size,
                full_paged_kv_block_valid_mask,
            ) = make_paged_kv_decode_tensors(
                full_block_tables,
                full_paged_attn_context_lens,
                block_size,
                full_split_pages,
                full_block_tables.len() * full_tiles_per_row,
            )?;
            let full_context_lens_tensor = Tensor::from_vec(
                full_paged_attn_context_lens
                    .iter()
                    .map(|x| *x as u32)
                    .collect::<Vec<_>>(),
                (full_paged_attn_context_lens.len(),),
                &Device::Cpu,
            )?;

            // For device mapping, make a copy of each tensor for each device
            let devices = self.devices.iter();
            let mut slot_mappings_map = HashMap::new();
            let mut block_tables_map = HashMap::new();
            let mut context_lens_map = HashMap::new();
            let mut full_block_tables_map = HashMap::new();
            let mut full_context_lens_map = HashMap::new();
            let mut paged_kv_indptr_map = HashMap::new();
            let mut paged_kv_indices_map = HashMap::new();
            let mut paged_kv_last_page_len_map = HashMap::new();
            let mut full_paged_kv_indptr_map = HashMap::new();
            let mut full_paged_kv_indices_map = HashMap::new();
            let mut full_paged_kv_last_page_len_map = HashMap::new();
            let mut paged_kv_request_indices_map = HashMap::new();
            let mut paged_kv_tile_indices_map = HashMap::new();
            let mut paged_kv_o_indptr_map = HashMap::new();
            let mut paged_kv_chunk_size_map = HashMap::new();
            let mut paged_kv_block_valid_mask_map = HashMap::new();
            let mut full_paged_kv_request_indices_map = HashMap::new();
            let mut full_paged_kv_tile_indices_map = HashMap::new();
            let mut full_paged_kv_o_indptr_map = HashMap::new();
            let mut full_paged_kv_chunk_size_map = HashMap::new();
            let mut full_paged_kv_block_valid_mask_map = HashMap::new();

            for device in devices {
                let device = device.clone();
                let location = device.location();
                let slot_mappings_device = slot_mappings.clone().to_device(&device)?;
                let paged_kv_indptr_device = paged_kv_indptr.clone().to_device(&device)?;
                let paged_kv_indices_device = paged_kv_indices.clone().to_device(&device)?;
                let paged_kv_last_page_len_device =
                    paged_kv_last_page_len.clone().to_device(&device)?;
                let request_indices_device = request_indices.clone().to_device(&device)?;
                let kv_tile_indices_device = kv_tile_indices.clone().to_device(&device)?;
                let o_indptr_device = o_indptr.clone().to_device(&device)?;
                let kv_chunk_size_device = kv_chunk_size.clone().to_device(&device)?;
                let block_valid_mask_device = block_valid_mask.clone().to_device(&device)?;

                slot_mappings_map.insert(location, slot_mappings_device);
                paged_kv_indptr_map.insert(location, paged_kv_indptr_device.clone());
                paged_kv_indices_map.insert(location, paged_kv_indices_device.clone());
                paged_kv_last_page_len_map.insert(location, paged_kv_last_page_len_device.clone());
                paged_kv_request_indices_map.insert(location, request_indices_device.clone());
                paged_kv_tile_indices_map.insert(location, kv_tile_indices_device.clone());
                paged_kv_o_indptr_map.insert(location, o_indptr_device.clone());
                paged_kv_chunk_size_map.insert(location, kv_chunk_size_device.clone());
                paged_kv_block_valid_mask_map.insert(location, block_valid_mask_device.clone());

                // Block-diffusion decode windows also need the plain tables for the
                // per-canvas KV gather, regardless of the attention backend layout.
                if use_standard_metadata || decode_window > 1 {
                    let block_tables_device = block_tables.clone().to_device(&device)?;
                    let context_lens_device = context_lens.clone().to_device(&device)?;
                    block_tables_map.insert(location, block_tables_device.clone());
                    context_lens_map.insert(location, context_lens_device.clone());
                    if full_matches_paged {
                        full_block_tables_map.insert(location, block_tables_device);
                        full_context_lens_map.insert(location, context_lens_device);
                    } else {
                        full_block_tables_map.insert(
                            location,
                            full_block_tables_tensor.clone().to_device(&device)?,
                        );
                        full_context_lens_map.insert(
                            location,
                            full_context_lens_tensor.clone().to_device(&device)?,
                        );
                    }
                }

                if full_matches_paged {
                    full_paged_kv_indptr_map.insert(location, paged_kv_indptr_device);
                    full_paged_kv_indices_map.insert(location, paged_kv_indices_device);
                    full_paged_kv_last_page_len_map.insert(location, paged_kv_last_page_len_device);
                    full_paged_kv_request_indices_map.insert(location, request_indices_device);
                    full_paged_kv_tile_indices_map.insert(location, kv_tile_indices_device);
                    full_paged_kv_o_indptr_map.insert(location, o_indptr_device);
                    full_paged_kv_chunk_size_map.insert(location, kv_chunk_size_device);
                    full_paged_kv_block_valid_mask_map.insert(location, block_valid_mask_device);
                } else {
                    full_paged_kv_indptr_map
                        .insert(location, full_paged_kv_indptr.clone().to_device(&device)?);
                    full_paged_kv_indices_map
                        .insert(location, full_paged_kv_indices.clone().to_device(&device)?);
                    full_paged_kv_last_page_len_map.insert(
                        location,
                        full_paged_kv_last_page_len.clone().to_device(&device)?,
                    );
                    full_paged_kv_request_indices_map.insert(
                        location,
                        full_paged_kv_request_indices.clone().to_device(&device)?,
                    );
                    full_paged_kv_tile_indices_map.insert(
                        location,
                        full_paged_kv_tile_indices.clone().to_device(&device)?,
                    );
                    full_paged_kv_o_indptr_map
                        .insert(location, full_paged_kv_o_indptr.clone().to_device(&device)?);
                    full_paged_kv_chunk_size_map.insert(
                        location,
                        full_paged_kv_chunk_size.clone().to_device(&device)?,
                    );
                    full_paged_kv_block_valid_mask_map.insert(
                        location,
                        full_paged_kv_block_valid_mask.clone().to_device(&device)?,
                    );
                }
            }

            let sliding_flashinfer_view = if full_matches_paged {
                None
            } else {
                Some(flashinfer_view(
                    use_standard_metadata.then_some(block_tables_map.clone()),
                    use_standard_metadata.then_some(context_lens_map.clone()),
                    use_standard_metadata.then_some(*max_context_len),
                    flashinfer_paged_kv(
                        paged_kv_indptr_map.clone(),
                        paged_kv_indices_map.clone(),
                        paged_kv_last_page_len_map.clone(),
                    ),
                    flashinfer_tile_plan(
                        paged_kv_request_indices_map.clone(),
                        paged_kv_tile_indices_map.clone(),
                        paged_kv_o_indptr_map.clone(),
                        paged_kv_chunk_size_map.clone(),
                        paged_kv_block_valid_mask_map.clone(),
                    ),
                ))
            };
            let logical_flashinfer_view = flashinfer_view(
                use_standard_metadata.then_some(full_block_tables_map.clone()),
                use_standard_metadata.then_some(full_context_lens_map.clone()),
                use_standard_metadata.then_some(full_max_context_len),
                flashinfer_paged_kv(
                    full_paged_kv_indptr_map.clone(),
                    full_paged_kv_indices_map.clone(),
                    full_paged_kv_last_page_len_map.clone(),
                ),
                flashinfer_tile_plan(
                    full_paged_kv_request_indices_map.clone(),
                    full_paged_kv_tile_indices_map.clone(),
                    full_paged_kv_o_indptr_map.clone(),
                    full_paged_kv_chunk_size_map.clone(),
                    full_paged_kv_block_valid_mask_map.clone(),
                ),
            );
            let flashinfer = Some(flashinfer_metadata(
                logical_flashinfer_view,
                sliding_flashinfer_view,
            ));

            Ok(PagedAttentionInputMetadata {
                slot_mappings: slot_mappings_map,
                block_tables: (use_standard_metadata || decode_window > 1)
                    .then_some(block_tables_map),
                context_lens: use_standard_metadata.then_some(context_lens_map),
                block_size: Some(block_size),
                paged_context_lens_cpu: Some(paged_attn_context_lens.clone()),
                full_paged_context_lens_cpu: Some(full_paged_attn_context_lens.clone()),
                max_context_len: use_standard_metadata.then_some(*max_context_len),
                full_block_tables: (use_standard_metadata || decode_window > 1)
                    .then_some(full_block_tables_map),
                full_context_lens: use_standard_metadata.then_some(full_context_lens_map),
                full_max_context_len: use_standard_metadata.then_some(full_max_context_len),
                is_first_prompt_chunk: false,
                is_final_prompt_chunk: true,
                prompt_chunk_attention_policy: MultimodalAttentionPolicy::Causal,
                has_noncausal_mm_context: false,
                mm_prefix_ranges: None,
                full_mm_prefix_ranges: None,
                prefill_attention_heads: 1,
                prefill_key_value_heads: 1,
                prefill_head_dim: 1,
                flashinfer,
                rope_positions: None,
                num_cached_tokens: None,
                query_lens: None,
                cu_seqlens_q: None,
                cu_seqlens_kv: None,
                decode_rows: Some(self.clone()),
            })
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn make_completion_prefill_chunk<T: WithDType + std::fmt::Debug>(
        toks: Vec<&[T]>,
        input_seqs: &[&mut Sequence],
        device: &Device,
        last_n_context_len: Option<(usize, usize)>,
        return_raw_logits: bool,
        paged_attn_metadata: Option<&mut PagedAttentionMeta>,
        mapper: Option<&dyn DeviceMapper>,
        sliding_window: Option<usize>,
        decode_window: usize,
    ) -> Result<InputMetadata> {
        let prefix_cache_lens = toks
            .iter()
            .map(|ctxt| ctxt.len().saturating_sub(decode_window))
            .collect::<Vec<_>>();
        make_prompt_chunk(
            0,
            toks,
            &input_seqs.iter().map(|seq| *seq.id()).collect::<Vec<_>>(),
            device,
            last_n_context_len,
            return_raw_logits,
            paged_attn_metadata,
            mapper,
            Some(&prefix_cache_lens),
            sliding_window,
            false,
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn get_prompt_input<T: WithDType + std::fmt::Debug>(
        toks: Vec<&[T]>,
        input_seqs: &[&mut Sequence],
        device: &Device,
        last_n_context_len: Option<(usize, usize)>,
        return_raw_logits: bool,
        paged_attn_metadata: Option<&mut PagedAttentionMeta>,
        mapper: Option<&dyn DeviceMapper>,
        sliding_window: Option<usize>,
    ) -> Result<InnerInputProcessorOutput> {
        let offset = input_seqs[0].token_offset();
        // Collect prefix cache lens when paged attention is in use
        let prefix_cache_lens: Vec<usize> =
            input_seqs.iter().map(|s| s.prefix_cache_len()).collect();
        let has_paged_attn = paged_attn_metadata.is_some();
        make_prompt_chunk(
            offset,
            toks,
            &input_seqs.iter().map(|s| *s.id()).collect::<Vec<_>>(),
            device,
            last_n_context_len,
            return_raw_logits,
            paged_attn_metadata,
            mapper,
            if has_paged_attn {
                Some(&prefix_cache_lens)
            } else {
                None
            },
            sliding_window,
            true,
        )
        .map(|inputs| InnerInputProcessorOutput {
            inputs,
            seq_indices: (0..input_seqs.len()).collect(),
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn get_completion_input<T: WithDType + std::fmt::Debug + From<u32> + Clone>(
        toks: Vec<&[T]>,
        input_seqs: &[&mut Sequence],
        device: &Device,
        no_kv_cache: bool,
        last_n_context_len: Option<(usize, usize)>,
        return_raw_logits: bool,
        paged_attn_metadata: Option<&mut PagedAttentionMeta>,
        mapper: Option<&dyn DeviceMapper>,
        sliding_window: Option<usize>,
    ) -> Result<InnerInputProcessorOutput> {
        if no_kv_cache {
            return get_prompt_input(
                toks,
                input_seqs,
                device,
                last_n_context_len,
                return_raw_logits,
                paged_attn_metadata,
                mapper,
                None,
            );
        }

        make_completion_chunk(
            toks,
            input_seqs,
            device,
            paged_attn_metadata,
            mapper,
            sliding_window,
            1,
        )
        .map(|inputs| InnerInputProcessorOutput {
            inputs,
            seq_indices: (0..input_seqs.len()).collect(),
        })
    }

    /// `get_completion_input` for models that consume more than one new token per decode step
    /// (e.g. block diffusion, where each step feeds the last committed canvas to the encoder).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn get_completion_input_windowed<
        T: WithDType + std::fmt::Debug + From<u32> + Clone,
    >(
        toks: Vec<&[T]>,
        input_seqs: &[&mut Sequence],
        device: &Device,
        no_kv_cache: bool,
        last_n_context_len: Option<(usize, usize)>,
        return_raw_logits: bool,
        paged_attn_metadata: Option<&mut PagedAttentionMeta>,
        mapper: Option<&dyn DeviceMapper>,
        sliding_window: Option<usize>,
        decode_window: usize,
    ) -> Result<InnerInputProcessorOutput> {
        if no_kv_cache {
            return get_prompt_input(
                toks,
                input_seqs,
                device,
                last_n_context_len,
                return_raw_logits,
                paged_attn_metadata,
                mapper,
                None,
            );
        }

        let inputs = if paged_attn_metadata.is_some() {
            make_completion_prefill_chunk(
                toks,
                input_seqs,
                device,
                last_n_context_len,
                return_raw_logits,
                paged_attn_metadata,
                mapper,
                sliding_window,
                decode_window,
            )
        } else {
            make_completion_chunk(
                toks,
                input_seqs,
                device,
                paged_attn_metadata,
                mapper,
                sliding_window,
                decode_window,
            )
        }?;
        Ok(InnerInputProcessorOutput {
            inputs,
            seq_indices: (0..input_seqs.len()).collect(),
        })
    }

    #[derive(Clone)]
    pub struct ModelInputs {
        pub input_ids: Tensor,
        pub input_ids_full: Option<Tensor>,
        pub seqlen_offsets: Vec<usize>,
        pub seqlen_offsets_full: Option<Vec<usize>>,
        pub context_lens: Vec<(usize, usize)>,
        pub position_ids: Vec<usize>,
        pub paged_attn_meta: Option<PagedAttentionInputMetadata>,
        pub flash_meta: FlashParams,
        pub flash_meta_full: Option<FlashParams>,
        pub recurrent_batch_kind: RecurrentBatchKind,
        pub adapter_leases: Arc<[Option<AdapterLease>]>,
    }

    fn adapter_leases(
        input_seqs: &[&mut Sequence],
        seq_indices: &[usize],
    ) -> Arc<[Option<AdapterLease>]> {
        seq_indices
            .iter()
            .map(|&index| input_seqs[index].adapter_lease().cloned())
            .collect::<Vec<_>>()
            .into()
    }

    pub struct TextInputsProcessor;

    impl InputsProcessor for TextInputsProcessor {
        fn process_inputs(
            &self,
            _: Option<Arc<Tokenizer>>,
            input_seqs: &mut [&mut Sequence],
            is_prompt: bool,
            is_xlora: bool,
            device: &Device,
            no_kv_cache: bool,
            last_n_context_len: Option<(usize, usize)>,
            return_raw_logits: bool,
            sliding_window: Option<usize>,
            _: Option<Arc<dyn Any>>,
            mut paged_attn_metadata: Option<PagedAttentionMeta>,
            mapper: Option<&dyn DeviceMapper>,
        ) -> Result<InputProcessorOutput> {
            let flash_sliding_window = if no_kv_cache { None } else { sliding_window };
            if is_xlora && !is_prompt {
                let prompt = get_prompt_input(
                    input_seqs
                        .iter()
                        .map(|seq| seq.get_toks())
                        .collect::<Vec<_>>(),
                    input_seqs,
                    device,
                    last_n_context_len,
                    return_raw_logits,
                    paged_attn_metadata.as_mut(),
                    mapper,
                    flash_sliding_window,
                )?;
                let completion = get_completion_input(
                    input_seqs
                        .iter()
                        .map(|seq| seq.get_toks())
                        .collect::<Vec<_>>(),
                    input_seqs,
                    device,
                    no_kv_cache,
                    last_n_context_len,
                    return_raw_logits,
                    paged_attn_metadata.as_mut(),
                    mapper,
                    flash_sliding_window,
                )?;
                let InnerInputProcessorOutput {
                    inputs:
                        InputMetadata {
                            input: input_ids_full,
                            positions: seqlen_offsets_full,
                            context_lens: _,
                            position_ids,
                            paged_attn_meta: _,
                            flash_meta: flash_meta_full,
                        },
                    seq_indices,
                } = prompt;
                let InnerInputProcessorOutput {
                    inputs:
                        InputMetadata {
                            input: input_ids,
                            positions: seqlen_offsets,
                            context_lens,
                            position_ids: _,
                            paged_attn_meta,
                            flash_meta,
                        },
                    seq_indices: _,
                } = completion;
                let adapter_leases = adapter_leases(input_seqs, &seq_indices);
                let inputs: Box<dyn Any> = Box::new(ModelInputs {
                    input_ids,
                    input_ids_full: Some(input_ids_full),
                    seqlen_offsets,
                    seqlen_offsets_full: Some(seqlen_offsets_full),
                    context_lens,
                    position_ids,
                    paged_attn_meta,
                    flash_meta,
                    flash_meta_full: Some(flash_meta_full),
                    recurrent_batch_kind: RecurrentBatchKind::Decode,
                    adapter_leases,
                });
                Ok(InputProcessorOutput {
                    inputs,
                    seq_indices,
                })
            } else if is_xlora && is_prompt {
                let metadata = get_prompt_input(
                    input_seqs
                        .iter()
                        .map(|seq| seq.get_toks())
                        .collect::<Vec<_>>(),
                    input_seqs,
                    device,
                    last_n_context_len,
                    return_raw_logits,
                    paged_attn_metadata.as_mut(),
                    mapper,
                    flash_sliding_window,
                )?;
                let InnerInputProcessorOutput {
                    inputs:
                        InputMetadata {
                            input: input_ids,
                            positions: seqlen_offsets,
                            context_lens,
                            position_ids,
                            paged_attn_meta,
                            flash_meta,
                        },
                    seq_indices,
                } = metadata;
                let adapter_leases = adapter_leases(input_seqs, &seq_indices);
                let inputs: Box<dyn Any> = Box::new(ModelInputs {
                    input_ids: input_ids.clone(),
                    input_ids_full: Some(input_ids),
                    seqlen_offsets: seqlen_offsets.clone(),
                    seqlen_offsets_full: Some(seqlen_offsets),
                    context_lens,
                    position_ids,
                    paged_attn_meta,
                    flash_meta: flash_meta.clone(),
                    flash_meta_full: Some(flash_meta),
                    recurrent_batch_kind: RecurrentBatchKind::Prefill,
                    adapter_leases,
                });
                Ok(InputProcessorOutput {
                    inputs,
                    seq_indices,
                })
            } else if is_prompt {
                let metadata = get_prompt_input(
                    input_seqs
                        .iter()
                        .map(|seq| seq.get_toks())
                        .collect::<Vec<_>>(),
                    input_seqs,
                    device,
                    last_n_context_len,
                    return_raw_logits,
                    paged_attn_metadata.as_mut(),
                    mapper,
                    flash_sliding_window,
                )?;
                let InnerInputProcessorOutput {
                    inputs:
                        InputMetadata {
                            input: input_ids,
                            positions: seqlen_offsets,
                            context_lens,
                            position_ids,
                            paged_attn_meta,
                            flash_meta,
                        },
                    seq_indices,
                } = metadata;
                let adapter_leases = adapter_leases(input_seqs, &seq_indices);
                let inputs: Box<dyn Any> = Box::new(ModelInputs {
                    input_ids,
                    input_ids_full: None,
                    seqlen_offsets,
                    seqlen_offsets_full: None,
                    context_lens,
                    position_ids,
                    paged_attn_meta,
                    flash_meta,
                    flash_meta_full: None,
                    recurrent_batch_kind: RecurrentBatchKind::Prefill,
                    adapter_leases,
                });
                Ok(InputProcessorOutput {
                    inputs,
                    seq_indices,
                })
            } else {
                let metadata = get_completion_input(
                    input_seqs
                        .iter()
                        .map(|seq| seq.get_toks())
                        .collect::<Vec<_>>(),
                    input_seqs,
                    device,
                    no_kv_cache,
                    last_n_context_len,
                    return_raw_logits,
                    paged_attn_metadata.as_mut(),
                    mapper,
                    flash_sliding_window,
                )?;
                let InnerInputProcessorOutput {
                    inputs:
                        InputMetadata {
                            input: input_ids,
                            positions: seqlen_offsets,
                            context_lens,
                            position_ids,
                            paged_attn_meta,
                            flash_meta,
                        },
                    seq_indices,
                } = metadata;
                let adapter_leases = adapter_leases(input_seqs, &seq_indices);
                let inputs: Box<dyn Any> = Box::new(ModelInputs {
                    input_ids,
                    input_ids_full: None,
                    seqlen_offsets,
                    seqlen_offsets_full: None,
                    context_lens,
                    position_ids,
                    paged_attn_meta,
                    flash_meta,
                    flash_meta_full: None,
                    recurrent_batch_kind: RecurrentBatchKind::Decode,
                    adapter_leases,
                });
                Ok(InputProcessorOutput {
                    inputs,
                    seq_indices,
                })
            }
        }

        fn get_type(&self) -> InputsProcessorType {
            InputsProcessorType::Text
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn padded_decode_rows_alias_row_zero_without_kv_writes() {
            let rows = DecodePagedRows {
                slot_mappings: vec![vec![40, 41], vec![72, 73]],
                block_tables: vec![vec![1, 2], vec![1, 2], vec![3], vec![3]],
                context_lens: vec![40, 41, 8, 9],
                full_block_tables: vec![vec![1, 2], vec![1, 2], vec![3], vec![3]],
                full_context_lens: vec![40, 41, 8, 9],
                query_len: 2,
                block_size: 32,
                use_standard_metadata: true,
                max_paged_context_len: 1024,
                sliding_window: None,
                decode_window: 1,
                devices: vec![Device::Cpu],
                num_kv_heads: 4,
            };
            let padded = rows.padded(4);
            assert_eq!(padded.batch_size(), 4);
            assert_eq!(padded.slot_mappings[2], vec![_PAD_SLOT_ID, _PAD_SLOT_ID]);
            assert_eq!(padded.slot_mappings[3], vec![_PAD_SLOT_ID, _PAD_SLOT_ID]);
            assert_eq!(padded.block_tables.len(), 8);
            assert_eq!(
                &padded.block_tables[4..],
                &[vec![1, 2], vec![1, 2], vec![1, 2], vec![1, 2]]
            );
            assert_eq!(&padded.context_lens[4..], &[40, 41, 40, 41]);
            assert_eq!(&padded.full_context_lens[4..], &[40, 41, 40, 41]);
            let metadata = Arc::new(padded).build().unwrap();
            assert_eq!(metadata.slot_mappings[&Device::Cpu.location()].dims(), &[8]);
            assert_eq!(
                metadata.paged_context_lens_cpu.as_deref(),
                Some(&[40, 41, 8, 9, 40, 41, 40, 41][..])
            );
            assert!(metadata.decode_rows.is_some());
        }

        #[test]
        fn ragged_prompt_selects_each_last_real_token() {
            let short = [1u32, 2];
            let long = [3u32, 4, 5, 6];
            let input = make_prompt_chunk(
                0,
                vec![short.as_slice(), long.as_slice()],
                &[0, 1],
                &Device::Cpu,
                None,
                false,
                None,
                None,
                None,
                None,
                false,
            )
            .unwrap();

            assert_eq!(input.input.dims(), &[2, 4]);
            assert_eq!(input.context_lens, vec![(1, 1), (3, 1)]);
        }

        #[test]
        fn packed_rope_positions_preserve_logical_offsets() {
            let positions = packed_rope_positions(&[0, 16, 32], &[3, 1, 4]).unwrap();

            assert_eq!(positions, vec![0, 1, 2, 16, 32, 33, 34, 35]);
        }

        #[test]
        fn packed_rope_positions_reject_mismatched_metadata() {
            let error = packed_rope_positions(&[0, 16], &[3]).unwrap_err();

            assert!(error.to_string().contains("2 offsets for 1 queries"));
        }

        #[test]
        fn packed_flash_params_preserve_ragged_boundaries() {
            let params = make_flash_params(
                &Device::Cpu,
                None,
                &[0, 3, 1, 4],
                &[0, 3, 1, 4],
                None,
                true,
                true,
            )
            .unwrap();
            let cumulative = params.cumulative_seqlens_q[&Device::Cpu.location()]
                .to_vec1::<u32>()
                .unwrap();

            assert_eq!(params.max_q, 4);
            assert_eq!(cumulative, vec![0, 3, 4, 8]);
        }

        #[test]
        fn sliding_single_token_uses_the_retained_window() {
            assert_eq!(
                sliding_k_lengths(&[0, 1], &[0, 101], 4).unwrap(),
                vec![0, 4]
            );
        }

        #[test]
        fn sliding_query_longer_than_the_window_keeps_the_full_query() {
            assert_eq!(sliding_k_lengths(&[0, 8], &[0, 8], 4).unwrap(), vec![0, 8]);
        }

        #[test]
        fn sliding_cached_multi_token_append_keeps_retained_and_new_tokens() {
            assert_eq!(
                sliding_k_lengths(&[0, 3], &[0, 103], 4).unwrap(),
                vec![0, 7]
            );
        }

        #[test]
        fn fresh_packed_sliding_metadata_preserves_logical_boundaries() {
            let params = make_flash_params(
                &Device::Cpu,
                None,
                &[0, 3, 1, 6],
                &[0, 3, 1, 6],
                Some(4),
                true,
                true,
            )
            .unwrap();
            let sliding = params.sliding_k.unwrap();

            assert_eq!(sliding.max, 6);
            assert_eq!(
                sliding.cumulative_seqlens[&Device::Cpu.location()]
                    .to_vec1::<u32>()
                    .unwrap(),
                vec![0, 3, 4, 10]
            );
        }

        #[test]
        fn sliding_metadata_rejects_inconsistent_lengths() {
            assert!(sliding_k_lengths(&[0, 2], &[0], 4).is_err());
            assert!(sliding_k_lengths(&[0, 3], &[0, 2], 4).is_err());
        }
    }
}

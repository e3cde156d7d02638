#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]

use crate::attention::AttentionMask;
use std::sync::{Arc, Mutex};

use candle_core::{Context, DType, Device, Result, Tensor, D};
use config::Gemma3Config;
use mistralrs_quant::{NonZeroOp, ShardedVarBuilder};
use mmproj::Gemma3MultiModalProjector;
use text::TextModel;

use crate::{
    amoe::{AnyMoeBaseModelMixin, MlpLayer},
    paged_attention::{
        encoder_cache::{cached_encode_images, CacheModality, EncoderCacheManager},
        AttentionImplementation, ModelConfigMetadata,
    },
    pipeline::{
        EitherCache, IsqModel, ModelForwardContext, MultimodalModel, NormalLoadingMetadata,
    },
    utils::unvarbuilder::UnVarBuilder,
    vision_models::multimodal_layout::{
        MultimodalEncoderKey, MultimodalEncoderOutputs, PackedMultimodalLayout,
    },
    AnyMoeConfig, AnyMoeExpertType,
};

pub mod config;
mod inputs_processor;
mod mmproj;
mod text;
pub(crate) use inputs_processor::Gemma3Processor;

use super::siglip::SiglipVisionTransformer;

pub struct Gemma3Model {
    language_model: TextModel,
    multi_modal_projector: Option<Gemma3MultiModalProjector>,
    vision_tower: Option<SiglipVisionTransformer>,
    cfg: Gemma3Config,
    encoder_cache: Arc<Mutex<EncoderCacheManager>>,
}

impl Gemma3Model {
    pub fn new(
        cfg: &Gemma3Config,
        vb: ShardedVarBuilder,
        is_gptx: bool,
        normal_loading_metadata: NormalLoadingMetadata,
        attention_mechanism: AttentionImplementation,
    ) -> Result<Self> {
        match cfg {
            Gemma3Config::Text(text_cfg) => {
                let vb = if text_cfg.use_language_model_prefix {
                    vb.pp("language_model")
                } else {
                    vb
                };
                Ok(Self {
                    language_model: TextModel::new(
                        text_cfg,
                        vb,
                        is_gptx,
                        normal_loading_metadata,
                        attention_mechanism,
                        None,
                    )?,
                    multi_modal_projector: None,
                    vision_tower: None,
                    cfg: cfg.clone(),
                    encoder_cache: Arc::new(Mutex::new(EncoderCacheManager::new(32))),
                })
            }
            Gemma3Config::WithVision {
                text_config,
                vision_config,
                image_token_index,
                mm_tokens_per_image: _,
            } => {
                assert!(*image_token_index < text_config.vocab_size);
                let non_text_vb = vb.clone().without_lora_registry();
                Ok(Self {
                    multi_modal_projector: Some(Gemma3MultiModalProjector::new(
                        cfg,
                        non_text_vb
                            .pp("multi_modal_projector")
                            .set_device(normal_loading_metadata.real_device.clone()),
                    )?),
                    vision_tower: Some(SiglipVisionTransformer::new(
                        vision_config,
                        non_text_vb
                            .pp("vision_tower")
                            .pp("vision_model")
                            .set_device(normal_loading_metadata.real_device.clone()),
                    )?),
                    language_model: TextModel::new(
                        text_config,
                        vb.pp("language_model"),
                        is_gptx,
                        normal_loading_metadata,
                        attention_mechanism,
                        Some(*image_token_index),
                    )?,
                    cfg: cfg.clone(),
                    encoder_cache: Arc::new(Mutex::new(EncoderCacheManager::new(32))),
                })
            }
        }
    }

    fn forward(
        &self,
        input_ids: &Tensor,
        pixel_values: Option<Tensor>,
        image_hashes: &[u64],
        packed_layout: Option<&PackedMultimodalLayout>,
        ctx: &mut ModelForwardContext<'_>,
    ) -> Result<Tensor> {
        let mut input_embeds = self.language_model.embed_tokens(input_ids)?;
        let has_images = pixel_values.is_some();
        if let Some(pixel_values) = pixel_values {
            let Gemma3Config::WithVision {
                image_token_index, ..
            } = &self.cfg
            else {
                unreachable!()
            };
            let special_image_mask = input_ids
                .eq(*image_token_index as f64)?
                .unsqueeze(D::Minus1)?
                .broadcast_as(input_embeds.shape())?
                .to_dtype(DType::U32)?;

            let mask_flat = special_image_mask.flatten_all()?;
            // Nonzero before vision model to allow async processing all the way through logits.
            let indices = mask_flat.nonzero()?.squeeze(1)?;

            let vision_tower = self
                .vision_tower
                .as_ref()
                .context("This model does not support vision.")?;
            let multi_modal_projector = self.multi_modal_projector.as_ref().unwrap();
            let dtype = vision_tower.dtype();

            let image_features = cached_encode_images(
                CacheModality::Image,
                image_hashes,
                &pixel_values.to_dtype(dtype)?,
                &self.encoder_cache,
                |pv| {
                    let vision_outputs = vision_tower.forward(pv, &AttentionMask::None, None)?;
                    Ok(vec![multi_modal_projector.forward(&vision_outputs)?])
                },
            )?
            .remove(0);

            if let Some(layout) = packed_layout {
                if image_features.dim(0)? != image_hashes.len() {
                    candle_core::bail!(
                        "Gemma 3 packed input has {} image outputs but {} image hashes",
                        image_features.dim(0)?,
                        image_hashes.len()
                    );
                }
                let encoder_outputs = image_hashes
                    .iter()
                    .copied()
                    .enumerate()
                    .map(|(index, hash)| {
                        Ok((
                            MultimodalEncoderKey {
                                kind: crate::paged_attention::block_hash::MultimodalKind::Image,
                                hash,
                            },
                            vec![image_features.get(index)?],
                        ))
                    })
                    .collect::<Result<MultimodalEncoderOutputs>>()?;
                input_embeds = layout.splice_embeddings(&input_embeds, &encoder_outputs)?;
            } else {
                let mut x_flat = input_embeds.flatten_all()?;
                let src_flat = image_features.flatten_all()?;
                let current_vals = x_flat.gather(&indices, 0)?;
                let diff = (src_flat - current_vals)?;
                x_flat = x_flat.scatter_add(&indices, &diff, 0)?;
                input_embeds = x_flat.reshape(input_embeds.shape())?;
            }
        };
        let res = self
            .language_model
            .forward_embeds(input_ids, input_embeds, ctx, has_images)?;
        Ok(res)
    }
}

impl IsqModel for Gemma3Model {
    fn residual_tensors(&self) -> Vec<(String, Tensor)> {
        match &self.cfg {
            Gemma3Config::Text(config) if config.use_language_model_prefix => {
                let uvb = UnVarBuilder::new();
                uvb.pp("language_model")
                    .extend(self.language_model.residual_tensors());
                uvb.to_safetensors()
            }
            Gemma3Config::Text(_) => self.language_model.residual_tensors(),
            Gemma3Config::WithVision { .. } => {
                let vision_tower = self.vision_tower.as_ref().unwrap();
                let multi_modal_projector = self.multi_modal_projector.as_ref().unwrap();

                let uvb = UnVarBuilder::new();
                uvb.pp("multi_modal_projector")
                    .extend(multi_modal_projector.residual_tensors());
                uvb.pp("language_model")
                    .extend(self.language_model.residual_tensors());
                uvb.pp("vision_tower")
                    .pp("vision_model")
                    .extend(vision_tower.residual_tensors());

                uvb.to_safetensors()
            }
        }
    }
}

#[derive(Default)]
pub struct Gemma3SpecificArgs {
    pub image_hashes: Vec<u64>,
    pub(crate) packed_layout: Option<PackedMultimodalLayout>,
}

impl crate::speculative::SpeculativeTargetMixin for Gemma3Model {}

impl crate::block_diffusion::BlockDiffusionMixin for Gemma3Model {}

impl MultimodalModel for Gemma3Model {
    fn supports_packed_prefill(&self) -> bool {
        self.language_model.supports_packed_prefill()
    }

    fn supports_mixed_media_batches(&self) -> bool {
        true
    }

    fn forward(
        &self,
        input_ids: &Tensor,
        pixel_values: Option<Tensor>,
        model_specific_args: Box<dyn std::any::Any>,
        ctx: &mut ModelForwardContext<'_>,
    ) -> candle_core::Result<Tensor> {
        let Gemma3SpecificArgs {
            image_hashes,
            packed_layout,
        } = *model_specific_args
            .downcast()
            .expect("Cannot downcast into `Gemma3SpecificArgs`");
        self.forward(
            input_ids,
            pixel_values,
            &image_hashes,
            packed_layout.as_ref(),
            ctx,
        )
    }
    fn default_model_specific_args(&self, _input_ids: &Tensor) -> Box<dyn std::any::Any> {
        Box::new(Gemma3SpecificArgs::default())
    }
    #[cfg(feature = "cuda")]
    fn supports_cuda_decode_graphs(&self) -> bool {
        true
    }
    fn cache(&self) -> &EitherCache {
        self.language_model.cache()
    }
    fn device(&self) -> &Device {
        self.language_model.device()
    }
    fn max_seq_len(&self) -> usize {
        self.language_model.max_seq_len()
    }
    fn config(&self) -> &ModelConfigMetadata {
        self.language_model.config()
    }
    fn encoder_cache_counters(
        &self,
    ) -> Option<(
        Arc<std::sync::atomic::AtomicUsize>,
        Arc<std::sync::atomic::AtomicUsize>,
    )> {
        Some(
            self.encoder_cache
                .lock()
                .expect("encoder cache poisoned")
                .counters(),
        )
    }
}

impl AnyMoeBaseModelMixin for Gemma3Model {
    fn get_mlps(&self) -> Vec<&dyn MlpLayer> {
        self.language_model.get_mlps()
    }
    fn get_mlps_mut(&mut self) -> Vec<&mut Box<dyn MlpLayer>> {
        self.language_model.get_mlps_mut()
    }
    fn create_anymoe_layers(
        &mut self,
        additional_vbs: Vec<ShardedVarBuilder>,
        config: AnyMoeConfig,
        (prefix, mlp): (String, String),
        layers: Vec<usize>,
        expert_type: AnyMoeExpertType,
        gate_vb: Option<ShardedVarBuilder>,
    ) -> Result<()> {
        self.language_model.create_anymoe_layers(
            additional_vbs,
            config,
            (prefix, mlp),
            layers,
            expert_type,
            gate_vb,
        )
    }
    fn amoe_supported(&self) -> bool {
        true
    }
}

use std::sync::Arc;

use candle_core::{DType, Result, Tensor};
use rand::Rng;
use rand_isaac::Isaac64Rng;

use crate::pipeline::sampling::{finish_or_add_toks_to_seq, sample_sequence};
use crate::pipeline::Pipeline;
use crate::prefix_cacher::PrefixCacheManagerV2;
use crate::sampler::Logprobs;
use crate::sequence::{Sequence, SequenceRecognizer, SequenceState};

/// One batched argmax + a single D2H for every verify row of a greedy sequence, replacing a
/// host sampler round trip per draft. None when anything could make the sampler diverge from argmax.
#[cfg(feature = "cuda")]
fn greedy_device_verify_tokens(
    seq: &Sequence,
    verify_logits: &Tensor,
    return_logprobs: bool,
) -> Result<Option<Vec<u32>>> {
    if !verify_logits.device().is_cuda()
        || return_logprobs
        || !matches!(seq.recognizer, SequenceRecognizer::None)
        || seq.tool_call_state.is_some()
    {
        return Ok(None);
    }
    let Some(plan) = seq.sampler().cuda_batch_sampling_plan(false) else {
        return Ok(None);
    };
    if !plan.kind.is_argmax() {
        return Ok(None);
    }
    let logits = match *verify_logits.dims() {
        [1, rows, vocab] => verify_logits.reshape((rows, vocab))?,
        [_, _] => verify_logits.clone(),
        _ => return Ok(None),
    };
    let logits = logits.to_dtype(DType::F32)?.contiguous()?;
    let packed = crate::ops::cuda_top1_logits_f32_packed_batched(&logits)?
        .packed
        .to_vec2::<f32>()?;
    let mut tokens = Vec::with_capacity(packed.len());
    for row in packed {
        if row.len() != crate::ops::CUDA_TOP1_PACKED_WIDTH
            || !row[1].is_finite()
            || row[1] < 0.0
            || row[1].fract() != 0.0
        {
            candle_core::bail!("invalid batched CUDA top-1 verify output");
        }
        #[allow(clippy::cast_possible_truncation)]
        tokens.push(row[1] as u32);
    }
    Ok(Some(tokens))
}

#[cfg(feature = "cuda")]
fn device_token_logprobs(token: u32) -> Logprobs {
    Logprobs {
        token,
        logprob: 0.0,
        top_logprobs: None,
        bytes: None,
    }
}

pub struct VerificationOutcome {
    pub accepted_drafts: usize,
    pub proposed_drafts: usize,
    pub keep_len: usize,
    pub continuation_token: Option<u32>,
}

#[allow(clippy::too_many_arguments)]
pub async fn finish_verified_step<P: Pipeline>(
    pipeline: &P,
    seq: &mut Sequence,
    verify_logits: Tensor,
    proposal: Vec<u32>,
    proposal_logits: Option<Tensor>,
    base_len: usize,
    prefix_cacher: &mut PrefixCacheManagerV2,
    disable_eos_stop: bool,
    rng: Arc<std::sync::Mutex<Isaac64Rng>>,
    anchor_to_emit: Option<Logprobs>,
) -> Result<VerificationOutcome> {
    let general_metadata = pipeline.get_metadata();
    let eos_tok = seq.effective_eos_tokens(&general_metadata.eos_tok, disable_eos_stop);
    let return_logprobs = seq.return_logprobs();

    if let Some(anchor) = anchor_to_emit {
        finish_or_add_toks_to_seq(pipeline, prefix_cacher, seq, anchor, eos_tok, true).await?;
        if matches!(seq.getstate(), SequenceState::Done(_)) {
            let keep_len = base_len + 1;
            seq.clear_staged_speculative_tokens();
            return Ok(VerificationOutcome {
                accepted_drafts: 0,
                proposed_drafts: proposal.len(),
                keep_len,
                continuation_token: None,
            });
        }
    }

    if let Some(proposal_logits) = proposal_logits {
        if stochastic_verification_allowed(
            seq.sampler().is_argmax(),
            !matches!(seq.recognizer, SequenceRecognizer::None),
            seq.tool_call_state.is_some(),
        ) {
            return finish_verified_step_stochastic(
                pipeline,
                seq,
                verify_logits,
                proposal,
                proposal_logits,
                base_len,
                prefix_cacher,
                eos_tok,
                return_logprobs,
                rng,
            )
            .await;
        }
    }

    #[cfg(feature = "cuda")]
    let device_tokens = greedy_device_verify_tokens(seq, &verify_logits, return_logprobs)?;
    #[cfg(not(feature = "cuda"))]
    let device_tokens: Option<Vec<u32>> = None;

    let mut accepted = 0usize;
    for (idx, draft) in proposal.iter().copied().enumerate() {
        let sampled = match &device_tokens {
            #[cfg(feature = "cuda")]
            Some(tokens) => device_token_logprobs(tokens[idx]),
            _ => {
                let row = logit_row(&verify_logits, idx)?;
                sample_sequence(
                    row.clone(),
                    seq,
                    return_logprobs,
                    eos_tok,
                    general_metadata.llg_factory.clone(),
                    general_metadata.max_seq_len,
                    rng.clone(),
                    false,
                    false,
                    false,
                )
                .await?
            }
        };
        let sampled_token = sampled.token;
        if sampled_token == draft {
            accepted += 1;
            finish_or_add_toks_to_seq(pipeline, prefix_cacher, seq, sampled, eos_tok, true).await?;
            if matches!(seq.getstate(), SequenceState::Done(_)) {
                let keep_len = base_len + 1 + accepted;
                seq.clear_staged_speculative_tokens();
                return Ok(VerificationOutcome {
                    accepted_drafts: accepted,
                    proposed_drafts: proposal.len(),
                    keep_len,
                    continuation_token: None,
                });
            }
        } else {
            let keep_len = base_len + 1 + accepted;
            finish_or_add_toks_to_seq(pipeline, prefix_cacher, seq, sampled, eos_tok, true).await?;
            if matches!(seq.getstate(), SequenceState::Done(_)) {
                seq.clear_staged_speculative_tokens();
                return Ok(VerificationOutcome {
                    accepted_drafts: accepted,
                    proposed_drafts: proposal.len(),
                    keep_len,
                    continuation_token: None,
                });
            }
            return Ok(VerificationOutcome {
                accepted_drafts: accepted,
                proposed_drafts: proposal.len(),
                keep_len,
                continuation_token: Some(sampled_token),
            });
        }
    }

    let continuation = match &device_tokens {
        #[cfg(feature = "cuda")]
        Some(tokens) => device_token_logprobs(tokens[accepted]),
        _ => {
            let row = logit_row(&verify_logits, accepted)?;
            sample_sequence(
                row.clone(),
                seq,
                return_logprobs,
                eos_tok,
                general_metadata.llg_factory.clone(),
                general_metadata.max_seq_len,
                rng.clone(),
                false,
                false,
                false,
            )
            .await?
        }
    };
    let continuation_token = continuation.token;
    finish_or_add_toks_to_seq(pipeline, prefix_cacher, seq, continuation, eos_tok, true).await?;

    let keep_len = base_len + 1 + accepted;
    let continuation_token = if matches!(seq.getstate(), SequenceState::Done(_)) {
        seq.clear_staged_speculative_tokens();
        None
    } else {
        Some(continuation_token)
    };

    Ok(VerificationOutcome {
        accepted_drafts: accepted,
        proposed_drafts: proposal.len(),
        keep_len,
        continuation_token,
    })
}

fn stochastic_verification_allowed(
    is_argmax: bool,
    has_constraint: bool,
    has_tool_call_state: bool,
) -> bool {
    !is_argmax && !has_constraint && !has_tool_call_state
}

#[allow(clippy::too_many_arguments)]
async fn finish_verified_step_stochastic<P: Pipeline>(
    pipeline: &P,
    seq: &mut Sequence,
    verify_logits: Tensor,
    proposal: Vec<u32>,
    proposal_logits: Tensor,
    base_len: usize,
    prefix_cacher: &mut PrefixCacheManagerV2,
    eos_tok: Option<&[u32]>,
    return_logprobs: bool,
    rng: Arc<std::sync::Mutex<Isaac64Rng>>,
) -> Result<VerificationOutcome> {
    let mut accepted = 0usize;
    for (idx, draft) in proposal.iter().copied().enumerate() {
        let target_row = logit_row(&verify_logits, idx)?;
        let candidate_row = logit_row(&proposal_logits, idx)?;
        let sampler = seq.sampler();
        let target_probs = sampler.speculative_target_probs(
            flat_logits(target_row.clone())?,
            seq.get_toks(),
            seq.prompt_tokens(),
        )?;
        let candidate_probs = sampler.speculative_candidate_probs(
            flat_logits(candidate_row)?,
            seq.get_toks(),
            seq.prompt_tokens(),
        )?;
        if target_probs.sampling.len() != candidate_probs.len() {
            candle_core::bail!(
                "speculative target/candidate vocab mismatch: target={}, candidate={}",
                target_probs.sampling.len(),
                candidate_probs.len()
            );
        }
        let draft_idx = draft as usize;
        let p_i = target_probs.sampling.get(draft_idx).copied().unwrap_or(0.0);
        let q_i = candidate_probs.get(draft_idx).copied().unwrap_or(0.0);
        let accept_prob = if q_i <= 0.0 {
            if p_i > 0.0 {
                1.0
            } else {
                0.0
            }
        } else {
            (p_i / q_i).min(1.0)
        };
        let draw = {
            let mut rng = rng.lock().expect("could not lock rng mutex");
            rng.random::<f32>()
        };

        if accepts_draft(draw, accept_prob) {
            accepted += 1;
            let sampled =
                sampler.logprobs_from_probs(draft, &target_probs.reporting, return_logprobs)?;
            finish_or_add_toks_to_seq(pipeline, prefix_cacher, seq, sampled, eos_tok, true).await?;
            if matches!(seq.getstate(), SequenceState::Done(_)) {
                let keep_len = base_len + 1 + accepted;
                seq.clear_staged_speculative_tokens();
                return Ok(VerificationOutcome {
                    accepted_drafts: accepted,
                    proposed_drafts: proposal.len(),
                    keep_len,
                    continuation_token: None,
                });
            }
            continue;
        }

        let mut adjusted_probs = target_probs
            .sampling
            .iter()
            .zip(candidate_probs.iter())
            .map(|(p, q)| (p - q).max(0.0))
            .collect::<Vec<_>>();
        if normalize_probs(&mut adjusted_probs).is_err() {
            adjusted_probs = target_probs.sampling;
        }
        let sampled = sampler.sample_from_probs(
            &adjusted_probs,
            &target_probs.reporting,
            return_logprobs,
            rng.clone(),
        )?;
        let sampled_token = sampled.token;
        let keep_len = base_len + 1 + accepted;
        finish_or_add_toks_to_seq(pipeline, prefix_cacher, seq, sampled, eos_tok, true).await?;
        if matches!(seq.getstate(), SequenceState::Done(_)) {
            seq.clear_staged_speculative_tokens();
            return Ok(VerificationOutcome {
                accepted_drafts: accepted,
                proposed_drafts: proposal.len(),
                keep_len,
                continuation_token: None,
            });
        }
        return Ok(VerificationOutcome {
            accepted_drafts: accepted,
            proposed_drafts: proposal.len(),
            keep_len,
            continuation_token: Some(sampled_token),
        });
    }

    let row = logit_row(&verify_logits, accepted)?;
    let sampler = seq.sampler();
    let target_probs = sampler.speculative_target_probs(
        flat_logits(row.clone())?,
        seq.get_toks(),
        seq.prompt_tokens(),
    )?;
    let continuation = sampler.sample_from_probs(
        &target_probs.sampling,
        &target_probs.reporting,
        return_logprobs,
        rng,
    )?;
    let continuation_token = continuation.token;
    finish_or_add_toks_to_seq(pipeline, prefix_cacher, seq, continuation, eos_tok, true).await?;

    let keep_len = base_len + 1 + accepted;
    let continuation_token = if matches!(seq.getstate(), SequenceState::Done(_)) {
        seq.clear_staged_speculative_tokens();
        None
    } else {
        Some(continuation_token)
    };

    Ok(VerificationOutcome {
        accepted_drafts: accepted,
        proposed_drafts: proposal.len(),
        keep_len,
        continuation_token,
    })
}

fn logit_row(logits: &Tensor, row: usize) -> Result<Tensor> {
    match logits.dims() {
        [_, rows, _] => {
            if row >= *rows {
                candle_core::bail!("speculative logit row {row} is out of range for {rows} rows");
            }
            logits.narrow(1, row, 1)
        }
        [rows, _] => {
            if row >= *rows {
                candle_core::bail!("speculative logit row {row} is out of range for {rows} rows");
            }
            logits.narrow(0, row, 1)
        }
        shape => candle_core::bail!("speculative logits have unsupported shape {shape:?}"),
    }
}

fn flat_logits(logits: Tensor) -> Result<Tensor> {
    match logits.dims() {
        [1, 1, _] => logits.squeeze(0)?.squeeze(0)?.to_dtype(DType::F32),
        [1, _] => logits.squeeze(0)?.to_dtype(DType::F32),
        [_] => logits.to_dtype(DType::F32),
        dims => candle_core::bail!("speculative logit row must flatten to rank 1, got {dims:?}"),
    }
}

fn normalize_probs(probs: &mut [f32]) -> Result<()> {
    let sum: f32 = probs
        .iter()
        .copied()
        .filter(|prob| prob.is_finite() && *prob > 0.0)
        .sum();
    if sum <= 0.0 {
        candle_core::bail!("all probabilities are zero in speculative adjusted distribution");
    }
    for prob in probs.iter_mut() {
        if prob.is_finite() && *prob > 0.0 {
            *prob /= sum;
        } else {
            *prob = 0.0;
        }
    }
    Ok(())
}

fn accepts_draft(draw: f32, accept_prob: f32) -> bool {
    draw < accept_prob
}

#[cfg(test)]
mod tests {
    use super::{accepts_draft, stochastic_verification_allowed};

    #[test]
    fn tool_sequences_use_per_row_target_sampling() {
        assert!(stochastic_verification_allowed(false, false, false));
        assert!(!stochastic_verification_allowed(false, false, true));
        assert!(!stochastic_verification_allowed(false, true, false));
        assert!(!stochastic_verification_allowed(true, false, false));
    }

    #[test]
    fn zero_probability_drafts_are_never_accepted() {
        assert!(!accepts_draft(0.0, 0.0));
        assert!(accepts_draft(0.0, 1.0));
        assert!(accepts_draft(0.999, 1.0));
    }
}

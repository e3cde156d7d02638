//! The CPU attention kernel a local model's layers call for a prompt (`vendor/mistral.rs`,
//! `mistralrs-core/src/attention/backends/cpu/`, see its BATON.md), against plain f64
//! arithmetic on the same half-precision values.
//!
//! What must hold: each output row is the softmax-weighted mean of the V rows its mask lets it
//! see, to within the output's own rounding to f16 (the model's CPU KV cache is f16, and so is
//! the kernel's output) and the kernel's f32 sums. The shapes are the local models' own: grouped
//! query heads (SmolLM2-135M: 9 heads over 3 KV heads of 64; Qwen2.5-1.5B: 12 over 2 of 128),
//! a causal mask, a prompt read cold (as many queries as keys) and one read after a cached
//! prefix (fewer queries than keys), lengths that are not multiples of the kernel's tiles, and
//! K and V as the strided views a layer passes.

use mistralrs::core::cpu_attention;
use mistralrs::{DType, Device, Tensor};

/// Uniform values in [-amp, amp], from a fixed seed, rounded to f16 as the KV cache holds them.
fn values(seed: u64, n: usize, amp: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let raw: Vec<f32> = (0..n)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32;
            (2.0 * unit - 1.0) * amp
        })
        .collect();
    Tensor::from_vec(raw, n, &Device::Cpu)
        .and_then(|t| t.to_dtype(DType::F16))
        .and_then(|t| t.to_dtype(DType::F32))
        .and_then(|t| t.to_vec1())
        .unwrap()
}

struct Case {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    q_len: usize,
    kv_len: usize,
}

fn check(case: &Case) {
    let Case { heads, kv_heads, head_dim: d, q_len, kv_len } = *case;
    let what = format!("{heads} heads over {kv_heads}, head_dim {d}, {q_len} queries, {kv_len} keys");
    let dev = Device::Cpu;
    // scores spread over several units, so a key read from the wrong place changes the weights
    let q = values(1, q_len * heads * d, 3.0);
    let k = values(2, kv_heads * kv_len * d, 1.0);
    let v = values(3, kv_heads * kv_len * d, 1.0);
    let scale = 1.0 / (d as f32).sqrt();
    // the causal mask with the queries at the end of the keys, as after a cached prefix
    let offset = kv_len - q_len;
    let mask: Vec<f32> = (0..q_len)
        .flat_map(|i| (0..kv_len).map(move |j| if j <= offset + i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();

    let f16 = |data: &[f32], shape: (usize, usize, usize, usize)| {
        Tensor::from_vec(data.to_vec(), shape, &dev).unwrap().to_dtype(DType::F16).unwrap()
    };
    let q_t = f16(&q, (1, q_len, heads, d));
    // a layer keeps K and V as (b, kv_heads, kv_len, d) and hands the kernel (b, kv_len, kv_heads, d)
    let k_t = f16(&k, (1, kv_heads, kv_len, d)).transpose(1, 2).unwrap();
    let v_t = f16(&v, (1, kv_heads, kv_len, d)).transpose(1, 2).unwrap();
    let mask_t = Tensor::from_vec(mask.clone(), (q_len, kv_len), &dev).unwrap();
    let out = cpu_attention(&q_t, &k_t, &v_t, Some(&mask_t), scale).unwrap();
    assert_eq!(out.dims(), &[1, heads, q_len, d], "{what}: output shape");
    let got: Vec<f32> = out.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap();

    let mut worst = 0f64;
    for h in 0..heads {
        let kh = h / (heads / kv_heads);
        for i in 0..q_len {
            let q_row = &q[(i * heads + h) * d..][..d];
            let scores: Vec<f64> = (0..kv_len)
                .map(|j| {
                    let k_row = &k[(kh * kv_len + j) * d..][..d];
                    let dot: f64 = q_row.iter().zip(k_row).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
                    dot * f64::from(scale) + f64::from(mask[i * kv_len + j])
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            for x in 0..d {
                let expected: f64 =
                    weights.iter().enumerate().map(|(j, w)| w * f64::from(v[(kh * kv_len + j) * d + x])).sum::<f64>()
                        / total;
                let actual = f64::from(got[(h * q_len + i) * d + x]);
                worst = worst.max((actual - expected).abs());
                assert!(
                    (actual - expected).abs() <= 1e-3,
                    "{what}: head {h}, query {i}, value {x}: {actual} where plain arithmetic gives {expected}"
                );
            }
        }
    }
    eprintln!("{what}: worst difference {worst:.2e}");
}

#[test]
fn prompts_attend_as_plain_arithmetic_does() {
    for case in [
        // SmolLM2-135M's heads, a prompt read cold and after a cached prefix
        Case { heads: 9, kv_heads: 3, head_dim: 64, q_len: 203, kv_len: 203 },
        Case { heads: 9, kv_heads: 3, head_dim: 64, q_len: 61, kv_len: 333 },
        // Qwen2.5-1.5B's heads
        Case { heads: 12, kv_heads: 2, head_dim: 128, q_len: 150, kv_len: 150 },
        Case { heads: 12, kv_heads: 2, head_dim: 128, q_len: 37, kv_len: 290 },
        // too few queries to widen K and V for: the kernel converts tile by tile
        Case { heads: 2, kv_heads: 2, head_dim: 64, q_len: 3, kv_len: 140 },
    ] {
        check(&case);
    }
}

//! The CPU path of candle's quantized matrix products (`vendor/candle`, see its BATON.md), over
//! every quantization a conductor GGUF uses.
//!
//! What must hold, and how exactly:
//! - A row's result does not depend on the rows computed with it, bit for bit: a prompt's rows
//!   give what each row gives alone. Every kernel here computes an output row from that row's
//!   quantized input only, so there is no reason for a difference, and a difference would make a
//!   greedy generation depend on how its prompt was batched.
//! - Products agree with plain f32 arithmetic on the dequantized weights to within 2% of the
//!   largest output: the input is quantized to 8 bits on the way, so agreement is close, not
//!   exact, and each kernel family (scalar, AVX2, the repacked AVX2/AVX-512 tiles) sums in its
//!   own order.
//!
//! Shapes that candle's repacked x86 kernels take (64 and 48 output columns, multiples of their
//! 16-row tiles; Q4_K, Q6_K, Q5_0, Q4_1 and, with VNNI, Q8_0) and one that only the row-by-row
//! kernels take (67 columns); and for 32-value types rows of 896 values, which the tiles take
//! with the activations padded to whole 256-value blocks.
//!
//! A weight the tiled kernels take is kept only as tiles once loaded (`keep_only_cpu_tiles`):
//! everything read from it must then be what its GGUF blocks give, bit for bit, and the tiles
//! may take no more memory than the blocks did, within the Q4_K tile's f16 scales (1.03x).

use candle_core::quantized::k_quants::{BlockQ4_1, BlockQ8_1, BlockQ8K, QK_K};
use candle_core::quantized::{GgmlDType, GgmlType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use std::borrow::Cow;

fn check(dtype: GgmlDType, (m, k, n): (usize, usize, usize)) -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
    let q = QTensor::quantize(&w, dtype)?;
    let dequantized = q.dequantize(&dev)?;
    let matmul = QMatMul::from_qtensor(q)?;
    let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?;

    let all = matmul.forward(&x)?.to_vec2::<f32>()?;
    for (row, got) in all.iter().enumerate() {
        let alone = matmul.forward(&x.narrow(0, row, 1)?)?.to_vec2::<f32>()?;
        assert_eq!(got, &alone[0], "{dtype:?} {n} columns: row {row} of {m} differs from the same row alone");
    }

    let expected = x.matmul(&dequantized.t()?)?.to_vec2::<f32>()?;
    let scale = expected.iter().flatten().fold(0f32, |a, v| a.max(v.abs()));
    let worst = all.iter().flatten().zip(expected.iter().flatten()).fold(0f32, |a, (g, e)| a.max((g - e).abs()));
    assert!(worst <= 0.02 * scale, "{dtype:?} {n} columns: off by {worst} where values reach {scale}");
    Ok(())
}

#[test]
fn many_rows_give_what_each_row_gives_alone_and_match_f32() -> candle_core::Result<()> {
    for dtype in [
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q8_0,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ] {
        // 45 input rows: not a multiple of any kernel's row tile.
        check(dtype, (45, 512, 64))?;
        check(dtype, (45, 512, 67))?;
        // three 16-row tiles: AMX (Q4_K, 32 rows or more, where the CPU has it) takes tiles in
        // pairs, so the last one goes alone
        check(dtype, (45, 512, 48))?;
        // 90 rows: AMX takes a superblock past blocks of 32 rows, the last one here with rows
        // in both of its 16-row halves (26)
        check(dtype, (90, 512, 48))?;
        // rows not a multiple of 256 values (Qwen2.5-0.5B's 896): the tiles of 32-value types
        // end mid-way through the activations' last 256-value block
        if dtype.block_size() == 32 {
            check(dtype, (45, 896, 64))?;
        }
    }
    Ok(())
}

/// Baton's Q4_1 kernels (an AVX2 dot product, and one that takes four weight rows at once)
/// against candle's scalar reference: the four-row kernel gives each row bit for bit what the
/// one-row kernel gives, and both agree with the reference up to the order of float sums.
#[test]
fn q4_1_kernels_match_the_scalar_reference() {
    let k = 4096;
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut random_row = || -> Vec<f32> {
        (0..k)
            .map(|_| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                (rng >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    };
    let weights: Vec<Vec<BlockQ4_1>> = (0..4)
        .map(|_| {
            let mut blocks = vec![BlockQ4_1::zeros(); k / 32];
            BlockQ4_1::from_float(&random_row(), &mut blocks);
            blocks
        })
        .collect();
    let mut input = vec![BlockQ8_1::zeros(); k / 32];
    BlockQ8_1::from_float(&random_row(), &mut input);

    let four = BlockQ4_1::vec_dot_4(k, &weights[0], &weights[1], &weights[2], &weights[3], &input);
    let four = [four.0, four.1, four.2, four.3];
    for (r, w) in weights.iter().enumerate() {
        let one = BlockQ4_1::vec_dot(k, w, &input);
        assert_eq!(four[r].to_bits(), one.to_bits(), "row {r}: four at once {} vs alone {one}", four[r]);
        let reference = BlockQ4_1::vec_dot_unopt(k, w, &input);
        let tolerance = 1e-3 * reference.abs().max(1.0);
        assert!((one - reference).abs() <= tolerance, "row {r}: kernel {one} vs scalar reference {reference}");
    }
}

// Activations are quantized to Q8_K for every Q4_K and Q6_K product (for the x86 tiles of
// 32-value types, with a scale per 32 values); on x86 with AVX2 by vector kernels that must
// give the scalar code's bytes.
#[test]
fn activations_quantize_to_q8k_as_the_scalar_reference_does() {
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut uniform = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    };
    let mut blocks: Vec<Vec<f32>> = Vec::new();
    for scale in [1e-3f32, 1.0, 37.0, 1e4] {
        blocks.push((0..QK_K).map(|_| uniform() * scale).collect());
    }
    // a largest magnitude of 127 makes the scale exactly 1 or -1, so values at .5 test the
    // rounding; the same magnitude twice, with both signs, tests which one sets the sign
    let mut halves: Vec<f32> = (0..QK_K).map(|i| (i as f32 - 128.0) / 2.0).collect();
    halves[3] = -127.0;
    halves[200] = 127.0;
    blocks.push(halves.clone());
    halves[3] = 127.0;
    halves[200] = -127.0;
    blocks.push(halves);
    // zeros, and a single value
    blocks.push(vec![0.0; QK_K]);
    let mut one = vec![0.0; QK_K];
    one[255] = -0.25;
    blocks.push(one);

    let row: Vec<f32> = blocks.concat();
    let mut got = vec![BlockQ8K::zeros(); blocks.len()];
    BlockQ8K::from_float(&row, &mut got);
    let mut expected = vec![BlockQ8K::zeros(); blocks.len()];
    BlockQ8K::from_float_unopt(&row, &mut expected);
    for (b, (got, expected)) in got.iter().zip(&expected).enumerate() {
        // f32 equality would take -0 for 0; the scale's bits must match
        assert_eq!(format!("{got:?}"), format!("{expected:?}"), "block {b} differs");
    }

    // and with a scale for each 32 values, as the tiles of Q4_1, Q5_0 and Q8_0 take them
    let mut got = vec![BlockQ8K::zeros(); blocks.len()];
    let mut got_scales = vec![0f32; blocks.len() * 8];
    BlockQ8K::from_float_per_32(&row, &mut got, &mut got_scales);
    let mut expected = vec![BlockQ8K::zeros(); blocks.len()];
    let mut expected_scales = vec![0f32; blocks.len() * 8];
    BlockQ8K::from_float_per_32_unopt(&row, &mut expected, &mut expected_scales);
    for (b, (got, expected)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(format!("{got:?}"), format!("{expected:?}"), "block {b} differs, scale per 32 values");
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got_scales), bits(&expected_scales), "the scales per 32 values differ");
}

// Projections that share an input (a layer's gate and up) are computed together on x86
// (`QTensor::gemv_fused_shared_lhs`: one quantization of the input, one parallel region), for
// one row (decode) or a prompt's rows; each must give what its own product gives, bit for bit,
// and a prompt's rows (AMX, where the CPU has it) what each row gives alone (the AVX-512 tiles).
#[test]
fn projections_sharing_an_input_give_what_each_gives_alone() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let k = 512;
    for dtype in [GgmlDType::Q4K, GgmlDType::Q4_1, GgmlDType::Q6K, GgmlDType::Q8_0] {
        let floats = [96, 64]
            .into_iter()
            .map(|n| Tensor::randn(0f32, 1.0, (n, k), &dev))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let quantize = |w: &Tensor| QTensor::quantize(w, dtype);
        let together_weights = floats.iter().map(quantize).collect::<candle_core::Result<Vec<_>>>()?;
        let alone_weights =
            floats.iter().map(|w| QMatMul::from_qtensor(quantize(w)?)).collect::<candle_core::Result<Vec<_>>>()?;
        for m in [1, 45] {
            let x = Tensor::randn(0f32, 1.0, (1, m, k), &dev)?;
            let refs: Vec<&QTensor> = together_weights.iter().collect();
            let Some(together) = QTensor::gemv_fused_shared_lhs(&refs, &x)? else {
                // not taken on this CPU (the fused kernel needs AVX-512)
                continue;
            };
            for (alone, got) in alone_weights.iter().zip(together) {
                assert_eq!(
                    got.flatten_all()?.to_vec1::<f32>()?,
                    alone.forward(&x)?.flatten_all()?.to_vec1::<f32>()?,
                    "{dtype:?}, {m} rows: together and alone differ"
                );
                for r in 0..m {
                    assert_eq!(
                        got.narrow(1, r, 1)?.flatten_all()?.to_vec1::<f32>()?,
                        alone.forward(&x.narrow(1, r, 1)?)?.flatten_all()?.to_vec1::<f32>()?,
                        "{dtype:?}, {m} rows: row {r} together and the row alone differ"
                    );
                }
            }
        }
    }
    Ok(())
}

fn tiled_kernels_take(dtype: GgmlDType) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 =
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
        avx2 && matches!(dtype, GgmlDType::Q4K | GgmlDType::Q6K | GgmlDType::Q5_0 | GgmlDType::Q4_1)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = dtype;
        false
    }
}

#[test]
fn a_weight_kept_only_as_tiles_gives_what_its_blocks_give() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    for (dtype, k) in [
        (GgmlDType::Q4K, 512),
        (GgmlDType::Q6K, 512),
        (GgmlDType::Q8_0, 512),
        (GgmlDType::Q5_0, 512),
        (GgmlDType::Q4_1, 512),
        (GgmlDType::Q8_0, 896),
        (GgmlDType::Q5_0, 896),
        (GgmlDType::Q4_1, 896),
    ] {
        let n = 64;
        let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
        let blocks = QTensor::quantize(&w, dtype)?.data()?.into_owned();
        let load = || QTensor::new(QStorage::from_data(Cow::Borrowed(&blocks), &dev, dtype)?, (n, k));
        let kept = load()?;
        let mut tiled = load()?;
        let took = tiled.keep_only_cpu_tiles();
        // Q8_0's tiles depend on the kernel tier in use (MISTRALRS_FORCE_AVX2 turns them off)
        if dtype != GgmlDType::Q8_0 {
            assert_eq!(took, tiled_kernels_take(dtype), "{dtype:?}: tiles only");
        }
        if !tiled.is_tiles_only() {
            continue;
        }

        assert!(tiled.data()? == Cow::Borrowed(&blocks[..]), "{dtype:?}: the blocks rebuilt from the tiles differ");
        assert_eq!(tiled.storage_size_in_bytes(), blocks.len());
        let resident = tiled.resident_size_in_bytes() as f64;
        assert!(
            resident <= 1.03 * blocks.len() as f64,
            "{dtype:?}: tiles take {resident} bytes for {} in blocks",
            blocks.len()
        );
        let (a, b) = (kept.dequantize(&dev)?.to_vec2::<f32>()?, tiled.dequantize(&dev)?.to_vec2::<f32>()?);
        assert!(a == b, "{dtype:?}: dequantized weights differ");

        let (kept, tiled) = (QMatMul::from_qtensor(kept)?, QMatMul::from_qtensor(tiled)?);
        let ids = Tensor::new(&[0u32, 17, 63, 5, 17], &dev)?;
        let (a, b) = (kept.embedding(&ids)?.to_vec2::<f32>()?, tiled.embedding(&ids)?.to_vec2::<f32>()?);
        assert!(a == b, "{dtype:?}: embedding rows differ");
        for m in [1, 3, 45] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
            let (a, b) = (kept.forward(&x)?.to_vec2::<f32>()?, tiled.forward(&x)?.to_vec2::<f32>()?);
            assert!(a == b, "{dtype:?}: {m} rows: products differ");
            // f16 input: the blocks take candle's f16 kernel, the tiles the f32 one
            let x = x.to_dtype(DType::F16)?;
            let a = kept.forward(&x)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            let b = tiled.forward(&x)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            let scale = a.iter().flatten().fold(0f32, |s, v| s.max(v.abs()));
            let worst = a.iter().flatten().zip(b.iter().flatten()).fold(0f32, |s, (a, b)| s.max((a - b).abs()));
            assert!(worst <= 0.02 * scale, "{dtype:?}: f16 input off by {worst} where values reach {scale}");
        }
    }
    Ok(())
}

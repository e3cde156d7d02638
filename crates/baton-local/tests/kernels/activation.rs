//! The gated activation of a local model's MLP on CPU, `silu(gate) * up` (`vendor/mistral.rs`,
//! `mistralrs-quant/src/utils/ops.rs`, `FusedGlu`; see its BATON.md), against f64 arithmetic.
//!
//! What must hold:
//! - Each value is within 4 ulp of `silu(a) * b` computed in f64 and rounded to f32 (the vector
//!   exp is within 2 ulp of libm's `expf`; the division and product add one rounding each), or
//!   within 1e-37 where the true value is smaller than that, over the whole range that reaches
//!   the activation. Past -88.72, where e^-a leaves f32's range, the result is 0, as f32
//!   arithmetic gives it (the scalar form too).
//! - A value's result does not depend on where it sits in the tensor, bit for bit: the threads'
//!   chunks end mid-row, and a prompt's rows must give what each row gives alone. The rows here
//!   are not a whole number of 16-value vectors, so the vector code's masked tail is checked too.

use mistralrs::core::{GluActivationType, fused_glu};
use mistralrs::{Device, Tensor};

fn silu_mul(a: &[f32], b: &[f32], shape: (usize, usize)) -> Vec<f32> {
    let dev = Device::Cpu;
    let a = Tensor::from_vec(a.to_vec(), shape, &dev).unwrap();
    let b = Tensor::from_vec(b.to_vec(), shape, &dev).unwrap();
    let out = fused_glu(&a, &b, GluActivationType::Silu).unwrap();
    out.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn reference(a: f32, b: f32) -> f64 {
    let a = a as f64;
    a / (1.0 + (-a).exp()) * b as f64
}

/// Pseudo-random values in [-amp, amp] from a fixed seed.
fn values(seed: u64, n: usize, amp: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
        })
        .collect()
}

#[test]
fn silu_times_up_is_within_4_ulp_of_f64_over_the_whole_range() {
    // a sweep through every scale from 1e-30 to 110 on both sides, the edges of exp's range,
    // and values as an MLP's gate gives them
    let mut a: Vec<f32> = Vec::new();
    for e in (-3000..=204).step_by(3) {
        let x = 10f32.powf(e as f32 / 100.0);
        a.extend([x, -x, x * 1.37, -x * 1.37]);
    }
    a.extend([0.0, -0.0, 87.3, -87.3, 88.72, -88.72, 89.0, -89.0, 103.9, -103.9, 1e30, -1e30]);
    a.extend(values(1, 20_000, 12.0));
    // 1,539 columns (SmolLM2's MLP has 1,536): not a multiple of 16, so that chunks end mid-vector
    let cols = 1539;
    let rows = a.len().div_ceil(cols);
    a.extend(values(2, rows * cols - a.len(), 6.0));
    let b: Vec<f32> = values(3, a.len(), 3.0).iter().map(|v| if *v == 0.0 { 1.0 } else { *v }).collect();

    let got = silu_mul(&a, &b, (rows, cols));
    let mut worst = (0f64, 0f32);
    for ((&x, &y), &g) in a.iter().zip(&b).zip(&got) {
        let want = reference(x, y);
        let err = (g as f64 - want).abs();
        assert!(g.is_finite(), "silu({x}) * {y} gave {g}, want {want}");
        if x < -88.73 {
            // e^-x is past f32's largest value, so x / (1 + e^-x) is 0 in f32 arithmetic
            assert_eq!(g, 0.0, "silu({x}) * {y}");
            continue;
        }
        if want.abs() < 1e-37 {
            assert!(err < 1e-37, "silu({x}) * {y} gave {g}, want {want}");
            continue;
        }
        let ulps = err / (f32::EPSILON as f64 * want.abs());
        if ulps > worst.0 {
            worst = (ulps, x);
        }
    }
    assert!(worst.0 <= 4.0, "off by {:.2} ulp at silu({})", worst.0, worst.1);

    // every length of a vector's tail, alone: the same values as in the long tensor
    for len in 1..=17 {
        let alone = silu_mul(&a[..len], &b[..len], (1, len));
        assert!(
            alone.iter().zip(&got).all(|(x, y)| x.to_bits() == y.to_bits()),
            "the first {len} values alone differ from the same values in {rows} rows"
        );
    }
}

#[test]
fn a_prompts_rows_give_what_each_row_gives_alone() {
    let (rows, cols) = (37, 1539);
    let a = values(4, rows * cols, 8.0);
    let b = values(5, rows * cols, 2.0);
    let all = silu_mul(&a, &b, (rows, cols));
    for r in 0..rows {
        let span = r * cols..(r + 1) * cols;
        let alone = silu_mul(&a[span.clone()], &b[span.clone()], (1, cols));
        assert!(
            alone.iter().zip(&all[span]).all(|(x, y)| x.to_bits() == y.to_bits()),
            "row {r} of {rows} differs from the same row alone"
        );
    }
}

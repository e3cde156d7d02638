//! The CPU prompt path of the patched candle-core (`vendor/candle-core`, see its BATON.md): a
//! quantized matmul over many rows at once gives, row for row, exactly what it gives each row
//! alone, and both agree with plain f32 arithmetic on the dequantized weights. Q4_1 checks the
//! AVX2 kernel added there; Q4_1 and Q4_K the kernels that take four input rows at once (45 rows
//! run as groups of four and a remainder); the others the tiling, over every quantization a
//! conductor GGUF uses.

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};

fn check(dtype: GgmlDType) -> candle_core::Result<()> {
    let dev = Device::Cpu;
    // Sizes that are not multiples of the kernel's tiles (8 weight rows, 32 input rows).
    let (m, k, n) = (45, 512, 67);
    let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
    let q = QTensor::quantize(&w, dtype)?;
    let dequantized = q.dequantize(&dev)?;
    let matmul = QMatMul::from_qtensor(q)?;
    let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?;

    let all = matmul.forward(&x)?.to_vec2::<f32>()?;
    for (row, got) in all.iter().enumerate() {
        let alone = matmul.forward(&x.narrow(0, row, 1)?)?.to_vec2::<f32>()?;
        assert_eq!(got, &alone[0], "{dtype:?}: row {row} of {m} differs from the same row alone");
    }

    // The input is quantized to 8 bits on the way, so agreement is close, not exact.
    let expected = x.matmul(&dequantized.t()?)?.to_vec2::<f32>()?;
    let scale = expected.iter().flatten().fold(0f32, |a, v| a.max(v.abs()));
    let worst = all.iter().flatten().zip(expected.iter().flatten()).fold(0f32, |a, (g, e)| a.max((g - e).abs()));
    assert!(worst <= 0.02 * scale, "{dtype:?}: off by {worst} where values reach {scale}");
    Ok(())
}

#[test]
fn many_rows_give_what_each_row_gives_alone_and_match_f32() -> candle_core::Result<()> {
    for dtype in [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q8_0, GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K] {
        check(dtype)?;
    }
    Ok(())
}

//! x86 repacked quantized kernels: weights tiled [n/16][k-blocks][16 rows] so one
//! vpdpbusd (AVX512-VNNI) produces 16 output columns for 4 k-values per instruction.
//! Activations are BlockQ8K rows; q4k/q6k quants are unsigned so vpdpbusd applies
//! directly with the min/offset terms corrected through the q8k bsums, and q8_0
//! weights are stored offset by +128 with the same correction.

use super::k_quants::{
    BlockQ4K, BlockQ4_1, BlockQ5_0, BlockQ6K, BlockQ8K, BlockQ8_0, QK4_1, QK5_0, QK8_0, QK_K,
};
use super::{GgmlType, QuantizedType};
use half::f16;

pub(crate) const TILE_N: usize = 16;

// One k-superblock (256 values) for 16 output rows.
// Baton: the tiles hold the GGUF's own numbers and no more bytes than it (2,368 bytes for
// 16 rows of 144-byte blocks, 1.03x; upstream widened the scales to f32, 3,072 bytes, 1.33x),
// because decode reads every weight once per token and is bound by memory. The kernels
// multiply d by the 6-bit scale as the block's own dequantization does, so products are
// the same bit for bit, and `q4k_block` gives the original block back.
#[repr(C)]
pub(crate) struct TileQ4K {
    pub(crate) d: [f16; TILE_N],
    pub(crate) dmin: [f16; TILE_N],
    // per-subblock (8) per-row (16) 6-bit scales and mins, one byte each
    pub(crate) sc: [[u8; TILE_N]; 8],
    pub(crate) mn: [[u8; TILE_N]; 8],
    // nibble-packed: [k8-group (32)][row (16)][4 bytes]; byte j = q[8g+j] | q[8g+j+4] << 4
    pub(crate) qs: [u8; QK_K / 8 * TILE_N * 4],
}
const _: () = assert!(std::mem::size_of::<TileQ4K>() == 2368);

// Baton: the 6-bit quants stay split in low nibbles and high bit pairs as in the GGUF
// (3,360 bytes for 16 rows of 210-byte blocks, 1.0x; upstream widened each to a byte and the
// scales to f32, 5,120 bytes, 1.52x). The kernels join them in registers.
#[repr(C)]
pub(crate) struct TileQ6K {
    pub(crate) d: [f16; TILE_N],
    pub(crate) scales: [[i8; TILE_N]; 16],
    // low 4 bits, laid out as TileQ4K's qs: [k8-group (32)][row (16)][4 bytes];
    // byte j = lo[8g+j] | lo[8g+j+4] << 4
    pub(crate) ql: [u8; QK_K / 8 * TILE_N * 4],
    // high 2 bits per 16-value subblock s: [s (16)][row (16)][4 bytes]; byte j holds
    // values 16s+j, 16s+4+j, 16s+8+j, 16s+12+j at bits 0, 2, 4, 6
    pub(crate) qh: [u8; QK_K / 16 * TILE_N * 4],
}
const _: () = assert!(std::mem::size_of::<TileQ6K>() == 3360);

// One 32-value block group for 16 rows of q8_0 weights, stored offset by +128.
#[repr(C)]
pub(crate) struct TileQ8_0 {
    pub(crate) d: [f16; TILE_N],
    pub(crate) qs: [u8; QK8_0 * TILE_N],
}

// Baton: one 32-value block group for 16 rows of q5_0 weights, in the GGUF's bytes (1.0x):
// the unsigned 5-bit values (real value v - 16) split in low nibbles and high bits, joined in
// registers. Qwen2.5-0.5B's GGUF stores most of its matrices so (its 896-wide rows are not a
// multiple of the K-quants' 256).
#[repr(C)]
pub(crate) struct TileQ5_0 {
    pub(crate) d: [f16; TILE_N],
    // low 4 bits, laid out as TileQ4K's qs: [k8-group (4)][row (16)][4 bytes];
    // byte j = lo[8g+j] | lo[8g+j+4] << 4
    pub(crate) qs: [u8; QK5_0 / 8 * TILE_N * 4],
    // high bits: [row (16)][4 bytes]; bit g of byte j is value 4g+j's
    pub(crate) qh: [u8; TILE_N * 4],
}
const _: () = assert!(std::mem::size_of::<TileQ5_0>() == 352);

// Baton: one 32-value block group for 16 rows of q4_1 weights, in the GGUF's bytes (1.0x):
// the unsigned 4-bit values with each row's scale d and offset m (a value is d * q + m).
// Small models such as SmolLM2-135M-Instruct Q4_1 store their matrices so.
#[repr(C)]
pub(crate) struct TileQ4_1 {
    pub(crate) d: [f16; TILE_N],
    pub(crate) m: [f16; TILE_N],
    // laid out as TileQ4K's qs: [k8-group (4)][row (16)][4 bytes];
    // byte j = q[8g+j] | q[8g+j+4] << 4
    pub(crate) qs: [u8; QK4_1 / 8 * TILE_N * 4],
}
const _: () = assert!(std::mem::size_of::<TileQ4_1>() == 320);

pub(crate) enum PackedX86 {
    Q4K(Vec<TileQ4K>),
    Q6K(Vec<TileQ6K>),
    Q8_0(Vec<TileQ8_0>),
    Q5_0(Vec<TileQ5_0>),
    Q4_1(Vec<TileQ4_1>),
}

pub(crate) fn select(dtype: super::GgmlDType, n: usize, k: usize) -> bool {
    use super::GgmlDType as D;
    let Some(lv) = level() else {
        return false;
    };
    if !n.is_multiple_of(TILE_N) {
        return false;
    }
    match dtype {
        D::Q4K | D::Q6K => k.is_multiple_of(QK_K),
        // Baton: 32-value blocks are taken in pairs, and rows of them need not fill whole
        // 256-value activation blocks (the activations are padded with zeros: `quantize_lhs`)
        // pure avx2 maddubs overflows on the +128 u8 range; q8_0 needs real dpbusd
        D::Q8_0 => lv != X86Level::Avx2 && k.is_multiple_of(2 * QK8_0),
        D::Q5_0 => k.is_multiple_of(2 * QK5_0),
        // Baton: unsigned 4-bit values, which maddubs takes without overflow
        D::Q4_1 => k.is_multiple_of(2 * QK4_1),
        _ => false,
    }
}

fn q4k_blocks(storage: &dyn QuantizedType) -> &[BlockQ4K] {
    let data = storage.storage_size_in_bytes();
    let ptr = storage.as_ptr() as *const BlockQ4K;
    unsafe { std::slice::from_raw_parts(ptr, data / std::mem::size_of::<BlockQ4K>()) }
}
fn q6k_blocks(storage: &dyn QuantizedType) -> &[BlockQ6K] {
    let data = storage.storage_size_in_bytes();
    let ptr = storage.as_ptr() as *const BlockQ6K;
    unsafe { std::slice::from_raw_parts(ptr, data / std::mem::size_of::<BlockQ6K>()) }
}
fn q8_0_blocks(storage: &dyn QuantizedType) -> &[BlockQ8_0] {
    let data = storage.storage_size_in_bytes();
    let ptr = storage.as_ptr() as *const BlockQ8_0;
    unsafe { std::slice::from_raw_parts(ptr, data / std::mem::size_of::<BlockQ8_0>()) }
}

// ggml's 6-bit scale/min unpack for q4k/q5k superblocks.
fn get_scale_min_k4(j: usize, scales: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        (
            (scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4),
            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
        )
    }
}

pub(crate) fn pack_q4k(storage: &dyn QuantizedType, n: usize, k: usize) -> PackedX86 {
    let blocks = q4k_blocks(storage);
    let kb = k / QK_K;
    let n_tiles = n / TILE_N;
    let mut out: Vec<TileQ4K> = Vec::with_capacity(n_tiles * kb);
    for t in 0..n_tiles {
        for b in 0..kb {
            let mut tile = TileQ4K {
                d: [f16::ZERO; TILE_N],
                dmin: [f16::ZERO; TILE_N],
                sc: [[0; TILE_N]; 8],
                mn: [[0; TILE_N]; 8],
                qs: [0; QK_K / 8 * TILE_N * 4],
            };
            for r in 0..TILE_N {
                let blk = &blocks[(t * TILE_N + r) * kb + b];
                tile.d[r] = blk.d;
                tile.dmin[r] = blk.dmin;
                for sub in 0..8 {
                    let (sc, mn) = get_scale_min_k4(sub, &blk.scales);
                    tile.sc[sub][r] = sc;
                    tile.mn[sub][r] = mn;
                }
                // q4k qs: 32-byte chunks c hold values [c*64, c*64+32) in the low nibbles
                // and [c*64+32, c*64+64) in the high nibbles
                let mut vals = [0u8; QK_K];
                for c in 0..4 {
                    for j in 0..32 {
                        let byte = blk.qs[c * 32 + j];
                        vals[c * 64 + j] = byte & 0x0F;
                        vals[c * 64 + 32 + j] = byte >> 4;
                    }
                }
                for g in 0..QK_K / 8 {
                    for j in 0..4 {
                        tile.qs[(g * TILE_N + r) * 4 + j] =
                            vals[g * 8 + j] | (vals[g * 8 + j + 4] << 4);
                    }
                }
            }
            out.push(tile);
        }
    }
    PackedX86::Q4K(out)
}

// Baton: row r's 256 4-bit values of a tile, in order.
fn q4k_tile_values(tile: &TileQ4K, r: usize) -> [u8; QK_K] {
    let mut vals = [0u8; QK_K];
    for g in 0..QK_K / 8 {
        for j in 0..4 {
            let byte = tile.qs[(g * TILE_N + r) * 4 + j];
            vals[g * 8 + j] = byte & 0x0F;
            vals[g * 8 + j + 4] = byte >> 4;
        }
    }
    vals
}

// Baton: the GGUF block row r of a tile was packed from, byte for byte.
fn q4k_block(tile: &TileQ4K, r: usize) -> BlockQ4K {
    let vals = q4k_tile_values(tile, r);
    let mut qs = [0u8; QK_K / 2];
    for c in 0..4 {
        for j in 0..32 {
            qs[c * 32 + j] = vals[c * 64 + j] | (vals[c * 64 + 32 + j] << 4);
        }
    }
    // the inverse of get_scale_min_k4: subblocks 4..8 keep their top two bits in the
    // top bits of bytes 0..8 and their low four in bytes 8..12
    let (sc, mn) = (|s: usize| tile.sc[s][r], |s: usize| tile.mn[s][r]);
    let mut scales = [0u8; 12];
    for i in 0..4 {
        scales[i] = sc(i) | ((sc(4 + i) >> 4) << 6);
        scales[4 + i] = mn(i) | ((mn(4 + i) >> 4) << 6);
        scales[8 + i] = (sc(4 + i) & 0x0F) | ((mn(4 + i) & 0x0F) << 4);
    }
    BlockQ4K {
        d: tile.d[r],
        dmin: tile.dmin[r],
        scales,
        qs,
    }
}

pub(crate) fn pack_q6k(storage: &dyn QuantizedType, n: usize, k: usize) -> PackedX86 {
    let blocks = q6k_blocks(storage);
    let kb = k / QK_K;
    let n_tiles = n / TILE_N;
    let mut out: Vec<TileQ6K> = Vec::with_capacity(n_tiles * kb);
    for t in 0..n_tiles {
        for b in 0..kb {
            let mut tile = TileQ6K {
                d: [f16::ZERO; TILE_N],
                scales: [[0; TILE_N]; 16],
                ql: [0; QK_K / 8 * TILE_N * 4],
                qh: [0; QK_K / 16 * TILE_N * 4],
            };
            for r in 0..TILE_N {
                let blk = &blocks[(t * TILE_N + r) * kb + b];
                tile.d[r] = blk.d;
                for sub in 0..16 {
                    tile.scales[sub][r] = blk.scales[sub];
                }
                // q6k: ql 128 bytes (low 4 bits), qh 64 bytes (high 2 bits), in 128-value halves
                let mut vals = [0u8; QK_K];
                for h in 0..2 {
                    let ql = &blk.ql[h * 64..];
                    let qh = &blk.qh[h * 32..];
                    for j in 0..32 {
                        vals[h * 128 + j] = (ql[j] & 0x0F) | ((qh[j] & 3) << 4);
                        vals[h * 128 + j + 32] = (ql[j + 32] & 0x0F) | (((qh[j] >> 2) & 3) << 4);
                        vals[h * 128 + j + 64] = (ql[j] >> 4) | (((qh[j] >> 4) & 3) << 4);
                        vals[h * 128 + j + 96] = (ql[j + 32] >> 4) | (((qh[j] >> 6) & 3) << 4);
                    }
                }
                for g in 0..QK_K / 8 {
                    for j in 0..4 {
                        tile.ql[(g * TILE_N + r) * 4 + j] =
                            (vals[g * 8 + j] & 0x0F) | ((vals[g * 8 + j + 4] & 0x0F) << 4);
                    }
                }
                for s in 0..QK_K / 16 {
                    for j in 0..4 {
                        let v = |i: usize| vals[16 * s + i] >> 4;
                        tile.qh[(s * TILE_N + r) * 4 + j] =
                            v(j) | (v(4 + j) << 2) | (v(8 + j) << 4) | (v(12 + j) << 6);
                    }
                }
            }
            out.push(tile);
        }
    }
    PackedX86::Q6K(out)
}

// Baton: the GGUF block row r of a tile was packed from, byte for byte.
fn q6k_block(tile: &TileQ6K, r: usize) -> BlockQ6K {
    let mut vals = [0u8; QK_K];
    for g in 0..QK_K / 8 {
        for j in 0..4 {
            let byte = tile.ql[(g * TILE_N + r) * 4 + j];
            vals[g * 8 + j] = byte & 0x0F;
            vals[g * 8 + j + 4] = byte >> 4;
        }
    }
    for s in 0..QK_K / 16 {
        for j in 0..4 {
            let byte = tile.qh[(s * TILE_N + r) * 4 + j];
            for (i, shift) in [(j, 0), (4 + j, 2), (8 + j, 4), (12 + j, 6)] {
                vals[16 * s + i] |= ((byte >> shift) & 3) << 4;
            }
        }
    }
    let mut ql = [0u8; QK_K / 2];
    let mut qh = [0u8; QK_K / 4];
    for h in 0..2 {
        let v = &vals[h * 128..];
        for j in 0..32 {
            ql[h * 64 + j] = (v[j] & 0x0F) | ((v[j + 64] & 0x0F) << 4);
            ql[h * 64 + j + 32] = (v[j + 32] & 0x0F) | ((v[j + 96] & 0x0F) << 4);
            qh[h * 32 + j] =
                (v[j] >> 4) | ((v[j + 32] >> 4) << 2) | ((v[j + 64] >> 4) << 4) | ((v[j + 96] >> 4) << 6);
        }
    }
    let mut scales = [0i8; QK_K / 16];
    for (sub, s) in scales.iter_mut().enumerate() {
        *s = tile.scales[sub][r];
    }
    BlockQ6K {
        ql,
        qh,
        scales,
        d: tile.d[r],
    }
}

pub(crate) fn pack_q8_0(storage: &dyn QuantizedType, n: usize, k: usize) -> PackedX86 {
    let blocks = q8_0_blocks(storage);
    let kb = k / QK8_0;
    let n_tiles = n / TILE_N;
    let mut out: Vec<TileQ8_0> = Vec::with_capacity(n_tiles * kb);
    for t in 0..n_tiles {
        for b in 0..kb {
            let mut tile = TileQ8_0 {
                d: [f16::ZERO; TILE_N],
                qs: [0; QK8_0 * TILE_N],
            };
            for r in 0..TILE_N {
                let blk = &blocks[(t * TILE_N + r) * kb + b];
                tile.d[r] = blk.d;
                for g in 0..QK8_0 / 4 {
                    for j in 0..4 {
                        tile.qs[(g * TILE_N + r) * 4 + j] = (blk.qs[g * 4 + j] as i16 + 128) as u8;
                    }
                }
            }
            out.push(tile);
        }
    }
    PackedX86::Q8_0(out)
}

// Baton: the GGUF block row r of a tile was packed from, byte for byte.
fn q8_0_block(tile: &TileQ8_0, r: usize) -> BlockQ8_0 {
    let mut qs = [0i8; QK8_0];
    for g in 0..QK8_0 / 4 {
        for j in 0..4 {
            qs[g * 4 + j] = (tile.qs[(g * TILE_N + r) * 4 + j] as i16 - 128) as i8;
        }
    }
    BlockQ8_0 { d: tile.d[r], qs }
}

pub(crate) fn pack_q5_0(storage: &dyn QuantizedType, n: usize, k: usize) -> PackedX86 {
    let data = storage.storage_size_in_bytes();
    let ptr = storage.as_ptr() as *const BlockQ5_0;
    let blocks = unsafe { std::slice::from_raw_parts(ptr, data / std::mem::size_of::<BlockQ5_0>()) };
    let kb = k / QK5_0;
    let n_tiles = n / TILE_N;
    let mut out: Vec<TileQ5_0> = Vec::with_capacity(n_tiles * kb);
    for t in 0..n_tiles {
        for b in 0..kb {
            let mut tile = TileQ5_0 {
                d: [f16::ZERO; TILE_N],
                qs: [0; QK5_0 / 8 * TILE_N * 4],
                qh: [0; TILE_N * 4],
            };
            for r in 0..TILE_N {
                let blk = &blocks[(t * TILE_N + r) * kb + b];
                tile.d[r] = blk.d;
                let qh = u32::from_le_bytes(blk.qh);
                let mut vals = [0u8; QK5_0];
                for j in 0..QK5_0 / 2 {
                    vals[j] = (blk.qs[j] & 0x0F) | ((((qh >> j) & 1) as u8) << 4);
                    vals[j + 16] = (blk.qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
                }
                for g in 0..QK5_0 / 8 {
                    for j in 0..4 {
                        tile.qs[(g * TILE_N + r) * 4 + j] =
                            (vals[g * 8 + j] & 0x0F) | ((vals[g * 8 + j + 4] & 0x0F) << 4);
                    }
                }
                for j in 0..4 {
                    let mut byte = 0u8;
                    for g in 0..QK5_0 / 4 {
                        byte |= (vals[4 * g + j] >> 4) << g;
                    }
                    tile.qh[r * 4 + j] = byte;
                }
            }
            out.push(tile);
        }
    }
    PackedX86::Q5_0(out)
}

// Baton: the GGUF block row r of a tile was packed from, byte for byte.
fn q5_0_block(tile: &TileQ5_0, r: usize) -> BlockQ5_0 {
    let mut vals = [0u8; QK5_0];
    for g in 0..QK5_0 / 8 {
        for j in 0..4 {
            let byte = tile.qs[(g * TILE_N + r) * 4 + j];
            vals[g * 8 + j] = byte & 0x0F;
            vals[g * 8 + j + 4] = byte >> 4;
        }
    }
    for j in 0..4 {
        let byte = tile.qh[r * 4 + j];
        for g in 0..QK5_0 / 4 {
            vals[4 * g + j] |= ((byte >> g) & 1) << 4;
        }
    }
    let mut qs = [0u8; QK5_0 / 2];
    let mut qh = 0u32;
    for j in 0..QK5_0 / 2 {
        qs[j] = (vals[j] & 0x0F) | ((vals[j + 16] & 0x0F) << 4);
        qh |= ((vals[j] >> 4) as u32) << j;
        qh |= ((vals[j + 16] >> 4) as u32) << (j + 16);
    }
    BlockQ5_0 { d: tile.d[r], qh: qh.to_le_bytes(), qs }
}

// Baton: q4_1 blocks into tiles. A block holds value j in the low nibble of byte j and value
// j + 16 in its high nibble.
pub(crate) fn pack_q4_1(storage: &dyn QuantizedType, n: usize, k: usize) -> PackedX86 {
    let data = storage.storage_size_in_bytes();
    let ptr = storage.as_ptr() as *const BlockQ4_1;
    let blocks = unsafe { std::slice::from_raw_parts(ptr, data / std::mem::size_of::<BlockQ4_1>()) };
    let kb = k / QK4_1;
    let n_tiles = n / TILE_N;
    let mut out: Vec<TileQ4_1> = Vec::with_capacity(n_tiles * kb);
    for t in 0..n_tiles {
        for b in 0..kb {
            let mut tile = TileQ4_1 {
                d: [f16::ZERO; TILE_N],
                m: [f16::ZERO; TILE_N],
                qs: [0; QK4_1 / 8 * TILE_N * 4],
            };
            for r in 0..TILE_N {
                let blk = &blocks[(t * TILE_N + r) * kb + b];
                tile.d[r] = blk.d;
                tile.m[r] = blk.m;
                let mut vals = [0u8; QK4_1];
                for j in 0..QK4_1 / 2 {
                    vals[j] = blk.qs[j] & 0x0F;
                    vals[j + 16] = blk.qs[j] >> 4;
                }
                for g in 0..QK4_1 / 8 {
                    for j in 0..4 {
                        tile.qs[(g * TILE_N + r) * 4 + j] = vals[g * 8 + j] | (vals[g * 8 + j + 4] << 4);
                    }
                }
            }
            out.push(tile);
        }
    }
    PackedX86::Q4_1(out)
}

// Baton: the GGUF block row r of a tile was packed from, byte for byte.
fn q4_1_block(tile: &TileQ4_1, r: usize) -> BlockQ4_1 {
    let mut vals = [0u8; QK4_1];
    for g in 0..QK4_1 / 8 {
        for j in 0..4 {
            let byte = tile.qs[(g * TILE_N + r) * 4 + j];
            vals[g * 8 + j] = byte & 0x0F;
            vals[g * 8 + j + 4] = byte >> 4;
        }
    }
    let mut qs = [0u8; QK4_1 / 2];
    for j in 0..QK4_1 / 2 {
        qs[j] = vals[j] | (vals[j + 16] << 4);
    }
    BlockQ4_1 { d: tile.d[r], m: tile.m[r], qs }
}

// Weight row `row`'s `per_row` blocks, rebuilt from the tiles that hold it.
fn row_blocks<T, B>(tiles: &[T], row: usize, per_row: usize, block: fn(&T, usize) -> B) -> Vec<B> {
    let (t, r) = (row / TILE_N, row % TILE_N);
    (0..per_row)
        .map(|b| block(&tiles[t * per_row + b], r))
        .collect()
}

// Baton: where a weight is kept only as tiles (`QTensor::keep_only_cpu_tiles`), what still
// needs its GGUF blocks (dequantizing it, its bytes, an embedding lookup, a kernel the tiles
// do not serve) gets them back from the tiles. Rows are rebuilt byte for byte, so every
// result is the one the blocks would give.
impl PackedX86 {
    // The whole weight's blocks, n rows of k values, in the GGUF's order.
    pub(crate) fn blocks(&self, n: usize, k: usize) -> Box<dyn QuantizedType> {
        fn all<T, B: GgmlType + Send + Sync + 'static>(
            tiles: &[T],
            n: usize,
            per_row: usize,
            block: fn(&T, usize) -> B,
        ) -> Box<dyn QuantizedType> {
            let mut out = Vec::with_capacity(n * per_row);
            for row in 0..n {
                out.extend(row_blocks(tiles, row, per_row, block));
            }
            Box::new(out)
        }
        match self {
            Self::Q4K(t) => all(t, n, k / QK_K, q4k_block),
            Self::Q6K(t) => all(t, n, k / QK_K, q6k_block),
            Self::Q8_0(t) => all(t, n, k / QK8_0, q8_0_block),
            Self::Q5_0(t) => all(t, n, k / QK5_0, q5_0_block),
            Self::Q4_1(t) => all(t, n, k / QK4_1, q4_1_block),
        }
    }

    // Rows `ids` of the weight (k values each) as f32, as the blocks' embedding gives them.
    pub(crate) fn embedding(&self, ids: &[u32], n: usize, k: usize) -> crate::Result<Vec<f32>> {
        fn rows<T, B: GgmlType>(
            tiles: &[T],
            ids: &[u32],
            n: usize,
            k: usize,
            per_row: usize,
            block: fn(&T, usize) -> B,
        ) -> crate::Result<Vec<f32>> {
            let mut out = vec![0f32; ids.len() * k];
            for (i, &id) in ids.iter().enumerate() {
                let row = id as usize;
                if row >= n {
                    crate::bail!("embedding id {row} is out of range for {n} rows")
                }
                let blocks = row_blocks(tiles, row, per_row, block);
                B::to_float(&blocks, &mut out[i * k..(i + 1) * k]);
            }
            Ok(out)
        }
        match self {
            Self::Q4K(t) => rows(t, ids, n, k, k / QK_K, q4k_block),
            Self::Q6K(t) => rows(t, ids, n, k, k / QK_K, q6k_block),
            Self::Q8_0(t) => rows(t, ids, n, k, k / QK8_0, q8_0_block),
            Self::Q5_0(t) => rows(t, ids, n, k, k / QK5_0, q5_0_block),
            Self::Q4_1(t) => rows(t, ids, n, k, k / QK4_1, q4_1_block),
        }
    }

    // What the tiles take in memory.
    pub(crate) fn size_in_bytes(&self) -> usize {
        match self {
            Self::Q4K(t) => std::mem::size_of_val(t.as_slice()),
            Self::Q6K(t) => std::mem::size_of_val(t.as_slice()),
            Self::Q8_0(t) => std::mem::size_of_val(t.as_slice()),
            Self::Q5_0(t) => std::mem::size_of_val(t.as_slice()),
            Self::Q4_1(t) => std::mem::size_of_val(t.as_slice()),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod kernels {
    use super::*;
    use core::arch::x86_64::*;

    // acc[m][16] f32 for up to MT activation rows against one 16-row weight tile
    // Baton: 8 rows, not 4, for Q4_K and Q6_K: a tile's nibbles are widened once for twice the
    // rows, and the 8 rows' integer and scaled sums still fit the 32 vector registers. The
    // 32-value types' kernels keep 4 (`MT_32`): they hold a whole tile pair's widened values.
    pub(crate) const MAX_MT: usize = 8;
    pub(crate) const MT_32: usize = 4;

    #[inline(always)]
    unsafe fn bcast4(act: &[i8], off: usize) -> __m512i {
        _mm512_set1_epi32(std::ptr::read_unaligned(act.as_ptr().add(off) as *const i32))
    }

    // Baton: 16 per-row 8-bit signed scales as f32.
    #[inline(always)]
    unsafe fn i8s_to_ps(v: &[i8; TILE_N]) -> __m512 {
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v.as_ptr() as *const _)))
    }

    // q4k: one superblock tile against `mt` q8k activation blocks. Subblocks are
    // processed in pairs with independent integer accumulators to break the dpbusd
    // latency chain when mt is small (decode gemv).
    // Baton: a row's superblock is summed exactly in integers: each subblock's integer sum
    // times its 6-bit scale (vpmulld), and the minimum terms (`min_sums`); the floats come
    // once a superblock (`q4k_finish`), as in llama.cpp's Q4_K dot product. Upstream multiplied
    // each subblock's scale by d and the activations' scale and subtracted its minimum term in
    // floats: six operations a subblock and row beside its eight dpbusd. The AMX kernel gets
    // the same integers another way (`amx::q4k_superblock`), so the two agree bit for bit.
    #[target_feature(enable = "avx512f,avx512vnni,avx512bw")]
    pub(crate) unsafe fn q4k_tile(tile: &TileQ4K, acts: &[&BlockQ8K], acc: &mut [[__m512; 1]]) {
        let mask = _mm512_set1_epi8(0x0F_u8 as i8);
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(tile.d.as_ptr() as *const _));
        let mut sacc = [_mm512_setzero_si512(); MAX_MT];
        for sub2 in 0..4 {
            let sa = sub2 * 2;
            let sb = sa + 1;
            let mut isum_a = [_mm512_setzero_si512(); MAX_MT];
            let mut isum_b = [_mm512_setzero_si512(); MAX_MT];
            for g4 in 0..4 {
                let ga = sa * 4 + g4;
                let gb = sb * 4 + g4;
                let wa = _mm512_loadu_si512(tile.qs.as_ptr().add(ga * TILE_N * 4) as *const _);
                let wb = _mm512_loadu_si512(tile.qs.as_ptr().add(gb * TILE_N * 4) as *const _);
                let lo_a = _mm512_and_si512(wa, mask);
                let hi_a = _mm512_and_si512(_mm512_srli_epi16(wa, 4), mask);
                let lo_b = _mm512_and_si512(wb, mask);
                let hi_b = _mm512_and_si512(_mm512_srli_epi16(wb, 4), mask);
                for (m, act) in acts.iter().enumerate() {
                    isum_a[m] =
                        _mm512_dpbusd_epi32(isum_a[m], lo_a, bcast4(&act.qs, sa * 32 + g4 * 8));
                    isum_a[m] =
                        _mm512_dpbusd_epi32(isum_a[m], hi_a, bcast4(&act.qs, sa * 32 + g4 * 8 + 4));
                    isum_b[m] =
                        _mm512_dpbusd_epi32(isum_b[m], lo_b, bcast4(&act.qs, sb * 32 + g4 * 8));
                    isum_b[m] =
                        _mm512_dpbusd_epi32(isum_b[m], hi_b, bcast4(&act.qs, sb * 32 + g4 * 8 + 4));
                }
            }
            for (sub, isum) in [(sa, &isum_a), (sb, &isum_b)] {
                let sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(tile.sc[sub].as_ptr() as *const _));
                for m in 0..acts.len() {
                    sacc[m] = _mm512_add_epi32(sacc[m], _mm512_mullo_epi32(isum[m], sc));
                }
            }
        }
        let mins = q4k_min_pairs(&tile.mn);
        let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(tile.dmin.as_ptr() as *const _));
        for (m, act) in acts.iter().enumerate() {
            q4k_finish(&mut acc[m][0], sacc[m], d, &mins, dmin, q4k_sum_pairs(act), act.d);
        }
    }

    // Baton: a Q4_K tile's 6-bit minimums as 16-bit pairs, subblocks 2i and 2i + 1 of a row
    // side by side, for `min_sums`.
    #[inline(always)]
    pub(crate) unsafe fn q4k_min_pairs(mn: &[[u8; TILE_N]; 8]) -> [__m512i; 4] {
        let mut pairs = [_mm512_setzero_si512(); 4];
        for (i, p) in pairs.iter_mut().enumerate() {
            let a = _mm_loadu_si128(mn[2 * i].as_ptr() as *const _);
            let b = _mm_loadu_si128(mn[2 * i + 1].as_ptr() as *const _);
            let ab = _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b));
            *p = _mm512_cvtepu8_epi16(ab);
        }
        pairs
    }

    // Baton: a Q6_K tile's signed 8-bit scales as 16-bit pairs, subblocks 2i and 2i + 1 of a
    // row side by side, for `min_sums`.
    #[inline(always)]
    unsafe fn q6k_scale_pairs(sc: &[[i8; TILE_N]; 16]) -> [__m512i; 8] {
        let mut pairs = [_mm512_setzero_si512(); 8];
        for (i, p) in pairs.iter_mut().enumerate() {
            let a = _mm_loadu_si128(sc[2 * i].as_ptr() as *const _);
            let b = _mm_loadu_si128(sc[2 * i + 1].as_ptr() as *const _);
            let ab = _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b));
            *p = _mm512_cvtepi8_epi16(ab);
        }
        pairs
    }

    // Baton: per row, the sum over subblocks of a weight's per-subblock number (a 16-bit pair
    // per 32 bits of `pairs[i]`) times the activations' sum over that subblock (`sums[i]`, the
    // same pair of subblocks as two i16), exactly, in integers (vpdpwssd).
    #[inline(always)]
    pub(crate) unsafe fn min_sums<const P: usize>(pairs: &[__m512i; P], sums: [i32; P]) -> __m512i {
        let mut total = _mm512_setzero_si512();
        for (p, s) in pairs.iter().zip(sums) {
            total = _mm512_dpwssd_epi32(total, *p, _mm512_set1_epi32(s));
        }
        total
    }

    // Baton: the activations' sums over 32-value subblocks 2i and 2i + 1, as an i16 pair (each
    // at most 32 * 128 in size).
    #[inline(always)]
    pub(crate) fn q4k_sum_pairs(act: &BlockQ8K) -> [i32; 4] {
        let sum32 = |s: usize| act.bsums[2 * s] as i32 + act.bsums[2 * s + 1] as i32;
        std::array::from_fn(|i| (sum32(2 * i) & 0xFFFF) | (sum32(2 * i + 1) << 16))
    }

    // Baton: the activations' sums over 16-value subblocks 2i and 2i + 1 (Q6_K's), as an i16
    // pair, as `min_sums` takes them.
    #[inline(always)]
    pub(crate) fn q6k_sum_pairs(act: &BlockQ8K) -> [i32; 8] {
        std::array::from_fn(|i| {
            (act.bsums[2 * i] as u16 as i32) | ((act.bsums[2 * i + 1] as i32) << 16)
        })
    }

    // Baton: a row's superblock into its output: d times the sum of the subblocks' integer sums
    // times their scales (`isum`, exact), times the activations' scale (`act_d`), less the
    // minimum terms (against the activations' `q4k_sum_pairs`).
    // The AMX kernel ends a superblock with this too, so a row's products are the same
    // whichever kernel computes them.
    #[inline(always)]
    pub(crate) unsafe fn q4k_finish(
        acc: &mut __m512,
        isum: __m512i,
        d: __m512,
        mins: &[__m512i; 4],
        dmin: __m512,
        sum_pairs: [i32; 4],
        act_d: f32,
    ) {
        let sacc = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), d);
        let dall = _mm512_set1_ps(act_d);
        let msum = _mm512_cvtepi32_ps(min_sums(mins, sum_pairs));
        *acc = _mm512_fmadd_ps(sacc, dall, *acc);
        *acc = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dall), msum, *acc);
    }

    // q6k: values are v-32; vpdpbusd on raw u6 then subtract 32 * bsum per 16-value subblock.
    // Baton: a subblock's four 16-row k4-groups are joined from two nibble vectors and one
    // vector of bit pairs (see TileQ6K). A row's float work is a conversion and a multiply-add
    // a subblock;
    // the offsets of 32 are summed in integers once a superblock (`min_sums`), where upstream
    // spent five more float operations a subblock and row on them and the scales.
    #[target_feature(enable = "avx512f,avx512vnni,avx512bw")]
    pub(crate) unsafe fn q6k_tile(tile: &TileQ6K, acts: &[&BlockQ8K], acc: &mut [[__m512; 1]]) {
        let lo4 = _mm512_set1_epi8(0x0F);
        let hi2 = _mm512_set1_epi8(0x30);
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(tile.d.as_ptr() as *const _));
        let mut sacc = [_mm512_setzero_ps(); MAX_MT];
        for sub in 0..16 {
            let l0 = _mm512_loadu_si512(tile.ql.as_ptr().add(2 * sub * TILE_N * 4) as *const _);
            let l1 =
                _mm512_loadu_si512(tile.ql.as_ptr().add((2 * sub + 1) * TILE_N * 4) as *const _);
            let h = _mm512_loadu_si512(tile.qh.as_ptr().add(sub * TILE_N * 4) as *const _);
            let w = [
                _mm512_or_si512(
                    _mm512_and_si512(l0, lo4),
                    _mm512_and_si512(_mm512_slli_epi16(h, 4), hi2),
                ),
                _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16(l0, 4), lo4),
                    _mm512_and_si512(_mm512_slli_epi16(h, 2), hi2),
                ),
                _mm512_or_si512(_mm512_and_si512(l1, lo4), _mm512_and_si512(h, hi2)),
                _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16(l1, 4), lo4),
                    _mm512_and_si512(_mm512_srli_epi16(h, 2), hi2),
                ),
            ];
            let mut isum = [_mm512_setzero_si512(); MAX_MT];
            for (g4, w) in w.iter().enumerate() {
                for (m, act) in acts.iter().enumerate() {
                    let a = bcast4(&act.qs, sub * 16 + g4 * 4);
                    isum[m] = _mm512_dpbusd_epi32(isum[m], *w, a);
                }
            }
            let scale = _mm512_mul_ps(d, i8s_to_ps(&tile.scales[sub]));
            for m in 0..acts.len() {
                sacc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), scale, sacc[m]);
            }
        }
        // the sum of scale * (activations' subblock sum), times 32 * d below: at most
        // 16 * 128 * 2048 in size, so exact in f32
        let scales = q6k_scale_pairs(&tile.scales);
        let d32 = _mm512_mul_ps(d, _mm512_set1_ps(32.0));
        for (m, act) in acts.iter().enumerate() {
            let offset = _mm512_cvtepi32_ps(min_sums(&scales, q6k_sum_pairs(act)));
            let dall = _mm512_set1_ps(act.d);
            acc[m][0] = _mm512_fmadd_ps(sacc[m], dall, acc[m][0]);
            acc[m][0] = _mm512_fnmadd_ps(_mm512_mul_ps(d32, dall), offset, acc[m][0]);
        }
    }

    // q8_0 (+128 offset weights), two 32-value block groups per call with independent
    // integer accumulators so the dpbusd latency chain never serializes at small m.
    #[target_feature(enable = "avx512f,avx512vnni,avx512bw")]
    pub(crate) unsafe fn q8_0_tile2(
        t0: &TileQ8_0,
        t1: &TileQ8_0,
        acts: &[&BlockQ8K],
        dact: &[[f32; 2]],
        sub32: usize,
        acc: &mut [[__m512; 1]],
    ) {
        let mut isum_a = [_mm512_setzero_si512(); MT_32];
        let mut isum_b = [_mm512_setzero_si512(); MT_32];
        for g4 in 0..8 {
            let wa = _mm512_loadu_si512(t0.qs.as_ptr().add(g4 * TILE_N * 4) as *const _);
            let wb = _mm512_loadu_si512(t1.qs.as_ptr().add(g4 * TILE_N * 4) as *const _);
            for (m, act) in acts.iter().enumerate() {
                isum_a[m] =
                    _mm512_dpbusd_epi32(isum_a[m], wa, bcast4(&act.qs, sub32 * 32 + g4 * 4));
                isum_b[m] =
                    _mm512_dpbusd_epi32(isum_b[m], wb, bcast4(&act.qs, (sub32 + 1) * 32 + g4 * 4));
            }
        }
        for (i, blk, isum, tile) in [(0, sub32, &isum_a, t0), (1, sub32 + 1, &isum_b, t1)] {
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(tile.d.as_ptr() as *const _));
            for (m, act) in acts.iter().enumerate() {
                let bsum = (act.bsums[blk * 2] as i32 + act.bsums[blk * 2 + 1] as i32) as f32;
                let f = _mm512_sub_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_set1_ps(128.0 * bsum));
                let da = _mm512_set1_ps(dact[m][i]);
                acc[m][0] = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, da), acc[m][0]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod kernels_q5_0 {
    use super::kernels::MT_32;
    use super::*;
    use core::arch::x86_64::*;

    // A tile's 8 k4-groups of 16 rows as unsigned 5-bit values.
    #[inline(always)]
    unsafe fn weights(t: &TileQ5_0) -> [__m512i; 8] {
        let lo4 = _mm512_set1_epi8(0x0F);
        let bit4 = _mm512_set1_epi8(0x10);
        let h = _mm512_loadu_si512(t.qh.as_ptr() as *const _);
        let q: [__m512i; 4] = [
            _mm512_loadu_si512(t.qs.as_ptr() as *const _),
            _mm512_loadu_si512(t.qs.as_ptr().add(TILE_N * 4) as *const _),
            _mm512_loadu_si512(t.qs.as_ptr().add(2 * TILE_N * 4) as *const _),
            _mm512_loadu_si512(t.qs.as_ptr().add(3 * TILE_N * 4) as *const _),
        ];
        // value 4g+j's high bit is bit g of byte j; move it to bit 4 (16-bit shifts: the
        // bits that cross into a neighbouring byte never land on bit 4)
        let hb = [
            _mm512_and_si512(_mm512_slli_epi16(h, 4), bit4),
            _mm512_and_si512(_mm512_slli_epi16(h, 3), bit4),
            _mm512_and_si512(_mm512_slli_epi16(h, 2), bit4),
            _mm512_and_si512(_mm512_slli_epi16(h, 1), bit4),
            _mm512_and_si512(h, bit4),
            _mm512_and_si512(_mm512_srli_epi16(h, 1), bit4),
            _mm512_and_si512(_mm512_srli_epi16(h, 2), bit4),
            _mm512_and_si512(_mm512_srli_epi16(h, 3), bit4),
        ];
        let mut w = [_mm512_setzero_si512(); 8];
        for i in 0..4 {
            w[2 * i] = _mm512_or_si512(_mm512_and_si512(q[i], lo4), hb[2 * i]);
            w[2 * i + 1] =
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q[i], 4), lo4), hb[2 * i + 1]);
        }
        w
    }

    // Two 32-value groups (sub32, sub32 + 1 of the activations' superblock); values are v-16,
    // corrected through the activations' sums as q8_0's +128 is.
    #[target_feature(enable = "avx512f,avx512vnni,avx512bw")]
    pub(crate) unsafe fn q5_0_tile2(
        t0: &TileQ5_0,
        t1: &TileQ5_0,
        acts: &[&BlockQ8K],
        dact: &[[f32; 2]],
        sub32: usize,
        acc: &mut [[__m512; 1]],
    ) {
        let wa = weights(t0);
        let wb = weights(t1);
        let mut isum_a = [_mm512_setzero_si512(); MT_32];
        let mut isum_b = [_mm512_setzero_si512(); MT_32];
        for g in 0..8 {
            for (m, act) in acts.iter().enumerate() {
                let a = _mm512_set1_epi32(std::ptr::read_unaligned(
                    act.qs.as_ptr().add(sub32 * 32 + g * 4) as *const i32,
                ));
                let b = _mm512_set1_epi32(std::ptr::read_unaligned(
                    act.qs.as_ptr().add((sub32 + 1) * 32 + g * 4) as *const i32,
                ));
                isum_a[m] = _mm512_dpbusd_epi32(isum_a[m], wa[g], a);
                isum_b[m] = _mm512_dpbusd_epi32(isum_b[m], wb[g], b);
            }
        }
        for (i, blk, isum, tile) in [(0, sub32, &isum_a, t0), (1, sub32 + 1, &isum_b, t1)] {
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(tile.d.as_ptr() as *const _));
            for (m, act) in acts.iter().enumerate() {
                let bsum = (act.bsums[blk * 2] as i32 + act.bsums[blk * 2 + 1] as i32) as f32;
                let f = _mm512_sub_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_set1_ps(16.0 * bsum));
                let da = _mm512_set1_ps(dact[m][i]);
                acc[m][0] = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, da), acc[m][0]);
            }
        }
    }
}

// Baton: q4_1 on AVX-512 VNNI. A value is d * q + m, so against activations a (scale da) a
// group's product is d * da * sum(q * a) + m * da * sum(a), the second term read off the
// activations' 16-value sums as llama.cpp's q8_1 sums give it.
#[cfg(target_arch = "x86_64")]
mod kernels_q4_1 {
    use super::kernels::MT_32;
    use super::*;
    use core::arch::x86_64::*;

    // A tile's 8 k4-groups of 16 rows as unsigned 4-bit values.
    #[inline(always)]
    unsafe fn weights(t: &TileQ4_1) -> [__m512i; 8] {
        let lo4 = _mm512_set1_epi8(0x0F);
        let mut w = [_mm512_setzero_si512(); 8];
        for i in 0..4 {
            let q = _mm512_loadu_si512(t.qs.as_ptr().add(i * TILE_N * 4) as *const _);
            w[2 * i] = _mm512_and_si512(q, lo4);
            w[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(q, 4), lo4);
        }
        w
    }

    // Two 32-value groups (sub32, sub32 + 1 of the activations' superblock).
    #[target_feature(enable = "avx512f,avx512vnni,avx512bw")]
    pub(crate) unsafe fn q4_1_tile2(
        t0: &TileQ4_1,
        t1: &TileQ4_1,
        acts: &[&BlockQ8K],
        dact: &[[f32; 2]],
        sub32: usize,
        acc: &mut [[__m512; 1]],
    ) {
        let wa = weights(t0);
        let wb = weights(t1);
        let mut isum_a = [_mm512_setzero_si512(); MT_32];
        let mut isum_b = [_mm512_setzero_si512(); MT_32];
        for g in 0..8 {
            for (m, act) in acts.iter().enumerate() {
                let a = _mm512_set1_epi32(std::ptr::read_unaligned(
                    act.qs.as_ptr().add(sub32 * 32 + g * 4) as *const i32,
                ));
                let b = _mm512_set1_epi32(std::ptr::read_unaligned(
                    act.qs.as_ptr().add((sub32 + 1) * 32 + g * 4) as *const i32,
                ));
                isum_a[m] = _mm512_dpbusd_epi32(isum_a[m], wa[g], a);
                isum_b[m] = _mm512_dpbusd_epi32(isum_b[m], wb[g], b);
            }
        }
        for (i, blk, isum, tile) in [(0, sub32, &isum_a, t0), (1, sub32 + 1, &isum_b, t1)] {
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(tile.d.as_ptr() as *const _));
            let mw = _mm512_cvtph_ps(_mm256_loadu_si256(tile.m.as_ptr() as *const _));
            for (m, act) in acts.iter().enumerate() {
                let bsum = (act.bsums[blk * 2] as i32 + act.bsums[blk * 2 + 1] as i32) as f32;
                let da = dact[m][i];
                let f = _mm512_cvtepi32_ps(isum[m]);
                acc[m][0] = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, _mm512_set1_ps(da)), acc[m][0]);
                acc[m][0] = _mm512_fmadd_ps(mw, _mm512_set1_ps(da * bsum), acc[m][0]);
            }
        }
    }
}

// Full matmul over the packed tiles: lhs is m rows already quantized to BlockQ8K,
// parallelized over (m-tiles x n-tiles) on the barrier pool by the caller's chunker.
// Per-unit bodies live in #[target_feature] fns so intrinsics inline under portable
// (target-cpu=generic) release builds; closures cannot carry the attribute.
// Baton: the per-32 activation scales of groups s and s + 1 of superblock b, for rows m0.. .
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn pair_scales(
    scales: &[f32],
    kb: usize,
    m0: usize,
    mt: usize,
    b: usize,
    s: usize,
) -> [[f32; 2]; kernels::MAX_MT] {
    let mut d = [[0f32; 2]; kernels::MAX_MT];
    for (i, d) in d.iter_mut().enumerate().take(mt) {
        let at = (m0 + i) * kb * 8 + b * 8 + s;
        *d = [scales[at], scales[at + 1]];
    }
    d
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni,avx512bw")]
#[allow(clippy::too_many_arguments)]
unsafe fn matmul_unit_512(
    packed: &PackedX86,
    lhs_q: &[BlockQ8K],
    scales: &[f32],
    kb: usize,
    groups: usize,
    nt: usize,
    m0: usize,
    mt: usize,
    dst_ptr: *mut f32,
    n: usize,
) {
    use core::arch::x86_64::*;
    let mut act_refs: [&BlockQ8K; kernels::MAX_MT] = [&lhs_q[m0 * kb]; kernels::MAX_MT];
    let mut acc = [[_mm512_setzero_ps(); 1]; kernels::MAX_MT];
    for b in 0..kb {
        for (i, a) in act_refs.iter_mut().enumerate().take(mt) {
            *a = &lhs_q[(m0 + i) * kb + b];
        }
        match packed {
            PackedX86::Q4K(tiles) => {
                kernels::q4k_tile(&tiles[nt * kb + b], &act_refs[..mt], &mut acc)
            }
            PackedX86::Q6K(tiles) => {
                kernels::q6k_tile(&tiles[nt * kb + b], &act_refs[..mt], &mut acc)
            }
            PackedX86::Q8_0(tiles) => {
                // q8_0 tiles cover 32 k-values each; 8 tiles per q8k superblock (Baton: the
                // row's `groups` tiles may end before its last, zero-padded superblock does)
                let g0 = nt * groups + b * 8;
                for s in (0..(groups - b * 8).min(8)).step_by(2) {
                    let dact = pair_scales(scales, kb, m0, mt, b, s);
                    for c in (0..mt).step_by(kernels::MT_32) {
                        let e = (c + kernels::MT_32).min(mt);
                        kernels::q8_0_tile2(
                            &tiles[g0 + s],
                            &tiles[g0 + s + 1],
                            &act_refs[c..e],
                            &dact[c..e],
                            s,
                            &mut acc[c..e],
                        );
                    }
                }
            }
            PackedX86::Q5_0(tiles) => {
                let g0 = nt * groups + b * 8;
                for s in (0..(groups - b * 8).min(8)).step_by(2) {
                    let dact = pair_scales(scales, kb, m0, mt, b, s);
                    for c in (0..mt).step_by(kernels::MT_32) {
                        let e = (c + kernels::MT_32).min(mt);
                        kernels_q5_0::q5_0_tile2(
                            &tiles[g0 + s],
                            &tiles[g0 + s + 1],
                            &act_refs[c..e],
                            &dact[c..e],
                            s,
                            &mut acc[c..e],
                        );
                    }
                }
            }
            PackedX86::Q4_1(tiles) => {
                let g0 = nt * groups + b * 8;
                for s in (0..(groups - b * 8).min(8)).step_by(2) {
                    let dact = pair_scales(scales, kb, m0, mt, b, s);
                    for c in (0..mt).step_by(kernels::MT_32) {
                        let e = (c + kernels::MT_32).min(mt);
                        kernels_q4_1::q4_1_tile2(
                            &tiles[g0 + s],
                            &tiles[g0 + s + 1],
                            &act_refs[c..e],
                            &dact[c..e],
                            s,
                            &mut acc[c..e],
                        );
                    }
                }
            }
        }
    }
    for (i, row) in acc[..mt].iter().enumerate() {
        _mm512_storeu_ps(dst_ptr.add((m0 + i) * n + nt * TILE_N), row[0]);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn matmul_unit_256(
    packed: &PackedX86,
    lhs_q: &[BlockQ8K],
    scales: &[f32],
    kb: usize,
    groups: usize,
    nt: usize,
    m0: usize,
    mt: usize,
    dst_ptr: *mut f32,
    n: usize,
    vnni: bool,
) {
    use core::arch::x86_64::*;
    let mut act_refs: [&BlockQ8K; kernels256::MAX_MT] = [&lhs_q[m0 * kb]; kernels256::MAX_MT];
    let mut acc = [[_mm256_setzero_ps(); 2]; kernels256::MAX_MT];
    for b in 0..kb {
        for (i, a) in act_refs.iter_mut().enumerate().take(mt) {
            *a = &lhs_q[(m0 + i) * kb + b];
        }
        match packed {
            PackedX86::Q4K(tiles) => {
                let t = &tiles[nt * kb + b];
                if vnni {
                    kernels256::q4k_tile_avxvnni(t, &act_refs[..mt], &mut acc)
                } else {
                    kernels256::q4k_tile_avx2(t, &act_refs[..mt], &mut acc)
                }
            }
            PackedX86::Q6K(tiles) => {
                let t = &tiles[nt * kb + b];
                if vnni {
                    kernels256::q6k_tile_avxvnni(t, &act_refs[..mt], &mut acc)
                } else {
                    kernels256::q6k_tile_avx2(t, &act_refs[..mt], &mut acc)
                }
            }
            PackedX86::Q8_0(tiles) => {
                let g0 = nt * groups + b * 8;
                for s in (0..(groups - b * 8).min(8)).step_by(2) {
                    let dact = pair_scales(scales, kb, m0, mt, b, s);
                    kernels256::q8_0_tile2_avxvnni(
                        &tiles[g0 + s],
                        &tiles[g0 + s + 1],
                        &act_refs[..mt],
                        &dact[..mt],
                        s,
                        &mut acc,
                    );
                }
            }
            PackedX86::Q5_0(tiles) => {
                let g0 = nt * groups + b * 8;
                for s in (0..(groups - b * 8).min(8)).step_by(2) {
                    let (t0, t1) = (&tiles[g0 + s], &tiles[g0 + s + 1]);
                    let dact = pair_scales(scales, kb, m0, mt, b, s);
                    let (acts, dact) = (&act_refs[..mt], &dact[..mt]);
                    if vnni {
                        kernels256::q5_0_tile2_avxvnni(t0, t1, acts, dact, s, &mut acc)
                    } else {
                        kernels256::q5_0_tile2_avx2(t0, t1, acts, dact, s, &mut acc)
                    }
                }
            }
            PackedX86::Q4_1(tiles) => {
                let g0 = nt * groups + b * 8;
                for s in (0..(groups - b * 8).min(8)).step_by(2) {
                    let (t0, t1) = (&tiles[g0 + s], &tiles[g0 + s + 1]);
                    let dact = pair_scales(scales, kb, m0, mt, b, s);
                    let (acts, dact) = (&act_refs[..mt], &dact[..mt]);
                    if vnni {
                        kernels256::q4_1_tile2_avxvnni(t0, t1, acts, dact, s, &mut acc)
                    } else {
                        kernels256::q4_1_tile2_avx2(t0, t1, acts, dact, s, &mut acc)
                    }
                }
            }
        }
    }
    for (i, row) in acc[..mt].iter().enumerate() {
        _mm256_storeu_ps(dst_ptr.add((m0 + i) * n + nt * TILE_N), row[0]);
        _mm256_storeu_ps(dst_ptr.add((m0 + i) * n + nt * TILE_N + 8), row[1]);
    }
}

pub(crate) fn matmul_tiles(
    packed: &PackedX86,
    acts: &Acts,
    m: usize,
    k: usize,
    n: usize,
    dst: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        let lv = level().expect("select() gated");
        let kb = k.div_ceil(QK_K);
        let groups = k / QK8_0;
        let n_tiles = n / TILE_N;
        let mt_step = if lv == X86Level::Avx512Vnni {
            kernels::MAX_MT
        } else {
            kernels256::MAX_MT
        };
        let dst_ptr = dst.as_mut_ptr() as usize;
        let total_units = n_tiles * m.div_ceil(mt_step);
        let m_units = m.div_ceil(mt_step);
        crate::utils::barrier_pool().execute_chunked(total_units, |range| {
            let dst_ptr = dst_ptr as *mut f32;
            for unit in range {
                let nt = unit / m_units;
                let m0 = (unit % m_units) * mt_step;
                let mt = (m - m0).min(mt_step);
                unsafe {
                    if lv == X86Level::Avx512Vnni {
                        let (q, sc) = (&acts.q, &acts.scales);
                        matmul_unit_512(packed, q, sc, kb, groups, nt, m0, mt, dst_ptr, n);
                    } else {
                        matmul_unit_256(
                            packed,
                            &acts.q,
                            &acts.scales,
                            kb,
                            groups,
                            nt,
                            m0,
                            mt,
                            dst_ptr,
                            n,
                            lv == X86Level::AvxVnni,
                        );
                    }
                }
            }
        });
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (packed, acts, m, k, n, dst);
        unreachable!("x86 repack kernels on non-x86 arch");
    }
}

pub(crate) fn pack(
    dtype: super::GgmlDType,
    storage: &dyn QuantizedType,
    n: usize,
    k: usize,
) -> PackedX86 {
    use super::GgmlDType as D;
    match dtype {
        D::Q4K => pack_q4k(storage, n, k),
        D::Q6K => pack_q6k(storage, n, k),
        D::Q8_0 => pack_q8_0(storage, n, k),
        D::Q5_0 => pack_q5_0(storage, n, k),
        D::Q4_1 => pack_q4_1(storage, n, k),
        _ => unreachable!("select() gates dtypes"),
    }
}

// Activations quantized for the tiles: rows of 256-value BlockQ8K blocks.
// Baton: for 32-value block types (Q4_1, Q5_0, Q8_0) each 32 values get a scale of their own, in
// `scales` (8 a block; the blocks' own `d` is unused), as llama.cpp quantizes activations for
// these types: one scale per 256 values lost precision next to Qwen's large activations
// (Qwen2.5-0.5B alone, MMLU: 3 of 60 items lost, none gained). Products with Q4_K/Q6_K keep
// one scale per 256, as theirs do. A row whose length is not a multiple of 256 is padded with
// zeros to whole blocks; the weights' tiles end where the row does, so the padding is never read.
pub(crate) struct Acts {
    pub(crate) q: Vec<BlockQ8K>,
    pub(crate) scales: Vec<f32>,
}

pub(crate) fn quantize_lhs(dtype: super::GgmlDType, lhs: &[f32], m: usize, k: usize) -> Acts {
    let per_32 = matches!(
        dtype,
        super::GgmlDType::Q5_0 | super::GgmlDType::Q8_0 | super::GgmlDType::Q4_1
    );
    let kb = k.div_ceil(QK_K);
    let mut out: Vec<BlockQ8K> = Vec::with_capacity(m * kb);
    #[allow(clippy::uninit_vec)]
    unsafe {
        out.set_len(m * kb)
    };
    let mut scales = vec![0f32; if per_32 { m * kb * 8 } else { 0 }];
    let out_ptr = out.as_mut_ptr() as usize;
    let scales_ptr = scales.as_mut_ptr() as usize;
    crate::utils::barrier_pool().execute_chunked(m, |range| {
        let out_ptr = out_ptr as *mut BlockQ8K;
        let mut padded = Vec::new();
        for r in range {
            let mut row = &lhs[r * k..(r + 1) * k];
            if !k.is_multiple_of(QK_K) {
                padded.clear();
                padded.extend_from_slice(row);
                padded.resize(kb * QK_K, 0f32);
                row = &padded;
            }
            let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.add(r * kb), kb) };
            if per_32 {
                let sc = unsafe {
                    std::slice::from_raw_parts_mut((scales_ptr as *mut f32).add(r * kb * 8), kb * 8)
                };
                BlockQ8K::from_float_per_32(row, dst, sc);
            } else {
                BlockQ8K::from_float(row, dst);
            }
        }
    });
    Acts { q: out, scales }
}

// Fused multi-projection gemv: one lhs quantization and one barrier region across
// all projections sharing the same activations (qkv, gate/up). 512-bit only; the
// per-unit body reuses matmul_unit_512 so intrinsics inline in portable builds.
// Baton: returns the products ([m][n] each) instead of filling zeroed ones, so that AMX,
// which writes every value, skips the zeroing.
pub(crate) fn gemv_fused(
    parts: &[(&PackedX86, usize)],
    acts: &Acts,
    m: usize,
    k: usize,
) -> Vec<Vec<f32>> {
    #[cfg(target_arch = "x86_64")]
    {
        // Baton: a prompt's rows go to AMX where a single product's would (`amx_tiles`), still
        // from the one quantized lhs. Upstream ran them through this kernel at any row count,
        // so on a CPU with AMX a prompt's gate and up projections (three fifths of a Qwen2.5
        // layer's weights) skipped it.
        let amx: Option<Vec<(AmxTiles<'_>, usize)>> =
            parts.iter().map(|(p, n)| amx_tiles(p, m).map(|t| (t, *n))).collect();
        if let Some(amx) = amx {
            return matmul_amx(&amx, acts, m, k);
        }
        let mut dsts: Vec<Vec<f32>> = parts.iter().map(|(_, n)| vec![0f32; m * n]).collect();
        let kb = k.div_ceil(QK_K);
        let groups = k / QK8_0;
        let mt_step = kernels::MAX_MT;
        let m_units = m.div_ceil(mt_step);
        // (n, dst ptr, unit offset)
        let mut metas: Vec<(usize, usize, usize)> = Vec::with_capacity(parts.len());
        let mut total = 0usize;
        for (i, (_p, n)) in parts.iter().enumerate() {
            metas.push((*n, dsts[i].as_mut_ptr() as usize, total));
            total += (n / TILE_N) * m_units;
        }
        let parts_ref = parts;
        crate::utils::barrier_pool().execute_chunked(total, |range| {
            for unit in range {
                let pi = metas
                    .iter()
                    .rposition(|(_n, _d, off)| unit >= *off)
                    .unwrap();
                let (n, dst_ptr, off) = metas[pi];
                let local = unit - off;
                let nt = local / m_units;
                let m0 = (local % m_units) * mt_step;
                let mt = (m - m0).min(mt_step);
                unsafe {
                    matmul_unit_512(
                        parts_ref[pi].0,
                        &acts.q,
                        &acts.scales,
                        kb,
                        groups,
                        nt,
                        m0,
                        mt,
                        dst_ptr as *mut f32,
                        n,
                    );
                }
            }
        });
        dsts
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (parts, acts, m, k);
        unreachable!("x86 repack kernels on non-x86 arch");
    }
}

// AMX-int8 path for large-m (prefill) q4k matmuls.
// Baton: each 4-bit value is widened to a byte already multiplied by its subblock's 6-bit
// scale, split in two 3-bit halves (scale = 8 * hi + lo; 15 * 7 fits a signed byte), so the
// tiles sum a whole 256-value superblock in integers: C = 8 * sum(q * hi * a) + sum(q * lo * a)
// is exactly the sum over subblocks of the scale times the subblock's integer sum, which the
// AVX-512 kernel computes with vpmulld (`kernels::q4k_tile`). Upstream ran a tile product per
// 32-value subblock and scaled each in floats: the C tiles left the tile registers eight times
// a superblock, and the kernel waited on those stores and on the float work.
// Baton: on a cache line, so that its B tiles' rows each are one (see `AlignedBytes`)
#[repr(C, align(64))]
pub(crate) struct TileQ4KAmx {
    pub(crate) d: [f32; TILE_N],
    // Baton: the minimums as the AVX-512 kernel takes them (`kernels::q4k_min_pairs`), and dmin
    pub(crate) min_pairs: [[i32; TILE_N]; 4],
    pub(crate) dmin: [f32; TILE_N],
    // [k-quad (64)][16 cols * 4 k]: the values times the low (`lo`) and high (`hi`) 3 bits
    // of their subblock's scale; 16 k-quads (64 values) make a B tile
    pub(crate) lo: [u8; QK_K * TILE_N],
    pub(crate) hi: [u8; QK_K * TILE_N],
}

impl TileQ4KAmx {
    fn zeroed() -> Self {
        TileQ4KAmx {
            d: [0.0; TILE_N],
            min_pairs: [[0; TILE_N]; 4],
            dmin: [0.0; TILE_N],
            lo: [0; QK_K * TILE_N],
            hi: [0; QK_K * TILE_N],
        }
    }
}

// Baton: memory that starts on a cache line, for what the AMX kernels load and store as tiles.
// A tile row of 64 bytes (or 32) at malloc's 16-byte alignment spans two cache lines (or half
// of them do); the loads and stores then take about 1.3x as long.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

pub(crate) struct AlignedBytes(Vec<Line>);

impl AlignedBytes {
    pub(crate) const fn new() -> Self {
        Self(Vec::new())
    }
    pub(crate) fn zeroed(bytes: usize) -> Self {
        Self(vec![Line([0; 64]); bytes.div_ceil(64)])
    }
    // room for `bytes`, not initialised: written through `as_mut_ptr`, then `assume_init`
    pub(crate) fn uninit(bytes: usize) -> Self {
        Self(Vec::with_capacity(bytes.div_ceil(64)))
    }
    // Safety: the first `bytes` of the buffer have been written, and `bytes` is a whole number
    // of lines (so no unwritten byte becomes readable)
    pub(crate) unsafe fn assume_init(&mut self, bytes: usize) {
        debug_assert!(bytes.is_multiple_of(64));
        self.0.set_len(bytes / 64)
    }
    pub(crate) fn len(&self) -> usize {
        self.0.len() * 64
    }
    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.0.as_ptr() as *const u8
    }
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.0.as_mut_ptr() as *mut u8
    }
    // the initialised bytes as values of an integer type (i8, i32: any bit pattern is one)
    fn as_mut_slice<T: AnyBits>(&mut self) -> &mut [T] {
        let len = self.len() / std::mem::size_of::<T>();
        // Safety: the lines are initialised, 64-byte aligned, and every bit pattern is a T
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr() as *mut T, len) }
    }
}

// integer types, for which any bytes are a value
trait AnyBits: Copy {}
impl AnyBits for i8 {}
impl AnyBits for i32 {}

// Baton: the weights that AMX multiplies (Q4_K and Q4_1 tiles, read as they are kept).
#[derive(Clone, Copy)]
pub(crate) enum AmxTiles<'a> {
    Q4K(&'a [TileQ4K]),
    Q4_1(&'a [TileQ4_1]),
}

// Baton: the tiles that a product of `m` rows takes to AMX, if it does: 32 rows or more, on a
// CPU with AMX. The one place that choice is made, for single and fused products alike.
pub(crate) fn amx_tiles(packed: &PackedX86, m: usize) -> Option<AmxTiles<'_>> {
    if m < 32 || !amx_available() {
        return None;
    }
    match packed {
        PackedX86::Q4K(tiles) => Some(AmxTiles::Q4K(tiles)),
        PackedX86::Q4_1(tiles) => Some(AmxTiles::Q4_1(tiles)),
        _ => None,
    }
}

// Baton: products on AMX of one set of activations, quantized for the weights' type
// (`quantize_lhs`), with each (weight, n): [m][n] each. The kernels write every value, so the
// results are not zeroed first: a prompt's are megabytes, and zeroing them took one thread
// while the others waited.
pub(crate) fn matmul_amx(parts: &[(AmxTiles<'_>, usize)], acts: &Acts, m: usize, k: usize) -> Vec<Vec<f32>> {
    let mut outs: Vec<Vec<f32>> = parts.iter().map(|(_, n)| Vec::with_capacity(m * n)).collect();
    let q4_1: Vec<super::repack_x86_amx_q4_1::Part<'_>> = parts
        .iter()
        .zip(outs.iter_mut())
        .filter_map(|((t, n), out)| match t {
            AmxTiles::Q4_1(tiles) => Some(super::repack_x86_amx_q4_1::Part {
                tiles,
                n: *n,
                dst: out.as_mut_ptr(),
            }),
            AmxTiles::Q4K(_) => None,
        })
        .collect();
    if !q4_1.is_empty() {
        // Safety: each out has room for its m * n values, and each part has its own out
        unsafe { super::repack_x86_amx_q4_1::matmul_amx_q4_1(&q4_1, acts, m, k) };
    }
    for ((t, n), out) in parts.iter().zip(outs.iter_mut()) {
        if let AmxTiles::Q4K(tiles) = t {
            // Safety: as above
            unsafe { matmul_amx_q4k(tiles, &acts.q, m, k, *n, out.as_mut_ptr()) };
        }
    }
    for ((_, n), out) in parts.iter().zip(outs.iter_mut()) {
        // Safety: the kernels above wrote all m * n values of every out
        unsafe { out.set_len(m * n) };
    }
    outs
}

pub(crate) fn amx_available() -> bool {
    use std::sync::OnceLock;
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        // forced downlevel testing must exercise the 256-bit paths end to end
        if level() != Some(X86Level::Avx512Vnni) {
            return false;
        }
        // Baton: AMX can be turned off alone, keeping the AVX-512 kernels, to compare the two.
        if std::env::var("MISTRALRS_NO_AMX").as_deref() == Ok("1") {
            return false;
        }
        // is_x86_feature_detected!("amx-int8") is unstable; read CPUID leaf 7 directly
        #[cfg(target_arch = "x86_64")]
        let has_amx = {
            let info = core::arch::x86_64::__cpuid_count(7, 0);
            info.edx & (1 << 25) != 0 && info.edx & (1 << 24) != 0
        };
        #[cfg(not(target_arch = "x86_64"))]
        let has_amx = false;
        if !has_amx {
            return false;
        }
        // Linux gates AMX tile state behind a per-process permission request; other
        // OSes would need their own enablement, so AMX stays off there.
        #[cfg(target_os = "linux")]
        {
            const ARCH_REQ_XCOMP_PERM: i32 = 0x1023;
            const XFEATURE_XTILEDATA: u64 = 18;
            let r = unsafe {
                libc::syscall(
                    libc::SYS_arch_prctl,
                    ARCH_REQ_XCOMP_PERM,
                    XFEATURE_XTILEDATA,
                )
            };
            r == 0
        }
        #[cfg(not(target_os = "linux"))]
        false
    })
}

// Baton: a tile widened for AMX as it is used, into a buffer the caller reuses. Upstream kept
// a widened copy of every Q4_K weight (2.2x the tiles' bytes) for the model's life, built tile
// by tile in scalar code on the first prompt. The widening is cheap: line g of the tile's
// nibbles holds k-quads 2g (low nibbles) and 2g+1 (high nibbles) in the [row][4 k] order a B
// tile wants; each byte is then multiplied by its column's scale halves (see `TileQ4KAmx`).
// The minimums are kept as the AVX-512 kernel takes them, so products are those of the
// AVX-512 tiles (see `amx::q4k_superblock`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn unpack_q4k_amx(src: &TileQ4K, dst: &mut TileQ4KAmx) {
    use core::arch::x86_64::*;
    // Bytes whose products fit a byte, multiplied lane by lane: the even bytes' product is
    // the low byte of a 16-bit product, the odd bytes' the high byte of another.
    #[inline(always)]
    unsafe fn mul_bytes(a: __m512i, b: __m512i) -> __m512i {
        let even = _mm512_and_si512(_mm512_mullo_epi16(a, b), _mm512_set1_epi16(0x00FF));
        let odd = _mm512_mullo_epi16(
            _mm512_srli_epi16(a, 8),
            _mm512_and_si512(b, _mm512_set1_epi16(0xFF00_u16 as i16)),
        );
        _mm512_or_si512(even, odd)
    }
    unsafe {
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(src.d.as_ptr() as *const __m256i));
        let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(src.dmin.as_ptr() as *const __m256i));
        _mm512_storeu_ps(dst.d.as_mut_ptr(), d);
        for (to, pair) in dst.min_pairs.iter_mut().zip(kernels::q4k_min_pairs(&src.mn)) {
            _mm512_storeu_si512(to.as_mut_ptr() as *mut _, pair);
        }
        _mm512_storeu_ps(dst.dmin.as_mut_ptr(), dmin);
        let low = _mm512_set1_epi8(0x0F);
        let three_bits = _mm512_set1_epi8(0x07);
        for sub in 0..8 {
            // column c's scale in each of the 4 bytes c takes in a k-quad line
            let sc = _mm512_mullo_epi32(
                _mm512_cvtepu8_epi32(_mm_loadu_si128(src.sc[sub].as_ptr() as *const __m128i)),
                _mm512_set1_epi32(0x0101_0101),
            );
            let sc_lo = _mm512_and_si512(sc, three_bits);
            let sc_hi = _mm512_and_si512(_mm512_srli_epi16(sc, 3), three_bits);
            for g in sub * 4..sub * 4 + 4 {
                let line = _mm512_loadu_si512(src.qs.as_ptr().add(g * 64) as *const _);
                let q_lo = _mm512_and_si512(line, low);
                let q_hi = _mm512_and_si512(_mm512_srli_epi16(line, 4), low);
                for (kq, q) in [(2 * g, q_lo), (2 * g + 1, q_hi)] {
                    let at = kq * 64;
                    _mm512_storeu_si512(dst.lo.as_mut_ptr().add(at) as *mut _, mul_bytes(q, sc_lo));
                    _mm512_storeu_si512(dst.hi.as_mut_ptr().add(at) as *mut _, mul_bytes(q, sc_hi));
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod amx {
    use super::*;
    use core::arch::x86_64::*;

    #[repr(C, align(64))]
    struct TileCfg {
        palette: u8,
        start_row: u8,
        _rsvd: [u8; 14],
        colsb: [u16; 16],
        rows: [u8; 16],
    }

    /// Baton: which layout a thread's tiles are configured for; a kernel asks for its own
    /// before its first tile instruction, and the configuration is loaded only when it changes.
    #[derive(Clone, Copy, PartialEq, Eq)]
    pub(crate) enum Layout {
        /// Every tile 16 rows of 64 bytes. tmm0-3: C (16x16 i32: the high and low scale
        /// halves' sums of two 16-row halves of the activations); tmm4-5: A (16 rows x 64 i8);
        /// tmm6-7: B (16 k-quads x 16 columns, the values times the high and low scale halves).
        Q4K,
        /// One 32-value group a product: tmm0-1: C (16x16 i32); tmm4-5: A (16 rows x 32 i8);
        /// tmm6-7: B (8 k-quads x 16 columns). tmm2-3 are left as in `Q4K`, unused.
        Group32,
    }

    unsafe fn configure(layout: Layout) {
        let mut cfg = TileCfg {
            palette: 1,
            start_row: 0,
            _rsvd: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        const _: () = assert!(std::mem::size_of::<TileCfg>() == 64);
        for t in 0..8 {
            cfg.colsb[t] = 64;
            cfg.rows[t] = 16;
        }
        if layout == Layout::Group32 {
            cfg.colsb[4] = 32;
            cfg.colsb[5] = 32;
            cfg.rows[6] = 8;
            cfg.rows[7] = 8;
        }
        core::arch::asm!(
            "ldtilecfg [{cfg}]",
            cfg = in(reg) &cfg,
            options(nostack)
        );
    }

    thread_local! {
        static AMX_LAYOUT: std::cell::Cell<Option<Layout>> = const { std::cell::Cell::new(None) };
    }

    pub(crate) fn ensure_configured(layout: Layout) {
        AMX_LAYOUT.with(|f| {
            if f.get() != Some(layout) {
                unsafe { configure(layout) };
                f.set(Some(layout));
            }
        });
    }

    // The i32 one product's four C tiles take; `q4k_superblock` keeps two such, one being
    // stored while the other is read.
    pub(super) const C_SCRATCH: usize = 4 * 16 * 16;

    // Baton: what a superblock's end takes from an activation row (`q4k_finish`), read off
    // its Q8_K block once for every column tile.
    #[derive(Clone, Copy)]
    pub(super) struct RowEnd {
        pub(super) sum_pairs: [i32; 4],
        pub(super) d: f32,
    }

    // Baton: one superblock of every activation row against `tiles` (1 or 2 widened 16-column
    // tiles), added into `acc` ([32-row block][32 rows][32 columns] floats). `a` holds the
    // superblock's activations, [32-row block][16-row half][4 k-chunks][16 rows * 64 bytes];
    // `rows` what each row's end takes. Per block of rows and column tile, four C tiles sum
    // the superblock's 256 values (see `TileQ4KAmx`) and leave the tile registers once; each
    // row's integer sum (8 * hi + lo) then ends the superblock as the AVX-512 kernel ends it
    // (`q4k_finish`). Those ends are done a quarter at a time between the next product's tile
    // instructions, so the vector units work while the tile unit does.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn q4k_superblock(
        tiles: &[&TileQ4KAmx],
        a: *const i8,
        rows: &[RowEnd],
        acc: &mut [f32],
        c_scratch: &mut [i32],
    ) {
        ensure_configured(Layout::Q4K);
        let m = rows.len();
        let count = tiles.len();
        debug_assert!(c_scratch.len() >= 2 * C_SCRATCH && acc.len() >= m.div_ceil(32) * 1024);
        // A product's C tiles, stored: rows 8 * part .. 8 * part + 8 of its 32 end here.
        let end_part = |step: usize, part: usize, acc: &mut [f32], c_scratch: &[i32]| {
            let (mb, ntl) = (step / count, step % count);
            let t = tiles[ntl];
            let (half, r0) = (part / 2, (part % 2) * 8);
            let first = mb * 32 + half * 16 + r0;
            if first >= m {
                return;
            }
            let c = c_scratch.as_ptr().add((step % 2) * C_SCRATCH + half * 512);
            let mins: [__m512i; 4] =
                std::array::from_fn(|i| _mm512_loadu_si512(t.min_pairs[i].as_ptr() as *const _));
            let d = _mm512_loadu_ps(t.d.as_ptr());
            let dmin = _mm512_loadu_ps(t.dmin.as_ptr());
            for mi in r0..r0 + (m - first).min(8) {
                let hi = _mm512_loadu_si512(c.add(mi * 16) as *const _);
                let lo = _mm512_loadu_si512(c.add(256 + mi * 16) as *const _);
                let isum = _mm512_add_epi32(_mm512_slli_epi32(hi, 3), lo);
                let fo = mb * 1024 + (half * 16 + mi) * 32 + ntl * 16;
                let row = rows[mb * 32 + half * 16 + mi];
                let mut f = _mm512_loadu_ps(acc.as_ptr().add(fo));
                kernels::q4k_finish(&mut f, isum, d, &mins, dmin, row.sum_pairs, row.d);
                _mm512_storeu_ps(acc.as_mut_ptr().add(fo), f);
            }
        };
        let steps = m.div_ceil(32) * count;
        unsafe {
            for step in 0..steps {
                let (mb, t) = (step / count, tiles[step % count]);
                core::arch::asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    options(nostack)
                );
                for chunk in 0..4 {
                    let a0 = a.add(mb * 2 * 4096 + chunk * 1024);
                    core::arch::asm!(
                        "tileloadd tmm4, [{a0} + {s}*1]",
                        "tileloadd tmm6, [{bh} + {s}*1]",
                        "tdpbssd tmm0, tmm4, tmm6",
                        "tileloadd tmm7, [{bl} + {s}*1]",
                        "tdpbssd tmm1, tmm4, tmm7",
                        "tileloadd tmm5, [{a1} + {s}*1]",
                        "tdpbssd tmm2, tmm5, tmm6",
                        "tdpbssd tmm3, tmm5, tmm7",
                        a0 = in(reg) a0,
                        a1 = in(reg) a0.add(4096),
                        bh = in(reg) t.hi.as_ptr().add(chunk * 1024),
                        bl = in(reg) t.lo.as_ptr().add(chunk * 1024),
                        s = in(reg) 64usize,
                        options(nostack)
                    );
                    // the next block of rows' activations into L1 (a quarter of their 8 KiB a
                    // chunk): a tile load waits for the products that read its register before
                    // it, so its latency is not hidden
                    if step % count == 0 && step + count < steps {
                        let next = a.add((mb + 1) * 2 * 4096 + chunk * 2048);
                        for line in 0..32 {
                            _mm_prefetch::<_MM_HINT_T0>(next.add(line * 64));
                        }
                    }
                    if step > 0 {
                        end_part(step - 1, chunk, acc, c_scratch);
                    }
                }
                core::arch::asm!(
                    "tilestored [{c} + {s}*1], tmm0",
                    "tilestored [{c} + {s}*1 + 1024], tmm1",
                    "tilestored [{c} + {s}*1 + 2048], tmm2",
                    "tilestored [{c} + {s}*1 + 3072], tmm3",
                    c = in(reg) c_scratch.as_mut_ptr().add((step % 2) * C_SCRATCH),
                    s = in(reg) 64usize,
                    options(nostack)
                );
            }
            for part in 0..4 {
                end_part(steps - 1, part, acc, c_scratch);
            }
        }
    }
}

// AMX matmul: m >= 32, q4k only. acts are per-row BlockQ8K slices.
// Baton: the threads share out pairs of 16-row weight tiles, not blocks of 32 activation rows.
// A thread widens its pair's tiles once (unpack_q4k_amx; 17 KiB a 256-value block, in its
// cache) and runs every 32-row block of activations past them, packed once for all threads.
// Upstream swept every weight once per 32 activation rows, so it needed a widened copy of the
// whole weight to keep the widening off that path.
// Baton: writes all m * n values at `dst`, which must be valid for them.
pub(crate) unsafe fn matmul_amx_q4k(
    tiles: &[TileQ4K],
    lhs_q: &[BlockQ8K],
    m: usize,
    k: usize,
    n: usize,
    dst: *mut f32,
) {
    #[cfg(target_arch = "x86_64")]
    {
        // Baton: what `select` gives AMX; anything else would leave values unwritten
        assert!(
            n.is_multiple_of(TILE_N) && k.is_multiple_of(QK_K) && tiles.len() == (n / TILE_N) * (k / QK_K),
            "Q4_K on AMX: {} tiles do not make {n} columns of {k} values",
            tiles.len()
        );
        let kb = k / QK_K;
        let n_tiles = n / TILE_N;
        let m_blocks = m.div_ceil(32);
        // Baton: [superblock][32-row block][16-row half][4 k-chunks][16 rows * 64 bytes], so
        // that a superblock's activations are read in order for every block of rows
        const A_BLOCK: usize = 2 * 4 * 16 * 64;
        let mut a_buf = AlignedBytes::zeroed(kb * m_blocks * A_BLOCK);
        let a_all = a_buf.as_mut_slice::<i8>();
        for (i, row) in lhs_q.chunks_exact(kb).take(m).enumerate() {
            for (b, block) in row.iter().enumerate() {
                let base = (b * m_blocks + i / 32) * A_BLOCK + ((i % 32) / 16) * (A_BLOCK / 2);
                for chunk in 0..4 {
                    let at = base + (chunk * 16 + i % 16) * 64;
                    a_all[at..at + 64].copy_from_slice(&block.qs[chunk * 64..chunk * 64 + 64]);
                }
            }
        }
        // what each superblock's end takes from each row, [superblock][row]
        let mut ends = Vec::with_capacity(kb * m);
        for b in 0..kb {
            ends.extend((0..m).map(|i| {
                let act = &lhs_q[i * kb + b];
                amx::RowEnd { sum_pairs: kernels::q4k_sum_pairs(act), d: act.d }
            }));
        }
        let dst_ptr = dst as usize;
        let (a_all, ends) = (&*a_all, &ends);
        crate::utils::barrier_pool().execute_chunked(n_tiles.div_ceil(2), |pairs| {
            let dst_ptr = dst_ptr as *mut f32;
            let mut widened: Vec<TileQ4KAmx> = (0..2 * kb).map(|_| TileQ4KAmx::zeroed()).collect();
            let mut c_buf = AlignedBytes::zeroed(2 * amx::C_SCRATCH * 4);
            let c_scratch = c_buf.as_mut_slice::<i32>();
            // Baton: the pair's 32 output columns for every row, summed a superblock at a
            // time: a superblock's widened tiles (16 KiB) stay in L1 while every block of
            // rows passes them.
            let mut acc = vec![0f32; m_blocks * 32 * 32];
            for pair in pairs {
                let nt = 2 * pair;
                let count = (n_tiles - nt).min(2);
                for (w, src) in widened.iter_mut().zip(&tiles[nt * kb..(nt + count) * kb]) {
                    unsafe { unpack_q4k_amx(src, w) };
                }
                acc.fill(0.0);
                for b in 0..kb {
                    let pair_tiles = [&widened[b], &widened[kb + b]];
                    unsafe {
                        amx::q4k_superblock(
                            &pair_tiles[..count],
                            a_all.as_ptr().add(b * m_blocks * A_BLOCK),
                            &ends[b * m..(b + 1) * m],
                            &mut acc,
                            c_scratch,
                        )
                    };
                }
                for i in 0..m {
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            acc.as_ptr().add((i / 32) * 1024 + (i % 32) * 32),
                            dst_ptr.add(i * n + nt * TILE_N),
                            16 * count,
                        )
                    };
                }
            }
        });
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (tiles, lhs_q, m, k, n, dst);
        unreachable!()
    }
}

// 256-bit kernel tier for CPUs without AVX512: AVX-VNNI (vpdpbusd ymm) or pure AVX2
// (maddubs+madd, safe for the u4/u6 x i8 operand ranges). Same tile layout, each
// 16-column group processed as two ymm halves.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum X86Level {
    Avx512Vnni,
    AvxVnni,
    Avx2,
}

pub(crate) fn level() -> Option<X86Level> {
    use std::sync::OnceLock;
    static LEVEL: OnceLock<Option<X86Level>> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let force_avx2 = std::env::var("MISTRALRS_FORCE_AVX2").as_deref() == Ok("1");
        let force_vnni = std::env::var("MISTRALRS_FORCE_AVXVNNI").as_deref() == Ok("1");
        if !force_avx2
            && !force_vnni
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vnni")
        {
            return Some(X86Level::Avx512Vnni);
        }
        if !force_avx2
            && (force_vnni || is_x86_feature_detected!("avxvnni"))
            && is_x86_feature_detected!("avx2")
            // Baton: the 256-bit kernels read the tiles' f16 scales
            && is_x86_feature_detected!("f16c")
        {
            return Some(X86Level::AvxVnni);
        }
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return Some(X86Level::Avx2);
        }
        None
    })
}

#[cfg(target_arch = "x86_64")]
mod kernels256 {
    use super::*;
    use core::arch::x86_64::*;

    // acc[m][2][8] f32 for up to MT activation rows: 16 ymm registers hold no more
    pub(crate) const MAX_MT: usize = 4;

    #[target_feature(enable = "avx2")]
    unsafe fn bcast4_256(act: &[i8], off: usize) -> __m256i {
        _mm256_set1_epi32(std::ptr::read_unaligned(act.as_ptr().add(off) as *const i32))
    }

    // Baton: rows h*8..h*8+8 of a tile's per-row f16 scales, or of its 6-bit scales, as f32.
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn half_ps(v: &[f16; TILE_N], h: usize) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(h * 8) as *const _))
    }
    // Baton: rows h*8..h*8+8 of a 16-row k4-group (32 bytes).
    #[target_feature(enable = "avx2")]
    unsafe fn group_half(base: &[u8], group: usize, h: usize) -> __m256i {
        _mm256_loadu_si256(base.as_ptr().add(group * TILE_N * 4 + h * 32) as *const _)
    }
    #[target_feature(enable = "avx2")]
    unsafe fn half_i8s_to_ps(v: &[i8; TILE_N], h: usize) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
            v.as_ptr().add(h * 8) as *const _
        )))
    }

    // Baton: rows h*8..h*8+8 of a tile's per-subblock numbers (Q4_K's 6-bit minimums, or
    // Q6_K's signed scales) as 16-bit pairs, subblocks 2i and 2i + 1 of a row side by side: the
    // 256-bit halves of `kernels::q4k_min_pairs` and its Q6_K twin.
    #[target_feature(enable = "avx2")]
    unsafe fn half_u8_pairs<const P: usize>(v: &[[u8; TILE_N]], h: usize) -> [__m256i; P] {
        std::array::from_fn(|i| {
            let a = _mm_loadl_epi64(v[2 * i].as_ptr().add(h * 8) as *const _);
            let b = _mm_loadl_epi64(v[2 * i + 1].as_ptr().add(h * 8) as *const _);
            _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(a, b))
        })
    }
    #[target_feature(enable = "avx2")]
    unsafe fn half_i8_pairs<const P: usize>(v: &[[i8; TILE_N]], h: usize) -> [__m256i; P] {
        std::array::from_fn(|i| {
            let a = _mm_loadl_epi64(v[2 * i].as_ptr().add(h * 8) as *const _);
            let b = _mm_loadl_epi64(v[2 * i + 1].as_ptr().add(h * 8) as *const _);
            _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b))
        })
    }
    // Baton: `kernels::min_sums` on 8 rows, with vpmaddwd (AVX2 has no vpdpwssd).
    #[target_feature(enable = "avx2")]
    unsafe fn min_sums_256<const P: usize>(pairs: &[__m256i; P], sums: [i32; P]) -> __m256i {
        let mut total = _mm256_setzero_si256();
        for (p, s) in pairs.iter().zip(sums) {
            total = _mm256_add_epi32(total, _mm256_madd_epi16(*p, _mm256_set1_epi32(s)));
        }
        total
    }

    #[target_feature(enable = "avx2,avxvnni")]
    unsafe fn dp_vnni(acc: __m256i, w_u8: __m256i, a_i8: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(acc, w_u8, a_i8)
    }

    // dpbusd stand-in for pure AVX2: maddubs (u8 x i8 -> i16 pairs) then madd against ones.
    #[target_feature(enable = "avx2")]
    unsafe fn dp_avx2(acc: __m256i, w_u8: __m256i, a_i8: __m256i) -> __m256i {
        let prod16 = _mm256_maddubs_epi16(w_u8, a_i8);
        _mm256_add_epi32(acc, _mm256_madd_epi16(prod16, _mm256_set1_epi16(1)))
    }

    macro_rules! q4k_tile_256 {
        ($fname:ident, $dp:path, $feat:literal) => {
            #[target_feature(enable = $feat)]
            pub(crate) unsafe fn $fname(
                tile: &TileQ4K,
                acts: &[&BlockQ8K],
                acc: &mut [[__m256; 2]],
            ) {
                let mask = _mm256_set1_epi8(0x0F_u8 as i8);
                let d = [half_ps(&tile.d, 0), half_ps(&tile.d, 1)];
                let dmin = [half_ps(&tile.dmin, 0), half_ps(&tile.dmin, 1)];
                // Baton: as the AVX-512 kernel, a superblock's exact integer sum of each
                // subblock's sum times its scale (`sacc`), and the minimum terms in integers.
                let mut sacc = [[_mm256_setzero_si256(); 2]; MAX_MT];
                for sub in 0..8 {
                    let mut isum = [[_mm256_setzero_si256(); 2]; MAX_MT];
                    for g4 in 0..4 {
                        let g = sub * 4 + g4;
                        for h in 0..2 {
                            let w = _mm256_loadu_si256(
                                tile.qs.as_ptr().add(g * TILE_N * 4 + h * 32) as *const _,
                            );
                            let lo = _mm256_and_si256(w, mask);
                            let hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), mask);
                            for (m, act) in acts.iter().enumerate() {
                                let a_lo = bcast4_256(&act.qs, sub * 32 + g4 * 8);
                                let a_hi = bcast4_256(&act.qs, sub * 32 + g4 * 8 + 4);
                                isum[m][h] = $dp(isum[m][h], lo, a_lo);
                                isum[m][h] = $dp(isum[m][h], hi, a_hi);
                            }
                        }
                    }
                    for h in 0..2 {
                        let sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                            tile.sc[sub].as_ptr().add(h * 8) as *const _,
                        ));
                        for m in 0..acts.len() {
                            let scaled = _mm256_mullo_epi32(isum[m][h], sc);
                            sacc[m][h] = _mm256_add_epi32(sacc[m][h], scaled);
                        }
                    }
                }
                for h in 0..2 {
                    let mins: [__m256i; 4] = half_u8_pairs(&tile.mn, h);
                    for (m, act) in acts.iter().enumerate() {
                        let sums = super::kernels::q4k_sum_pairs(act);
                        let msum = _mm256_cvtepi32_ps(min_sums_256(&mins, sums));
                        let dall = _mm256_set1_ps(act.d);
                        let scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(sacc[m][h]), d[h]);
                        acc[m][h] = _mm256_fmadd_ps(scaled, dall, acc[m][h]);
                        acc[m][h] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin[h], dall), msum, acc[m][h]);
                    }
                }
            }
        };
    }
    q4k_tile_256!(q4k_tile_avxvnni, dp_vnni, "avx2,avxvnni,fma,f16c");
    q4k_tile_256!(q4k_tile_avx2, dp_avx2, "avx2,fma,f16c");

    macro_rules! q6k_tile_256 {
        ($fname:ident, $dp:path, $feat:literal) => {
            #[target_feature(enable = $feat)]
            pub(crate) unsafe fn $fname(
                tile: &TileQ6K,
                acts: &[&BlockQ8K],
                acc: &mut [[__m256; 2]],
            ) {
                let lo4 = _mm256_set1_epi8(0x0F);
                let hi2 = _mm256_set1_epi8(0x30);
                let d = [half_ps(&tile.d, 0), half_ps(&tile.d, 1)];
                // Baton: as the AVX-512 kernel, a conversion and a multiply-add a subblock and row
                // (`sacc`), and the offsets of 32 in integers once a superblock.
                let mut sacc = [[_mm256_setzero_ps(); 2]; MAX_MT];
                for sub in 0..16 {
                    let mut isum = [[_mm256_setzero_si256(); 2]; MAX_MT];
                    for h in 0..2 {
                        let l0 = group_half(&tile.ql, 2 * sub, h);
                        let l1 = group_half(&tile.ql, 2 * sub + 1, h);
                        let hb = group_half(&tile.qh, sub, h);
                        let w = [
                            _mm256_or_si256(
                                _mm256_and_si256(l0, lo4),
                                _mm256_and_si256(_mm256_slli_epi16(hb, 4), hi2),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16(l0, 4), lo4),
                                _mm256_and_si256(_mm256_slli_epi16(hb, 2), hi2),
                            ),
                            _mm256_or_si256(_mm256_and_si256(l1, lo4), _mm256_and_si256(hb, hi2)),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16(l1, 4), lo4),
                                _mm256_and_si256(_mm256_srli_epi16(hb, 2), hi2),
                            ),
                        ];
                        for (g4, w) in w.iter().enumerate() {
                            for (m, act) in acts.iter().enumerate() {
                                let a = bcast4_256(&act.qs, sub * 16 + g4 * 4);
                                isum[m][h] = $dp(isum[m][h], *w, a);
                            }
                        }
                    }
                    for h in 0..2 {
                        let scale = _mm256_mul_ps(d[h], half_i8s_to_ps(&tile.scales[sub], h));
                        for m in 0..acts.len() {
                            let f = _mm256_cvtepi32_ps(isum[m][h]);
                            sacc[m][h] = _mm256_fmadd_ps(f, scale, sacc[m][h]);
                        }
                    }
                }
                for h in 0..2 {
                    let scales: [__m256i; 8] = half_i8_pairs(&tile.scales, h);
                    let d32 = _mm256_mul_ps(d[h], _mm256_set1_ps(32.0));
                    for (m, act) in acts.iter().enumerate() {
                        let sums = super::kernels::q6k_sum_pairs(act);
                        let offset = _mm256_cvtepi32_ps(min_sums_256(&scales, sums));
                        let dall = _mm256_set1_ps(act.d);
                        acc[m][h] = _mm256_fmadd_ps(sacc[m][h], dall, acc[m][h]);
                        acc[m][h] = _mm256_fnmadd_ps(_mm256_mul_ps(d32, dall), offset, acc[m][h]);
                    }
                }
            }
        };
    }
    q6k_tile_256!(q6k_tile_avxvnni, dp_vnni, "avx2,avxvnni,fma,f16c");
    q6k_tile_256!(q6k_tile_avx2, dp_avx2, "avx2,fma,f16c");

    // Baton: q5_0, two 32-value groups; values are unsigned 5-bit (v-16), which maddubs takes
    // without overflow, so pure AVX2 runs it too.
    macro_rules! q5_0_tile2_256 {
        ($fname:ident, $dp:path, $feat:literal) => {
            #[target_feature(enable = $feat)]
            pub(crate) unsafe fn $fname(
                t0: &TileQ5_0,
                t1: &TileQ5_0,
                acts: &[&BlockQ8K],
                dact: &[[f32; 2]],
                sub32: usize,
                acc: &mut [[__m256; 2]],
            ) {
                let lo4 = _mm256_set1_epi8(0x0F);
                let bit4 = _mm256_set1_epi8(0x10);
                for (gi, blk, tile) in [(0, sub32, t0), (1, sub32 + 1, t1)] {
                    let mut isum = [[_mm256_setzero_si256(); 2]; MAX_MT];
                    for h in 0..2 {
                        let hv = group_half(&tile.qh, 0, h);
                        let hb = [
                            _mm256_and_si256(_mm256_slli_epi16(hv, 4), bit4),
                            _mm256_and_si256(_mm256_slli_epi16(hv, 3), bit4),
                            _mm256_and_si256(_mm256_slli_epi16(hv, 2), bit4),
                            _mm256_and_si256(_mm256_slli_epi16(hv, 1), bit4),
                            _mm256_and_si256(hv, bit4),
                            _mm256_and_si256(_mm256_srli_epi16(hv, 1), bit4),
                            _mm256_and_si256(_mm256_srli_epi16(hv, 2), bit4),
                            _mm256_and_si256(_mm256_srli_epi16(hv, 3), bit4),
                        ];
                        for i in 0..4 {
                            let q = group_half(&tile.qs, i, h);
                            let w = [
                                _mm256_or_si256(_mm256_and_si256(q, lo4), hb[2 * i]),
                                _mm256_or_si256(
                                    _mm256_and_si256(_mm256_srli_epi16(q, 4), lo4),
                                    hb[2 * i + 1],
                                ),
                            ];
                            for (half, w) in w.iter().enumerate() {
                                let g = 2 * i + half;
                                for (m, act) in acts.iter().enumerate() {
                                    let a = bcast4_256(&act.qs, blk * 32 + g * 4);
                                    isum[m][h] = $dp(isum[m][h], *w, a);
                                }
                            }
                        }
                    }
                    for h in 0..2 {
                        let dw = half_ps(&tile.d, h);
                        for (m, act) in acts.iter().enumerate() {
                            let bsum =
                                (act.bsums[blk * 2] as i32 + act.bsums[blk * 2 + 1] as i32) as f32;
                            let f = _mm256_sub_ps(
                                _mm256_cvtepi32_ps(isum[m][h]),
                                _mm256_set1_ps(16.0 * bsum),
                            );
                            acc[m][h] = _mm256_fmadd_ps(
                                f,
                                _mm256_mul_ps(dw, _mm256_set1_ps(dact[m][gi])),
                                acc[m][h],
                            );
                        }
                    }
                }
            }
        };
    }
    q5_0_tile2_256!(q5_0_tile2_avxvnni, dp_vnni, "avx2,avxvnni,fma,f16c");
    q5_0_tile2_256!(q5_0_tile2_avx2, dp_avx2, "avx2,fma,f16c");

    // Baton: q4_1, two 32-value groups; unsigned 4-bit values, so pure AVX2 runs it too.
    macro_rules! q4_1_tile2_256 {
        ($fname:ident, $dp:path, $feat:literal) => {
            #[target_feature(enable = $feat)]
            pub(crate) unsafe fn $fname(
                t0: &TileQ4_1,
                t1: &TileQ4_1,
                acts: &[&BlockQ8K],
                dact: &[[f32; 2]],
                sub32: usize,
                acc: &mut [[__m256; 2]],
            ) {
                let lo4 = _mm256_set1_epi8(0x0F);
                for (gi, blk, tile) in [(0, sub32, t0), (1, sub32 + 1, t1)] {
                    let mut isum = [[_mm256_setzero_si256(); 2]; MAX_MT];
                    for h in 0..2 {
                        for i in 0..4 {
                            let q = group_half(&tile.qs, i, h);
                            let w = [
                                _mm256_and_si256(q, lo4),
                                _mm256_and_si256(_mm256_srli_epi16(q, 4), lo4),
                            ];
                            for (half, w) in w.iter().enumerate() {
                                let g = 2 * i + half;
                                for (m, act) in acts.iter().enumerate() {
                                    let a = bcast4_256(&act.qs, blk * 32 + g * 4);
                                    isum[m][h] = $dp(isum[m][h], *w, a);
                                }
                            }
                        }
                    }
                    for h in 0..2 {
                        let dw = half_ps(&tile.d, h);
                        let mw = half_ps(&tile.m, h);
                        for (m, act) in acts.iter().enumerate() {
                            let bsum =
                                (act.bsums[blk * 2] as i32 + act.bsums[blk * 2 + 1] as i32) as f32;
                            let da = dact[m][gi];
                            let f = _mm256_cvtepi32_ps(isum[m][h]);
                            acc[m][h] =
                                _mm256_fmadd_ps(f, _mm256_mul_ps(dw, _mm256_set1_ps(da)), acc[m][h]);
                            acc[m][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(da * bsum), acc[m][h]);
                        }
                    }
                }
            }
        };
    }
    q4_1_tile2_256!(q4_1_tile2_avxvnni, dp_vnni, "avx2,avxvnni,fma,f16c");
    q4_1_tile2_256!(q4_1_tile2_avx2, dp_avx2, "avx2,fma,f16c");

    // q8_0 needs true dpbusd (u8 range overflows maddubs' i16 pairs), so vnni only.
    #[target_feature(enable = "avx2,avxvnni,fma")]
    pub(crate) unsafe fn q8_0_tile2_avxvnni(
        t0: &TileQ8_0,
        t1: &TileQ8_0,
        acts: &[&BlockQ8K],
        dact: &[[f32; 2]],
        sub32: usize,
        acc: &mut [[__m256; 2]],
    ) {
        let mut isum_a = [[_mm256_setzero_si256(); 2]; MAX_MT];
        let mut isum_b = [[_mm256_setzero_si256(); 2]; MAX_MT];
        for g4 in 0..8 {
            for h in 0..2 {
                let wa =
                    _mm256_loadu_si256(t0.qs.as_ptr().add(g4 * TILE_N * 4 + h * 32) as *const _);
                let wb =
                    _mm256_loadu_si256(t1.qs.as_ptr().add(g4 * TILE_N * 4 + h * 32) as *const _);
                for (m, act) in acts.iter().enumerate() {
                    isum_a[m][h] = _mm256_dpbusd_avx_epi32(
                        isum_a[m][h],
                        wa,
                        bcast4_256(&act.qs, sub32 * 32 + g4 * 4),
                    );
                    isum_b[m][h] = _mm256_dpbusd_avx_epi32(
                        isum_b[m][h],
                        wb,
                        bcast4_256(&act.qs, (sub32 + 1) * 32 + g4 * 4),
                    );
                }
            }
        }
        for (i, blk, isum, tile) in [(0, sub32, &isum_a, t0), (1, sub32 + 1, &isum_b, t1)] {
            for h in 0..2 {
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(tile.d.as_ptr().add(h * 8) as *const _));
                for (m, act) in acts.iter().enumerate() {
                    let bsum = (act.bsums[blk * 2] as i32 + act.bsums[blk * 2 + 1] as i32) as f32;
                    let f =
                        _mm256_sub_ps(_mm256_cvtepi32_ps(isum[m][h]), _mm256_set1_ps(128.0 * bsum));
                    acc[m][h] = _mm256_fmadd_ps(
                        f,
                        _mm256_mul_ps(dw, _mm256_set1_ps(dact[m][i])),
                        acc[m][h],
                    );
                }
            }
        }
    }
}

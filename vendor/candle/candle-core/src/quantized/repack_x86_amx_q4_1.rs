//! Baton: a prompt's products with Q4_1 weights on AMX (see ../../../BATON.md, change 13).
//!
//! A Q4_1 value is d * q + m with a scale d and offset m for every 32 values of a row, so a
//! product cannot sum past 32 values in integers: each 32-value group's integer sum is scaled on
//! its own. The AVX-512 kernel (`kernels_q4_1::q4_1_tile2`) spends 8 vpdpbusd a row and group
//! on those sums; here one tile product gives them for 16 rows and 16 columns, and the vector
//! units only scale them. Every group's sum is the same integer, and it is scaled and added in
//! the same order with the same operations, so a row's result is bit for bit what the AVX-512
//! kernel gives it alone.
//!
//! Layout: the tiles are configured as the Q4_K kernel configures them (16 rows of 64 bytes),
//! so an A tile holds two groups of 16 activation rows. Each group's weights sit in half of a
//! B tile whose other half is zero, so one product sums one group; that wastes half of each
//! product, which costs nothing measurable: the scaling, not the tile unit, bounds the kernel.

use super::repack_x86::{amx, Acts, TileQ4_1, TILE_N};
use super::k_quants::{QK4_1, QK_K};
use core::arch::x86_64::*;

// bytes of one B tile (16 k-quads x 16 columns x 4), and of a group pair's two
const B_TILE: usize = 1024;
const B_PAIR: usize = 2 * B_TILE;

// What a group's scaling takes from an activation row: its scale, and its scale times its sum.
type GroupEnd = [f32; 2];

pub(crate) fn matmul_amx_q4_1(
    tiles: &[TileQ4_1],
    acts: &Acts,
    m: usize,
    k: usize,
    n: usize,
    dst: &mut [f32],
) {
    let kb = k.div_ceil(QK_K);
    let groups = k / QK4_1;
    debug_assert!(groups.is_multiple_of(2) && n.is_multiple_of(TILE_N));
    debug_assert!(tiles.len() == (n / TILE_N) * groups && dst.len() >= m * n);
    let m_blocks = m.div_ceil(16);
    let n_tiles = n / TILE_N;

    // the activations as [row][k] bytes, rows padded with zeros to whole blocks of 16
    let mut a_all = vec![0i8; m_blocks * 16 * k];
    for (i, row) in acts.q.chunks_exact(kb).take(m).enumerate() {
        for (b, block) in row.iter().enumerate() {
            let len = (k - b * QK_K).min(QK_K);
            a_all[i * k + b * QK_K..][..len].copy_from_slice(&block.qs[..len]);
        }
    }
    // [16-row block][group][row in block]; padded rows' ends are zero, so their sums add nothing
    let mut ends: Vec<GroupEnd> = vec![[0.0; 2]; m_blocks * groups * 16];
    for i in 0..m {
        for g in 0..groups {
            let act = &acts.q[i * kb + g / 8];
            let blk = g % 8;
            // as `kernels_q4_1::q4_1_tile2` computes them, expression for expression
            let bsum = (act.bsums[blk * 2] as i32 + act.bsums[blk * 2 + 1] as i32) as f32;
            let da = acts.scales[i * kb * 8 + g];
            ends[((i / 16) * groups + g) * 16 + i % 16] = [da, da * bsum];
        }
    }

    let dst_ptr = dst.as_mut_ptr() as usize;
    let (a_all, ends) = (&a_all, &ends);
    crate::utils::barrier_pool().execute_chunked(n_tiles, |range| {
        let dst_ptr = dst_ptr as *mut f32;
        // the column tile's weights as B tiles; the zero halves are never written
        let mut b_tiles = AlignedBytes::zeroed(groups / 2 * B_PAIR);
        let mut c_scratch = AlignedBytes::zeroed(4 * B_TILE);
        for nt in range {
            let col_tiles = &tiles[nt * groups..(nt + 1) * groups];
            unsafe {
                widen(col_tiles, b_tiles.as_mut_ptr());
                for mb in 0..m_blocks {
                    let rows = (m - mb * 16).min(16);
                    rows16(
                        a_all.as_ptr().add(mb * 16 * k),
                        k,
                        b_tiles.as_ptr(),
                        col_tiles,
                        &ends[mb * groups * 16..(mb + 1) * groups * 16],
                        c_scratch.as_mut_ptr() as *mut i32,
                        rows,
                        dst_ptr.add(mb * 16 * n + nt * TILE_N),
                        n,
                    );
                }
            }
        }
    });
}

// 64-byte aligned scratch: tile loads and stores of whole cache lines
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

struct AlignedBytes(Vec<Line>);

impl AlignedBytes {
    fn zeroed(bytes: usize) -> Self {
        Self(vec![Line([0; 64]); bytes.div_ceil(64)])
    }
    fn as_ptr(&self) -> *const u8 {
        self.0.as_ptr() as *const u8
    }
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.0.as_mut_ptr() as *mut u8
    }
}

// A column tile's groups as B tiles: the pair (2p, 2p + 1) at p * B_PAIR, group 2p in rows 0-7
// of the first tile, group 2p + 1 in rows 8-15 of the second. Line l of a Q4_1 tile holds
// k-quads 2l (low nibbles) and 2l + 1 (high nibbles) in the [column][4 values] order a B
// tile's row wants.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn widen(col_tiles: &[TileQ4_1], b: *mut u8) {
    let lo4 = _mm512_set1_epi8(0x0F);
    for (g, tile) in col_tiles.iter().enumerate() {
        let base = b.add((g / 2) * B_PAIR + (g % 2) * (B_TILE + 8 * 64));
        for l in 0..QK4_1 / 8 {
            let q = _mm512_loadu_si512(tile.qs.as_ptr().add(l * TILE_N * 4) as *const _);
            _mm512_storeu_si512(base.add(2 * l * 64) as *mut _, _mm512_and_si512(q, lo4));
            _mm512_storeu_si512(
                base.add((2 * l + 1) * 64) as *mut _,
                _mm512_and_si512(_mm512_srli_epi16(q, 4), lo4),
            );
        }
    }
}

// Sixteen activation rows (`a`, [row][k] bytes, row stride `a_stride`) against one column tile:
// each group pair is one A tile load and two tile products, stored as two C tiles and scaled
// into sixteen rows of accumulators. Pairs alternate between C tiles 0-1 and 2-3 (and their
// halves of `c`), so a pair's products need not wait for the previous pair's stores.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows16(
    a: *const i8,
    a_stride: usize,
    b: *const u8,
    col_tiles: &[TileQ4_1],
    ends: &[GroupEnd],
    c: *mut i32,
    rows: usize,
    dst: *mut f32,
    n: usize,
) {
    amx::ensure_configured();
    let groups = col_tiles.len();
    let mut acc = [_mm512_setzero_ps(); 16];
    for p in 0..groups / 2 {
        let a0 = a.add(p * 64);
        let b0 = b.add(p * B_PAIR);
        let c0 = c.add((p % 2) * 512);
        if p % 2 == 0 {
            core::arch::asm!(
                "tileloadd tmm4, [{a} + {sa}*1]",
                "tileloadd tmm6, [{b} + {s}*1]",
                "tileloadd tmm7, [{b} + {s}*1 + 1024]",
                "tilezero tmm0",
                "tilezero tmm1",
                "tdpbssd tmm0, tmm4, tmm6",
                "tdpbssd tmm1, tmm4, tmm7",
                "tilestored [{c} + {s}*1], tmm0",
                "tilestored [{c} + {s}*1 + 1024], tmm1",
                a = in(reg) a0,
                sa = in(reg) a_stride,
                b = in(reg) b0,
                c = in(reg) c0,
                s = in(reg) 64usize,
                options(nostack)
            );
        } else {
            core::arch::asm!(
                "tileloadd tmm5, [{a} + {sa}*1]",
                "tileloadd tmm6, [{b} + {s}*1]",
                "tileloadd tmm7, [{b} + {s}*1 + 1024]",
                "tilezero tmm2",
                "tilezero tmm3",
                "tdpbssd tmm2, tmm5, tmm6",
                "tdpbssd tmm3, tmm5, tmm7",
                "tilestored [{c} + {s}*1], tmm2",
                "tilestored [{c} + {s}*1 + 1024], tmm3",
                a = in(reg) a0,
                sa = in(reg) a_stride,
                b = in(reg) b0,
                c = in(reg) c0,
                s = in(reg) 64usize,
                options(nostack)
            );
        }
        for half in 0..2 {
            let g = 2 * p + half;
            let tile = &col_tiles[g];
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(tile.d.as_ptr() as *const _));
            let mw = _mm512_cvtph_ps(_mm256_loadu_si256(tile.m.as_ptr() as *const _));
            let e = &ends[g * 16..g * 16 + 16];
            let cg = c0.add(half * 256);
            for (i, acc) in acc.iter_mut().enumerate() {
                let f = _mm512_cvtepi32_ps(_mm512_loadu_si512(cg.add(i * 16) as *const _));
                *acc = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, _mm512_set1_ps(e[i][0])), *acc);
                *acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(e[i][1]), *acc);
            }
        }
    }
    for (i, acc) in acc.iter().enumerate().take(rows) {
        _mm512_storeu_ps(dst.add(i * n), *acc);
    }
}

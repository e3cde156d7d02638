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

// One product of a call: a weight's column tiles, its width, and its [m][n] result.
pub(crate) struct Part<'a> {
    pub(crate) tiles: &'a [TileQ4_1],
    pub(crate) n: usize,
    pub(crate) dst: *mut f32,
}

/// The products of `m` activation rows with each part's weight, written whole into each part's
/// `dst` (every one of its m * n values, so it need not be zeroed first).
///
/// # Safety
/// Each `dst` must be valid for writes of m * n values, and the parts' results must not overlap.
pub(crate) unsafe fn matmul_amx_q4_1(parts: &[Part<'_>], acts: &Acts, m: usize, k: usize) {
    let groups = k / QK4_1;
    debug_assert!(groups.is_multiple_of(2));
    for p in parts {
        debug_assert!(p.n.is_multiple_of(TILE_N) && p.tiles.len() == (p.n / TILE_N) * groups);
    }
    let m_blocks = m.div_ceil(16);
    let (a_all, ends) = rows_as_tiles(acts, m, k);

    // every part's column tiles are one list of work, so a fused call (gate and up) waits for
    // its threads once, and a thread that finishes one part's tiles goes on to the next's
    let mut starts = Vec::with_capacity(parts.len());
    let mut total = 0;
    for p in parts {
        starts.push(total);
        total += p.n / TILE_N;
    }
    // (tiles, n, dst): raw pointers are not Sync, so the destinations travel as addresses
    let work: Vec<(&[TileQ4_1], usize, usize)> =
        parts.iter().map(|p| (p.tiles, p.n, p.dst as usize)).collect();
    let (a_all, ends, starts, work) = (&a_all, &ends, &starts, &work);
    crate::utils::barrier_pool().execute_chunked_by(total, 1, |range| {
        SCRATCH.with_borrow_mut(|scratch| {
            let (b_tiles, c_scratch) = scratch.take(groups / 2 * B_PAIR, 4 * B_TILE);
            for unit in range {
                let pi = starts.partition_point(|&s| s <= unit) - 1;
                let ((tiles, n, dst), nt) = (work[pi], unit - starts[pi]);
                let dst = dst as *mut f32;
                let col_tiles = &tiles[nt * groups..(nt + 1) * groups];
                // Safety: AVX-512 and AMX were checked before AMX was chosen (`amx_tiles`);
                // the scratch holds a column tile's B tiles and four C tiles; the caller gave
                // m * n values at each dst
                unsafe { widen(col_tiles, b_tiles) };
                for mb in 0..m_blocks {
                    unsafe { rows16(
                        a_all.as_ptr().add(mb * 16 * k),
                        k,
                        b_tiles,
                        col_tiles,
                        &ends[mb * groups * 16..(mb + 1) * groups * 16],
                        c_scratch as *mut i32,
                        (m - mb * 16).min(16),
                        dst.add(mb * 16 * n + nt * TILE_N),
                        n,
                    ) };
                }
            }
        })
    });
}

// The activations as AMX reads them: [row][k] bytes, rows padded with zeros to whole blocks of
// 16, and each group's scaling terms as [16-row block][group][row in block] (a padded row's
// are zero, so its sums add nothing). Built by all threads, a block of rows each: on one
// thread it was a tenth of a small model's prompt, with the other threads waiting.
fn rows_as_tiles(acts: &Acts, m: usize, k: usize) -> (Vec<i8>, Vec<GroupEnd>) {
    let kb = k.div_ceil(QK_K);
    let groups = k / QK4_1;
    let m_blocks = m.div_ceil(16);
    let mut a_all: Vec<i8> = Vec::with_capacity(m_blocks * 16 * k);
    let mut ends: Vec<GroupEnd> = Vec::with_capacity(m_blocks * groups * 16);
    let (a_ptr, e_ptr) = (a_all.as_mut_ptr() as usize, ends.as_mut_ptr() as usize);
    crate::utils::barrier_pool().execute_chunked(m_blocks, |blocks| {
        for mb in blocks {
            // Safety: block mb writes only its own 16 rows of `a_all` and its own
            // [groups][16] ends, every value of them.
            let a = unsafe {
                std::slice::from_raw_parts_mut((a_ptr as *mut i8).add(mb * 16 * k), 16 * k)
            };
            let e = unsafe {
                std::slice::from_raw_parts_mut(
                    (e_ptr as *mut GroupEnd).add(mb * groups * 16),
                    groups * 16,
                )
            };
            for r in 0..16 {
                let i = mb * 16 + r;
                let a_row = &mut a[r * k..(r + 1) * k];
                if i >= m {
                    a_row.fill(0);
                    for g in 0..groups {
                        e[g * 16 + r] = [0.0; 2];
                    }
                    continue;
                }
                for (b, block) in acts.q[i * kb..(i + 1) * kb].iter().enumerate() {
                    let len = (k - b * QK_K).min(QK_K);
                    a_row[b * QK_K..b * QK_K + len].copy_from_slice(&block.qs[..len]);
                }
                for g in 0..groups {
                    let act = &acts.q[i * kb + g / 8];
                    let blk = g % 8;
                    // as `kernels_q4_1::q4_1_tile2` computes them, expression for expression
                    let bsum = (act.bsums[blk * 2] as i32 + act.bsums[blk * 2 + 1] as i32) as f32;
                    let da = acts.scales[i * kb * 8 + g];
                    e[g * 16 + r] = [da, da * bsum];
                }
            }
        }
    });
    // Safety: the blocks above wrote every value of both
    unsafe {
        a_all.set_len(m_blocks * 16 * k);
        ends.set_len(m_blocks * groups * 16);
    }
    (a_all, ends)
}

// A thread's B tiles and C scratch, kept between calls: the B tiles' zero halves are written
// once, when the buffer grows, and never again (`widen` writes only the weight halves).
struct Scratch {
    b: AlignedBytes,
    c: AlignedBytes,
}

impl Scratch {
    fn take(&mut self, b_bytes: usize, c_bytes: usize) -> (*mut u8, *mut u8) {
        if self.b.len() < b_bytes {
            self.b = AlignedBytes::zeroed(b_bytes);
        }
        if self.c.len() < c_bytes {
            self.c = AlignedBytes::zeroed(c_bytes);
        }
        (self.b.as_mut_ptr(), self.c.as_mut_ptr())
    }
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = const {
        std::cell::RefCell::new(Scratch { b: AlignedBytes(Vec::new()), c: AlignedBytes(Vec::new()) })
    };
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
    fn len(&self) -> usize {
        self.0.len() * 64
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

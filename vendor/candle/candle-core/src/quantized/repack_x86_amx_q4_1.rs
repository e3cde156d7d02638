//! Baton: a prompt's products with Q4_1 weights on AMX (see ../../../BATON.md, changes 13 and 15).
//!
//! A Q4_1 value is d * q + m with a scale d and offset m for every 32 values of a row, so a
//! product cannot sum past 32 values in integers: each 32-value group's integer sum is scaled on
//! its own. The AVX-512 kernel (`kernels_q4_1::q4_1_tile2`) spends 8 vpdpbusd a row and group
//! on those sums; here one tile product gives them for 16 rows and 16 columns, and the vector
//! units only scale them. Every group's sum is the same integer, and it is scaled and added in
//! the same order with the same operations, so a row's result is bit for bit what the AVX-512
//! kernel gives it alone.
//!
//! Layout (`amx::Layout::Group32`): one tile product is one group, 16 activation rows of 32
//! bytes (A) against 8 k-quads of 16 columns (B), so no tile carries padding. Even and odd
//! groups use their own tiles, and a group's product is computed two groups ahead of its
//! scaling and stored one group ahead, so the tile unit, the tile stores and the vector units
//! work at once. What bounds the kernel is each group's C tile going through memory (AMX has
//! no move from a tile to a vector register) and its scaling.

use super::repack_x86::{amx, Acts, AlignedBytes, TileQ4_1, TILE_N};
use super::k_quants::{QK4_1, QK_K};
use core::arch::x86_64::*;

// bytes of one group's B tile (8 k-quads x 16 columns x 4), and of one C tile (16 x 16 i32)
const B_GROUP: usize = 512;
const C_TILE: usize = 1024;

// What a group's scaling takes from an activation row: its scale, and its scale times its sum.
type GroupEnd = [f32; 2];

// One product of a call: a weight's column tiles, its width, and its [m][n] result.
pub(crate) struct Part<'a> {
    pub(crate) tiles: &'a [TileQ4_1],
    pub(crate) n: usize,
    pub(crate) dst: *mut f32,
}

// Safety: the threads of `matmul_amx_q4_1` write through `dst` only, each to its own column
// tiles' values (one unit of work a column tile), as that function's contract states.
unsafe impl Sync for Part<'_> {}

/// The products of `m` activation rows with each part's weight, written whole into each part's
/// `dst` (every one of its m * n values, so it need not be zeroed first).
///
/// # Safety
/// Each `dst` must be valid for writes of m * n values, and the parts' results must not overlap.
pub(crate) unsafe fn matmul_amx_q4_1(parts: &[Part<'_>], acts: &Acts, m: usize, k: usize) {
    let groups = k / QK4_1;
    // what `select` gives AMX; anything else would leave values unwritten
    assert!(k.is_multiple_of(64), "Q4_1 on AMX needs k a multiple of 64, not {k}");
    for p in parts {
        assert!(
            p.n.is_multiple_of(TILE_N) && p.tiles.len() == (p.n / TILE_N) * groups,
            "Q4_1 on AMX: {} tiles do not make {} columns of {k} values",
            p.tiles.len(),
            p.n
        );
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
    let (a_all, ends, starts) = (&a_all, &ends, &starts);
    crate::utils::barrier_pool().execute_chunked_by(total, 1, |range| {
        SCRATCH.with_borrow_mut(|scratch| {
            let (b_tiles, c_scratch) = scratch.take(groups * B_GROUP, 2 * C_TILE);
            for unit in range {
                let pi = starts.partition_point(|&s| s <= unit) - 1;
                let (Part { tiles, n, dst }, nt) = (&parts[pi], unit - starts[pi]);
                let (n, dst) = (*n, *dst);
                let col_tiles = &tiles[nt * groups..(nt + 1) * groups];
                // Safety: AVX-512 and AMX were checked before AMX was chosen (`amx_tiles`);
                // the scratch holds a column tile's B tiles and two C tiles; the caller gave
                // m * n values at each dst
                unsafe { widen(col_tiles, b_tiles) };
                for mb in 0..m_blocks {
                    unsafe { rows16(
                        a_all.as_ptr().add(mb * 16 * k) as *const i8,
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
// thread it was a tenth of a small model's prompt, with the other threads waiting. The rows
// start on cache lines (k is a multiple of 64), so a tile load's row of 32 bytes never spans
// two lines: with malloc's alignment, half of them did, and the kernel took 1.3x as long.
fn rows_as_tiles(acts: &Acts, m: usize, k: usize) -> (AlignedBytes, Vec<GroupEnd>) {
    debug_assert!(k.is_multiple_of(64));
    let kb = k.div_ceil(QK_K);
    let groups = k / QK4_1;
    let m_blocks = m.div_ceil(16);
    let mut a_all = AlignedBytes::uninit(m_blocks * 16 * k);
    let mut ends: Vec<GroupEnd> = Vec::with_capacity(m_blocks * groups * 16);
    let (a_ptr, e_ptr) = (a_all.as_mut_ptr() as usize, ends.as_mut_ptr() as usize);
    crate::utils::barrier_pool().execute_chunked(m_blocks, |blocks| {
        for mb in blocks {
            // Safety: block mb writes only its own 16 rows of `a_all` and its own
            // [groups][16] ends, every value of them, through raw pointers (the memory is not
            // initialised until then).
            let a = unsafe { (a_ptr as *mut u8).add(mb * 16 * k) };
            let e = unsafe { (e_ptr as *mut GroupEnd).add(mb * groups * 16) };
            for r in 0..16 {
                let i = mb * 16 + r;
                let a_row = unsafe { a.add(r * k) };
                if i >= m {
                    unsafe { a_row.write_bytes(0, k) };
                    for g in 0..groups {
                        unsafe { e.add(g * 16 + r).write([0.0; 2]) };
                    }
                    continue;
                }
                for (b, block) in acts.q[i * kb..(i + 1) * kb].iter().enumerate() {
                    let len = (k - b * QK_K).min(QK_K);
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            block.qs.as_ptr() as *const u8,
                            a_row.add(b * QK_K),
                            len,
                        )
                    };
                }
                for g in 0..groups {
                    let act = &acts.q[i * kb + g / 8];
                    let blk = g % 8;
                    // as `kernels_q4_1::q4_1_tile2` computes them, expression for expression
                    let bsum = (act.bsums[blk * 2] as i32 + act.bsums[blk * 2 + 1] as i32) as f32;
                    let da = acts.scales[i * kb * 8 + g];
                    unsafe { e.add(g * 16 + r).write([da, da * bsum]) };
                }
            }
        }
    });
    // Safety: the blocks above wrote every value of both
    unsafe {
        a_all.assume_init(m_blocks * 16 * k);
        ends.set_len(m_blocks * groups * 16);
    }
    (a_all, ends)
}

// A thread's B tiles and C scratch, kept between calls so that a unit of work allocates
// nothing.
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
        std::cell::RefCell::new(Scratch { b: AlignedBytes::new(), c: AlignedBytes::new() })
    };
}

// A column tile's groups as B tiles (`Layout::Group32`): group g's 8 k-quad rows at g * B_GROUP.
// Line l of a Q4_1 tile holds k-quads 2l (low nibbles) and 2l + 1 (high nibbles) in the
// [column][4 values] order a B tile's row wants.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn widen(col_tiles: &[TileQ4_1], b: *mut u8) {
    let lo4 = _mm512_set1_epi8(0x0F);
    for (g, tile) in col_tiles.iter().enumerate() {
        let base = b.add(g * B_GROUP);
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

// Group g's tile product for sixteen rows, into C tile tmm0 or tmm1 (by g's parity). Even and
// odd groups use their own A, B and C tiles, so a group's loads need not wait for the previous
// group's product to have read its tiles.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn product(a: *const i8, a_stride: usize, b: *const u8, g: usize) {
    let a0 = a.add(g * QK4_1);
    let b0 = b.add(g * B_GROUP);
    if g % 2 == 0 {
        core::arch::asm!(
            "tileloadd tmm4, [{a} + {sa}*1]",
            "tileloadd tmm6, [{b} + {s}*1]",
            "tilezero tmm0",
            "tdpbssd tmm0, tmm4, tmm6",
            a = in(reg) a0,
            sa = in(reg) a_stride,
            b = in(reg) b0,
            s = in(reg) 64usize,
            options(nostack)
        );
    } else {
        core::arch::asm!(
            "tileloadd tmm5, [{a} + {sa}*1]",
            "tileloadd tmm7, [{b} + {s}*1]",
            "tilezero tmm1",
            "tdpbssd tmm1, tmm5, tmm7",
            a = in(reg) a0,
            sa = in(reg) a_stride,
            b = in(reg) b0,
            s = in(reg) 64usize,
            options(nostack)
        );
    }
}

// Group g's product (`product`) stored as one C tile at c + (g % 2) * 256.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store(c: *mut i32, g: usize) {
    let c0 = c.add((g % 2) * 256);
    if g % 2 == 0 {
        core::arch::asm!("tilestored [{c} + {s}*1], tmm0", c = in(reg) c0, s = in(reg) 64usize, options(nostack));
    } else {
        core::arch::asm!("tilestored [{c} + {s}*1], tmm1", c = in(reg) c0, s = in(reg) 64usize, options(nostack));
    }
}

// Sixteen activation rows (`a`, [row][k] bytes, row stride `a_stride`) against one column tile:
// each group is one tile product (`product`), stored as one C tile (`store`, into the half of
// `c` its parity picks) and scaled into sixteen rows of accumulators.
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
    amx::ensure_configured(amx::Layout::Group32);
    let groups = col_tiles.len();
    let mut acc = [_mm512_setzero_ps(); 16];
    // three groups in flight: while group g is scaled, g + 1's product is stored and g + 2's
    // is computed, so a store comes a group's scaling after its product (but the first)
    // (k is a multiple of 64, so there are two groups at least)
    product(a, a_stride, b, 0);
    product(a, a_stride, b, 1);
    store(c, 0);
    for g in 0..groups {
        if g + 2 < groups {
            product(a, a_stride, b, g + 2);
        }
        if g + 1 < groups {
            store(c, g + 1);
        }
        let tile = &col_tiles[g];
        let dw = _mm512_cvtph_ps(_mm256_loadu_si256(tile.d.as_ptr() as *const _));
        let mw = _mm512_cvtph_ps(_mm256_loadu_si256(tile.m.as_ptr() as *const _));
        let e = &ends[g * 16..g * 16 + 16];
        let cg = c.add((g % 2) * 256);
        for (i, acc) in acc.iter_mut().enumerate() {
            let f = _mm512_cvtepi32_ps(_mm512_loadu_si512(cg.add(i * 16) as *const _));
            *acc = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, _mm512_set1_ps(e[i][0])), *acc);
            *acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(e[i][1]), *acc);
        }
    }
    for (i, acc) in acc.iter().enumerate().take(rows) {
        _mm512_storeu_ps(dst.add(i * n), *acc);
    }
}

//! AVX-512 tiles of the quantized matrix product.
//!
//! A tile is `R` weight rows × `T` tokens. For each block of 32 weights the tile's rows are
//! dequantized once into registers (`d * q + m` rounded once, as the portable kernel's fused
//! operation) and multiplied into one 16-lane accumulator per (row, token): lane `l` takes
//! weights `l` then `16 + l` of each block, in block order. The horizontal sum is the same
//! fixed tree as [`super::hsum`]. So the bits of `(row, token)` depend on neither `R`, `T`,
//! nor the other rows and tokens.
//!
//! The attention is in `avx512/attend.rs`, the block formats (`Block`) in `avx512/blocks.rs`.

use std::arch::x86_64::*;

mod attend;
mod blocks;
mod broadcast;
pub use attend::attend;
#[cfg(test)]
pub(crate) use attend::exp16;
pub use blocks::{Block, Q4_1Grouped, Q4_1Wide, Q8_0Wide};

/// The many-token kernel's register tile for a few tokens (below [`TALL_FROM`]): 4 rows x 4
/// tokens. At 4 x 5 the 20 accumulators, 4 weight vectors and the token vector should fit
/// the 32 registers, but the compiler spilled accumulators (48 GMAC/s against 81 at 4 x 4,
/// 32 tokens of a 576-column matrix on a Sapphire Rapids core); so did 8 x 3 and 6 x 4.
const SHORT_TILE: (usize, usize) = (4, 4);

/// The tile from [`TALL_FROM`] tokens: 8 rows x 2 tokens. Each token vector, which comes
/// from L2 once the tokens' activations outgrow L1 (32 tokens of 576 columns: 73 KB), serves
/// 8 rows instead of 4. On a Xeon core (2 MiB L2), 3 rounds interleaved: 512-token prefill
/// 340-364 -> 434-474 tok/s; batch-32 decode 273-276 -> 312-327 (2 threads 472-495 ->
/// 549-557). At a batch of 8 it was slower (215-230 against 247-253 tok/s: twice the
/// dequantized weights per tile for few tokens).
const TALL_TILE: (usize, usize) = (8, 2);

/// Tokens from which [`rows_many`] takes [`TALL_TILE`]. Once the token vectors were aligned
/// (`kernels::lines`: every 16-lane load of a misaligned one had crossed two cache lines)
/// the short tile won at 32 tokens again: batch-32 decode 347-354 -> 365-370 tok/s (2
/// threads 531-551 -> 573-586), 3 rounds interleaved on a Xeon core; prefill 512 kept the
/// tall tile's 445-460 (the short tile's: 356-359).
const TALL_FROM: usize = 64;

/// The most tokens a many-token register tile takes (the token pointers it is given).
const TILE_TOKENS: usize = 4;

/// The activations [`rows_many`] sweeps at once, at most (bytes): a quarter of a 2 MiB L2,
/// so they stay there while every tile passes over them, each block of tokens dequantizing
/// the weights again. A 512-token chunk's input to the down projection (1,536 columns:
/// 3 MB) had come from L3 for every tile: 43 -> 54 GMAC/s; 1-thread prefill 391-403 ->
/// 421-436 tok/s (3 rounds interleaved; at 2 threads, 256 tokens each, 721-826 -> 767-792:
/// within the noise).
const X_BLOCK_BYTES: usize = 512 << 10;

/// Columns of the many-token kernel's span: 4 rows and 4 tokens of them (24 KB; the tall
/// tile's 8 rows and 2 tokens, 30 KB) stay in L1 while the span lasts. A whole row of the
/// FFN's down projection (1,536 columns) did not (4 rows and 4 tokens, 48 KB: 47 % of the
/// peak against 65 % for 576 columns); spans of 384 and 1,536 with the tall tile were
/// slower.
const K_SPAN: usize = 768;

/// From this many tokens the matrix product takes [`rows_many`] (each tile dequantized once
/// for every token) instead of the streaming [`rows`]. Up to 8 tokens go through [`rows`] in
/// one pass (2-row tiles from 5 tokens): at 8 tokens 45-46 GMAC/s against the many-token
/// kernel's 34-41 (`--kernels`, 2 rounds interleaved, the EPYC (Zen 4) VM).
pub const MANY_FROM: usize = 9;

/// The fixed tree: pairs `(i, i + 8)`, then `(i, i + 4)`, `(i, i + 2)`, `(0, 1)`.
#[inline(always)]
unsafe fn hsum(v: __m512) -> f32 {
    // SAFETY: register-only operations; AVX-512F is enabled by the callers.
    unsafe {
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
        let s8 = _mm256_add_ps(lo, hi);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)))
    }
}

/// The first step of [`hsum`]'s tree for two vectors at once: `[x's lanes 0..8 | y's 0..8]
/// + [x's 8..16 | y's 8..16]`, so each 256-bit half holds one vector's pairs `(i, i + 8)`.
#[inline(always)]
pub(super) unsafe fn tree_halves(x: __m512, y: __m512) -> __m512 {
    // SAFETY: register-only operations; AVX-512F is enabled by the callers.
    unsafe {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
        )
    }
}

/// The second step for four vectors, from two [`tree_halves`]: each 128-bit lane one
/// vector's pairs `(i, i + 4)`, in the order `x`'s two, then `y`'s.
#[inline(always)]
pub(super) unsafe fn tree_quarters(x: __m512, y: __m512) -> __m512 {
    // SAFETY: as for `tree_halves`.
    unsafe {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
        )
    }
}

/// [`hsum`] of sixteen vectors at once: lane `p` of the result is `hsum(v[p])`, bit for bit
/// (each of the tree's four steps adds the same two values, only side by side: 30 shuffles
/// and 15 additions instead of 64 and 64). Where a tile's products have only a few dozen
/// fused multiply-adds per sum (576 columns: 36), the sixteen separate trees cost a fifth of
/// them.
#[inline(always)]
unsafe fn hsum16(v: [__m512; 16]) -> __m512 {
    // SAFETY: register-only operations; AVX-512F is enabled by the callers.
    unsafe {
        // The steps leave sum `s` in lane `4 * (s % 4) + s / 4`; reading the inputs in that
        // transposed order puts `hsum(v[p])` in lane `p`.
        let at = |s: usize| v[4 * (s % 4) + s / 4];
        let halves: [__m512; 8] = std::array::from_fn(|k| tree_halves(at(2 * k), at(2 * k + 1)));
        let quarters: [__m512; 4] =
            std::array::from_fn(|k| tree_quarters(halves[2 * k], halves[2 * k + 1]));
        // Within each 128-bit lane: (0 + 2, 1 + 3) of one sum beside another's, then (0 + 1).
        let pairs = |x: __m512, y: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_ps::<0b01_00_01_00>(x, y),
                _mm512_shuffle_ps::<0b11_10_11_10>(x, y),
            )
        };
        let (a, b) = (
            pairs(quarters[0], quarters[1]),
            pairs(quarters[2], quarters[3]),
        );
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(a, b),
            _mm512_shuffle_ps::<0b11_01_11_01>(a, b),
        )
    }
}

/// One tile: `out[j * out_stride + i] = dot(row i, token j)`.
///
/// # Safety
/// Each `rows[i]` points at `blocks * B::BYTES` readable bytes, each `xs[j]` at `blocks * 32`
/// readable f32, `out` has room for every written index; AVX-512F and F16C are available.
#[inline(always)]
unsafe fn tile<B: Block, const R: usize, const T: usize>(
    rows: [*const u8; R],
    xs: [*const f32; T],
    blocks: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let ahead = super::PREFETCH_AHEAD * blocks * B::BYTES;
    // SAFETY: per the function contract.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        // Block `$b` of the tile's rows, row `$i`'s weights from `$load`.
        macro_rules! block {
            ($b:expr, |$i:ident| $load:expr) => {{
                let b = $b;
                let mut w = [(_mm512_setzero_ps(), _mm512_setzero_ps()); R];
                for $i in 0..R {
                    // Weights stream from memory once per token at decode: fetch the same
                    // block of the rows `ahead` bytes on while this tile computes, into L2
                    // only ([`super::PREFETCH_AHEAD`]). A prefetch past the end of the matrix
                    // is harmless (it never faults).
                    _mm_prefetch::<_MM_HINT_T1>(rows[$i].wrapping_add(ahead + b * B::BYTES).cast());
                    w[$i] = $load;
                }
                for j in 0..T {
                    let xl = _mm512_loadu_ps(xs[j].add(b * 32));
                    let xh = _mm512_loadu_ps(xs[j].add(b * 32 + 16));
                    for i in 0..R {
                        acc[i][j] = _mm512_fmadd_ps(w[i].0, xl, acc[i][j]);
                        acc[i][j] = _mm512_fmadd_ps(w[i].1, xh, acc[i][j]);
                    }
                }
            }};
        }
        const { assert!(B::GROUP == 1 || B::GROUP == 4, "the unrolled groups below") };
        let grouped = blocks / B::GROUP * B::GROUP;
        let mut b = 0;
        while b < grouped {
            let g: [*const u8; R] = std::array::from_fn(|i| rows[i].add(b * B::BYTES));
            // Each block of the group with a constant `k` (so constant shifts); a group of
            // one is the lone block.
            block!(b, |i| B::load_grouped(g[i], 0));
            if B::GROUP == 4 {
                block!(b + 1, |i| B::load_grouped(g[i], 1));
                block!(b + 2, |i| B::load_grouped(g[i], 2));
                block!(b + 3, |i| B::load_grouped(g[i], 3));
            }
            b += B::GROUP;
        }
        while b < blocks {
            block!(b, |i| B::load(rows[i].add(b * B::BYTES)));
            b += 1;
        }
        for i in 0..R {
            for j in 0..T {
                *out.add(j * out_stride + i) = hsum(acc[i][j]);
            }
        }
    }
}

/// A tile over f32 weights already dequantized into `wbuf` (`R` rows of `cols`), columns
/// `span` of them: the same accumulation sequence as [`tile`] (16-lane chunks in increasing
/// `k`), so the bits match. The sums continue from `carry` unless `span` starts at column 0,
/// and go back to it unless `span` ends the row, where their trees are written to `out`
/// (a store and a load change no bit). Rows beyond `rows` are computed on row 0's weights
/// and not written.
///
/// # Safety
/// `wbuf` holds `R * cols` f32, each `xs[j]` for `j < T` (`T <= TILE_TOKENS`) `cols` f32,
/// `carry` `R * T` vectors, `out` every written index; AVX-512F.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_f32<const R: usize, const T: usize>(
    wbuf: *const f32,
    cols: usize,
    span: std::ops::Range<usize>,
    rows: usize,
    xs: [*const f32; TILE_TOKENS],
    carry: *mut __m512,
    out: *mut f32,
    out_stride: usize,
) {
    // SAFETY: per the function contract.
    unsafe {
        let w: [*const f32; R] =
            std::array::from_fn(|i| wbuf.add(if rows > i { i * cols } else { 0 }));
        // Indexed by constants only (`R` and `T` are compile-time): the accumulators stay in
        // registers. (A version that chose the rows at run time kept them on the stack:
        // 40 % of the peak instead of 60 %.)
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        if span.start > 0 {
            for i in 0..R {
                for j in 0..T {
                    acc[i][j] = *carry.add(i * T + j);
                }
            }
        }
        let mut k = span.start;
        while k < span.end {
            let mut v = [_mm512_setzero_ps(); R];
            for i in 0..R {
                v[i] = _mm512_loadu_ps(w[i].add(k));
            }
            for j in 0..T {
                let x = _mm512_loadu_ps(xs[j].add(k));
                for i in 0..R {
                    acc[i][j] = _mm512_fmadd_ps(v[i], x, acc[i][j]);
                }
            }
            k += 16;
        }
        if span.end < cols {
            for i in 0..R {
                for j in 0..T {
                    *carry.add(i * T + j) = acc[i][j];
                }
            }
            return;
        }
        if R * T == 16 {
            // Token-major, so each token's rows are consecutive lanes.
            let sums = hsum16(std::array::from_fn(|p| acc[p % R][p / R]));
            // `rows <= R <= 16` lanes of each token.
            let keep = ((1u32 << rows) - 1) as u16;
            for j in 0..T {
                let first = _mm512_add_epi32(
                    _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                    _mm512_set1_epi32((j * R) as i32),
                );
                let row_sums = _mm512_permutexvar_ps(first, sums);
                _mm512_mask_storeu_ps(out.add(j * out_stride), keep, row_sums);
            }
            return;
        }
        for (i, acc) in acc.iter().enumerate().take(rows) {
            for j in 0..T {
                *out.add(j * out_stride + i) = hsum(acc[j]);
            }
        }
    }
}

/// Like [`rows`], for many tokens: each tile of rows is dequantized once into an L1-sized
/// f32 buffer and then swept over the tokens a register tile at a time, [`K_SPAN`] columns
/// at a time ([`SHORT_TILE`], or [`TALL_TILE`] from [`TALL_FROM`] tokens), the tokens in
/// blocks of [`X_BLOCK_BYTES`]. Same bits as [`rows`] whatever the tile and block.
///
/// # Safety
/// As for [`rows`].
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn rows_many<B: Block>(
    w: &[u8],
    cols: usize,
    first: usize,
    n: usize,
    x: &[f32],
    tokens: usize,
    out: *mut f32,
    out_stride: usize,
) {
    const S_R: usize = SHORT_TILE.0;
    const S_T: usize = SHORT_TILE.1;
    const T_R: usize = TALL_TILE.0;
    const T_T: usize = TALL_TILE.1;
    // Tokens in blocks whose activations stay in L2 while every tile passes over them.
    let per = (X_BLOCK_BYTES / (cols * 4).max(1)).max(TALL_FROM);
    let mut t0 = 0;
    while t0 < tokens {
        let nt = per.min(tokens - t0);
        let x = &x[t0 * cols..(t0 + nt) * cols];
        // SAFETY: the block's outputs are inside the caller's.
        let out = unsafe { out.add(t0 * out_stride) };
        // SAFETY: the caller's contract is the sweep's, for this block of its tokens.
        unsafe {
            if nt >= TALL_FROM {
                sweep_many::<B, T_R, T_T>(w, cols, first, n, x, nt, out, out_stride)
            } else {
                sweep_many::<B, S_R, S_T>(w, cols, first, n, x, nt, out, out_stride)
            }
        }
        t0 += nt;
    }
}

/// [`rows_many`] with tiles of `R` rows and up to `T` (at most [`TILE_TOKENS`]) tokens.
///
/// # Safety
/// As for [`rows`].
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn sweep_many<B: Block, const R: usize, const T: usize>(
    w: &[u8],
    cols: usize,
    first: usize,
    n: usize,
    x: &[f32],
    tokens: usize,
    out: *mut f32,
    out_stride: usize,
) {
    const {
        assert!(
            T >= 1 && T <= TILE_TOKENS,
            "a tile's tokens fit its token pointers"
        )
    };
    let blocks = cols / 32;
    let rb = blocks * B::BYTES;
    // 64-byte aligned: a 16-lane load across two cache lines costs two (the allocator
    // aligns to 16 bytes).
    let mut wbuf = vec![0f32; R * cols + 16];
    let skip = wbuf.as_ptr().align_offset(64).min(16);
    // Each token group's sums between column spans; a row of one span carries nothing, so
    // the common shapes (576 columns) allocate no buffer on this per-product path.
    let carried = if cols > K_SPAN {
        tokens.div_ceil(T) * R * T
    } else {
        0
    };
    let mut carry = vec![_mm512_setzero_ps(); carried];
    let (base, xb, ob) = (w.as_ptr(), x.as_ptr(), out);
    let (wp, cp) = (wbuf[skip..].as_mut_ptr(), carry.as_mut_ptr());
    // SAFETY: every pointer below stays inside `w`, `x`, `out`, `wbuf` and `carry` per the
    // contract.
    unsafe {
        let tok = |t: usize| xb.add(t * cols);
        let mut r = 0;
        while r < n {
            let tile_rows = (n - r).min(R);
            for i in 0..tile_rows {
                let row = base.add((first + r + i) * rb);
                for b in 0..blocks {
                    let (lo, hi) = B::load_nth(row, b, blocks);
                    _mm512_storeu_ps(wp.add(i * cols + b * 32), lo);
                    _mm512_storeu_ps(wp.add(i * cols + b * 32 + 16), hi);
                }
            }
            // The next tile's rows come from memory while this one computes (its dequantizing
            // loop above otherwise waits for them; a prefetch past the end never faults).
            // Into L2, as the attention's (`sweep.rs`): batch 32, 3 rounds, 318-323 -> 329-338
            // tok/s on a Zen 4 core with T0 -> T1.
            let next = base.wrapping_add((first + r + R) * rb);
            let mut b = 0;
            while b < R * rb {
                _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(b).cast());
                b += 64;
            }
            let mut k = 0;
            while k < cols {
                let span = k..cols.min(k + K_SPAN);
                let mut t = 0;
                while t < tokens {
                    let group = (tokens - t).min(T);
                    let o = ob.add(t * out_stride + r);
                    let xs = std::array::from_fn(|j: usize| tok(t + j.min(group - 1)));
                    // Never read or written where `carry` is empty (one span per row).
                    let c = cp.wrapping_add(t * R);
                    let span = span.clone();
                    // `group <= T <= TILE_TOKENS` (4): the arms above `T` are never taken.
                    match group {
                        4 => tile_f32::<R, 4>(wp, cols, span, tile_rows, xs, c, o, out_stride),
                        3 => tile_f32::<R, 3>(wp, cols, span, tile_rows, xs, c, o, out_stride),
                        2 => tile_f32::<R, 2>(wp, cols, span, tile_rows, xs, c, o, out_stride),
                        _ => tile_f32::<R, 1>(wp, cols, span, tile_rows, xs, c, o, out_stride),
                    }
                    t += group;
                }
                k = span.end;
            }
            r += tile_rows;
        }
    }
}

/// Rows `first..first + n` of `W · xᵀ` for `tokens` tokens of `cols` (a multiple of 32).
/// Writes `out[t * out_stride + (r - first)]`.
///
/// # Safety
/// `w` holds at least `(first + n)` rows of `cols / 32` blocks of `B`; `x` holds
/// `tokens * cols` f32; `out` may be written at `t * out_stride + i` for `t < tokens`,
/// `i < n` (`out_stride >= n`), and nothing else reads or writes those elements during the
/// call (the pieces of a split product write one output's disjoint rows at once); AVX-512F
/// and F16C are available.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn rows<B: Block>(
    w: &[u8],
    cols: usize,
    first: usize,
    n: usize,
    x: &[f32],
    tokens: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let blocks = cols / 32;
    let rb = blocks * B::BYTES;
    let base = w.as_ptr();
    let xb = x.as_ptr();
    let ob = out;
    // SAFETY: every pointer below stays inside `w`, `x` and `out` per the contract.
    unsafe {
        let row = |r: usize| base.add((first + r) * rb);
        let tok = |t: usize| xb.add(t * cols);
        let mut r = 0;
        while r < n {
            // 5 to 8 tokens in one pass of 2-row tiles (up to 16 sums in registers) rather
            // than a 4-token pass and a second for the rest: each pass dequantizes every
            // weight again, and the second cost as much as a whole batch-1 product. On the
            // EPYC (Zen 4) VM (`--kernels`, interleaved) the FFN products at 5 tokens 132-138
            // -> 117-118 us, 6 144-155 -> 125-132, 7 161-167 -> 145-146.
            // At most 8 (the widest arm below), so every (rows, tokens) a pass takes has an arm even
            // if a caller streams more tokens than `MANY_FROM` sends here.
            let (most_rows, most_tokens) = if tokens > 4 {
                (2, tokens.min(8))
            } else {
                (4, 4)
            };
            let tile_rows = (n - r).min(most_rows);
            let mut t = 0;
            while t < tokens {
                let group = (tokens - t).min(most_tokens);
                let o = ob.add(t * out_stride + r);
                macro_rules! go {
                    ($R:literal, $T:literal) => {
                        tile::<B, $R, $T>(
                            std::array::from_fn(|i| row(r + i)),
                            std::array::from_fn(|j| tok(t + j)),
                            blocks,
                            o,
                            out_stride,
                        )
                    };
                }
                match (tile_rows, group) {
                    (2, 8) => go!(2, 8),
                    (2, 7) => go!(2, 7),
                    (2, 6) => go!(2, 6),
                    (2, 5) => go!(2, 5),
                    (1, 8) => go!(1, 8),
                    (1, 7) => go!(1, 7),
                    (1, 6) => go!(1, 6),
                    (1, 5) => go!(1, 5),
                    (4, 4) => go!(4, 4),
                    (4, 3) => go!(4, 3),
                    (4, 2) => go!(4, 2),
                    (4, 1) => go!(4, 1),
                    (3, 4) => go!(3, 4),
                    (3, 3) => go!(3, 3),
                    (3, 2) => go!(3, 2),
                    (3, 1) => go!(3, 1),
                    (2, 4) => go!(2, 4),
                    (2, 3) => go!(2, 3),
                    (2, 2) => go!(2, 2),
                    (2, 1) => go!(2, 1),
                    (1, 4) => go!(1, 4),
                    (1, 3) => go!(1, 3),
                    (1, 2) => go!(1, 2),
                    _ => go!(1, 1),
                }
                t += group;
            }
            r += tile_rows;
        }
    }
}

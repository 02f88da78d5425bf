//! AVX2 tiles of the quantized matrix product: the AVX-512 kernel's operations on 8-lane
//! registers.
//!
//! The 16 lanes of a dot product (see [`super`]) are two 8-lane registers: lanes 0-7 and 8-15.
//! For each block of 32 weights, lane `l` takes weight `l` then `16 + l`, each a fused
//! multiply-add, in block order; the weights are dequantized exactly as the portable kernel
//! does (`d * q + m` fused for Q4_1, `q * d` for Q8_0). The horizontal sum is the same fixed
//! tree. So a result's bits equal the portable and AVX-512 kernels' (the matmul tests compare
//! them), whatever the tile shape.
//!
//! The attention, and the element-wise kernels that share its `exp`, are in `avx2/attend.rs`.

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::lines::Lines;

mod attend;
mod block;
pub(crate) mod softmax;
pub use attend::attend;
pub(crate) use attend::exp8;
pub(crate) use attend::silu_mul;
pub use block::{Block, Q4_1Wide, Q8_0Wide};

/// The fixed tree over the 16 lanes `(lo, hi)`: pairs `(i, i + 8)`, then `(i, i + 4)`,
/// `(i, i + 2)`, `(0, 1)`.
#[inline(always)]
unsafe fn hsum(lo: __m256, hi: __m256) -> f32 {
    // SAFETY: register-only operations; AVX2 is enabled by the callers.
    unsafe {
        let s8 = _mm256_add_ps(lo, hi);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)))
    }
}

/// From this many tokens [`rows_many`] (an f32 panel dequantized once) beats the streaming
/// [`rows`]. Below it, from 3 tokens, [`rows`] dequantizes one row's block once for all of
/// them ([`STREAM_TOKENS`]). Max GMAC/s of six alternated `--kernels` rounds, panel against
/// streaming, the four layer matrices (an AVX2 Zen 3 EPYC): 15.4-19.1 against 24.4-25.7 at
/// 3 tokens, 19.6-22.4 against 27.9-29.0 at 4, 20.4-22.0 against 24.2-24.5 at 5. At 2
/// tokens, streaming 19.7 against panel 15.0. From 6 the panel wins, also against [`stream`]
/// (one register dequantized at a time): 26.1-28.3 against 21.4-23.8 at 6 and 7, and
/// [`stream`] at 8 tokens (16 accumulators) spills, 16-19.
pub const MANY_FROM: usize = 6;
/// Tokens per tile in [`rows`] from 3 tokens: one row at a time ([`stream`]), up to 5
/// tokens' 10 accumulators beside the one dequantized register, the scale, offset and mask
/// (the tokens are read from memory by the multiply-adds). Two rows of two tokens, as at 1
/// and 2 tokens, dequantize each row once per pair of tokens.
const STREAM_TOKENS: usize = 5;

/// Rows dequantized at a time by [`rows_many`]: 15 rows (5 tiles) of up to 1,536 f32 (90 KiB)
/// stay in L2 while every token passes over them.
const PANEL_ROWS: usize = 15;
/// Rows and tokens per register tile in [`rows_many`]. A tile runs over one half of the
/// lanes at a time ([`half_pass`]), so 3 rows x 4 tokens is 12 accumulators, and 3 weight
/// registers and a token's fill the 16 (4 x 3 needs a 17th: the compiler spilled an
/// accumulator every step). The tile it replaced, 2 rows x 3 tokens with both halves at
/// once, loaded 10 registers per 12 fused multiply-adds where this loads 7, and ran at
/// 29-32 GMAC/s from L1 against this one's 37-39 (a C model of both loops, best of 7, on a
/// Zen 3 core with a 47 GMAC/s FMA peak).
const ROWS_MANY: usize = 3;
/// See [`ROWS_MANY`].
const TOKENS_MANY: usize = 4;
/// The activations [`rows_many`] sweeps at once, at most (bytes): half of a 512 KiB L2 (Zen
/// 3's), so they stay there while every panel passes over them, each block of tokens
/// dequantizing the weights again (as the AVX-512 kernel's `X_BLOCK_BYTES`).
const X_BLOCK_BYTES: usize = 256 << 10;

/// One tile: `out[j * out_stride + i] = dot(row i, token j)`.
///
/// # Safety
/// Each `rows[i]` points at `blocks * B::BYTES` readable bytes, each `xs[j]` at `blocks * 32`
/// readable f32, `out` has room for every written index; AVX2 and FMA are available.
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
        // (lanes 0-7, lanes 8-15) per (row, token).
        let mut acc = [[(_mm256_setzero_ps(), _mm256_setzero_ps()); T]; R];
        for b in 0..blocks {
            let mut x = [[_mm256_setzero_ps(); 4]; T];
            for j in 0..T {
                for c in 0..4 {
                    x[j][c] = _mm256_loadu_ps(xs[j].add(b * 32 + 8 * c));
                }
            }
            for i in 0..R {
                // Weights stream from memory once per token at decode: fetch the same block
                // of the rows `ahead` bytes on while this one computes, into L2 only
                // ([`super::PREFETCH_AHEAD`] says why; a prefetch past the end of the matrix
                // never faults).
                _mm_prefetch::<_MM_HINT_T1>(rows[i].wrapping_add(ahead + b * B::BYTES).cast());
                let w = B::load(rows[i].add(b * B::BYTES));
                for j in 0..T {
                    let (lo, hi) = &mut acc[i][j];
                    *lo = _mm256_fmadd_ps(w[0], x[j][0], *lo);
                    *hi = _mm256_fmadd_ps(w[1], x[j][1], *hi);
                    *lo = _mm256_fmadd_ps(w[2], x[j][2], *lo);
                    *hi = _mm256_fmadd_ps(w[3], x[j][3], *hi);
                }
            }
        }
        for i in 0..R {
            for j in 0..T {
                *out.add(j * out_stride + i) = hsum(acc[i][j].0, acc[i][j].1);
            }
        }
    }
}

/// One row's tile over `T` tokens (3 to [`STREAM_TOKENS`]): `out[j * out_stride] = dot(row,
/// token j)`. Each of the block's four registers is dequantized just before its multiply-adds
/// ([`Block::quarter`]), so only one is live: [`tile`] with one row keeps all four, and at 5
/// tokens its 10 accumulators, 4 weights, scale, offset and mask want 17 registers (the
/// compiler spilled). Each accumulator takes the same products in the same order as in
/// [`tile`] (lanes 0-7: weights 0-7 then 16-23; lanes 8-15: 8-15 then 24-31), so the bits
/// are the same. Five alternated rounds on the Zen 3 EPYC, median GMAC/s of the four layer
/// matrices at 5 tokens: 24.4-24.8 with [`tile`], 30.2-32.1 with this (batch-5 decode,
/// `--decode-profile` at ctx 460: median 141.9 -> 162.0 tok/s); 3 and 4 tokens unchanged.
///
/// # Safety
/// As [`tile`] with one row.
#[inline(always)]
unsafe fn stream<B: Block, const T: usize>(
    row: *const u8,
    xs: [*const f32; T],
    blocks: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let ahead = super::PREFETCH_AHEAD * blocks * B::BYTES;
    #[inline(always)]
    unsafe fn quarter<B: Block, const C: usize, const T: usize>(
        p: *const u8,
        xs: &[*const f32; T],
        at: usize,
        acc: &mut [__m256; T],
    ) {
        // SAFETY: per `stream`'s contract (`at + 8 * C + 8 <= blocks * 32`).
        unsafe {
            let w = B::quarter::<C>(p);
            for j in 0..T {
                acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xs[j].add(at + 8 * C)), acc[j]);
            }
        }
    }
    // SAFETY: per the function contract.
    unsafe {
        let mut lo = [_mm256_setzero_ps(); T];
        let mut hi = [_mm256_setzero_ps(); T];
        for b in 0..blocks {
            // As in `tile`: the row's block `ahead` bytes on, into L2 only.
            _mm_prefetch::<_MM_HINT_T1>(row.wrapping_add(ahead + b * B::BYTES).cast());
            let p = row.add(b * B::BYTES);
            quarter::<B, 0, T>(p, &xs, b * 32, &mut lo);
            quarter::<B, 1, T>(p, &xs, b * 32, &mut hi);
            quarter::<B, 2, T>(p, &xs, b * 32, &mut lo);
            quarter::<B, 3, T>(p, &xs, b * 32, &mut hi);
        }
        for j in 0..T {
            *out.add(j * out_stride) = hsum(lo[j], hi[j]);
        }
    }
}

/// Rows per tile in [`rows`] for a single token. Four rows' dequantized blocks, their eight
/// accumulators and the token's four registers left nothing for the scale, offset and mask:
/// the compiler spilled the weights to the stack and reloaded them (14.2 against 11.9
/// GMAC/s for two rows against four, `--kernels`, on an AVX2 EPYC).
const ROWS_ONE_TOKEN: usize = 2;

/// Rows `first..first + n` of `W · xᵀ` for `tokens` tokens of `cols` (a multiple of 32).
/// Writes `out[t * out_stride + (r - first)]`.
///
/// # Safety
/// `w` holds at least `(first + n)` rows of `cols / 32` blocks of `B`; `x` holds
/// `tokens * cols` f32; `out` may be written at `t * out_stride + i` for `t < tokens`,
/// `i < n` (`out_stride >= n`), and nothing else reads or writes those elements during the
/// call (the pieces of a split product write one output's disjoint rows at once); AVX2 and
/// FMA are available.
#[target_feature(enable = "avx2,fma")]
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
    let (base, xb, ob) = (w.as_ptr(), x.as_ptr(), out);
    // SAFETY: every pointer below stays inside `w`, `x` and `out` per the contract.
    unsafe {
        let row = |r: usize| base.add((first + r) * rb);
        let tok = |t: usize| xb.add(t * cols);
        let (most_rows, most_tokens) = match tokens {
            1 | 2 => (ROWS_ONE_TOKEN, 2),
            _ => (1, STREAM_TOKENS),
        };
        let mut r = 0;
        while r < n {
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
                macro_rules! stream {
                    ($T:literal) => {
                        stream::<B, $T>(
                            row(r),
                            std::array::from_fn(|j| tok(t + j)),
                            blocks,
                            o,
                            out_stride,
                        )
                    };
                }
                match (tile_rows, group) {
                    (2, 2) => go!(2, 2),
                    (2, 1) => go!(2, 1),
                    (1, 5) => stream!(5),
                    (1, 4) => stream!(4),
                    (1, 3) => stream!(3),
                    (1, 2) => go!(1, 2),
                    _ => go!(1, 1),
                }
                t += group;
            }
            r += tile_rows;
        }
    }
}

/// `row` (a multiple of 16 long) with its lanes 0-7 of every 16 elements first, then its
/// lanes 8-15, so that each half of a tile's sums reads contiguous memory.
fn split_halves(row: &[f32], out: &mut [f32]) {
    let half = row.len() / 2;
    for (s, chunk) in row.chunks_exact(16).enumerate() {
        out[8 * s..8 * s + 8].copy_from_slice(&chunk[..8]);
        out[half + 8 * s..half + 8 * s + 8].copy_from_slice(&chunk[8..]);
    }
}

/// One half of a tile over f32 weights and tokens split into halves ([`split_halves`]): the
/// accumulators of lanes 0-7 (`ws` and `xs` at the rows' and tokens' first halves) or of
/// lanes 8-15 (at their second halves). Each lane's sum is its fused multiply-adds in
/// increasing `k`, as [`tile`]'s, whether the other half runs beside it or after it.
///
/// # Safety
/// Each `ws[i]` and `xs[j]` holds `8 * steps` f32; AVX2 and FMA are available.
#[inline(always)]
unsafe fn half_pass<const R: usize, const T: usize>(
    ws: [*const f32; R],
    xs: [*const f32; T],
    steps: usize,
) -> [[__m256; T]; R] {
    // SAFETY: per the function contract.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        for s in 0..steps {
            let w: [__m256; R] = std::array::from_fn(|i| _mm256_loadu_ps(ws[i].add(8 * s)));
            for j in 0..T {
                let x = _mm256_loadu_ps(xs[j].add(8 * s));
                for i in 0..R {
                    acc[i][j] = _mm256_fmadd_ps(w[i], x, acc[i][j]);
                }
            }
        }
        acc
    }
}

/// A tile over f32 weights already dequantized into the panel (`R` rows, `ws[i]`, of
/// `cols`) and tokens (`xs[j]`), both split into halves ([`split_halves`]): the same
/// operations in the same order as [`tile`], one half of the lanes after the other; then the
/// fixed tree. So the bits match.
///
/// # Safety
/// Each `ws[i]` holds `cols` f32, each `xs[j]` `cols` f32, `out` every written index; AVX2
/// and FMA are available.
#[inline(always)]
unsafe fn tile_f32<const R: usize, const T: usize>(
    ws: [*const f32; R],
    xs: [*const f32; T],
    cols: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let steps = cols / 16;
    // SAFETY: per the function contract; the second halves start `cols / 2` in.
    unsafe {
        let lo = half_pass::<R, T>(ws, xs, steps);
        let half = |p: *const f32| p.add(cols / 2);
        let hi = half_pass::<R, T>(ws.map(half), xs.map(half), steps);
        for i in 0..R {
            for j in 0..T {
                *out.add(j * out_stride + i) = hsum(lo[i][j], hi[i][j]);
            }
        }
    }
}

/// Like [`rows`], for many tokens: [`PANEL_ROWS`] rows at a time are dequantized once into an
/// f32 panel (L2-sized), then every token of a block ([`X_BLOCK_BYTES`]) passes over it,
/// [`TOKENS_MANY`] tokens by [`ROWS_MANY`] rows in registers. Dequantizing once per panel
/// instead of once per pair of tokens is what lets a decode batch run near the FMA peak.
/// Same bits as [`rows`].
///
/// # Safety
/// As for [`rows`].
#[target_feature(enable = "avx2,fma")]
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
    let per = tokens_per_block(cols);
    // On a cache line, so that no 8-lane load straddles two (`super::lines`).
    let mut split = Lines::zeros(per.min(tokens) * cols);
    let mut t0 = 0;
    while t0 < tokens {
        let nt = per.min(tokens - t0);
        // The block's tokens split as the panel's rows are (a copy of `nt * cols` f32
        // against `n * nt * cols` multiply-adds), each block just before its sweep, so that
        // it is still in L2 there.
        let split = &mut split[..nt * cols];
        split_tokens_into(&x[t0 * cols..(t0 + nt) * cols], cols, split);
        // SAFETY: the block's outputs are inside the caller's; the rest is the caller's
        // contract, `split` the block's tokens split.
        unsafe {
            rows_many_split::<B>(
                w,
                cols,
                first,
                n,
                split,
                nt,
                out.add(t0 * out_stride),
                out_stride,
            )
        };
        t0 += nt;
    }
}

thread_local! {
    /// This thread's panel ([`PANEL_ROWS`] rows), kept from call to call: every panel row a
    /// tile reads was dequantized into it just before, so it needs no zeroing, and a piece of
    /// a product split by row (a K or V piece of 24 rows is ~15 us at batch 32) had zeroed a
    /// fresh one each time.
    static PANEL: RefCell<Lines> = RefCell::new(Lines::default());
}

/// `f` on this thread's panel for rows of `cols` (see [`PANEL`]).
fn with_panel<R>(cols: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    PANEL.with(|panel| {
        let mut panel = panel.borrow_mut();
        let len = PANEL_ROWS * cols;
        if panel.len() < len {
            // On a cache line, so that no 8-lane load straddles two (`super::lines`); each
            // row starts on one too (`cols` is a multiple of 32).
            *panel = Lines::zeros(len);
        }
        f(&mut panel[..len])
    })
}

/// Tokens per block of [`rows_many`]: their activations stay in L2 while every panel passes
/// over them.
fn tokens_per_block(cols: usize) -> usize {
    (X_BLOCK_BYTES / (cols * 4).max(1)).max(TOKENS_MANY)
}

/// Each token of `x` (rows of `cols`) split into halves ([`split_halves`]) into `split`.
fn split_tokens_into(x: &[f32], cols: usize, split: &mut [f32]) {
    for (t, s) in x.chunks_exact(cols).zip(split.chunks_exact_mut(cols)) {
        split_halves(t, s);
    }
}

/// `x` (`tokens` rows of `cols`) as [`rows_many_split`] reads it: each token split into
/// halves. A product split by row into pieces splits its tokens once with this and gives
/// every piece the same copy; each piece's own [`rows_many`] had zeroed and filled one per
/// piece (eight per matrix on two threads at batch 32, 24 for a layer's Q, K and V).
pub fn split_tokens(x: &[f32], cols: usize) -> Lines {
    let mut split = Lines::zeros(x.len());
    split_tokens_into(x, cols, &mut split);
    split
}

/// [`rows_many`] over tokens already split ([`split_tokens`]). Same bits.
///
/// # Safety
/// As for [`rows`], with `split` (from [`split_tokens`]) for `x`.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn rows_many_split<B: Block>(
    w: &[u8],
    cols: usize,
    first: usize,
    n: usize,
    split: &[f32],
    tokens: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let per = tokens_per_block(cols);
    let mut t0 = 0;
    while t0 < tokens {
        let nt = per.min(tokens - t0);
        // SAFETY: the block's outputs are inside the caller's, its slice of `split` holds its
        // `nt` tokens split; the rest is the caller's contract.
        with_panel(cols, |panel| unsafe {
            sweep_block::<B>(
                w,
                cols,
                first,
                n,
                &split[t0 * cols..(t0 + nt) * cols],
                nt,
                panel,
                out.add(t0 * out_stride),
                out_stride,
            )
        });
        t0 += nt;
    }
}

/// [`rows_many`] for one block of tokens, already split into halves (`split`, `tokens` of
/// them), through `panel` ([`PANEL_ROWS`] rows of `cols`).
///
/// # Safety
/// As for [`rows`], `split` for `x`.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn sweep_block<B: Block>(
    w: &[u8],
    cols: usize,
    first: usize,
    n: usize,
    split: &[f32],
    tokens: usize,
    panel: &mut [f32],
    out: *mut f32,
    out_stride: usize,
) {
    let blocks = cols / 32;
    let rb = blocks * B::BYTES;
    let (base, xb, ob, pp) = (w.as_ptr(), split.as_ptr(), out, panel.as_mut_ptr());
    // SAFETY: every pointer below stays inside `w`, `split`, `out` and `panel` per the
    // contract.
    unsafe {
        let tok = |t: usize| xb.add(t * cols);
        let mut r = 0;
        while r < n {
            let panel_rows = (n - r).min(PANEL_ROWS);
            for i in 0..panel_rows {
                let row = base.add((first + r + i) * rb);
                // Weights 0-7 and 16-23 of each block go to the row's first half, 8-15
                // and 24-31 to its second, as `tile_f32` reads them.
                let (lo, hi) = (pp.add(i * cols), pp.add(i * cols + cols / 2));
                for b in 0..blocks {
                    let q = B::load(row.add(b * B::BYTES));
                    _mm256_storeu_ps(lo.add(b * 16), q[0]);
                    _mm256_storeu_ps(hi.add(b * 16), q[1]);
                    _mm256_storeu_ps(lo.add(b * 16 + 8), q[2]);
                    _mm256_storeu_ps(hi.add(b * 16 + 8), q[3]);
                }
            }
            // The tokens in groups as even as [`TOKENS_MANY`] allows (6 as 3 + 3, not 4 + 2:
            // a 2-token tile's 6 accumulators leave the FMA latency exposed).
            let (mut t, mut groups) = (0, tokens.div_ceil(TOKENS_MANY));
            while t < tokens {
                let group = (tokens - t).div_ceil(groups);
                groups -= 1;
                let mut i = 0;
                while i < panel_rows {
                    let tile_rows = (panel_rows - i).min(ROWS_MANY);
                    let o = ob.add(t * out_stride + r + i);
                    macro_rules! go {
                        ($R:literal, $T:literal) => {
                            tile_f32::<$R, $T>(
                                std::array::from_fn(|a| pp.add((i + a) * cols).cast_const()),
                                std::array::from_fn(|j| tok(t + j)),
                                cols,
                                o,
                                out_stride,
                            )
                        };
                    }
                    match (tile_rows, group) {
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
                    i += tile_rows;
                }
                t += group;
            }
            r += panel_rows;
        }
    }
}

//! AVX2 tiles of the quantized matrix product: the AVX-512 kernel's operations on 8-lane
//! registers.
//!
//! The 16 lanes of a dot product (see [`super`]) are two 8-lane registers: lanes 0-7 and 8-15.
//! For each block of 32 weights, lane `l` takes weight `l` then `16 + l`, each a fused
//! multiply-add, in block order; the weights are dequantized exactly as the portable kernel
//! does (`d * q + m` fused for Q4_1, `q * d` for Q8_0). The horizontal sum is the same fixed
//! tree. So a result's bits equal the portable and AVX-512 kernels' (the matmul tests compare
//! them), whatever the tile shape.

use std::arch::x86_64::*;

use super::exp;

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

/// The weights of one block of one row as four 8-lane registers: weights 0-7, 8-15, 16-23,
/// 24-31.
pub trait Block {
    /// Bytes per block.
    const BYTES: usize;
    /// Dequantizes the block at `p`.
    ///
    /// # Safety
    /// `p` must point at `BYTES` readable bytes; AVX2 and FMA must be available.
    unsafe fn load(p: *const u8) -> [__m256; 4];
}

/// Q4_1 with `d` and `m` widened to f32 (24-byte blocks): byte `j` holds weight `j` (low
/// nibble) and weight `16 + j` (high nibble).
pub struct Q4_1Wide;

impl Block for Q4_1Wide {
    const BYTES: usize = 24;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> [__m256; 4] {
        // SAFETY: per the trait contract (the block is 24 readable bytes).
        unsafe {
            let d = _mm256_set1_ps(p.cast::<f32>().read_unaligned());
            let m = _mm256_set1_ps(p.add(4).cast::<f32>().read_unaligned());
            let q0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(8).cast()));
            let q1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(16).cast()));
            let low = _mm256_set1_epi32(0x0F);
            // No closures here: a closure is compiled without the caller's target features,
            // and the intrinsics inside it stay calls (the debug build showed it).
            let w0 = _mm256_cvtepi32_ps(_mm256_and_si256(q0, low));
            let w1 = _mm256_cvtepi32_ps(_mm256_and_si256(q1, low));
            let w2 = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(q0));
            let w3 = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(q1));
            [
                _mm256_fmadd_ps(w0, d, m),
                _mm256_fmadd_ps(w1, d, m),
                _mm256_fmadd_ps(w2, d, m),
                _mm256_fmadd_ps(w3, d, m),
            ]
        }
    }
}

/// Q8_0 with `d` widened to f32 (36-byte blocks).
pub struct Q8_0Wide;

impl Block for Q8_0Wide {
    const BYTES: usize = 36;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> [__m256; 4] {
        // SAFETY: per the trait contract (the block is 36 readable bytes).
        unsafe {
            let d = _mm256_set1_ps(p.cast::<f32>().read_unaligned());
            let q0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(4).cast()));
            let q1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(12).cast()));
            let q2 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(20).cast()));
            let q3 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(28).cast()));
            [
                _mm256_mul_ps(_mm256_cvtepi32_ps(q0), d),
                _mm256_mul_ps(_mm256_cvtepi32_ps(q1), d),
                _mm256_mul_ps(_mm256_cvtepi32_ps(q2), d),
                _mm256_mul_ps(_mm256_cvtepi32_ps(q3), d),
            ]
        }
    }
}

/// From this many tokens [`rows_many`] (an f32 panel dequantized once) beats the streaming
/// [`rows`]: streaming against panel, 19.7 and 15.0 GMAC/s at 2 tokens, 17.5 and 19.8 at 3,
/// 19.7 and 25.9 at 6 (`--kernels`, an AVX2 EPYC).
pub const MANY_FROM: usize = 3;

/// Rows dequantized at a time by [`rows_many`]: 16 rows of up to 1,536 f32 (96 KiB) stay in
/// L2 while every token passes over them.
const PANEL_ROWS: usize = 16;
/// Tokens per register tile in [`rows_many`]: 2 rows x 3 tokens x 2 halves is 12
/// accumulators, plus the 2 weight registers, of the 16.
const TOKENS_MANY: usize = 3;

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
    ahead: usize,
    out: *mut f32,
    out_stride: usize,
) {
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
                // of the rows `ahead` bytes on (4 rows: the next tiles') while this one
                // computes (8 and 16 rows measured no faster; a prefetch past the end of the
                // matrix never faults).
                _mm_prefetch::<_MM_HINT_T0>(rows[i].wrapping_add(ahead + b * B::BYTES).cast());
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
/// `tokens * cols` f32; `out` holds `tokens * out_stride` f32 with `out_stride >= n`; AVX2
/// and FMA are available.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn rows<B: Block>(
    w: &[u8],
    cols: usize,
    first: usize,
    n: usize,
    x: &[f32],
    tokens: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let blocks = cols / 32;
    let rb = blocks * B::BYTES;
    let (base, xb, ob) = (w.as_ptr(), x.as_ptr(), out.as_mut_ptr());
    // SAFETY: every pointer below stays inside `w`, `x` and `out` per the contract.
    unsafe {
        let row = |r: usize| base.add((first + r) * rb);
        let tok = |t: usize| xb.add(t * cols);
        let mut r = 0;
        while r < n {
            let tile_rows = (n - r).min(ROWS_ONE_TOKEN);
            let mut t = 0;
            while t < tokens {
                let group = (tokens - t).min(2);
                let o = ob.add(t * out_stride + r);
                macro_rules! go {
                    ($R:literal, $T:literal) => {
                        tile::<B, $R, $T>(
                            std::array::from_fn(|i| row(r + i)),
                            std::array::from_fn(|j| tok(t + j)),
                            blocks,
                            4 * rb,
                            o,
                            out_stride,
                        )
                    };
                }
                match (tile_rows, group) {
                    (4, 2) => go!(4, 2),
                    (4, 1) => go!(4, 1),
                    (3, 2) => go!(3, 2),
                    (3, 1) => go!(3, 1),
                    (2, 2) => go!(2, 2),
                    (2, 1) => go!(2, 1),
                    (1, 2) => go!(1, 2),
                    _ => go!(1, 1),
                }
                t += group;
            }
            r += tile_rows;
        }
    }
}

/// A tile over f32 weights already dequantized (`R` rows, `ws[i]`, of `cols`), the same
/// operations in the same order as [`tile`]: per 16 weights, lanes 0-7 then 8-15, one fused
/// multiply-add each, in increasing `k`; then the fixed tree. So the bits match.
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
    // SAFETY: per the function contract.
    unsafe {
        let mut lo = [[_mm256_setzero_ps(); T]; R];
        let mut hi = [[_mm256_setzero_ps(); T]; R];
        let mut k = 0;
        while k < cols {
            let wl: [__m256; R] = std::array::from_fn(|i| _mm256_loadu_ps(ws[i].add(k)));
            for j in 0..T {
                let x = _mm256_loadu_ps(xs[j].add(k));
                for i in 0..R {
                    lo[i][j] = _mm256_fmadd_ps(wl[i], x, lo[i][j]);
                }
            }
            let wh: [__m256; R] = std::array::from_fn(|i| _mm256_loadu_ps(ws[i].add(k + 8)));
            for j in 0..T {
                let x = _mm256_loadu_ps(xs[j].add(k + 8));
                for i in 0..R {
                    hi[i][j] = _mm256_fmadd_ps(wh[i], x, hi[i][j]);
                }
            }
            k += 16;
        }
        for i in 0..R {
            for j in 0..T {
                *out.add(j * out_stride + i) = hsum(lo[i][j], hi[i][j]);
            }
        }
    }
}

/// Like [`rows`], for many tokens: [`PANEL_ROWS`] rows at a time are dequantized once into an
/// f32 panel (L2-sized), then every token passes over it, [`TOKENS_MANY`] tokens by 2 rows in
/// registers. Dequantizing once per panel instead of once per pair of tokens is what lets
/// a decode batch run near the FMA peak. Same bits as [`rows`].
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
    out: &mut [f32],
    out_stride: usize,
) {
    let blocks = cols / 32;
    let rb = blocks * B::BYTES;
    let mut panel = vec![0f32; PANEL_ROWS * cols];
    let (base, xb, ob, pp) = (w.as_ptr(), x.as_ptr(), out.as_mut_ptr(), panel.as_mut_ptr());
    // SAFETY: every pointer below stays inside `w`, `x`, `out` and `panel` per the contract.
    unsafe {
        let tok = |t: usize| xb.add(t * cols);
        let mut r = 0;
        while r < n {
            let panel_rows = (n - r).min(PANEL_ROWS);
            for i in 0..panel_rows {
                let row = base.add((first + r + i) * rb);
                for b in 0..blocks {
                    let q = B::load(row.add(b * B::BYTES));
                    for (c, v) in q.iter().enumerate() {
                        _mm256_storeu_ps(pp.add(i * cols + b * 32 + 8 * c), *v);
                    }
                }
            }
            let mut t = 0;
            while t < tokens {
                let group = (tokens - t).min(TOKENS_MANY);
                let mut i = 0;
                while i < panel_rows {
                    let pair = (panel_rows - i).min(2);
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
                    match (pair, group) {
                        (2, 3) => go!(2, 3),
                        (2, 2) => go!(2, 2),
                        (2, 1) => go!(2, 1),
                        (1, 3) => go!(1, 3),
                        (1, 2) => go!(1, 2),
                        _ => go!(1, 1),
                    }
                    i += pair;
                }
                t += group;
            }
            r += panel_rows;
        }
    }
}

/// A KV element type the AVX2 attention reads, 8 at a time as f32.
pub trait KvElem: Copy {
    /// Loads 8 elements as f32.
    ///
    /// # Safety
    /// `p` points at 8 readable elements; AVX2 and F16C are available.
    unsafe fn load8(p: *const Self) -> __m256;
}

impl KvElem for half::f16 {
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: per the trait contract.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

impl KvElem for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: per the trait contract.
        unsafe { _mm256_loadu_ps(p) }
    }
}

/// Attention of one token (the query heads of `kv_heads`) over positions `0..=pos`: the
/// portable kernel's operations in its order (each score a 16-lane dot, lanes 0-7 and 8-15
/// in two registers, then the fixed tree; softmax in position order; V accumulated by one
/// fused multiply-add per element in position order).
///
/// Query heads go in blocks of up to [`HEADS`] that share each K and V chunk: a chunk is
/// widened from f16 once per block, and the block's accumulators stay in registers across
/// positions (the first version widened a row into a stack buffer and kept V's sums in
/// memory; its stores and reloads, not the KV reads, bounded it at ~190 cycles per position
/// and KV head, even with the KV in L2).
///
/// `blocks(page_index, v)` gives the K (`v = false`) or V block of the sequence's page.
///
/// # Safety
/// `head_dim` is a multiple of 16 and at most 256; every block holds `page_size * kv_dim`
/// elements; `q` holds `n_heads * head_dim` and `out` the heads of `kv_heads`; AVX2, FMA and
/// F16C are available.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn attend<E: KvElem>(
    blocks: &dyn Fn(usize, bool) -> *const E,
    page_size: usize,
    kv_dim: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    kv_heads: std::ops::Range<usize>,
    q: &[f32],
    pos: usize,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let group = n_heads / n_kv_heads;
    let base = kv_heads.start * group;
    let len = pos + 1;
    scores.resize(group * len, 0.0);
    let seq = Seq {
        blocks,
        page_size,
        kv_dim,
        head_dim,
        len,
    };
    // SAFETY: pointers stay inside the blocks, `q`, `scores` and `out` per the contract.
    unsafe {
        let s0 = scores.as_mut_ptr();
        for g in kv_heads {
            let at = g * head_dim;
            let q0 = q.as_ptr().add(g * group * head_dim);
            let o0 = out.as_mut_ptr().add((g * group - base) * head_dim);
            let mut h = 0;
            while h < group {
                let n = HEADS.min(group - h);
                let (qh, sh) = (q0.add(h * head_dim), s0.add(h * len));
                match n {
                    1 => seq.scores::<1>(at, qh, sh),
                    2 => seq.scores::<2>(at, qh, sh),
                    3 => seq.scores::<3>(at, qh, sh),
                    _ => seq.scores::<4>(at, qh, sh),
                }
                h += n;
            }
            let mut inv = [0f32; 64];
            for (hi, inv) in inv.iter_mut().take(group).enumerate() {
                *inv =
                    1.0 / softmax_numerators(std::slice::from_raw_parts_mut(s0.add(hi * len), len));
            }
            let mut h = 0;
            while h < group {
                let n = HEADS.min(group - h);
                let (sh, oh, ih) = (s0.add(h * len), o0.add(h * head_dim), inv.as_ptr().add(h));
                match n {
                    1 => seq.values::<1>(at, sh, ih, oh),
                    2 => seq.values::<2>(at, sh, ih, oh),
                    3 => seq.values::<3>(at, sh, ih, oh),
                    _ => seq.values::<4>(at, sh, ih, oh),
                }
                h += n;
            }
        }
    }
}

/// `s[j] = exp(s[j] - max)`, eight at a time, and their sum in position order (the portable
/// kernel's operations: `exp::exp`'s on every lane).
#[inline(always)]
unsafe fn softmax_numerators(s: &mut [f32]) -> f32 {
    let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let n = s.len() / 8 * 8;
    // SAFETY: `j + 8 <= n <= s.len()`; AVX2 and FMA are enabled by the caller.
    unsafe {
        let m = _mm256_set1_ps(max);
        let p = s.as_mut_ptr();
        let mut j = 0;
        while j < n {
            _mm256_storeu_ps(p.add(j), exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(j)), m)));
            j += 8;
        }
    }
    for v in &mut s[n..] {
        *v = exp::exp(*v - max);
    }
    s.iter().fold(0.0, |sum, v| sum + v)
}

/// [`exp::exp`] on 8 lanes: the same operations in the same order, so the same bits.
#[inline(always)]
pub(super) unsafe fn exp8(x: __m256) -> __m256 {
    // SAFETY: register-only operations; AVX2 and FMA are enabled by the callers.
    unsafe {
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(exp::LOG2E)),
        );
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-exp::LN2_HI), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-exp::LN2_LO), r);
        let mut p = _mm256_set1_ps(exp::P[0]);
        for c in &exp::P[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
        }
        let r2 = _mm256_mul_ps(r, r);
        let y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
        let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        let e = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
        // Below MIN_ARG (and NaN): 0; above MAX_ARG: +inf; there `n` was out of the
        // exponent's range.
        let e = _mm256_and_ps(
            e,
            _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(exp::MIN_ARG)),
        );
        _mm256_blendv_ps(
            e,
            _mm256_set1_ps(f32::INFINITY),
            _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(exp::MAX_ARG)),
        )
    }
}

/// `gate = silu(gate) * up`, eight at a time: `ops::silu_mul`'s operations on every lane
/// (`exp8` for its `exp::exp`), so its bits.
///
/// # Safety
/// AVX2 and FMA are available.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
    let n = gate.len().min(up.len()) / 8 * 8;
    // SAFETY: `j + 8 <= n` is within both slices.
    unsafe {
        let (g, u) = (gate.as_mut_ptr(), up.as_ptr());
        let one = _mm256_set1_ps(1.0);
        let sign = _mm256_set1_ps(-0.0);
        let mut j = 0;
        while j < n {
            let x = _mm256_loadu_ps(g.add(j));
            let e = exp8(_mm256_xor_ps(x, sign));
            let silu = _mm256_div_ps(x, _mm256_add_ps(one, e));
            _mm256_storeu_ps(g.add(j), _mm256_mul_ps(silu, _mm256_loadu_ps(u.add(j))));
            j += 8;
        }
    }
    super::ops::silu_mul_scalar(&mut gate[n..], &up[n..]);
}

/// Query heads that share one pass over K or V: 4 heads' two accumulators, two widened KV
/// chunks and the broadcast weights fit AVX2's 16 registers.
const HEADS: usize = 4;

/// One sequence's KV as the attention reads it: `len` positions in pages of `page_size`.
struct Seq<'a, E> {
    blocks: &'a dyn Fn(usize, bool) -> *const E,
    page_size: usize,
    kv_dim: usize,
    head_dim: usize,
    len: usize,
}

impl<E: KvElem> Seq<'_, E> {
    /// Calls `f(j, row)` for every position `j` in order, `row` pointing at the K (`v =
    /// false`) or V row of the head whose first element is `at`.
    #[inline(always)]
    unsafe fn rows(&self, v: bool, at: usize, mut f: impl FnMut(usize, *const E)) {
        let mut j = 0;
        while j < self.len {
            let page = j / self.page_size;
            let end = self.len.min((page + 1) * self.page_size);
            // SAFETY (of the offsets): every slot of a block is in it (the caller's contract).
            let mut row = unsafe { (self.blocks)(page, v).add(at) };
            while j < end {
                f(j, row);
                row = row.wrapping_add(self.kv_dim);
                j += 1;
            }
        }
    }

    /// `s[h * len + j]` = the scaled score of query head `h` (at `q + h * head_dim`) for
    /// every position `j`: a 16-lane dot and the fixed tree, as `attention::attend_kernel`.
    #[inline(always)]
    unsafe fn scores<const H: usize>(&self, at: usize, q: *const f32, s: *mut f32) {
        let (head_dim, len) = (self.head_dim, self.len);
        let scale = 1.0 / (head_dim as f32).sqrt();
        // SAFETY: rows hold `head_dim` elements; `q` holds H heads and `s` H rows of `len`.
        unsafe {
            self.rows(false, at, |j, k| {
                let mut lo = [_mm256_setzero_ps(); H];
                let mut hi = [_mm256_setzero_ps(); H];
                let mut c = 0;
                while c < head_dim {
                    let (kl, kh) = (E::load8(k.add(c)), E::load8(k.add(c + 8)));
                    for h in 0..H {
                        let qh = q.add(h * head_dim + c);
                        lo[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qh), kl, lo[h]);
                        hi[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qh.add(8)), kh, hi[h]);
                    }
                    c += 16;
                }
                for h in 0..H {
                    *s.add(h * len + j) = hsum(lo[h], hi[h]) * scale;
                }
            });
        }
    }

    /// `o[h * head_dim..]` = `inv[h]` times the sum over positions of `p[h * len + j]` times
    /// V's row `j`, 16 elements at a time, each element one fused multiply-add per position
    /// in position order (as `attention::attend_kernel`).
    #[inline(always)]
    unsafe fn values<const H: usize>(
        &self,
        at: usize,
        p: *const f32,
        inv: *const f32,
        o: *mut f32,
    ) {
        let (head_dim, len) = (self.head_dim, self.len);
        // SAFETY: rows hold `head_dim` elements; `p` holds H rows of `len`, `inv` H values,
        // `o` H heads.
        unsafe {
            let mut c = 0;
            while c < head_dim {
                let mut lo = [_mm256_setzero_ps(); H];
                let mut hi = [_mm256_setzero_ps(); H];
                self.rows(true, at + c, |j, v| {
                    let (vl, vh) = (E::load8(v), E::load8(v.add(8)));
                    for h in 0..H {
                        let w = _mm256_broadcast_ss(&*p.add(h * len + j));
                        lo[h] = _mm256_fmadd_ps(w, vl, lo[h]);
                        hi[h] = _mm256_fmadd_ps(w, vh, hi[h]);
                    }
                });
                for h in 0..H {
                    let i = _mm256_set1_ps(*inv.add(h));
                    _mm256_storeu_ps(o.add(h * head_dim + c), _mm256_mul_ps(lo[h], i));
                    _mm256_storeu_ps(o.add(h * head_dim + c + 8), _mm256_mul_ps(hi[h], i));
                }
                c += 16;
            }
        }
    }
}

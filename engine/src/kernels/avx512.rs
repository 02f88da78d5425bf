//! AVX-512 tiles of the quantized matrix product.
//!
//! A tile is `R` weight rows × `T` tokens. For each block of 32 weights the tile's rows are
//! dequantized once into registers (`d * q + m` exactly, fused) and multiplied into one
//! 16-lane accumulator per (row, token): lane `l` takes weights `l` then `16 + l` of each
//! block, in block order. The horizontal sum is the same fixed tree as [`super::hsum`]. So the
//! bits of `(row, token)` depend on neither `R`, `T`, nor the other rows and tokens.

use std::arch::x86_64::*;

/// Reads a little-endian f16 at `p` as f32 (F16C).
#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees two readable bytes at `p`; F16C is enabled by the callers'
    // target features.
    unsafe {
        let bits = u16::from_le_bytes([*p, *p.add(1)]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
    }
}

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

/// The weights of one block of one row, as two 16-lane halves.
pub trait Block {
    /// Bytes per block.
    const BYTES: usize;
    /// Dequantizes the block at `p`.
    ///
    /// # Safety
    /// `p` must point at `BYTES` readable bytes; AVX-512F and F16C must be available.
    unsafe fn load(p: *const u8) -> (__m512, __m512);
}

/// GGML Q4_1: f16 d, f16 m, 16 bytes of nibbles (low nibbles are weights 0..16).
pub struct Q4_1;

impl Block for Q4_1 {
    const BYTES: usize = 20;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> (__m512, __m512) {
        // SAFETY: per the trait contract.
        unsafe {
            let d = _mm512_set1_ps(f16_at(p));
            let m = _mm512_set1_ps(f16_at(p.add(2)));
            let q = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(4).cast()));
            let lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0x0F)));
            let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(q));
            (_mm512_fmadd_ps(lo, d, m), _mm512_fmadd_ps(hi, d, m))
        }
    }
}

/// Q4_1 with `d` and `m` widened to f32 (24-byte blocks).
pub struct Q4_1Wide;

impl Block for Q4_1Wide {
    const BYTES: usize = 24;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> (__m512, __m512) {
        // SAFETY: per the trait contract (the block is 24 readable bytes).
        unsafe {
            let d = _mm512_set1_ps(p.cast::<f32>().read_unaligned());
            let m = _mm512_set1_ps(p.add(4).cast::<f32>().read_unaligned());
            let q = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(8).cast()));
            let lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0x0F)));
            let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(q));
            (_mm512_fmadd_ps(lo, d, m), _mm512_fmadd_ps(hi, d, m))
        }
    }
}

/// Q8_0 with `d` widened to f32 (36-byte blocks).
pub struct Q8_0Wide;

impl Block for Q8_0Wide {
    const BYTES: usize = 36;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> (__m512, __m512) {
        // SAFETY: per the trait contract (the block is 36 readable bytes).
        unsafe {
            let d = _mm512_set1_ps(p.cast::<f32>().read_unaligned());
            let lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(4).cast()));
            let hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(20).cast()));
            (
                _mm512_mul_ps(_mm512_cvtepi32_ps(lo), d),
                _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d),
            )
        }
    }
}

/// GGML Q8_0: f16 d, 32 signed bytes.
pub struct Q8_0;

impl Block for Q8_0 {
    const BYTES: usize = 34;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> (__m512, __m512) {
        // SAFETY: per the trait contract.
        unsafe {
            let d = _mm512_set1_ps(f16_at(p));
            let lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(2).cast()));
            let hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(18).cast()));
            (
                _mm512_mul_ps(_mm512_cvtepi32_ps(lo), d),
                _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d),
            )
        }
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
    // SAFETY: per the function contract.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        for b in 0..blocks {
            let mut w = [(_mm512_setzero_ps(), _mm512_setzero_ps()); R];
            for i in 0..R {
                w[i] = B::load(rows[i].add(b * B::BYTES));
            }
            for j in 0..T {
                let xl = _mm512_loadu_ps(xs[j].add(b * 32));
                let xh = _mm512_loadu_ps(xs[j].add(b * 32 + 16));
                for i in 0..R {
                    acc[i][j] = _mm512_fmadd_ps(w[i].0, xl, acc[i][j]);
                    acc[i][j] = _mm512_fmadd_ps(w[i].1, xh, acc[i][j]);
                }
            }
        }
        for i in 0..R {
            for j in 0..T {
                *out.add(j * out_stride + i) = hsum(acc[i][j]);
            }
        }
    }
}

/// A tile over f32 weights already dequantized into `wbuf` (`R` rows of `cols`): the same
/// accumulation sequence as [`tile`] (16-lane chunks in increasing `k`), so the bits match.
///
/// # Safety
/// `wbuf` holds `R * cols` f32, each `xs[j]` `cols` f32, `out` every written index; AVX-512F.
#[inline(always)]
unsafe fn tile_f32<const R: usize, const T: usize>(
    wbuf: *const f32,
    cols: usize,
    xs: [*const f32; T],
    out: *mut f32,
    out_stride: usize,
) {
    // SAFETY: per the function contract.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let mut k = 0;
        while k < cols {
            let w: [__m512; R] = std::array::from_fn(|i| _mm512_loadu_ps(wbuf.add(i * cols + k)));
            for j in 0..T {
                let x = _mm512_loadu_ps(xs[j].add(k));
                for i in 0..R {
                    acc[i][j] = _mm512_fmadd_ps(w[i], x, acc[i][j]);
                }
            }
            k += 16;
        }
        for i in 0..R {
            for j in 0..T {
                *out.add(j * out_stride + i) = hsum(acc[i][j]);
            }
        }
    }
}

/// Like [`rows`], for many tokens: each tile of 4 rows is dequantized once into an L1-sized
/// f32 buffer and then swept over the tokens six at a time. Same bits as [`rows`].
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
    out: &mut [f32],
    out_stride: usize,
) {
    let blocks = cols / 32;
    let rb = blocks * B::BYTES;
    let mut wbuf = vec![0f32; 4 * cols];
    let (base, xb, ob, wp) = (w.as_ptr(), x.as_ptr(), out.as_mut_ptr(), wbuf.as_mut_ptr());
    // SAFETY: every pointer below stays inside `w`, `x`, `out` and `wbuf` per the contract.
    unsafe {
        let tok = |t: usize| xb.add(t * cols);
        let mut r = 0;
        while r < n {
            let tile_rows = (n - r).min(4);
            for i in 0..tile_rows {
                let row = base.add((first + r + i) * rb);
                for b in 0..blocks {
                    let (lo, hi) = B::load(row.add(b * B::BYTES));
                    _mm512_storeu_ps(wp.add(i * cols + b * 32), lo);
                    _mm512_storeu_ps(wp.add(i * cols + b * 32 + 16), hi);
                }
            }
            let mut t = 0;
            while t < tokens {
                let group = (tokens - t).min(6);
                let o = ob.add(t * out_stride + r);
                macro_rules! go {
                    ($R:literal, $T:literal) => {
                        tile_f32::<$R, $T>(
                            wp,
                            cols,
                            std::array::from_fn(|j| tok(t + j)),
                            o,
                            out_stride,
                        )
                    };
                }
                match (tile_rows, group) {
                    (4, 6) => go!(4, 6),
                    (4, 5) => go!(4, 5),
                    (4, 4) => go!(4, 4),
                    (4, 3) => go!(4, 3),
                    (4, 2) => go!(4, 2),
                    (4, 1) => go!(4, 1),
                    (3, 6) => go!(3, 6),
                    (3, 5) => go!(3, 5),
                    (3, 4) => go!(3, 4),
                    (3, 3) => go!(3, 3),
                    (3, 2) => go!(3, 2),
                    (3, 1) => go!(3, 1),
                    (2, 6) => go!(2, 6),
                    (2, 5) => go!(2, 5),
                    (2, 4) => go!(2, 4),
                    (2, 3) => go!(2, 3),
                    (2, 2) => go!(2, 2),
                    (2, 1) => go!(2, 1),
                    (1, 6) => go!(1, 6),
                    (1, 5) => go!(1, 5),
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

/// Rows `first..first + n` of `W · xᵀ` for `tokens` tokens of `cols` (a multiple of 32).
/// Writes `out[t * out_stride + (r - first)]`.
///
/// # Safety
/// `w` holds at least `(first + n)` rows of `cols / 32` blocks of `B`; `x` holds
/// `tokens * cols` f32; `out` holds `tokens * out_stride` f32 with `out_stride >= n`; AVX-512F
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
    out: &mut [f32],
    out_stride: usize,
) {
    let blocks = cols / 32;
    let rb = blocks * B::BYTES;
    let base = w.as_ptr();
    let xb = x.as_ptr();
    let ob = out.as_mut_ptr();
    // SAFETY: every pointer below stays inside `w`, `x` and `out` per the contract.
    unsafe {
        let row = |r: usize| base.add((first + r) * rb);
        let tok = |t: usize| xb.add(t * cols);
        let mut r = 0;
        while r < n {
            let tile_rows = (n - r).min(4);
            let mut t = 0;
            while t < tokens {
                let group = (tokens - t).min(4);
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

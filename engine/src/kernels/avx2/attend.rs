//! The AVX2 attention and the element-wise kernels it shares its `exp` with (the softmax's
//! numerators, SiLU): the portable code's operations, eight lanes at a time, so its bits.

use std::arch::x86_64::*;

use super::hsum;
use crate::kernels::attention::sweep::{Seq, Tiles, sweep};
use crate::kernels::exp;

/// The AVX2 tiles of the shared sweep.
pub struct Avx2;

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
/// The walk over the pages is the shared `attention::sweep`; these are its register tiles.
/// Query heads go in blocks of up to four that share each K and V chunk: a chunk is
/// widened from f16 once per block, and the block's accumulators stay in registers across
/// positions (the first version widened a row into a stack buffer and kept V's sums in
/// memory; its stores and reloads, not the KV reads, bounded it at ~190 cycles per position
/// and KV head, even with the KV in L2).
///
/// The softmax's max is vector wide (its numerators are [`numerators`]).
///
/// `blocks(page_index, v)` gives the K (`v = false`) or V block of the sequence's page;
/// `cold`: the KV is likely not in cache (the sweep prefetches it a page ahead).
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
    cold: bool,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let seq = Seq {
        blocks,
        page_size,
        kv_dim,
        head_dim,
        len: pos + 1,
        cold,
    };
    // SAFETY: the caller's contract is `sweep`'s; the target features are enabled here.
    unsafe { sweep::<E, Avx2>(&seq, n_heads / n_kv_heads, kv_heads, q, scores, out) }
}

/// `s[j] = exp(s[j] - max)`, eight at a time (the portable kernel's operations: `exp::exp`'s
/// on every lane): the sampler's max and exponentials (`softmax.rs`). The max in any order
/// is the same value but for the sign of a zero, which no difference `s[j] - max` shows; NaN
/// scores are skipped as `f32::max` skips them. The f64 sum they also make goes unused here
/// (the softmax's sum runs in position order, `attention::sums_in_position_order`), and the
/// compiler drops it.
#[inline(always)]
unsafe fn numerators(s: &mut [f32]) {
    // SAFETY: `s` is `s.len()` elements; AVX2 and FMA are enabled by the caller.
    unsafe {
        let max = super::softmax::max_in(s);
        super::softmax::exp_in(s.as_ptr(), Some(s.as_mut_ptr()), s.len(), max);
    }
}

/// [`exp::exp`] on 8 lanes: the same operations in the same order, so the same bits.
#[inline(always)]
pub(crate) unsafe fn exp8(x: __m256) -> __m256 {
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
pub(crate) unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
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
    crate::kernels::ops::silu_mul_scalar(&mut gate[n..], &up[n..]);
}

/// The 16 lanes of each of `H` heads' dot with the K row at `k`: lanes 0-7 and 8-15 in two
/// registers, lane `l` taking elements `l, l + 16, ...` in increasing order.
///
/// # Safety
/// `k` holds `head_dim` elements, `q` H heads of `head_dim`; AVX2, FMA and F16C are enabled.
#[inline(always)]
unsafe fn dot16<E: KvElem, const H: usize>(
    k: *const E,
    q: *const f32,
    head_dim: usize,
) -> ([__m256; H], [__m256; H]) {
    // SAFETY: per the contract.
    unsafe {
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
        (lo, hi)
    }
}

/// The rest of [`hsum`] for eight positions at once, `v[p]` = position `p`'s lanes 0-7 plus
/// lanes 8-15 (the first level): pairs `(i, i + 4)`, `(i, i + 2)`, `(0, 1)` as `hsum` adds
/// them, so the same bits, with position `p`'s sum in lane `p`. One tree at a time, every
/// position waited for its own five dependent shuffles and additions after its dot, and the
/// scores ran at the latency of that chain (28 ns per position and KV head with the KV in L2,
/// a Zen 3 core); here the eight share 8 permutes, 6 shuffles and 7 additions.
#[inline(always)]
unsafe fn hsum8(v: &[__m256; 8]) -> __m256 {
    // SAFETY: register-only operations; AVX is enabled by the callers.
    unsafe {
        // Positions p and p + 4 in the two 128-bit lanes: (i, i + 4) within each.
        let s4: [__m256; 4] = std::array::from_fn(|p| {
            _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(v[p], v[p + 4]),
                _mm256_permute2f128_ps::<0x31>(v[p], v[p + 4]),
            )
        });
        // (i, i + 2): lanes [p: 0, 1; p + 1: 0, 1] for p = 0 and 2 (and p + 4, p + 5).
        let s2 = |a: __m256, b: __m256| {
            _mm256_add_ps(
                _mm256_shuffle_ps::<0b01_00_01_00>(a, b),
                _mm256_shuffle_ps::<0b11_10_11_10>(a, b),
            )
        };
        let (s01, s23) = (s2(s4[0], s4[1]), s2(s4[2], s4[3]));
        // (0, 1): positions 0-3 in the low lane, 4-7 in the high one.
        _mm256_add_ps(
            _mm256_shuffle_ps::<0b10_00_10_00>(s01, s23),
            _mm256_shuffle_ps::<0b11_01_11_01>(s01, s23),
        )
    }
}

impl<E: KvElem> Tiles<E> for Avx2 {
    /// `s[h * len + j]` = the scaled score of query head `h` (at `q + h * head_dim`) for
    /// every position `j` of `span` (within one page): a 16-lane dot and the fixed tree, as
    /// `attention::attend_kernel`.
    #[inline(always)]
    unsafe fn scores<const H: usize>(
        seq: &Seq<'_, E>,
        at: usize,
        span: std::ops::Range<usize>,
        q: *const f32,
        s: *mut f32,
    ) {
        let (head_dim, len) = (seq.head_dim, seq.len);
        let scale = 1.0 / (head_dim as f32).sqrt();
        // SAFETY: rows hold `head_dim` elements; `q` holds H heads and `s` H rows of `len`.
        unsafe {
            let mut k = seq.row(false, at, span.start);
            let mut j = span.start;
            // Eight positions at a time: each one's two halves added (the tree's first
            // level), then the rest of the eight trees side by side ([`hsum8`]).
            while j + 8 <= span.end {
                let mut halves = [[_mm256_setzero_ps(); 8]; H];
                for p in 0..8 {
                    let (lo, hi) = dot16::<E, H>(k, q, head_dim);
                    for h in 0..H {
                        halves[h][p] = _mm256_add_ps(lo[h], hi[h]);
                    }
                    k = k.wrapping_add(seq.kv_dim);
                }
                for (h, halves) in halves.iter().enumerate() {
                    let sums = _mm256_mul_ps(hsum8(halves), _mm256_set1_ps(scale));
                    _mm256_storeu_ps(s.add(h * len + j), sums);
                }
                j += 8;
            }
            for j in j..span.end {
                let (lo, hi) = dot16::<E, H>(k, q, head_dim);
                for h in 0..H {
                    *s.add(h * len + j) = hsum(lo[h], hi[h]) * scale;
                }
                k = k.wrapping_add(seq.kv_dim);
            }
        }
    }

    /// Adds the positions of `span` (within one page) to `o[h * head_dim..]`, the sums over
    /// positions of `p[h * len + j]` times V's row `j`, 16 elements at a time in registers:
    /// each element one fused multiply-add per position in position order (as
    /// `attention::attend_kernel`). The first page starts the sums from zero; they wait in
    /// `o` between pages (a store and a load change no bit), so the four passes over a head
    /// read the page's rows from L1, not the whole sequence's from memory once per pass.
    #[inline(always)]
    unsafe fn values<const H: usize>(
        seq: &Seq<'_, E>,
        at: usize,
        span: std::ops::Range<usize>,
        p: *const f32,
        o: *mut f32,
    ) {
        let (head_dim, len) = (seq.head_dim, seq.len);
        // SAFETY: rows hold `head_dim` elements; `p` holds H rows of `len`, `o` H heads.
        unsafe {
            let mut c = 0;
            while c < head_dim {
                let mut lo = [_mm256_setzero_ps(); H];
                let mut hi = [_mm256_setzero_ps(); H];
                if span.start > 0 {
                    for h in 0..H {
                        lo[h] = _mm256_loadu_ps(o.add(h * head_dim + c));
                        hi[h] = _mm256_loadu_ps(o.add(h * head_dim + c + 8));
                    }
                }
                let mut v = seq.row(true, at + c, span.start);
                for j in span.clone() {
                    let (vl, vh) = (E::load8(v), E::load8(v.add(8)));
                    for h in 0..H {
                        let w = _mm256_broadcast_ss(&*p.add(h * len + j));
                        lo[h] = _mm256_fmadd_ps(w, vl, lo[h]);
                        hi[h] = _mm256_fmadd_ps(w, vh, hi[h]);
                    }
                    v = v.wrapping_add(seq.kv_dim);
                }
                for h in 0..H {
                    _mm256_storeu_ps(o.add(h * head_dim + c), lo[h]);
                    _mm256_storeu_ps(o.add(h * head_dim + c + 8), hi[h]);
                }
                c += 16;
            }
        }
    }

    #[inline(always)]
    unsafe fn numerators(s: &mut [f32]) {
        // SAFETY: the instruction set is available (the trait's contract).
        unsafe { numerators(s) }
    }
}

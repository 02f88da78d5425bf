//! The AVX-512 attention: the portable kernel's operations sixteen lanes at a time, so its
//! bits (the AVX2 attention's design on 16-lane registers; see `avx2/attend.rs`).

use std::arch::x86_64::*;

use super::broadcast::fma_broadcast;
use super::{hsum, tree_halves, tree_quarters};
use crate::kernels::attention::sweep::{Seq, Tiles, sweep};
use crate::kernels::exp;

/// The AVX-512 tiles of the shared sweep; `ONE_HEAD_OF_64`: the call attends one KV head of
/// several, and heads are 64 elements ([`scores_chunks`]).
pub struct Avx512<const ONE_HEAD_OF_64: bool>;

/// Where one KV head of one token lives: a pointer to `head_dim` elements.
pub trait KvElem: Copy {
    /// Loads 16 elements as f32.
    ///
    /// # Safety
    /// `p` points at 16 readable elements; AVX-512F and F16C are available.
    unsafe fn load16(p: *const Self) -> __m512;
}

impl KvElem for half::f16 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        // SAFETY: per the trait contract.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
}

impl KvElem for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        // SAFETY: per the trait contract.
        unsafe { _mm512_loadu_ps(p) }
    }
}

/// Attention of one token (the query heads of `kv_heads`) over positions `0..=pos`, the
/// same operations in the same order as `attention::attend_kernel` (each score 16-lane FMAs
/// then the fixed tree; softmax in position order; V accumulated by one fused multiply-add
/// per element in position order).
///
/// The walk over the pages is the shared `attention::sweep`; these are its register tiles.
/// Query heads go in blocks of up to four that share each K and V row: a row is widened
/// from f16 once per block (the first version widened it once per query head, and ran the
/// softmax's `exp` one element at a time: half the AVX2 kernel's speed on the same core).
///
/// The softmax's max is vector wide (its numerators are [`numerators`]). With the sweep's
/// page order: 1.93 -> 0.94 ms per decode token at a 480-token context, all 30 layers, on a
/// Sapphire Rapids core. Scores four positions at a time, their trees side by side
/// ([`hsum4`]): 0.90-0.92 -> 0.77-0.85 ms on a later Xeon guest.
///
/// `blocks(page_index, v)` gives the K (`v = false`) or V block of the sequence's page;
/// `cold`: the KV is likely not in cache (the sweep prefetches it a page ahead).
///
/// # Safety
/// `head_dim` is a multiple of 16 and at most 256; every block holds `page_size * kv_dim`
/// elements; `q` holds `n_heads * head_dim` and `out` the heads of `kv_heads`; AVX-512F and
/// F16C are available.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
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
    let group = n_heads / n_kv_heads;
    // SAFETY: the caller's contract is `sweep`'s; the target features are enabled here.
    unsafe {
        if head_dim == 64 && kv_heads.len() == 1 && n_kv_heads > 1 {
            sweep::<E, Avx512<true>>(&seq, group, kv_heads, q, scores, out)
        } else {
            sweep::<E, Avx512<false>>(&seq, group, kv_heads, q, scores, out)
        }
    }
}

/// `s[j] = exp(s[j] - max)`, sixteen at a time (the portable kernel's operations:
/// `exp::exp`'s on every lane). The max in any order is the same value but for the sign
/// of a zero, which no difference `s[j] - max` shows; NaN scores are skipped as
/// `f32::max` skips them (`vmaxps` returns its second operand when one is NaN).
#[inline(always)]
unsafe fn numerators(s: &mut [f32]) {
    let n = s.len() / 16 * 16;
    // SAFETY: `j + 16 <= n <= s.len()`; AVX-512F is enabled by the caller.
    unsafe {
        let p = s.as_mut_ptr();
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut j = 0;
        while j < n {
            m = _mm512_max_ps(_mm512_loadu_ps(p.add(j)), m);
            j += 16;
        }
        let max = s[n..]
            .iter()
            .copied()
            .fold(_mm512_reduce_max_ps(m), f32::max);
        let m = _mm512_set1_ps(max);
        let mut j = 0;
        while j < n {
            _mm512_storeu_ps(p.add(j), exp16(_mm512_sub_ps(_mm512_loadu_ps(p.add(j)), m)));
            j += 16;
        }
        for v in &mut s[n..] {
            *v = exp::exp(*v - max);
        }
    }
}

/// [`exp::exp`] on 16 lanes: the same operations in the same order, so the same bits (as
/// `avx2::exp8`).
#[inline(always)]
pub(crate) unsafe fn exp16(x: __m512) -> __m512 {
    // SAFETY: register-only operations; AVX-512F is enabled by the callers.
    unsafe {
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(exp::LOG2E)),
        );
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-exp::LN2_HI), x);
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-exp::LN2_LO), r);
        let mut p = _mm512_set1_ps(exp::P[0]);
        for c in &exp::P[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
        }
        let r2 = _mm512_mul_ps(r, r);
        let y = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0));
        let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvtps_epi32(n),
            _mm512_set1_epi32(127),
        ));
        let e = _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
        // Below MIN_ARG (and NaN): 0; above MAX_ARG: +inf; there `n` was out of the
        // exponent's range.
        let e = _mm512_maskz_mov_ps(
            _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(exp::MIN_ARG)),
            e,
        );
        _mm512_mask_blend_ps(
            _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(exp::MAX_ARG)),
            e,
            _mm512_set1_ps(f32::INFINITY),
        )
    }
}

impl<E: KvElem, const ONE_HEAD_OF_64: bool> Tiles<E> for Avx512<ONE_HEAD_OF_64> {
    /// `s[h * len + j]` = the scaled score of query head `h` (at `q + h * head_dim`) for
    /// every position `j` of `span` (within one page): 16-lane FMAs over the head's chunks
    /// and the fixed tree.
    #[inline(always)]
    unsafe fn scores<const H: usize>(
        seq: &Seq<'_, E>,
        at: usize,
        span: std::ops::Range<usize>,
        q: *const f32,
        s: *mut f32,
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            if ONE_HEAD_OF_64 {
                scores_chunks::<E, H, 4>(seq, at, span, q, s)
            } else {
                scores_chunks::<E, H, 0>(seq, at, span, q, s)
            }
        }
    }

    /// Adds the positions of `span` (within one page) to `o[h * head_dim..]`, the sums over
    /// positions of `p[h * len + j]` times V's row `j`: each element one fused multiply-add
    /// per position in position order. The first page starts the sums from zero; the sums
    /// wait in `o` between pages (a store and a load change no bit).
    #[inline(always)]
    unsafe fn values<const H: usize>(
        seq: &Seq<'_, E>,
        at: usize,
        span: std::ops::Range<usize>,
        p: *const f32,
        o: *mut f32,
    ) {
        let chunks = seq.head_dim / 16;
        // SAFETY: as `values_chunks`.
        unsafe {
            let mut c = 0;
            while c < chunks {
                let n = CHUNKS.min(chunks - c);
                if n == CHUNKS {
                    values_chunks::<E, H, CHUNKS>(seq, at, c * 16, span.clone(), p, o);
                } else {
                    for k in 0..n {
                        values_chunks::<E, H, 1>(seq, at, (c + k) * 16, span.clone(), p, o);
                    }
                }
                c += n;
            }
        }
    }

    #[inline(always)]
    unsafe fn numerators(s: &mut [f32]) {
        // SAFETY: the instruction set is available (the trait's contract).
        unsafe { numerators(s) }
    }
}

/// [`hsum`] of four vectors at once: the same additions in the same order (pairs `(i, i + 8)`,
/// then `(i, i + 4)`, `(i, i + 2)`, `(0, 1)`), each vector's in its own 128-bit lane, so the
/// same bits; 8 shuffles, 5 additions and a permute instead of 16 shuffles and 16 additions.
#[inline(always)]
unsafe fn hsum4(a: __m512, b: __m512, c: __m512, d: __m512) -> __m128 {
    // SAFETY: register-only operations; AVX-512F is enabled by the callers.
    unsafe {
        let s4 = tree_quarters(tree_halves(a, b), tree_halves(c, d));
        // Within each lane: (0 + 2, 1 + 3), then 0 + 1 (`movehl`, then the pair).
        let s2 = _mm512_add_ps(s4, _mm512_shuffle_ps::<0b11_10_11_10>(s4, s4));
        let s1 = _mm512_add_ps(s2, _mm512_shuffle_ps::<0b01_01_01_01>(s2, s2));
        let lanes = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
        _mm512_castps512_ps128(_mm512_permutexvar_ps(lanes, s1))
    }
}

/// [`Tiles::scores`] over `CH` chunks of 16 (`CH = 0`: `head_dim / 16`, read at run time).
///
/// `CH = 4` (heads of 64, the loop over the chunks unrolled) only where a call attends one
/// KV head of several: there it is faster, whole tokens slower. `throughput --attention`, ns
/// per position and KV head, 3-4 rounds interleaved: one head per call 800 x 4 30.7-34.5 ->
/// 24.3-26.6, 2048 x 4 30.8-32.5 -> 25.2-26.2, 256 x 32 34.9-36.5 -> 26.3-26.7; a whole
/// token's call 800 x 4 16.9-18.5 -> 18.3-19.8, 2048 x 4 17.7-18.4 -> 20.8-22.0 (not
/// understood: the loads of the unrolled loop come sooner after the prefetch of each head's
/// rows, a page ahead, than the loop's did). Decode at batch 1 on two threads (a token's KV
/// heads split between them), 400 steps from a 560-token context, 6 pairs alternating:
/// 171-196 -> 179-204 tok/s, 1.01-1.09x per pair.
#[inline(always)]
unsafe fn scores_chunks<E: KvElem, const H: usize, const CH: usize>(
    seq: &Seq<'_, E>,
    at: usize,
    span: std::ops::Range<usize>,
    q: *const f32,
    s: *mut f32,
) {
    let (head_dim, len) = (seq.head_dim, seq.len);
    let chunks = if CH > 0 { CH } else { head_dim / 16 };
    let scale = 1.0 / (head_dim as f32).sqrt();
    // SAFETY: rows hold `head_dim` elements; `q` holds H heads and `s` H rows of `len`.
    unsafe {
        let mut k = seq.row(false, at, span.start);
        // Four positions at a time: their trees side by side ([`hsum4`]).
        let mut j = span.start;
        let sc = _mm_set1_ps(scale);
        while j + 4 <= span.end {
            let mut acc = [[_mm512_setzero_ps(); 4]; H];
            for c in (0..chunks).map(|i| i * 16) {
                let kc: [__m512; 4] = std::array::from_fn(|p| E::load16(k.add(p * seq.kv_dim + c)));
                for h in 0..H {
                    let qh = _mm512_loadu_ps(q.add(h * head_dim + c));
                    for p in 0..4 {
                        acc[h][p] = _mm512_fmadd_ps(qh, kc[p], acc[h][p]);
                    }
                }
            }
            for h in 0..H {
                let sums = hsum4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
                _mm_storeu_ps(s.add(h * len + j), _mm_mul_ps(sums, sc));
            }
            k = k.wrapping_add(4 * seq.kv_dim);
            j += 4;
        }
        for j in j..span.end {
            let mut acc = [_mm512_setzero_ps(); H];
            for c in (0..chunks).map(|i| i * 16) {
                let kc = E::load16(k.add(c));
                for h in 0..H {
                    let qh = _mm512_loadu_ps(q.add(h * head_dim + c));
                    acc[h] = _mm512_fmadd_ps(qh, kc, acc[h]);
                }
            }
            for h in 0..H {
                *s.add(h * len + j) = hsum(acc[h]) * scale;
            }
            k = k.wrapping_add(seq.kv_dim);
        }
    }
}

/// Sixteen-lane chunks of a head that V's accumulators hold in registers at once: 4 heads x 4
/// chunks and the 4 widened chunks fit the 32 registers.
const CHUNKS: usize = 4;

/// [`Tiles::values`] for `C` chunks from element `dim`, their sums in registers.
///
/// Each weight enters its fused multiply-adds as a broadcast from memory inside the
/// instruction ([`fma_broadcast`]) rather than a `vbroadcastss` into a register, which takes
/// Zen 4's one 512-bit shuffle pipe that the f16 widening needs as well. `throughput
/// --attention`, ns per position and KV head, 3 rounds interleaved: 63 x 1 17.9-18.2 ->
/// 17.5-17.6, 480 x 1 16.4-16.5 -> 15.7-15.8, 800 x 4 18.2-19.8 -> 17.6-17.8.
#[inline(always)]
unsafe fn values_chunks<E: KvElem, const H: usize, const C: usize>(
    seq: &Seq<'_, E>,
    at: usize,
    dim: usize,
    span: std::ops::Range<usize>,
    p: *const f32,
    o: *mut f32,
) {
    let (head_dim, len) = (seq.head_dim, seq.len);
    // SAFETY: rows hold `head_dim` elements; `p` holds H rows of `len`, `o` H heads.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); C]; H];
        if span.start > 0 {
            for h in 0..H {
                for c in 0..C {
                    acc[h][c] = _mm512_loadu_ps(o.add(h * head_dim + dim + c * 16));
                }
            }
        }
        let mut v = seq.row(true, at + dim, span.start);
        for j in span {
            let mut vc = [_mm512_setzero_ps(); C];
            for c in 0..C {
                vc[c] = E::load16(v.add(c * 16));
            }
            for h in 0..H {
                let w = p.add(h * len + j);
                for c in 0..C {
                    acc[h][c] = fma_broadcast(vc[c], w, acc[h][c]);
                }
            }
            v = v.wrapping_add(seq.kv_dim);
        }
        for h in 0..H {
            for c in 0..C {
                _mm512_storeu_ps(o.add(h * head_dim + dim + c * 16), acc[h][c]);
            }
        }
    }
}

//! Causal attention of one token over its sequence's KV, read through the page table.
//!
//! For query position `pos` the token attends to positions `0..=pos` in increasing order:
//! scores (fixed-order dot products), softmax (max, exponentials, a sequential sum), then the
//! weighted sum of V in the same order. The work of one token never depends on which other
//! tokens share the step, so a token computes the same bits in a prefill chunk of any size and
//! in a decode batch.

use duet_gpu::{BlockView, KvDtype, KvPool, PageId};
use half::slice::HalfFloatSliceExt;

use super::{LANES, dot};

#[cfg(target_arch = "x86_64")]
pub(crate) mod sweep;

/// Shape of the attention.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Query heads.
    pub n_heads: usize,
    /// KV heads (each serves `n_heads / n_kv_heads` query heads).
    pub n_kv_heads: usize,
    /// Dimension per head.
    pub head_dim: usize,
}

/// Reusable buffers for one thread.
#[derive(Debug, Default)]
pub struct AttnScratch {
    scores: Vec<f32>,
    kv: Vec<f32>,
    /// The page table and layer this thread attended over last: the same again (the next
    /// token of a prompt chunk) finds that KV in cache, so the SIMD kernels skip their
    /// prefetches.
    last: Option<(usize, usize)>,
    /// The K and V blocks' addresses of each page of the call, looked up once per call: the
    /// kernels ask for a page's block at every row tile and prefetch (four times per page and
    /// KV head), and each pool lookup (offsets, bounds, dtype) had been 6 % of the attention.
    /// `throughput --attention`, whole tokens, 3 rounds interleaved on a Zen 4 core: 480 x 1
    /// 15.6 -> 14.6-14.7 ns per position and KV head, 800 x 4 17.7-18.6 -> 16.9-17.8.
    blocks: Vec<[usize; 2]>,
}

/// `out` = attention of `q` (all query heads, already rotated) at `pos`, for the query heads of
/// KV heads `kv_heads` (`out` holds exactly those heads). Splitting a token's heads between
/// threads changes no bit: each head's computation is independent.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    pool: &KvPool,
    layer: usize,
    shape: AttnShape,
    kv_heads: std::ops::Range<usize>,
    q: &[f32],
    pos: usize,
    pages: &[PageId],
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    attend_with(
        super::isa(),
        pool,
        layer,
        shape,
        kv_heads,
        q,
        pos,
        pages,
        out,
        scratch,
    )
}

/// [`attend`] with the kernels of `isa`, which this CPU must have (`isa()` or a level below
/// it: the tests run every level the machine offers).
#[allow(clippy::too_many_arguments)]
fn attend_with(
    isa: super::Isa,
    pool: &KvPool,
    layer: usize,
    shape: AttnShape,
    kv_heads: std::ops::Range<usize>,
    q: &[f32],
    pos: usize,
    pages: &[PageId],
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    #[cfg(target_arch = "x86_64")]
    {
        use super::{Isa, avx2, avx512};
        let fits = shape.head_dim.is_multiple_of(16)
            && shape.head_dim <= 256
            && shape.n_heads / shape.n_kv_heads <= 64;
        let args = (pool, layer, shape, kv_heads.clone(), q, pos, pages);
        // SAFETY (of each kernel passed): the caller's `isa` was detected (AVX-512F and F16C;
        // AVX2, FMA and F16C); `fits` holds its shape conditions (head_dim, at most 64 query
        // heads per KV head).
        match (isa, pool.layout().dtype) {
            (Isa::Avx512, KvDtype::F16) if fits => {
                return attend_simd(args, out, scratch, f16_blocks, avx512::attend);
            }
            (Isa::Avx512, KvDtype::F32) if fits => {
                return attend_simd(args, out, scratch, f32_blocks, avx512::attend);
            }
            (Isa::Avx2, KvDtype::F16) if fits => {
                return attend_simd(args, out, scratch, f16_blocks, avx2::attend);
            }
            (Isa::Avx2, KvDtype::F32) if fits => {
                return attend_simd(args, out, scratch, f32_blocks, avx2::attend);
            }
            _ => {}
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    crate::dispatch!(attend_kernel(
        pool, layer, shape, kv_heads, q, pos, pages, out, scratch
    ))
}

type AttendArgs<'a> = (
    &'a KvPool,
    usize,
    AttnShape,
    std::ops::Range<usize>,
    &'a [f32],
    usize,
    &'a [PageId],
);

fn f16_blocks(b: BlockView<'_>) -> Option<&[half::f16]> {
    match b {
        BlockView::F16(s) => Some(s),
        BlockView::F32(_) => None,
    }
}

fn f32_blocks(b: BlockView<'_>) -> Option<&[f32]> {
    match b {
        BlockView::F32(s) => Some(s),
        BlockView::F16(_) => None,
    }
}

/// A SIMD attention kernel (`avx512::attend`, `avx2::attend`) over elements `E`.
#[cfg(target_arch = "x86_64")]
type SimdKernel<E> = unsafe fn(
    &dyn Fn(usize, bool) -> *const E,
    usize,
    usize,
    usize,
    usize,
    usize,
    std::ops::Range<usize>,
    &[f32],
    usize,
    bool,
    &mut Vec<f32>,
    &mut [f32],
);

/// Runs `kernel` over a pool whose blocks `view` turns into slices of `E`.
#[cfg(target_arch = "x86_64")]
fn attend_simd<E>(
    (pool, layer, shape, kv_heads, q, pos, pages): AttendArgs<'_>,
    out: &mut [f32],
    scratch: &mut AttnScratch,
    view: for<'b> fn(BlockView<'b>) -> Option<&'b [E]>,
    kernel: SimdKernel<E>,
) {
    let layout = pool.layout();
    scratch.blocks.clear();
    for &page in pages.iter().take((pos + 1).div_ceil(layout.page_size)) {
        let at = |v| view(pool.block(page, layer, v)).map_or(0, |b| b.as_ptr() as usize);
        scratch.blocks.push([at(false), at(true)]);
    }
    let table = &scratch.blocks;
    let blocks = |i: usize, v: bool| table[i][usize::from(v)] as *const E;
    let this = (pages.as_ptr() as usize, layer);
    let cold = scratch.last.replace(this) != Some(this);
    // SAFETY: the caller chose `kernel` for the instruction set `isa()` detected and checked
    // its shape conditions (head_dim a multiple of 16 and at most 256, the group bound); the
    // engine checked that the page table covers `pos`; `kv_heads` is within the layout and
    // `out` holds exactly their query heads; `view` matches the pool's dtype, so every block
    // pointer is a whole `page_size * kv_dim` block.
    unsafe {
        kernel(
            &blocks,
            layout.page_size,
            layout.kv_dim(),
            shape.n_heads,
            shape.n_kv_heads,
            shape.head_dim,
            kv_heads,
            q,
            pos,
            cold,
            &mut scratch.scores,
            out,
        )
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_kernel(
    pool: &KvPool,
    layer: usize,
    shape: AttnShape,
    kv_heads: std::ops::Range<usize>,
    q: &[f32],
    pos: usize,
    pages: &[PageId],
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    let AttnShape {
        n_heads,
        n_kv_heads,
        head_dim,
    } = shape;
    let group = n_heads / n_kv_heads;
    let layout = pool.layout();
    let (page_size, kv_dim) = (layout.page_size, layout.kv_dim());
    let len = pos + 1;
    let scale = 1.0 / (head_dim as f32).sqrt();
    scratch.scores.resize(group * len, 0.0);
    scratch.kv.resize(head_dim, 0.0);
    out.fill(0.0);
    let base = kv_heads.start * group;
    debug_assert!(kv_heads.end <= n_kv_heads);
    for g in kv_heads {
        let heads = g * group..(g + 1) * group;
        // Scores for every query head of this KV head.
        for j in 0..len {
            let slot = j % page_size;
            let at = slot * kv_dim + g * head_dim;
            load(
                pool.block(pages[j / page_size], layer, false),
                at,
                &mut scratch.kv,
            );
            for (hi, h) in heads.clone().enumerate() {
                let qh = &q[h * head_dim..(h + 1) * head_dim];
                scratch.scores[hi * len + j] = dot(qh, &scratch.kv) * scale;
            }
        }
        // Softmax numerators, and their sums in position order.
        let mut sums = vec![0f32; group];
        for (hi, sum) in sums.iter_mut().enumerate() {
            let s = &mut scratch.scores[hi * len..(hi + 1) * len];
            let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            for v in s.iter_mut() {
                *v = super::exp::exp(*v - max);
                *sum += *v;
            }
        }
        // Weighted sum of V in position order.
        for j in 0..len {
            let slot = j % page_size;
            let at = slot * kv_dim + g * head_dim;
            load(
                pool.block(pages[j / page_size], layer, true),
                at,
                &mut scratch.kv,
            );
            for (hi, h) in heads.clone().enumerate() {
                let p = scratch.scores[hi * len + j];
                let o = &mut out[(h - base) * head_dim..(h - base + 1) * head_dim];
                axpy(o, p, &scratch.kv);
            }
        }
        for (hi, h) in heads.enumerate() {
            let inv = 1.0 / sums[hi];
            for v in &mut out[(h - base) * head_dim..(h - base + 1) * head_dim] {
                *v *= inv;
            }
        }
    }
}

/// `sums[r]` = the sum of row `r` of `rows` (rows of `len`), each in position order, the
/// rows' chains interleaved up to twelve at a time.
///
/// A softmax's sum must run in position order (its bits are the portable kernel's); one row
/// after another, every add waited for the one before it (four cycles), and the two chains,
/// max and sum, were half of a decode token's attention. Independent rows side by side keep
/// the adders busy without changing any row's order.
#[cfg(target_arch = "x86_64")]
pub(super) fn sums_in_position_order(rows: &[f32], len: usize, sums: &mut [f32]) {
    #[inline(always)]
    fn block<const N: usize>(rows: &[f32], len: usize, sums: &mut [f32]) {
        let mut acc = [0f32; N];
        for j in 0..len {
            for r in 0..N {
                acc[r] += rows[r * len + j];
            }
        }
        sums[..N].copy_from_slice(&acc);
    }
    // Up to 12 rows in one pass: two adders at four cycles each keep 8 chains busy, and 9 to
    // 12 cost one pass of 4.5 to 6 cycles a position where 8 and then the rest cost two of 4
    // (SmolLM2's 9 query heads were 8 + 1: 2.0 of ~24 ns per position and KV head went to the
    // sums, `throughput --attention` at 480 x 1 with the rest of the kernel switched off).
    let mut r = 0;
    while r < sums.len() {
        let (rows, sums) = (&rows[r * len..], &mut sums[r..]);
        let n = if sums.len() <= 12 { sums.len() } else { 8 };
        match n {
            1 => block::<1>(rows, len, sums),
            2 => block::<2>(rows, len, sums),
            3 => block::<3>(rows, len, sums),
            4 => block::<4>(rows, len, sums),
            5 => block::<5>(rows, len, sums),
            6 => block::<6>(rows, len, sums),
            7 => block::<7>(rows, len, sums),
            8 => block::<8>(rows, len, sums),
            9 => block::<9>(rows, len, sums),
            10 => block::<10>(rows, len, sums),
            11 => block::<11>(rows, len, sums),
            _ => block::<12>(rows, len, sums),
        }
        r += n;
    }
}

/// Copies one head of one slot out of a K or V block, as f32.
#[inline(always)]
fn load(block: BlockView<'_>, at: usize, into: &mut [f32]) {
    let n = into.len();
    match block {
        BlockView::F32(b) => into.copy_from_slice(&b[at..at + n]),
        BlockView::F16(b) => b[at..at + n].convert_to_f32_slice(into),
    }
}

/// `o += p * v`, lane by lane (each element its own fused multiply-add).
#[inline(always)]
fn axpy(o: &mut [f32], p: f32, v: &[f32]) {
    let n = o.len() / LANES * LANES;
    for (oc, vc) in o[..n]
        .chunks_exact_mut(LANES)
        .zip(v[..n].chunks_exact(LANES))
    {
        for l in 0..LANES {
            oc[l] = p.mul_add(vc[l], oc[l]);
        }
    }
    for i in n..o.len() {
        o[i] = p.mul_add(v[i], o[i]);
    }
}

#[cfg(test)]
mod tests {
    use duet_gpu::{KvDtype, KvLayout};

    use super::*;

    use crate::kernels::test_values as random;

    /// Naive attention over contiguous K and V (f64 accumulation).
    fn naive(q: &[f32], k: &[Vec<f32>], v: &[Vec<f32>], shape: AttnShape) -> Vec<f32> {
        let group = shape.n_heads / shape.n_kv_heads;
        let d = shape.head_dim;
        let mut out = vec![0f32; shape.n_heads * d];
        for h in 0..shape.n_heads {
            let g = h / group;
            let qh = &q[h * d..(h + 1) * d];
            let scores: Vec<f64> = k
                .iter()
                .map(|kj| {
                    let kh = &kj[g * d..(g + 1) * d];
                    qh.iter()
                        .zip(kh)
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum::<f64>()
                        / (d as f64).sqrt()
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            for i in 0..d {
                let acc: f64 = e
                    .iter()
                    .zip(v)
                    .map(|(p, vj)| p * f64::from(vj[g * d + i]))
                    .sum();
                out[h * d + i] = (acc / sum) as f32;
            }
        }
        out
    }

    #[test]
    fn paged_attention_equals_naive_contiguous_attention() {
        // Both KV element types: every kernel this machine runs (AVX-512, AVX2, portable)
        // gives the portable kernel's bits on each; f32 KV is also checked against the naive
        // f64 sum.
        let shape = AttnShape {
            n_heads: 6,
            n_kv_heads: 2,
            head_dim: 32,
        };
        for dtype in [KvDtype::F32, KvDtype::F16] {
            paged_attention_case(dtype, shape, 19);
        }
    }

    #[test]
    fn more_query_heads_per_kv_head_than_one_simd_pass_holds() {
        // Five and seven query heads per KV head: the SIMD kernels' blocks of four, then the
        // rest; 10 rows of softmax sums in one pass, 14 in 8 and 6.
        for n_heads in [10, 14] {
            let shape = AttnShape {
                n_heads,
                n_kv_heads: 2,
                head_dim: 64,
            };
            paged_attention_case(KvDtype::F16, shape, 19);
        }
    }

    #[test]
    fn the_models_shape_and_heads_wider_than_one_pass_hold_over_many_pages() {
        // SmolLM2's groups of three heads of 64 over 23 pages; heads of 80 and 128 take
        // several passes over V, each a page at a time with the sums kept between pages.
        for head_dim in [64, 80, 128] {
            let shape = AttnShape {
                n_heads: 6,
                n_kv_heads: 2,
                head_dim,
            };
            paged_attention_case(KvDtype::F16, shape, 90);
        }
    }

    #[test]
    fn pages_of_sixteen_take_the_eight_position_trees_and_their_tails() {
        // Pages wider than 8 positions: the AVX2 scores reduce eight positions' trees at
        // once, then the page's tail one by one; every span length from 1 to 16 occurs.
        // Groups of 1 to 4 and 7 query heads: every block width of the tiles (1 to 4 heads).
        for n_heads in [2, 4, 6, 8, 14] {
            let shape = AttnShape {
                n_heads,
                n_kv_heads: 2,
                head_dim: 64,
            };
            for dtype in [KvDtype::F32, KvDtype::F16] {
                paged_attention_case_paged(
                    dtype,
                    shape,
                    16 * 3 + 11,
                    16,
                    &[7, 8, 9, 15, 16, 23, 31, 40, 58],
                );
            }
        }
    }

    fn paged_attention_case(dtype: KvDtype, shape: AttnShape, len: usize) {
        paged_attention_case_paged(dtype, shape, len, 4, &[0, 3, 4, 18, len - 1]);
    }

    /// Attention at each query position of `positions` over a `len`-token sequence in
    /// scattered pages of `page_size`: every kernel this machine runs gives the portable
    /// kernel's bits, also split by KV head, and stays close to the naive f64 sum.
    fn paged_attention_case_paged(
        dtype: KvDtype,
        shape: AttnShape,
        len: usize,
        page_size: usize,
        positions: &[usize],
    ) {
        let (hd, kv) = (shape.head_dim, shape.n_kv_heads * shape.head_dim);
        let qd = shape.n_heads * hd;
        let layout = KvLayout {
            n_layers: 2,
            n_kv_heads: shape.n_kv_heads,
            head_dim: hd,
            page_size,
            dtype,
        };
        let n_pages = len.div_ceil(page_size);
        let mut pool = KvPool::new(layout, 2 * n_pages + 1).unwrap();
        // Scattered, out-of-order pages: the page table is what makes them one sequence.
        let pages: Vec<PageId> = (0..n_pages as PageId)
            .map(|i| (i * 7 + 3) % (2 * n_pages as PageId + 1))
            .collect();
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        for j in 0..len {
            let k = random(kv, 10 + j as u64);
            let v = random(kv, 100 + j as u64);
            pool.write_token(pages[j / page_size], 1, j % page_size, &k, &v);
            ks.push(k);
            vs.push(v);
        }
        let mut scratch = AttnScratch::default();
        for &pos in positions {
            let q = random(qd, 1000 + pos as u64);
            let mut out = vec![0f32; qd];
            attend(
                &pool,
                1,
                shape,
                0..2,
                &q,
                pos,
                &pages,
                &mut out,
                &mut scratch,
            );
            let expect = naive(&q, &ks[..=pos], &vs[..=pos], shape);
            let mut generic = vec![0f32; qd];
            attend_kernel(
                &pool,
                1,
                shape,
                0..2,
                &q,
                pos,
                &pages,
                &mut generic,
                &mut scratch,
            );
            assert_eq!(
                generic, out,
                "{dtype:?}: the portable kernel gives the same bits"
            );
            for isa in crate::kernels::isas() {
                let mut each = vec![0f32; qd];
                attend_with(
                    isa,
                    &pool,
                    1,
                    shape,
                    0..2,
                    &q,
                    pos,
                    &pages,
                    &mut each,
                    &mut scratch,
                );
                assert_eq!(each, generic, "{isa:?} {dtype:?} head_dim {hd} pos {pos}");
                // One KV head at a time gives the same bits.
                let mut split = vec![0f32; qd];
                let (first, second) = split.split_at_mut(qd / 2);
                let one = |kv_heads, out: &mut [f32], scratch: &mut AttnScratch| {
                    attend_with(
                        isa, &pool, 1, shape, kv_heads, &q, pos, &pages, out, scratch,
                    )
                };
                one(0..1, first, &mut scratch);
                one(1..2, second, &mut scratch);
                assert_eq!(split, out, "{isa:?} {dtype:?}: split by KV head");
            }
            let tolerance = if dtype == KvDtype::F32 { 1e-5 } else { 1e-2 };
            for (a, b) in out.iter().zip(&expect) {
                assert!((a - b).abs() < tolerance, "{dtype:?} pos {pos}: {a} vs {b}");
            }
        }
    }
}

//! The order both SIMD attention kernels (`avx2/attend.rs`, `avx512/attend.rs`) walk a
//! sequence's KV in; each supplies only its register tiles ([`Tiles`]).
//!
//! Page by page, every KV head of a page before the next page, so each page's K and V blocks
//! are read front to back while they are in cache; query heads in blocks of up to [`HEADS`]
//! that share each widened K or V row; then the softmax's numerators per head, their sums in
//! position order side by side ([`super::sums_in_position_order`]), the weighted sum of V
//! (the sums wait in `out` between pages: a store and a load change no bit) and the division.
//! Where the KV is likely cold, each page's next block is prefetched while the page computes.

/// Query heads that share one pass over K or V: 4 heads' accumulators, the widened KV chunks
/// and the broadcast weights fit AVX2's 16 registers (and AVX-512's 32 with whole heads of 64).
pub(crate) const HEADS: usize = 4;

/// One sequence's KV as the attention reads it: `len` positions in pages of `page_size`.
pub(crate) struct Seq<'a, E> {
    /// The K (`v = false`) or V block of the sequence's `i`-th page.
    pub blocks: &'a dyn Fn(usize, bool) -> *const E,
    pub page_size: usize,
    pub kv_dim: usize,
    pub head_dim: usize,
    pub len: usize,
    /// The KV is likely not in cache: prefetch each page's blocks a page ahead.
    pub cold: bool,
}

impl<E> Seq<'_, E> {
    /// The positions of each page in turn.
    pub fn pages(&self) -> impl Iterator<Item = std::ops::Range<usize>> + use<'_, E> {
        (0..self.len.div_ceil(self.page_size))
            .map(|p| p * self.page_size..self.len.min((p + 1) * self.page_size))
    }

    /// The K (`v = false`) or V row of position `j` for the head whose first element is
    /// `at`; each next position of the page is `kv_dim` elements further on.
    ///
    /// The tiles loop over a page's rows themselves: a closure called for every row was not
    /// inlined where its body grew, and compiled without the caller's target features, its
    /// intrinsics became function calls (4x slower).
    ///
    /// # Safety
    /// `j < len` and `at` within a row (every slot of a block is in it).
    #[inline(always)]
    pub unsafe fn row(&self, v: bool, at: usize, j: usize) -> *const E {
        // SAFETY: per the contract.
        unsafe { (self.blocks)(j / self.page_size, v).add((j % self.page_size) * self.kv_dim + at) }
    }

    /// Asks for the K (`v = false`) or V rows of page `page` that KV head `g` of a call over
    /// `kv_heads` needs, a page ahead of their use: head `g`'s part of each row where the call
    /// attends every KV head; the whole block when `g` is the first of fewer; else nothing.
    ///
    /// A sequence's pages lie anywhere in the pool, and one layer's block of a page (6 KB
    /// for SmolLM2's f16 KV) is too short for the hardware prefetcher to ramp up in; every
    /// block started with a full memory latency. Decode at batch 4 after 400 tokens, one
    /// Sapphire Rapids core: 155-166 -> 182-187 tok/s (every fourth line only: 161-170).
    /// Where one call attends every KV head, each head asks for its own rows of the next page
    /// as it starts, so the block comes in three bursts of 32 lines instead of one of 96:
    /// 42.5-47.0 -> 34.7-38.6 ns per position and KV head at 500 x 4 and 256 x 32 contexts
    /// (`throughput --attention`, 3 rounds, a Zen 3 core; presumably a burst longer than the
    /// misses the core keeps in flight lost its tail). A call for one head of several asks
    /// for the whole block: the other heads' calls, next on this thread or the other, then
    /// find it in L2 (asking for only its own rows: 54-58 -> 60-65 ns).
    /// Not when `cold` is false: a prompt chunk's next token finds its KV in cache, and the
    /// prefetches cost prefill 283-305 against 300-312 tok/s. A prefetch never faults, so
    /// no bound check.
    ///
    /// Into L2 (`T1`), not L1: a burst of L1 prefetches holds the core's few L1 miss buffers,
    /// and the loads of the page being computed queued behind them. `T0` -> `T1`, ns per
    /// position and KV head, 3 rounds: 34.2-36.1 -> 19.4-24.5 at 800 x 4, 34.6-37.8 ->
    /// 21.0-22.2 at 256 x 32 (a Zen 4 core; its AVX2 kernel 38.4-40.7 -> 20.4-21.3 and
    /// 41.2-42.6 -> 22.4-23.1), in cache (63 x 1) 17.7-18.2 -> 17.7-17.8 (one round
    /// of three 24.0); a call for one
    /// head of several 45.5-46.9 -> 32.8-32.9. A row is then one L2 hit away, which the
    /// page's other loads hide.
    #[inline(always)]
    fn prefetch(&self, page: usize, v: bool, kv_heads: &std::ops::Range<usize>, g: usize) {
        let every = kv_heads.len() * self.head_dim == self.kv_dim;
        if !self.cold || page * self.page_size >= self.len || (!every && g != kv_heads.start) {
            return;
        }
        let size = std::mem::size_of::<E>();
        let block = (self.blocks)(page, v).cast::<i8>();
        let row = self.kv_dim * size;
        let lines = |from: usize, bytes: usize| {
            let mut b = from;
            while b < from + bytes {
                // SAFETY: a prefetch only hints; it reads nothing and never faults.
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                        block.wrapping_add(b),
                    )
                };
                b += 64;
            }
        };
        if every {
            for j in 0..self.page_size {
                lines(j * row + g * self.head_dim * size, self.head_dim * size);
            }
        } else {
            lines(0, self.page_size * row);
        }
    }
}

/// One instruction set's register tiles over `H` query heads and one page's positions.
pub(crate) trait Tiles<E> {
    /// `s[h * len + j]` = the scaled score of query head `h` (at `q + h * head_dim`) for
    /// every position `j` of `span` (within one page): the portable kernel's 16-lane dot and
    /// fixed tree.
    ///
    /// # Safety
    /// The rows of `span` exist; `q` holds H heads and `s` H rows of `len`.
    unsafe fn scores<const H: usize>(
        seq: &Seq<'_, E>,
        at: usize,
        span: std::ops::Range<usize>,
        q: *const f32,
        s: *mut f32,
    );

    /// Adds the positions of `span` (within one page) to `o[h * head_dim..]`: `p[h * len + j]`
    /// times V's row `j`, each element one fused multiply-add per position in position
    /// order; the first page starts from zero.
    ///
    /// # Safety
    /// The rows of `span` exist; `p` holds H rows of `len`, `o` H heads.
    unsafe fn values<const H: usize>(
        seq: &Seq<'_, E>,
        at: usize,
        span: std::ops::Range<usize>,
        p: *const f32,
        o: *mut f32,
    );

    /// `s[j] = exp(s[j] - max)` with `exp::exp`'s bits on every lane.
    ///
    /// # Safety
    /// The instruction set is available.
    unsafe fn numerators(s: &mut [f32]);
}

/// The attention of one token for the query heads of `kv_heads` (groups of `group`) over
/// `seq`, with `K`'s tiles: `out` holds those heads; `scores` is scratch.
///
/// Inlined into each kernel's `#[target_feature]` function, so the tiles compile with its
/// instruction set.
///
/// # Safety
/// As the kernels' `attend`: every block of `seq` holds `page_size * kv_dim` elements, `q`
/// all query heads, `out` the heads of `kv_heads`; `K`'s instruction set is available.
#[inline(always)]
pub(crate) unsafe fn sweep<E, K: Tiles<E>>(
    seq: &Seq<'_, E>,
    group: usize,
    kv_heads: std::ops::Range<usize>,
    q: &[f32],
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let (head_dim, len) = (seq.head_dim, seq.len);
    let heads = kv_heads.len() * group;
    // Every head's scores, then their sums' place.
    scores.resize(heads * len + heads, 0.0);
    let (rows, sums) = scores.split_at_mut(heads * len);
    // SAFETY: pointers stay inside the blocks, `q`, `rows` and `out` per the contract.
    unsafe {
        let s0 = rows.as_mut_ptr();
        for (page, span) in seq.pages().enumerate() {
            for (i, g) in kv_heads.clone().enumerate() {
                let at = g * head_dim;
                seq.prefetch(page + 1, false, &kv_heads, g);
                let q0 = q.as_ptr().add(g * group * head_dim);
                let mut h = 0;
                while h < group {
                    let n = HEADS.min(group - h);
                    let (qh, sh) = (q0.add(h * head_dim), s0.add((i * group + h) * len));
                    let span = span.clone();
                    match n {
                        1 => K::scores::<1>(seq, at, span, qh, sh),
                        2 => K::scores::<2>(seq, at, span, qh, sh),
                        3 => K::scores::<3>(seq, at, span, qh, sh),
                        _ => K::scores::<4>(seq, at, span, qh, sh),
                    }
                    h += n;
                }
            }
        }
        for row in rows.chunks_exact_mut(len) {
            K::numerators(row);
        }
        super::sums_in_position_order(rows, len, sums);
        let s0 = rows.as_ptr();
        for (page, span) in seq.pages().enumerate() {
            for (i, g) in kv_heads.clone().enumerate() {
                let at = g * head_dim;
                seq.prefetch(page + 1, true, &kv_heads, g);
                let o0 = out.as_mut_ptr().add(i * group * head_dim);
                let mut h = 0;
                while h < group {
                    let n = HEADS.min(group - h);
                    let (sh, oh) = (s0.add((i * group + h) * len), o0.add(h * head_dim));
                    let span = span.clone();
                    match n {
                        1 => K::values::<1>(seq, at, span, sh, oh),
                        2 => K::values::<2>(seq, at, span, sh, oh),
                        3 => K::values::<3>(seq, at, span, sh, oh),
                        _ => K::values::<4>(seq, at, span, sh, oh),
                    }
                    h += n;
                }
            }
        }
    }
    for (o, sum) in out.chunks_exact_mut(head_dim).zip(sums.iter()) {
        let inv = 1.0 / *sum;
        for v in o {
            *v *= inv;
        }
    }
}

//! CPU kernels: weight-quantized matrix products with f32 activations, and the small ops.
//!
//! # Exact and batch-invariant
//!
//! Activations stay f32. Quantized weights are dequantized inside the kernel, block by block,
//! to the exact f32 value `d * q + m` (Q4_1), `d * (q - 8)` (Q4_0) or `d * q` (Q8_0), and
//! multiplied with the f32 activations. Every output element `y[t][n] = Σ_k W[n][k] x[t][k]`
//! is computed with one fixed sequence of operations: [`LANES`] partial sums, lane `l` taking
//! `k ≡ l (mod LANES)` in increasing `k`, each step one fused multiply-add, then the lanes
//! summed in a fixed tree. Which other rows or tokens are computed alongside, how many tokens
//! there are, and which thread computes a row never change that sequence, so a token's
//! result is bit-identical whether it is alone, in a batch of 32, in a prefill chunk of any
//! size, or at any position in the batch.
//!
//! The instruction set is chosen once per process (AVX-512, AVX2+FMA with or without F16C, or
//! portable code), so
//! the guarantee holds per machine; the portable path uses the same order with `mul_add`.

#![allow(unsafe_code)]
// target_feature dispatch; each call site states why it is sound
// Kernels index several arrays with one loop variable on purpose: it is the tile coordinate.
#![allow(clippy::needless_range_loop)]

pub mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod exp;
mod lines;
mod matmul;
pub mod ops;
pub mod softmax;

pub use lines::Lines;
pub use matmul::{
    Format, QRef, TOKENS_PER_THREAD, matmul, matmul_group, repack, rows_strided, token_split,
};

/// Rows ahead of its tile that the streaming kernels (`avx512::rows`, `avx2::rows`) prefetch (two
/// 4-row tiles), into L2 (`prefetcht1`), not L1: on an AMD EPYC (Zen 4) core a prefetch into L1
/// holds one of the L1's few miss buffers for a whole memory latency, and batch-1 decode, which
/// streams every weight once per token, read them at half the rate the core reads memory. Into L2,
/// 3 rounds interleaved with the same build prefetching into L1: the LM head (Q8_0, 32 MB) 2.7-3.8
/// -> 1.6-1.7 ms; batch-1 decode 89-94 -> 122-132 tok/s at 1 thread (after 480 tokens 72-79 ->
/// 88-103), 141-173 -> 204-211 at 2 threads (112-129 -> 153-164); batch 32 unchanged; 16 and 32
/// rows ahead measured the same, no software prefetch at all 6.6 ms for the LM head, and a second
/// prefetch into L1 4 rows ahead (beside the one into L2) slower (104-117 tok/s). The many-token
/// kernel's and the attention's prefetches into L2 measured no different (within the noise). The
/// AVX2 kernel on the same core, capped at AVX2, 2 rounds: batch-1 decode 77-80 tok/s (into L1, 4
/// rows ahead, as it was) -> 84-90 (into L2, 4 rows) -> 103 (into L2, 8 rows).
#[cfg(target_arch = "x86_64")]
const PREFETCH_AHEAD: usize = 8;

/// Partial sums per dot product.
pub const LANES: usize = 16;

/// The instruction set this process computes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F.
    Avx512,
    /// AVX2 with FMA and F16C.
    Avx2,
    /// AVX2 with FMA but no F16C (some virtual machines hide it): the same kernels, with f16
    /// converted in software (exact both ways, so the results are the same bits).
    Avx2NoF16c,
    /// Whatever the baseline target offers.
    Portable,
}

/// Detected once; never changes for the life of the process.
pub fn isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // `DUET_ISA` caps the level (`portable`, `avx2`): to measure or test a lower
            // level's kernels on a machine that has a higher one.
            let cap = std::env::var_os("DUET_ISA");
            if cap.as_ref().is_some_and(|v| v == "portable") {
                return Isa::Portable;
            }
            let f16c = is_x86_feature_detected!("f16c");
            let avx2_cap = cap.is_some_and(|v| v == "avx2");
            if is_x86_feature_detected!("avx512f") && f16c && !avx2_cap {
                return Isa::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                // Without this level a CPU that lacks only F16C fell to the portable path,
                // where every `mul_add` is a library call: ~30x slower.
                return if f16c { Isa::Avx2 } else { Isa::Avx2NoF16c };
            }
        }
        Isa::Portable
    })
}

/// Every level this process may compute with: [`isa`] and the levels below it whose kernels
/// this CPU runs, so a test checks each against the portable bits.
#[cfg(test)]
pub(crate) fn isas() -> Vec<Isa> {
    let all = [Isa::Avx512, Isa::Avx2, Isa::Portable];
    let from = all
        .iter()
        .position(|i| *i == isa())
        .unwrap_or(all.len() - 1);
    all[from..].to_vec()
}

/// Sums the lanes in a fixed tree (pairs, then pairs of pairs...).
#[inline(always)]
pub fn hsum(acc: &[f32; LANES]) -> f32 {
    let mut v = *acc;
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            v[i] += v[i + width];
        }
        width /= 2;
    }
    v[0]
}

/// `acc[l] += a[l] * b[l]` for every lane, fused.
#[inline(always)]
pub fn fma_lanes(acc: &mut [f32; LANES], a: &[f32], b: &[f32]) {
    for l in 0..LANES {
        acc[l] = a[l].mul_add(b[l], acc[l]);
    }
}

/// A fixed-order dot product of two equal-length slices (length a multiple of [`LANES`];
/// a tail is summed sequentially after the lanes).
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let n = a.len() / LANES * LANES;
    for (ca, cb) in a[..n].chunks_exact(LANES).zip(b[..n].chunks_exact(LANES)) {
        fma_lanes(&mut acc, ca, cb);
    }
    let mut s = hsum(&acc);
    for i in n..a.len() {
        s = a[i].mul_add(b[i], s);
    }
    s
}

/// Runs `f` compiled for the detected instruction set. `f` must be `#[inline(always)]` code
/// so it is compiled inside each `target_feature` wrapper; the closure around it is
/// `#[inline(always)]` too: left to the optimiser it stayed a function of its own, compiled
/// without the features, where every `mul_add` became a call to the library's `fmaf` (the
/// AVX2 path ran at the portable path's speed, ~30x slower than it should).
#[macro_export]
#[doc(hidden)]
macro_rules! dispatch {
    ($body:expr) => {{
        match $crate::kernels::isa() {
            #[cfg(target_arch = "x86_64")]
            $crate::kernels::Isa::Avx512 => {
                #[target_feature(enable = "avx512f,avx2,fma,f16c")]
                unsafe fn run<R>(f: impl FnOnce() -> R) -> R {
                    f()
                }
                // SAFETY: `isa()` returned Avx512 only after detecting avx512f and f16c (and
                // every CPU with avx512f has avx2 and fma).
                unsafe {
                    run(
                        #[inline(always)]
                        || $body,
                    )
                }
            }
            #[cfg(target_arch = "x86_64")]
            $crate::kernels::Isa::Avx2 => {
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn run<R>(f: impl FnOnce() -> R) -> R {
                    f()
                }
                // SAFETY: `isa()` returned Avx2 only after detecting avx2, fma and f16c.
                unsafe {
                    run(
                        #[inline(always)]
                        || $body,
                    )
                }
            }
            #[cfg(target_arch = "x86_64")]
            $crate::kernels::Isa::Avx2NoF16c => {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn run<R>(f: impl FnOnce() -> R) -> R {
                    f()
                }
                // SAFETY: `isa()` returned Avx2NoF16c only after detecting avx2 and fma.
                unsafe {
                    run(
                        #[inline(always)]
                        || $body,
                    )
                }
            }
            _ => $body,
        }
    }};
}

/// Deterministic values in [-0.5, 0.5) for the kernels' tests.
#[cfg(test)]
pub(crate) fn test_values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        })
        .collect()
}

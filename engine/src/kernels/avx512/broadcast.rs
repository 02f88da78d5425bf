//! One-instruction products whose scalar operand is broadcast from memory inside the
//! instruction (`{1to16}`).
//!
//! On Zen 4 a `vbroadcastss` into a register takes the one 512-bit shuffle pipe, which the
//! permutes, zero-extensions and f16 widenings of the kernels need as well; a broadcast folded
//! into the arithmetic costs no shuffle. The compiler folds a broadcast only where its value
//! has a single use, and shares the load where one scalar multiplies several vectors, so these
//! spell the instruction out with `asm!` (docs/benchmarks/engine.md, the eleventh session, has
//! the pipe measurements).

use std::arch::x86_64::__m512;

/// `a * d` (one rounding: `vmulps`) with the f32 at `d` broadcast from memory inside the
/// instruction: both halves of a Q8_0 block multiply by the same `d`. The LM head at one token (`throughput --kernels`, 3 rounds interleaved): 1513-1641 ->
/// 1385-1406 us; a C model of the 4-row tile, weights in L1: 19.5-19.7 -> 20.8-22.6 GMAC/s.
///
/// # Safety
/// `d` points at 4 readable bytes; AVX-512F is available.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn mul_broadcast(a: __m512, d: *const f32) -> __m512 {
    let product;
    // SAFETY: reads the 4 bytes at `d` (the contract) and writes only `product`.
    unsafe {
        std::arch::asm!(
            "vmulps {product}, {a}, dword ptr [{d}]{{1to16}}",
            product = lateout(zmm_reg) product,
            a = in(zmm_reg) a,
            d = in(reg) d,
            options(pure, readonly, nostack, preserves_flags),
        )
    };
    product
}

/// `fma(a, d, acc)` (one rounding: `vfmadd231ps`) with the f32 at `d` broadcast from memory
/// inside the instruction: one attention weight multiplies each chunk of a V row.
///
/// # Safety
/// `d` points at 4 readable bytes; AVX-512F is available.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn fma_broadcast(a: __m512, d: *const f32, acc: __m512) -> __m512 {
    let mut acc = acc;
    // SAFETY: reads the 4 bytes at `d` (the contract) and writes only `acc`.
    unsafe {
        std::arch::asm!(
            "vfmadd231ps {acc}, {a}, dword ptr [{d}]{{1to16}}",
            acc = inout(zmm_reg) acc,
            a = in(zmm_reg) a,
            d = in(reg) d,
            options(pure, readonly, nostack, preserves_flags),
        )
    };
    acc
}

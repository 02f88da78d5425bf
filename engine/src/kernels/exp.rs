//! The engine's own `exp`: one fixed sequence of f32 operations, so a SIMD kernel can compute
//! eight at once and give the scalar code's bits.
//!
//! The library's `expf` is exact enough but a call per element: in the attention's softmax
//! (three exponentials per position and KV head for SmolLM2) the calls and the register
//! spills around them were half of a decode token's attention time. This one is Cephes'
//! `expf`: `x = n ln2 + r` with `n` rounded to nearest (ties to even), `r` reduced with a
//! two-part `ln2` by fused multiply-adds, a degree-5 polynomial for `e^r` by Horner's rule with
//! fused multiply-adds, and `2^n` built in the exponent bits. Every step is an IEEE operation
//! that rounds once, so the scalar version ([`exp`], `mul_add` for each fused step) and the
//! AVX2 and AVX-512 ones (`avx2::exp8`, `avx512::exp16`) give the same bits
//! for every input; within 1 ulp of the true value (0.98 at worst in the test's sweep against
//! f64).
//!
//! Inputs below [`MIN_ARG`] (and NaN) give 0 (e^-87.3 is already under the smallest normal
//! f32 and, beside a softmax term equal to 1, changes no sum); inputs above [`MAX_ARG`] give
//! `+inf` (the true value is at most 3.4e38 there; the SiLU, `g / (1 + e^-g)`, then gives -0
//! for a gate below -88 where the true value is under 1e-36).

/// Below this `exp` returns 0.
pub const MIN_ARG: f32 = -87.336_55;
/// Above this `exp` returns `+inf`, so that `2^n` below stays a normal f32 (`n <= 127`).
pub const MAX_ARG: f32 = 88.0;
/// `log2(e)`.
pub const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` in two parts: `LN2_HI` has few enough bits that `n * LN2_HI` is exact.
pub const LN2_HI: f32 = 0.693_359_4;
/// The rest of `ln 2`.
pub const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes' coefficients for `e^r` on `|r| <= ln2/2`: `1 + r + r^2 (P0 r^5 ... + P5)`.
pub const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_2e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `e^x` (see the module's note on the ends of the range).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // Written so that NaN also gives 0, as the SIMD versions' mask does.
    if x.is_nan() || x < MIN_ARG {
        return 0.0;
    }
    if x > MAX_ARG {
        return f32::INFINITY;
    }
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = P[0];
    for c in &P[1..] {
        p = p.mul_add(r, *c);
    }
    let r2 = r * r;
    let y = p.mul_add(r2, r) + 1.0;
    // n is in [-126, 127] here, so 2^n is a normal f32.
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Units in the last place between `a` and the f64 value `b`.
    fn ulps(a: f32, b: f64) -> f64 {
        let b32 = b as f32;
        let ulp = f64::from(f32::from_bits(b32.to_bits() + 1) - b32);
        (f64::from(a) - b).abs() / ulp
    }

    #[test]
    fn within_one_ulp_of_the_true_value() {
        let mut worst = 0f64;
        let mut x = MIN_ARG;
        while x <= MAX_ARG {
            let e = f64::from(x).exp();
            if e >= f64::from(f32::MIN_POSITIVE) {
                worst = worst.max(ulps(exp(x), e));
            }
            x += 0.000_37;
        }
        assert!(worst <= 1.0, "worst error {worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert!(exp(MIN_ARG) > 0.0);
        assert!(exp(MAX_ARG).is_finite());
        assert_eq!(exp(88.5), f32::INFINITY);
        assert_eq!(exp(f32::NAN), 0.0);
    }

    /// Every range of the argument, both ends, NaN and the rounding ties of `n`.
    fn inputs(lanes: usize) -> Vec<f32> {
        let mut inputs: Vec<f32> = (0..200_000).map(|i| -(i as f32) * 0.000_44).collect();
        inputs.extend([
            0.0,
            -0.0,
            MIN_ARG,
            MIN_ARG - 1e-3,
            -88.0,
            -1e30,
            f32::NEG_INFINITY,
            f32::NAN,
            -0.5 * std::f32::consts::LN_2,
            -1.5 * std::f32::consts::LN_2,
            MAX_ARG,
            88.5,
        ]);
        while !inputs.len().is_multiple_of(lanes) {
            inputs.push(-1.0);
        }
        inputs
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx2_lanes_give_the_scalar_bits() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            return;
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn lanes(x: &[f32]) -> [f32; 8] {
            use std::arch::x86_64::{_mm256_loadu_ps, _mm256_storeu_ps};
            let mut lanes = [0f32; 8];
            // SAFETY: eight floats each way; AVX2 and FMA were detected.
            unsafe {
                _mm256_storeu_ps(
                    lanes.as_mut_ptr(),
                    crate::kernels::avx2::exp8(_mm256_loadu_ps(x.as_ptr())),
                )
            };
            lanes
        }
        for x in inputs(8).chunks_exact(8) {
            // SAFETY: the features were detected above.
            let simd = unsafe { lanes(x) };
            for l in 0..8 {
                assert_eq!(simd[l].to_bits(), exp(x[l]).to_bits(), "exp({})", x[l]);
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx512_lanes_give_the_scalar_bits() {
        if !is_x86_feature_detected!("avx512f") {
            return;
        }
        #[target_feature(enable = "avx512f")]
        unsafe fn lanes(x: &[f32]) -> [f32; 16] {
            use std::arch::x86_64::{_mm512_loadu_ps, _mm512_storeu_ps};
            let mut lanes = [0f32; 16];
            // SAFETY: sixteen floats each way; AVX-512F was detected.
            unsafe {
                _mm512_storeu_ps(
                    lanes.as_mut_ptr(),
                    crate::kernels::avx512::exp16(_mm512_loadu_ps(x.as_ptr())),
                )
            };
            lanes
        }
        for x in inputs(16).chunks_exact(16) {
            // SAFETY: the feature was detected above.
            let simd = unsafe { lanes(x) };
            for l in 0..16 {
                assert_eq!(simd[l].to_bits(), exp(x[l]).to_bits(), "exp({})", x[l]);
            }
        }
    }
}

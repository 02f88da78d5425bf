//! The AVX2 halves of [`crate::kernels::softmax`]: the same operations as its scalar code,
//! eight lanes at a time, so its bits (`exp8` is `exp::exp` on every lane, and the f64 sums
//! keep its lane order).

use std::arch::x86_64::*;

use super::exp8;
use crate::kernels::softmax::{LANES, lanes_total, max_scalar};

/// The largest of `x`, NaN skipped (`vmaxps` returns its second operand, the running max,
/// when the element is NaN); `-inf` when `x` is empty or all NaN.
///
/// # Safety
/// AVX2 is available.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn max(x: &[f32]) -> f32 {
    let n = x.len() / LANES * LANES;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    // SAFETY: `j + 8 <= n <= x.len()`.
    unsafe {
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut j = 0;
        while j < n {
            m = _mm256_max_ps(_mm256_loadu_ps(x.as_ptr().add(j)), m);
            j += LANES;
        }
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
    }
    max_scalar(lanes.iter().chain(&x[n..]))
}

/// `Σ e^(x[i] - max)` in f64: [`crate::kernels::softmax::exp_sum`]'s order.
///
/// # Safety
/// AVX2 and FMA are available.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn exp_sum(x: &[f32], max: f32) -> f64 {
    // SAFETY: the features are enabled here.
    unsafe { sum_with(x, max, true) }
}

/// `Σ x[i]` in f64: [`crate::kernels::softmax::sum`]'s order.
///
/// # Safety
/// AVX2 is available.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn sum(x: &[f32]) -> f64 {
    // SAFETY: the features are enabled here.
    unsafe { sum_with(x, 0.0, false) }
}

/// `x[i] = e^(x[i] - max)` in place.
///
/// # Safety
/// AVX2 and FMA are available.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn exp_shifted(x: &mut [f32], max: f32) {
    let n = x.len() / LANES * LANES;
    // SAFETY: `j + 8 <= n <= x.len()`.
    unsafe {
        let (p, m) = (x.as_mut_ptr(), _mm256_set1_ps(max));
        let mut j = 0;
        while j < n {
            _mm256_storeu_ps(p.add(j), exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(j)), m)));
            j += LANES;
        }
    }
    for v in &mut x[n..] {
        *v = crate::kernels::exp::exp(*v - max);
    }
}

/// Lane `l` of eight f64 sums takes elements `l, l + 8, ...` (each `e^(x - max)` when `exp`)
/// in increasing order; then [`lanes_total`] and the tail in order.
#[inline(always)]
unsafe fn sum_with(x: &[f32], max: f32, exp: bool) -> f64 {
    let n = x.len() / LANES * LANES;
    let mut lanes = [0f64; LANES];
    // SAFETY: `j + 8 <= n <= x.len()`; the caller enabled AVX2 and FMA.
    unsafe {
        let m = _mm256_set1_ps(max);
        let (mut lo, mut hi) = (_mm256_setzero_pd(), _mm256_setzero_pd());
        let mut j = 0;
        while j < n {
            let mut v = _mm256_loadu_ps(x.as_ptr().add(j));
            if exp {
                v = exp8(_mm256_sub_ps(v, m));
            }
            lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
            hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(v)));
            j += LANES;
        }
        _mm256_storeu_pd(lanes.as_mut_ptr(), lo);
        _mm256_storeu_pd(lanes.as_mut_ptr().add(4), hi);
    }
    let mut total = lanes_total(&lanes);
    for v in &x[n..] {
        total += f64::from(if exp {
            crate::kernels::exp::exp(*v - max)
        } else {
            *v
        });
    }
    total
}

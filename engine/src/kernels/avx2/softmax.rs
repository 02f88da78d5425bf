//! The AVX2 halves of [`crate::kernels::softmax`]: the same operations as its scalar code,
//! eight lanes at a time, so its bits (`exp8` is `exp::exp` on every lane, and the f64 sums
//! keep its lane order). The attention's softmax numerators (`attend.rs`) are [`max_in`] and
//! [`exp_in`] too.

use std::arch::x86_64::*;

use super::exp8;
use crate::kernels::exp;
use crate::kernels::softmax::{LANES, lanes_total, max_scalar};

/// The largest of `x`, NaN skipped; `-inf` when there is none.
///
/// # Safety
/// AVX2 is available.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn max(x: &[f32]) -> f32 {
    // SAFETY: the features are enabled here.
    unsafe { max_in(x) }
}

/// `Σ e^(x[i] - max)` in f64: [`crate::kernels::softmax::exp_sum`]'s order.
///
/// # Safety
/// AVX2 and FMA are available.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn exp_sum(x: &[f32], max: f32) -> f64 {
    // SAFETY: `x` is `x.len()` readable elements; nothing is written.
    unsafe { exp_in(x.as_ptr(), None, x.len(), max) }
}

/// `x[i] = e^(x[i] - max)` in place, and their sum: [`crate::kernels::softmax::exp_shifted`].
///
/// # Safety
/// AVX2 and FMA are available.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn exp_shifted(x: &mut [f32], max: f32) -> f64 {
    // SAFETY: `x` is `x.len()` elements, each read before it is written.
    unsafe { exp_in(x.as_ptr(), Some(x.as_mut_ptr()), x.len(), max) }
}

/// [`max`]'s body, for callers compiled with AVX2 (`vmaxps` returns its second operand, the
/// running max, when the element is NaN).
///
/// # Safety
/// AVX2 is enabled in the caller.
#[inline(always)]
pub(crate) unsafe fn max_in(x: &[f32]) -> f32 {
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

/// `e^(x - max)` of the `len` elements at `src`, written to `dst` when given, summed in f64:
/// lane `l` of eight takes elements `l, l + 8, ...` in increasing order, then
/// [`lanes_total`] and the tail in order.
///
/// # Safety
/// `src` (and `dst`, which may be `src`) hold `len` elements; AVX2 and FMA are enabled in the
/// caller.
#[inline(always)]
pub(crate) unsafe fn exp_in(src: *const f32, dst: Option<*mut f32>, len: usize, max: f32) -> f64 {
    let n = len / LANES * LANES;
    let mut lanes = [0f64; LANES];
    // SAFETY: every index is below `len`; each element is read before it is written.
    unsafe {
        let m = _mm256_set1_ps(max);
        let (mut lo, mut hi) = (_mm256_setzero_pd(), _mm256_setzero_pd());
        let mut j = 0;
        while j < n {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(src.add(j)), m));
            if let Some(d) = dst {
                _mm256_storeu_ps(d.add(j), e);
            }
            lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(e)));
            j += LANES;
        }
        _mm256_storeu_pd(lanes.as_mut_ptr(), lo);
        _mm256_storeu_pd(lanes.as_mut_ptr().add(4), hi);
        let mut total = lanes_total(&lanes);
        for j in n..len {
            let e = exp::exp(*src.add(j) - max);
            if let Some(d) = dst {
                *d.add(j) = e;
            }
            total += f64::from(e);
        }
        total
    }
}

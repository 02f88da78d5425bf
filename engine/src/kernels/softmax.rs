//! Softmax over a vocabulary's logits, for the sampler: the row's max, its normalizer
//! `Σ e^(x - max)` in f64, the numerators in place, in fixed orders, so every instruction set
//! gives the same bits (the AVX2 code is `avx2/softmax.rs`).
//!
//! A worker samples every sequence of a step on its engine thread, one 49,152-logit row each
//! for SmolLM2. With the library's f64 `exp` per logit the normalizer alone cost ~330 us a
//! token, and a sort of the whole row for temperature sampling ~3 ms, a quarter of a batch-1
//! decode step (`throughput --sampling`); these run the row at memory speed.

/// Sums kept side by side: lane `l` takes elements `l, l + LANES, ...` (one AVX2 register).
pub(crate) const LANES: usize = 8;

/// The largest of `x` with NaN skipped (as `f32::max` skips it); `-inf` when there is none.
pub fn max(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if super::isa() != super::Isa::Portable {
        // SAFETY: every level but Portable detected AVX2 and FMA.
        return unsafe { super::avx2::softmax::max(x) };
    }
    max_scalar(x)
}

/// `Σ e^(x[i] - max)` in f64, each term [`super::exp::exp`]'s f32, in [`LANES`] partial sums.
pub fn exp_sum(x: &[f32], max: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if super::isa() != super::Isa::Portable {
        // SAFETY: every level but Portable detected AVX2 and FMA.
        return unsafe { super::avx2::softmax::exp_sum(x, max) };
    }
    sum_scalar(x, |v| super::exp::exp(v - max))
}

/// `x[i] = e^(x[i] - max)`, in place ([`super::exp::exp`]'s bits), and their sum: what
/// [`exp_sum`] gives, bit for bit, in the same pass.
pub fn exp_shifted(x: &mut [f32], max: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if super::isa() != super::Isa::Portable {
        // SAFETY: every level but Portable detected AVX2 and FMA.
        return unsafe { super::avx2::softmax::exp_shifted(x, max) };
    }
    for v in x.iter_mut() {
        *v = super::exp::exp(*v - max);
    }
    sum_scalar(x, |v| v)
}

/// The `n` largest of `x` with their indices, largest first, ties by lower index, NaN never
/// counted: one pass keeping them sorted (insertion: `n` is a top-k or a `top_logprobs`, tens),
/// [`LANES`] elements at a time skipped at once while none beats the `n`-th kept (nearly all of a
/// vocabulary's row: the per-element compare and branch were ~130 us of SmolLM2's 49,152).
pub fn top_n(x: &[f32], n: usize) -> Vec<(u32, f32)> {
    crate::dispatch!(top_n_in(x, n))
}

#[inline(always)]
fn top_n_in(x: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n == 0 {
        return best;
    }
    let offer = |best: &mut Vec<(u32, f32)>, i: usize, l: f32| {
        if l.is_nan() || (best.len() == n && l <= best[n - 1].1) {
            return;
        }
        let at = best.partition_point(|&(_, b)| b >= l);
        best.insert(at, (i as u32, l));
        best.truncate(n);
    };
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for (c, chunk) in chunks.enumerate() {
        // `>` is false for NaN, so a chunk of NaN and smaller values is skipped whole.
        if best.len() == n && !chunk.iter().fold(false, |a, v| a | (*v > best[n - 1].1)) {
            continue;
        }
        for (j, l) in chunk.iter().enumerate() {
            offer(&mut best, c * LANES + j, *l);
        }
    }
    for (j, l) in tail.iter().enumerate() {
        offer(&mut best, x.len() - tail.len() + j, *l);
    }
    best
}

/// [`max`] one element at a time (the portable path, and the SIMD path's lanes and tail).
pub(crate) fn max_scalar<'a>(x: impl IntoIterator<Item = &'a f32>) -> f32 {
    x.into_iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// The [`LANES`] partial sums added in a fixed tree: `(l, l + 4)`, then `(l, l + 2)`, then
/// `(0, 1)`.
#[inline(always)]
pub(crate) fn lanes_total(lanes: &[f64; LANES]) -> f64 {
    let q: [f64; 4] = std::array::from_fn(|l| lanes[l] + lanes[l + 4]);
    (q[0] + q[2]) + (q[1] + q[3])
}

/// The sums of [`exp_sum`] and [`exp_shifted`] one element at a time: `f` of each element into
/// lane `i % LANES`, the lanes' tree, then the tail in order.
fn sum_scalar(x: &[f32], f: impl Fn(f32) -> f32) -> f64 {
    let n = x.len() / LANES * LANES;
    let mut lanes = [0f64; LANES];
    for c in x[..n].chunks_exact(LANES) {
        for (acc, v) in lanes.iter_mut().zip(c) {
            *acc += f64::from(f(*v));
        }
    }
    let mut total = lanes_total(&lanes);
    for v in &x[n..] {
        total += f64::from(f(*v));
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Logits with the cases a sampler meets: a long row with a tail, NaN, both infinities,
    /// values far below the max (their terms 0).
    fn row(n: usize) -> Vec<f32> {
        let mut x: Vec<f32> = crate::kernels::test_values(n, 11)
            .iter()
            .map(|v| v * 40.0)
            .collect();
        x[3] = f32::NAN;
        x[10] = f32::NEG_INFINITY;
        x[17] = -1e6;
        x
    }

    #[test]
    fn every_level_gives_the_scalar_bits() {
        for n in [0, 1, 7, 8, 9, 61, 4099] {
            let x = row(n.max(18))[..n].to_vec();
            let m = max_scalar(&x);
            assert_eq!(max(&x).to_bits(), m.to_bits(), "max, {n}");
            let s = sum_scalar(&x, |v| crate::kernels::exp::exp(v - m));
            assert_eq!(exp_sum(&x, m).to_bits(), s.to_bits(), "exp_sum, {n}");
            let mut e = x.clone();
            let total = exp_shifted(&mut e, m);
            for (i, (a, v)) in e.iter().zip(&x).enumerate() {
                let want = crate::kernels::exp::exp(v - m);
                assert_eq!(a.to_bits(), want.to_bits(), "exp_shifted, {n}, element {i}");
            }
            let t = sum_scalar(&e, |v| v);
            assert_eq!(total.to_bits(), t.to_bits(), "exp_shifted's sum, {n}");
            assert_eq!(exp_sum(&x, m).to_bits(), total.to_bits(), "one order, {n}");
        }
    }

    /// `x` with its indices, NaN left out, largest first, ties by lower index.
    fn sorted(x: &[f32]) -> Vec<(u32, f32)> {
        let mut s: Vec<(u32, f32)> = x
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_nan())
            .map(|(i, v)| (i as u32, *v))
            .collect();
        s.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        s
    }

    #[test]
    fn top_n_is_the_sort_s_prefix() {
        let mut x = row(4099);
        // Ties across chunks and within one, and a row shorter than `n`.
        for i in [40, 41, 900, 4098] {
            x[i] = 19.5;
        }
        let all = sorted(&x);
        for n in [0, 1, 3, 20, 64, 300] {
            assert_eq!(top_n(&x, n), all[..n].to_vec(), "n {n}");
        }
        assert_eq!(top_n(&x[..5], 20), sorted(&x[..5]));
    }

    #[test]
    fn the_normalizer_is_the_true_one() {
        let x = row(4099);
        let m = max(&x);
        let want: f64 = x
            .iter()
            .filter(|v| !v.is_nan())
            .map(|v| (f64::from(*v) - f64::from(m)).exp())
            .sum();
        let got = exp_sum(&x, m);
        assert!((got - want).abs() <= 1e-6 * want, "{got} against {want}");
        assert_eq!(max(&[f32::NAN, f32::NAN]), f32::NEG_INFINITY);
        assert_eq!(max(&[1.0, f32::INFINITY, 2.0]), f32::INFINITY);
    }
}

//! Element-wise and row-wise operations of the Llama block, in fixed orders.

use super::{LANES, fma_lanes, hsum};

/// `out = x / sqrt(mean(x²) + eps) * weight`, one row of `weight.len()` at a time.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    // Compiled for the detected instruction set: outside `dispatch!` each fused multiply-add
    // was a call to the library's `fmaf` (same bits, several times slower; at a 512-token
    // prefill the serial norms outlasted the compute threads' spin and they went to sleep).
    crate::dispatch!(rms_norm_rows(x, weight, eps, out))
}

#[inline(always)]
fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    for (row, o) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let mut acc = [0f32; LANES];
        let n = dim / LANES * LANES;
        for c in row[..n].chunks_exact(LANES) {
            fma_lanes(&mut acc, c, c);
        }
        let mut ss = hsum(&acc);
        for v in &row[n..] {
            ss = v.mul_add(*v, ss);
        }
        let scale = 1.0 / (ss / dim as f32 + eps).sqrt();
        for ((o, v), w) in o.iter_mut().zip(row).zip(weight) {
            *o = w * (v * scale);
        }
    }
}

/// Rotary embedding tables: `cos[p][i]`, `sin[p][i]` for position `p` and pair `i`.
#[derive(Debug, Clone)]
pub struct Rope {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    /// Tables for `max_pos` positions of heads of `dim` (pairs rotated: `dim / 2`).
    pub fn new(dim: usize, base: f32, max_pos: usize) -> Rope {
        let half = dim / 2;
        // As the reference computes them: inverse frequencies and angles in f32.
        let inv: Vec<f32> = (0..half)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32))
            .collect();
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for p in 0..max_pos {
            for f in &inv {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        Rope { half, cos, sin }
    }

    /// Positions the tables cover.
    pub fn max_pos(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// Rotates adjacent pairs `(x[2i], x[2i+1])` of every head in `x` (GGML's normal mode).
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        let c = &self.cos[pos * self.half..(pos + 1) * self.half];
        let s = &self.sin[pos * self.half..(pos + 1) * self.half];
        for head in x.chunks_exact_mut(head_dim) {
            for i in 0..self.half.min(head_dim / 2) {
                let (a, b) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = a * c[i] - b * s[i];
                head[2 * i + 1] = a * s[i] + b * c[i];
            }
        }
    }
}

/// `gate = silu(gate) * up`, in place; with AVX2 eight at a time, the same bits.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::isa() != super::Isa::Portable {
        // SAFETY: every level but Portable detected AVX2 and FMA.
        return unsafe { super::avx2::silu_mul(gate, up) };
    }
    crate::dispatch!(silu_mul_scalar(gate, up))
}

/// [`silu_mul`] one element at a time (the portable path, and the SIMD path's tail).
#[inline(always)]
pub(super) fn silu_mul_scalar(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        let silu = *g / (1.0 + super::exp::exp(-*g));
        *g = silu * u;
    }
}

/// `x += y`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silu_mul_gives_the_scalar_bits_and_the_true_value() {
        // 37: four SIMD groups and a tail; gates from -100 to 100 cross both ends of exp.
        let gate: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 5.5).collect();
        let up = crate::kernels::test_values(37, 7);
        let mut fast = gate.clone();
        silu_mul(&mut fast, &up);
        let mut slow = gate.clone();
        silu_mul_scalar(&mut slow, &up);
        for i in 0..37 {
            assert_eq!(fast[i].to_bits(), slow[i].to_bits(), "gate {}", gate[i]);
            let g = f64::from(gate[i]);
            let want = g / (1.0 + (-g).exp()) * f64::from(up[i]);
            assert!(
                (f64::from(fast[i]) - want).abs() <= 1e-6 * want.abs().max(1e-30),
                "gate {g}"
            );
        }
    }
}

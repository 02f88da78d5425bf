//! f32 buffers that start on a cache line, for the activations the matrix products read.
//!
//! A 16-lane load that straddles two cache lines costs two, and from L2 that is what a
//! `Vec<f32>` (16-byte aligned) gave every load of a token vector unless its allocation
//! happened to start on a line: 32 tokens' products ran at 52-57 GMAC/s misaligned against
//! 56-64 aligned on a Xeon core. The engine's step allocates the products' inputs as
//! [`Lines`]; [`aligned`] copies any other input once per product.

use std::ops::{Deref, DerefMut};

/// f32 per cache line.
const PER_LINE: usize = 16;

/// One cache line of f32.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; PER_LINE]);

/// `len` f32 from a cache-line boundary (each row of a multiple of 16 f32 starts on one too).
#[derive(Clone, Default)]
pub struct Lines {
    lines: Vec<Line>,
    len: usize,
}

impl Lines {
    /// `len` zeros.
    pub fn zeros(len: usize) -> Lines {
        Lines {
            lines: vec![Line([0.0; PER_LINE]); len.div_ceil(PER_LINE)],
            len,
        }
    }

    /// A copy of `x`, each value written once.
    fn copy_of(x: &[f32]) -> Lines {
        let lines = x
            .chunks(PER_LINE)
            .map(|c| {
                let mut line = [0.0; PER_LINE];
                line[..c.len()].copy_from_slice(c);
                Line(line)
            })
            .collect();
        Lines {
            lines,
            len: x.len(),
        }
    }
}

impl Deref for Lines {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: a `Line` is 16 f32 without padding (`repr(C)`), so `lines` holds at least
        // `len` f32 in a row.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<f32>(), self.len) }
    }
}

impl DerefMut for Lines {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as for `deref`, borrowed mutably with `self`.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<f32>(), self.len) }
    }
}

/// `x` itself where it starts on a cache line, else a copy in `staged`.
pub(crate) fn aligned<'a>(x: &'a [f32], staged: &'a mut Lines) -> &'a [f32] {
    if x.as_ptr().align_offset(64) == 0 {
        return x;
    }
    *staged = Lines::copy_of(x);
    staged
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_start_on_a_cache_line_and_copies_keep_every_value() {
        let z = Lines::zeros(37);
        assert_eq!(z.len(), 37);
        assert_eq!(z.as_ptr().align_offset(64), 0);
        let x: Vec<f32> = (0..37).map(|i| i as f32).collect();
        // A slice off a line (one f32 in) is copied onto one, with the same values.
        let mut staged = Lines::default();
        let got = aligned(&x[1..], &mut staged);
        assert_eq!(got.as_ptr().align_offset(64), 0);
        assert_eq!(got, &x[1..]);
        // Already on a line: the input itself.
        let mut again = Lines::default();
        assert_eq!(aligned(&z, &mut again).as_ptr(), z.as_ptr());
    }
}

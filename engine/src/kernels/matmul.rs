//! `y = x · Wᵀ` with W quantized (or f32), x and y f32, in a fixed reduction order.
//!
//! Rows of W are taken in tiles of [`ROWS`]; for each block of 32 along `k` the tile's weights
//! are dequantized once into registers-sized buffers and used by every token of the call. So a
//! weight is dequantized once per call (not once per token), and each `(row, token)` keeps its
//! own [`LANES`]-wide accumulator whose sequence of fused multiply-adds is the same whatever
//! else is computed (see the module docs of `kernels`).

use half::f16;
use rayon::prelude::*;

use super::{LANES, fma_lanes, hsum};
use crate::gguf::TensorType;

/// Rows of W per tile.
const ROWS: usize = 4;
/// Tokens per pass over a tile (bounded so the accumulators stay in registers).
const TOKENS: usize = 4;
/// Elements per quantization block.
const BLOCK: usize = 32;

/// A matrix of `rows` rows of `cols` elements, stored as GGML blocks.
#[derive(Debug, Clone, Copy)]
pub struct QRef<'a> {
    /// Element type.
    pub ty: TensorType,
    /// Output features.
    pub rows: usize,
    /// Input features (a multiple of 32 for block types).
    pub cols: usize,
    /// The raw blocks, row after row.
    pub bytes: &'a [u8],
}

impl QRef<'_> {
    fn row_bytes(&self) -> usize {
        self.cols / self.ty.block_elems() * self.ty.block_bytes()
    }

    /// Row `r` dequantized into `out` (f32, `cols` long).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let rb = self.row_bytes();
        let row = &self.bytes[r * rb..(r + 1) * rb];
        for b in 0..self.cols.div_ceil(BLOCK) {
            let n = BLOCK.min(self.cols - b * BLOCK);
            dequant_block(self.ty, row, b, &mut out[b * BLOCK..b * BLOCK + n]);
        }
    }
}

/// Dequantizes block `b` of a row into `out` (32 values, fewer only for F32/F16 tails).
#[inline(always)]
fn dequant_block(ty: TensorType, row: &[u8], b: usize, out: &mut [f32]) {
    let h = |lo: u8, hi: u8| f16::from_bits(u16::from_le_bytes([lo, hi])).to_f32();
    match ty {
        TensorType::Q4_1 => {
            let blk = &row[b * 20..b * 20 + 20];
            let (d, m) = (h(blk[0], blk[1]), h(blk[2], blk[3]));
            let qs = &blk[4..20];
            for j in 0..16 {
                out[j] = f32::from(qs[j] & 0x0F).mul_add(d, m);
                out[j + 16] = f32::from(qs[j] >> 4).mul_add(d, m);
            }
        }
        TensorType::Q4_0 => {
            let blk = &row[b * 18..b * 18 + 18];
            let d = h(blk[0], blk[1]);
            let qs = &blk[2..18];
            for j in 0..16 {
                out[j] = (f32::from(qs[j] & 0x0F) - 8.0) * d;
                out[j + 16] = (f32::from(qs[j] >> 4) - 8.0) * d;
            }
        }
        TensorType::Q8_0 => {
            let blk = &row[b * 34..b * 34 + 34];
            let d = h(blk[0], blk[1]);
            for j in 0..32 {
                out[j] = f32::from(blk[2 + j] as i8) * d;
            }
        }
        TensorType::F32 => {
            for (j, o) in out.iter_mut().enumerate() {
                let at = (b * BLOCK + j) * 4;
                *o = f32::from_le_bytes([row[at], row[at + 1], row[at + 2], row[at + 3]]);
            }
        }
        TensorType::F16 => {
            for (j, o) in out.iter_mut().enumerate() {
                let at = (b * BLOCK + j) * 2;
                *o = h(row[at], row[at + 1]);
            }
        }
    }
}

/// `out[t * w.rows + n] = Σ_k w[n][k] · x[t * w.cols + k]` for `tokens` tokens, on `threads`
/// threads (rows are split between them; the result does not depend on the split).
pub fn matmul(w: QRef<'_>, x: &[f32], tokens: usize, out: &mut [f32], threads: usize) {
    debug_assert_eq!(x.len(), tokens * w.cols);
    debug_assert_eq!(out.len(), tokens * w.rows);
    if tokens == 0 {
        return;
    }
    let tiles = w.rows.div_ceil(ROWS);
    if threads <= 1 || tiles < 2 {
        // Rows-major scratch: each tile writes its rows for every token.
        let mut t_out = vec![0f32; w.rows * tokens];
        matmul_into_rows(w, x, tokens, 0, w.rows, &mut t_out);
        transpose_into(&t_out, w.rows, tokens, out);
        return;
    }
    // Split the tiles into contiguous parts, a few per thread for balance.
    let parts = (threads * 4).min(tiles);
    let per = tiles.div_ceil(parts);
    let mut t_out = vec![0f32; w.rows * tokens];
    t_out
        .par_chunks_mut(per * ROWS * tokens)
        .enumerate()
        .for_each(|(i, chunk)| {
            let first = i * per * ROWS;
            let n = chunk.len() / tokens;
            matmul_into_rows(w, x, tokens, first, n, chunk);
        });
    transpose_into(&t_out, w.rows, tokens, out);
}

fn transpose_into(rows_major: &[f32], rows: usize, tokens: usize, out: &mut [f32]) {
    for n in 0..rows {
        for t in 0..tokens {
            out[t * rows + n] = rows_major[n * tokens + t];
        }
    }
}

/// Rows `first..first + n` of the product, written row-major (`out[(r - first) * tokens + t]`).
pub fn matmul_into_rows(
    w: QRef<'_>,
    x: &[f32],
    tokens: usize,
    first: usize,
    n: usize,
    out: &mut [f32],
) {
    crate::dispatch!(rows_kernel(w, x, tokens, first, n, out))
}

#[inline(always)]
fn rows_kernel(w: QRef<'_>, x: &[f32], tokens: usize, first: usize, n: usize, out: &mut [f32]) {
    let rb = w.row_bytes();
    let blocks = w.cols.div_ceil(BLOCK);
    let mut r = 0;
    while r < n {
        let tile = ROWS.min(n - r);
        let rows: [&[u8]; ROWS] = std::array::from_fn(|i| {
            let row = first + r + i.min(tile - 1);
            &w.bytes[row * rb..(row + 1) * rb]
        });
        let mut t = 0;
        while t < tokens {
            let group = TOKENS.min(tokens - t);
            let mut acc = [[[0f32; LANES]; TOKENS]; ROWS];
            let mut wbuf = [[0f32; BLOCK]; ROWS];
            for b in 0..blocks {
                let width = BLOCK.min(w.cols - b * BLOCK);
                for i in 0..tile {
                    dequant_block(w.ty, rows[i], b, &mut wbuf[i][..width]);
                }
                for j in 0..group {
                    let xs = &x[(t + j) * w.cols + b * BLOCK..];
                    for i in 0..tile {
                        lanes_block(&mut acc[i][j], &wbuf[i], xs, width);
                    }
                }
            }
            for i in 0..tile {
                for j in 0..group {
                    out[(r + i) * tokens + t + j] = hsum(&acc[i][j]);
                }
            }
            t += group;
        }
        r += tile;
    }
}

/// One block of a row's dot product into its lanes (`width` is 32 except for an f32 tail).
#[inline(always)]
fn lanes_block(acc: &mut [f32; LANES], w: &[f32; BLOCK], x: &[f32], width: usize) {
    if width == BLOCK {
        fma_lanes(acc, &w[..LANES], &x[..LANES]);
        fma_lanes(acc, &w[LANES..BLOCK], &x[LANES..BLOCK]);
    } else {
        for k in 0..width {
            acc[k % LANES] = w[k].mul_add(x[k], acc[k % LANES]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::writer::quantize;

    fn random(n: usize, seed: u64) -> Vec<f32> {
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

    fn reference(w: &QRef<'_>, x: &[f32], tokens: usize) -> Vec<f32> {
        let mut row = vec![0f32; w.cols];
        let mut out = vec![0f32; tokens * w.rows];
        for n in 0..w.rows {
            w.dequantize_row(n, &mut row);
            for t in 0..tokens {
                let xs = &x[t * w.cols..(t + 1) * w.cols];
                out[t * w.rows + n] = row
                    .iter()
                    .zip(xs)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum::<f64>() as f32;
            }
        }
        out
    }

    #[test]
    fn matches_a_f64_reference_for_every_type() {
        let (rows, cols) = (13, 96);
        let values = random(rows * cols, 1);
        for ty in [
            TensorType::Q4_1,
            TensorType::Q4_0,
            TensorType::Q8_0,
            TensorType::F16,
            TensorType::F32,
        ] {
            let bytes = quantize(ty, &values);
            let w = QRef {
                ty,
                rows,
                cols,
                bytes: &bytes,
            };
            let x = random(5 * cols, 2);
            let mut out = vec![0f32; 5 * rows];
            matmul(w, &x, 5, &mut out, 2);
            for (a, b) in out.iter().zip(reference(&w, &x, 5)) {
                assert!((a - b).abs() < 1e-4, "{ty:?}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn batch_size_threads_and_position_do_not_change_a_single_bit() {
        let (rows, cols) = (37, 128);
        let bytes = quantize(TensorType::Q4_1, &random(rows * cols, 3));
        let w = QRef {
            ty: TensorType::Q4_1,
            rows,
            cols,
            bytes: &bytes,
        };
        let x = random(11 * cols, 4);
        let mut all = vec![0f32; 11 * rows];
        matmul(w, &x, 11, &mut all, 1);
        for threads in [1, 2, 3] {
            for t in 0..11 {
                let mut one = vec![0f32; rows];
                matmul(w, &x[t * cols..(t + 1) * cols], 1, &mut one, threads);
                assert_eq!(
                    one,
                    all[t * rows..(t + 1) * rows],
                    "token {t}, {threads} threads"
                );
            }
            let mut again = vec![0f32; 6 * rows];
            matmul(w, &x[5 * cols..], 6, &mut again, threads);
            assert_eq!(again, all[5 * rows..]);
        }
    }
}

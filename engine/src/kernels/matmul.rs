//! `y = x · Wᵀ` with W quantized (or f32), x and y f32, in a fixed reduction order.
//!
//! Rows of W are taken in tiles of [`ROWS`]; for each block of 32 along `k` the tile's weights
//! are dequantized once into registers-sized buffers and used by every token of the call. So a
//! weight is dequantized once per call (not once per token), and each `(row, token)` keeps its
//! own [`LANES`]-wide accumulator whose sequence of fused multiply-adds is the same whatever
//! else is computed (see the module docs of `kernels`).

use half::f16;

use super::lines::{Lines, aligned};
use super::{LANES, fma_lanes, hsum};
use crate::gguf::TensorType;
use crate::step_pool::StepPool;

/// How a matrix's blocks are stored in memory.
///
/// The GGUF types as they are in the file, plus the repacked forms that the model builds at
/// load for the hot types: the f16 scale and minimum widened to f32 (exact), so the kernel
/// broadcasts them straight from memory instead of converting every block. Weights stay
/// 4- and 8-bit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// As in the file.
    Gguf(TensorType),
    /// Q4_1 with f32 `d` and `m`: 24 bytes per 32 weights. `d` holds an f16's value (only
    /// [`repack`] builds this form): the AVX-512 kernel relies on `d * q` being exact.
    Q4_1Wide,
    /// Q8_0 with f32 `d`: 36 bytes per 32 weights.
    Q8_0Wide,
    /// [`Format::Q4_1Wide`]'s blocks, each row's in groups of four ([`GROUP`] blocks, 96
    /// bytes): first the four blocks' 64 bytes of nibbles interleaved, 32-bit word `l`
    /// holding byte `l` of block `k` in its byte `k`; then their `(d, m)` pairs. A row's last
    /// blocks, fewer than four, are as in `Q4_1Wide`. So AVX-512 reads four blocks' indices
    /// with one load and takes each block's by shifts; `vpermps` reads an index's low 4 bits
    /// ([`repack`] says why only AVX-512 gets it).
    Q4_1Grouped,
}

impl Format {
    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            Format::Gguf(t) => t.block_elems(),
            Format::Q4_1Wide | Format::Q4_1Grouped | Format::Q8_0Wide => 32,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Format::Gguf(t) => t.block_bytes(),
            Format::Q4_1Wide | Format::Q4_1Grouped => 24,
            Format::Q8_0Wide => 36,
        }
    }
}

/// Blocks of a [`Format::Q4_1Grouped`] group.
pub(crate) const GROUP: usize = 4;

/// Repacks GGUF blocks (rows of `cols`) into the format this process's kernels prefer (or
/// returns them as they are).
///
/// Q4_1 is grouped only where the kernels are AVX-512's: there each block had taken a
/// zero-extension of its 16 nibble bytes on Zen 4's one 512-bit shuffle pipe, beside its two
/// permutes. AVX2's kernel reads a block's two 8-lane halves from its own 16 bytes.
pub fn repack(ty: TensorType, bytes: &[u8], cols: usize) -> (Format, Vec<u8>) {
    repack_for(super::isa(), ty, bytes, cols)
}

/// [`repack`] for the kernels of `isa` (the tests build both layouts on one machine).
pub(crate) fn repack_for(
    isa: super::Isa,
    ty: TensorType,
    bytes: &[u8],
    cols: usize,
) -> (Format, Vec<u8>) {
    let h = |b: &[u8]| {
        f16::from_bits(u16::from_le_bytes([b[0], b[1]]))
            .to_f32()
            .to_le_bytes()
    };
    match ty {
        TensorType::Q4_1 => {
            let mut out = Vec::with_capacity(bytes.len() / 20 * 24);
            for blk in bytes.chunks_exact(20) {
                out.extend(h(&blk[0..2]));
                out.extend(h(&blk[2..4]));
                out.extend(&blk[4..20]);
            }
            if isa == super::Isa::Avx512 && cols.is_multiple_of(BLOCK) && cols > 0 {
                (Format::Q4_1Grouped, group_rows(&out, cols / BLOCK))
            } else {
                (Format::Q4_1Wide, out)
            }
        }
        TensorType::Q8_0 => {
            let mut out = Vec::with_capacity(bytes.len() / 34 * 36);
            for blk in bytes.chunks_exact(34) {
                out.extend(h(&blk[0..2]));
                out.extend(&blk[2..34]);
            }
            (Format::Q8_0Wide, out)
        }
        other => (Format::Gguf(other), bytes.to_vec()),
    }
}

/// [`Format::Q4_1Wide`] rows of `blocks` blocks as [`Format::Q4_1Grouped`] (the same size).
fn group_rows(wide: &[u8], blocks: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(wide.len());
    for row in wide.chunks_exact(blocks * 24) {
        let mut groups = row.chunks_exact(GROUP * 24);
        for group in &mut groups {
            let blk = |k: usize| &group[k * 24..(k + 1) * 24];
            for l in 0..16 {
                out.extend((0..GROUP).map(|k| blk(k)[8 + l]));
            }
            for k in 0..GROUP {
                out.extend(&blk(k)[..8]);
            }
        }
        out.extend(groups.remainder());
    }
    out
}

/// Rows of W per tile.
const ROWS: usize = 4;
/// Tokens per pass over a tile (bounded so the accumulators stay in registers).
const TOKENS: usize = 4;
/// Tokens per thread from which a product is split by token rather than by row: below it
/// (a decode batch) the dequantization of a tile, shared by the call's tokens, is a large
/// part of the cost, and splitting by row dequantizes each tile once in all instead of once
/// per thread (batch 32 on two threads: 1.55x one thread split by token).
pub const TOKENS_PER_THREAD: usize = 64;

/// Whether a step of `tokens` on `team` is split by token, and if so the tokens of each
/// thread's contiguous range (thread `i` takes `i * per..`). Every region of such a step
/// (products, norms, attention) uses the same ranges; see [`StepPool::for_each_thread`].
pub fn token_split(tokens: usize, team: &StepPool) -> Option<usize> {
    let threads = team.threads();
    (threads > 1 && tokens >= threads * TOKENS_PER_THREAD).then(|| tokens.div_ceil(threads))
}
/// Tokens from which a product split by row gives each thread four pieces rather than one
/// (see [`matmul_group`]). Batch-32 decode on two threads of a Zen 4 guest, 7 rounds
/// interleaved: 539-643 -> 605-638 tok/s ([`PIECES_PER_THREAD`] 8: 577-626).
const PIECES_FROM: usize = 16;
/// Pieces per thread of a row-split product from [`PIECES_FROM`] tokens.
const PIECES_PER_THREAD: usize = 4;
/// Elements per quantization block.
const BLOCK: usize = 32;

/// A matrix of `rows` rows of `cols` elements, stored as GGML blocks.
#[derive(Debug, Clone, Copy)]
pub struct QRef<'a> {
    /// Block format.
    pub ty: Format,
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
fn dequant_block(ty: Format, row: &[u8], b: usize, out: &mut [f32]) {
    let h = |lo: u8, hi: u8| f16::from_bits(u16::from_le_bytes([lo, hi])).to_f32();
    let f = |x: &[u8]| f32::from_le_bytes([x[0], x[1], x[2], x[3]]);
    match ty {
        Format::Q4_1Wide => {
            let blk = &row[b * 24..b * 24 + 24];
            let (d, m) = (f(&blk[0..4]), f(&blk[4..8]));
            let qs = &blk[8..24];
            for j in 0..16 {
                out[j] = f32::from(qs[j] & 0x0F).mul_add(d, m);
                out[j + 16] = f32::from(qs[j] >> 4).mul_add(d, m);
            }
        }
        Format::Q4_1Grouped if b >= row.len() / 24 / GROUP * GROUP => {
            dequant_block(Format::Q4_1Wide, row, b, out)
        }
        Format::Q4_1Grouped => {
            let (g, k) = (b / GROUP, b % GROUP);
            let group = &row[g * GROUP * 24..(g + 1) * GROUP * 24];
            let dm = &group[64 + 8 * k..72 + 8 * k];
            let (d, m) = (f(&dm[0..4]), f(&dm[4..8]));
            for j in 0..16 {
                let q = group[4 * j + k];
                out[j] = f32::from(q & 0x0F).mul_add(d, m);
                out[j + 16] = f32::from(q >> 4).mul_add(d, m);
            }
        }
        Format::Q8_0Wide => {
            let blk = &row[b * 36..b * 36 + 36];
            let d = f(&blk[0..4]);
            for j in 0..32 {
                out[j] = f32::from(blk[4 + j] as i8) * d;
            }
        }
        Format::Gguf(TensorType::Q4_1) => {
            let blk = &row[b * 20..b * 20 + 20];
            let (d, m) = (h(blk[0], blk[1]), h(blk[2], blk[3]));
            let qs = &blk[4..20];
            for j in 0..16 {
                out[j] = f32::from(qs[j] & 0x0F).mul_add(d, m);
                out[j + 16] = f32::from(qs[j] >> 4).mul_add(d, m);
            }
        }
        Format::Gguf(TensorType::Q4_0) => {
            let blk = &row[b * 18..b * 18 + 18];
            let d = h(blk[0], blk[1]);
            let qs = &blk[2..18];
            for j in 0..16 {
                out[j] = (f32::from(qs[j] & 0x0F) - 8.0) * d;
                out[j + 16] = (f32::from(qs[j] >> 4) - 8.0) * d;
            }
        }
        Format::Gguf(TensorType::Q8_0) => {
            let blk = &row[b * 34..b * 34 + 34];
            let d = h(blk[0], blk[1]);
            for j in 0..32 {
                out[j] = f32::from(blk[2 + j] as i8) * d;
            }
        }
        Format::Gguf(TensorType::F32) => {
            for (j, o) in out.iter_mut().enumerate() {
                let at = (b * BLOCK + j) * 4;
                *o = f32::from_le_bytes([row[at], row[at + 1], row[at + 2], row[at + 3]]);
            }
        }
        Format::Gguf(TensorType::F16) => {
            for (j, o) in out.iter_mut().enumerate() {
                let at = (b * BLOCK + j) * 2;
                *o = h(row[at], row[at + 1]);
            }
        }
    }
}

/// `out[t * w.rows + n] = Σ_k w[n][k] · x[t * w.cols + k]` for `tokens` tokens, on the
/// team's threads. Many tokens are split between threads by token, few by row; neither split
/// changes a single result bit.
pub fn matmul(w: QRef<'_>, x: &[f32], tokens: usize, out: &mut [f32], team: &StepPool) {
    matmul_group(&[w], x, tokens, &mut [out], team);
}

/// Several products of the same input (`outs[i] = x · ws[i]ᵀ`) in one parallel region, so
/// threads are woken once for the Q, K and V projections (or gate and up), not once per
/// matrix. Same bits as [`matmul`] on each.
pub fn matmul_group(
    ws: &[QRef<'_>],
    x: &[f32],
    tokens: usize,
    outs: &mut [&mut [f32]],
    team: &StepPool,
) {
    assert_eq!(ws.len(), outs.len(), "one output per matrix");
    for (w, out) in ws.iter().zip(outs.iter()) {
        assert_eq!(x.len(), tokens * w.cols, "matmul input shape");
        assert_eq!(out.len(), tokens * w.rows, "matmul output shape");
    }
    if tokens == 0 {
        return;
    }
    // Each token's vector from a cache-line boundary (`super::lines`): an input that is not
    // is copied, by each thread for its own tokens, or once for all where threads split the
    // rows. The engine's own inputs already are.
    let mut staged = Lines::default();
    let threads = team.threads();
    if threads <= 1 {
        let x = aligned(x, &mut staged);
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            rows_strided(*w, x, tokens, 0, w.rows, out, w.rows);
        }
        return;
    }
    let cols = ws[0].cols;
    if let Some(per) = token_split(tokens, team) {
        // Split by tokens: each thread computes every matrix for its range of the tokens.
        let mut parts: Vec<(&[f32], Vec<&mut [f32]>)> =
            x.chunks(per * cols).map(|xs| (xs, Vec::new())).collect();
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            for (part, chunk) in parts.iter_mut().zip(out.chunks_mut(per * w.rows)) {
                part.1.push(chunk);
            }
        }
        team.for_each_thread(parts, |(xs, mut outs)| {
            let mut staged = Lines::default();
            let xs = aligned(xs, &mut staged);
            let n = xs.len() / cols;
            for (w, out) in ws.iter().zip(outs.iter_mut()) {
                rows_strided(*w, xs, n, 0, w.rows, out, w.rows);
            }
        });
        return;
    }
    // Few tokens: split every matrix's rows into one piece of whole tiles per thread (still
    // claimed, so a thread that starts late takes fewer). Each piece starts its stream of
    // weights cold: at four pieces per thread (2 threads on a Xeon guest, 6 rounds
    // interleaved) batch 1 ran at 177-197 tok/s against 195-226 at one, after 480 tokens
    // 141-162 against 149-174, batch 8 464-517 against 492-523.
    //
    // From [`PIECES_FROM`] tokens a product is compute-bound and the cold start is a small
    // part of a piece, while one piece per thread leaves a thread whose core the host slows
    // for a moment the region's last: [`PIECES_PER_THREAD`] each.
    //
    // Each piece writes its rows of every token straight into the output (which a `&mut`
    // slice per piece cannot express: the pieces' rows interleave token by token). Copying
    // them from per-piece scratch after the region had been a serial 4-5 % of a batch-32
    // step on two threads.
    let pieces_per = if tokens >= PIECES_FROM {
        threads * PIECES_PER_THREAD
    } else {
        threads
    };
    // (matrix, first row, rows) of each piece.
    let mut pieces: Vec<(usize, usize, usize)> = Vec::new();
    for (m, w) in ws.iter().enumerate() {
        let per = w.rows.div_ceil(pieces_per).div_ceil(ROWS).max(1) * ROWS;
        let mut first = 0;
        while first < w.rows {
            let n = per.min(w.rows - first);
            pieces.push((m, first, n));
            first += n;
        }
    }
    let x = aligned(x, &mut staged);
    let split = split_once(ws, x, tokens);
    let bases: Vec<Shared> = outs.iter_mut().map(|o| Shared(o.as_mut_ptr())).collect();
    team.for_each(pieces, |(m, first, n)| {
        let w = ws[m];
        // SAFETY: `outs[m]` holds `tokens * w.rows` f32 (asserted above) and stays borrowed
        // by this call; the pieces' rows `first..first + n` are disjoint, so each element is
        // written by one piece and read by none during the region; `split` is `x` split.
        unsafe {
            rows_into(
                w,
                x,
                split.as_deref(),
                tokens,
                first,
                n,
                bases[m].0.add(first),
                w.rows,
            )
        }
    });
}

/// The tokens split into halves once for every piece of a row-split product, where the AVX2
/// many-token kernel will read them so (`avx2::split_tokens`); `None` elsewhere.
///
/// Each piece had split its own copy: on two threads at batch 32 a layer zeroed and filled
/// 56 copies of its inputs where one thread makes 7 (a K or V piece is 24 rows, ~15 us).
/// Same bits: the kernel reads the same values. With the AVX2 panel kept between calls
/// (`avx2::PANEL`), on a 2-vCPU Zen 3 guest, old and new binaries alternating
/// (`throughput --decode-profile`, 2 threads): batch 32 median 307 -> 323 tok/s over 10
/// pairs (faster in 7), batch 8 239 -> 259 over 5 (faster in 4); 1 thread unchanged.
fn split_once(ws: &[QRef<'_>], x: &[f32], tokens: usize) -> Option<Lines> {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = matches!(super::isa(), super::Isa::Avx2 | super::Isa::Avx2NoF16c);
        let cols = ws[0].cols;
        let kernel_reads_split = ws
            .iter()
            .any(|w| matches!(w.ty, Format::Q4_1Wide | Format::Q8_0Wide));
        if avx2
            && tokens >= super::avx2::MANY_FROM
            && cols.is_multiple_of(BLOCK)
            && kernel_reads_split
        {
            return Some(super::avx2::split_tokens(&x[..tokens * cols], cols));
        }
    }
    let _ = (ws, x, tokens);
    None
}

/// An output shared by the pieces of a split product, each writing its own rows.
#[derive(Clone, Copy)]
struct Shared(*mut f32);
// SAFETY: the pieces write disjoint elements (see `matmul_group`), and the region ends before
// the output is used again.
unsafe impl Send for Shared {}
// SAFETY: as for `Send`.
unsafe impl Sync for Shared {}

/// Rows `first..first + n` for every token, written to `out[t * out_stride + (r - first)]`.
pub fn rows_strided(
    w: QRef<'_>,
    x: &[f32],
    tokens: usize,
    first: usize,
    n: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let out = strided(out, tokens, n, out_stride);
    // SAFETY: `strided` checked every written index inside `out`, which is borrowed mutably.
    unsafe { rows_into(w, x, None, tokens, first, n, out, out_stride) }
}

/// `out`'s start, once checked to hold `t * out_stride + i` for every `t < tokens`, `i < n`.
fn strided(out: &mut [f32], tokens: usize, n: usize, out_stride: usize) -> *mut f32 {
    let fits = tokens == 0 || out.len() >= (tokens - 1) * out_stride + n;
    assert!(out_stride >= n && fits, "output too short for its stride");
    out.as_mut_ptr()
}

/// [`rows_strided`] through a raw output: `out[t * out_stride + (r - first)]`. `split`:
/// `x` already split for the AVX2 many-token kernel ([`split_once`]), which then reads it.
///
/// # Safety
/// `out` may be written at `t * out_stride + i` for `t < tokens`, `i < n`, and nothing else
/// reads or writes those elements during the call; `split`, where given, is
/// `avx2::split_tokens` of `x`'s first `tokens` rows.
#[allow(clippy::too_many_arguments)]
unsafe fn rows_into(
    w: QRef<'_>,
    x: &[f32],
    split: Option<&[f32]>,
    tokens: usize,
    first: usize,
    n: usize,
    out: *mut f32,
    out_stride: usize,
) {
    assert!(first + n <= w.rows && x.len() >= tokens * w.cols && out_stride >= n);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = split;
    #[cfg(target_arch = "x86_64")]
    {
        // Many tokens (from `$simd::MANY_FROM`): dequantize each tile (AVX-512) or panel of
        // rows (AVX2) once, then sweep the tokens; few: stream the weights past the tokens.
        // Same bits either way.
        // `$simd::rows` or `$simd::rows_many` over the repacked formats; falls through for others.
        macro_rules! simd {
            ($simd:ident $(, $grouped:ident)?) => {{
                use super::$simd;
                macro_rules! run {
                    ($B:ty) => {
                        if tokens >= $simd::MANY_FROM {
                            $simd::rows_many::<$B>(
                                w.bytes, w.cols, first, n, x, tokens, out, out_stride,
                            )
                        } else {
                            $simd::rows::<$B>(w.bytes, w.cols, first, n, x, tokens, out, out_stride)
                        }
                    };
                }
                // SAFETY: the assert above bounds every row and token the kernel reads, the
                // function's contract every output it writes; the caller checked that `isa()`
                // detected the kernel's instruction set (AVX-512F and F16C; AVX2 and FMA).
                match w.ty {
                    Format::Q4_1Wide => return unsafe { run!($simd::Q4_1Wide) },
                    Format::Q8_0Wide => return unsafe { run!($simd::Q8_0Wide) },
                    $(Format::$grouped => return unsafe { run!($simd::$grouped) },)?
                    _ => {}
                }
            }};
        }
        // Tokens split once for every piece ([`split_once`]), made only where `isa()`
        // detected AVX2 and FMA, the columns are whole blocks and the tokens many.
        if let Some(split) = split {
            use super::avx2::{Q4_1Wide, Q8_0Wide, rows_many_split};
            assert!(split.len() >= tokens * w.cols, "split tokens");
            macro_rules! run {
                ($B:ty) => {
                    // SAFETY: as below, `split` holding the tokens split (the caller's
                    // contract).
                    return unsafe {
                        rows_many_split::<$B>(
                            w.bytes, w.cols, first, n, split, tokens, out, out_stride,
                        )
                    }
                };
            }
            match w.ty {
                Format::Q4_1Wide => run!(Q4_1Wide),
                Format::Q8_0Wide => run!(Q8_0Wide),
                _ => {}
            }
        }
        if w.cols.is_multiple_of(BLOCK) {
            match super::isa() {
                super::Isa::Avx512 => simd!(avx512, Q4_1Grouped),
                super::Isa::Avx2 | super::Isa::Avx2NoF16c => simd!(avx2),
                super::Isa::Portable => {}
            }
        }
    }
    // SAFETY: the function's contract is the kernel's. (The macro's SIMD arms are inside an
    // `unsafe` block already, its portable arm is not.)
    #[allow(unused_unsafe)]
    let () = crate::dispatch!(unsafe { rows_kernel(w, x, tokens, first, n, out, out_stride) });
}

/// The portable kernel, for every format and instruction set.
///
/// # Safety
/// As for [`rows_into`].
#[inline(always)]
unsafe fn rows_kernel(
    w: QRef<'_>,
    x: &[f32],
    tokens: usize,
    first: usize,
    n: usize,
    out: *mut f32,
    out_stride: usize,
) {
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
                    // SAFETY: `r + i < n` and `t + j < tokens`, inside the contract.
                    unsafe { *out.add((t + j) * out_stride + r + i) = hsum(&acc[i][j]) };
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
mod tests;

//! The AVX-512 kernels' block formats: how one block of one row becomes two 16-lane halves of
//! weights, for each repacked format (`matmul::Format`).

use std::arch::x86_64::*;

use super::broadcast::mul_broadcast;

/// The weights of one block of one row, as two 16-lane halves.
pub trait Block {
    /// Bytes per block.
    const BYTES: usize;
    /// Blocks stored together as a group (`GROUP * BYTES` bytes) at the start of each row;
    /// the row's last blocks, fewer than a group, alone. 1: every block alone.
    const GROUP: usize = 1;

    /// Dequantizes the block at `p` (one stored alone).
    ///
    /// # Safety
    /// `p` must point at `BYTES` readable bytes; AVX-512F and F16C must be available.
    unsafe fn load(p: *const u8) -> (__m512, __m512);

    /// Dequantizes block `k` of the group at `g` (`k` a constant where it is called in a
    /// hot loop, so its shifts are immediates).
    ///
    /// # Safety
    /// `g` must point at `GROUP * BYTES` readable bytes, `k < GROUP`; AVX-512F and F16C must
    /// be available.
    #[inline(always)]
    unsafe fn load_grouped(g: *const u8, k: usize) -> (__m512, __m512) {
        // SAFETY: block `k` of a group of lone blocks is `k` blocks on.
        unsafe { Self::load(g.add(k * Self::BYTES)) }
    }

    /// Dequantizes block `b` of a row of `blocks` at `row`, wherever its group put it.
    ///
    /// # Safety
    /// `row` must point at `blocks * BYTES` readable bytes, `b < blocks`; AVX-512F and F16C
    /// must be available.
    #[inline(always)]
    unsafe fn load_nth(row: *const u8, b: usize, blocks: usize) -> (__m512, __m512) {
        let grouped = blocks / Self::GROUP * Self::GROUP;
        // SAFETY: per the contract; a group starts where its first block would alone.
        unsafe {
            if b < grouped {
                let k = b % Self::GROUP;
                Self::load_grouped(row.add((b - k) * Self::BYTES), k)
            } else {
                Self::load(row.add(b * Self::BYTES))
            }
        }
    }
}

/// A Q4_1 block's 16 possible weights `d * q + m` for q = 0..15, `d` and `m` the f32 at
/// `dm` and `dm + 4`.
///
/// Each weight depends on its nibble only, so a permute of this table picks the same bits
/// as computing it per weight. A product then a sum, not one fused multiply-add, with the
/// same bits: `d` came from an f16 (11 significant bits), so `d * q` (q at most 15) is exact
/// and the sum rounds once, as the fused operation did. Both take their broadcast from
/// memory inside the instruction, where the fused one needed a separate `vbroadcastss`; on
/// Zen 4 that broadcast and the permutes share the one 512-bit shuffle pipe, and the sum runs
/// on the adder pipes, which were idle. `throughput --kernels`, one token, 3 rounds
/// interleaved: ffn_up 19.3-21.2 -> 22.4-23.4 GMAC/s, ffn_down 20.9-22.0 -> 21.6-24.5 (a C
/// model of the tile, weights in L1: 20.3-21.2 -> 22.9-24.3).
///
/// # Safety
/// `dm` points at 8 readable bytes; AVX-512F is available.
#[inline(always)]
unsafe fn q4_1_table(dm: *const u8) -> __m512 {
    // SAFETY: per the contract.
    unsafe {
        let d = _mm512_set1_ps(dm.cast::<f32>().read_unaligned());
        let m = _mm512_set1_ps(dm.add(4).cast::<f32>().read_unaligned());
        _mm512_add_ps(
            _mm512_mul_ps(
                _mm512_setr_ps(
                    0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0,
                    15.0,
                ),
                d,
            ),
            m,
        )
    }
}

/// Q4_1 with `d` and `m` widened to f32 (24-byte blocks).
pub struct Q4_1Wide;

impl Block for Q4_1Wide {
    const BYTES: usize = 24;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> (__m512, __m512) {
        // SAFETY: per the trait contract (the block is 24 readable bytes).
        unsafe {
            // One permute of the block's table ([`q4_1_table`]) per 16 weights: `vpermps`
            // reads an index's low 4 bits, so the low nibble needs no mask. Five vector
            // operations per block instead of seven (mask, shift, two conversions, two fused
            // dequantizations).
            let table = q4_1_table(p);
            let q = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(8).cast()));
            (
                _mm512_permutexvar_ps(q, table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), table),
            )
        }
    }
}

/// [`Q4_1Wide`]'s blocks in groups of four ([`crate::kernels::Format::Q4_1Grouped`]).
pub struct Q4_1Grouped;

impl Block for Q4_1Grouped {
    const BYTES: usize = 24;
    const GROUP: usize = crate::kernels::matmul::GROUP;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> (__m512, __m512) {
        // SAFETY: a lone block is a `Q4_1Wide` one.
        unsafe { Q4_1Wide::load(p) }
    }

    /// Lane `l` of the group's first 64 bytes holds byte `l` of each block, block `k`'s in
    /// bits `8k..8k + 8`: shifted down by `8k` (and `8k + 4`), its low 4 bits are the index
    /// `vpermps` reads. Shifts instead of `Q4_1Wide`'s zero-extension per block, which took
    /// the shuffle pipe the permutes need. `throughput --kernels`, one token, 5 rounds
    /// interleaved on a Zen 4 core: attn_q 20.5-23.2 -> 25.6-25.8 GMAC/s, ffn_up 23.2-23.6 ->
    /// 25.3-26.1, ffn_down 22.1-24.5 -> 28.0-28.4; decode at batch 1 (`--threads 1`, 3 pairs)
    /// 147-154 -> 160-162 tok/s, after 512 tokens 136-139 -> 144-146.
    #[inline(always)]
    unsafe fn load_grouped(g: *const u8, k: usize) -> (__m512, __m512) {
        // SAFETY: per the trait contract (the group is 96 readable bytes).
        unsafe {
            let table = q4_1_table(g.add(64 + 8 * k));
            let q = _mm512_loadu_si512(g.cast());
            let shift = (8 * k) as i32;
            (
                _mm512_permutexvar_ps(_mm512_srlv_epi32(q, _mm512_set1_epi32(shift)), table),
                _mm512_permutexvar_ps(_mm512_srlv_epi32(q, _mm512_set1_epi32(shift + 4)), table),
            )
        }
    }
}

/// Q8_0 with `d` widened to f32 (36-byte blocks).
pub struct Q8_0Wide;

impl Block for Q8_0Wide {
    const BYTES: usize = 36;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> (__m512, __m512) {
        // SAFETY: per the trait contract (the block is 36 readable bytes).
        unsafe {
            let lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(4).cast()));
            let hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(20).cast()));
            (
                mul_broadcast(_mm512_cvtepi32_ps(lo), p.cast()),
                mul_broadcast(_mm512_cvtepi32_ps(hi), p.cast()),
            )
        }
    }
}

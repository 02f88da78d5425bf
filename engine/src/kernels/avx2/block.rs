//! The quantized blocks the AVX2 tiles read, dequantized to 8-lane f32 registers exactly as
//! the portable kernel does (`d * q + m` fused for Q4_1, `q * d` for Q8_0).

use std::arch::x86_64::*;

/// The weights of one block of one row as four 8-lane registers: weights 0-7, 8-15, 16-23,
/// 24-31.
pub trait Block {
    /// Bytes per block.
    const BYTES: usize;
    /// Register `C` of the block at `p` alone (weights `8C..8C + 8`): the streaming tile
    /// dequantizes one register just before its multiply-adds, so that only one is live.
    ///
    /// # Safety
    /// `p` must point at `BYTES` readable bytes; AVX2 and FMA must be available.
    unsafe fn quarter<const C: usize>(p: *const u8) -> __m256;

    /// Dequantizes the whole block at `p` (the four quarters; the compiler merges their
    /// shared loads and broadcasts).
    ///
    /// # Safety
    /// As [`Block::quarter`].
    #[inline(always)]
    unsafe fn load(p: *const u8) -> [__m256; 4] {
        // SAFETY: per the contract.
        unsafe {
            [
                Self::quarter::<0>(p),
                Self::quarter::<1>(p),
                Self::quarter::<2>(p),
                Self::quarter::<3>(p),
            ]
        }
    }
}

/// Q4_1 with `d` and `m` widened to f32 (24-byte blocks): byte `j` holds weight `j` (low
/// nibble) and weight `16 + j` (high nibble).
pub struct Q4_1Wide;

impl Block for Q4_1Wide {
    const BYTES: usize = 24;

    #[inline(always)]
    unsafe fn quarter<const C: usize>(p: *const u8) -> __m256 {
        // SAFETY: per the trait contract (the block is 24 readable bytes).
        unsafe {
            let d = _mm256_set1_ps(p.cast::<f32>().read_unaligned());
            let m = _mm256_set1_ps(p.add(4).cast::<f32>().read_unaligned());
            // Registers 0 and 2 are bytes 0-7's low and high nibbles, 1 and 3 bytes 8-15's.
            let q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(8 + 8 * (C & 1)).cast()));
            let q = if C < 2 {
                _mm256_and_si256(q, _mm256_set1_epi32(0x0F))
            } else {
                _mm256_srli_epi32::<4>(q)
            };
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m)
        }
    }
}

/// Q8_0 with `d` widened to f32 (36-byte blocks).
pub struct Q8_0Wide;

impl Block for Q8_0Wide {
    const BYTES: usize = 36;

    #[inline(always)]
    unsafe fn quarter<const C: usize>(p: *const u8) -> __m256 {
        // SAFETY: per the trait contract (the block is 36 readable bytes).
        unsafe {
            let d = _mm256_set1_ps(p.cast::<f32>().read_unaligned());
            let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(4 + 8 * C).cast()));
            _mm256_mul_ps(_mm256_cvtepi32_ps(q), d)
        }
    }
}

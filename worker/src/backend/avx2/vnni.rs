//! The grouped kernels with AVX-512 VNNI on 256-bit vectors: `vpdpbusd` multiplies and
//! accumulates four byte pairs per lane in one instruction, and the 32 vector registers
//! hold eight activation rows' accumulators next to a group's expanded weights. The i32
//! sums are the same as the AVX2 kernels', so the results are identical.

use std::arch::x86_64::*;

use super::common::*;
use super::int8::*;
use super::kquant::*;
use crate::backend::interleaved::{BlockQ4Kx8, BlockQ6Kx8, InterleavedGroup};
use crate::backend::kquant::{ACT_BLOCKS, BlockQ4K, BlockQ5K, BlockQ6K};
use crate::backend::quant::{
    BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, BlockQ8Act, GROUP_ROWS, QK, WeightGroup,
};

/// Whether this CPU can run the kernels in this module.
pub fn available() -> bool {
    super::available()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
}

/// Two chains of four `vpdpbusd`s, not one of eight: a chain's latency, not the
/// pipes, bounded the kernel.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn q4_1_sum(nibbles: &[__m256i; 8], x: &[i8; QK]) -> __m256i {
    let mut even = _mm256_setzero_si256();
    let mut odd = _mm256_setzero_si256();
    for k in (0..8).step_by(2) {
        even = _mm256_dpbusd_epi32(even, nibbles[k], broadcast_word(x, k));
        odd = _mm256_dpbusd_epi32(odd, nibbles[k + 1], broadcast_word(x, k + 1));
    }
    _mm256_add_epi32(even, odd)
}

/// One block column of a `Q8_0` group shifted to unsigned bytes (q + 128), so every
/// activation row takes plain `vpdpbusd`s with no sign fix-up; the shift adds 128·Σx,
/// which is subtracted in integers, so the sums are exactly the AVX2 kernel's.
#[derive(Clone, Copy)]
struct ExpandedQ8_0 {
    unsigned: [__m256i; 8],
    d: __m256,
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn expand_q8_0(blocks: &[&BlockQ8_0; GROUP_ROWS]) -> ExpandedQ8_0 {
    let shift = _mm256_set1_epi8(i8::MIN);
    ExpandedQ8_0 {
        unsigned: q8_0_words(blocks).map(|v| _mm256_xor_si256(v, shift)),
        d: f16x8(blocks.map(|b| b.d)),
    }
}

/// From `sum` = Σ q·x.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q8_0_finish(e: &ExpandedQ8_0, x: &BlockQ8Act, sum: __m256i, acc: &mut __m256) {
    let sum = _mm256_cvtepi32_ps(sum);
    *acc = _mm256_fmadd_ps(sum, _mm256_mul_ps(e.d, _mm256_set1_ps(x.d)), *acc);
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn q8_0_block<const A: usize>(e: &ExpandedQ8_0, x: [&BlockQ8Act; A], acc: &mut [__m256; A]) {
    for (acc, x) in acc.iter_mut().zip(x) {
        let shifted = q4_1_sum(&e.unsigned, &x.qs);
        let sum = _mm256_sub_epi32(shifted, _mm256_set1_epi32(128 * x.sum));
        q8_0_finish(e, x, sum, acc);
    }
}

group_kernels!(
    "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni",
    8,
    [7, 6, 5, 4, 3, 2, 1],
    q4_1_sum: q4_1_sum,
    q5_sum: kq5_sum
);

/// `vpdpbusd` sums unsigned bytes up to 255 in 32 bits, so 4-bit and 5-bit columns
/// take the same chains.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn kq4_sum(q: &[__m256i; 8], x: &[i8; QK]) -> __m256i {
    q4_1_sum(q, x)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn kq5_sum(q: &[__m256i; 8], x: &[i8; QK]) -> __m256i {
    q4_1_sum(q, x)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
fn kq6_sums(q: &[__m256i; 8], x: &[i8; QK]) -> (__m256i, __m256i) {
    let mut lo = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q[0], broadcast_word(x, 0));
    let mut hi = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q[4], broadcast_word(x, 4));
    for k in 1..4 {
        lo = _mm256_dpbusd_epi32(lo, q[k], broadcast_word(x, k));
        hi = _mm256_dpbusd_epi32(hi, q[k + 4], broadcast_word(x, k + 4));
    }
    (lo, hi)
}

kquant_kernels!(
    "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni",
    8,
    [7, 6, 5, 4, 3, 2, 1]
);
pub mod pair;

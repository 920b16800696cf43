//! The int8 kernels of the 32-value block formats: activation quantisation, the one-row dot
//! products and the grouped matmul kernels of `Q4_0`, `Q4_1`, `Q5_0`, `Q5_1` and `Q8_0`.
//!
//! The int8 dot products use `maddubs` (u8 × i8 → i16 pairs) followed by `madd` with ones
//! (i16 pairs → i32); both operands stay within ±127 (or 0..15 for 4-bit weights), so the
//! 16-bit pair sums cannot saturate.

use std::arch::x86_64::*;

use half::f16;

use super::common::*;
use super::kquant::kq5_sum;
use crate::backend::quant::{
    BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, BlockQ8Act, GROUP_ROWS, QK, WeightGroup,
};

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_to_f32(h: f16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h.to_bits() as i32)))
}

/// 16 bytes of packed nibbles → 32 bytes 0..15: low nibbles in lanes 0..16, high in 16..32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles_to_bytes(qs: &[u8; QK / 2]) -> __m256i {
    // SAFETY: `qs` is 16 readable bytes; loadu has no alignment requirement.
    let packed = unsafe { _mm_loadu_si128(qs.as_ptr() as *const __m128i) };
    let both = _mm256_set_m128i(_mm_srli_epi16::<4>(packed), packed);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0f))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_i8x32(qs: &[i8; QK]) -> __m256i {
    // SAFETY: `qs` is 32 readable bytes; loadu has no alignment requirement.
    unsafe { _mm256_loadu_si256(qs.as_ptr() as *const __m256i) }
}

/// Σ u·s over 32 byte pairs as 8 f32 lanes; `u` must be non-negative and ≤ 127 or 4-bit.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn mul_sum_us8(u: __m256i, s: __m256i) -> __m256 {
    let pairs = _mm256_maddubs_epi16(u, s);
    _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
}

/// Σ a·b over 32 signed byte pairs, via the sign trick.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn mul_sum_i8(a: __m256i, b: __m256i) -> __m256 {
    mul_sum_us8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a))
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`](super::available)).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_act(x: &[f32], out: &mut [BlockQ8Act]) {
    let sign_mask = _mm256_set1_ps(-0.0);
    for (c, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        // SAFETY: each chunk holds 32 f32 = four 8-lane loads.
        let v = unsafe {
            [
                _mm256_loadu_ps(c.as_ptr()),
                _mm256_loadu_ps(c.as_ptr().add(8)),
                _mm256_loadu_ps(c.as_ptr().add(16)),
                _mm256_loadu_ps(c.as_ptr().add(24)),
            ]
        };
        let mut amax = _mm256_andnot_ps(sign_mask, v[0]);
        for lane in &v[1..] {
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, *lane));
        }
        let m4 = _mm_max_ps(
            _mm256_castps256_ps128(amax),
            _mm256_extractf128_ps::<1>(amax),
        );
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let m4 = _mm_max_ss(m4, _mm_shuffle_ps::<1>(m4, m4));
        let d = _mm_cvtss_f32(m4) / 127.0;
        let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        // Round half away from zero, as `f32::round` in the scalar reference.
        let round = |x: __m256| {
            let half = _mm256_or_ps(_mm256_and_ps(x, sign_mask), _mm256_set1_ps(0.5));
            _mm256_cvtps_epi32(
                _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(_mm256_add_ps(
                    x, half,
                )),
            )
        };
        let i0 = round(_mm256_mul_ps(v[0], inv));
        let i1 = round(_mm256_mul_ps(v[1], inv));
        let i2 = round(_mm256_mul_ps(v[2], inv));
        let i3 = round(_mm256_mul_ps(v[3], inv));
        let lanes_sum = |v: __m256i| {
            let s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
            let s4 = _mm_hadd_epi32(s4, s4);
            _mm_cvtsi128_si32(_mm_hadd_epi32(s4, s4))
        };
        let low = lanes_sum(_mm256_add_epi32(i0, i1));
        let total = low + lanes_sum(_mm256_add_epi32(i2, i3));
        // Pack 32 i32 → 32 i8; packs interleave 128-bit lanes, the permute restores order.
        let p16a = _mm256_packs_epi32(i0, i1);
        let p16b = _mm256_packs_epi32(i2, i3);
        let p8 = _mm256_packs_epi16(p16a, p16b);
        let ordered = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: `b.qs` is 32 writable bytes.
        unsafe { _mm256_storeu_si256(b.qs.as_mut_ptr() as *mut __m256i, ordered) };
        b.d = d;
        b.s = d * total as f32;
        b.sum = total;
        b.low_sum = low;
    }
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`](super::available)).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_0(w: &[BlockQ4_0], x: &[BlockQ8Act]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let eight = _mm256_set1_epi8(8);
    for (w, x) in w.iter().zip(x) {
        // SAFETY: block arrays have the sizes the loads read.
        let (wq, xq) = unsafe { (nibbles_to_bytes(&w.qs), load_i8x32(&x.qs)) };
        let p = mul_sum_i8(_mm256_sub_epi8(wq, eight), xq);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_to_f32(w.d) * x.d), p, acc);
    }
    hsum(acc)
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`](super::available)).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_1(w: &[BlockQ4_1], x: &[BlockQ8Act]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut offsets = 0f32;
    for (w, x) in w.iter().zip(x) {
        // SAFETY: block arrays have the sizes the loads read.
        let (wq, xq) = unsafe { (nibbles_to_bytes(&w.qs), load_i8x32(&x.qs)) };
        let p = mul_sum_us8(wq, xq);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_to_f32(w.d) * x.d), p, acc);
        offsets += f16_to_f32(w.m) * x.s;
    }
    hsum(acc) + offsets
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`](super::available)).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q8_0(w: &[BlockQ8_0], x: &[BlockQ8Act]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (w, x) in w.iter().zip(x) {
        // SAFETY: block arrays have the sizes the loads read.
        let (wq, xq) = unsafe { (load_i8x32(&w.qs), load_i8x32(&x.qs)) };
        let p = mul_sum_i8(wq, xq);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_to_f32(w.d) * x.d), p, acc);
    }
    hsum(acc)
}

/// `d` and `m` of eight `Q4_1`/`Q5_1` blocks as f32 lanes: one 32-bit word per block (the
/// two f16 fields are adjacent), then the halves are sorted apart and widened.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn d_m_scales(d: [f16; GROUP_ROWS], m: [f16; GROUP_ROWS]) -> (__m256, __m256) {
    let word = |r: usize| (d[r].to_bits() as u32 | (m[r].to_bits() as u32) << 16) as i32;
    let dm = _mm256_setr_epi32(
        word(0),
        word(1),
        word(2),
        word(3),
        word(4),
        word(5),
        word(6),
        word(7),
    );
    // Per 128-bit half: the four d values to the low 8 bytes, the four m values to the high.
    let split = _mm256_shuffle_epi8(
        dm,
        _mm256_setr_epi8(
            0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3,
            6, 7, 10, 11, 14, 15,
        ),
    );
    let ordered = _mm256_permute4x64_epi64::<0b11_01_10_00>(split);
    (
        _mm256_cvtph_ps(_mm256_castsi256_si128(ordered)),
        _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(ordered)),
    )
}

/// Blocks of a group expanded at a time when more activation rows than one kernel pass
/// take them: each expansion then serves every pass, and the span (5 KiB for `Q4_1`,
/// under 9 KiB for AVX2's `Q8_0`) stays in L1 beside the activations it meets.
const EXPANDED_SPAN: usize = 16;

/// One block column of a `Q4_1` group unpacked for the kernels: vector `k` holds nibbles
/// `4k..4k + 4` of each row in its 32-bit lane (the low nibbles of the packed bytes first),
/// and the scales are f32 lanes.
#[derive(Clone, Copy)]
pub(super) struct ExpandedQ4_1 {
    pub(super) nibbles: [__m256i; 8],
    pub(super) d: __m256,
    pub(super) m: __m256,
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn expand_q4_1(blocks: &[&BlockQ4_1; GROUP_ROWS]) -> ExpandedQ4_1 {
    let low = _mm256_set1_epi8(0x0f);
    // SAFETY: each `qs` is 16 bytes.
    let packed = unsafe { transpose_rows(column_ptrs(blocks, |w| w.qs.as_ptr())) };
    let mut nibbles = [_mm256_setzero_si256(); 8];
    for k in 0..4 {
        nibbles[k] = _mm256_and_si256(packed[k], low);
        nibbles[k + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(packed[k]), low);
    }
    let (d, m) = d_m_scales(blocks.map(|b| b.d), blocks.map(|b| b.m));
    ExpandedQ4_1 { nibbles, d, m }
}

/// One block column of a `Q5_0` group: vector `k` holds values `4k..4k + 4` (0..32) of each
/// row in its 32-bit lane, and the rows' d. `Q4_0` columns take the same form, values 0..16.
#[derive(Clone, Copy)]
pub(super) struct ExpandedQ5_0 {
    pub(super) q: [__m256i; 8],
    pub(super) d: __m256,
}

/// As [`ExpandedQ5_0`] with the rows' m, for `Q5_1`.
#[derive(Clone, Copy)]
pub(super) struct ExpandedQ5_1 {
    pub(super) q: [__m256i; 8],
    pub(super) d: __m256,
    pub(super) m: __m256,
}

/// The 5-bit values of a `Q5_0`/`Q5_1` block column laid out as [`ExpandedQ5_0`] holds them,
/// from each row's 16 nibble bytes (`qs`) and 32 fifth bits (`qh`).
///
/// # Safety
/// Every `qs` pointer must have 16 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn five_bit_values(qs: [*const u8; GROUP_ROWS], qh: [[u8; 4]; GROUP_ROWS]) -> [__m256i; 8] {
    let low = _mm256_set1_epi8(0x0f);
    // SAFETY: guaranteed by the caller.
    let packed = unsafe { transpose_rows(qs) };
    let qh = _mm256_setr_epi32(
        i32::from_le_bytes(qh[0]),
        i32::from_le_bytes(qh[1]),
        i32::from_le_bytes(qh[2]),
        i32::from_le_bytes(qh[3]),
        i32::from_le_bytes(qh[4]),
        i32::from_le_bytes(qh[5]),
        i32::from_le_bytes(qh[6]),
        i32::from_le_bytes(qh[7]),
    );
    // Each lane's byte of `qh` that holds the fifth bits of values 4k..4k + 4 (byte k / 2,
    // from bit 4·(k mod 2)), copied into all four bytes of the lane.
    let lane_bytes = _mm256_setr_epi8(
        0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12,
        12, 12, 12,
    );
    let sixteen = _mm256_set1_epi8(16);
    let mut q = [_mm256_setzero_si256(); 8];
    for (k, q) in q.iter_mut().enumerate() {
        let nibble = if k < 4 {
            _mm256_and_si256(packed[k], low)
        } else {
            _mm256_and_si256(_mm256_srli_epi16::<4>(packed[k - 4]), low)
        };
        let spread = _mm256_shuffle_epi8(
            qh,
            _mm256_add_epi8(lane_bytes, _mm256_set1_epi8((k / 2) as i8)),
        );
        let bit = _mm256_set1_epi32(if k % 2 == 0 {
            0x0804_0201
        } else {
            0x8040_2010_u32 as i32
        });
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        *q = _mm256_or_si256(nibble, _mm256_and_si256(set, sixteen));
    }
    q
}

/// The nibbles as [`expand_q4_1`] lays them out, and the rows' d.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn expand_q4_0(blocks: &[&BlockQ4_0; GROUP_ROWS]) -> ExpandedQ5_0 {
    let low = _mm256_set1_epi8(0x0f);
    // SAFETY: each `qs` is 16 bytes.
    let packed = unsafe { transpose_rows(column_ptrs(blocks, |w| w.qs.as_ptr())) };
    let mut q = [_mm256_setzero_si256(); 8];
    for k in 0..4 {
        q[k] = _mm256_and_si256(packed[k], low);
        q[k + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(packed[k]), low);
    }
    ExpandedQ5_0 {
        q,
        d: f16x8(blocks.map(|b| b.d)),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn expand_q5_0(blocks: &[&BlockQ5_0; GROUP_ROWS]) -> ExpandedQ5_0 {
    ExpandedQ5_0 {
        // SAFETY: each `qs` is 16 bytes.
        q: unsafe { five_bit_values(column_ptrs(blocks, |w| w.qs.as_ptr()), blocks.map(|b| b.qh)) },
        d: f16x8(blocks.map(|b| b.d)),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn expand_q5_1(blocks: &[&BlockQ5_1; GROUP_ROWS]) -> ExpandedQ5_1 {
    let (d, m) = d_m_scales(blocks.map(|b| b.d), blocks.map(|b| b.m));
    ExpandedQ5_1 {
        // SAFETY: each `qs` is 16 bytes.
        q: unsafe { five_bit_values(column_ptrs(blocks, |w| w.qs.as_ptr()), blocks.map(|b| b.qh)) },
        d,
        m,
    }
}

/// Runs `apply(span, blocks)` over `nb` block columns in spans of equal length (at most
/// [`EXPANDED_SPAN`]), each column `b` expanded once by `expand(b)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn over_expanded_spans<E>(
    nb: usize,
    expand: impl Fn(usize) -> E,
    mut apply: impl FnMut(&[E], std::ops::Range<usize>),
) {
    let len = nb.div_ceil(nb.div_ceil(EXPANDED_SPAN));
    // Uninitialised: zeroing the scratch cost as much as a small group's expansion.
    let mut scratch = [const { std::mem::MaybeUninit::<E>::uninit() }; EXPANDED_SPAN];
    for start in (0..nb).step_by(len) {
        let end = (start + len).min(nb);
        for b in start..end {
            scratch[b - start].write(expand(b));
        }
        // SAFETY: entries 0..end - start were written just above.
        let span = unsafe { std::slice::from_raw_parts(scratch.as_ptr() as *const E, end - start) };
        apply(span, start..end);
    }
}

// The float step of one expanded column for one activation row, from the column's i32
// sums Σ q·x per row lane: the AVX2 and VNNI kernels share it, and the pair kernels repeat
// it lane for lane on 512-bit vectors, so their results differ only if their integer sums
// do, and those are exact.

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q4_1_finish(e: &ExpandedQ4_1, x: &BlockQ8Act, sum: __m256i, acc: &mut __m256) {
    let sum = _mm256_cvtepi32_ps(sum);
    *acc = _mm256_fmadd_ps(sum, _mm256_mul_ps(e.d, _mm256_set1_ps(x.d)), *acc);
    *acc = _mm256_fmadd_ps(e.m, _mm256_set1_ps(x.s), *acc);
}

/// `sum` = Σ (q − 16)·x, or Σ (q − 8)·x for `Q4_0`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q5_0_finish(e: &ExpandedQ5_0, x: &BlockQ8Act, sum: __m256i, acc: &mut __m256) {
    let scaled = _mm256_mul_ps(
        _mm256_mul_ps(e.d, _mm256_set1_ps(x.d)),
        _mm256_cvtepi32_ps(sum),
    );
    *acc = _mm256_add_ps(*acc, scaled);
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q5_1_finish(e: &ExpandedQ5_1, x: &BlockQ8Act, sum: __m256i, acc: &mut __m256) {
    let sum = _mm256_cvtepi32_ps(sum);
    let scaled = _mm256_mul_ps(_mm256_mul_ps(e.d, _mm256_set1_ps(x.d)), sum);
    let offset = _mm256_mul_ps(e.m, _mm256_set1_ps(x.s));
    *acc = _mm256_add_ps(*acc, _mm256_add_ps(scaled, offset));
}

/// The grouped kernels for one instruction set: `$q4_1_sum` and `$q5_sum` turn one block's
/// 4-bit or 5-bit weight vectors and activation block into the i32 dot product of each
/// row's lane; for `Q8_0` rows the module's own `ExpandedQ8_0`, `expand_q8_0` and
/// `q8_0_block` do that job. The 5-bit kernels repeat their scalar references' arithmetic
/// lane by lane, unfused, so they equal them bit for bit.
macro_rules! group_kernels {
    ($features:literal, $widest:literal, [$($rest:literal),*],
     q4_1_sum: $q4_1_sum:expr, q5_sum: $q5_sum:expr) => {
        #[inline]
        #[target_feature(enable = $features)]
        fn q4_1_block<const A: usize>(
            e: &ExpandedQ4_1,
            x: [&BlockQ8Act; A],
            acc: &mut [__m256; A],
        ) {
            for (acc, x) in acc.iter_mut().zip(x) {
                q4_1_finish(e, x, $q4_1_sum(&e.nibbles, &x.qs), acc);
            }
        }

        format_kernels!(
            $features, $widest, [$($rest),*],
            /// `out[j][r]` = row `r` of the [`GROUP_ROWS`]-row group `w` · activation row
            /// `j` of `x` (as [`crate::backend::quant::gemm_q4_1_group_scalar`]).
            gemm_q4_1_group, BlockQ4_1,
            streamed: q4_1_group, expanded: q4_1_expanded,
            ExpandedQ4_1, expand_q4_1, q4_1_block
        );
        #[inline]
        #[target_feature(enable = $features)]
        fn q4_0_block<const A: usize>(
            e: &ExpandedQ5_0,
            x: [&BlockQ8Act; A],
            acc: &mut [__m256; A],
        ) {
            for (acc, x) in acc.iter_mut().zip(x) {
                // Σ (q − 8)·x as Σ q·x − 8·Σx, in integers.
                let sum = _mm256_sub_epi32($q4_1_sum(&e.q, &x.qs), _mm256_set1_epi32(8 * x.sum));
                q5_0_finish(e, x, sum, acc);
            }
        }

        format_kernels!(
            $features, $widest, [$($rest),*],
            /// As [`crate::backend::quant::gemm_q4_0_group_scalar`], bit for bit.
            gemm_q4_0_group, BlockQ4_0,
            streamed: q4_0_group, expanded: q4_0_expanded,
            ExpandedQ5_0, expand_q4_0, q4_0_block
        );
        #[inline]
        #[target_feature(enable = $features)]
        fn q5_0_block<const A: usize>(
            e: &ExpandedQ5_0,
            x: [&BlockQ8Act; A],
            acc: &mut [__m256; A],
        ) {
            for (acc, x) in acc.iter_mut().zip(x) {
                // Σ (q − 16)·x as Σ q·x − 16·Σx, in integers.
                let sum = _mm256_sub_epi32($q5_sum(&e.q, &x.qs), _mm256_set1_epi32(16 * x.sum));
                q5_0_finish(e, x, sum, acc);
            }
        }

        #[inline]
        #[target_feature(enable = $features)]
        fn q5_1_block<const A: usize>(
            e: &ExpandedQ5_1,
            x: [&BlockQ8Act; A],
            acc: &mut [__m256; A],
        ) {
            for (acc, x) in acc.iter_mut().zip(x) {
                q5_1_finish(e, x, $q5_sum(&e.q, &x.qs), acc);
            }
        }

        format_kernels!(
            $features, $widest, [$($rest),*],
            /// As [`crate::backend::quant::gemm_q5_0_group_scalar`], bit for bit.
            gemm_q5_0_group, BlockQ5_0,
            streamed: q5_0_group, expanded: q5_0_expanded,
            ExpandedQ5_0, expand_q5_0, q5_0_block
        );
        format_kernels!(
            $features, $widest, [$($rest),*],
            /// As [`crate::backend::quant::gemm_q5_1_group_scalar`], bit for bit.
            gemm_q5_1_group, BlockQ5_1,
            streamed: q5_1_group, expanded: q5_1_expanded,
            ExpandedQ5_1, expand_q5_1, q5_1_block
        );
        format_kernels!(
            $features, $widest, [$($rest),*],
            /// As [`gemm_q4_1_group`] for `Q8_0` weights.
            gemm_q8_0_group, BlockQ8_0,
            streamed: q8_0_group, expanded: q8_0_expanded,
            ExpandedQ8_0, expand_q8_0, q8_0_block
        );
    };
}

/// The kernels of one block format for one instruction set: `$block` applies one expanded
/// block column (`$expanded_ty`, made by `$expand`) to `A` activation rows.
///
/// `$streamed::<A>`: one group of [`GROUP_ROWS`] rows (`w`, row-major) against `A`
/// activation rows, added to `out`; lane `r` of an accumulator is row `r`'s sum, so no
/// horizontal reductions are needed, and each block is expanded in registers as it is
/// reached. `$expanded::<A>` does the same over a span expanded beforehand. The entry point
/// `$gemm` takes the streamed pass for a batch of at most one pass, and otherwise expands a
/// span of blocks once and runs every pass over it.
macro_rules! format_kernels {
    ($features:literal, $widest:literal, [$($rest:literal),*],
     $(#[$doc:meta])* $gemm:ident, $block_ty:ty,
     streamed: $streamed:ident, expanded: $expanded:ident,
     $expanded_ty:ty, $expand:ident, $block:ident) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// The CPU must support the module's target features.
        #[target_feature(enable = $features)]
        pub unsafe fn $gemm(w: WeightGroup<'_, $block_ty>, x: &[BlockQ8Act], out: &mut [[f32; GROUP_ROWS]]) {
            let nb = w.row_blocks();
            out.fill([0.0; GROUP_ROWS]);
            if nb == 0 {
                return;
            }
            if out.len() <= $widest {
                over_activation_rows!($streamed, w, x, nb, 0..nb, out, $widest, [$($rest),*]);
                return;
            }
            let expand = |b| {
                prefetch_share(w, b, 1);
                $expand(&w.column(b))
            };
            over_expanded_spans(nb, expand, |span, blocks| {
                over_activation_rows!($expanded, span, x, nb, blocks, &mut *out,
                    $widest, [$($rest),*]);
            });
        }

        /// # Safety
        /// The CPU must support the module's target features.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $streamed<const A: usize>(
            w: WeightGroup<'_, $block_ty>,
            x: [&[BlockQ8Act]; A],
            out: &mut [[f32; GROUP_ROWS]],
        ) {
            let nb = w.row_blocks();
            let mut acc = load_rows::<A>(out);
            for b in 0..nb {
                let e = $expand(&w.column(b));
                prefetch_share(w, b, 1);
                $block(&e, x.map(|x| &x[b]), &mut acc);
            }
            store_rows(acc, out);
        }

        /// # Safety
        /// The CPU must support the module's target features.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $expanded<const A: usize>(
            span: &[$expanded_ty],
            x: [&[BlockQ8Act]; A],
            out: &mut [[f32; GROUP_ROWS]],
        ) {
            let mut acc = load_rows::<A>(out);
            for (b, e) in span.iter().enumerate() {
                $block(e, x.map(|x| &x[b]), &mut acc);
            }
            store_rows(acc, out);
        }
    };
}

/// Sums a lane's eight byte products in 16 bits before widening:
/// 8 × 2 × 15 × 128 = 30720 fits in an i16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q4_1_sum(nibbles: &[__m256i; 8], x: &[i8; QK]) -> __m256i {
    let mut sum = _mm256_maddubs_epi16(nibbles[0], broadcast_word(x, 0));
    for (k, nib) in nibbles.iter().enumerate().skip(1) {
        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(*nib, broadcast_word(x, k)));
    }
    _mm256_madd_epi16(sum, _mm256_set1_epi16(1))
}

/// Signed weights take the sign trick; byte-pair sums (up to 2 × 128 × 127) are widened
/// one product at a time.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q8_0_sum(signed: &[__m256i; 8], magnitude: &[__m256i; 8], x: &[i8; QK]) -> __m256i {
    let mut sum = _mm256_setzero_si256();
    for k in 0..8 {
        let xs = _mm256_sign_epi8(broadcast_word(x, k), signed[k]);
        let pairs = _mm256_maddubs_epi16(magnitude[k], xs);
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
    sum
}

/// The 32 signed bytes of eight `Q8_0` blocks as eight vectors; vector `k` holds bytes
/// `4k..4k + 4` of block `r` in 32-bit lane `r`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q8_0_words(blocks: &[&BlockQ8_0; GROUP_ROWS]) -> [__m256i; 8] {
    // SAFETY: each `qs` is 32 bytes, read as two 16-byte halves.
    let (first, second) = unsafe {
        (
            transpose_rows(column_ptrs(blocks, |w| w.qs.as_ptr() as *const u8)),
            transpose_rows(column_ptrs(blocks, |w| w.qs.as_ptr().add(16) as *const u8)),
        )
    };
    [
        first[0], first[1], first[2], first[3], second[0], second[1], second[2], second[3],
    ]
}

/// One block column of a `Q8_0` group for the AVX2 kernels: the signed weight words
/// (vector `k` holds bytes `4k..4k + 4` of each row in its 32-bit lane), their magnitudes
/// for the sign trick, and the scales.
#[derive(Clone, Copy)]
struct ExpandedQ8_0 {
    signed: [__m256i; 8],
    magnitude: [__m256i; 8],
    d: __m256,
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn expand_q8_0(blocks: &[&BlockQ8_0; GROUP_ROWS]) -> ExpandedQ8_0 {
    let signed = q8_0_words(blocks);
    ExpandedQ8_0 {
        signed,
        magnitude: signed.map(|v| _mm256_sign_epi8(v, v)),
        d: f16x8(blocks.map(|b| b.d)),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q8_0_block<const A: usize>(e: &ExpandedQ8_0, x: [&BlockQ8Act; A], acc: &mut [__m256; A]) {
    for (acc, x) in acc.iter_mut().zip(x) {
        let sum = _mm256_cvtepi32_ps(q8_0_sum(&e.signed, &e.magnitude, &x.qs));
        *acc = _mm256_fmadd_ps(sum, _mm256_mul_ps(e.d, _mm256_set1_ps(x.d)), *acc);
    }
}

group_kernels!("avx2,fma,f16c", 4, [3, 2, 1], q4_1_sum: q4_1_sum, q5_sum: kq5_sum);

//! AVX2 + FMA + F16C kernels, and AVX-512 VNNI variants of the grouped matmul kernels in
//! [`vnni`]. Each has a scalar twin in `quant.rs` it is tested against.
//!
//! The int8 dot products use `maddubs` (u8 × i8 → i16 pairs) followed by `madd` with ones
//! (i16 pairs → i32); both operands stay within ±127 (or 0..15 for 4-bit weights), so the
//! 16-bit pair sums cannot saturate.

use std::arch::x86_64::*;

use half::f16;

use super::kquant::{ACT_BLOCKS, BlockQ4K, BlockQ5K, BlockQ6K};
use super::quant::{
    BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, BlockQ8Act, GROUP_ROWS, QK, StridedRows,
    WeightGroup,
};

/// Whether this CPU can run the kernels in this module.
pub fn available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

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
/// The CPU must support AVX2, FMA and F16C ([`available`]).
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
/// The CPU must support AVX2, FMA and F16C ([`available`]).
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
/// The CPU must support AVX2, FMA and F16C ([`available`]).
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

/// 16 bytes at each of `rows[0..8]` → four vectors; vector `k` holds bytes `4k..4k + 4` of
/// row `r` in 32-bit lane `r`. Rows `r` and `r + 4` share a load, then a 4 × 4 transpose of
/// 32-bit words runs in each 128-bit half.
///
/// # Safety
/// Every pointer must have 16 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn transpose_rows(rows: [*const u8; GROUP_ROWS]) -> [__m256i; 4] {
    // SAFETY: guaranteed by the caller; loadu has no alignment requirement.
    let pair = |r: usize| unsafe {
        _mm256_set_m128i(
            _mm_loadu_si128(rows[r + 4] as *const __m128i),
            _mm_loadu_si128(rows[r] as *const __m128i),
        )
    };
    let (v0, v1, v2, v3) = (pair(0), pair(1), pair(2), pair(3));
    let t0 = _mm256_unpacklo_epi32(v0, v1);
    let t1 = _mm256_unpackhi_epi32(v0, v1);
    let t2 = _mm256_unpacklo_epi32(v2, v3);
    let t3 = _mm256_unpackhi_epi32(v2, v3);
    [
        _mm256_unpacklo_epi64(t0, t2),
        _mm256_unpackhi_epi64(t0, t2),
        _mm256_unpacklo_epi64(t1, t3),
        _mm256_unpackhi_epi64(t1, t3),
    ]
}

#[inline(always)]
fn column_ptrs<B>(
    blocks: &[&B; GROUP_ROWS],
    at: impl Fn(&B) -> *const u8,
) -> [*const u8; GROUP_ROWS] {
    [
        at(blocks[0]),
        at(blocks[1]),
        at(blocks[2]),
        at(blocks[3]),
        at(blocks[4]),
        at(blocks[5]),
        at(blocks[6]),
        at(blocks[7]),
    ]
}

/// Activation bytes `4k..4k + 4` in every 32-bit lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn broadcast_word(qs: &[i8; QK], k: usize) -> __m256i {
    let word = [qs[4 * k], qs[4 * k + 1], qs[4 * k + 2], qs[4 * k + 3]];
    _mm256_set1_epi32(i32::from_le_bytes(word.map(|b| b as u8)))
}

/// Eight f16 values as eight f32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16x8(h: [f16; GROUP_ROWS]) -> __m256 {
    let bits = h.map(f16::to_bits);
    // SAFETY: `bits` is 16 readable bytes.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(bits.as_ptr() as *const __m128i) })
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

/// Groups up to this size are prefetched into L1 by [`prefetch_share`]: the next one fits
/// there beside the one being read and the activations.
const L1_PREFETCHED_GROUP_BYTES: usize = 8 << 10;
/// Groups up to this size are prefetched into L2. A larger group's rows are each long
/// enough (4 KiB and more) for the hardware prefetchers to follow, and explicit requests
/// only took issue slots: on a 7B model's down projection (8 rows of 10.6 KiB a group)
/// batch-1 `Q4_K` ran 15–40% faster without them, one thread measured alone.
const L2_PREFETCHED_GROUP_BYTES: usize = 32 << 10;

/// Hardware prefetchers do not pick up the eight short interleaved row streams of a small
/// group of adjacent rows, so while block `b` is computed, the matching share of the next
/// `groups` groups' bytes (which follow `group` in memory) is requested explicitly.
///
/// A spread group's rows each run on into the same row of the next group, and block `b` of
/// those rows is requested into L2: the hardware prefetchers follow the streams, but not far
/// enough ahead of the `Q6_K` kernels, whose work per byte is the heaviest (7B shape, batch
/// 1: 18 GB/s without, 22 to 26 with; `Q4_K` ran as fast either way).
///
/// Prefetches never fault, so a share past the end of the matrix is harmless.
#[inline(always)]
fn prefetch_share<B>(group: WeightGroup<'_, B>, b: usize, groups: usize) {
    let Some(blocks) = group.contiguous() else {
        prefetch_next_rows(group, b);
        return;
    };
    let bytes = groups * std::mem::size_of_val(blocks);
    let next = blocks.as_ptr().wrapping_add(blocks.len()) as *const i8;
    let nb = group.row_blocks();
    let (start, end) = (b * bytes / nb, (b + 1) * bytes / nb);
    if bytes <= L1_PREFETCHED_GROUP_BYTES {
        for offset in (start..end).step_by(64) {
            // SAFETY: SSE, which `_mm_prefetch` needs, is part of every x86-64 CPU.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(offset)) };
        }
    } else if bytes <= L2_PREFETCHED_GROUP_BYTES {
        for offset in (start..end).step_by(64) {
            // SAFETY: SSE, which `_mm_prefetch` needs, is part of every x86-64 CPU.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(offset)) };
        }
    }
}

/// Block `b` of the row after each of a spread group's rows, into L2 (see [`prefetch_share`]).
/// Kept out of line so the adjacent groups' prefetch stays small enough to inline.
#[inline(never)]
fn prefetch_next_rows<B>(group: WeightGroup<'_, B>, b: usize) {
    for r in 0..GROUP_ROWS {
        let row = group.row(r);
        let next = row.as_ptr().wrapping_add(row.len() + b) as *const i8;
        for offset in (0..std::mem::size_of::<B>()).step_by(64) {
            // SAFETY: SSE, which `_mm_prefetch` needs, is part of every x86-64 CPU.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(offset)) };
        }
    }
}

/// Blocks of a group expanded at a time when more activation rows than one kernel pass
/// take them: each expansion then serves every pass, and the span (5 KiB for `Q4_1`,
/// under 9 KiB for AVX2's `Q8_0`) stays in L1 beside the activations it meets.
const EXPANDED_SPAN: usize = 16;

/// One block column of a `Q4_1` group unpacked for the kernels: vector `k` holds nibbles
/// `4k..4k + 4` of each row in its 32-bit lane (the low nibbles of the packed bytes first),
/// and the scales are f32 lanes.
#[derive(Clone, Copy)]
struct ExpandedQ4_1 {
    nibbles: [__m256i; 8],
    d: __m256,
    m: __m256,
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn expand_q4_1(blocks: &[&BlockQ4_1; GROUP_ROWS]) -> ExpandedQ4_1 {
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
/// row in its 32-bit lane, and the rows' d.
#[derive(Clone, Copy)]
struct ExpandedQ5_0 {
    q: [__m256i; 8],
    d: __m256,
}

/// As [`ExpandedQ5_0`] with the rows' m, for `Q5_1`.
#[derive(Clone, Copy)]
struct ExpandedQ5_1 {
    q: [__m256i; 8],
    d: __m256,
    m: __m256,
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

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn expand_q5_0(blocks: &[&BlockQ5_0; GROUP_ROWS]) -> ExpandedQ5_0 {
    ExpandedQ5_0 {
        // SAFETY: each `qs` is 16 bytes.
        q: unsafe { five_bit_values(column_ptrs(blocks, |w| w.qs.as_ptr()), blocks.map(|b| b.qh)) },
        d: f16x8(blocks.map(|b| b.d)),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn expand_q5_1(blocks: &[&BlockQ5_1; GROUP_ROWS]) -> ExpandedQ5_1 {
    let (d, m) = d_m_scales(blocks.map(|b| b.d), blocks.map(|b| b.m));
    ExpandedQ5_1 {
        // SAFETY: each `qs` is 16 bytes.
        q: unsafe { five_bit_values(column_ptrs(blocks, |w| w.qs.as_ptr()), blocks.map(|b| b.qh)) },
        d,
        m,
    }
}

/// Accumulators of `A` activation rows over one group, read from and written back to `out`
/// so a group can be computed a span of blocks at a time.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load_rows<const A: usize>(out: &[[f32; GROUP_ROWS]]) -> [__m256; A] {
    let mut acc = [_mm256_setzero_ps(); A];
    for (acc, out) in acc.iter_mut().zip(out) {
        // SAFETY: each row is 8 readable f32.
        *acc = unsafe { _mm256_loadu_ps(out.as_ptr()) };
    }
    acc
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn store_rows<const A: usize>(acc: [__m256; A], out: &mut [[f32; GROUP_ROWS]]) {
    for (acc, out) in acc.iter().zip(out) {
        // SAFETY: each row is 8 writable f32.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), *acc) };
    }
}

/// Runs `apply(span, blocks)` over `nb` block columns in spans of equal length (at most
/// [`EXPANDED_SPAN`]), each column `b` expanded once by `expand(b)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn over_expanded_spans<E>(
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
fn q4_1_finish(e: &ExpandedQ4_1, x: &BlockQ8Act, sum: __m256i, acc: &mut __m256) {
    let sum = _mm256_cvtepi32_ps(sum);
    *acc = _mm256_fmadd_ps(sum, _mm256_mul_ps(e.d, _mm256_set1_ps(x.d)), *acc);
    *acc = _mm256_fmadd_ps(e.m, _mm256_set1_ps(x.s), *acc);
}

/// `sum` = Σ (q − 16)·x.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q5_0_finish(e: &ExpandedQ5_0, x: &BlockQ8Act, sum: __m256i, acc: &mut __m256) {
    let scaled = _mm256_mul_ps(
        _mm256_mul_ps(e.d, _mm256_set1_ps(x.d)),
        _mm256_cvtepi32_ps(sum),
    );
    *acc = _mm256_add_ps(*acc, scaled);
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q5_1_finish(e: &ExpandedQ5_1, x: &BlockQ8Act, sum: __m256i, acc: &mut __m256) {
    let sum = _mm256_cvtepi32_ps(sum);
    let scaled = _mm256_mul_ps(_mm256_mul_ps(e.d, _mm256_set1_ps(x.d)), sum);
    let offset = _mm256_mul_ps(e.m, _mm256_set1_ps(x.s));
    *acc = _mm256_add_ps(*acc, _mm256_add_ps(scaled, offset));
}

/// `Q4_K` and `Q5_K`: d·sc·(Σ q·x)·d_x − dmin·m·s_x.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn kmin_finish(e: &ExpandedKMin, x: &BlockQ8Act, sum: __m256i, acc: &mut __m256) {
    let sum = _mm256_cvtepi32_ps(sum);
    let scaled = _mm256_mul_ps(_mm256_mul_ps(e.d, _mm256_set1_ps(x.d)), sum);
    let offset = _mm256_mul_ps(e.m, _mm256_set1_ps(x.s));
    *acc = _mm256_add_ps(*acc, _mm256_sub_ps(scaled, offset));
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

/// Activation rows `j..j + A`, each its blocks `blocks` of `nb`.
///
/// A plain loop, not `array::from_fn`: a closure written in a function with target
/// features inherits them, which keeps it from being inlined into generic std code, and
/// it then cost a call per row.
#[inline(always)]
fn activation_rows<'a, const A: usize>(
    x: &'a [BlockQ8Act],
    nb: usize,
    blocks: &std::ops::Range<usize>,
    j: usize,
) -> [&'a [BlockQ8Act]; A] {
    let mut acts: [&[BlockQ8Act]; A] = [&[]; A];
    for (i, a) in acts.iter_mut().enumerate() {
        let row = (j + i) * nb;
        *a = &x[row + blocks.start..row + blocks.end];
    }
    acts
}

/// Runs a grouped kernel, `$kernel::<A>(src, A activation rows, A output rows)`, over
/// every output row, `$widest` activation rows at a time; each activation row is its
/// blocks `$blocks` (the blocks `src` covers) of `$nb` in `$x`.
macro_rules! over_activation_rows {
    ($kernel:ident, $src:expr, $x:expr, $nb:expr, $blocks:expr, $out:expr,
     $widest:literal, [$($rest:literal),*]) => {{
        let (src, x, nb, blocks, out) = ($src, $x, $nb, $blocks, $out);
        let mut j = 0;
        // SAFETY (every call): the caller guarantees the CPU features.
        while j + $widest <= out.len() {
            let acts = activation_rows::<$widest>(x, nb, &blocks, j);
            unsafe { $kernel::<$widest>(src, acts, &mut out[j..j + $widest]) };
            j += $widest;
        }
        match out.len() - j {
            $($rest => {
                let acts = activation_rows::<$rest>(x, nb, &blocks, j);
                unsafe { $kernel::<$rest>(src, acts, &mut out[j..]) }
            },)*
            _ => {}
        }
    }};
}

/// Sums a lane's eight byte products in 16 bits before widening:
/// 8 × 2 × 15 × 128 = 30720 fits in an i16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q4_1_sum(nibbles: &[__m256i; 8], x: &[i8; QK]) -> __m256i {
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
fn q8_0_words(blocks: &[&BlockQ8_0; GROUP_ROWS]) -> [__m256i; 8] {
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

/// One 32-value sub-block column of a `Q4_K`/`Q5_K` group: vector `k` holds values
/// `4k..4k + 4` of each row (unsigned bytes) in its 32-bit lane, with the rows' d·sc and
/// dmin·m.
#[derive(Clone, Copy)]
struct ExpandedKMin {
    q: [__m256i; 8],
    d: __m256,
    m: __m256,
}

/// One 32-value column of a `Q6_K` group: the unsigned values q + 32 laid out as in
/// [`ExpandedKMin`], the rows' d, and the scales of its two 16-value sub-blocks as i32 lanes.
#[derive(Clone, Copy)]
struct ExpandedQ6K {
    q: [__m256i; 8],
    d: __m256,
    sc: [__m256i; 2],
}

/// 32 bytes at each of `rows[0..8]` as eight vectors; vector `k` holds bytes `4k..4k + 4`
/// of row `r` in 32-bit lane `r`.
///
/// # Safety
/// Every pointer must have 32 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn words32(rows: [*const u8; GROUP_ROWS]) -> [__m256i; 8] {
    // SAFETY: guaranteed by the caller.
    let (a, b) = unsafe {
        (
            transpose_rows(rows),
            transpose_rows([
                rows[0].add(16),
                rows[1].add(16),
                rows[2].add(16),
                rows[3].add(16),
                rows[4].add(16),
                rows[5].add(16),
                rows[6].add(16),
                rows[7].add(16),
            ]),
        )
    };
    [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
}

/// The d·sc_j and dmin·m_j of the eight sub-blocks of eight `Q4_K`/`Q5_K` blocks, read
/// from each block's first 16 bytes (`d`, `dmin` and the 12 packed scale bytes, the same
/// in both formats): the 6-bit fields of [`super::kquant::scale_min_k4`] are unpacked with one
/// row per 32-bit lane, and each product is the scalar kernel's single f32 multiply.
///
/// # Safety
/// Every pointer must be the start of a `Q4_K` or `Q5_K` block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kmin_scales(heads: [*const u8; GROUP_ROWS]) -> ([__m256; 8], [__m256; 8]) {
    // SAFETY: guaranteed by the caller; both block types are larger than 16 bytes.
    let [dm, low, mid, high] = unsafe { transpose_rows(heads) };
    let halves = |v: __m256i| {
        _mm256_cvtph_ps(_mm_packus_epi32(
            _mm256_castsi256_si128(v),
            _mm256_extracti128_si256::<1>(v),
        ))
    };
    let d = halves(_mm256_and_si256(dm, _mm256_set1_epi32(0xffff)));
    let dmin = halves(_mm256_srli_epi32::<16>(dm));
    let bits = |v: __m256i, shift: i32, mask: i32| {
        _mm256_and_si256(
            _mm256_srl_epi32(v, _mm_cvtsi32_si128(shift)),
            _mm256_set1_epi32(mask),
        )
    };
    let (mut dv, mut mv) = ([_mm256_setzero_ps(); 8], [_mm256_setzero_ps(); 8]);
    for k in 0..4 {
        let at = 8 * k as i32;
        let (sc, m) = (bits(low, at, 63), bits(mid, at, 63));
        dv[k] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
        mv[k] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m));
        let sc = _mm256_or_si256(
            bits(high, at, 15),
            _mm256_slli_epi32::<4>(bits(low, at + 6, 3)),
        );
        let m = _mm256_or_si256(
            bits(high, at + 4, 15),
            _mm256_slli_epi32::<4>(bits(mid, at + 6, 3)),
        );
        dv[k + 4] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
        mv[k + 4] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m));
    }
    (dv, mv)
}

// The k-quant expansions hand each sub-block column of a super-block column to `emit` in
// sub-block order: a batch of one pass consumes it while it is still in registers, a larger
// batch stores it for every pass.

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn expand_q4_k(blocks: &[&BlockQ4K; GROUP_ROWS], mut emit: impl FnMut(usize, &ExpandedKMin)) {
    let low = _mm256_set1_epi8(0x0f);
    // SAFETY: the pointers are the blocks' own.
    let (d, m) = unsafe { kmin_scales(column_ptrs(blocks, |b| (b as *const BlockQ4K).cast())) };
    for i in 0..4 {
        // SAFETY: each `qs` is 128 bytes; 32 are read from byte 32·i.
        let w = unsafe { words32(column_ptrs(blocks, |b| b.qs.as_ptr().add(32 * i))) };
        let (mut first, mut second) = ([_mm256_setzero_si256(); 8], [_mm256_setzero_si256(); 8]);
        for ((first, second), w) in first.iter_mut().zip(&mut second).zip(&w) {
            *first = _mm256_and_si256(*w, low);
            *second = _mm256_and_si256(_mm256_srli_epi16::<4>(*w), low);
        }
        for (j, q) in [(2 * i, first), (2 * i + 1, second)] {
            emit(
                j,
                &ExpandedKMin {
                    q,
                    d: d[j],
                    m: m[j],
                },
            );
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn expand_q5_k(blocks: &[&BlockQ5K; GROUP_ROWS], mut emit: impl FnMut(usize, &ExpandedKMin)) {
    let low = _mm256_set1_epi8(0x0f);
    let sixteen = _mm256_set1_epi8(16);
    // SAFETY: the pointers are the blocks' own.
    let (d, m) = unsafe { kmin_scales(column_ptrs(blocks, |b| (b as *const BlockQ5K).cast())) };
    // SAFETY: each `qh` is 32 bytes.
    let high = unsafe { words32(column_ptrs(blocks, |b| b.qh.as_ptr())) };
    for i in 0..4 {
        // SAFETY: each `qs` is 128 bytes; 32 are read from byte 32·i.
        let w = unsafe { words32(column_ptrs(blocks, |b| b.qs.as_ptr().add(32 * i))) };
        for half in 0..2 {
            let j = 2 * i + half;
            let bit = _mm256_set1_epi8((1u8 << j) as i8);
            let mut q = [_mm256_setzero_si256(); 8];
            for ((q, w), high) in q.iter_mut().zip(&w).zip(&high) {
                let nibble = if half == 0 {
                    _mm256_and_si256(*w, low)
                } else {
                    _mm256_and_si256(_mm256_srli_epi16::<4>(*w), low)
                };
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(*high, bit), bit);
                *q = _mm256_or_si256(nibble, _mm256_and_si256(set, sixteen));
            }
            emit(
                j,
                &ExpandedKMin {
                    q,
                    d: d[j],
                    m: m[j],
                },
            );
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn expand_q6_k(blocks: &[&BlockQ6K; GROUP_ROWS], mut emit: impl FnMut(usize, &ExpandedQ6K)) {
    let low = _mm256_set1_epi8(0x0f);
    let top_two = _mm256_set1_epi8(0x30);
    let d = f16x8(blocks.map(|b| b.d));
    // SAFETY: each `scales` is 16 bytes.
    let scales = unsafe { transpose_rows(column_ptrs(blocks, |b| b.scales.as_ptr().cast())) };
    for half in 0..2 {
        // SAFETY: `ql` is 128 bytes and `qh` 64; 32 are read from each start.
        let (ql_a, ql_b, qh) = unsafe {
            (
                words32(column_ptrs(blocks, |b| b.ql.as_ptr().add(64 * half))),
                words32(column_ptrs(blocks, |b| b.ql.as_ptr().add(64 * half + 32))),
                words32(column_ptrs(blocks, |b| b.qh.as_ptr().add(32 * half))),
            )
        };
        for p in 0..4 {
            let c = 4 * half + p;
            let ql = if p % 2 == 0 { &ql_a } else { &ql_b };
            let mut q = [_mm256_setzero_si256(); 8];
            for ((q, ql), qh) in q.iter_mut().zip(ql).zip(&qh) {
                let nibble = if p < 2 {
                    _mm256_and_si256(*ql, low)
                } else {
                    _mm256_and_si256(_mm256_srli_epi16::<4>(*ql), low)
                };
                // Bits 2p, 2p + 1 of each byte moved to bits 4, 5 in one shift: the 16-bit
                // lanes carry bits across bytes only outside the mask.
                let high = match p {
                    0 => _mm256_slli_epi16::<4>(*qh),
                    1 => _mm256_slli_epi16::<2>(*qh),
                    2 => *qh,
                    _ => _mm256_srli_epi16::<2>(*qh),
                };
                *q = _mm256_or_si256(nibble, _mm256_and_si256(high, top_two));
            }
            emit(
                c,
                &ExpandedQ6K {
                    q,
                    d,
                    sc: [signed_byte(&scales, 2 * c), signed_byte(&scales, 2 * c + 1)],
                },
            );
        }
    }
}

/// Byte `i` of each row of [`transpose_rows`]' output, sign-extended to its 32-bit lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn signed_byte(words: &[__m256i; 4], i: usize) -> __m256i {
    let up = _mm256_sll_epi32(words[i / 4], _mm_cvtsi32_si128(24 - 8 * (i % 4) as i32));
    _mm256_srai_epi32::<24>(up)
}

/// Super-blocks of a k-quant group expanded at a time: 16 sub-block columns (5 KiB for
/// `Q4_K`) stay in L1 beside the activations every pass meets them with.
const K_SPAN: usize = 2;

/// The k-quant grouped kernels for one instruction set, from its `kq4_sum` (Σ q·x of a
/// 4-bit column), `kq5_sum` (of a 5-bit column) and `kq6_sums` (the two 16-value halves of
/// a 6-bit column). Each lane's arithmetic is the scalar kernel's, in the same order and
/// without fused multiply-adds, so the results equal the scalar reference bit for bit.
macro_rules! kquant_kernels {
    ($features:literal, $widest:literal, [$($rest:literal),*]) => {
        #[inline]
        #[target_feature(enable = $features)]
        fn kq4_block<const A: usize>(
            e: &ExpandedKMin,
            x: [&BlockQ8Act; A],
            acc: &mut [__m256; A],
        ) {
            for (acc, x) in acc.iter_mut().zip(x) {
                kmin_finish(e, x, kq4_sum(&e.q, &x.qs), acc);
            }
        }

        #[inline]
        #[target_feature(enable = $features)]
        fn kq5_block<const A: usize>(
            e: &ExpandedKMin,
            x: [&BlockQ8Act; A],
            acc: &mut [__m256; A],
        ) {
            for (acc, x) in acc.iter_mut().zip(x) {
                kmin_finish(e, x, kq5_sum(&e.q, &x.qs), acc);
            }
        }

        /// The values are stored as q + 32; 32·Σx of each half is taken back out in
        /// integers before the halves' scales weight them.
        #[inline]
        #[target_feature(enable = $features)]
        fn kq6_block<const A: usize>(
            e: &ExpandedQ6K,
            x: [&BlockQ8Act; A],
            acc: &mut [__m256; A],
        ) {
            for (acc, x) in acc.iter_mut().zip(x) {
                let (lo, hi) = kq6_sums(&e.q, &x.qs);
                let lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(32 * x.low_sum));
                let hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(32 * (x.sum - x.low_sum)));
                let sum = _mm256_add_epi32(
                    _mm256_mullo_epi32(lo, e.sc[0]),
                    _mm256_mullo_epi32(hi, e.sc[1]),
                );
                let scaled = _mm256_mul_ps(
                    _mm256_mul_ps(e.d, _mm256_set1_ps(x.d)),
                    _mm256_cvtepi32_ps(sum),
                );
                *acc = _mm256_add_ps(*acc, scaled);
            }
        }

        kquant_kernel!($features, $widest, [$($rest),*],
            /// As [`crate::backend::kquant::gemm_q4_k_group_scalar`], bit for bit.
            gemm_q4_k_group, BlockQ4K, ExpandedKMin, expand_q4_k, kq4_block, kq4_streamed, kq4_pass);
        kquant_kernel!($features, $widest, [$($rest),*],
            /// As [`crate::backend::kquant::gemm_q5_k_group_scalar`], bit for bit.
            gemm_q5_k_group, BlockQ5K, ExpandedKMin, expand_q5_k, kq5_block, kq5_streamed, kq5_pass);
        kquant_kernel!($features, $widest, [$($rest),*],
            /// As [`crate::backend::kquant::gemm_q6_k_group_scalar`], bit for bit.
            gemm_q6_k_group, BlockQ6K, ExpandedQ6K, expand_q6_k, kq6_block, kq6_streamed, kq6_pass);
    };
}

/// One k-quant format's grouped kernel. A batch of at most `$widest` activation rows takes
/// one streamed pass (`$streamed`): each sub-block column is applied as `$expand` makes it,
/// so nothing is stored. A larger batch expands [`K_SPAN`] super-block columns of the group
/// at a time into sub-block columns, then every activation row meets them, `$widest` rows a
/// pass (`$pass`, applying `$block` per column).
macro_rules! kquant_kernel {
    ($features:literal, $widest:literal, [$($rest:literal),*],
     $(#[$doc:meta])* $gemm:ident, $block_ty:ty, $expanded_ty:ty, $expand:ident,
     $block:ident, $streamed:ident, $pass:ident) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// The CPU must support the module's target features.
        #[target_feature(enable = $features)]
        pub unsafe fn $gemm(w: WeightGroup<'_, $block_ty>, x: &[BlockQ8Act], out: &mut [[f32; GROUP_ROWS]]) {
            let nbk = w.row_blocks();
            out.fill([0.0; GROUP_ROWS]);
            if nbk == 0 {
                return;
            }
            let nb = nbk * ACT_BLOCKS;
            if out.len() <= $widest {
                over_activation_rows!($streamed, w, x, nb, 0..nb, out, $widest, [$($rest),*]);
                return;
            }
            // Uninitialised: zeroing the scratch costs about as much as expanding it.
            let mut scratch =
                [[const { std::mem::MaybeUninit::<$expanded_ty>::uninit() }; ACT_BLOCKS]; K_SPAN];
            for s0 in (0..nbk).step_by(K_SPAN) {
                let s1 = (s0 + K_SPAN).min(nbk);
                for s in s0..s1 {
                    let columns = &mut scratch[s - s0];
                    $expand(&w.column(s), |j, e| {
                        columns[j].write(*e);
                    });
                    prefetch_share(w, s, 1);
                }
                // SAFETY: the expansions just above wrote every column of rows 0..s1 - s0.
                let span = unsafe {
                    std::slice::from_raw_parts(
                        scratch.as_ptr() as *const $expanded_ty,
                        (s1 - s0) * ACT_BLOCKS,
                    )
                };
                over_activation_rows!($pass, span, x, nb, s0 * ACT_BLOCKS..s1 * ACT_BLOCKS,
                    &mut *out, $widest, [$($rest),*]);
            }
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
            let nbk = w.row_blocks();
            let mut acc = load_rows::<A>(out);
            for s in 0..nbk {
                $expand(&w.column(s), |j, e| {
                    $block(e, x.map(|x| &x[s * ACT_BLOCKS + j]), &mut acc)
                });
                prefetch_share(w, s, 1);
            }
            store_rows(acc, out);
        }

        /// # Safety
        /// The CPU must support the module's target features.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $pass<const A: usize>(
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

/// Σ q·x of a 4-bit column: eight byte-pair sums of at most 2 × 15 × 127 add up in 16 bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn kq4_sum(q: &[__m256i; 8], x: &[i8; QK]) -> __m256i {
    q4_1_sum(q, x)
}

/// Byte-pair sums of 5-bit values reach 2 × 31 × 127, so four add up in 16 bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn kq5_sum(q: &[__m256i; 8], x: &[i8; QK]) -> __m256i {
    let ones = _mm256_set1_epi16(1);
    let quarter = |k: usize| {
        let mut s = _mm256_maddubs_epi16(q[k], broadcast_word(x, k));
        for i in 1..4 {
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(q[k + i], broadcast_word(x, k + i)));
        }
        _mm256_madd_epi16(s, ones)
    };
    _mm256_add_epi32(quarter(0), quarter(4))
}

/// Byte-pair sums of 6-bit values reach 2 × 63 × 127, so two add up in 16 bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn kq6_sums(q: &[__m256i; 8], x: &[i8; QK]) -> (__m256i, __m256i) {
    let ones = _mm256_set1_epi16(1);
    let pair = |k: usize| {
        let s = _mm256_add_epi16(
            _mm256_maddubs_epi16(q[k], broadcast_word(x, k)),
            _mm256_maddubs_epi16(q[k + 1], broadcast_word(x, k + 1)),
        );
        _mm256_madd_epi16(s, ones)
    };
    (
        _mm256_add_epi32(pair(0), pair(2)),
        _mm256_add_epi32(pair(4), pair(6)),
    )
}

kquant_kernels!("avx2,fma,f16c", 4, [3, 2, 1]);

/// The grouped kernels with AVX-512 VNNI on 256-bit vectors: `vpdpbusd` multiplies and
/// accumulates four byte pairs per lane in one instruction, and the 32 vector registers
/// hold eight activation rows' accumulators next to a group's expanded weights. The i32
/// sums are the same as the AVX2 kernels', so the results are identical.
pub mod vnni {
    use super::*;

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
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`]).
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

/// Activation rows [`dot_f32_rows`] takes through one weight-row block at a time: 64 rows
/// of up to 1536 values (384 KiB) stay in L2 while every block meets them.
const F32_ACT_BLOCK: usize = 64;

/// `out[j · out_stride + r]` = weight row `r` of `w` · activation row `j` of `x`, rows
/// `cols` long. Every product is computed the same way wherever its rows sit and however
/// many share the call: one 8-lane fused multiply-add chain over the values in order, the
/// lanes summed by [`hsum`], then the values after the last eight added one at a time. So
/// a token's projections do not depend on the batch it is in. Blocks of four activation
/// rows × three weight rows share their loads.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f32_rows(w: &[f32], x: &[f32], cols: usize, out: &mut [f32], out_stride: usize) {
    if cols == 0 {
        return;
    }
    let (rows, n) = (w.len() / cols, x.len() / cols);
    assert!(
        n == 0 || (n - 1) * out_stride + rows <= out.len(),
        "dot_f32_rows output"
    );
    for j0 in (0..n).step_by(F32_ACT_BLOCK) {
        let j1 = (j0 + F32_ACT_BLOCK).min(n);
        for r in (0..rows).step_by(3) {
            let mut j = j0;
            while j < j1 {
                let acts = (j1 - j).min(4);
                // SAFETY: rows r..r + 3 (clipped) of `w` and j..j + acts of `x` are inside
                // their slices, and the outputs inside `out` (asserted above).
                unsafe {
                    let (wp, xp) = (w.as_ptr().add(r * cols), x.as_ptr().add(j * cols));
                    let op = out.as_mut_ptr().add(j * out_stride + r);
                    match (acts, (rows - r).min(3)) {
                        (4, 3) => dot_block::<4, 3>(wp, xp, cols, op, out_stride),
                        (4, 2) => dot_block::<4, 2>(wp, xp, cols, op, out_stride),
                        (4, _) => dot_block::<4, 1>(wp, xp, cols, op, out_stride),
                        (3, 3) => dot_block::<3, 3>(wp, xp, cols, op, out_stride),
                        (3, 2) => dot_block::<3, 2>(wp, xp, cols, op, out_stride),
                        (3, _) => dot_block::<3, 1>(wp, xp, cols, op, out_stride),
                        (2, 3) => dot_block::<2, 3>(wp, xp, cols, op, out_stride),
                        (2, 2) => dot_block::<2, 2>(wp, xp, cols, op, out_stride),
                        (2, _) => dot_block::<2, 1>(wp, xp, cols, op, out_stride),
                        (_, 3) => dot_block::<1, 3>(wp, xp, cols, op, out_stride),
                        (_, 2) => dot_block::<1, 2>(wp, xp, cols, op, out_stride),
                        _ => dot_block::<1, 1>(wp, xp, cols, op, out_stride),
                    }
                }
                j += acts;
            }
        }
    }
}

/// `A` activation rows (from `x`) × `W` weight rows (from `w`), all `cols` long and
/// contiguous, into `out[a · out_stride + r]`, each product as [`dot_f32_rows`] defines it.
///
/// # Safety
/// The CPU must support the features; the rows and outputs must be in bounds.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_block<const A: usize, const W: usize>(
    w: *const f32,
    x: *const f32,
    cols: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); W]; A];
    let mut i = 0;
    // SAFETY (every access): guaranteed by the caller, `i + 8 ≤ cols` or `i < cols`.
    unsafe {
        while i + 8 <= cols {
            let mut wv = [_mm256_setzero_ps(); W];
            for (r, wv) in wv.iter_mut().enumerate() {
                *wv = _mm256_loadu_ps(w.add(r * cols + i));
            }
            for (a, acc) in acc.iter_mut().enumerate() {
                let xv = _mm256_loadu_ps(x.add(a * cols + i));
                for (acc, wv) in acc.iter_mut().zip(&wv) {
                    *acc = _mm256_fmadd_ps(xv, *wv, *acc);
                }
            }
            i += 8;
        }
        for (a, acc) in acc.iter().enumerate() {
            for (r, acc) in acc.iter().enumerate() {
                let mut sum = hsum(*acc);
                for k in i..cols {
                    sum += *x.add(a * cols + k) * *w.add(r * cols + k);
                }
                *out.add(a * out_stride + r) = sum;
            }
        }
    }
}

/// A KV cache element as the attention kernels read it, widened to f32: an f16 cache
/// widens with F16C, so on the same values both element types give the same bits.
pub trait CacheValue: Copy {
    /// Eight values from `p`.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C ([`available`]); `p..p + 8` must be readable.
    unsafe fn load8(p: *const Self) -> __m256;

    fn widen(self) -> f32;
}

impl CacheValue for f32 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const f32) -> __m256 {
        // SAFETY: guaranteed by the caller; loadu has no alignment requirement.
        unsafe { _mm256_loadu_ps(p) }
    }

    fn widen(self) -> f32 {
        self
    }
}

impl CacheValue for f16 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const f16) -> __m256 {
        // SAFETY: guaranteed by the caller; loadu has no alignment requirement.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }

    fn widen(self) -> f32 {
        // Exact, as every f16 is an f32.
        self.to_f32()
    }
}

/// As [`super::quant::dot_strided_scalar`], bit for bit: eight rows at a time, one row per
/// lane, each lane a single fused multiply-add chain over the values in order. Blocks of
/// 8 × 8 values are transposed so that one vector holds value `d` of the eight rows, and
/// each transposed block serves up to [`HEADS_PER_PASS`] query heads.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_strided<T: CacheValue>(
    q: &[f32],
    heads: usize,
    rows: StridedRows<'_, T>,
    scale: f32,
    out: &mut [f32],
    out_stride: usize,
) {
    let n = q.len() / heads.max(1);
    let mut i = 0;
    if n.is_multiple_of(8) {
        while i + 8 <= rows.count {
            let r: [&[T]; 8] = std::array::from_fn(|j| rows.row(i + j, n));
            for h0 in (0..heads).step_by(HEADS_PER_PASS) {
                let pass = (heads - h0).min(HEADS_PER_PASS);
                let mut acc = [_mm256_setzero_ps(); HEADS_PER_PASS];
                for c in (0..n).step_by(8) {
                    // SAFETY: `c + 8 ≤ n` and every row is `n` long.
                    let v = r.map(|r| unsafe { T::load8(r.as_ptr().add(c)) });
                    let columns = transpose_8x8(v);
                    for (h, acc) in acc[..pass].iter_mut().enumerate() {
                        let qh = &q[(h0 + h) * n + c..(h0 + h) * n + c + 8];
                        for (j, column) in columns.iter().enumerate() {
                            *acc = _mm256_fmadd_ps(_mm256_set1_ps(qh[j]), *column, *acc);
                        }
                    }
                }
                for (h, acc) in acc[..pass].iter().enumerate() {
                    let at = (h0 + h) * out_stride + i;
                    assert!(at + 8 <= out.len(), "dot_strided output");
                    // SAFETY: checked just above.
                    unsafe {
                        _mm256_storeu_ps(
                            out.as_mut_ptr().add(at),
                            _mm256_mul_ps(*acc, _mm256_set1_ps(scale)),
                        )
                    };
                }
            }
            i += 8;
        }
    }
    // The rows after the last eight: the same in-order chains, one scalar FMA at a time.
    for row in i..rows.count {
        let keys = rows.row(row, n);
        for h in 0..heads {
            let mut acc = _mm_setzero_ps();
            for (a, b) in q[h * n..(h + 1) * n].iter().zip(keys) {
                acc = _mm_fmadd_ss(_mm_set_ss(*a), _mm_set_ss(b.widen()), acc);
            }
            out[h * out_stride + row] = _mm_cvtss_f32(acc) * scale;
        }
    }
}

/// Query heads that share one transposed block of keys in [`dot_strided`].
const HEADS_PER_PASS: usize = 4;

/// Rows `v[0..8]` → columns: lane `i` of result `j` is lane `j` of `v[i]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn transpose_8x8(v: [__m256; 8]) -> [__m256; 8] {
    let t0 = _mm256_unpacklo_ps(v[0], v[1]);
    let t1 = _mm256_unpackhi_ps(v[0], v[1]);
    let t2 = _mm256_unpacklo_ps(v[2], v[3]);
    let t3 = _mm256_unpackhi_ps(v[2], v[3]);
    let t4 = _mm256_unpacklo_ps(v[4], v[5]);
    let t5 = _mm256_unpackhi_ps(v[4], v[5]);
    let t6 = _mm256_unpacklo_ps(v[6], v[7]);
    let t7 = _mm256_unpackhi_ps(v[6], v[7]);
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xee>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xee>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let u5 = _mm256_shuffle_ps::<0xee>(t4, t6);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let u7 = _mm256_shuffle_ps::<0xee>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ]
}

/// As [`super::quant::axpy_strided_scalar`]. Blocks of 64 output values stay in registers
/// while every row is added to them, in the same order as one `axpy` per row.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn axpy_strided<T: CacheValue>(
    weights: &[f32],
    rows: &[T],
    stride: usize,
    out: &mut [f32],
) {
    const BLOCK: usize = 64;
    let n = out.len();
    let mut c0 = 0;
    while c0 + BLOCK <= n {
        let mut acc = [_mm256_setzero_ps(); BLOCK / 8];
        // SAFETY: every access is within `c0..c0 + BLOCK` of `out` or of a row's slice.
        unsafe {
            for (j, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_loadu_ps(out.as_ptr().add(c0 + 8 * j));
            }
            for (i, &w) in weights.iter().enumerate() {
                let row = &rows[i * stride + c0..i * stride + c0 + BLOCK];
                let wv = _mm256_set1_ps(w);
                for (j, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm256_fmadd_ps(wv, T::load8(row.as_ptr().add(8 * j)), *acc);
                }
            }
            for (j, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.as_mut_ptr().add(c0 + 8 * j), *acc);
            }
        }
        c0 += BLOCK;
    }
    if c0 < n {
        // Row by row as [`axpy`] does it: eight fused lanes, then the rest one at a time.
        for (i, &w) in weights.iter().enumerate() {
            let row = &rows[i * stride + c0..i * stride + n];
            let y = &mut out[c0..];
            let wv = _mm256_set1_ps(w);
            let mut c = 0;
            // SAFETY: `c + 8 ≤ row.len() = y.len()`.
            unsafe {
                while c + 8 <= row.len() {
                    let yv = _mm256_loadu_ps(y.as_ptr().add(c));
                    let r = _mm256_fmadd_ps(wv, T::load8(row.as_ptr().add(c)), yv);
                    _mm256_storeu_ps(y.as_mut_ptr().add(c), r);
                    c += 8;
                }
            }
            for (y, x) in y[c..].iter_mut().zip(&row[c..]) {
                *y += w * x.widen();
            }
        }
    }
}

/// e^x for eight lanes: x = n·ln2 + r with |r| ≤ ln2/2, e^r by its Taylor series to r⁷
/// (within 2 ulp of the correctly rounded value), 2^n put into the exponent bits. Results
/// stay normal floats: inputs above 88.37 give e^88.37 (softmax and SiLU only need that
/// they are huge), and inputs whose e^x would be subnormal give 0 (an error below 1.2e-38).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn exp8(x: __m256) -> __m256 {
    let normal = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(-87.33));
    let x = _mm256_max_ps(
        _mm256_min_ps(x, _mm256_set1_ps(88.37)),
        _mm256_set1_ps(-87.33),
    );
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    // ln 2 in two parts, so n·ln2 is subtracted without rounding error for |n| ≤ 128.
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_145_75), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428_606_8e-6), r);
    let mut p = _mm256_set1_ps(1.0 / 5040.0);
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let scale = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(scale)), normal)
}

/// As [`super::quant::exp_sum_scalar`], with [`exp8`].
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn exp_sum(x: &mut [f32], shift: f32) -> f32 {
    let mut chunks = x.chunks_exact_mut(8);
    let mut acc = _mm256_setzero_ps();
    for c in &mut chunks {
        // SAFETY: the chunk is 8 floats.
        unsafe {
            let e = exp8(_mm256_sub_ps(
                _mm256_loadu_ps(c.as_ptr()),
                _mm256_set1_ps(shift),
            ));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            acc = _mm256_add_ps(acc, e);
        }
    }
    hsum(acc) + super::quant::exp_sum_scalar(chunks.into_remainder(), shift)
}

/// As [`super::quant::silu_mul_scalar`], with [`exp8`].
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
    let n = gate.len().min(up.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: `i + 8 ≤ n` for both slices.
        unsafe {
            let g = _mm256_loadu_ps(gate.as_ptr().add(i));
            let u = _mm256_loadu_ps(up.as_ptr().add(i));
            let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
            let silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0), e));
            _mm256_storeu_ps(gate.as_mut_ptr().add(i), _mm256_mul_ps(silu, u));
        }
        i += 8;
    }
    super::quant::silu_mul_scalar(&mut gate[i..n], &up[i..n]);
}

/// y += a · x
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len().min(y.len());
    let av = _mm256_set1_ps(a);
    let mut i = 0;
    // SAFETY: every access is within `0..n` of both slices.
    unsafe {
        while i + 8 <= n {
            let yv = _mm256_loadu_ps(y.as_ptr().add(i));
            let r = _mm256_fmadd_ps(av, _mm256_loadu_ps(x.as_ptr().add(i)), yv);
            _mm256_storeu_ps(y.as_mut_ptr().add(i), r);
            i += 8;
        }
    }
    for j in i..n {
        y[j] += a * x[j];
    }
}

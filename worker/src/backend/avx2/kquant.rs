//! The grouped matmul kernels of the k-quant formats (`Q4_K`, `Q5_K`, `Q6_K`), whose
//! super-blocks carry per-sub-block scales the 32-value formats' kernels do not.

use std::arch::x86_64::*;

use super::common::*;
use super::int8::q4_1_sum;
use crate::backend::interleaved::{BlockQ4Kx8, BlockQ6Kx8, InterleavedGroup};
use crate::backend::kquant::{ACT_BLOCKS, BlockQ4K, BlockQ5K, BlockQ6K};
use crate::backend::quant::{BlockQ8Act, GROUP_ROWS, QK, WeightGroup};

/// One 32-value sub-block column of a `Q4_K`/`Q5_K` group: vector `k` holds values
/// `4k..4k + 4` of each row (unsigned bytes) in its 32-bit lane, with the rows' d·sc and
/// dmin·m.
#[derive(Clone, Copy)]
pub(super) struct ExpandedKMin {
    pub(super) q: [__m256i; 8],
    pub(super) d: __m256,
    pub(super) m: __m256,
}

/// One 32-value column of a `Q6_K` group: the unsigned values q + 32 laid out as in
/// [`ExpandedKMin`], the rows' d, and the scales of its two 16-value sub-blocks as i32 lanes.
#[derive(Clone, Copy)]
pub(super) struct ExpandedQ6K {
    pub(super) q: [__m256i; 8],
    pub(super) d: __m256,
    pub(super) sc: [__m256i; 2],
}

/// `Q4_K` and `Q5_K`: d·sc·(Σ q·x)·d_x − dmin·m·s_x.
/// The float step the AVX2, VNNI and pair kernels share, as the 32-value formats' in
/// `int8.rs`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn kmin_finish(e: &ExpandedKMin, x: &BlockQ8Act, sum: __m256i, acc: &mut __m256) {
    let sum = _mm256_cvtepi32_ps(sum);
    let scaled = _mm256_mul_ps(_mm256_mul_ps(e.d, _mm256_set1_ps(x.d)), sum);
    let offset = _mm256_mul_ps(e.m, _mm256_set1_ps(x.s));
    *acc = _mm256_add_ps(*acc, _mm256_sub_ps(scaled, offset));
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
/// in both formats): the 6-bit fields of [`crate::backend::kquant::scale_min_k4`] are unpacked with one
/// row per 32-bit lane, and each product is the scalar kernel's single f32 multiply.
///
/// # Safety
/// Every pointer must be the start of a `Q4_K` or `Q5_K` block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kmin_scales(heads: [*const u8; GROUP_ROWS]) -> ([__m256; 8], [__m256; 8]) {
    // SAFETY: guaranteed by the caller; both block types are larger than 16 bytes.
    kmin_scales_of(unsafe { transpose_rows(heads) })
}

/// [`kmin_scales`] from the heads already in lanes, as [`transpose_rows`] leaves them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn kmin_scales_of([dm, low, mid, high]: [__m256i; 4]) -> ([__m256; 8], [__m256; 8]) {
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
pub(super) fn expand_q4_k(
    blocks: &[&BlockQ4K; GROUP_ROWS],
    mut emit: impl FnMut(usize, &ExpandedKMin),
) {
    // SAFETY: the pointers are the blocks' own.
    let (d, m) = unsafe { kmin_scales(column_ptrs(blocks, |b| (b as *const BlockQ4K).cast())) };
    for i in 0..4 {
        // SAFETY: each `qs` is 128 bytes; 32 are read from byte 32·i.
        let w = unsafe { words32(column_ptrs(blocks, |b| b.qs.as_ptr().add(32 * i))) };
        emit_q4_k_pair(i, &w, (&d, &m), &mut emit);
    }
}

/// [`expand_q4_k`] of an interleaved column: the same vectors, loaded as stored.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn expand_q4_kx8(column: &BlockQ4Kx8, mut emit: impl FnMut(usize, &ExpandedKMin)) {
    let (d, m) = kmin_scales_of(std::array::from_fn(|v| vector_at(&column.heads, v)));
    for i in 0..4 {
        let w = std::array::from_fn(|k| vector_at(&column.qs, 8 * i + k));
        emit_q4_k_pair(i, &w, (&d, &m), &mut emit);
    }
}

/// The 32-byte vector `v` of an interleaved column's field.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn vector_at(bytes: &[u8], v: usize) -> __m256i {
    let vector = &bytes[32 * v..32 * (v + 1)];
    // SAFETY: `vector` is 32 readable bytes; loadu has no alignment requirement.
    unsafe { _mm256_loadu_si256(vector.as_ptr().cast()) }
}

/// Sub-blocks `2i` (the low nibbles of `w`) and `2i + 1` (the high ones) of a `Q4_K` column.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn emit_q4_k_pair(
    i: usize,
    w: &[__m256i; 8],
    (d, m): (&[__m256; 8], &[__m256; 8]),
    emit: &mut impl FnMut(usize, &ExpandedKMin),
) {
    let low = _mm256_set1_epi8(0x0f);
    let (mut first, mut second) = ([_mm256_setzero_si256(); 8], [_mm256_setzero_si256(); 8]);
    for ((first, second), w) in first.iter_mut().zip(&mut second).zip(w) {
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

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn expand_q5_k(
    blocks: &[&BlockQ5K; GROUP_ROWS],
    mut emit: impl FnMut(usize, &ExpandedKMin),
) {
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
pub(super) fn expand_q6_k(
    blocks: &[&BlockQ6K; GROUP_ROWS],
    mut emit: impl FnMut(usize, &ExpandedQ6K),
) {
    let d = f16x8(blocks.map(|b| b.d));
    // SAFETY: each `scales` is 16 bytes.
    let scales = unsafe { transpose_rows(column_ptrs(blocks, |b| b.scales.as_ptr().cast())) };
    for half in 0..2 {
        // SAFETY: `ql` is 128 bytes and `qh` 64; 32 are read from each start.
        let words = unsafe {
            [
                words32(column_ptrs(blocks, |b| b.ql.as_ptr().add(64 * half))),
                words32(column_ptrs(blocks, |b| b.ql.as_ptr().add(64 * half + 32))),
                words32(column_ptrs(blocks, |b| b.qh.as_ptr().add(32 * half))),
            ]
        };
        emit_q6_k_half(half, &words, d, &scales, &mut emit);
    }
}

/// [`expand_q6_k`] of an interleaved column: the same vectors, loaded as stored.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn expand_q6_kx8(column: &BlockQ6Kx8, mut emit: impl FnMut(usize, &ExpandedQ6K)) {
    let d = f16x8(column.d);
    let scales = std::array::from_fn(|v| vector_at(&column.scales, v));
    for half in 0..2 {
        let words = [
            std::array::from_fn(|k| vector_at(&column.ql, 16 * half + k)),
            std::array::from_fn(|k| vector_at(&column.ql, 16 * half + 8 + k)),
            std::array::from_fn(|k| vector_at(&column.qh, 8 * half + k)),
        ];
        emit_q6_k_half(half, &words, d, &scales, &mut emit);
    }
}

/// Sub-block columns `4·half..4·half + 4` of a `Q6_K` column, from the words of its low bits
/// at byte `64·half` and `64·half + 32` and of its high bits at byte `32·half`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn emit_q6_k_half(
    half: usize,
    [ql_a, ql_b, qh]: &[[__m256i; 8]; 3],
    d: __m256,
    scales: &[__m256i; 4],
    emit: &mut impl FnMut(usize, &ExpandedQ6K),
) {
    let low = _mm256_set1_epi8(0x0f);
    let top_two = _mm256_set1_epi8(0x30);
    for p in 0..4 {
        let c = 4 * half + p;
        let ql = if p % 2 == 0 { ql_a } else { ql_b };
        let mut q = [_mm256_setzero_si256(); 8];
        for ((q, ql), qh) in q.iter_mut().zip(ql).zip(qh) {
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
                sc: [signed_byte(scales, 2 * c), signed_byte(scales, 2 * c + 1)],
            },
        );
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
pub(super) const K_SPAN: usize = 2;

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
            gemm_q4_k_group, WeightGroup<'_, BlockQ4K>, ExpandedKMin, expand_q4_k, kq4_block,
            kq4_streamed, kq4_pass);
        kquant_kernel!($features, $widest, [$($rest),*],
            /// As [`crate::backend::interleaved::gemm_group_scalar`] of `Q4_K`, bit for bit.
            gemm_q4_kx8_group, InterleavedGroup<'_, BlockQ4Kx8>, ExpandedKMin, expand_q4_kx8,
            kq4_block, kq4x8_streamed, kq4x8_pass);
        kquant_kernel!($features, $widest, [$($rest),*],
            /// As [`crate::backend::kquant::gemm_q5_k_group_scalar`], bit for bit.
            gemm_q5_k_group, WeightGroup<'_, BlockQ5K>, ExpandedKMin, expand_q5_k, kq5_block,
            kq5_streamed, kq5_pass);
        kquant_kernel!($features, $widest, [$($rest),*],
            /// As [`crate::backend::kquant::gemm_q6_k_group_scalar`], bit for bit.
            gemm_q6_k_group, WeightGroup<'_, BlockQ6K>, ExpandedQ6K, expand_q6_k, kq6_block,
            kq6_streamed, kq6_pass);
        kquant_kernel!($features, $widest, [$($rest),*],
            /// As [`crate::backend::interleaved::gemm_group_scalar`] of `Q6_K`, bit for bit.
            gemm_q6_kx8_group, InterleavedGroup<'_, BlockQ6Kx8>, ExpandedQ6K, expand_q6_kx8,
            kq6_block, kq6x8_streamed, kq6x8_pass);
    };
}

/// One k-quant format's grouped kernel. A batch of at most `$widest` activation rows takes
/// one streamed pass (`$streamed`): each sub-block column is applied as `$expand` makes it,
/// so nothing is stored. A larger batch expands [`K_SPAN`] super-block columns of the group
/// at a time into sub-block columns, then every activation row meets them, `$widest` rows a
/// pass (`$pass`, applying `$block` per column).
macro_rules! kquant_kernel {
    ($features:literal, $widest:literal, [$($rest:literal),*],
     $(#[$doc:meta])* $gemm:ident, $group:ty, $expanded_ty:ty, $expand:ident,
     $block:ident, $streamed:ident, $pass:ident) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// The CPU must support the module's target features.
        #[target_feature(enable = $features)]
        pub unsafe fn $gemm(w: $group, x: &[BlockQ8Act], out: &mut [[f32; GROUP_ROWS]]) {
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
            w: $group,
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
pub(super) fn kq5_sum(q: &[__m256i; 8], x: &[i8; QK]) -> __m256i {
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

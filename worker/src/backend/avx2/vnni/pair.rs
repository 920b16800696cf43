//! The grouped kernels over two groups at once (16 weight rows) on 512-bit vectors, for
//! batches wider than one VNNI pass. A 512-bit `vpdpbusd` runs at the rate of a 256-bit one
//! here, so with the first group's rows in lanes 0..8 and the second's in lanes 8..16, each
//! instruction (its activation word broadcast to every lane) does twice the work. The
//! columns are the VNNI kernels' expansions, joined, and every lane's arithmetic is theirs,
//! so the results are bit-equal to theirs at any batch size.

use std::mem::MaybeUninit;

use super::*;

/// Weight rows of a pair of groups.
pub const PAIR_ROWS: usize = 2 * GROUP_ROWS;

/// The smallest batch the pair kernels pay for: batches of one VNNI pass (8 rows) or fewer
/// stream each group's columns through registers, which measured faster (8-sequence decode
/// on the 7B shape: 18.2 tok/s that way, 16.0 through the pairs' stored spans).
pub const MIN_BATCH: usize = 9;

/// A column of two groups: the format's weight words, its d and, where it has one, its m.
#[derive(Clone, Copy)]
struct PairColumn {
    q: [__m512i; 8],
    d: __m512,
    m: __m512,
}

/// A `Q6_K` column of two groups.
#[derive(Clone, Copy)]
struct PairQ6K {
    q: [__m512i; 8],
    d: __m512,
    sc: [__m512i; 2],
}

#[inline]
#[target_feature(enable = "avx512f")]
fn join(first: __m256i, second: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(first), second)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn join_ps(first: __m256, second: __m256) -> __m512 {
    _mm512_castsi512_ps(join(
        _mm256_castps_si256(first),
        _mm256_castps_si256(second),
    ))
}

#[inline]
#[target_feature(enable = "avx512f")]
fn join_words(first: &[__m256i; 8], second: &[__m256i; 8]) -> [__m512i; 8] {
    let mut q = [_mm512_setzero_si512(); 8];
    for ((q, a), b) in q.iter_mut().zip(first).zip(second) {
        *q = join(*a, *b);
    }
    q
}

/// What a pair takes from an expanded 32-value column: its weight words, d, and m where
/// the format has one.
trait ColumnParts {
    fn parts(&self) -> (&[__m256i; 8], __m256, Option<__m256>);
}

impl ColumnParts for ExpandedKMin {
    fn parts(&self) -> (&[__m256i; 8], __m256, Option<__m256>) {
        (&self.q, self.d, Some(self.m))
    }
}

impl ColumnParts for ExpandedQ4_1 {
    fn parts(&self) -> (&[__m256i; 8], __m256, Option<__m256>) {
        (&self.nibbles, self.d, Some(self.m))
    }
}

impl ColumnParts for ExpandedQ5_0 {
    fn parts(&self) -> (&[__m256i; 8], __m256, Option<__m256>) {
        (&self.q, self.d, None)
    }
}

impl ColumnParts for ExpandedQ5_1 {
    fn parts(&self) -> (&[__m256i; 8], __m256, Option<__m256>) {
        (&self.q, self.d, Some(self.m))
    }
}

impl ColumnParts for ExpandedQ8_0 {
    fn parts(&self) -> (&[__m256i; 8], __m256, Option<__m256>) {
        (&self.unsigned, self.d, None)
    }
}

#[inline]
#[target_feature(enable = "avx512f")]
fn join_columns<E: ColumnParts>(first: &E, second: &E) -> PairColumn {
    let ((q0, d0, m0), (q1, d1, m1)) = (first.parts(), second.parts());
    let none = _mm256_setzero_ps();
    PairColumn {
        q: join_words(q0, q1),
        d: join_ps(d0, d1),
        m: join_ps(m0.unwrap_or(none), m1.unwrap_or(none)),
    }
}

#[inline]
#[target_feature(enable = "avx512f")]
fn join_q6_k(first: &ExpandedQ6K, second: &ExpandedQ6K) -> PairQ6K {
    PairQ6K {
        q: join_words(&first.q, &second.q),
        d: join_ps(first.d, second.d),
        sc: [
            join(first.sc[0], second.sc[0]),
            join(first.sc[1], second.sc[1]),
        ],
    }
}

/// Activation bytes `4k..4k + 4` in every lane.
#[inline]
#[target_feature(enable = "avx512f")]
fn broadcast_word(qs: &[i8; QK], k: usize) -> __m512i {
    // SAFETY: 4k + 4 ≤ 32 for k < 8; the read has no alignment requirement.
    _mm512_set1_epi32(unsafe { std::ptr::read_unaligned(qs.as_ptr().add(4 * k).cast::<i32>()) })
}

/// Σ q·x of words `words` of `q` against the same words of each activation row: the VNNI
/// chains of the group kernels, 16 rows wide, the rows' chains interleaved.
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
fn word_sums<const A: usize>(
    q: &[__m512i; 8],
    x: &[&BlockQ8Act; A],
    words: std::ops::Range<usize>,
) -> [__m512i; A] {
    let mut sums = [_mm512_setzero_si512(); A];
    for k in words {
        for (sum, x) in sums.iter_mut().zip(x) {
            *sum = _mm512_dpbusd_epi32(*sum, q[k], broadcast_word(&x.qs, k));
        }
    }
    sums
}

// The float steps of the 32-value columns, each the 256-bit finish of its format lane for
// lane, from the column's i32 sums Σ q·x.

/// As [`kmin_finish`].
#[inline]
#[target_feature(enable = "avx512f")]
fn kmin_finish_wide(e: &PairColumn, x: &BlockQ8Act, sum: __m512i, acc: &mut __m512) {
    let sum = _mm512_cvtepi32_ps(sum);
    let scaled = _mm512_mul_ps(_mm512_mul_ps(e.d, _mm512_set1_ps(x.d)), sum);
    let offset = _mm512_mul_ps(e.m, _mm512_set1_ps(x.s));
    *acc = _mm512_add_ps(*acc, _mm512_sub_ps(scaled, offset));
}

/// As [`q4_1_finish`].
#[inline]
#[target_feature(enable = "avx512f")]
fn q4_1_finish_wide(e: &PairColumn, x: &BlockQ8Act, sum: __m512i, acc: &mut __m512) {
    let sum = _mm512_cvtepi32_ps(sum);
    *acc = _mm512_fmadd_ps(sum, _mm512_mul_ps(e.d, _mm512_set1_ps(x.d)), *acc);
    *acc = _mm512_fmadd_ps(e.m, _mm512_set1_ps(x.s), *acc);
}

/// As [`q5_0_finish`], after Σ (q − 8)·x is taken as Σ q·x − 8·Σx in integers.
#[inline]
#[target_feature(enable = "avx512f")]
fn q4_0_finish_wide(e: &PairColumn, x: &BlockQ8Act, sum: __m512i, acc: &mut __m512) {
    let sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(8 * x.sum));
    let scaled = _mm512_mul_ps(
        _mm512_mul_ps(e.d, _mm512_set1_ps(x.d)),
        _mm512_cvtepi32_ps(sum),
    );
    *acc = _mm512_add_ps(*acc, scaled);
}

/// As [`q5_0_finish`], after Σ (q − 16)·x is taken as Σ q·x − 16·Σx in integers.
#[inline]
#[target_feature(enable = "avx512f")]
fn q5_0_finish_wide(e: &PairColumn, x: &BlockQ8Act, sum: __m512i, acc: &mut __m512) {
    let sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(16 * x.sum));
    let scaled = _mm512_mul_ps(
        _mm512_mul_ps(e.d, _mm512_set1_ps(x.d)),
        _mm512_cvtepi32_ps(sum),
    );
    *acc = _mm512_add_ps(*acc, scaled);
}

/// As [`q5_1_finish`].
#[inline]
#[target_feature(enable = "avx512f")]
fn q5_1_finish_wide(e: &PairColumn, x: &BlockQ8Act, sum: __m512i, acc: &mut __m512) {
    let sum = _mm512_cvtepi32_ps(sum);
    let scaled = _mm512_mul_ps(_mm512_mul_ps(e.d, _mm512_set1_ps(x.d)), sum);
    let offset = _mm512_mul_ps(e.m, _mm512_set1_ps(x.s));
    *acc = _mm512_add_ps(*acc, _mm512_add_ps(scaled, offset));
}

/// As the VNNI `q8_0_finish`: the weights are q + 128, so 128·Σx comes out first.
#[inline]
#[target_feature(enable = "avx512f")]
fn q8_0_finish_wide(e: &PairColumn, x: &BlockQ8Act, sum: __m512i, acc: &mut __m512) {
    let sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, _mm512_set1_epi32(128 * x.sum)));
    *acc = _mm512_fmadd_ps(sum, _mm512_mul_ps(e.d, _mm512_set1_ps(x.d)), *acc);
}

/// `$block::<A>`: one 32-value column against `A` activation rows, their chains
/// interleaved, each row's sum then taken by `$finish`.
macro_rules! column_block {
    ($block:ident, $finish:ident) => {
        #[inline]
        #[target_feature(enable = "avx512f,avx512vnni")]
        fn $block<const A: usize>(e: &PairColumn, x: [&BlockQ8Act; A], acc: &mut [__m512; A]) {
            let sums = word_sums(&e.q, &x, 0..8);
            for ((acc, x), sum) in acc.iter_mut().zip(x).zip(sums) {
                $finish(e, x, sum, acc);
            }
        }
    };
}

column_block!(kmin_block, kmin_finish_wide);
column_block!(q4_0_block, q4_0_finish_wide);
column_block!(q4_1_block, q4_1_finish_wide);
column_block!(q5_0_block, q5_0_finish_wide);
column_block!(q5_1_block, q5_1_finish_wide);
column_block!(q8_0_block, q8_0_finish_wide);

/// As the VNNI `kq6_block`, lane for lane.
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
fn q6_k_block<const A: usize>(e: &PairQ6K, x: [&BlockQ8Act; A], acc: &mut [__m512; A]) {
    let lo = word_sums(&e.q, &x, 0..4);
    let hi = word_sums(&e.q, &x, 4..8);
    for (((acc, x), lo), hi) in acc.iter_mut().zip(x).zip(lo).zip(hi) {
        let lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(32 * x.low_sum));
        let hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(32 * (x.sum - x.low_sum)));
        let sum = _mm512_add_epi32(
            _mm512_mullo_epi32(lo, e.sc[0]),
            _mm512_mullo_epi32(hi, e.sc[1]),
        );
        let scaled = _mm512_mul_ps(
            _mm512_mul_ps(e.d, _mm512_set1_ps(x.d)),
            _mm512_cvtepi32_ps(sum),
        );
        *acc = _mm512_add_ps(*acc, scaled);
    }
}

/// `$pass::<A>`: a span of joined columns (`$column_ty`) against `A` activation rows, added
/// to `out`, applying `$block` per column.
macro_rules! pair_pass {
    ($pass:ident, $column_ty:ty, $block:ident) => {
        /// # Safety
        /// The CPU must support the module's features.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
        unsafe fn $pass<const A: usize>(
            span: &[$column_ty],
            x: [&[BlockQ8Act]; A],
            out: &mut [[f32; PAIR_ROWS]],
        ) {
            let mut acc = [_mm512_setzero_ps(); A];
            for (acc, out) in acc.iter_mut().zip(out.iter()) {
                // SAFETY: each row is 16 readable f32.
                *acc = unsafe { _mm512_loadu_ps(out.as_ptr()) };
            }
            for (b, e) in span.iter().enumerate() {
                $block(e, x.map(|x| &x[b]), &mut acc);
            }
            for (acc, out) in acc.iter().zip(out) {
                // SAFETY: each row is 16 writable f32.
                unsafe { _mm512_storeu_ps(out.as_mut_ptr(), *acc) };
            }
        }
    };
}

/// A 32-value block format's pair kernel: it expands spans of block columns of both groups
/// ([`over_expanded_spans`]), joins them, and meets every activation row with them, eight
/// rows a pass.
macro_rules! block_pair_kernel {
    ($(#[$doc:meta])* $gemm:ident, $block_ty:ty, $expand:ident, $block:ident, $pass:ident) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// The CPU must support the module's features.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
        pub unsafe fn $gemm(
            first: WeightGroup<'_, $block_ty>,
            second: WeightGroup<'_, $block_ty>,
            x: &[BlockQ8Act],
            out: &mut [[f32; PAIR_ROWS]],
        ) {
            let nb = first.row_blocks();
            out.fill([0.0; PAIR_ROWS]);
            if nb == 0 {
                return;
            }
            let join = |b| {
                prefetch_share(second, b, 2);
                join_columns(&$expand(&first.column(b)), &$expand(&second.column(b)))
            };
            over_expanded_spans(nb, join, |span, blocks| {
                over_activation_rows!($pass, span, x, nb, blocks, &mut *out,
                    8, [7, 6, 5, 4, 3, 2, 1]);
            });
        }

        pair_pass!($pass, PairColumn, $block);
    };
}

/// One k-quant format's pair kernel: it expands [`K_SPAN`] super-block columns of both
/// groups at a time, joins them, and meets every activation row with them, eight rows a
/// pass.
macro_rules! kquant_pair_kernel {
    ($(#[$doc:meta])* $gemm:ident, $group:ty, $expanded_ty:ty, $pair_ty:ty,
     $expand:ident, $join:ident, $block:ident, $pass:ident) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// The CPU must support the module's features.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
        pub unsafe fn $gemm(
            first: $group,
            second: $group,
            x: &[BlockQ8Act],
            out: &mut [[f32; PAIR_ROWS]],
        ) {
            let nbk = first.row_blocks();
            out.fill([0.0; PAIR_ROWS]);
            let nb = nbk * ACT_BLOCKS;
            let mut halves =
                [[const { MaybeUninit::<$expanded_ty>::uninit() }; ACT_BLOCKS]; 2];
            let mut scratch =
                [[const { MaybeUninit::<$pair_ty>::uninit() }; ACT_BLOCKS]; K_SPAN];
            for s0 in (0..nbk).step_by(K_SPAN) {
                let s1 = (s0 + K_SPAN).min(nbk);
                for s in s0..s1 {
                    for (half, group) in halves.iter_mut().zip([first, second]) {
                        $expand(&group.column(s), |j, e| {
                            half[j].write(*e);
                        });
                    }
                    for (j, column) in scratch[s - s0].iter_mut().enumerate() {
                        // SAFETY: both expansions just above wrote every column j.
                        let (a, b) = unsafe {
                            (halves[0][j].assume_init_ref(), halves[1][j].assume_init_ref())
                        };
                        column.write($join(a, b));
                    }
                    prefetch_share(second, s, 2);
                }
                // SAFETY: the loop above wrote every column of rows 0..s1 - s0.
                let span = unsafe {
                    std::slice::from_raw_parts(
                        scratch.as_ptr() as *const $pair_ty,
                        (s1 - s0) * ACT_BLOCKS,
                    )
                };
                over_activation_rows!($pass, span, x, nb, s0 * ACT_BLOCKS..s1 * ACT_BLOCKS,
                    &mut *out, 8, [7, 6, 5, 4, 3, 2, 1]);
            }
        }

        pair_pass!($pass, $pair_ty, $block);
    };
}

block_pair_kernel!(
    /// Two groups of [`super::gemm_q4_0_group`], bit for bit.
    gemm_q4_0_pair, BlockQ4_0, expand_q4_0, q4_0_block, q4_0_pass
);
block_pair_kernel!(
    /// Two groups of [`super::gemm_q4_1_group`], bit for bit.
    gemm_q4_1_pair, BlockQ4_1, expand_q4_1, q4_1_block, q4_1_pass
);
block_pair_kernel!(
    /// Two groups of [`super::gemm_q5_0_group`], bit for bit.
    gemm_q5_0_pair, BlockQ5_0, expand_q5_0, q5_0_block, q5_0_pass
);
block_pair_kernel!(
    /// Two groups of [`super::gemm_q5_1_group`], bit for bit.
    gemm_q5_1_pair, BlockQ5_1, expand_q5_1, q5_1_block, q5_1_pass
);
block_pair_kernel!(
    /// Two groups of [`super::gemm_q8_0_group`], bit for bit.
    gemm_q8_0_pair, BlockQ8_0, expand_q8_0, q8_0_block, q8_0_pass
);
kquant_pair_kernel!(
    /// Two groups of [`super::gemm_q4_k_group`], bit for bit.
    gemm_q4_k_pair, WeightGroup<'_, BlockQ4K>, ExpandedKMin, PairColumn, expand_q4_k,
    join_columns, kmin_block, q4_k_pass
);
kquant_pair_kernel!(
    /// Two groups of [`super::gemm_q4_kx8_group`], bit for bit.
    gemm_q4_kx8_pair, InterleavedGroup<'_, BlockQ4Kx8>, ExpandedKMin, PairColumn,
    expand_q4_kx8, join_columns, kmin_block, q4_kx8_pass
);
kquant_pair_kernel!(
    /// Two groups of [`super::gemm_q6_kx8_group`], bit for bit.
    gemm_q6_kx8_pair, InterleavedGroup<'_, BlockQ6Kx8>, ExpandedQ6K, PairQ6K, expand_q6_kx8,
    join_q6_k, q6_k_block, q6_kx8_pass
);
kquant_pair_kernel!(
    /// Two groups of [`super::gemm_q5_k_group`], bit for bit.
    gemm_q5_k_pair, WeightGroup<'_, BlockQ5K>, ExpandedKMin, PairColumn, expand_q5_k,
    join_columns, kmin_block, q5_k_pass
);
kquant_pair_kernel!(
    /// Two groups of [`super::gemm_q6_k_group`], bit for bit.
    gemm_q6_k_pair, WeightGroup<'_, BlockQ6K>, ExpandedQ6K, PairQ6K, expand_q6_k,
    join_q6_k, q6_k_block, q6_k_pass
);

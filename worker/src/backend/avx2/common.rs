//! What the AVX2 kernel families share: lane sums, the 8-row transposes and broadcasts the
//! grouped kernels are built on, their prefetching, and the split of a batch into passes.

use std::arch::x86_64::*;

use half::f16;

use crate::backend::interleaved::InterleavedGroup;
use crate::backend::quant::{BlockQ8Act, GROUP_ROWS, QK, WeightGroup};

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

/// 16 bytes at each of `rows[0..8]` → four vectors; vector `k` holds bytes `4k..4k + 4` of
/// row `r` in 32-bit lane `r`. Rows `r` and `r + 4` share a load, then a 4 × 4 transpose of
/// 32-bit words runs in each 128-bit half.
///
/// # Safety
/// Every pointer must have 16 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn transpose_rows(rows: [*const u8; GROUP_ROWS]) -> [__m256i; 4] {
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
pub(super) fn column_ptrs<B>(
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
pub(super) fn broadcast_word(qs: &[i8; QK], k: usize) -> __m256i {
    let word = [qs[4 * k], qs[4 * k + 1], qs[4 * k + 2], qs[4 * k + 3]];
    _mm256_set1_epi32(i32::from_le_bytes(word.map(|b| b as u8)))
}

/// Eight f16 values as eight f32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn f16x8(h: [f16; GROUP_ROWS]) -> __m256 {
    let bits = h.map(f16::to_bits);
    // SAFETY: `bits` is 16 readable bytes.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(bits.as_ptr() as *const __m128i) })
}

/// Groups up to this size are prefetched into L1 by [`prefetch_share`]: the next one fits
/// there beside the one being read and the activations.
const L1_PREFETCHED_GROUP_BYTES: usize = 8 << 10;
/// Groups of eight separate rows up to this size are prefetched into L2. A larger one's
/// rows are each long enough (4 KiB and more) for the hardware prefetchers to follow, and
/// explicit requests only took issue slots: on a 7B model's down projection (8 rows of
/// 10.6 KiB a group) batch-1 `Q4_K` ran 15–40% faster without them, one thread measured
/// alone.
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
/// An interleaved group's columns are one run of bytes, and the next groups' follow it; a
/// large one's are requested into L2 too, since the hardware prefetchers do not run far
/// enough ahead of one stream (7B shape, batch 1, one thread: 5.4 to 5.7 tok/s with the
/// requests against 4.6 to 4.8 without; two threads as fast or faster in four alternating runs).
///
/// Prefetches never fault, so a share past the end of the matrix is harmless.
#[inline(always)]
pub(super) fn prefetch_share(group: impl Prefetched, b: usize, groups: usize) {
    group.prefetch_share(b, groups)
}

/// A group whose next groups' bytes the kernels request ahead ([`prefetch_share`]).
pub(super) trait Prefetched {
    fn prefetch_share(self, b: usize, groups: usize);
}

impl<B> Prefetched for WeightGroup<'_, B> {
    #[inline(always)]
    fn prefetch_share(self, b: usize, groups: usize) {
        match self.contiguous() {
            Some(blocks) => prefetch_following(
                blocks,
                self.row_blocks(),
                b,
                groups,
                L2_PREFETCHED_GROUP_BYTES,
            ),
            None => prefetch_next_rows(self, b),
        }
    }
}

impl<C> Prefetched for InterleavedGroup<'_, C> {
    #[inline(always)]
    fn prefetch_share(self, b: usize, groups: usize) {
        prefetch_following(self.columns(), self.row_blocks(), b, groups, usize::MAX)
    }
}

/// Share `b` of `nb` of the `groups` groups stored after `group`, each its size, into L1
/// or, up to `l2_bytes` of them, into L2.
#[inline(always)]
fn prefetch_following<B>(group: &[B], nb: usize, b: usize, groups: usize, l2_bytes: usize) {
    let bytes = groups * std::mem::size_of_val(group);
    let next = group.as_ptr().wrapping_add(group.len()) as *const i8;
    let (start, end) = (b * bytes / nb, (b + 1) * bytes / nb);
    if bytes <= L1_PREFETCHED_GROUP_BYTES {
        for offset in (start..end).step_by(64) {
            // SAFETY: SSE, which `_mm_prefetch` needs, is part of every x86-64 CPU.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(offset)) };
        }
    } else if bytes <= l2_bytes {
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

/// Accumulators of `A` activation rows over one group, read from and written back to `out`
/// so a group can be computed a span of blocks at a time.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn load_rows<const A: usize>(out: &[[f32; GROUP_ROWS]]) -> [__m256; A] {
    let mut acc = [_mm256_setzero_ps(); A];
    for (acc, out) in acc.iter_mut().zip(out) {
        // SAFETY: each row is 8 readable f32.
        *acc = unsafe { _mm256_loadu_ps(out.as_ptr()) };
    }
    acc
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn store_rows<const A: usize>(acc: [__m256; A], out: &mut [[f32; GROUP_ROWS]]) {
    for (acc, out) in acc.iter().zip(out) {
        // SAFETY: each row is 8 writable f32.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), *acc) };
    }
}

/// Activation rows `j..j + A`, each its blocks `blocks` of `nb`.
///
/// A plain loop, not `array::from_fn`: a closure written in a function with target
/// features inherits them, which keeps it from being inlined into generic std code, and
/// it then cost a call per row.
#[inline(always)]
pub(super) fn activation_rows<'a, const A: usize>(
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

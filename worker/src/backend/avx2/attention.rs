//! The attention kernels over a page of the KV cache, f32 or f16: scores of query heads
//! against strided key rows, and the score-weighted sum of value rows.

use std::arch::x86_64::*;

use half::f16;

use crate::backend::StridedRows;

/// A KV cache element as the attention kernels read it, widened to f32: an f16 cache
/// widens with F16C, so on the same values both element types give the same bits.
pub trait CacheValue: Copy {
    /// Eight values from `p`.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C ([`available`](super::available)); `p..p + 8` must be readable.
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

/// As [`crate::backend::scalar::dot_strided_scalar`], bit for bit: eight rows at a time, one row per
/// lane, each lane a single fused multiply-add chain over the values in order. Blocks of
/// 8 × 8 values are transposed so that one vector holds value `d` of the eight rows, and
/// each transposed block serves up to [`HEADS_PER_PASS`] query heads.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`](super::available)).
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

/// As [`crate::backend::scalar::axpy_strided_scalar`]. Blocks of 64 output values stay in registers
/// while every row is added to them, in the same order as one `axpy` per row.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`](super::available)).
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

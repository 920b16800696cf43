//! The f32 kernels: the float matmul's dot products, `axpy`, and the vectorised e^x behind
//! softmax and SwiGLU.

use std::arch::x86_64::*;

use super::common::hsum;

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
/// The CPU must support AVX2, FMA and F16C ([`available`](super::available)).
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

/// As [`crate::backend::scalar::exp_sum_scalar`], with [`exp8`].
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`](super::available)).
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
    hsum(acc) + crate::backend::scalar::exp_sum_scalar(chunks.into_remainder(), shift)
}

/// As [`crate::backend::scalar::silu_mul_scalar`], with [`exp8`].
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`](super::available)).
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
    crate::backend::scalar::silu_mul_scalar(&mut gate[i..n], &up[i..n]);
}

/// y += a · x
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`](super::available)).
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

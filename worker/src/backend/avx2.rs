//! AVX2 + FMA + F16C kernels. Each has a scalar twin in `quant.rs` it is tested against.
//!
//! The int8 dot products use `maddubs` (u8 × i8 → i16 pairs) followed by `madd` with ones
//! (i16 pairs → i32); both operands stay within ±127 (or 0..15 for 4-bit weights), so the
//! 16-bit pair sums cannot saturate.

use std::arch::x86_64::*;

use half::f16;

use super::quant::{BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8Act, QK};

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
        let sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        let s4 = _mm_add_epi32(
            _mm256_castsi256_si128(sum),
            _mm256_extracti128_si256::<1>(sum),
        );
        let s4 = _mm_hadd_epi32(s4, s4);
        let s4 = _mm_hadd_epi32(s4, s4);
        let total = _mm_cvtsi128_si32(s4);
        // Pack 32 i32 → 32 i8; packs interleave 128-bit lanes, the permute restores order.
        let p16a = _mm256_packs_epi32(i0, i1);
        let p16b = _mm256_packs_epi32(i2, i3);
        let p8 = _mm256_packs_epi16(p16a, p16b);
        let ordered = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: `b.qs` is 32 writable bytes.
        unsafe { _mm256_storeu_si256(b.qs.as_mut_ptr() as *mut __m256i, ordered) };
        b.d = d;
        b.s = d * total as f32;
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

/// Four weight rows against one activation row: the nibble expansion of a weight block is
/// done once per block, and the four row sums stay in registers.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`]); all rows as long as `x`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_1_x4(w: [&[BlockQ4_1]; 4], x: &[BlockQ8Act]) -> [f32; 4] {
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut offsets = [0f32; 4];
    for (b, x) in x.iter().enumerate() {
        // SAFETY: `x.qs` is 32 bytes.
        let xq = unsafe { load_i8x32(&x.qs) };
        for r in 0..4 {
            let wb = &w[r][b];
            // SAFETY: `wb.qs` is 16 bytes.
            let wq = unsafe { nibbles_to_bytes(&wb.qs) };
            let p = mul_sum_us8(wq, xq);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(f16_to_f32(wb.d) * x.d), p, acc[r]);
            offsets[r] += f16_to_f32(wb.m) * x.s;
        }
    }
    [
        hsum(acc[0]) + offsets[0],
        hsum(acc[1]) + offsets[1],
        hsum(acc[2]) + offsets[2],
        hsum(acc[3]) + offsets[3],
    ]
}

/// Four weight rows against two activation rows (batched decode): each weight block is
/// expanded once and used for both activation rows.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`]); all rows as long as `x[0]`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_1_4x2(w: [&[BlockQ4_1]; 4], x: [&[BlockQ8Act]; 2]) -> [[f32; 4]; 2] {
    let mut acc = [[_mm256_setzero_ps(); 4]; 2];
    let mut offsets = [[0f32; 4]; 2];
    for b in 0..x[0].len() {
        let (x0, x1) = (&x[0][b], &x[1][b]);
        // SAFETY: `qs` arrays are 32 bytes.
        let (q0, q1) = unsafe { (load_i8x32(&x0.qs), load_i8x32(&x1.qs)) };
        for r in 0..4 {
            let wb = &w[r][b];
            // SAFETY: `wb.qs` is 16 bytes.
            let wq = unsafe { nibbles_to_bytes(&wb.qs) };
            let (d, m) = (f16_to_f32(wb.d), f16_to_f32(wb.m));
            acc[0][r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x0.d), mul_sum_us8(wq, q0), acc[0][r]);
            acc[1][r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x1.d), mul_sum_us8(wq, q1), acc[1][r]);
            offsets[0][r] += m * x0.s;
            offsets[1][r] += m * x1.s;
        }
    }
    let mut out = [[0f32; 4]; 2];
    for j in 0..2 {
        for r in 0..4 {
            out[j][r] = hsum(acc[j][r]) + offsets[j][r];
        }
    }
    out
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

/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut i = 0;
    // SAFETY: every load reads within `0..n` of both slices.
    unsafe {
        while i + 16 <= n {
            acc0 = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i)),
                _mm256_loadu_ps(b.as_ptr().add(i)),
                acc0,
            );
            acc1 = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i + 8)),
                _mm256_loadu_ps(b.as_ptr().add(i + 8)),
                acc1,
            );
            i += 16;
        }
        while i + 8 <= n {
            acc0 = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i)),
                _mm256_loadu_ps(b.as_ptr().add(i)),
                acc0,
            );
            i += 8;
        }
    }
    let mut sum = hsum(_mm256_add_ps(acc0, acc1));
    for j in i..n {
        sum += a[j] * b[j];
    }
    sum
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f16(w: &[f16], x: &[f32]) -> f32 {
    let n = w.len().min(x.len());
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    // SAFETY: every load reads within `0..n` of both slices.
    unsafe {
        while i + 8 <= n {
            let wv = _mm256_cvtph_ps(_mm_loadu_si128(w.as_ptr().add(i) as *const __m128i));
            acc = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.as_ptr().add(i)), acc);
            i += 8;
        }
    }
    let mut sum = hsum(acc);
    for j in i..n {
        sum += f16_to_f32(w[j]) * x[j];
    }
    sum
}

/// y += a · x
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`]).
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

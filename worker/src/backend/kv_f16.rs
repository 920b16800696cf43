//! Scalar references of the attention kernels that read an f16 KV cache. Each widens a
//! value to f32 where its f32 twin in `quant.rs` reads one and does the same arithmetic in
//! the same order, so on widened copies of the same keys and values both give the same
//! bits; the AVX2 versions in `avx2.rs` are tested against them.

use half::f16;

/// `count` rows of f16 values whose starts are `stride` apart: the keys of one kv head in
/// a cache page.
#[derive(Clone, Copy)]
pub struct StridedRowsF16<'a> {
    pub data: &'a [f16],
    pub stride: usize,
    pub count: usize,
}

impl<'a> StridedRowsF16<'a> {
    /// The first `len` values of row `i`.
    #[inline]
    pub fn row(&self, i: usize, len: usize) -> &'a [f16] {
        &self.data[i * self.stride..i * self.stride + len]
    }
}

/// As [`super::quant::dot_strided_scalar`], on f16 rows.
pub fn dot_strided_f16_scalar(
    q: &[f32],
    heads: usize,
    rows: StridedRowsF16<'_>,
    scale: f32,
    out: &mut [f32],
    out_stride: usize,
) {
    let n = q.len() / heads.max(1);
    for (h, q) in q.chunks_exact(n.max(1)).take(heads).enumerate() {
        for i in 0..rows.count {
            let mut acc = 0f32;
            for (a, b) in q.iter().zip(rows.row(i, n)) {
                acc = a.mul_add(b.to_f32(), acc);
            }
            out[h * out_stride + i] = acc * scale;
        }
    }
}

/// As [`super::quant::axpy_strided_scalar`], on f16 rows.
pub fn axpy_strided_f16_scalar(weights: &[f32], rows: &[f16], stride: usize, out: &mut [f32]) {
    let n = out.len();
    for (i, &w) in weights.iter().enumerate() {
        for (y, x) in out.iter_mut().zip(&rows[i * stride..i * stride + n]) {
            *y += w * x.to_f32();
        }
    }
}

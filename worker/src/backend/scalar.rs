//! The scalar references of the float kernels (f32 dot products, attention's strided scores
//! and sums, softmax, SwiGLU): the portable set [`super::cpu::Kernels::scalar`] runs and the
//! SIMD float kernels are tested against; the block formats' own are in `quant.rs`/`kquant.rs`.

use super::StridedRows;

pub fn dot_f32_scalar(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Scalar reference of the float matmul kernel: `out[j · out_stride + r]` = weight row `r`
/// of `w` · activation row `j` of `x`, rows `cols` long, each one [`dot_f32_scalar`].
pub fn dot_f32_rows_scalar(w: &[f32], x: &[f32], cols: usize, out: &mut [f32], out_stride: usize) {
    for (j, x) in x.chunks_exact(cols.max(1)).enumerate() {
        for (r, w) in w.chunks_exact(cols.max(1)).enumerate() {
            out[j * out_stride + r] = dot_f32_scalar(w, x);
        }
    }
}

/// `out[h · out_stride + i] = scale · (query h · row i)` for the `heads` query vectors laid
/// end to end in `q` (the heads that share one kv head). Each product is one fused
/// multiply-add chain in order, the rounding of the GEMM that scores prefill chunks, so a
/// position's attention is the same whether it was decoded or recomputed. f16 rows are
/// widened value by value, so they give the bits of their widened f32 copy.
pub fn dot_strided_scalar<T: Copy + Into<f32>>(
    q: &[f32],
    heads: usize,
    rows: StridedRows<'_, T>,
    scale: f32,
    out: &mut [f32],
    out_stride: usize,
) {
    let n = q.len() / heads.max(1);
    for (h, q) in q.chunks_exact(n.max(1)).take(heads).enumerate() {
        for i in 0..rows.count {
            let mut acc = 0f32;
            for (a, b) in q.iter().zip(rows.row(i, n)) {
                acc = a.mul_add((*b).into(), acc);
            }
            out[h * out_stride + i] = acc * scale;
        }
    }
}

/// `out += Σᵢ weights[i] · row i` for rows of `out.len()` values whose starts are `stride`
/// apart in `rows` (the values of one kv head in a cache page), f32 or f16.
pub fn axpy_strided_scalar<T: Copy + Into<f32>>(
    weights: &[f32],
    rows: &[T],
    stride: usize,
    out: &mut [f32],
) {
    let n = out.len();
    for (i, &w) in weights.iter().enumerate() {
        for (y, &x) in out.iter_mut().zip(&rows[i * stride..i * stride + n]) {
            *y += w * x.into();
        }
    }
}

/// `x[i] = exp(x[i] − shift)`, returning the sum: the exponentials of a softmax.
pub fn exp_sum_scalar(x: &mut [f32], shift: f32) -> f32 {
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - shift).exp();
        sum += *v;
    }
    sum
}

/// `gate[i] = silu(gate[i]) · up[i]`, SwiGLU's gating.
pub fn silu_mul_scalar(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// y += a · x
pub fn axpy_scalar(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

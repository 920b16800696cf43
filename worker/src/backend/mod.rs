//! Compute kernels behind a small trait: the model layer hands the backend weight matrices
//! and activation rows; the backend decides how to multiply them on this machine.
//!
//! [`cpu::CpuBackend`] is the portable implementation: f32 GEMM (the `gemm` crate) for the
//! full-precision path, and block-quantised dot products (AVX2 when the CPU has it, scalar
//! otherwise) for the quantised path.

#[cfg(target_arch = "x86_64")]
pub mod avx2;
pub mod blocks;
pub mod cpu;
pub mod interleaved;
pub mod kquant;
pub mod quant;
pub mod scalar;

use std::ops::Range;

use half::f16;

pub use blocks::Blocks;
use interleaved::{BlockQ4Kx8, BlockQ6Kx8};
use kquant::{BlockQ4K, BlockQ5K, BlockQ6K, QK_K};
use quant::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, QK};

/// How a weight matrix is stored.
#[derive(Clone, Debug, PartialEq)]
pub enum WeightData {
    F32(Blocks<f32>),
    F16(Blocks<f16>),
    Q4_0(Blocks<BlockQ4_0>),
    Q4_1(Blocks<BlockQ4_1>),
    Q5_0(Blocks<BlockQ5_0>),
    Q5_1(Blocks<BlockQ5_1>),
    Q8_0(Blocks<BlockQ8_0>),
    /// Super-blocks of 256 values; rows are a whole number of them.
    Q4K(Blocks<BlockQ4K>),
    /// `Q4_K` repacked for the grouped kernels ([`interleaved`]); rows are whole groups.
    Q4KX8(Blocks<BlockQ4Kx8>),
    Q5K(Blocks<BlockQ5K>),
    Q6K(Blocks<BlockQ6K>),
    /// `Q6_K` repacked as [`WeightData::Q4KX8`].
    Q6KX8(Blocks<BlockQ6Kx8>),
}

/// A row-major `rows × cols` weight matrix; `y = x · Wᵀ` maps `cols` inputs to `rows` outputs.
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: WeightData,
}

impl Matrix {
    pub fn f32(rows: usize, cols: usize, data: Vec<f32>) -> Matrix {
        debug_assert_eq!(data.len(), rows * cols);
        Matrix {
            rows,
            cols,
            data: WeightData::F32(data.into()),
        }
    }

    /// Whether the weights are read in place from a model file's mapping.
    pub fn is_mapped(&self) -> bool {
        match &self.data {
            WeightData::F32(v) => v.is_mapped(),
            WeightData::F16(v) => v.is_mapped(),
            WeightData::Q4_0(v) => v.is_mapped(),
            WeightData::Q4_1(v) => v.is_mapped(),
            WeightData::Q5_0(v) => v.is_mapped(),
            WeightData::Q5_1(v) => v.is_mapped(),
            WeightData::Q8_0(v) => v.is_mapped(),
            WeightData::Q4K(v) => v.is_mapped(),
            WeightData::Q4KX8(v) => v.is_mapped(),
            WeightData::Q5K(v) => v.is_mapped(),
            WeightData::Q6K(v) => v.is_mapped(),
            WeightData::Q6KX8(v) => v.is_mapped(),
        }
    }

    /// Panics unless `x` holds `n` input rows and `out` room for `n` output rows of this
    /// matrix.
    #[inline]
    pub fn check_matmul_shapes(&self, x: &[f32], n: usize, out: &[f32]) {
        assert_eq!(x.len(), n * self.cols, "matmul input shape");
        assert_eq!(out.len(), n * self.rows, "matmul output shape");
    }

    pub fn is_quantized(&self) -> bool {
        matches!(
            self.data,
            WeightData::Q4_0(_)
                | WeightData::Q4_1(_)
                | WeightData::Q5_0(_)
                | WeightData::Q5_1(_)
                | WeightData::Q8_0(_)
                | WeightData::Q4K(_)
                | WeightData::Q4KX8(_)
                | WeightData::Q5K(_)
                | WeightData::Q6K(_)
                | WeightData::Q6KX8(_)
        )
    }

    pub fn type_name(&self) -> &'static str {
        match self.data {
            WeightData::F32(_) => "f32",
            WeightData::F16(_) => "f16",
            WeightData::Q4_0(_) => "q4_0",
            WeightData::Q4_1(_) => "q4_1",
            WeightData::Q5_0(_) => "q5_0",
            WeightData::Q5_1(_) => "q5_1",
            WeightData::Q8_0(_) => "q8_0",
            WeightData::Q4K(_) | WeightData::Q4KX8(_) => "q4_k",
            WeightData::Q5K(_) => "q5_k",
            WeightData::Q6K(_) | WeightData::Q6KX8(_) => "q6_k",
        }
    }

    /// Bytes the weights occupy in memory.
    pub fn bytes(&self) -> usize {
        match &self.data {
            WeightData::F32(v) => v.len() * 4,
            WeightData::F16(v) => v.len() * 2,
            WeightData::Q4_0(v) => v.len() * std::mem::size_of::<BlockQ4_0>(),
            WeightData::Q4_1(v) => v.len() * std::mem::size_of::<BlockQ4_1>(),
            WeightData::Q5_0(v) => v.len() * std::mem::size_of::<BlockQ5_0>(),
            WeightData::Q5_1(v) => v.len() * std::mem::size_of::<BlockQ5_1>(),
            WeightData::Q8_0(v) => v.len() * std::mem::size_of::<BlockQ8_0>(),
            WeightData::Q4K(v) => v.len() * std::mem::size_of::<BlockQ4K>(),
            WeightData::Q4KX8(v) => v.len() * std::mem::size_of::<BlockQ4Kx8>(),
            WeightData::Q5K(v) => v.len() * std::mem::size_of::<BlockQ5K>(),
            WeightData::Q6K(v) => v.len() * std::mem::size_of::<BlockQ6K>(),
            WeightData::Q6KX8(v) => v.len() * std::mem::size_of::<BlockQ6Kx8>(),
        }
    }

    /// Writes row `r` as f32 into `out` (`cols` long).
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let c = self.cols;
        let (nb, nbk) = (c / QK, c / QK_K);
        match &self.data {
            WeightData::F32(v) => out.copy_from_slice(&v[r * c..(r + 1) * c]),
            WeightData::F16(v) => {
                for (o, h) in out.iter_mut().zip(&v[r * c..(r + 1) * c]) {
                    *o = h.to_f32();
                }
            }
            WeightData::Q4_0(v) => quant::dequantize_q4_0(&v[r * nb..(r + 1) * nb], out),
            WeightData::Q4_1(v) => quant::dequantize_q4_1(&v[r * nb..(r + 1) * nb], out),
            WeightData::Q5_0(v) => quant::dequantize_q5_0(&v[r * nb..(r + 1) * nb], out),
            WeightData::Q5_1(v) => quant::dequantize_q5_1(&v[r * nb..(r + 1) * nb], out),
            WeightData::Q8_0(v) => quant::dequantize_q8_0(&v[r * nb..(r + 1) * nb], out),
            WeightData::Q4K(v) => kquant::dequantize_q4_k(&v[r * nbk..(r + 1) * nbk], out),
            WeightData::Q4KX8(v) => interleaved::dequantize_row::<BlockQ4K>(v, nbk, r, out),
            WeightData::Q5K(v) => kquant::dequantize_q5_k(&v[r * nbk..(r + 1) * nbk], out),
            WeightData::Q6K(v) => kquant::dequantize_q6_k(&v[r * nbk..(r + 1) * nbk], out),
            WeightData::Q6KX8(v) => interleaved::dequantize_row::<BlockQ6K>(v, nbk, r, out),
        }
    }

    pub fn to_f32(&self) -> Vec<f32> {
        if let WeightData::F32(v) = &self.data {
            return v.to_vec();
        }
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
            self.row_to_f32(r, row);
        }
        out
    }

    /// The same matrix as f32; f32 weights are shared rather than copied when mapped.
    pub fn to_f32_matrix(&self) -> Matrix {
        if let WeightData::F32(_) = &self.data {
            return self.clone();
        }
        Matrix::f32(self.rows, self.cols, self.to_f32())
    }

    /// The same matrix stored as f16.
    pub fn to_f16_matrix(&self) -> Matrix {
        let data = match &self.data {
            WeightData::F16(v) => v.clone(),
            _ => self
                .to_f32()
                .into_iter()
                .map(f16::from_f32)
                .collect::<Vec<_>>()
                .into(),
        };
        Matrix {
            rows: self.rows,
            cols: self.cols,
            data: WeightData::F16(data),
        }
    }

    /// Int8 per-group-of-32 symmetric quantisation; `None` when `cols` is not a multiple of 32.
    pub fn to_q8_0(&self) -> Option<Matrix> {
        if !self.cols.is_multiple_of(QK) {
            return None;
        }
        Some(Matrix {
            rows: self.rows,
            cols: self.cols,
            data: WeightData::Q8_0(quant::quantize_q8_0(&self.to_f32()).into()),
        })
    }

    /// `Q4_K` and `Q6_K` weights in whole row groups repacked for the grouped kernels
    /// ([`interleaved`]); any other matrix as it is. A mapped original's pages leave the
    /// resident set, so the repacked copy does not hold the weights twice.
    pub fn interleaved(self) -> Matrix {
        fn repack<B: interleaved::Interleave + Sync>(v: &Blocks<B>, m: &Matrix) -> Blocks<B::Column>
        where
            B::Column: Send,
        {
            let columns = interleaved::interleave_rows(v, m.rows, m.cols / QK_K);
            v.release_pages();
            columns.into()
        }
        if !self.rows.is_multiple_of(quant::GROUP_ROWS) {
            return self;
        }
        let data = match &self.data {
            WeightData::Q4K(v) => WeightData::Q4KX8(repack(v, &self)),
            WeightData::Q6K(v) => WeightData::Q6KX8(repack(v, &self)),
            _ => return self,
        };
        Matrix { data, ..self }
    }

    /// Rows `range` (the column-parallel shard of a tensor-parallel split); rows are
    /// contiguous, so mapped weights stay mapped.
    pub fn select_rows(&self, range: std::ops::Range<usize>) -> Matrix {
        let per_row = |block: usize| range.start * self.cols / block..range.end * self.cols / block;
        let nbk = self.cols / QK_K;
        let data = match &self.data {
            WeightData::F32(v) => WeightData::F32(v.slice(per_row(1))),
            WeightData::F16(v) => WeightData::F16(v.slice(per_row(1))),
            WeightData::Q4_0(v) => WeightData::Q4_0(v.slice(per_row(QK))),
            WeightData::Q4_1(v) => WeightData::Q4_1(v.slice(per_row(QK))),
            WeightData::Q5_0(v) => WeightData::Q5_0(v.slice(per_row(QK))),
            WeightData::Q5_1(v) => WeightData::Q5_1(v.slice(per_row(QK))),
            WeightData::Q8_0(v) => WeightData::Q8_0(v.slice(per_row(QK))),
            WeightData::Q4K(v) => WeightData::Q4K(v.slice(per_row(QK_K))),
            WeightData::Q4KX8(v) => {
                WeightData::Q4K(interleaved::rows_of(v, nbk, range.clone()).into())
            }
            WeightData::Q6KX8(v) => {
                WeightData::Q6K(interleaved::rows_of(v, nbk, range.clone()).into())
            }
            WeightData::Q5K(v) => WeightData::Q5K(v.slice(per_row(QK_K))),
            WeightData::Q6K(v) => WeightData::Q6K(v.slice(per_row(QK_K))),
        };
        Matrix {
            rows: range.len(),
            cols: self.cols,
            data,
        }
    }

    /// Columns `range` (the row-parallel shard). Block formats keep their blocks when the
    /// range is block aligned (super-block aligned for the k-quants) and fall back to f32
    /// otherwise.
    pub fn select_cols(&self, range: std::ops::Range<usize>) -> Matrix {
        let aligned = range.start.is_multiple_of(QK) && range.end.is_multiple_of(QK);
        let (c, nb) = (self.cols, self.cols / QK);
        let (b0, b1) = (range.start / QK, range.end / QK);
        let aligned_k = range.start.is_multiple_of(QK_K) && range.end.is_multiple_of(QK_K);
        let (nbk, k0, k1) = (c / QK_K, range.start / QK_K, range.end / QK_K);
        fn pick<T: Copy>(v: &[T], rows: usize, stride: usize, a: usize, b: usize) -> Blocks<T> {
            (0..rows)
                .flat_map(|r| v[r * stride + a..r * stride + b].iter().copied())
                .collect::<Vec<_>>()
                .into()
        }
        let data = match &self.data {
            WeightData::F16(v) => WeightData::F16(pick(v, self.rows, c, range.start, range.end)),
            WeightData::Q4_0(v) if aligned => WeightData::Q4_0(pick(v, self.rows, nb, b0, b1)),
            WeightData::Q4_1(v) if aligned => WeightData::Q4_1(pick(v, self.rows, nb, b0, b1)),
            WeightData::Q5_0(v) if aligned => WeightData::Q5_0(pick(v, self.rows, nb, b0, b1)),
            WeightData::Q5_1(v) if aligned => WeightData::Q5_1(pick(v, self.rows, nb, b0, b1)),
            WeightData::Q8_0(v) if aligned => WeightData::Q8_0(pick(v, self.rows, nb, b0, b1)),
            WeightData::Q4K(v) if aligned_k => WeightData::Q4K(pick(v, self.rows, nbk, k0, k1)),
            WeightData::Q4KX8(v) if aligned_k => {
                let rows = interleaved::rows_of(v, nbk, 0..self.rows);
                WeightData::Q4K(pick(&rows, self.rows, nbk, k0, k1))
            }
            WeightData::Q6KX8(v) if aligned_k => {
                let rows = interleaved::rows_of(v, nbk, 0..self.rows);
                WeightData::Q6K(pick(&rows, self.rows, nbk, k0, k1))
            }
            WeightData::Q5K(v) if aligned_k => WeightData::Q5K(pick(v, self.rows, nbk, k0, k1)),
            WeightData::Q6K(v) if aligned_k => WeightData::Q6K(pick(v, self.rows, nbk, k0, k1)),
            _ => WeightData::F32(pick(&self.to_f32(), self.rows, c, range.start, range.end)),
        };
        Matrix {
            rows: self.rows,
            cols: range.len(),
            data,
        }
    }
}

/// The element type the KV cache stores keys and values in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    /// Half the memory of f32 per position; the attention kernels widen as they read.
    F16,
    F32,
}

impl KvDtype {
    /// Bytes per stored value.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
        }
    }
}

/// One layer's keys or values, in the cache's element type.
#[derive(Clone, Copy)]
pub enum KvData<'a> {
    F16(&'a [f16]),
    F32(&'a [f32]),
}

/// One sequence's keys and values for one layer, stored in fixed-size blocks.
/// Position `p` lives in block `block_table[p / block_size]`, slot `p % block_size`; a slot
/// holds `n_kv_heads × head_dim` values.
pub struct PagedKv<'a> {
    pub k: KvData<'a>,
    pub v: KvData<'a>,
    pub block_table: &'a [u32],
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl PagedKv<'_> {
    /// Offset of position `pos`, kv head `h` in `k`/`v`.
    #[inline]
    pub fn offset(&self, pos: usize, h: usize) -> usize {
        let block = self.block_table[pos / self.block_size] as usize;
        ((block * self.block_size + pos % self.block_size) * self.n_kv_heads + h) * self.head_dim
    }
}

/// `count` rows whose starts are `stride` apart in `data`: the keys or values of one kv
/// head in a cache page, f32 or f16 as the cache stores them.
#[derive(Clone, Copy)]
pub struct StridedRows<'a, T = f32> {
    pub data: &'a [T],
    pub stride: usize,
    pub count: usize,
}

impl<'a, T> StridedRows<'a, T> {
    #[inline]
    pub fn new(data: &'a [T], stride: usize, count: usize) -> Self {
        StridedRows {
            data,
            stride,
            count,
        }
    }

    /// The first `len` values of row `i`.
    #[inline]
    pub fn row(&self, i: usize, len: usize) -> &'a [T] {
        &self.data[i * self.stride..i * self.stride + len]
    }
}

/// The operations the forward pass needs from a device.
pub trait Backend: Send + Sync {
    /// Names the implementation and the kernels it picked, for logs.
    fn name(&self) -> String;
    fn threads(&self) -> usize;
    /// Runs `work` on the backend's worker threads, so the kernels it calls share one pool.
    fn run(&self, work: &mut (dyn FnMut() + Send));
    /// `out[n × w.rows] = x[n × w.cols] · Wᵀ`.
    fn matmul(&self, w: &Matrix, x: &[f32], n: usize, out: &mut [f32]);
    /// [`Backend::matmul`] in f32 arithmetic whatever the storage: block-quantised weights
    /// are widened as they are read instead of meeting int8 activations. The default is for
    /// a backend whose only path for block formats is its quantised one.
    fn matmul_f32(&self, w: &Matrix, x: &[f32], n: usize, out: &mut [f32]) {
        self.matmul(w, x, n, out)
    }
    /// `outs[i][n × ws[i].rows] = x · Wᵢᵀ` for matrices that read the same input (the Q/K/V
    /// projections, gate and up), which a backend may compute as one pass.
    fn matmul_shared_input(&self, ws: &[&Matrix], x: &[f32], n: usize, outs: &mut [&mut [f32]]) {
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.matmul(w, x, n, out)
        }
    }
    /// `gate = silu(gate) · up` (SwiGLU's gating) over rows `width` long.
    fn swiglu(&self, gate: &mut [f32], up: &[f32], width: usize);
    /// Causal attention for every chunk of a step in one call, so the backend can spread
    /// all of them over its threads at once. `q` and `out` are stacked rows of
    /// `n_heads × head_dim`; each chunk's token `i` (row `rows.start + i`, at position
    /// `start_pos + i`) attends over positions `0..=start_pos + i` of its own `kv`.
    /// Grouped-query heads share kv head `h / (n_heads / n_kv_heads)`.
    fn attention(&self, q: &[f32], chunks: &[AttentionChunk<'_>], n_heads: usize, out: &mut [f32]);
}

/// One sequence's part of a batched [`Backend::attention`] call.
pub struct AttentionChunk<'a> {
    /// The chunk's rows in the stacked queries and outputs.
    pub rows: Range<usize>,
    /// Position of the chunk's first token.
    pub start_pos: usize,
    pub kv: PagedKv<'a>,
}

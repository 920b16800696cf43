//! The CPU backend: a rayon pool sized by the `threads` option, kernels picked once at start
//! from what the CPU supports.

use half::f16;
use std::ops::Range;

use rayon::prelude::*;

use super::quant::{self, BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8Act, QK};
use super::{Backend, Matrix, PagedKv, WeightData};

/// Four `Q4_1` weight rows × two activation rows → `[act][row]` dot products.
pub type Q41x4x2 = fn([&[BlockQ4_1]; 4], [&[BlockQ8Act]; 2]) -> [[f32; 4]; 2];

/// The innermost kernels, as plain function pointers chosen at run time.
#[derive(Clone, Copy)]
pub struct Kernels {
    pub name: &'static str,
    pub quantize_act: fn(&[f32], &mut [BlockQ8Act]),
    pub dot_q4_0: fn(&[BlockQ4_0], &[BlockQ8Act]) -> f32,
    pub dot_q4_1: fn(&[BlockQ4_1], &[BlockQ8Act]) -> f32,
    pub dot_q4_1_x4: fn([&[BlockQ4_1]; 4], &[BlockQ8Act]) -> [f32; 4],
    pub dot_q4_1_4x2: Q41x4x2,
    pub dot_q8_0: fn(&[BlockQ8_0], &[BlockQ8Act]) -> f32,
    pub dot_f32: fn(&[f32], &[f32]) -> f32,
    pub dot_f16: fn(&[f16], &[f32]) -> f32,
    pub axpy: fn(f32, &[f32], &mut [f32]),
}

impl Kernels {
    /// The portable reference kernels.
    pub fn scalar() -> Kernels {
        Kernels {
            name: "scalar",
            quantize_act: quant::quantize_act_scalar,
            dot_q4_0: quant::dot_q4_0_scalar,
            dot_q4_1: quant::dot_q4_1_scalar,
            dot_q4_1_x4: |w, x| {
                [
                    quant::dot_q4_1_scalar(w[0], x),
                    quant::dot_q4_1_scalar(w[1], x),
                    quant::dot_q4_1_scalar(w[2], x),
                    quant::dot_q4_1_scalar(w[3], x),
                ]
            },
            dot_q4_1_4x2: |w, x| {
                let row = |x| [0, 1, 2, 3].map(|r| quant::dot_q4_1_scalar(w[r], x));
                [row(x[0]), row(x[1])]
            },
            dot_q8_0: quant::dot_q8_0_scalar,
            dot_f32: quant::dot_f32_scalar,
            dot_f16: quant::dot_f16_scalar,
            axpy: quant::axpy_scalar,
        }
    }

    /// The fastest kernels this CPU supports.
    pub fn detect() -> Kernels {
        #[cfg(target_arch = "x86_64")]
        if super::avx2::available() {
            return avx2_kernels();
        }
        Kernels::scalar()
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_kernels() -> Kernels {
    use super::avx2;
    // SAFETY (every closure below): these kernels are only selected after
    // `avx2::available()` confirmed the CPU features they are compiled for.
    Kernels {
        name: "avx2",
        quantize_act: |x, out| unsafe { avx2::quantize_act(x, out) },
        dot_q4_0: |w, x| unsafe { avx2::dot_q4_0(w, x) },
        dot_q4_1: |w, x| unsafe { avx2::dot_q4_1(w, x) },
        dot_q4_1_x4: |w, x| unsafe { avx2::dot_q4_1_x4(w, x) },
        dot_q4_1_4x2: |w, x| unsafe { avx2::dot_q4_1_4x2(w, x) },
        dot_q8_0: |w, x| unsafe { avx2::dot_q8_0(w, x) },
        dot_f32: |a, b| unsafe { avx2::dot_f32(a, b) },
        dot_f16: |w, x| unsafe { avx2::dot_f16(w, x) },
        axpy: |a, x, y| unsafe { avx2::axpy(a, x, y) },
    }
}

pub struct CpuBackend {
    pool: rayon::ThreadPool,
    kernels: Kernels,
}

/// Weight rows per parallel task of the quantised and small-batch matmuls: small enough
/// that a tile stays in L1 while every activation row of the batch passes over it.
const ROW_TILE: usize = 16;
/// Activation rows a weight tile is applied to at once.
const ACT_ROWS: usize = 2;
/// Batches up to this many rows use the dot-product path for float weights instead of GEMM.
const GEMV_MAX_ROWS: usize = 2;
/// Weight rows converted from f16 to f32 at a time before a GEMM.
const F16_GEMM_ROWS: usize = 256;
/// Chunks of at least this many tokens compute attention as two GEMMs per head.
const ATTENTION_GEMM_MIN_TOKENS: usize = 8;
/// Query rows per task of the GEMM attention.
const ATTENTION_ROW_BLOCK: usize = 64;

/// A raw output pointer shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: every task writes only the output columns of its own weight-row tile.
unsafe impl Send for SharedOut {}
// SAFETY: as above.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// A method rather than field access, so closures capture the whole `Sync` wrapper.
    #[inline]
    fn ptr(self) -> *mut f32 {
        self.0
    }

    /// # Safety
    /// `i` must be in bounds and written by no other task.
    #[inline]
    unsafe fn write(self, i: usize, v: f32) {
        // SAFETY: guaranteed by the caller.
        unsafe { *self.ptr().add(i) = v }
    }
}

impl CpuBackend {
    /// `threads == 0` uses every core.
    pub fn new(threads: usize) -> anyhow::Result<CpuBackend> {
        Self::with_kernels(threads, Kernels::detect())
    }

    pub fn with_kernels(threads: usize, kernels: Kernels) -> anyhow::Result<CpuBackend> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("compute-{i}"))
            .build()?;
        Ok(CpuBackend { pool, kernels })
    }

    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    /// Attention for a prefill chunk: per head and block of query rows, scores = Q·Kᵀ and
    /// out = softmax(scores)·V as GEMMs over the keys gathered out of their pages.
    fn attention_gemm(
        &self,
        q: &[f32],
        kv: &PagedKv<'_>,
        start_pos: usize,
        n_heads: usize,
        out: &mut [f32],
    ) {
        let hd = kv.head_dim;
        let t = q.len() / (n_heads * hd);
        let total = start_pos + t;
        let group = n_heads / kv.n_kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let gathered: Vec<(Vec<f32>, Vec<f32>)> = (0..kv.n_kv_heads)
            .into_par_iter()
            .map(|g| {
                let (mut k, mut v) = (
                    Vec::with_capacity(total * hd),
                    Vec::with_capacity(total * hd),
                );
                for p in 0..total {
                    let off = kv.offset(p, g);
                    k.extend_from_slice(&kv.k[off..off + hd]);
                    v.extend_from_slice(&kv.v[off..off + hd]);
                }
                (k, v)
            })
            .collect();
        let shared = SharedOut(out.as_mut_ptr());
        let row_blocks = t.div_ceil(ATTENTION_ROW_BLOCK);
        let row_stride = (n_heads * hd) as isize;
        (0..n_heads * row_blocks).into_par_iter().for_each(|task| {
            let (h, b) = (task / row_blocks, task % row_blocks);
            let (i0, i1) = (
                b * ATTENTION_ROW_BLOCK,
                ((b + 1) * ATTENTION_ROW_BLOCK).min(t),
            );
            let rows = i1 - i0;
            // Keys beyond the block's last query position are masked for every row.
            let keys = start_pos + i1;
            let (k, v) = &gathered[h / group];
            let mut scores = vec![0f32; rows * keys];
            // SAFETY: dst is rows × keys in `scores`; lhs reads rows query vectors of head h
            // (stride n_heads·hd) inside `q`; rhs is Kᵀ over the first `keys` gathered keys.
            unsafe {
                gemm::gemm(
                    rows,
                    keys,
                    hd,
                    scores.as_mut_ptr(),
                    1,
                    keys as isize,
                    false,
                    q.as_ptr().add((i0 * n_heads + h) * hd),
                    1,
                    row_stride,
                    k.as_ptr(),
                    hd as isize,
                    1,
                    0.0,
                    scale,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                )
            };
            for (r, row) in scores.chunks_exact_mut(keys).enumerate() {
                let visible = start_pos + i0 + r + 1;
                let max = row[..visible]
                    .iter()
                    .copied()
                    .fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for s in &mut row[..visible] {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                for s in &mut row[..visible] {
                    *s /= sum;
                }
                row[visible..].fill(0.0);
            }
            // SAFETY: dst is the rows × hd output block of head h (stride n_heads·hd), which
            // no other task writes; lhs is `scores`, rhs the first `keys` gathered values.
            unsafe {
                gemm::gemm(
                    rows,
                    hd,
                    keys,
                    shared.ptr().add((i0 * n_heads + h) * hd),
                    1,
                    row_stride,
                    false,
                    scores.as_ptr(),
                    1,
                    keys as isize,
                    v.as_ptr(),
                    1,
                    hd as isize,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                )
            };
        });
    }

    /// `out[n × rows]` (row stride `out_stride`) = `x[n × cols]` · Wᵀ for row-major `w`.
    fn gemm_f32(
        &self,
        w: &[f32],
        cols: usize,
        x: &[f32],
        n: usize,
        out: &mut [f32],
        out_stride: usize,
    ) {
        let rows = w.len() / cols;
        assert!(
            x.len() >= n * cols && out.len() >= (n - 1) * out_stride + rows,
            "gemm shapes"
        );
        // SAFETY: dst is n × rows at row stride `out_stride` (≥ rows) inside `out`; lhs is
        // n × cols row-major in `x`; rhs is Wᵀ (cols × rows) read from row-major `w`.
        unsafe {
            gemm::gemm(
                n,
                rows,
                cols,
                out.as_mut_ptr(),
                1,
                out_stride as isize,
                false,
                x.as_ptr(),
                1,
                cols as isize,
                w.as_ptr(),
                cols as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::Rayon(self.pool.current_num_threads()),
            )
        }
    }

    /// For each weight-row tile in parallel: every activation row against every tile row.
    /// `dot_tile(rows, acts, out)` fills `out[acts.len() × rows.len()]` for up to
    /// [`ACT_ROWS`] activation rows at a time.
    fn tiled<F>(&self, rows: usize, n: usize, out: &mut [f32], dot_tile: F)
    where
        F: Fn(Range<usize>, Range<usize>, &mut [f32]) + Sync,
    {
        let shared = SharedOut(out.as_mut_ptr());
        let tiles = rows.div_ceil(ROW_TILE);
        (0..tiles).into_par_iter().for_each(|t| {
            let range = t * ROW_TILE..((t + 1) * ROW_TILE).min(rows);
            let mut tile_out = [0f32; ACT_ROWS * ROW_TILE];
            for j0 in (0..n).step_by(ACT_ROWS) {
                let acts = j0..(j0 + ACT_ROWS).min(n);
                let tile_out = &mut tile_out[..acts.len() * range.len()];
                dot_tile(range.clone(), acts.clone(), tile_out);
                for (j, row) in acts.zip(tile_out.chunks_exact(range.len())) {
                    for (i, &v) in row.iter().enumerate() {
                        // SAFETY: column `range.start + i` of row `j` belongs to this tile
                        // only, and j < n, range.end ≤ rows keep it inside the output.
                        unsafe { shared.write(j * rows + range.start + i, v) };
                    }
                }
            }
        });
    }

    fn matmul_quantized(&self, w: &Matrix, x: &[f32], n: usize, out: &mut [f32]) {
        let k = &self.kernels;
        let nb = w.cols / QK;
        let mut acts = vec![BlockQ8Act::default(); n * nb];
        acts.par_chunks_mut(nb)
            .zip(x.par_chunks(w.cols))
            .for_each(|(a, x)| (k.quantize_act)(x, a));
        let acts = &acts;
        match &w.data {
            WeightData::Q4_0(b) => self.tiled(w.rows, n, out, |range, act_rows, o| {
                for (j, o) in act_rows.zip(o.chunks_exact_mut(range.len())) {
                    let a = &acts[j * nb..(j + 1) * nb];
                    for (o, r) in o.iter_mut().zip(range.clone()) {
                        *o = (k.dot_q4_0)(&b[r * nb..(r + 1) * nb], a);
                    }
                }
            }),
            WeightData::Q4_1(b) => self.tiled(w.rows, n, out, |range, acts_j, o| {
                let row = |r: usize| &b[r * nb..(r + 1) * nb];
                let act = |j: usize| &acts[j * nb..(j + 1) * nb];
                let quads = range.len() / 4 * 4;
                let len = range.len();
                let (j0, pair) = (acts_j.start, acts_j.len() == 2);
                for q in (0..quads).step_by(4) {
                    let r = range.start + q;
                    let w4 = [row(r), row(r + 1), row(r + 2), row(r + 3)];
                    if pair {
                        let [o0, o1] = (k.dot_q4_1_4x2)(w4, [act(j0), act(j0 + 1)]);
                        o[q..q + 4].copy_from_slice(&o0);
                        o[len + q..len + q + 4].copy_from_slice(&o1);
                    } else {
                        o[q..q + 4].copy_from_slice(&(k.dot_q4_1_x4)(w4, act(j0)));
                    }
                }
                for (jj, j) in acts_j.enumerate() {
                    for i in quads..len {
                        o[jj * len + i] = (k.dot_q4_1)(row(range.start + i), act(j));
                    }
                }
            }),
            WeightData::Q8_0(b) => self.tiled(w.rows, n, out, |range, act_rows, o| {
                for (j, o) in act_rows.zip(o.chunks_exact_mut(range.len())) {
                    let a = &acts[j * nb..(j + 1) * nb];
                    for (o, r) in o.iter_mut().zip(range.clone()) {
                        *o = (k.dot_q8_0)(&b[r * nb..(r + 1) * nb], a);
                    }
                }
            }),
            WeightData::F32(_) | WeightData::F16(_) => {
                unreachable!("float weights take the float path")
            }
        }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        format!(
            "cpu ({} kernels, {} threads)",
            self.kernels.name,
            self.threads()
        )
    }

    fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    fn run(&self, work: &mut (dyn FnMut() + Send)) {
        self.pool.install(work)
    }

    fn matmul(&self, w: &Matrix, x: &[f32], n: usize, out: &mut [f32]) {
        assert_eq!(x.len(), n * w.cols, "matmul input shape");
        assert_eq!(out.len(), n * w.rows, "matmul output shape");
        if n == 0 {
            return;
        }
        let k = &self.kernels;
        let c = w.cols;
        match &w.data {
            WeightData::F32(v) if n <= GEMV_MAX_ROWS => {
                self.tiled(w.rows, n, out, |range, act_rows, o| {
                    for (j, o) in act_rows.zip(o.chunks_exact_mut(range.len())) {
                        let a = &x[j * c..(j + 1) * c];
                        for (o, r) in o.iter_mut().zip(range.clone()) {
                            *o = (k.dot_f32)(&v[r * c..(r + 1) * c], a);
                        }
                    }
                })
            }
            WeightData::F32(v) => self.gemm_f32(v, c, x, n, out, w.rows),
            WeightData::F16(v) if n <= GEMV_MAX_ROWS => {
                self.tiled(w.rows, n, out, |range, act_rows, o| {
                    for (j, o) in act_rows.zip(o.chunks_exact_mut(range.len())) {
                        let a = &x[j * c..(j + 1) * c];
                        for (o, r) in o.iter_mut().zip(range.clone()) {
                            *o = (k.dot_f16)(&v[r * c..(r + 1) * c], a);
                        }
                    }
                })
            }
            WeightData::F16(v) => {
                let mut tile = vec![0f32; F16_GEMM_ROWS * c];
                for r0 in (0..w.rows).step_by(F16_GEMM_ROWS) {
                    let r1 = (r0 + F16_GEMM_ROWS).min(w.rows);
                    let tile = &mut tile[..(r1 - r0) * c];
                    tile.par_chunks_mut(c)
                        .zip(v[r0 * c..r1 * c].par_chunks(c))
                        .for_each(|(t, h)| {
                            half::slice::HalfFloatSliceExt::convert_to_f32_slice(h, t)
                        });
                    self.gemm_f32(tile, c, x, n, &mut out[r0..], w.rows);
                }
            }
            _ => self.matmul_quantized(w, x, n, out),
        }
    }

    fn attention(
        &self,
        q: &[f32],
        kv: &PagedKv<'_>,
        start_pos: usize,
        n_heads: usize,
        out: &mut [f32],
    ) {
        let hd = kv.head_dim;
        if q.len() / (n_heads * hd) >= ATTENTION_GEMM_MIN_TOKENS {
            return self.attention_gemm(q, kv, start_pos, n_heads, out);
        }
        let group = n_heads / kv.n_kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let k = &self.kernels;
        out.par_chunks_mut(hd).enumerate().for_each(|(idx, o)| {
            let (t, h) = (idx / n_heads, idx % n_heads);
            let kvh = h / group;
            let qv = &q[idx * hd..(idx + 1) * hd];
            let len = start_pos + t + 1;
            let mut scores: Vec<f32> = (0..len)
                .map(|p| {
                    let off = kv.offset(p, kvh);
                    (k.dot_f32)(qv, &kv.k[off..off + hd]) * scale
                })
                .collect();
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            o.fill(0.0);
            for (p, s) in scores.iter().enumerate() {
                let off = kv.offset(p, kvh);
                (k.axpy)(s / sum, &kv.v[off..off + hd], o);
            }
        });
    }
}

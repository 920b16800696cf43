//! The CPU backend: a rayon pool sized by the `threads` option, kernels picked once at start
//! from what the CPU supports.

use half::f16;
use std::ops::Range;

use rayon::prelude::*;

use super::quant::{
    self, BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8Act, GROUP_ROWS, QK, StridedRows,
};
use super::{AttentionChunk, Backend, Matrix, PagedKv, WeightData};

/// A group of [`GROUP_ROWS`] weight rows (row-major blocks) against every activation row:
/// `out[j][r]` = weight row `r` · activation row `j`.
pub type GroupKernel<B> = fn(&[B], &[BlockQ8Act], &mut [[f32; GROUP_ROWS]]);
/// One weight row · one activation row.
pub type DotKernel<B> = fn(&[B], &[BlockQ8Act]) -> f32;

/// The innermost kernels, as plain function pointers chosen at run time.
#[derive(Clone, Copy)]
pub struct Kernels {
    pub name: &'static str,
    pub quantize_act: fn(&[f32], &mut [BlockQ8Act]),
    pub dot_q4_0: fn(&[BlockQ4_0], &[BlockQ8Act]) -> f32,
    pub dot_q4_1: fn(&[BlockQ4_1], &[BlockQ8Act]) -> f32,
    pub gemm_q4_1_group: GroupKernel<BlockQ4_1>,
    pub dot_q8_0: fn(&[BlockQ8_0], &[BlockQ8Act]) -> f32,
    pub gemm_q8_0_group: GroupKernel<BlockQ8_0>,
    pub dot_f32: fn(&[f32], &[f32]) -> f32,
    pub dot_f16: fn(&[f16], &[f32]) -> f32,
    pub axpy: fn(f32, &[f32], &mut [f32]),
    pub exp_sum: fn(&mut [f32], f32) -> f32,
    pub silu_mul: fn(&mut [f32], &[f32]),
    pub dot_strided: fn(&[f32], usize, StridedRows<'_>, f32, &mut [f32], usize),
    pub axpy_strided: fn(&[f32], &[f32], usize, &mut [f32]),
}

impl Kernels {
    /// The portable reference kernels.
    pub fn scalar() -> Kernels {
        Kernels {
            name: "scalar",
            quantize_act: quant::quantize_act_scalar,
            dot_q4_0: quant::dot_q4_0_scalar,
            dot_q4_1: quant::dot_q4_1_scalar,
            gemm_q4_1_group: quant::gemm_q4_1_group_scalar,
            dot_q8_0: quant::dot_q8_0_scalar,
            gemm_q8_0_group: quant::gemm_q8_0_group_scalar,
            dot_f32: quant::dot_f32_scalar,
            dot_f16: quant::dot_f16_scalar,
            axpy: quant::axpy_scalar,
            exp_sum: quant::exp_sum_scalar,
            silu_mul: quant::silu_mul_scalar,
            dot_strided: quant::dot_strided_scalar,
            axpy_strided: quant::axpy_strided_scalar,
        }
    }

    /// The fastest kernels this CPU supports.
    pub fn detect() -> Kernels {
        Kernels::supported().pop().unwrap_or_else(Kernels::scalar)
    }

    /// Every kernel set this CPU can run, slowest (the scalar reference) first.
    pub fn supported() -> Vec<Kernels> {
        // Only x86-64 builds add SIMD sets.
        #[allow(unused_mut)]
        let mut sets = vec![Kernels::scalar()];
        #[cfg(target_arch = "x86_64")]
        {
            if super::avx2::available() {
                sets.push(avx2_kernels());
            }
            if super::avx2::vnni::available() {
                sets.push(avx512_vnni_kernels());
            }
        }
        sets
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
        gemm_q4_1_group: |w, x, out| unsafe { avx2::gemm_q4_1_group(w, x, out) },
        dot_q8_0: |w, x| unsafe { avx2::dot_q8_0(w, x) },
        gemm_q8_0_group: |w, x, out| unsafe { avx2::gemm_q8_0_group(w, x, out) },
        dot_f32: |a, b| unsafe { avx2::dot_f32(a, b) },
        dot_f16: |w, x| unsafe { avx2::dot_f16(w, x) },
        axpy: |a, x, y| unsafe { avx2::axpy(a, x, y) },
        exp_sum: |x, shift| unsafe { avx2::exp_sum(x, shift) },
        silu_mul: |gate, up| unsafe { avx2::silu_mul(gate, up) },
        dot_strided: |q, heads, rows, scale, out, out_stride| unsafe {
            avx2::dot_strided(q, heads, rows, scale, out, out_stride)
        },
        axpy_strided: |w, rows, stride, out| unsafe { avx2::axpy_strided(w, rows, stride, out) },
    }
}

/// The AVX2 set with the grouped matmul kernels on AVX-512 VNNI.
#[cfg(target_arch = "x86_64")]
fn avx512_vnni_kernels() -> Kernels {
    use super::avx2::vnni;
    // SAFETY (every closure below): these kernels are only selected after
    // `vnni::available()` confirmed the CPU features they are compiled for.
    Kernels {
        name: "avx512-vnni",
        gemm_q4_1_group: |w, x, out| unsafe { vnni::gemm_q4_1_group(w, x, out) },
        gemm_q8_0_group: |w, x, out| unsafe { vnni::gemm_q8_0_group(w, x, out) },
        ..avx2_kernels()
    }
}

pub struct CpuBackend {
    pool: rayon::ThreadPool,
    kernels: Kernels,
}

/// Weight rows per parallel task of the quantised and small-batch matmuls: small enough
/// that a tile stays in L1 while every activation row of the batch passes over it.
const ROW_TILE: usize = 16;
/// Groups of [`GROUP_ROWS`] weight rows per parallel task of the quantised matmul.
const GROUPS_PER_TASK: usize = 2;
/// Batches up to this many rows quantise their activations on the calling thread.
const SERIAL_QUANTIZE_ROWS: usize = 4;
/// Activation rows a weight tile is applied to at once.
const ACT_ROWS: usize = 2;
/// Rows per task of the element-wise kernels: a decode step's few rows stay on the calling
/// thread.
const SERIAL_ELEMENTWISE_ROWS: usize = 8;
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
        let kernels = &self.kernels;
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
                let sum = (kernels.exp_sum)(&mut row[..visible], max);
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

    /// Activation rows quantised per block for the int8 kernels.
    fn quantize_rows(&self, x: &[f32], n: usize, cols: usize) -> Vec<BlockQ8Act> {
        let quantize = self.kernels.quantize_act;
        let nb = cols / QK;
        let mut acts = vec![BlockQ8Act::default(); n * nb];
        if n <= SERIAL_QUANTIZE_ROWS {
            for (a, x) in acts.chunks_exact_mut(nb).zip(x.chunks_exact(cols)) {
                quantize(x, a);
            }
        } else {
            acts.par_chunks_mut(nb)
                .zip(x.par_chunks(cols))
                .for_each(|(a, x)| quantize(x, a));
        }
        acts
    }

    fn matmul_quantized(&self, w: &Matrix, x: &[f32], n: usize, out: &mut [f32]) {
        let k = &self.kernels;
        let nb = w.cols / QK;
        let acts = self.quantize_rows(x, n, w.cols);
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
            WeightData::Q4_1(_) | WeightData::Q8_0(_) => {
                let job = GroupedJob::of(w, out).expect("grouped block format");
                self.grouped(&[job], n, acts)
            }
            WeightData::F32(_) | WeightData::F16(_) => {
                unreachable!("float weights take the float path")
            }
        }
    }

    /// `out = acts · Wᵀ` for every job's block-quantised `w`: groups of [`GROUP_ROWS`]
    /// weight rows of all the jobs run as one parallel pass, each group read once for all
    /// `n` activation rows; the rows after a matrix's last whole group take the one-row kernel.
    fn grouped(&self, jobs: &[GroupedJob<'_>], n: usize, acts: &[BlockQ8Act]) {
        let nb = acts.len() / n;
        if nb == 0 {
            for job in jobs {
                // SAFETY: the job's output is `n × rows` long and borrowed for the call.
                unsafe { std::slice::from_raw_parts_mut(job.out.ptr(), n * job.rows) }.fill(0.0);
            }
            return;
        }
        let k = &self.kernels;
        // Task `t` of the pass is task `t - first[i]` of job `i`.
        let mut first = Vec::with_capacity(jobs.len() + 1);
        first.push(0);
        for job in jobs {
            let tasks = (job.rows / GROUP_ROWS).div_ceil(GROUPS_PER_TASK);
            first.push(first[first.len() - 1] + tasks);
        }
        let total = first[jobs.len()];
        (0..total).into_par_iter().for_each_init(
            || vec![[0f32; GROUP_ROWS]; n],
            |sums, t| {
                let i = first.partition_point(|&f| f <= t) - 1;
                let job = &jobs[i];
                let groups = job.rows / GROUP_ROWS;
                let local = t - first[i];
                for g in local * GROUPS_PER_TASK..((local + 1) * GROUPS_PER_TASK).min(groups) {
                    job.weights.group(k, g, nb, acts, sums);
                    for (j, s) in sums.iter().enumerate() {
                        // SAFETY: columns g·8..g·8 + 8 of every output row belong to group
                        // g of this job only, and j < n, g·8 + 8 ≤ rows keep them inside
                        // the job's output.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                s.as_ptr(),
                                job.out.ptr().add(j * job.rows + g * GROUP_ROWS),
                                GROUP_ROWS,
                            )
                        };
                    }
                }
            },
        );
        for job in jobs {
            for r in job.rows / GROUP_ROWS * GROUP_ROWS..job.rows {
                for (j, a) in acts.chunks_exact(nb).enumerate() {
                    // SAFETY: row j, column r is inside the job's `n × rows` output, and
                    // the parallel pass above has finished.
                    unsafe {
                        job.out
                            .write(j * job.rows + r, job.weights.dot(k, r, nb, a))
                    };
                }
            }
        }
    }
}

/// One matrix of a [`CpuBackend::grouped`] pass and where its `n × rows` output goes.
struct GroupedJob<'a> {
    weights: GroupedWeights<'a>,
    rows: usize,
    out: SharedOut,
}

impl<'a> GroupedJob<'a> {
    /// `None` for formats without grouped kernels.
    fn of(w: &'a Matrix, out: &mut [f32]) -> Option<GroupedJob<'a>> {
        let weights = match &w.data {
            WeightData::Q4_1(b) => GroupedWeights::Q4_1(b),
            WeightData::Q8_0(b) => GroupedWeights::Q8_0(b),
            _ => return None,
        };
        Some(GroupedJob {
            weights,
            rows: w.rows,
            out: SharedOut(out.as_mut_ptr()),
        })
    }
}

enum GroupedWeights<'a> {
    Q4_1(&'a [BlockQ4_1]),
    Q8_0(&'a [BlockQ8_0]),
}

impl GroupedWeights<'_> {
    /// Group `g` (rows `g·8..g·8 + 8`) against every activation row.
    fn group(
        &self,
        k: &Kernels,
        g: usize,
        nb: usize,
        acts: &[BlockQ8Act],
        sums: &mut [[f32; GROUP_ROWS]],
    ) {
        let blocks = g * GROUP_ROWS * nb..(g + 1) * GROUP_ROWS * nb;
        match self {
            GroupedWeights::Q4_1(w) => (k.gemm_q4_1_group)(&w[blocks], acts, sums),
            GroupedWeights::Q8_0(w) => (k.gemm_q8_0_group)(&w[blocks], acts, sums),
        }
    }

    /// Row `r` · one activation row.
    fn dot(&self, k: &Kernels, r: usize, nb: usize, act: &[BlockQ8Act]) -> f32 {
        match self {
            GroupedWeights::Q4_1(w) => (k.dot_q4_1)(&w[r * nb..(r + 1) * nb], act),
            GroupedWeights::Q8_0(w) => (k.dot_q8_0)(&w[r * nb..(r + 1) * nb], act),
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

    fn swiglu(&self, gate: &mut [f32], up: &[f32], width: usize) {
        let silu_mul = self.kernels.silu_mul;
        gate.par_chunks_mut(width.max(1))
            .zip(up.par_chunks(width.max(1)))
            .with_min_len(SERIAL_ELEMENTWISE_ROWS)
            .for_each(|(g, u)| silu_mul(g, u));
    }

    fn matmul_shared_input(&self, ws: &[&Matrix], x: &[f32], n: usize, outs: &mut [&mut [f32]]) {
        assert_eq!(ws.len(), outs.len(), "one output per matrix");
        let cols = ws.first().map_or(0, |w| w.cols);
        let jobs: Option<Vec<GroupedJob<'_>>> = ws
            .iter()
            .zip(outs.iter_mut())
            .map(|(w, out)| {
                assert_eq!(out.len(), n * w.rows, "matmul output shape");
                (w.cols == cols).then(|| GroupedJob::of(w, out)).flatten()
            })
            .collect();
        match jobs {
            // Block-quantised matrices share one activation quantisation and one pass.
            Some(jobs) if n > 0 && cols.is_multiple_of(QK) => {
                assert_eq!(x.len(), n * cols, "matmul input shape");
                let acts = self.quantize_rows(x, n, cols);
                self.grouped(&jobs, n, &acts)
            }
            _ => {
                for (w, out) in ws.iter().zip(outs.iter_mut()) {
                    self.matmul(w, x, n, out)
                }
            }
        }
    }

    fn attention(&self, q: &[f32], chunks: &[AttentionChunk<'_>], n_heads: usize, out: &mut [f32]) {
        let Some(first) = chunks.first() else { return };
        let (hd, n_kv) = (first.kv.head_dim, first.kv.n_kv_heads);
        let row_len = n_heads * hd;
        assert_eq!(q.len(), out.len(), "attention output shape");
        let mut decode_rows = Vec::new();
        for (i, c) in chunks.iter().enumerate() {
            if c.rows.len() >= ATTENTION_GEMM_MIN_TOKENS {
                let range = c.rows.start * row_len..c.rows.end * row_len;
                self.attention_gemm(
                    &q[range.clone()],
                    &c.kv,
                    c.start_pos,
                    n_heads,
                    &mut out[range],
                );
            } else {
                decode_rows.extend(c.rows.clone().map(|row| (i, row)));
            }
        }
        // The short chunks (decode steps) of every sequence share one parallel pass, one
        // task per token and kv head: the heads of a group read the same keys while they
        // are still in cache, and a step pays for one fork-join instead of one per sequence.
        let group = n_heads / n_kv;
        let scale = 1.0 / (hd as f32).sqrt();
        let k = &self.kernels;
        let shared = SharedOut(out.as_mut_ptr());
        (0..decode_rows.len() * n_kv).into_par_iter().for_each_init(
            Vec::new,
            |scores: &mut Vec<f32>, task| {
                let ((chunk, row), kvh) = (decode_rows[task / n_kv], task % n_kv);
                let c = &chunks[chunk];
                let len = c.start_pos + (row - c.rows.start) + 1;
                let at = row * row_len + kvh * group * hd;
                let width = group * hd;
                // SAFETY: the heads of kv head `kvh` in row `row` are written by this task
                // only, and `at + width ≤ out.len()` since `row` is inside a chunk's rows.
                let o = unsafe { std::slice::from_raw_parts_mut(shared.ptr().add(at), width) };
                attend_group(k, &q[at..at + width], &c.kv, kvh, len, scale, scores, o);
            },
        );
    }
}

/// The attention of the query heads that share kv head `kvh` (laid end to end in `q`) over
/// its first `len` positions. Keys and values are read page by page, a page's slots of one
/// kv head being evenly spaced; every page's keys are scored for all the heads at once.
#[allow(clippy::too_many_arguments)]
fn attend_group(
    k: &Kernels,
    q: &[f32],
    kv: &PagedKv<'_>,
    kvh: usize,
    len: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let hd = kv.head_dim;
    let heads = q.len() / hd;
    let stride = kv.n_kv_heads * hd;
    let pages = || {
        (0..len).step_by(kv.block_size).map(|p0| {
            let first = kv.offset(p0, kvh);
            (p0..(p0 + kv.block_size).min(len), first)
        })
    };
    scores.resize(heads * len, 0.0);
    for (range, first) in pages() {
        let keys = StridedRows {
            data: &kv.k[first..],
            stride,
            count: range.len(),
        };
        (k.dot_strided)(q, heads, keys, scale, &mut scores[range.start..], len);
    }
    for (s, o) in scores.chunks_exact_mut(len).zip(out.chunks_exact_mut(hd)) {
        let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum = (k.exp_sum)(s, max);
        for v in s.iter_mut() {
            *v /= sum;
        }
        o.fill(0.0);
        for (range, first) in pages() {
            (k.axpy_strided)(&s[range], &kv.v[first..], stride, o);
        }
    }
}

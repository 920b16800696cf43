//! The CPU backend: a rayon pool sized by the `threads` option, kernels picked once at start
//! from what the CPU supports.

use half::f16;
use rayon::prelude::*;

use super::interleaved::{self, BlockQ4Kx8, BlockQ6Kx8, InterleavedGroup};
use super::kquant::{self, ACT_BLOCKS, BlockQ4K, BlockQ5K, BlockQ6K};
use super::quant::{
    self, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, BlockQ8Act, GROUP_ROWS, QK,
    WeightGroup,
};
use super::{AttentionChunk, Backend, Matrix, StridedRows, WeightData, scalar};

mod attention;

/// A group of [`GROUP_ROWS`] weight rows against every activation row:
/// `out[j][r]` = row `r` of the group · activation row `j`.
pub type GroupKernel<B> = fn(WeightGroup<'_, B>, &[BlockQ8Act], &mut [[f32; GROUP_ROWS]]);
/// Two groups against every activation row: `out[j][r]` = row `r` of the first group and
/// `out[j][GROUP_ROWS + r]` row `r` of the second, · activation row `j`.
pub type PairKernel<B> =
    fn(WeightGroup<'_, B>, WeightGroup<'_, B>, &[BlockQ8Act], &mut [[f32; 2 * GROUP_ROWS]]);
/// [`GroupKernel`] of an interleaved group of columns `C` ([`interleaved`]).
pub type InterleavedKernel<C> =
    fn(InterleavedGroup<'_, C>, &[BlockQ8Act], &mut [[f32; GROUP_ROWS]]);
/// [`PairKernel`] of two interleaved groups.
pub type InterleavedPairKernel<C> = fn(
    InterleavedGroup<'_, C>,
    InterleavedGroup<'_, C>,
    &[BlockQ8Act],
    &mut [[f32; 2 * GROUP_ROWS]],
);
/// Pair kernels of every grouped format, for batches of at least `min_batch` activation
/// rows; smaller batches take the group kernels, one group at a time.
#[derive(Clone, Copy)]
pub struct PairKernels {
    pub min_batch: usize,
    pub q4_0: PairKernel<BlockQ4_0>,
    pub q4_1: PairKernel<BlockQ4_1>,
    pub q5_0: PairKernel<BlockQ5_0>,
    pub q5_1: PairKernel<BlockQ5_1>,
    pub q8_0: PairKernel<BlockQ8_0>,
    pub q4_k: PairKernel<BlockQ4K>,
    pub q4_kx8: InterleavedPairKernel<BlockQ4Kx8>,
    pub q5_k: PairKernel<BlockQ5K>,
    pub q6_k: PairKernel<BlockQ6K>,
    pub q6_kx8: InterleavedPairKernel<BlockQ6Kx8>,
}
/// One weight row · one activation row.
pub type DotKernel<B> = fn(&[B], &[BlockQ8Act]) -> f32;
/// Attention scores of query heads against strided key rows stored as `T`.
pub type DotStridedKernel<T> = fn(&[f32], usize, StridedRows<'_, T>, f32, &mut [f32], usize);
/// Score-weighted sum of strided value rows stored as `T`.
pub type AxpyStridedKernel<T> = fn(&[f32], &[T], usize, &mut [f32]);

/// The innermost kernels, as plain function pointers chosen at run time.
#[derive(Clone, Copy)]
pub struct Kernels {
    pub name: &'static str,
    pub quantize_act: fn(&[f32], &mut [BlockQ8Act]),
    pub dot_q4_0: fn(&[BlockQ4_0], &[BlockQ8Act]) -> f32,
    pub gemm_q4_0_group: GroupKernel<BlockQ4_0>,
    pub dot_q4_1: fn(&[BlockQ4_1], &[BlockQ8Act]) -> f32,
    pub gemm_q4_1_group: GroupKernel<BlockQ4_1>,
    pub dot_q5_0: DotKernel<BlockQ5_0>,
    pub gemm_q5_0_group: GroupKernel<BlockQ5_0>,
    pub dot_q5_1: DotKernel<BlockQ5_1>,
    pub gemm_q5_1_group: GroupKernel<BlockQ5_1>,
    pub dot_q8_0: fn(&[BlockQ8_0], &[BlockQ8Act]) -> f32,
    pub gemm_q8_0_group: GroupKernel<BlockQ8_0>,
    /// The k-quant kernels take [`ACT_BLOCKS`] activation blocks per weight super-block.
    pub dot_q4_k: DotKernel<BlockQ4K>,
    pub gemm_q4_k_group: GroupKernel<BlockQ4K>,
    pub gemm_q4_kx8_group: InterleavedKernel<BlockQ4Kx8>,
    pub dot_q5_k: DotKernel<BlockQ5K>,
    pub gemm_q5_k_group: GroupKernel<BlockQ5K>,
    pub dot_q6_k: DotKernel<BlockQ6K>,
    pub gemm_q6_k_group: GroupKernel<BlockQ6K>,
    pub gemm_q6_kx8_group: InterleavedKernel<BlockQ6Kx8>,
    /// Kernels over two groups at once, where a set has them.
    pub pairs: Option<PairKernels>,
    /// `(w, x, cols, out, out_stride)`: every weight row of `w` · every activation row of
    /// `x` into `out[j · out_stride + r]`; each product's arithmetic is fixed, whatever the
    /// row counts, so a row's result does not depend on its batch.
    pub dot_f32_rows: fn(&[f32], &[f32], usize, &mut [f32], usize),
    pub axpy: fn(f32, &[f32], &mut [f32]),
    pub exp_sum: fn(&mut [f32], f32) -> f32,
    pub silu_mul: fn(&mut [f32], &[f32]),
    pub dot_strided: DotStridedKernel<f32>,
    pub axpy_strided: AxpyStridedKernel<f32>,
    /// [`Kernels::dot_strided`] and [`Kernels::axpy_strided`] over an f16 KV cache.
    pub dot_strided_f16: DotStridedKernel<f16>,
    pub axpy_strided_f16: AxpyStridedKernel<f16>,
}

impl Kernels {
    /// The portable reference kernels.
    pub fn scalar() -> Kernels {
        Kernels {
            name: "scalar",
            quantize_act: quant::quantize_act_scalar,
            dot_q4_0: quant::dot_q4_0_scalar,
            gemm_q4_0_group: quant::gemm_q4_0_group_scalar,
            dot_q4_1: quant::dot_q4_1_scalar,
            gemm_q4_1_group: quant::gemm_q4_1_group_scalar,
            dot_q5_0: quant::dot_q5_0_scalar,
            gemm_q5_0_group: quant::gemm_q5_0_group_scalar,
            dot_q5_1: quant::dot_q5_1_scalar,
            gemm_q5_1_group: quant::gemm_q5_1_group_scalar,
            dot_q8_0: quant::dot_q8_0_scalar,
            gemm_q8_0_group: quant::gemm_q8_0_group_scalar,
            dot_q4_k: kquant::dot_q4_k_scalar,
            gemm_q4_k_group: kquant::gemm_q4_k_group_scalar,
            gemm_q4_kx8_group: interleaved::gemm_group_scalar::<BlockQ4K>,
            dot_q5_k: kquant::dot_q5_k_scalar,
            gemm_q5_k_group: kquant::gemm_q5_k_group_scalar,
            dot_q6_k: kquant::dot_q6_k_scalar,
            gemm_q6_k_group: kquant::gemm_q6_k_group_scalar,
            gemm_q6_kx8_group: interleaved::gemm_group_scalar::<BlockQ6K>,
            pairs: None,
            dot_f32_rows: scalar::dot_f32_rows_scalar,
            axpy: scalar::axpy_scalar,
            exp_sum: scalar::exp_sum_scalar,
            silu_mul: scalar::silu_mul_scalar,
            dot_strided: scalar::dot_strided_scalar,
            axpy_strided: scalar::axpy_strided_scalar,
            dot_strided_f16: scalar::dot_strided_scalar::<f16>,
            axpy_strided_f16: scalar::axpy_strided_scalar::<f16>,
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
        gemm_q4_0_group: |w, x, out| unsafe { avx2::gemm_q4_0_group(w, x, out) },
        dot_q4_1: |w, x| unsafe { avx2::dot_q4_1(w, x) },
        gemm_q4_1_group: |w, x, out| unsafe { avx2::gemm_q4_1_group(w, x, out) },
        dot_q8_0: |w, x| unsafe { avx2::dot_q8_0(w, x) },
        gemm_q8_0_group: |w, x, out| unsafe { avx2::gemm_q8_0_group(w, x, out) },
        // The one-row 5-bit and k-quant kernels only take the rows after a matrix's last
        // whole group.
        dot_q5_0: quant::dot_q5_0_scalar,
        gemm_q5_0_group: |w, x, out| unsafe { avx2::gemm_q5_0_group(w, x, out) },
        dot_q5_1: quant::dot_q5_1_scalar,
        gemm_q5_1_group: |w, x, out| unsafe { avx2::gemm_q5_1_group(w, x, out) },
        dot_q4_k: kquant::dot_q4_k_scalar,
        gemm_q4_k_group: |w, x, out| unsafe { avx2::gemm_q4_k_group(w, x, out) },
        gemm_q4_kx8_group: |w, x, out| unsafe { avx2::gemm_q4_kx8_group(w, x, out) },
        dot_q5_k: kquant::dot_q5_k_scalar,
        gemm_q5_k_group: |w, x, out| unsafe { avx2::gemm_q5_k_group(w, x, out) },
        dot_q6_k: kquant::dot_q6_k_scalar,
        gemm_q6_k_group: |w, x, out| unsafe { avx2::gemm_q6_k_group(w, x, out) },
        gemm_q6_kx8_group: |w, x, out| unsafe { avx2::gemm_q6_kx8_group(w, x, out) },
        dot_f32_rows: |w, x, cols, out, stride| unsafe {
            avx2::dot_f32_rows(w, x, cols, out, stride)
        },
        axpy: |a, x, y| unsafe { avx2::axpy(a, x, y) },
        exp_sum: |x, shift| unsafe { avx2::exp_sum(x, shift) },
        silu_mul: |gate, up| unsafe { avx2::silu_mul(gate, up) },
        dot_strided: |q, heads, rows, scale, out, out_stride| unsafe {
            avx2::dot_strided(q, heads, rows, scale, out, out_stride)
        },
        axpy_strided: |w, rows, stride, out| unsafe { avx2::axpy_strided(w, rows, stride, out) },
        dot_strided_f16: |q, heads, rows, scale, out, out_stride| unsafe {
            avx2::dot_strided::<f16>(q, heads, rows, scale, out, out_stride)
        },
        axpy_strided_f16: |w, rows, stride, out| unsafe {
            avx2::axpy_strided::<f16>(w, rows, stride, out)
        },
        pairs: None,
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
        gemm_q4_0_group: |w, x, out| unsafe { vnni::gemm_q4_0_group(w, x, out) },
        gemm_q4_1_group: |w, x, out| unsafe { vnni::gemm_q4_1_group(w, x, out) },
        gemm_q5_0_group: |w, x, out| unsafe { vnni::gemm_q5_0_group(w, x, out) },
        gemm_q5_1_group: |w, x, out| unsafe { vnni::gemm_q5_1_group(w, x, out) },
        gemm_q8_0_group: |w, x, out| unsafe { vnni::gemm_q8_0_group(w, x, out) },
        gemm_q4_k_group: |w, x, out| unsafe { vnni::gemm_q4_k_group(w, x, out) },
        gemm_q4_kx8_group: |w, x, out| unsafe { vnni::gemm_q4_kx8_group(w, x, out) },
        gemm_q5_k_group: |w, x, out| unsafe { vnni::gemm_q5_k_group(w, x, out) },
        gemm_q6_k_group: |w, x, out| unsafe { vnni::gemm_q6_k_group(w, x, out) },
        gemm_q6_kx8_group: |w, x, out| unsafe { vnni::gemm_q6_kx8_group(w, x, out) },
        pairs: Some(PairKernels {
            min_batch: vnni::pair::MIN_BATCH,
            q4_0: |a, b, x, out| unsafe { vnni::pair::gemm_q4_0_pair(a, b, x, out) },
            q4_1: |a, b, x, out| unsafe { vnni::pair::gemm_q4_1_pair(a, b, x, out) },
            q5_0: |a, b, x, out| unsafe { vnni::pair::gemm_q5_0_pair(a, b, x, out) },
            q5_1: |a, b, x, out| unsafe { vnni::pair::gemm_q5_1_pair(a, b, x, out) },
            q8_0: |a, b, x, out| unsafe { vnni::pair::gemm_q8_0_pair(a, b, x, out) },
            q4_k: |a, b, x, out| unsafe { vnni::pair::gemm_q4_k_pair(a, b, x, out) },
            q4_kx8: |a, b, x, out| unsafe { vnni::pair::gemm_q4_kx8_pair(a, b, x, out) },
            q5_k: |a, b, x, out| unsafe { vnni::pair::gemm_q5_k_pair(a, b, x, out) },
            q6_k: |a, b, x, out| unsafe { vnni::pair::gemm_q6_k_pair(a, b, x, out) },
            q6_kx8: |a, b, x, out| unsafe { vnni::pair::gemm_q6_kx8_pair(a, b, x, out) },
        }),
        ..avx2_kernels()
    }
}

pub struct CpuBackend {
    pool: rayon::ThreadPool,
    kernels: Kernels,
}

/// Groups of [`GROUP_ROWS`] weight rows per parallel task of the quantised matmul.
const GROUPS_PER_TASK: usize = 2;
/// The largest batch whose grouped pass spreads a large matrix's groups (see [`Grouping`]).
const SPREAD_MAX_BATCH: usize = 2;
/// The smallest matrix whose groups a small batch spreads: one that outgrows a server
/// core's 2 MiB L2 twice over, so a pass reads it from memory.
const SPREAD_MIN_BYTES: usize = 4 << 20;
/// Batches up to this many rows quantise their activations on the calling thread.
const SERIAL_QUANTIZE_ROWS: usize = 4;
/// Rows per task of the element-wise kernels: a decode step's few rows stay on the calling
/// thread.
const SERIAL_ELEMENTWISE_ROWS: usize = 8;
/// Weight rows per parallel task of the float matmul (f16 rows are widened per task).
const FLOAT_ROW_TILE: usize = 48;

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

    /// `out = x · Wᵀ` in f32 arithmetic for weights in any storage, per tile of weight rows in
    /// parallel. Other storages are widened to f32 one tile at a time, so every storage shares
    /// one kernel and its rounding, and no f32 copy of a quantised matrix is ever held whole.
    fn matmul_float(&self, w: &Matrix, x: &[f32], n: usize, out: &mut [f32]) {
        let (rows, cols) = (w.rows, w.cols);
        let dot_rows = self.kernels.dot_f32_rows;
        let shared = SharedOut(out.as_mut_ptr());
        (0..rows.div_ceil(FLOAT_ROW_TILE))
            .into_par_iter()
            .for_each_init(
                || (Vec::new(), Vec::new()),
                |(widened, tile_out): &mut (Vec<f32>, Vec<f32>), t| {
                    let range = t * FLOAT_ROW_TILE..((t + 1) * FLOAT_ROW_TILE).min(rows);
                    let weights = range.start * cols..range.end * cols;
                    let tile: &[f32] = match &w.data {
                        WeightData::F32(v) => &v[weights],
                        WeightData::F16(v) => {
                            widened.resize(weights.len(), 0.0);
                            half::slice::HalfFloatSliceExt::convert_to_f32_slice(
                                &v[weights],
                                widened,
                            );
                            widened
                        }
                        _ => {
                            widened.resize(weights.len(), 0.0);
                            for (r, row) in range.clone().zip(widened.chunks_exact_mut(cols)) {
                                w.row_to_f32(r, row);
                            }
                            widened
                        }
                    };
                    tile_out.resize(n * range.len(), 0.0);
                    dot_rows(tile, x, cols, tile_out, range.len());
                    for (j, row) in tile_out.chunks_exact(range.len()).enumerate() {
                        for (i, &v) in row.iter().enumerate() {
                            // SAFETY: columns `range` of every output row belong to this tile
                            // only, and j < n, range.end ≤ rows keep them inside the output.
                            unsafe { shared.write(j * rows + range.start + i, v) };
                        }
                    }
                },
            );
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
        let acts = self.quantize_rows(x, n, w.cols);
        match &w.data {
            WeightData::Q4_0(_)
            | WeightData::Q4_1(_)
            | WeightData::Q5_0(_)
            | WeightData::Q5_1(_)
            | WeightData::Q8_0(_)
            | WeightData::Q4K(_)
            | WeightData::Q4KX8(_)
            | WeightData::Q5K(_)
            | WeightData::Q6K(_)
            | WeightData::Q6KX8(_) => {
                let job = GroupedJob::of(w, n, out).expect("grouped block format");
                self.grouped(&[job], n, &acts)
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
        let pairs = k.pairs.filter(|p| n >= p.min_batch);
        (0..total).into_par_iter().for_each_init(
            || (vec![[0f32; GROUP_ROWS]; n], vec![[0f32; 2 * GROUP_ROWS]; n]),
            |(sums, pair_sums), t| {
                let i = first.partition_point(|&f| f <= t) - 1;
                let job = &jobs[i];
                let groups = job.rows / GROUP_ROWS;
                let grouping = job.grouping;
                let local = t - first[i];
                let end = ((local + 1) * GROUPS_PER_TASK).min(groups);
                let mut g = local * GROUPS_PER_TASK;
                while g < end {
                    let width = match pairs {
                        Some(pairs) if g + 1 < end => {
                            job.weights.pair(&pairs, (g, grouping), nb, acts, pair_sums);
                            2
                        }
                        _ => {
                            job.weights.group(k, (g, grouping), nb, acts, sums);
                            1
                        }
                    };
                    for j in 0..n {
                        let s: &[f32] = if width == 2 { &pair_sums[j] } else { &sums[j] };
                        // SAFETY: j < n, and `scatter` writes rows of groups g..g + width,
                        // which are this task's only.
                        unsafe { grouping.scatter(g, s, job.out.ptr().add(j * job.rows)) };
                    }
                    g += width;
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

/// Which rows of a matrix form its groups: row `i` of group `g` is row `g · step + i · stride`.
#[derive(Clone, Copy)]
struct Grouping {
    step: usize,
    stride: usize,
}

impl Grouping {
    const ADJACENT: Grouping = Grouping {
        step: GROUP_ROWS,
        stride: 1,
    };

    /// A pass of at most [`SPREAD_MAX_BATCH`] activation rows over a matrix of at least
    /// [`SPREAD_MIN_BYTES`] reads it from memory at the speed the memory streams it, so its
    /// groups take rows an eighth of the matrix apart: each of a group's rows runs on into
    /// the same row of the next group, and a thread reads eight long streams the hardware
    /// prefetchers follow. Groups of eight adjacent rows are eight short streams they do
    /// not, and need the kernels' explicit prefetches. On a 7B model's 3584-wide `Q4_K`
    /// projections a batch-1 pass read 26 GB/s spread against 18 GB/s adjacent; larger
    /// batches and cache-sized matrices ran as fast or faster adjacent.
    fn of(rows: usize, bytes: usize, n: usize) -> Grouping {
        if n <= SPREAD_MAX_BATCH && bytes >= SPREAD_MIN_BYTES {
            Grouping {
                step: 1,
                stride: rows / GROUP_ROWS,
            }
        } else {
            Grouping::ADJACENT
        }
    }

    fn row(&self, g: usize, i: usize) -> usize {
        g * self.step + i * self.stride
    }

    /// Writes the sums of groups `g`, `g + 1`, … (eight lanes each) to their rows of `out`.
    ///
    /// # Safety
    /// `out` must have room for every row of those groups, and no other thread may write
    /// them.
    unsafe fn scatter(&self, g: usize, sums: &[f32], out: *mut f32) {
        if self.stride == 1 {
            // SAFETY: adjacent groups' rows are consecutive; room is the caller's promise.
            unsafe {
                std::ptr::copy_nonoverlapping(sums.as_ptr(), out.add(self.row(g, 0)), sums.len())
            };
            return;
        }
        for (lane, &v) in sums.iter().enumerate() {
            // SAFETY: as above.
            unsafe { *out.add(self.row(g + lane / GROUP_ROWS, lane % GROUP_ROWS)) = v };
        }
    }

    /// Groups `g` and `g + 1` of `w` through a pair kernel.
    fn pair<B>(
        &self,
        kernel: PairKernel<B>,
        w: &[B],
        g: usize,
        row_blocks: usize,
        acts: &[BlockQ8Act],
        sums: &mut [[f32; 2 * GROUP_ROWS]],
    ) {
        let (first, second) = (
            self.group(w, g, row_blocks),
            self.group(w, g + 1, row_blocks),
        );
        kernel(first, second, acts, sums)
    }

    /// Group `g` of a matrix of rows `row_blocks` blocks long.
    fn group<'a, B>(&self, w: &'a [B], g: usize, row_blocks: usize) -> WeightGroup<'a, B> {
        WeightGroup::new(&w[self.row(g, 0) * row_blocks..], row_blocks, self.stride)
    }
}

/// One matrix of a [`CpuBackend::grouped`] pass over `n` activation rows, which rows form
/// its groups for that pass, and where its `n × rows` output goes.
struct GroupedJob<'a> {
    weights: GroupedWeights<'a>,
    rows: usize,
    grouping: Grouping,
    out: SharedOut,
}

impl<'a> GroupedJob<'a> {
    /// `None` for formats without grouped kernels.
    fn of(w: &'a Matrix, n: usize, out: &mut [f32]) -> Option<GroupedJob<'a>> {
        let weights = match &w.data {
            WeightData::Q4_0(b) => GroupedWeights::Q4_0(b),
            WeightData::Q4_1(b) => GroupedWeights::Q4_1(b),
            WeightData::Q5_0(b) => GroupedWeights::Q5_0(b),
            WeightData::Q5_1(b) => GroupedWeights::Q5_1(b),
            WeightData::Q8_0(b) => GroupedWeights::Q8_0(b),
            WeightData::Q4K(b) => GroupedWeights::Q4K(b),
            WeightData::Q4KX8(b) => GroupedWeights::Q4KX8(b),
            WeightData::Q5K(b) => GroupedWeights::Q5K(b),
            WeightData::Q6K(b) => GroupedWeights::Q6K(b),
            WeightData::Q6KX8(b) => GroupedWeights::Q6KX8(b),
            _ => return None,
        };
        // An interleaved matrix's groups are its adjacent rows, at every batch size.
        let grouping = match weights {
            GroupedWeights::Q4KX8(_) | GroupedWeights::Q6KX8(_) => Grouping::ADJACENT,
            _ => Grouping::of(w.rows, w.bytes(), n),
        };
        Some(GroupedJob {
            weights,
            rows: w.rows,
            grouping,
            out: SharedOut(out.as_mut_ptr()),
        })
    }
}

/// Group `g` of an interleaved matrix of rows `row_blocks` super-blocks long.
fn interleaved_group<C>(w: &[C], g: usize, row_blocks: usize) -> InterleavedGroup<'_, C> {
    InterleavedGroup::new(&w[g * row_blocks..(g + 1) * row_blocks])
}

enum GroupedWeights<'a> {
    Q4_0(&'a [BlockQ4_0]),
    Q4_1(&'a [BlockQ4_1]),
    Q5_0(&'a [BlockQ5_0]),
    Q5_1(&'a [BlockQ5_1]),
    Q8_0(&'a [BlockQ8_0]),
    Q4K(&'a [BlockQ4K]),
    Q4KX8(&'a [BlockQ4Kx8]),
    Q5K(&'a [BlockQ5K]),
    Q6K(&'a [BlockQ6K]),
    Q6KX8(&'a [BlockQ6Kx8]),
}

impl GroupedWeights<'_> {
    /// Group `g` of the matrix's `grouping` against every activation row of `nb` blocks.
    fn group(
        &self,
        k: &Kernels,
        (g, grouping): (usize, Grouping),
        nb: usize,
        acts: &[BlockQ8Act],
        sums: &mut [[f32; GROUP_ROWS]],
    ) {
        let nbk = nb / ACT_BLOCKS;
        match self {
            GroupedWeights::Q4_0(w) => (k.gemm_q4_0_group)(grouping.group(w, g, nb), acts, sums),
            GroupedWeights::Q4_1(w) => (k.gemm_q4_1_group)(grouping.group(w, g, nb), acts, sums),
            GroupedWeights::Q5_0(w) => (k.gemm_q5_0_group)(grouping.group(w, g, nb), acts, sums),
            GroupedWeights::Q5_1(w) => (k.gemm_q5_1_group)(grouping.group(w, g, nb), acts, sums),
            GroupedWeights::Q8_0(w) => (k.gemm_q8_0_group)(grouping.group(w, g, nb), acts, sums),
            GroupedWeights::Q4K(w) => (k.gemm_q4_k_group)(grouping.group(w, g, nbk), acts, sums),
            GroupedWeights::Q4KX8(w) => {
                (k.gemm_q4_kx8_group)(interleaved_group(w, g, nbk), acts, sums)
            }
            GroupedWeights::Q5K(w) => (k.gemm_q5_k_group)(grouping.group(w, g, nbk), acts, sums),
            GroupedWeights::Q6K(w) => (k.gemm_q6_k_group)(grouping.group(w, g, nbk), acts, sums),
            GroupedWeights::Q6KX8(w) => {
                (k.gemm_q6_kx8_group)(interleaved_group(w, g, nbk), acts, sums)
            }
        }
    }

    /// Groups `g` and `g + 1` against every activation row.
    fn pair(
        &self,
        k: &PairKernels,
        (g, grouping): (usize, Grouping),
        nb: usize,
        acts: &[BlockQ8Act],
        sums: &mut [[f32; 2 * GROUP_ROWS]],
    ) {
        let nbk = nb / ACT_BLOCKS;
        match self {
            GroupedWeights::Q4_0(w) => grouping.pair(k.q4_0, w, g, nb, acts, sums),
            GroupedWeights::Q4_1(w) => grouping.pair(k.q4_1, w, g, nb, acts, sums),
            GroupedWeights::Q5_0(w) => grouping.pair(k.q5_0, w, g, nb, acts, sums),
            GroupedWeights::Q5_1(w) => grouping.pair(k.q5_1, w, g, nb, acts, sums),
            GroupedWeights::Q8_0(w) => grouping.pair(k.q8_0, w, g, nb, acts, sums),
            GroupedWeights::Q4K(w) => grouping.pair(k.q4_k, w, g, nbk, acts, sums),
            GroupedWeights::Q4KX8(w) => (k.q4_kx8)(
                interleaved_group(w, g, nbk),
                interleaved_group(w, g + 1, nbk),
                acts,
                sums,
            ),
            GroupedWeights::Q6KX8(w) => (k.q6_kx8)(
                interleaved_group(w, g, nbk),
                interleaved_group(w, g + 1, nbk),
                acts,
                sums,
            ),
            GroupedWeights::Q5K(w) => grouping.pair(k.q5_k, w, g, nbk, acts, sums),
            GroupedWeights::Q6K(w) => grouping.pair(k.q6_k, w, g, nbk, acts, sums),
        }
    }

    /// Row `r` · one activation row.
    fn dot(&self, k: &Kernels, r: usize, nb: usize, act: &[BlockQ8Act]) -> f32 {
        let nbk = nb / ACT_BLOCKS;
        match self {
            GroupedWeights::Q4_0(w) => (k.dot_q4_0)(&w[r * nb..(r + 1) * nb], act),
            GroupedWeights::Q4_1(w) => (k.dot_q4_1)(&w[r * nb..(r + 1) * nb], act),
            GroupedWeights::Q5_0(w) => (k.dot_q5_0)(&w[r * nb..(r + 1) * nb], act),
            GroupedWeights::Q5_1(w) => (k.dot_q5_1)(&w[r * nb..(r + 1) * nb], act),
            GroupedWeights::Q8_0(w) => (k.dot_q8_0)(&w[r * nb..(r + 1) * nb], act),
            GroupedWeights::Q4K(w) => (k.dot_q4_k)(&w[r * nbk..(r + 1) * nbk], act),
            GroupedWeights::Q4KX8(_) | GroupedWeights::Q6KX8(_) => {
                unreachable!("interleaved matrices are whole groups")
            }
            GroupedWeights::Q5K(w) => (k.dot_q5_k)(&w[r * nbk..(r + 1) * nbk], act),
            GroupedWeights::Q6K(w) => (k.dot_q6_k)(&w[r * nbk..(r + 1) * nbk], act),
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
        w.check_matmul_shapes(x, n, out);
        if n == 0 {
            return;
        }
        match &w.data {
            WeightData::F32(_) | WeightData::F16(_) => self.matmul_float(w, x, n, out),
            _ => self.matmul_quantized(w, x, n, out),
        }
    }

    fn matmul_f32(&self, w: &Matrix, x: &[f32], n: usize, out: &mut [f32]) {
        w.check_matmul_shapes(x, n, out);
        if n > 0 {
            self.matmul_float(w, x, n, out)
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
                (w.cols == cols)
                    .then(|| GroupedJob::of(w, n, out))
                    .flatten()
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
        attention::attention(&self.kernels, q, chunks, n_heads, out)
    }
}

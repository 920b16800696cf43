//! Every SIMD kernel against its scalar reference on random data of odd sizes, and the
//! quantisation round trips.

use npufleet_worker::backend::cpu::{
    CpuBackend, DotKernel, GroupKernel, InterleavedKernel, InterleavedPairKernel, Kernels,
    PairKernel,
};
use npufleet_worker::backend::interleaved::{self, Interleave, InterleavedGroup};
use npufleet_worker::backend::kquant::{
    self, BlockQ4K, BlockQ5K, BlockQ6K, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, QK_K,
};
use npufleet_worker::backend::quant::{
    self, BlockQ5_0, BlockQ5_1, BlockQ8Act, GROUP_ROWS, Q5_0_BYTES, Q5_1_BYTES, QK, WeightGroup,
};
use npufleet_worker::backend::{
    AttentionChunk, Backend, KvData, Matrix, PagedKv, StridedRows, WeightData, scalar,
};

/// A fixed generator so failures reproduce.
struct Rng(u64);

impl Rng {
    fn f32(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f32() * scale).collect()
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n)
            .map(|_| {
                self.f32();
                (self.0 >> 24) as u8
            })
            .collect()
    }

    /// A positive f16 scale of the size real k-quant files hold.
    fn scale(&mut self) -> [u8; 2] {
        half::f16::from_f32((self.f32().abs() + 0.05) * 0.02)
            .to_bits()
            .to_le_bytes()
    }

    /// `n` GGUF blocks of `block_bytes` with random quants and sane f16 scales at the
    /// byte offsets `scales`.
    fn block_bytes(&mut self, n: usize, block_bytes: usize, scales: &[usize]) -> Vec<u8> {
        let mut out = self.bytes(n * block_bytes);
        for b in out.chunks_exact_mut(block_bytes) {
            for &at in scales {
                b[at..at + 2].copy_from_slice(&self.scale());
            }
        }
        out
    }

    fn q4_k(&mut self, n: usize) -> Vec<BlockQ4K> {
        kquant::parse_q4_k(&self.block_bytes(n, Q4_K_BYTES, &[0, 2]))
    }

    fn q5_k(&mut self, n: usize) -> Vec<BlockQ5K> {
        kquant::parse_q5_k(&self.block_bytes(n, Q5_K_BYTES, &[0, 2]))
    }

    fn q6_k(&mut self, n: usize) -> Vec<BlockQ6K> {
        kquant::parse_q6_k(&self.block_bytes(n, Q6_K_BYTES, &[208]))
    }

    fn q5_0(&mut self, n: usize) -> Vec<BlockQ5_0> {
        quant::parse_q5_0(&self.block_bytes(n, Q5_0_BYTES, &[0]))
    }

    fn q5_1(&mut self, n: usize) -> Vec<BlockQ5_1> {
        quant::parse_q5_1(&self.block_bytes(n, Q5_1_BYTES, &[0, 2]))
    }
}

fn close(a: f32, b: f32, rel: f32) -> bool {
    (a - b).abs() <= rel * (1.0 + a.abs().max(b.abs()))
}

/// The scalar reference and every SIMD set this CPU supports.
fn kernel_sets() -> (Kernels, Vec<Kernels>) {
    let mut sets = Kernels::supported();
    let simd = sets.split_off(1);
    let names: Vec<&str> = simd.iter().map(|k| k.name).collect();
    eprintln!("testing {names:?} kernels against scalar");
    (sets.remove(0), simd)
}

/// Runs `check` with the scalar reference against each SIMD set, each from a fresh `Rng(seed)`.
fn against_scalar(seed: u64, mut check: impl FnMut(&Kernels, &Kernels, &mut Rng)) {
    let (scalar, simd) = kernel_sets();
    for fast in &simd {
        check(&scalar, fast, &mut Rng(seed));
    }
}

/// `dot`, a quantised dot product of weights `w` (dequantised) with `x` quantised as `xq`,
/// is the exact product but for activation rounding: at most half a step per element.
fn assert_within_rounding(dot: f32, w: &[f32], x: &[f32], xq: &[BlockQ8Act], what: &str) {
    let exact = scalar::dot_f32_scalar(w, x);
    let bound: f32 = w
        .chunks(QK)
        .zip(xq)
        .map(|(w, b)| w.iter().map(|v| v.abs()).sum::<f32>() * b.d * 0.5)
        .sum();
    assert!(
        (dot - exact).abs() <= bound * 1.01 + 1e-4,
        "{what}: {dot} vs exact {exact} (bound {bound})"
    );
}

fn quantize(k: &Kernels, x: &[f32]) -> Vec<BlockQ8Act> {
    let mut out = vec![BlockQ8Act::default(); x.len() / QK];
    (k.quantize_act)(x, &mut out);
    out
}

#[test]
fn activation_quantisation_matches_scalar_exactly() {
    against_scalar(7, |scalar, fast, rng| {
        for blocks in [1, 3, 18, 49] {
            let mut x = rng.vec(blocks * QK, 3.0);
            x[5] = 0.0;
            let zeros = [0f32; QK];
            for input in [&x[..], &zeros[..]] {
                assert_eq!(
                    quantize(scalar, input),
                    quantize(fast, input),
                    "{blocks} blocks"
                );
            }
        }
    });
}

#[test]
fn quantised_dot_products_match_scalar() {
    against_scalar(11, |scalar, fast, rng| {
        // Past one kernel pass (8 rows) a group is expanded once in spans of at most 16
        // blocks: 18, 33 and 48 blocks split into 2 × 9, 3 × 11 and 3 × 16.
        for blocks in [1, 2, 7, 18, 33, 48] {
            let w = rng.vec(blocks * QK, 0.5);
            let x = rng.vec(blocks * QK, 2.0);
            let xq = quantize(scalar, &x);
            let q40 = quant::quantize_q4_0(&w);
            let q41 = quant::quantize_q4_1(&w);
            let q80 = quant::quantize_q8_0(&w);
            let mut deq = vec![0f32; w.len()];
            for (name, s, f) in [
                (
                    "q4_0",
                    (scalar.dot_q4_0)(&q40, &xq),
                    (fast.dot_q4_0)(&q40, &xq),
                ),
                (
                    "q4_1",
                    (scalar.dot_q4_1)(&q41, &xq),
                    (fast.dot_q4_1)(&q41, &xq),
                ),
                (
                    "q8_0",
                    (scalar.dot_q8_0)(&q80, &xq),
                    (fast.dot_q8_0)(&q80, &xq),
                ),
            ] {
                assert!(
                    close(s, f, 1e-5),
                    "{name} {blocks} blocks: scalar {s} vs simd {f}"
                );
                match name {
                    "q4_0" => quant::dequantize_q4_0(&q40, &mut deq),
                    "q4_1" => quant::dequantize_q4_1(&q41, &mut deq),
                    _ => quant::dequantize_q8_0(&q80, &mut deq),
                }
                assert_within_rounding(s, &deq, &x, &xq, name);
            }
        }
    });
}

/// One weight-row group against every activation row of `x`.
fn group<B>(kernel: GroupKernel<B>, w: &[B], x: &[BlockQ8Act]) -> Vec<[f32; GROUP_ROWS]> {
    let mut out = vec![[0f32; GROUP_ROWS]; x.len() / (w.len() / GROUP_ROWS)];
    kernel(WeightGroup::adjacent(w), x, &mut out);
    out
}

#[test]
fn grouped_kernels_match_scalar_for_every_batch_size() {
    // Every SIMD set is also checked against the first.
    let simd = kernel_sets().1;
    against_scalar(17, |scalar, fast, rng| {
        // Past one kernel pass (8 rows) a group is expanded once in spans of at most 16
        // blocks: 18, 33 and 48 blocks split into 2 × 9, 3 × 11 and 3 × 16.
        for blocks in [1, 2, 7, 18, 33, 48] {
            let cols = blocks * QK;
            let w = rng.vec(GROUP_ROWS * cols, 0.5);
            let q40 = quant::quantize_q4_0(&w);
            let q41 = quant::quantize_q4_1(&w);
            let q80 = quant::quantize_q8_0(&w);
            let x = rng.vec(32 * cols, 2.0);
            let xq = quantize(scalar, &x);
            for n in (1..=9).chain([16, 17, 32]) {
                let xq = &xq[..n * blocks];
                let q40_scalar = group(scalar.gemm_q4_0_group, &q40, xq);
                let q40_fast = group(fast.gemm_q4_0_group, &q40, xq);
                let q41_scalar = group(scalar.gemm_q4_1_group, &q41, xq);
                let q41_fast = group(fast.gemm_q4_1_group, &q41, xq);
                let q80_scalar = group(scalar.gemm_q8_0_group, &q80, xq);
                let q80_fast = group(fast.gemm_q8_0_group, &q80, xq);
                for j in 0..n {
                    let act = &xq[j * blocks..(j + 1) * blocks];
                    for r in 0..GROUP_ROWS {
                        let q40_row = &q40[r * blocks..(r + 1) * blocks];
                        assert_eq!(q40_scalar[j][r], quant::dot_q4_0_scalar(q40_row, act));
                        // Σ (q − 8)·x − taken as Σ q·x − 8·Σx − is exact, and the float
                        // steps are the scalar ones in order, unfused.
                        assert_eq!(
                            q40_scalar[j][r].to_bits(),
                            q40_fast[j][r].to_bits(),
                            "q4_0 group {blocks} blocks n={n} [{j}][{r}]"
                        );
                        let q41_row = &q41[r * blocks..(r + 1) * blocks];
                        let q80_row = &q80[r * blocks..(r + 1) * blocks];
                        // The scalar group is the one-row reference applied row by row.
                        assert_eq!(q41_scalar[j][r], quant::dot_q4_1_scalar(q41_row, act));
                        assert_eq!(q80_scalar[j][r], quant::dot_q8_0_scalar(q80_row, act));
                        let (s, f) = (q41_scalar[j][r], q41_fast[j][r]);
                        assert!(
                            close(s, f, 1e-5),
                            "q4_1 group {blocks} blocks n={n} [{j}][{r}]: scalar {s} vs simd {f}"
                        );
                        let (s, f) = (q80_scalar[j][r], q80_fast[j][r]);
                        assert!(
                            close(s, f, 1e-5),
                            "q8_0 group {blocks} blocks n={n} [{j}][{r}]: scalar {s} vs simd {f}"
                        );
                    }
                }
                // An activation row's result does not depend on how many rows share the call.
                let alone = |j: usize| &xq[j * blocks..(j + 1) * blocks];
                for j in 0..n {
                    assert_eq!(q40_fast[j..=j], group(fast.gemm_q4_0_group, &q40, alone(j)));
                    assert_eq!(q41_fast[j..=j], group(fast.gemm_q4_1_group, &q41, alone(j)));
                    assert_eq!(q80_fast[j..=j], group(fast.gemm_q8_0_group, &q80, alone(j)));
                }
                // Every SIMD set computes the same integer sums, so they agree bit for bit.
                let first = &simd[0];
                assert_eq!(
                    q41_fast,
                    group(first.gemm_q4_1_group, &q41, xq),
                    "{}",
                    fast.name
                );
                assert_eq!(
                    q80_fast,
                    group(first.gemm_q8_0_group, &q80, xq),
                    "{}",
                    fast.name
                );
            }
        }
    });
}

#[test]
fn exponential_kernels_match_the_standard_library() {
    let (scalar, simd) = kernel_sets();
    // A softmax's shifted scores and SwiGLU's gates, out to where e^x leaves the normal
    // floats, with a length that leaves a scalar tail.
    let mut xs: Vec<f32> = (0..2001).map(|i| (i as f32 - 1000.0) * 0.1).collect();
    xs.extend([0.0, -0.0, 1e-8, -1e-8, 88.0, -87.0, 200.0, -200.0]);
    let ys: Vec<f32> = xs.iter().map(|x| (x * 7.3).sin()).collect();
    for fast in &simd {
        // Softmax shifts by the maximum, so exp's inputs are at most 0.
        let scores: Vec<f32> = xs.iter().copied().filter(|x| *x < 80.0).collect();
        let shift = scores.iter().copied().fold(f32::MIN, f32::max);
        let (mut want, mut got) = (scores.clone(), scores.clone());
        let want_sum = (scalar.exp_sum)(&mut want, shift);
        let got_sum = (fast.exp_sum)(&mut got, shift);
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert!(
                (w - g).abs() <= 4e-7 * w.abs() + f32::MIN_POSITIVE,
                "{} exp({} - {shift}): {g} vs {w}",
                fast.name,
                scores[i]
            );
        }
        // The two sum in different orders; both must be near the exact sum.
        let exact: f64 = want.iter().map(|&v| f64::from(v)).sum();
        for sum in [want_sum, got_sum] {
            let error = (f64::from(sum) - exact).abs() / exact;
            assert!(error < 1e-5, "{} exp sum {sum} vs {exact}", fast.name);
        }
        let (mut want, mut got) = (xs.clone(), xs.clone());
        (scalar.silu_mul)(&mut want, &ys);
        (fast.silu_mul)(&mut got, &ys);
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert!(
                (w - g).abs() <= 1e-6 * w.abs() + 1e-30,
                "{} silu({}) · {}: {g} vs {w}",
                fast.name,
                xs[i],
                ys[i]
            );
        }
    }
}

#[test]
fn float_kernels_match_scalar() {
    against_scalar(3, |scalar, fast, rng| {
        for n in [1, 7, 8, 15, 16, 17, 63, 64, 577] {
            let a = rng.vec(n, 1.0);
            let b = rng.vec(n, 1.0);
            // Seven weight rows × five activation rows (off both block sizes), outputs
            // nine apart.
            let w = rng.vec(7 * n, 1.0);
            let x = rng.vec(5 * n, 1.0);
            let (mut o1, mut o2) = (vec![0f32; 45], vec![0f32; 45]);
            (scalar.dot_f32_rows)(&w, &x, n, &mut o1, 9);
            (fast.dot_f32_rows)(&w, &x, n, &mut o2, 9);
            for j in 0..5 {
                for r in 0..7 {
                    let (p, q) = (o1[j * 9 + r], o2[j * 9 + r]);
                    assert!(close(p, q, 1e-5), "dot_f32_rows n={n} [{j}][{r}]");
                    // A product is the same bits alone as inside a block.
                    for (k, got) in [(scalar, p), (fast, q)] {
                        let mut one = [0f32];
                        let (wr, xj) = (&w[r * n..(r + 1) * n], &x[j * n..(j + 1) * n]);
                        (k.dot_f32_rows)(wr, xj, n, &mut one, 1);
                        assert_eq!(one[0].to_bits(), got.to_bits(), "{} n={n}", k.name);
                    }
                }
            }
            let (mut y1, mut y2) = (b.clone(), b.clone());
            (scalar.axpy)(0.37, &a, &mut y1);
            (fast.axpy)(0.37, &a, &mut y2);
            for (p, q) in y1.iter().zip(&y2) {
                assert!(close(*p, *q, 1e-6), "axpy n={n}");
            }
            // Eleven rows of n values, n + 3 apart, as the keys or values of one kv head,
            // scored for one to five query heads (more than one pass of heads).
            let stride = n + 3;
            let rows = rng.vec(10 * stride + n, 1.0);
            let keys = StridedRows {
                data: &rows,
                stride,
                count: 11,
            };
            for heads in 1..=5 {
                let qs = rng.vec(heads * n, 1.0);
                // Each head's scores 13 apart: the kernels leave the gaps alone.
                let (mut s1, mut s2) = (vec![7f32; heads * 13], vec![7f32; heads * 13]);
                (scalar.dot_strided)(&qs, heads, keys, 0.125, &mut s1, 13);
                (fast.dot_strided)(&qs, heads, keys, 0.125, &mut s2, 13);
                assert_eq!(s1, s2, "dot_strided n={n} heads={heads}");
                for h in 0..heads {
                    for i in 0..13 {
                        let got = s1[h * 13 + i];
                        if i >= 11 {
                            assert_eq!(got, 7.0, "dot_strided wrote a gap");
                            continue;
                        }
                        let q = &qs[h * n..(h + 1) * n];
                        let direct = scalar::dot_f32_scalar(q, keys.row(i, n)) * 0.125;
                        assert!(
                            close(got, direct, 1e-6),
                            "dot_strided n={n} head {h} row {i}"
                        );
                    }
                }
            }
            let s1: Vec<f32> = (0..11).map(|i| ((i * 5) % 7) as f32 / 7.0).collect();
            let (mut y1, mut y2) = (b.clone(), b.clone());
            (scalar.axpy_strided)(&s1, &rows, stride, &mut y1);
            (fast.axpy_strided)(&s1, &rows, stride, &mut y2);
            for (p, q) in y1.iter().zip(&y2) {
                assert!(close(*p, *q, 1e-5), "axpy_strided n={n}");
            }
        }
    });
}

/// Keys and values rounded to f16, and the same values widened back to f32.
fn f16_and_widened(values: Vec<f32>) -> (Vec<half::f16>, Vec<f32>) {
    let halves: Vec<half::f16> = values.into_iter().map(half::f16::from_f32).collect();
    let widened = halves.iter().map(|h| h.to_f32()).collect();
    (halves, widened)
}

#[test]
fn f16_kv_kernels_equal_f32_kernels_on_widened_values() {
    let mut rng = Rng(17);
    let (scalar, fast) = kernel_sets();
    // Below, at and past the 8-lane and 64-value blocks, with a scalar tail.
    for n in [5usize, 16, 40, 64, 141] {
        let stride = n + 3;
        let (halves, widened) = f16_and_widened(rng.vec(10 * stride + n, 1.0));
        let keys = StridedRows {
            data: &widened,
            stride,
            count: 11,
        };
        let keys16 = StridedRows {
            data: &halves,
            stride,
            count: 11,
        };
        let weights: Vec<f32> = (0..11).map(|i| ((i * 5) % 7) as f32 / 7.0).collect();
        let b = rng.vec(n, 1.0);
        let mut reference_axpy = b.clone();
        scalar::axpy_strided_scalar(&weights, &halves, stride, &mut reference_axpy);
        for k in std::iter::once(&scalar).chain(&fast) {
            for heads in 1..=5 {
                let qs = rng.vec(heads * n, 1.0);
                let (mut s32, mut s16) = (vec![7f32; heads * 13], vec![7f32; heads * 13]);
                (k.dot_strided)(&qs, heads, keys, 0.125, &mut s32, 13);
                (k.dot_strided_f16)(&qs, heads, keys16, 0.125, &mut s16, 13);
                assert_eq!(s32, s16, "{} dot_strided_f16 n={n} heads={heads}", k.name);
                let mut reference = vec![7f32; heads * 13];
                scalar::dot_strided_scalar(&qs, heads, keys16, 0.125, &mut reference, 13);
                assert_eq!(reference, s16, "{} vs scalar n={n} heads={heads}", k.name);
            }
            let (mut y32, mut y16) = (b.clone(), b.clone());
            (k.axpy_strided)(&weights, &widened, stride, &mut y32);
            (k.axpy_strided_f16)(&weights, &halves, stride, &mut y16);
            assert_eq!(y32, y16, "{} axpy_strided_f16 n={n}", k.name);
            for (p, q) in reference_axpy.iter().zip(&y16) {
                assert!(close(*p, *q, 1e-5), "{} axpy_strided_f16 n={n}", k.name);
            }
        }
    }
}

#[test]
fn paged_attention_reads_an_f16_cache_as_its_widened_values() {
    let mut rng = Rng(19);
    let (n_heads, n_kv, hd, bs) = (6, 2, 64, 4);
    let blocks = 9;
    let len = blocks * bs * n_kv * hd;
    let (k16, k32) = f16_and_widened(rng.vec(len, 1.0));
    let (v16, v32) = f16_and_widened(rng.vec(len, 1.0));
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    // A prefill chunk and a decode token, each over its own pages of the same cache.
    let chunks = |k, v| {
        [(0usize, 0..21usize), (30, 21..22)].map(|(start_pos, rows)| AttentionChunk {
            rows,
            start_pos,
            kv: PagedKv {
                k,
                v,
                block_table: &table,
                block_size: bs,
                n_kv_heads: n_kv,
                head_dim: hd,
            },
        })
    };
    let wide = chunks(KvData::F32(&k32), KvData::F32(&v32));
    let narrow = chunks(KvData::F16(&k16), KvData::F16(&v16));
    let q = rng.vec(22 * n_heads * hd, 1.0);
    for kernels in Kernels::supported() {
        let be = CpuBackend::with_kernels(2, kernels).unwrap();
        let (mut want, mut got) = (vec![0f32; q.len()], vec![0f32; q.len()]);
        be.attention(&q, &wide, n_heads, &mut want);
        be.attention(&q, &narrow, n_heads, &mut got);
        assert_eq!(want, got, "f16 cache ({})", be.name());
    }
}

#[test]
fn block_formats_round_trip() {
    let mut rng = Rng(5);
    let x = rng.vec(5 * QK, 1.0);
    let mut out = vec![0f32; x.len()];
    let within = |out: &[f32], step: f32| x.iter().zip(out).all(|(a, b)| (a - b).abs() <= step);
    let q8 = quant::quantize_q8_0(&x);
    quant::dequantize_q8_0(&q8, &mut out);
    assert!(within(&out, 1.0 / 127.0 + 1e-3));
    let q41 = quant::quantize_q4_1(&x);
    quant::dequantize_q4_1(&q41, &mut out);
    assert!(within(&out, 2.0 / 15.0 * 0.5 + 2e-3));
    let q40 = quant::quantize_q4_0(&x);
    quant::dequantize_q4_0(&q40, &mut out);
    assert!(within(&out, 1.0 / 8.0 + 2e-3));
    // The GGUF byte encodings parse back to the same blocks.
    assert_eq!(quant::parse_q8_0(&quant::q8_0_bytes(&q8)), q8);
    assert_eq!(quant::parse_q4_1(&quant::q4_1_bytes(&q41)), q41);
    assert_eq!(quant::parse_q4_0(&quant::q4_0_bytes(&q40)), q40);
}

fn reference_matmul(w: &Matrix, x: &[f32], n: usize) -> Vec<f32> {
    let wf = w.to_f32();
    let mut out = vec![0f32; n * w.rows];
    for j in 0..n {
        for r in 0..w.rows {
            out[j * w.rows + r] = scalar::dot_f32_scalar(
                &wf[r * w.cols..(r + 1) * w.cols],
                &x[j * w.cols..(j + 1) * w.cols],
            );
        }
    }
    out
}

#[test]
fn matmul_every_storage_and_batch_size() {
    let mut rng = Rng(9);
    let (rows, cols) = (37, 96);
    let base = Matrix::f32(rows, cols, rng.vec(rows * cols, 0.3));
    let storages = [
        base.clone(),
        base.to_f16_matrix(),
        base.to_q8_0().unwrap(),
        Matrix {
            rows,
            cols,
            data: WeightData::Q4_0(quant::quantize_q4_0(&base.to_f32()).into()),
        },
        Matrix {
            rows,
            cols,
            data: WeightData::Q4_1(quant::quantize_q4_1(&base.to_f32()).into()),
        },
    ];
    let backends: Vec<CpuBackend> = Kernels::supported()
        .into_iter()
        .map(|k| CpuBackend::with_kernels(2, k).unwrap())
        .collect();
    for n in [1, 2, 3, 5, 33] {
        let x = rng.vec(n * cols, 1.0);
        for w in &storages {
            let want = reference_matmul(w, &x, n);
            let quantised = w.is_quantized();
            let mut results = Vec::new();
            for be in &backends {
                let mut out = vec![0f32; n * rows];
                be.matmul(w, &x, n, &mut out);
                let tol = if quantised { 0.05 } else { 1e-3 };
                for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                    assert!(
                        (a - b).abs() <= tol,
                        "{} n={n} [{i}]: {a} vs {b} ({})",
                        w.type_name(),
                        be.name()
                    );
                }
                results.push(out);
            }
            for (simd, be) in results[1..].iter().zip(&backends[1..]) {
                for (a, b) in results[0].iter().zip(simd) {
                    assert!(
                        close(*a, *b, 1e-5),
                        "{} n={n}: scalar and {} backends differ",
                        w.type_name(),
                        be.name()
                    );
                }
            }
            // Batches change speed, not answers: each row equals its single-row product bit
            // for bit, in every storage.
            for (be, batched) in backends.iter().zip(&results) {
                for j in 0..n {
                    let mut alone = vec![0f32; rows];
                    be.matmul(w, &x[j * cols..(j + 1) * cols], 1, &mut alone);
                    assert_eq!(
                        alone[..],
                        batched[j * rows..(j + 1) * rows],
                        "{} n={n} row {j} ({})",
                        w.type_name(),
                        be.name()
                    );
                }
            }
        }
    }
}

#[test]
fn a_small_batch_over_a_large_matrix_spreads_its_groups_with_the_same_results() {
    // Over 4 MiB, so a pass of one or two rows spreads each group over the matrix: 255
    // groups and five rows for the one-row kernel.
    let mut rng = Rng(29);
    let (rows, supers) = (2045, 16);
    let cols = supers * QK_K;
    let blocks = rng.q4_k(rows * supers);
    let w = Matrix {
        rows,
        cols,
        data: WeightData::Q4K(blocks.clone().into()),
    };
    assert!(w.bytes() > 4 << 20);
    let x = rng.vec(3 * cols, 1.0);
    for k in Kernels::supported() {
        let be = CpuBackend::with_kernels(2, k).unwrap();
        // Three rows take adjacent groups; one and two rows, spread ones.
        let mut adjacent = vec![0f32; 3 * rows];
        be.matmul(&w, &x, 3, &mut adjacent);
        for n in [1, 2] {
            let mut spread = vec![0f32; n * rows];
            be.matmul(&w, &x[..n * cols], n, &mut spread);
            assert_eq!(spread[..], adjacent[..n * rows], "n={n} ({})", be.name());
        }
        let xq = quantize(&Kernels::scalar(), &x[..cols]);
        for (r, row) in blocks.chunks_exact(supers).enumerate() {
            let (got, want) = (adjacent[r], kquant::dot_q4_k_scalar(row, &xq));
            assert!(
                close(got, want, 1e-5),
                "row {r}: {got} vs {want} ({})",
                be.name()
            );
        }
    }
}

#[test]
fn matmuls_sharing_an_input_equal_separate_matmuls() {
    let mut rng = Rng(21);
    let cols = 64;
    let matrix = |rows: usize, rng: &mut Rng| Matrix::f32(rows, cols, rng.vec(rows * cols, 0.3));
    let (a, b, c) = (
        matrix(40, &mut rng),
        matrix(24, &mut rng),
        matrix(13, &mut rng),
    );
    let q4_1 = |m: &Matrix| Matrix {
        rows: m.rows,
        cols,
        data: WeightData::Q4_1(quant::quantize_q4_1(&m.to_f32()).into()),
    };
    // One pass over mixed block formats and a row count off the group size; float and
    // Q4_0 matrices take the one-at-a-time path.
    let sets = [
        vec![q4_1(&a), b.to_q8_0().unwrap(), q4_1(&c)],
        vec![a.clone(), b.to_q8_0().unwrap()],
        vec![
            Matrix {
                rows: 13,
                cols,
                data: WeightData::Q4_0(quant::quantize_q4_0(&c.to_f32()).into()),
            },
            q4_1(&a),
        ],
    ];
    for kernels in Kernels::supported() {
        let be = CpuBackend::with_kernels(2, kernels).unwrap();
        for n in [1, 3, 9] {
            let x = rng.vec(n * cols, 1.0);
            for set in &sets {
                let ws: Vec<&Matrix> = set.iter().collect();
                let mut outs: Vec<Vec<f32>> = set.iter().map(|w| vec![0f32; n * w.rows]).collect();
                let mut parts: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
                be.matmul_shared_input(&ws, &x, n, &mut parts);
                for (w, got) in set.iter().zip(&outs) {
                    let mut alone = vec![0f32; n * w.rows];
                    be.matmul(w, &x, n, &mut alone);
                    assert_eq!(got, &alone, "{} n={n} ({})", w.type_name(), be.name());
                }
            }
        }
    }
}

#[test]
fn paged_attention_matches_contiguous_reference() {
    let mut rng = Rng(13);
    let (n_heads, n_kv, hd, bs) = (4, 2, 16, 4);
    let slot = n_kv * hd;
    // One call carries every chunk of a step, decode-sized and long.
    let shapes = [(5usize, 1usize), (5, 3), (0, 9), (17, 1), (3, 70), (0, 1)];
    struct Pages {
        start: usize,
        t: usize,
        table: Vec<u32>,
        k: Vec<f32>,
        v: Vec<f32>,
    }
    let pages: Vec<Pages> = shapes
        .iter()
        .map(|&(start, t)| {
            let blocks = (start + t).div_ceil(bs);
            // Pages deliberately out of order, with one unused page in between.
            let table = (0..blocks as u32)
                .map(|b| (b * 7 + 3) % (blocks as u32 + 1))
                .collect();
            let k = rng.vec((blocks + 1) * bs * slot, 1.0);
            let v = rng.vec((blocks + 1) * bs * slot, 1.0);
            Pages {
                start,
                t,
                table,
                k,
                v,
            }
        })
        .collect();
    let total: usize = shapes.iter().map(|s| s.1).sum();
    let q = rng.vec(total * n_heads * hd, 1.0);
    let mut chunks = Vec::new();
    for p in &pages {
        let at = chunks.last().map_or(0, |c: &AttentionChunk<'_>| c.rows.end);
        chunks.push(AttentionChunk {
            rows: at..at + p.t,
            start_pos: p.start,
            kv: PagedKv {
                k: KvData::F32(&p.k),
                v: KvData::F32(&p.v),
                block_table: &p.table,
                block_size: bs,
                n_kv_heads: n_kv,
                head_dim: hd,
            },
        });
    }
    let row_len = n_heads * hd;
    for kernels in Kernels::supported() {
        let be = CpuBackend::with_kernels(2, kernels).unwrap();
        let mut out = vec![0f32; q.len()];
        be.attention(&q, &chunks, n_heads, &mut out);
        // Each token on its own, as a one-token chunk, gives the same bits as inside its
        // chunk: a prefix from the cache does not change what follows it.
        for c in &chunks {
            for (i, row) in c.rows.clone().enumerate() {
                let alone = [AttentionChunk {
                    rows: 0..1,
                    start_pos: c.start_pos + i,
                    kv: PagedKv { ..c.kv },
                }];
                let mut one = vec![0f32; row_len];
                be.attention(&q[row * row_len..][..row_len], &alone, n_heads, &mut one);
                assert_eq!(
                    one[..],
                    out[row * row_len..][..row_len],
                    "start {} row {i} ({})",
                    c.start_pos,
                    be.name()
                );
            }
        }
        for (p, c) in pages.iter().zip(&chunks) {
            for i in 0..p.t {
                let row = c.rows.start + i;
                for h in 0..n_heads {
                    let kvh = h / (n_heads / n_kv);
                    let qv = &q[(row * n_heads + h) * hd..][..hd];
                    let len = p.start + i + 1;
                    let at = |pos: usize| {
                        ((p.table[pos / bs] as usize * bs + pos % bs) * n_kv + kvh) * hd
                    };
                    let s: Vec<f32> = (0..len)
                        .map(|pos| {
                            scalar::dot_f32_scalar(qv, &p.k[at(pos)..at(pos) + hd])
                                / (hd as f32).sqrt()
                        })
                        .collect();
                    let m = s.iter().copied().fold(f32::MIN, f32::max);
                    let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
                    let z: f32 = e.iter().sum();
                    for d in 0..hd {
                        let want: f32 = (0..len).map(|pos| e[pos] / z * p.v[at(pos) + d]).sum();
                        let got = out[(row * n_heads + h) * hd + d];
                        assert!(
                            (want - got).abs() < 1e-5,
                            "start {} t {}: token {i} head {h} dim {d}: {got} vs {want} ({})",
                            p.start,
                            p.t,
                            be.name()
                        );
                    }
                }
            }
        }
    }
}

/// Weight row `r` · one activation row, with a kernel set's kernel.
type RowDot = dyn Fn(&Kernels, usize, &[BlockQ8Act]) -> f32;
/// The first weight-row group · every activation row, with a kernel set's kernel.
type GroupDot = dyn Fn(&Kernels, &[BlockQ8Act]) -> Vec<[f32; GROUP_ROWS]>;

/// One GGUF block format's kernels and dequantised values on random blocks, by name.
struct BlockCase {
    name: &'static str,
    /// Values per block: a column range keeps the blocks only when aligned to it.
    block_values: usize,
    dequantized: Vec<f32>,
    dot: Box<RowDot>,
    group: Box<GroupDot>,
    matrix: Matrix,
}

/// The three k-quant formats, and the Q5_0 / Q5_1 blocks the k-quant files mix in, on
/// `rows` random rows of `supers` × 256 columns each.
fn gguf_block_cases(rng: &mut Rng, rows: usize, supers: usize) -> Vec<BlockCase> {
    #[allow(clippy::too_many_arguments)]
    fn case<B: Copy + 'static>(
        name: &'static str,
        block_values: usize,
        blocks: Vec<B>,
        rows: usize,
        dequantize: fn(&[B], &mut [f32]),
        dot: fn(&Kernels) -> DotKernel<B>,
        group: fn(&Kernels) -> GroupKernel<B>,
        data: fn(Vec<B>) -> WeightData,
    ) -> BlockCase {
        let nb = blocks.len() / rows;
        let mut dequantized = vec![0f32; blocks.len() * block_values];
        dequantize(&blocks, &mut dequantized);
        let (b1, b2) = (blocks.clone(), blocks.clone());
        BlockCase {
            name,
            block_values,
            dequantized,
            dot: Box::new(move |k, r, x| dot(k)(&b1[r * nb..(r + 1) * nb], x)),
            group: Box::new(move |k, x| {
                let w = &b2[..GROUP_ROWS * nb];
                let mut out = vec![[0f32; GROUP_ROWS]; x.len() * QK / (nb * block_values)];
                group(k)(WeightGroup::adjacent(w), x, &mut out);
                out
            }),
            matrix: Matrix {
                rows,
                cols: nb * block_values,
                data: data(blocks),
            },
        }
    }
    let n = rows * supers;
    let n5 = n * QK_K / QK;
    vec![
        case(
            "q4_k",
            QK_K,
            rng.q4_k(n),
            rows,
            kquant::dequantize_q4_k,
            |k| k.dot_q4_k,
            |k| k.gemm_q4_k_group,
            |b| WeightData::Q4K(b.into()),
        ),
        case(
            "q5_k",
            QK_K,
            rng.q5_k(n),
            rows,
            kquant::dequantize_q5_k,
            |k| k.dot_q5_k,
            |k| k.gemm_q5_k_group,
            |b| WeightData::Q5K(b.into()),
        ),
        case(
            "q6_k",
            QK_K,
            rng.q6_k(n),
            rows,
            kquant::dequantize_q6_k,
            |k| k.dot_q6_k,
            |k| k.gemm_q6_k_group,
            |b| WeightData::Q6K(b.into()),
        ),
        case(
            "q5_0",
            QK,
            rng.q5_0(n5),
            rows,
            quant::dequantize_q5_0,
            |k| k.dot_q5_0,
            |k| k.gemm_q5_0_group,
            |b| WeightData::Q5_0(b.into()),
        ),
        case(
            "q5_1",
            QK,
            rng.q5_1(n5),
            rows,
            quant::dequantize_q5_1,
            |k| k.dot_q5_1,
            |k| k.gemm_q5_1_group,
            |b| WeightData::Q5_1(b.into()),
        ),
    ]
}

#[test]
fn gguf_blocks_round_trip_through_their_bytes() {
    let mut rng = Rng(31);
    let q4 = rng.block_bytes(5, Q4_K_BYTES, &[0, 2]);
    let q5 = rng.block_bytes(5, Q5_K_BYTES, &[0, 2]);
    let q6 = rng.block_bytes(5, Q6_K_BYTES, &[208]);
    assert_eq!(kquant::q4_k_bytes(&kquant::parse_q4_k(&q4)), q4);
    assert_eq!(kquant::q5_k_bytes(&kquant::parse_q5_k(&q5)), q5);
    assert_eq!(kquant::q6_k_bytes(&kquant::parse_q6_k(&q6)), q6);
    let q50 = rng.block_bytes(5, Q5_0_BYTES, &[0]);
    let q51 = rng.block_bytes(5, Q5_1_BYTES, &[0, 2]);
    assert_eq!(quant::q5_0_bytes(&quant::parse_q5_0(&q50)), q50);
    assert_eq!(quant::q5_1_bytes(&quant::parse_q5_1(&q51)), q51);
    // The struct layouts are the GGUF ones, size for size.
    assert_eq!(std::mem::size_of::<BlockQ4K>(), Q4_K_BYTES);
    assert_eq!(std::mem::size_of::<BlockQ5K>(), Q5_K_BYTES);
    assert_eq!(std::mem::size_of::<BlockQ6K>(), Q6_K_BYTES);
    assert_eq!(std::mem::size_of::<BlockQ5_0>(), Q5_0_BYTES);
    assert_eq!(std::mem::size_of::<BlockQ5_1>(), Q5_1_BYTES);
}

#[test]
fn kquant_scale_packing_is_ggmls() {
    // Sub-blocks 0..4 keep their 6-bit scale and minimum in bytes 0..4 and 4..8; 4..8 put
    // their low four bits in bytes 8..12 and their top two in the spare bits of 0..8.
    let mut scales = [0u8; 12];
    scales[1] = 0b11_000101; // sub-block 1 scale 5, top bits of sub-block 5's scale 3
    scales[5] = 0b01_001001; // sub-block 1 min 9, top bits of sub-block 5's min 1
    scales[9] = 0b1010_0110; // sub-block 5: low bits of scale 6, of min 10
    assert_eq!(kquant::scale_min_k4(1, &scales), (5, 9));
    assert_eq!(kquant::scale_min_k4(5, &scales), (0b11_0110, 0b01_1010));
}

#[test]
fn gguf_block_dot_products_match_scalar_and_the_dequantised_weights() {
    let (scalar, simd) = kernel_sets();
    let mut rng = Rng(37);
    for supers in [1, 2, 3, 6] {
        let cols = supers * QK_K;
        let x = rng.vec(cols, 2.0);
        let xq = quantize(&scalar, &x);
        for case in gguf_block_cases(&mut rng, 3, supers) {
            for r in 0..3 {
                let s = (case.dot)(&scalar, r, &xq);
                let w = &case.dequantized[r * cols..(r + 1) * cols];
                let what = format!("{} {supers} super-blocks", case.name);
                assert_within_rounding(s, w, &x, &xq, &what);
                for fast in &simd {
                    let f = (case.dot)(fast, r, &xq);
                    assert!(
                        close(s, f, 1e-5),
                        "{} {supers} super-blocks: scalar {s} vs {} {f}",
                        case.name,
                        fast.name
                    );
                }
            }
        }
    }
}

#[test]
fn gguf_block_grouped_kernels_match_scalar_for_every_batch_size() {
    let (scalar, simd) = kernel_sets();
    let mut rng = Rng(41);
    // Up to 20 super-blocks: past one kernel pass a group is expanded in spans.
    for supers in [1, 2, 5, 20] {
        let cols = supers * QK_K;
        let x = rng.vec(35 * cols, 2.0);
        let xq = quantize(&scalar, &x);
        for case in gguf_block_cases(&mut rng, GROUP_ROWS, supers) {
            let want = (case.group)(&scalar, &xq);
            for (j, row) in want.iter().enumerate() {
                for (r, &v) in row.iter().enumerate() {
                    let dot = (case.dot)(&scalar, r, &xq[j * cols / QK..(j + 1) * cols / QK]);
                    assert_eq!(v, dot, "{} scalar group row {r} act {j}", case.name);
                }
            }
            for fast in &simd {
                let all = (case.group)(fast, &xq);
                for n in (1..=19).chain([32, 35]) {
                    let got = (case.group)(fast, &xq[..n * cols / QK]);
                    for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                        // A row's result does not depend on the batch it is in.
                        assert_eq!(g, &all[j], "{} {} n={n} act {j}", case.name, fast.name);
                        // Each lane repeats the scalar arithmetic in order, unfused.
                        assert_eq!(
                            g.map(f32::to_bits),
                            w.map(f32::to_bits),
                            "{} {} {supers} super-blocks n={n} act {j}",
                            case.name,
                            fast.name
                        );
                    }
                }
            }
        }
    }
}

/// A set's pair kernel on two groups, against its group kernel on each (which the tests
/// above hold to the scalar references). The 16 rows form two groups the way the backend
/// forms a matrix's: the even rows, and the odd ones.
fn pair_matches_groups<B: Copy>(
    name: &str,
    blocks: &[B],
    pair: Option<PairKernel<B>>,
    group: GroupKernel<B>,
    x: &[BlockQ8Act],
    set: &str,
) {
    let Some(pair) = pair else { return };
    let row_blocks = blocks.len() / (2 * GROUP_ROWS);
    let (even, odd) = (
        WeightGroup::new(blocks, row_blocks, 2),
        WeightGroup::new(&blocks[row_blocks..], row_blocks, 2),
    );
    let nb = x.len() / 35;
    // The pair kernels run their 512-bit passes at any batch size, eight rows at a time.
    for n in (1..=19).chain([32, 35]) {
        let x = &x[..n * nb];
        let (mut first, mut second) = (vec![[0f32; GROUP_ROWS]; n], vec![[0f32; GROUP_ROWS]; n]);
        group(even, x, &mut first);
        group(odd, x, &mut second);
        let mut got = vec![[0f32; 2 * GROUP_ROWS]; n];
        pair(even, odd, x, &mut got);
        for (j, got) in got.iter().enumerate() {
            let want: Vec<u32> = first[j]
                .iter()
                .chain(&second[j])
                .map(|v| v.to_bits())
                .collect();
            let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "{name} {set} {nb} blocks n={n} act {j}");
        }
    }
}

#[test]
fn pair_kernels_equal_two_groups_for_every_batch_size() {
    let (scalar, simd) = kernel_sets();
    let mut rng = Rng(47);
    let rows = 2 * GROUP_ROWS;
    // 1 to 40 blocks of 32: past 16 the 32-value formats expand a pair in spans.
    for supers in [1, 2, 5] {
        let cols = supers * QK_K;
        let xq = quantize(&scalar, &rng.vec(35 * cols, 2.0));
        let w = rng.vec(rows * cols, 0.5);
        let (q40, q41, q80) = (
            quant::quantize_q4_0(&w),
            quant::quantize_q4_1(&w),
            quant::quantize_q8_0(&w),
        );
        let blocks = rows * cols / QK;
        let (q50, q51) = (rng.q5_0(blocks), rng.q5_1(blocks));
        let (q4k, q5k, q6k) = (
            rng.q4_k(rows * supers),
            rng.q5_k(rows * supers),
            rng.q6_k(rows * supers),
        );
        for k in &simd {
            let (set, p) = (k.name, k.pairs);
            pair_matches_groups("q4_0", &q40, p.map(|p| p.q4_0), k.gemm_q4_0_group, &xq, set);
            pair_matches_groups("q4_1", &q41, p.map(|p| p.q4_1), k.gemm_q4_1_group, &xq, set);
            pair_matches_groups("q5_0", &q50, p.map(|p| p.q5_0), k.gemm_q5_0_group, &xq, set);
            pair_matches_groups("q5_1", &q51, p.map(|p| p.q5_1), k.gemm_q5_1_group, &xq, set);
            pair_matches_groups("q8_0", &q80, p.map(|p| p.q8_0), k.gemm_q8_0_group, &xq, set);
            pair_matches_groups("q4_k", &q4k, p.map(|p| p.q4_k), k.gemm_q4_k_group, &xq, set);
            pair_matches_groups("q5_k", &q5k, p.map(|p| p.q5_k), k.gemm_q5_k_group, &xq, set);
            pair_matches_groups("q6_k", &q6k, p.map(|p| p.q6_k), k.gemm_q6_k_group, &xq, set);
        }
    }
}

/// A plain k-quant format's group and pair kernels, and its interleaved ones.
struct InterleavedKernels<B, C> {
    group: GroupKernel<B>,
    pair: Option<PairKernel<B>>,
    interleaved_group: InterleavedKernel<C>,
    interleaved_pair: Option<InterleavedPairKernel<C>>,
}

fn bits<const N: usize>(v: &[[f32; N]]) -> Vec<u32> {
    v.iter().flatten().map(|v| v.to_bits()).collect()
}

/// The interleaved kernels read the bytes of eight rows' blocks moved, so each set's
/// interleaved group and pair kernels equal its plain ones bit for bit, at every batch size
/// (and through the scalar reference, the plain scalar kernel).
fn check_interleaved_kernels<B: Interleave + Sync + std::fmt::Debug + PartialEq>(
    name: &str,
    random: fn(&mut Rng, usize) -> Vec<B>,
    kernels: fn(&Kernels) -> InterleavedKernels<B, B::Column>,
) where
    B::Column: Send,
{
    let (scalar, simd) = kernel_sets();
    let mut rng = Rng(53);
    for supers in [1, 2, 5, 20] {
        let cols = supers * QK_K;
        let xq = quantize(&scalar, &rng.vec(35 * cols, 2.0));
        let blocks = random(&mut rng, 2 * GROUP_ROWS * supers);
        let columns = interleaved::interleave_rows(&blocks, 2 * GROUP_ROWS, supers);
        assert_eq!(
            interleaved::rows_of::<B>(&columns, supers, 0..2 * GROUP_ROWS),
            blocks
        );
        let packed = |g: usize| InterleavedGroup::new(&columns[g * supers..][..supers]);
        let plain = |g: usize| {
            WeightGroup::adjacent(&blocks[g * GROUP_ROWS * supers..][..GROUP_ROWS * supers])
        };
        for k in std::iter::once(&scalar).chain(&simd) {
            let kernels = kernels(k);
            for n in (1..=19).chain([32, 35]) {
                let x = &xq[..n * cols / QK];
                for g in 0..2 {
                    let (mut want, mut got) =
                        (vec![[0f32; GROUP_ROWS]; n], vec![[0f32; GROUP_ROWS]; n]);
                    (kernels.group)(plain(g), x, &mut want);
                    (kernels.interleaved_group)(packed(g), x, &mut got);
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{name} {} {supers} supers n={n} group {g}",
                        k.name
                    );
                }
                let (Some(pair), Some(interleaved_pair)) = (kernels.pair, kernels.interleaved_pair)
                else {
                    continue;
                };
                let mut want = vec![[0f32; 2 * GROUP_ROWS]; n];
                pair(plain(0), plain(1), x, &mut want);
                let mut got = vec![[0f32; 2 * GROUP_ROWS]; n];
                interleaved_pair(packed(0), packed(1), x, &mut got);
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{name} {} pair {supers} supers n={n}",
                    k.name
                );
            }
        }
    }
}

#[test]
fn interleaved_kernels_equal_the_plain_ones() {
    check_interleaved_kernels("q4_k", Rng::q4_k, |k| InterleavedKernels {
        group: k.gemm_q4_k_group,
        pair: k.pairs.map(|p| p.q4_k),
        interleaved_group: k.gemm_q4_kx8_group,
        interleaved_pair: k.pairs.map(|p| p.q4_kx8),
    });
    check_interleaved_kernels("q6_k", Rng::q6_k, |k| InterleavedKernels {
        group: k.gemm_q6_k_group,
        pair: k.pairs.map(|p| p.q6_k),
        interleaved_group: k.gemm_q6_kx8_group,
        interleaved_pair: k.pairs.map(|p| p.q6_kx8),
    });
}

/// `Q4_K` and `Q6_K` matrices of whole row groups, interleaved, keep their values and every
/// backend's products bit for bit, at every batch size (a small batch over the plain matrix
/// spreads its groups; the interleaved one keeps them adjacent), and their row and column
/// slices; other matrices stay as they are.
#[test]
fn interleaved_matrices_multiply_as_the_plain_ones() {
    let mut rng = Rng(59);
    let (rows, supers) = (48, 3);
    let cols = supers * QK_K;
    let x = rng.vec(17 * cols, 1.0);
    let backends: Vec<CpuBackend> = Kernels::supported()
        .into_iter()
        .map(|k| CpuBackend::with_kernels(2, k).unwrap())
        .collect();
    for data in [
        WeightData::Q4K(rng.q4_k(rows * supers).into()),
        WeightData::Q6K(rng.q6_k(rows * supers).into()),
    ] {
        let plain = Matrix { rows, cols, data };
        let packed = plain.clone().interleaved();
        assert!(matches!(
            packed.data,
            WeightData::Q4KX8(_) | WeightData::Q6KX8(_)
        ));
        assert_eq!(packed.type_name(), plain.type_name());
        assert_eq!(packed.bytes(), plain.bytes());
        assert_eq!(packed.to_f32(), plain.to_f32());
        assert_eq!(packed.select_rows(8..21), plain.select_rows(8..21));
        assert_eq!(
            packed.select_cols(QK_K..2 * QK_K),
            plain.select_cols(QK_K..2 * QK_K)
        );
        let odd = plain.select_rows(0..21);
        assert_eq!(
            odd.clone().interleaved(),
            odd,
            "rows in no whole group stay as they are"
        );
        for be in &backends {
            for n in [1, 2, 3, 9, 17] {
                let (mut want, mut got) = (vec![0f32; n * rows], vec![0f32; n * rows]);
                be.matmul(&plain, &x[..n * cols], n, &mut want);
                be.matmul(&packed, &x[..n * cols], n, &mut got);
                assert_eq!(got, want, "{} n={n} ({})", plain.type_name(), be.name());
            }
        }
    }
    let q4_1 = Matrix {
        rows,
        cols,
        data: WeightData::Q4_1(quant::quantize_q4_1(&rng.vec(rows * cols, 1.0)).into()),
    };
    assert_eq!(q4_1.clone().interleaved(), q4_1);
}

#[test]
fn gguf_block_matmuls_match_the_dequantised_weights_on_every_backend() {
    let mut rng = Rng(43);
    // 21 rows: two whole groups and a remainder the one-row kernel takes.
    let (rows, cols) = (21, 2 * QK_K);
    let backends: Vec<CpuBackend> = Kernels::supported()
        .into_iter()
        .map(|k| CpuBackend::with_kernels(2, k).unwrap())
        .collect();
    let cases = gguf_block_cases(&mut rng, rows, cols / QK_K);
    for n in [1, 4, 9] {
        let x = rng.vec(n * cols, 1.0);
        for case in &cases {
            let w = &case.matrix;
            assert_eq!(w.to_f32(), case.dequantized);
            let want = reference_matmul(w, &x, n);
            for be in &backends {
                let mut out = vec![0f32; n * rows];
                be.matmul(w, &x, n, &mut out);
                for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                    // Activation rounding: at most half a step of each block's int8 scale.
                    let (j, r) = (i / rows, i % rows);
                    let w = &case.dequantized[r * cols..(r + 1) * cols];
                    let bound: f32 = w
                        .chunks(QK)
                        .zip(x[j * cols..(j + 1) * cols].chunks(QK))
                        .map(|(w, x)| {
                            let step = x.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                            w.iter().map(|v| v.abs()).sum::<f32>() * step * 0.5
                        })
                        .sum();
                    assert!(
                        (a - b).abs() <= bound * 1.01 + 1e-4,
                        "{} n={n} [{i}]: {a} vs {b} (bound {bound}, {})",
                        case.name,
                        be.name()
                    );
                }
                for j in 0..n {
                    let mut alone = vec![0f32; rows];
                    be.matmul(w, &x[j * cols..(j + 1) * cols], 1, &mut alone);
                    assert_eq!(alone[..], out[j * rows..(j + 1) * rows], "{}", case.name);
                }
            }
        }
        // Q/K/V of a Q4_K_M file mix formats in one shared-input pass.
        let mixed = [&cases[0].matrix, &cases[3].matrix, &cases[2].matrix];
        for be in &backends {
            let mut outs: Vec<Vec<f32>> = mixed.iter().map(|_| vec![0f32; n * rows]).collect();
            let mut parts: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
            be.matmul_shared_input(&mixed, &x, n, &mut parts);
            for (w, got) in mixed.iter().zip(&outs) {
                let mut alone = vec![0f32; n * rows];
                be.matmul(w, &x, n, &mut alone);
                assert_eq!(got, &alone, "{} n={n} ({})", w.type_name(), be.name());
            }
        }
    }
}

#[test]
fn block_column_slices_keep_blocks_only_when_aligned() {
    let mut rng = Rng(47);
    let cases = gguf_block_cases(&mut rng, 4, 3);
    for case in &cases {
        let w = &case.matrix;
        let full = w.to_f32();
        for range in [256..512, 0..768, 128..384, 32..256] {
            let part = w.select_cols(range.clone());
            let unit = case.block_values;
            let aligned = range.start % unit == 0 && range.end % unit == 0;
            assert_eq!(part.is_quantized(), aligned, "{} {range:?}", case.name);
            let want: Vec<f32> = (0..w.rows)
                .flat_map(|r| full[r * w.cols + range.start..r * w.cols + range.end].to_vec())
                .collect();
            assert_eq!(part.to_f32(), want, "{} {range:?}", case.name);
        }
        let rows = w.select_rows(1..3);
        assert_eq!(rows.to_f32(), full[w.cols..3 * w.cols], "{}", case.name);
    }
}

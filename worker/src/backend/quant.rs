//! Block-quantised number formats and their scalar reference kernels.
//!
//! Weight blocks follow the GGUF layouts bit for bit, so a file's blocks are used as stored.
//! Activations are quantised per token into [`BlockQ8Act`] (int8, one scale per 32 values)
//! right before a quantised matrix multiply. Every SIMD kernel of these formats is tested
//! against the scalar functions here (the float kernels' references are in `scalar.rs`).

use half::f16;

/// Values per quantisation block in every block format.
pub const QK: usize = 32;

/// Weight rows the grouped matmul kernels compute together (one SIMD lane per row).
pub const GROUP_ROWS: usize = 8;

/// GGUF `Q4_0`: value = (q − 8) · d, q in 0..16. Low nibbles hold elements 0..16, high 16..32.
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; QK / 2],
}

/// GGUF `Q4_1`: value = q · d + m, q in 0..16. Nibble order as in [`BlockQ4_0`].
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; QK / 2],
}

/// GGUF `Q8_0`: value = q · d, q in −127..=127. Also the int8 per-group symmetric format
/// the backend quantises f32/f16 weights into.
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK],
}

/// GGUF `Q5_0`: value = (q − 16) · d, q in 0..32: the low four bits packed as in
/// [`BlockQ4_0`], and bit `i` of `qh` (little-endian) the fifth bit of value `i`. llama.cpp
/// stores the matrices of k-quant files whose rows are not a multiple of 256 (all but
/// `ffn_down` in SmolLM2's `Q4_K_M`) in this format.
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ5_0 {
    pub d: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

/// GGUF `Q5_1`: value = q · d + m, q in 0..32, bits as in [`BlockQ5_0`] (the fallback of
/// `Q5_K_M` files).
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

/// The quantised values 0..32 of a `Q5_0`/`Q5_1` block in order.
pub fn q5_values(qh: &[u8; 4], qs: &[u8; QK / 2]) -> [u8; QK] {
    let qh = u32::from_le_bytes(*qh);
    let mut q = [0u8; QK];
    for (j, &byte) in qs.iter().enumerate() {
        q[j] = (byte & 0x0f) | (((qh >> j) & 1) << 4) as u8;
        q[j + QK / 2] = (byte >> 4) | (((qh >> (j + QK / 2)) & 1) << 4) as u8;
    }
    q
}

/// A quantised activation block: value = q · d; `s` = d · Σq, which the `Q4_1` dot product
/// needs for the weight offsets.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C, align(8))]
pub struct BlockQ8Act {
    pub d: f32,
    pub s: f32,
    /// Σq, which lets a kernel that shifts signed weights to unsigned bytes take the
    /// shift back out exactly.
    pub sum: i32,
    /// Σq of the first 16 values: `Q6_K`'s sub-blocks are 16 values, and its kernels take
    /// each half's shift back out.
    pub low_sum: i32,
    pub qs: [i8; QK],
}

impl Default for BlockQ8Act {
    fn default() -> Self {
        Self {
            d: 0.0,
            s: 0.0,
            sum: 0,
            low_sum: 0,
            qs: [0; QK],
        }
    }
}

/// Byte size of one block of each GGUF block format.
pub const Q4_0_BYTES: usize = 18;
pub const Q4_1_BYTES: usize = 20;
pub const Q8_0_BYTES: usize = 34;
pub const Q5_0_BYTES: usize = 22;
pub const Q5_1_BYTES: usize = 24;

/// An f16 field's GGUF bytes.
pub(crate) fn le(x: f16) -> [u8; 2] {
    x.to_bits().to_le_bytes()
}

fn f16_at(b: &[u8], at: usize) -> f16 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Parses consecutive GGUF `Q4_0` blocks; `bytes.len()` must be a multiple of the block size.
pub fn parse_q4_0(bytes: &[u8]) -> Vec<BlockQ4_0> {
    bytes
        .chunks_exact(Q4_0_BYTES)
        .map(|b| {
            let mut qs = [0u8; QK / 2];
            qs.copy_from_slice(&b[2..18]);
            BlockQ4_0 {
                d: f16_at(b, 0),
                qs,
            }
        })
        .collect()
}

pub fn parse_q4_1(bytes: &[u8]) -> Vec<BlockQ4_1> {
    bytes
        .chunks_exact(Q4_1_BYTES)
        .map(|b| {
            let mut qs = [0u8; QK / 2];
            qs.copy_from_slice(&b[4..20]);
            BlockQ4_1 {
                d: f16_at(b, 0),
                m: f16_at(b, 2),
                qs,
            }
        })
        .collect()
}

pub fn parse_q8_0(bytes: &[u8]) -> Vec<BlockQ8_0> {
    bytes
        .chunks_exact(Q8_0_BYTES)
        .map(|b| {
            let mut qs = [0i8; QK];
            for (q, &byte) in qs.iter_mut().zip(&b[2..34]) {
                *q = byte as i8;
            }
            BlockQ8_0 {
                d: f16_at(b, 0),
                qs,
            }
        })
        .collect()
}

pub fn parse_q5_0(bytes: &[u8]) -> Vec<BlockQ5_0> {
    bytes
        .chunks_exact(Q5_0_BYTES)
        .map(|b| BlockQ5_0 {
            d: f16_at(b, 0),
            qh: b[2..6].try_into().expect("4 bytes"),
            qs: b[6..22].try_into().expect("16 bytes"),
        })
        .collect()
}

pub fn parse_q5_1(bytes: &[u8]) -> Vec<BlockQ5_1> {
    bytes
        .chunks_exact(Q5_1_BYTES)
        .map(|b| BlockQ5_1 {
            d: f16_at(b, 0),
            m: f16_at(b, 2),
            qh: b[4..8].try_into().expect("4 bytes"),
            qs: b[8..24].try_into().expect("16 bytes"),
        })
        .collect()
}

/// Serialises blocks back to their GGUF bytes (used when writing test models).
pub fn q4_0_bytes(blocks: &[BlockQ4_0]) -> Vec<u8> {
    blocks
        .iter()
        .flat_map(|b| [&le(b.d)[..], &b.qs].concat())
        .collect()
}

pub fn q4_1_bytes(blocks: &[BlockQ4_1]) -> Vec<u8> {
    blocks
        .iter()
        .flat_map(|b| [&le(b.d)[..], &le(b.m), &b.qs].concat())
        .collect()
}

pub fn q5_0_bytes(blocks: &[BlockQ5_0]) -> Vec<u8> {
    blocks
        .iter()
        .flat_map(|b| [&le(b.d)[..], &b.qh, &b.qs].concat())
        .collect()
}

pub fn q5_1_bytes(blocks: &[BlockQ5_1]) -> Vec<u8> {
    blocks
        .iter()
        .flat_map(|b| [&le(b.d)[..], &le(b.m), &b.qh, &b.qs].concat())
        .collect()
}

pub fn q8_0_bytes(blocks: &[BlockQ8_0]) -> Vec<u8> {
    blocks
        .iter()
        .flat_map(|b| [&le(b.d)[..], bytemuck::cast_slice(&b.qs)].concat())
        .collect()
}

pub fn dequantize_q4_0(blocks: &[BlockQ4_0], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for i in 0..QK / 2 {
            o[i] = ((b.qs[i] & 0x0f) as i32 - 8) as f32 * d;
            o[i + QK / 2] = ((b.qs[i] >> 4) as i32 - 8) as f32 * d;
        }
    }
}

pub fn dequantize_q4_1(blocks: &[BlockQ4_1], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        let m = b.m.to_f32();
        for i in 0..QK / 2 {
            o[i] = (b.qs[i] & 0x0f) as f32 * d + m;
            o[i + QK / 2] = (b.qs[i] >> 4) as f32 * d + m;
        }
    }
}

pub fn dequantize_q8_0(blocks: &[BlockQ8_0], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for (o, &q) in o.iter_mut().zip(&b.qs) {
            *o = q as f32 * d;
        }
    }
}

/// As ggml computes it: the integer q − 16 times d.
pub fn dequantize_q5_0(blocks: &[BlockQ5_0], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for (o, q) in o.iter_mut().zip(q5_values(&b.qh, &b.qs)) {
            *o = (q as i32 - 16) as f32 * d;
        }
    }
}

pub fn dequantize_q5_1(blocks: &[BlockQ5_1], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let (d, m) = (b.d.to_f32(), b.m.to_f32());
        for (o, q) in o.iter_mut().zip(q5_values(&b.qh, &b.qs)) {
            *o = q as f32 * d + m;
        }
    }
}

/// Symmetric int8 per group of 32 (the `Q8_0` format). `x.len()` must be a multiple of 32.
pub fn quantize_q8_0(x: &[f32]) -> Vec<BlockQ8_0> {
    x.chunks_exact(QK)
        .map(|c| {
            let amax = c.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut qs = [0i8; QK];
            for (q, &v) in qs.iter_mut().zip(c) {
                *q = (v * inv).round().clamp(-127.0, 127.0) as i8;
            }
            BlockQ8_0 {
                d: f16::from_f32(d),
                qs,
            }
        })
        .collect()
}

/// Asymmetric 4-bit per group of 32, as llama.cpp's reference quantiser.
pub fn quantize_q4_1(x: &[f32]) -> Vec<BlockQ4_1> {
    x.chunks_exact(QK)
        .map(|c| {
            let min = c.iter().copied().fold(f32::INFINITY, f32::min);
            let max = c.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let d = (max - min) / 15.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            let q = |v: f32| ((v - min) * inv).round().clamp(0.0, 15.0) as u8;
            let mut qs = [0u8; QK / 2];
            for i in 0..QK / 2 {
                qs[i] = q(c[i]) | (q(c[i + QK / 2]) << 4);
            }
            BlockQ4_1 {
                d: f16::from_f32(d),
                m: f16::from_f32(min),
                qs,
            }
        })
        .collect()
}

/// Symmetric 4-bit per group of 32, as llama.cpp's reference quantiser.
pub fn quantize_q4_0(x: &[f32]) -> Vec<BlockQ4_0> {
    x.chunks_exact(QK)
        .map(|c| {
            let max = c
                .iter()
                .copied()
                .fold(0f32, |m, v| if v.abs() > m.abs() { v } else { m });
            let d = max / -8.0;
            let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
            let q = |v: f32| (v * inv + 8.5).clamp(0.0, 15.0) as u8;
            let mut qs = [0u8; QK / 2];
            for i in 0..QK / 2 {
                qs[i] = q(c[i]) | (q(c[i + QK / 2]) << 4);
            }
            BlockQ4_0 {
                d: f16::from_f32(d),
                qs,
            }
        })
        .collect()
}

/// Scalar reference: quantises one activation row (length a multiple of 32).
pub fn quantize_act_scalar(x: &[f32], out: &mut [BlockQ8Act]) {
    for (c, b) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = c.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        for (q, &v) in b.qs.iter_mut().zip(c) {
            // Half away from zero, spelled so the SIMD kernel can match it bit for bit.
            let scaled = v * inv;
            *q = (scaled + 0.5f32.copysign(scaled)).trunc() as i8;
        }
        let sum_of = |q: &[i8]| q.iter().map(|&q| q as i32).sum::<i32>();
        let sum = sum_of(&b.qs);
        b.d = d;
        b.s = d * sum as f32;
        b.sum = sum;
        b.low_sum = sum_of(&b.qs[..QK / 2]);
    }
}

pub fn dot_q4_0_scalar(w: &[BlockQ4_0], x: &[BlockQ8Act]) -> f32 {
    let mut acc = 0f32;
    for (w, x) in w.iter().zip(x) {
        let mut sum = 0i32;
        for i in 0..QK / 2 {
            sum += ((w.qs[i] & 0x0f) as i32 - 8) * x.qs[i] as i32;
            sum += ((w.qs[i] >> 4) as i32 - 8) * x.qs[i + QK / 2] as i32;
        }
        acc += w.d.to_f32() * x.d * sum as f32;
    }
    acc
}

pub fn dot_q4_1_scalar(w: &[BlockQ4_1], x: &[BlockQ8Act]) -> f32 {
    let mut acc = 0f32;
    for (w, x) in w.iter().zip(x) {
        let mut sum = 0i32;
        for i in 0..QK / 2 {
            sum += (w.qs[i] & 0x0f) as i32 * x.qs[i] as i32;
            sum += (w.qs[i] >> 4) as i32 * x.qs[i + QK / 2] as i32;
        }
        acc += w.d.to_f32() * x.d * sum as f32 + w.m.to_f32() * x.s;
    }
    acc
}

pub fn dot_q8_0_scalar(w: &[BlockQ8_0], x: &[BlockQ8Act]) -> f32 {
    let mut acc = 0f32;
    for (w, x) in w.iter().zip(x) {
        let sum: i32 =
            w.qs.iter()
                .zip(&x.qs)
                .map(|(&a, &b)| a as i32 * b as i32)
                .sum();
        acc += w.d.to_f32() * x.d * sum as f32;
    }
    acc
}

fn dot_q5_i32(q: [u8; QK], x: &[i8; QK]) -> i32 {
    q.iter().zip(x).map(|(&q, &x)| q as i32 * x as i32).sum()
}

/// Σ (q − 16)·x is taken as Σ q·x − 16·Σx, both exact in integers.
pub fn dot_q5_0_scalar(w: &[BlockQ5_0], x: &[BlockQ8Act]) -> f32 {
    let mut acc = 0f32;
    for (w, x) in w.iter().zip(x) {
        let sum = dot_q5_i32(q5_values(&w.qh, &w.qs), &x.qs) - 16 * x.sum;
        acc += w.d.to_f32() * x.d * sum as f32;
    }
    acc
}

pub fn dot_q5_1_scalar(w: &[BlockQ5_1], x: &[BlockQ8Act]) -> f32 {
    let mut acc = 0f32;
    for (w, x) in w.iter().zip(x) {
        let sum = dot_q5_i32(q5_values(&w.qh, &w.qs), &x.qs);
        acc += w.d.to_f32() * x.d * sum as f32 + w.m.to_f32() * x.s;
    }
    acc
}

/// The [`GROUP_ROWS`] weight rows a grouped kernel reads together: row `r` of the group
/// starts `r · stride` rows into `blocks`, and each row is `row_blocks` blocks long. For a
/// small batch over a large matrix `CpuBackend` spaces a group's rows an eighth of the
/// matrix apart; otherwise they are adjacent.
#[derive(Clone, Copy)]
pub struct WeightGroup<'a, B> {
    blocks: &'a [B],
    row_blocks: usize,
    stride: usize,
}

impl<'a, B> WeightGroup<'a, B> {
    /// # Panics
    /// If `blocks` ends before the group's last row does.
    pub fn new(blocks: &'a [B], row_blocks: usize, stride: usize) -> Self {
        let end = ((GROUP_ROWS - 1) * stride + 1) * row_blocks;
        assert!(
            blocks.len() >= end,
            "a group of {GROUP_ROWS} rows of {row_blocks} blocks, {stride} rows apart, needs \
             {end} blocks; {} given",
            blocks.len()
        );
        WeightGroup {
            blocks,
            row_blocks,
            stride,
        }
    }

    /// `GROUP_ROWS` rows stored one after another.
    pub fn adjacent(blocks: &'a [B]) -> Self {
        Self::new(blocks, blocks.len() / GROUP_ROWS, 1)
    }

    pub fn row_blocks(&self) -> usize {
        self.row_blocks
    }

    pub fn row(&self, r: usize) -> &'a [B] {
        &self.blocks[r * self.stride * self.row_blocks..][..self.row_blocks]
    }

    /// The group's blocks, when its rows are stored one after another.
    pub fn contiguous(&self) -> Option<&'a [B]> {
        (self.stride == 1).then(|| &self.blocks[..GROUP_ROWS * self.row_blocks])
    }

    /// Block `b` of each row.
    #[inline(always)]
    pub fn column(&self, b: usize) -> [&'a B; GROUP_ROWS] {
        let step = self.stride * self.row_blocks;
        std::array::from_fn(|r| &self.blocks[r * step + b])
    }
}

/// Scalar reference of the grouped kernels: `out[j][r]` = row `r` of the group `w` ·
/// activation row `j` of `x`, for `out.len()` activation rows of `w.row_blocks()` blocks
/// each.
pub fn gemm_q4_1_group_scalar(
    w: WeightGroup<'_, BlockQ4_1>,
    x: &[BlockQ8Act],
    out: &mut [[f32; GROUP_ROWS]],
) {
    gemm_group_scalar(w, x, out, 1, dot_q4_1_scalar)
}

/// As [`gemm_q4_1_group_scalar`]; the SIMD kernels take Σ (q − 8)·x as Σ q·x − 8·Σx in
/// integers and then repeat this arithmetic lane by lane, unfused, so they equal it bit for
/// bit.
pub fn gemm_q4_0_group_scalar(
    w: WeightGroup<'_, BlockQ4_0>,
    x: &[BlockQ8Act],
    out: &mut [[f32; GROUP_ROWS]],
) {
    gemm_group_scalar(w, x, out, 1, dot_q4_0_scalar)
}

pub fn gemm_q8_0_group_scalar(
    w: WeightGroup<'_, BlockQ8_0>,
    x: &[BlockQ8Act],
    out: &mut [[f32; GROUP_ROWS]],
) {
    gemm_group_scalar(w, x, out, 1, dot_q8_0_scalar)
}

/// As [`gemm_q4_1_group_scalar`]; the SIMD kernels of both 5-bit formats repeat this
/// arithmetic lane by lane, unfused, so they equal it bit for bit.
pub fn gemm_q5_0_group_scalar(
    w: WeightGroup<'_, BlockQ5_0>,
    x: &[BlockQ8Act],
    out: &mut [[f32; GROUP_ROWS]],
) {
    gemm_group_scalar(w, x, out, 1, dot_q5_0_scalar)
}

pub fn gemm_q5_1_group_scalar(
    w: WeightGroup<'_, BlockQ5_1>,
    x: &[BlockQ8Act],
    out: &mut [[f32; GROUP_ROWS]],
) {
    gemm_group_scalar(w, x, out, 1, dot_q5_1_scalar)
}

/// Every row of the group · every activation row, one `dot` each; a weight block spans
/// `acts_per_block` activation blocks.
pub(super) fn gemm_group_scalar<B>(
    w: WeightGroup<'_, B>,
    x: &[BlockQ8Act],
    out: &mut [[f32; GROUP_ROWS]],
    acts_per_block: usize,
    dot: fn(&[B], &[BlockQ8Act]) -> f32,
) {
    let nb = w.row_blocks();
    if nb == 0 {
        out.fill([0.0; GROUP_ROWS]);
        return;
    }
    for (o, x) in out.iter_mut().zip(x.chunks_exact(nb * acts_per_block)) {
        for (r, o) in o.iter_mut().enumerate() {
            *o = dot(w.row(r), x);
        }
    }
}

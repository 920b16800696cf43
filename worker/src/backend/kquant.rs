//! The GGUF "k-quant" formats `Q4_K`, `Q5_K` and `Q6_K` and their scalar reference kernels.
//!
//! A super-block holds [`QK_K`] = 256 values in sub-blocks with their own scale (and, for
//! `Q4_K`/`Q5_K`, their own minimum), stored as in ggml bit for bit. `Q4_K`/`Q5_K`
//! sub-blocks are 32 values, so each lines up with one [`BlockQ8Act`]; `Q6_K` sub-blocks are
//! 16 values, two per activation block.

use half::f16;

use super::quant::{BlockQ8Act, GROUP_ROWS, QK, WeightGroup, gemm_group_scalar, le};

/// Values per super-block.
pub const QK_K: usize = 256;
/// Activation blocks per super-block.
pub const ACT_BLOCKS: usize = QK_K / QK;

pub const Q4_K_BYTES: usize = 144;
pub const Q5_K_BYTES: usize = 176;
pub const Q6_K_BYTES: usize = 210;

/// GGUF `Q4_K`: value `i` of sub-block `j` = d·sc_j·q − dmin·m_j, q in 0..16, with the
/// 6-bit (sc_j, m_j) packed in `scales` ([`scale_min_k4`]). Each 32 bytes of `qs` hold
/// two sub-blocks: the low nibbles the first, the high nibbles the second.
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qs: [u8; 128],
}

/// GGUF `Q5_K`: as [`BlockQ4K`] with q in 0..32; bit `j` of `qh[i]` is the fifth bit of
/// value `i` of sub-block `j`.
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qh: [u8; 32],
    pub qs: [u8; 128],
}

/// GGUF `Q6_K`: value `v` = d·scales[v / 16]·(q − 32), q in 0..64: four low bits in `ql`,
/// two high bits in `qh` (layout in [`q6_k_values`]).
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct BlockQ6K {
    pub ql: [u8; 128],
    pub qh: [u8; 64],
    pub scales: [i8; 16],
    pub d: f16,
}

fn f16_at(b: &[u8], at: usize) -> f16 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]]))
}

fn array<const N: usize>(b: &[u8]) -> [u8; N] {
    b[..N].try_into().expect("slice of N bytes")
}

/// Parses consecutive `Q4_K` blocks; `bytes.len()` must be a multiple of the block size.
pub fn parse_q4_k(bytes: &[u8]) -> Vec<BlockQ4K> {
    bytes
        .chunks_exact(Q4_K_BYTES)
        .map(|b| BlockQ4K {
            d: f16_at(b, 0),
            dmin: f16_at(b, 2),
            scales: array(&b[4..]),
            qs: array(&b[16..]),
        })
        .collect()
}

pub fn parse_q5_k(bytes: &[u8]) -> Vec<BlockQ5K> {
    bytes
        .chunks_exact(Q5_K_BYTES)
        .map(|b| BlockQ5K {
            d: f16_at(b, 0),
            dmin: f16_at(b, 2),
            scales: array(&b[4..]),
            qh: array(&b[16..]),
            qs: array(&b[48..]),
        })
        .collect()
}

pub fn parse_q6_k(bytes: &[u8]) -> Vec<BlockQ6K> {
    bytes
        .chunks_exact(Q6_K_BYTES)
        .map(|b| BlockQ6K {
            ql: array(b),
            qh: array(&b[128..]),
            scales: array::<16>(&b[192..]).map(|s| s as i8),
            d: f16_at(b, 208),
        })
        .collect()
}

/// Serialises blocks back to their GGUF bytes (used when writing test models).
pub fn q4_k_bytes(blocks: &[BlockQ4K]) -> Vec<u8> {
    blocks
        .iter()
        .flat_map(|b| [&le(b.d)[..], &le(b.dmin), &b.scales, &b.qs].concat())
        .collect()
}

pub fn q5_k_bytes(blocks: &[BlockQ5K]) -> Vec<u8> {
    blocks
        .iter()
        .flat_map(|b| [&le(b.d)[..], &le(b.dmin), &b.scales, &b.qh, &b.qs].concat())
        .collect()
}

pub fn q6_k_bytes(blocks: &[BlockQ6K]) -> Vec<u8> {
    blocks
        .iter()
        .flat_map(|b| [&b.ql[..], &b.qh, bytemuck::cast_slice(&b.scales), &le(b.d)].concat())
        .collect()
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and minimum of sub-block `j` (0..8). The
/// first four pairs are the low six bits of bytes 0..4 and 4..8; the last four take their
/// low four bits from bytes 8..12 and their top two from the spare bits of bytes 0..8.
#[inline]
pub fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The quantised values 0..16 of a `Q4_K` super-block in order.
pub fn q4_k_values(b: &BlockQ4K) -> [u8; QK_K] {
    let mut q = [0u8; QK_K];
    for (q, qs) in q.chunks_exact_mut(64).zip(b.qs.chunks_exact(32)) {
        for l in 0..32 {
            q[l] = qs[l] & 0x0f;
            q[l + 32] = qs[l] >> 4;
        }
    }
    q
}

/// The quantised values 0..32 of a `Q5_K` super-block in order.
pub fn q5_k_values(b: &BlockQ5K) -> [u8; QK_K] {
    let mut q = [0u8; QK_K];
    for (i, (q, qs)) in q
        .chunks_exact_mut(64)
        .zip(b.qs.chunks_exact(32))
        .enumerate()
    {
        for l in 0..32 {
            q[l] = (qs[l] & 0x0f) | (((b.qh[l] >> (2 * i)) & 1) << 4);
            q[l + 32] = (qs[l] >> 4) | (((b.qh[l] >> (2 * i + 1)) & 1) << 4);
        }
    }
    q
}

/// The quantised values of a `Q6_K` super-block in order, already shifted to −32..32.
/// Each half of 128 values reads 64 bytes of `ql` and 32 of `qh`: value `32p + l` of the
/// half takes the low (p < 2) or high nibble of `ql[l + 32·(p mod 2)]` and bits 2p, 2p + 1
/// of `qh[l]`.
pub fn q6_k_values(b: &BlockQ6K) -> [i8; QK_K] {
    let mut q = [0i8; QK_K];
    for (half, q) in q.chunks_exact_mut(128).enumerate() {
        let (ql, qh) = (&b.ql[64 * half..], &b.qh[32 * half..]);
        for p in 0..4 {
            for l in 0..32 {
                let low = (ql[l + 32 * (p % 2)] >> (4 * (p / 2))) & 0x0f;
                let high = (qh[l] >> (2 * p)) & 3;
                q[32 * p + l] = (low | (high << 4)) as i8 - 32;
            }
        }
    }
    q
}

/// The per-sub-block f32 scale and minimum of a `Q4_K`/`Q5_K` block, as ggml computes them.
#[inline]
pub fn scales_mins(d: f16, dmin: f16, scales: &[u8; 12]) -> [(f32, f32); ACT_BLOCKS] {
    let (d, dmin) = (d.to_f32(), dmin.to_f32());
    std::array::from_fn(|j| {
        let (sc, m) = scale_min_k4(j, scales);
        (d * sc as f32, dmin * m as f32)
    })
}

fn dequantize_min_form(q: &[u8; QK_K], sm: &[(f32, f32); ACT_BLOCKS], out: &mut [f32]) {
    for ((o, q), &(d, m)) in out.chunks_exact_mut(QK).zip(q.chunks_exact(QK)).zip(sm) {
        for (o, &q) in o.iter_mut().zip(q) {
            *o = d * q as f32 - m;
        }
    }
}

pub fn dequantize_q4_k(blocks: &[BlockQ4K], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        dequantize_min_form(&q4_k_values(b), &scales_mins(b.d, b.dmin, &b.scales), o);
    }
}

pub fn dequantize_q5_k(blocks: &[BlockQ5K], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        dequantize_min_form(&q5_k_values(b), &scales_mins(b.d, b.dmin, &b.scales), o);
    }
}

pub fn dequantize_q6_k(blocks: &[BlockQ6K], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        for ((o, q), &sc) in o
            .chunks_exact_mut(16)
            .zip(q6_k_values(b).chunks_exact(16))
            .zip(&b.scales)
        {
            let scale = d * sc as f32;
            for (o, &q) in o.iter_mut().zip(q) {
                *o = scale * q as f32;
            }
        }
    }
}

fn dot_i8<T: Copy + Into<i32>>(w: &[T], x: &[i8]) -> i32 {
    w.iter().zip(x).map(|(&w, &x)| w.into() * x as i32).sum()
}

/// Adds (d·sc_j)·dx_j·Σ(q·qx) − (dmin·m_j)·s_j of every sub-block j to `acc`, one activation
/// block per sub-block. One running sum over the row, without fused multiply-adds: the SIMD
/// kernels compute the same lane by lane.
fn dot_min_form(q: &[u8; QK_K], sm: &[(f32, f32); ACT_BLOCKS], x: &[BlockQ8Act], acc: &mut f32) {
    for ((q, &(d, m)), x) in q.chunks_exact(QK).zip(sm).zip(x) {
        *acc += d * x.d * dot_i8(q, &x.qs) as f32 - m * x.s;
    }
}

/// `w`: one row of super-blocks; `x`: the row's [`ACT_BLOCKS`] activation blocks per
/// super-block.
pub fn dot_q4_k_scalar(w: &[BlockQ4K], x: &[BlockQ8Act]) -> f32 {
    let mut acc = 0f32;
    for (b, x) in w.iter().zip(x.chunks_exact(ACT_BLOCKS)) {
        let sm = scales_mins(b.d, b.dmin, &b.scales);
        dot_min_form(&q4_k_values(b), &sm, x, &mut acc);
    }
    acc
}

pub fn dot_q5_k_scalar(w: &[BlockQ5K], x: &[BlockQ8Act]) -> f32 {
    let mut acc = 0f32;
    for (b, x) in w.iter().zip(x.chunks_exact(ACT_BLOCKS)) {
        let sm = scales_mins(b.d, b.dmin, &b.scales);
        dot_min_form(&q5_k_values(b), &sm, x, &mut acc);
    }
    acc
}

/// Each activation block meets two 16-value sub-blocks: their integer sums are weighted by
/// their scales in integers (|sc·Σ| < 2²⁰), then scaled by d·dx once.
pub fn dot_q6_k_scalar(w: &[BlockQ6K], x: &[BlockQ8Act]) -> f32 {
    let mut acc = 0f32;
    for (b, x) in w.iter().zip(x.chunks_exact(ACT_BLOCKS)) {
        let q = q6_k_values(b);
        let d = b.d.to_f32();
        for (j, (q, x)) in q.chunks_exact(QK).zip(x).enumerate() {
            let lo = dot_i8(&q[..16], &x.qs[..16]) * b.scales[2 * j] as i32;
            let hi = dot_i8(&q[16..], &x.qs[16..]) * b.scales[2 * j + 1] as i32;
            acc += d * x.d * (lo + hi) as f32;
        }
    }
    acc
}

/// Scalar reference of the grouped kernels (as `quant::gemm_q4_1_group_scalar`): `w` is
/// [`GROUP_ROWS`] rows of super-blocks, `x` holds `out.len()` activation rows of
/// [`ACT_BLOCKS`] blocks per super-block.
pub fn gemm_q4_k_group_scalar(
    w: WeightGroup<'_, BlockQ4K>,
    x: &[BlockQ8Act],
    out: &mut [[f32; GROUP_ROWS]],
) {
    gemm_group_scalar(w, x, out, ACT_BLOCKS, dot_q4_k_scalar)
}

pub fn gemm_q5_k_group_scalar(
    w: WeightGroup<'_, BlockQ5K>,
    x: &[BlockQ8Act],
    out: &mut [[f32; GROUP_ROWS]],
) {
    gemm_group_scalar(w, x, out, ACT_BLOCKS, dot_q5_k_scalar)
}

pub fn gemm_q6_k_group_scalar(
    w: WeightGroup<'_, BlockQ6K>,
    x: &[BlockQ8Act],
    out: &mut [[f32; GROUP_ROWS]],
) {
    gemm_group_scalar(w, x, out, ACT_BLOCKS, dot_q6_k_scalar)
}

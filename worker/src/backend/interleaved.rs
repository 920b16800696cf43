//! `Q4_K` and `Q6_K` matrices repacked once at load for the grouped kernels: each
//! super-block column of a group of [`GROUP_ROWS`] adjacent rows is stored as the vectors the
//! kernels multiply, so a pass loads them instead of gathering and transposing eight rows'
//! blocks every time, and a group is one sequential stream (batch-1 decode of the 7B shape on
//! a 2-core EPYC: 7.2 tok/s before, 9.4 to 10.3 after; `worker/bench/README.md`). The bytes
//! are the eight blocks' own, moved: the values, and every result, are unchanged.
//!
//! The rule, for a block of `S` bytes: its 4-byte word `v` (bytes `4v..4v + 4`) of row `r`
//! goes to bytes `32v + 4r..32v + 4r + 4` of the column, so 32 bytes of the column are one
//! 256-bit vector with row `r` in lane `r`; the `S mod 4` bytes left over (`Q6_K`'s f16
//! scale) follow, row after row.

use std::ops::Range;

use bytemuck::{Pod, Zeroable};
use half::f16;
use rayon::prelude::*;

use super::kquant::{
    BlockQ4K, BlockQ6K, QK_K, dequantize_q4_k, dequantize_q6_k, gemm_q4_k_group_scalar,
    gemm_q6_k_group_scalar,
};
use super::quant::{BlockQ8Act, GROUP_ROWS, WeightGroup};

/// Bytes of a 256-bit vector; each of its eight 32-bit lanes holds one row's four bytes.
const VECTOR: usize = 32;

/// One super-block column of eight `Q4_K` rows: four vectors of the rows' first 16 bytes
/// (d, dmin, the packed scales), then 32 of their quants.
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4Kx8 {
    pub heads: [u8; 4 * VECTOR],
    pub qs: [u8; 32 * VECTOR],
}

/// One super-block column of eight `Q6_K` rows: 32 vectors of the low bits, 16 of the high
/// bits, four of the sub-block scales, then each row's d.
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ6Kx8 {
    pub ql: [u8; 32 * VECTOR],
    pub qh: [u8; 16 * VECTOR],
    pub scales: [u8; 4 * VECTOR],
    pub d: [f16; GROUP_ROWS],
}

/// A block format stored interleaved, and its column type.
pub trait Interleave: Pod {
    type Column: Pod;
    /// The scalar reference the interleaved kernels equal bit for bit.
    const GEMM_SCALAR: fn(WeightGroup<'_, Self>, &[BlockQ8Act], &mut [[f32; GROUP_ROWS]]);
    const DEQUANTIZE: fn(&[Self], &mut [f32]);
}

impl Interleave for BlockQ4K {
    type Column = BlockQ4Kx8;
    const GEMM_SCALAR: fn(WeightGroup<'_, Self>, &[BlockQ8Act], &mut [[f32; GROUP_ROWS]]) =
        gemm_q4_k_group_scalar;
    const DEQUANTIZE: fn(&[Self], &mut [f32]) = dequantize_q4_k;
}

impl Interleave for BlockQ6K {
    type Column = BlockQ6Kx8;
    const GEMM_SCALAR: fn(WeightGroup<'_, Self>, &[BlockQ8Act], &mut [[f32; GROUP_ROWS]]) =
        gemm_q6_k_group_scalar;
    const DEQUANTIZE: fn(&[Self], &mut [f32]) = dequantize_q6_k;
}

const _: () = assert!(size_of::<BlockQ4Kx8>() == GROUP_ROWS * size_of::<BlockQ4K>());
const _: () = assert!(size_of::<BlockQ6Kx8>() == GROUP_ROWS * size_of::<BlockQ6K>());

/// Where the bytes left after row `r`'s whole words (`tail` of them) sit in a column of
/// `words` vectors.
fn tail_at(words: usize, tail: usize, r: usize) -> usize {
    words * VECTOR + tail * r
}

/// Writes the column of block `rows[r]` for each row `r` into `column`.
fn interleave<B: Interleave>(rows: [&B; GROUP_ROWS], column: &mut B::Column) {
    let out = bytemuck::bytes_of_mut(column);
    for (r, block) in rows.into_iter().enumerate() {
        let (words, tail) = bytemuck::bytes_of(block).as_chunks::<4>();
        for (v, word) in words.iter().enumerate() {
            *out[v * VECTOR + 4 * r..]
                .first_chunk_mut::<4>()
                .expect("in the column") = *word;
        }
        let at = tail_at(words.len(), tail.len(), r);
        out[at..at + tail.len()].copy_from_slice(tail);
    }
}

/// Row `r`'s block of a column, as it was before [`interleave`].
pub fn block_of<B: Interleave>(column: &B::Column, r: usize) -> B {
    let mut block = B::zeroed();
    let from = bytemuck::bytes_of(column);
    let (words, tail) = bytemuck::bytes_of_mut(&mut block).as_chunks_mut::<4>();
    for (v, word) in words.iter_mut().enumerate() {
        *word = *from[v * VECTOR + 4 * r..]
            .first_chunk::<4>()
            .expect("in the column");
    }
    let at = tail_at(words.len(), tail.len(), r);
    tail.copy_from_slice(&from[at..at + tail.len()]);
    block
}

/// A matrix of `rows` rows (a multiple of [`GROUP_ROWS`]) of `row_blocks` super-blocks,
/// interleaved: group `g`'s columns are `out[g · row_blocks..(g + 1) · row_blocks]`.
pub fn interleave_rows<B: Interleave + Sync>(
    blocks: &[B],
    rows: usize,
    row_blocks: usize,
) -> Vec<B::Column>
where
    B::Column: Send,
{
    assert!(
        rows.is_multiple_of(GROUP_ROWS) && blocks.len() == rows * row_blocks,
        "{rows} rows of {row_blocks} blocks do not make whole groups of {GROUP_ROWS} in {} blocks",
        blocks.len()
    );
    let mut columns = Vec::with_capacity(blocks.len() / GROUP_ROWS);
    if row_blocks > 0 {
        // Each group's columns are written in place, in parallel: a collected iterator
        // would copy the whole matrix once more.
        columns.spare_capacity_mut()[..blocks.len() / GROUP_ROWS]
            .par_chunks_mut(row_blocks)
            .zip(blocks.par_chunks_exact(GROUP_ROWS * row_blocks))
            .for_each(|(out, group)| {
                for (s, out) in out.iter_mut().enumerate() {
                    let column = out.write(B::Column::zeroed());
                    interleave(std::array::from_fn(|r| &group[r * row_blocks + s]), column);
                }
            });
    }
    // SAFETY: the loop above wrote every column of every group.
    unsafe { columns.set_len(blocks.len() / GROUP_ROWS) };
    columns
}

/// Rows `rows` of an interleaved matrix of `row_blocks` super-blocks a row, as plain blocks.
pub fn rows_of<B: Interleave>(
    columns: &[B::Column],
    row_blocks: usize,
    rows: Range<usize>,
) -> Vec<B> {
    rows.flat_map(|r| {
        let group = &columns[r / GROUP_ROWS * row_blocks..][..row_blocks];
        group.iter().map(move |c| block_of(c, r % GROUP_ROWS))
    })
    .collect()
}

/// Row `r` of an interleaved matrix of `row_blocks` super-blocks a row, dequantised.
pub fn dequantize_row<B: Interleave>(
    columns: &[B::Column],
    row_blocks: usize,
    r: usize,
    out: &mut [f32],
) {
    // A block at a time: the float path widens rows tile by tile, so this stays allocation-free.
    let group = &columns[r / GROUP_ROWS * row_blocks..][..row_blocks];
    for (column, out) in group.iter().zip(out.chunks_exact_mut(QK_K)) {
        B::DEQUANTIZE(&[block_of(column, r % GROUP_ROWS)], out);
    }
}

/// The super-block columns of one interleaved group, as the grouped kernels read them.
#[derive(Clone, Copy)]
pub struct InterleavedGroup<'a, C> {
    columns: &'a [C],
}

impl<'a, C> InterleavedGroup<'a, C> {
    pub fn new(columns: &'a [C]) -> Self {
        InterleavedGroup { columns }
    }

    pub fn row_blocks(&self) -> usize {
        self.columns.len()
    }

    #[inline(always)]
    pub fn column(&self, s: usize) -> &'a C {
        &self.columns[s]
    }

    pub fn columns(&self) -> &'a [C] {
        self.columns
    }
}

/// Scalar reference of the interleaved grouped kernels: the group's rows restored and
/// multiplied by the plain format's scalar kernel.
pub fn gemm_group_scalar<B: Interleave>(
    w: InterleavedGroup<'_, B::Column>,
    x: &[BlockQ8Act],
    out: &mut [[f32; GROUP_ROWS]],
) {
    let rows = rows_of::<B>(w.columns, w.row_blocks(), 0..GROUP_ROWS);
    B::GEMM_SCALAR(WeightGroup::adjacent(&rows), x, out)
}

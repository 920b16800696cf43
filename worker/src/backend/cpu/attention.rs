//! The CPU backend's attention: each token's scores against the paged KV cache, their
//! softmax and the weighted sum of values, spread over the pool one block of tokens and kv
//! head per task.

use std::ops::Range;

use rayon::prelude::*;

use super::{Kernels, SharedOut};
use crate::backend::{AttentionChunk, KvData, PagedKv, StridedRows};

/// [`Backend::attention`](crate::backend::Backend::attention) with kernels `k`.
pub(super) fn attention(
    k: &Kernels,
    q: &[f32],
    chunks: &[AttentionChunk<'_>],
    n_heads: usize,
    out: &mut [f32],
) {
    let Some(first) = chunks.first() else { return };
    let (hd, n_kv) = (first.kv.head_dim, first.kv.n_kv_heads);
    assert_eq!(q.len(), out.len(), "attention output shape");
    // Every token of every chunk, prefill or decode, takes the same per-token arithmetic
    // in one parallel pass, one task per block of a chunk's tokens and kv head: a token's
    // attention is then the same bits whether its chunk was long or short, or its prefix
    // came from the cache. A block's tokens score each page of keys together, so the
    // page is transposed once for all of them, and a step pays for one fork-join.
    let blocks: Vec<(usize, Range<usize>)> = chunks
        .iter()
        .enumerate()
        .flat_map(|(i, c)| {
            c.rows
                .clone()
                .step_by(QUERY_BLOCK)
                .map(move |r0| (i, r0..(r0 + QUERY_BLOCK).min(c.rows.end)))
        })
        .collect();
    let shape = AttentionShape {
        row_len: n_heads * hd,
        group: n_heads / n_kv,
        head_dim: hd,
        scale: 1.0 / (hd as f32).sqrt(),
    };
    let shared = SharedOut(out.as_mut_ptr());
    (0..blocks.len() * n_kv).into_par_iter().for_each_init(
        AttentionScratch::default,
        |scratch, task| {
            let ((chunk, rows), kvh) = (&blocks[task / n_kv], task % n_kv);
            let c = &chunks[*chunk];
            // Tokens of the block see the positions up to their own.
            let first_len = c.start_pos + (rows.start - c.rows.start) + 1;
            attend_block(
                k,
                q,
                &c.kv,
                kvh,
                rows.clone(),
                first_len,
                &shape,
                scratch,
                shared,
            );
        },
    );
}

/// Tokens of one chunk scored together against each page of keys.
const QUERY_BLOCK: usize = 16;

struct AttentionShape {
    /// Values of one token's query (and output) row: every head's.
    row_len: usize,
    /// Query heads per kv head.
    group: usize,
    head_dim: usize,
    scale: f32,
}

/// A task's buffers, kept across the tasks a thread runs.
#[derive(Default)]
struct AttentionScratch {
    /// The block's query heads of one kv head, token after token.
    q: Vec<f32>,
    /// One row of scores per query head of the block.
    scores: Vec<f32>,
}

/// The attention of the query heads that share kv head `kvh`, for the tokens in `rows` of
/// one chunk, the first of which sees `first_len` positions (each next one, one more). Keys
/// and values are read page by page, a page's slots of one kv head being evenly spaced;
/// every page's keys are scored for all the heads of the tokens that see it at once.
#[allow(clippy::too_many_arguments)]
fn attend_block(
    k: &Kernels,
    q: &[f32],
    kv: &PagedKv<'_>,
    kvh: usize,
    rows: Range<usize>,
    first_len: usize,
    shape: &AttentionShape,
    scratch: &mut AttentionScratch,
    out: SharedOut,
) {
    let (hd, group) = (shape.head_dim, shape.group);
    let width = group * hd;
    let stride = kv.n_kv_heads * hd;
    let max_len = first_len + rows.len() - 1;
    scratch.q.clear();
    for row in rows.clone() {
        let at = row * shape.row_len + kvh * width;
        scratch.q.extend_from_slice(&q[at..at + width]);
    }
    scratch.scores.resize(rows.len() * group * max_len, 0.0);
    let pages = |len: usize| {
        (0..len).step_by(kv.block_size).map(move |p0| {
            let first = kv.offset(p0, kvh);
            (p0..(p0 + kv.block_size).min(len), first)
        })
    };
    for (range, first) in pages(max_len) {
        // The block's tokens from the first whose prefix reaches this page. A later token's
        // scores past its own position are computed with the rest and never read.
        let t0 = (range.start + 1).saturating_sub(first_len);
        let qs = &scratch.q[t0 * width..];
        let heads = qs.len() / hd;
        let out = &mut scratch.scores[t0 * group * max_len + range.start..];
        match kv.k {
            KvData::F32(keys) => {
                let keys = StridedRows::new(&keys[first..], stride, range.len());
                (k.dot_strided)(qs, heads, keys, shape.scale, out, max_len)
            }
            KvData::F16(keys) => {
                let keys = StridedRows::new(&keys[first..], stride, range.len());
                (k.dot_strided_f16)(qs, heads, keys, shape.scale, out, max_len)
            }
        }
    }
    for (t, row) in rows.enumerate() {
        let len = first_len + t;
        let at = row * shape.row_len + kvh * width;
        // SAFETY: the heads of kv head `kvh` in row `row` are written by this task only,
        // and `at + width ≤ out.len()` since `row` is inside a chunk's rows.
        let o = unsafe { std::slice::from_raw_parts_mut(out.ptr().add(at), width) };
        let scores = &mut scratch.scores[t * group * max_len..(t + 1) * group * max_len];
        for (s, o) in scores.chunks_exact_mut(max_len).zip(o.chunks_exact_mut(hd)) {
            let s = &mut s[..len];
            let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum = (k.exp_sum)(s, max);
            for v in s.iter_mut() {
                *v /= sum;
            }
            o.fill(0.0);
            for (range, first) in pages(len) {
                match kv.v {
                    KvData::F32(values) => (k.axpy_strided)(&s[range], &values[first..], stride, o),
                    KvData::F16(values) => {
                        (k.axpy_strided_f16)(&s[range], &values[first..], stride, o)
                    }
                }
            }
        }
    }
}

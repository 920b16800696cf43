//! The Llama forward pass (and Qwen2's, which adds Q/K/V biases) over a mixed batch: every
//! chunk's tokens are stacked into one `n × dim` activation matrix, so each weight matrix is
//! read once per step for all of them.

use std::ops::Range;

use rayon::prelude::*;

use super::weights::Linear;
use super::{ForwardError, KvCache, Model, SequenceChunk, WeightPrecision};
use crate::backend::{AttentionChunk, Backend};

/// The activations of a forward pass, kept by the caller so that consecutive steps reuse the
/// memory: each buffer grows to the largest step seen and is not freed between steps.
#[derive(Default)]
pub struct StepBuffers {
    x: Vec<f32>,
    xb: Vec<f32>,
    out: Vec<f32>,
    q: Vec<f32>,
    att: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    last: Vec<f32>,
    pub(super) logits: Vec<f32>,
    vocab_size: usize,
}

impl StepBuffers {
    /// The last pass's last-token logits of each chunk with `want_logits`, in batch order.
    pub fn logits(&self) -> std::slice::ChunksExact<'_, f32> {
        self.logits.chunks_exact(self.vocab_size.max(1))
    }
}

/// `buf` as `len` zeros, in the memory it already has when that is enough.
fn zeroed(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    buf.clear();
    buf.resize(len, 0.0);
    buf
}

/// Runs the pass, checking `interrupted` before each layer and before the output head; the
/// logits are left in `buf` (see [`StepBuffers::logits`]).
pub(super) fn forward(
    m: &Model,
    kv: &mut KvCache,
    batch: &[SequenceChunk<'_>],
    buf: &mut StepBuffers,
    interrupted: &(dyn Fn() -> bool + Sync),
) -> Result<(), ForwardError> {
    let (cfg, w, be) = (&m.config, &m.weights, m.backend.as_ref());
    let (dim, hd, eps) = (cfg.dim, cfg.head_dim, cfg.rms_eps);
    let (nh, nkv) = (w.n_heads, w.n_kv_heads);
    let rows = Rows::of(batch);
    let n = rows.positions.len();
    let rotations = Rotations::new(&rows.positions, hd, cfg.rope_theta);
    let ffn = w
        .layers
        .first()
        .map_or(0, |l| l.w_gate.get(WeightPrecision::Full).rows);
    let StepBuffers {
        x,
        xb,
        out,
        q,
        att,
        k,
        v,
        gate,
        up,
        last,
        logits,
        vocab_size,
    } = buf;
    *vocab_size = cfg.vocab_size;
    let x = zeroed(x, n * dim);
    for (row, &tok) in x
        .chunks_exact_mut(dim)
        .zip(batch.iter().flat_map(|c| c.tokens))
    {
        w.token_embd.row_to_f32(tok as usize, row);
    }
    let (xb, out) = (zeroed(xb, n * dim), zeroed(out, n * dim));
    let (q, att) = (zeroed(q, n * nh * hd), zeroed(att, n * nh * hd));
    let (k, v) = (zeroed(k, n * nkv * hd), zeroed(v, n * nkv * hd));
    let (gate, up) = (zeroed(gate, n * ffn), zeroed(up, n * ffn));
    for (l, lw) in w.layers.iter().enumerate() {
        if interrupted() {
            return Err(ForwardError::Interrupted { layers: l });
        }
        rms_norm(x, &lw.attn_norm, eps, xb);
        linear_shared_input(
            be,
            [&lw.wq, &lw.wk, &lw.wv],
            xb,
            &rows.segments,
            [&mut *q, &mut *k, &mut *v],
        );
        for (out, bias) in [(&mut *q, &lw.bq), (&mut *k, &lw.bk), (&mut *v, &lw.bv)] {
            if let Some(bias) = bias {
                add_bias(out, bias);
            }
        }
        rotations.apply(q);
        rotations.apply(k);
        for (c, r) in batch.iter().zip(&rows.chunks) {
            let kv_rows = r.start * nkv * hd..r.end * nkv * hd;
            kv.store(
                l,
                c.block_table,
                c.start_pos,
                &k[kv_rows.clone()],
                &v[kv_rows],
            );
        }
        let chunks: Vec<AttentionChunk<'_>> = batch
            .iter()
            .zip(&rows.chunks)
            .map(|(c, r)| AttentionChunk {
                rows: r.clone(),
                start_pos: c.start_pos,
                kv: kv.paged(l, c.block_table),
            })
            .collect();
        be.attention(q, &chunks, nh, att);
        linear(be, &lw.wo, att, &rows.segments, out);
        m.all_reduce(out)?;
        add(x, out);
        rms_norm(x, &lw.ffn_norm, eps, xb);
        linear_shared_input(
            be,
            [&lw.w_gate, &lw.w_up],
            xb,
            &rows.segments,
            [&mut *gate, &mut *up],
        );
        be.swiglu(gate, up, ffn);
        linear(be, &lw.w_down, gate, &rows.segments, out);
        m.all_reduce(out)?;
        add(x, out);
    }
    if interrupted() {
        return Err(ForwardError::Interrupted {
            layers: w.layers.len(),
        });
    }
    let wanted: Vec<usize> = (0..batch.len()).filter(|&i| batch[i].want_logits).collect();
    let last = zeroed(last, wanted.len() * dim);
    for (dst, &i) in last.chunks_exact_mut(dim).zip(&wanted) {
        let row = rows.chunks[i].end - 1;
        rms_norm(&x[row * dim..(row + 1) * dim], &w.output_norm, eps, dst);
    }
    let head_segments = segments(wanted.iter().map(|&i| (1, batch[i].precision)));
    let logits = zeroed(logits, wanted.len() * cfg.vocab_size);
    linear(be, &w.output, last, &head_segments, logits);
    Ok(())
}

/// Where each chunk's rows sit in the stacked activations.
struct Rows {
    chunks: Vec<Range<usize>>,
    positions: Vec<usize>,
    /// Runs of consecutive rows that share a weight precision.
    segments: Vec<(Range<usize>, WeightPrecision)>,
}

impl Rows {
    fn of(batch: &[SequenceChunk<'_>]) -> Rows {
        let mut chunks = Vec::with_capacity(batch.len());
        let mut positions = Vec::new();
        for c in batch {
            chunks.push(positions.len()..positions.len() + c.tokens.len());
            positions.extend(c.start_pos..c.start_pos + c.tokens.len());
        }
        let segments = segments(batch.iter().map(|c| (c.tokens.len(), c.precision)));
        Rows {
            chunks,
            positions,
            segments,
        }
    }
}

fn segments(
    lens: impl Iterator<Item = (usize, WeightPrecision)>,
) -> Vec<(Range<usize>, WeightPrecision)> {
    let mut out: Vec<(Range<usize>, WeightPrecision)> = Vec::new();
    let mut at = 0;
    for (len, p) in lens {
        match out.last_mut() {
            Some((r, last)) if *last == p => r.end += len,
            _ => out.push((at..at + len, p)),
        }
        at += len;
    }
    out
}

/// `out = x · Wᵀ`, each run of rows with the weights of its precision.
fn linear(
    be: &dyn Backend,
    w: &Linear,
    x: &[f32],
    segments: &[(Range<usize>, WeightPrecision)],
    out: &mut [f32],
) {
    for (r, p) in segments {
        let m = w.get(*p);
        let (x, out) = (
            &x[r.start * m.cols..r.end * m.cols],
            &mut out[r.start * m.rows..r.end * m.rows],
        );
        match p {
            WeightPrecision::Int8 => be.matmul(m, x, r.len(), out),
            WeightPrecision::Full => be.matmul_f32(m, x, r.len(), out),
        }
    }
}

/// Rows per task of the element-wise steps: a decode step's few rows stay on the calling
/// thread, a batch's many rows spread over the pool the forward pass runs in.
const ELEMENTWISE_ROWS: usize = 8;

/// [`linear`] for layers that read the same input, handed to the backend together.
fn linear_shared_input<const L: usize>(
    be: &dyn Backend,
    ws: [&Linear; L],
    x: &[f32],
    segments: &[(Range<usize>, WeightPrecision)],
    mut outs: [&mut [f32]; L],
) {
    let cols = ws.first().map_or(0, |w| w.get(WeightPrecision::Full).cols);
    for (r, p) in segments {
        let ms = ws.map(|w| w.get(*p));
        let mut parts: Vec<&mut [f32]> = outs
            .iter_mut()
            .zip(&ms)
            .map(|(out, m)| &mut out[r.start * m.rows..r.end * m.rows])
            .collect();
        let x = &x[r.start * cols..r.end * cols];
        match p {
            WeightPrecision::Int8 => be.matmul_shared_input(&ms, x, r.len(), &mut parts),
            WeightPrecision::Full => {
                for (m, out) in ms.iter().zip(parts.iter_mut()) {
                    be.matmul_f32(m, x, r.len(), out)
                }
            }
        }
    }
}

fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    x.par_chunks(dim)
        .zip(out.par_chunks_mut(dim))
        .with_min_len(ELEMENTWISE_ROWS)
        .for_each(|(x, o)| {
            let ms = sum_of_squares(x) / dim as f32;
            let scale = 1.0 / (ms + eps).sqrt();
            for ((o, x), w) in o.iter_mut().zip(x).zip(weight) {
                *o = x * scale * w;
            }
        });
}

/// Σ x², in eight running sums so the loop vectorises instead of waiting on one chain of
/// additions.
fn sum_of_squares(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    for chunk in chunks {
        for (s, v) in lanes.iter_mut().zip(chunk) {
            *s += v * v;
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// Rotary embedding on adjacent pairs `(2i, 2i+1)` of every head, frequency θ^(−2i/head_dim).
/// The angles depend only on the positions, so every layer reuses one table.
struct Rotations {
    head_dim: usize,
    /// `(sin, cos)` of pair `i` at row `r`: `[r * head_dim / 2 + i]`.
    sin_cos: Vec<(f32, f32)>,
}

impl Rotations {
    fn new(positions: &[usize], head_dim: usize, theta: f32) -> Rotations {
        let inv_freq: Vec<f32> = (0..head_dim / 2)
            .map(|i| theta.powf(-((2 * i) as f32) / head_dim as f32))
            .collect();
        let sin_cos = positions
            .iter()
            .flat_map(|&pos| inv_freq.iter().map(move |f| (pos as f32 * f).sin_cos()))
            .collect();
        Rotations { head_dim, sin_cos }
    }

    fn apply(&self, x: &mut [f32]) {
        let pairs = self.head_dim / 2;
        let rows = self.sin_cos.len() / pairs.max(1);
        let row_len = (x.len() / rows.max(1)).max(1);
        x.par_chunks_mut(row_len)
            .zip(self.sin_cos.par_chunks(pairs.max(1)))
            .with_min_len(ELEMENTWISE_ROWS)
            .for_each(|(row, rot)| {
                for head in row.chunks_exact_mut(self.head_dim) {
                    for (pair, &(sin, cos)) in head.chunks_exact_mut(2).zip(rot) {
                        let (a, b) = (pair[0], pair[1]);
                        pair[0] = a * cos - b * sin;
                        pair[1] = a * sin + b * cos;
                    }
                }
            });
    }
}

/// Adds `bias` to every row of `x`.
fn add_bias(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        add(row, bias);
    }
}

fn add(x: &mut [f32], y: &[f32]) {
    for (x, y) in x.iter_mut().zip(y) {
        *x += y;
    }
}

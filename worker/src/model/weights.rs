//! The weights as plain structs, loaded from a GGUF file or a Hugging Face safetensors
//! directory, in the storage the precision policy asks for, and sliced for one
//! tensor-parallel rank.
//!
//! Tensor-parallel split (Megatron): Q/K/V and gate/up are column-parallel (each rank keeps
//! its heads' or its FFN slice's output rows), attention-out and down are row-parallel (each
//! rank keeps the matching input columns and the partial sums are all-reduced). Norms,
//! embeddings and the output head are replicated; Q/K/V biases split with their rows.
//!
//! Q/K rows that rotate half-split pairs (Hugging Face checkpoints, Qwen2 GGUF files) are
//! reordered here into the adjacent pairs the forward pass rotates, so one forward pass
//! serves both layouts.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};
use half::{bf16, f16};

use super::gguf::{GgufFile, TensorType};
use super::{ModelConfig, PrecisionPolicy, WeightPrecision};
use crate::backend::blocks::FileLayout;
use crate::backend::{Blocks, Matrix, WeightData, interleaved, kquant, quant};

/// Which slice of the tensor-parallel split this process holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
}

impl Shard {
    pub const WHOLE: Shard = Shard { rank: 0, world: 1 };

    /// This rank's part of `0..n` (n must divide evenly).
    pub fn part(&self, n: usize) -> std::ops::Range<usize> {
        let per = n / self.world;
        self.rank * per..(self.rank + 1) * per
    }
}

/// A linear layer in the storages the policy keeps: `quant` for [`WeightPrecision::Int8`]
/// chunks, `full` for [`WeightPrecision::Full`]; a chunk asking for a missing one uses the other
/// (a full-precision chunk multiplies block-quantised weights in f32, widening them per tile).
pub struct Linear {
    pub full: Option<Matrix>,
    pub quant: Option<Matrix>,
}

impl Linear {
    pub fn get(&self, precision: WeightPrecision) -> &Matrix {
        let (preferred, other) = match precision {
            WeightPrecision::Int8 => (&self.quant, &self.full),
            WeightPrecision::Full => (&self.full, &self.quant),
        };
        preferred
            .as_ref()
            .or(other.as_ref())
            .expect("a linear layer always holds at least one storage")
    }

    pub fn bytes(&self) -> usize {
        self.full.as_ref().map_or(0, Matrix::bytes) + self.quant.as_ref().map_or(0, Matrix::bytes)
    }

    /// `keep_precise`: under the int8 policy, float weights of this layer stay float (the
    /// attention Q/K/V projections and the output head, whose errors the logits amplify).
    fn new(m: Matrix, policy: PrecisionPolicy, keep_precise: bool) -> Linear {
        // Block-quantised weights move in as they are (read in place when the file allowed
        // it); only float weights are converted.
        let int8 = |m: &Matrix| (!keep_precise).then(|| m.to_q8_0()).flatten();
        let (quant, full) = match policy {
            PrecisionPolicy::Fp32 => (None, Some(m.to_f32_matrix())),
            PrecisionPolicy::Fp16 => (None, Some(m.to_f16_matrix())),
            // The x86-64 kernels read k-quants faster repacked; elsewhere only the scalar
            // reference would read the repacked layout, slower than the file's.
            PrecisionPolicy::Int8 | PrecisionPolicy::Auto { .. } if m.is_quantized() => {
                let m = if cfg!(target_arch = "x86_64") {
                    m.interleaved()
                } else {
                    m
                };
                (Some(m), None)
            }
            PrecisionPolicy::Int8 => match int8(&m) {
                Some(q) => (Some(q), None),
                None => (None, Some(m.to_f32_matrix())),
            },
            // Block-quantised weights are widened per tile when a chunk runs in f32, so no
            // full-precision copy is held; float weights stay in their own storage while some
            // prompt can run at full precision, or while they have no int8 copy.
            PrecisionPolicy::Auto { .. } => {
                let quant = int8(&m);
                let full_runs = policy.precisions().contains(&WeightPrecision::Full);
                let full = (full_runs || quant.is_none()).then_some(m);
                (quant, full)
            }
        };
        Linear { full, quant }
    }
}

pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: Linear,
    pub wk: Linear,
    pub wv: Linear,
    /// Q/K/V biases of this rank's rows, when the architecture has them.
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub wo: Linear,
    pub ffn_norm: Vec<f32>,
    pub w_gate: Linear,
    pub w_up: Linear,
    pub w_down: Linear,
}

pub struct Weights {
    /// Stored as in the file; rows are dequantised on lookup.
    pub token_embd: Matrix,
    pub layers: Vec<LayerWeights>,
    pub output_norm: Vec<f32>,
    pub output: Linear,
    /// Heads held by this rank.
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub shard: Shard,
}

impl Weights {
    pub fn bytes(&self) -> usize {
        let per_layer: usize = self.linears().map(Linear::bytes).sum();
        per_layer + self.token_embd.bytes() + self.output.bytes()
    }

    /// Bytes of weights one decode step at `precision` multiplies: every layer's matrices
    /// and the output head. The embedding table contributes one row, so it is left out
    /// (a tied head is already counted as the output).
    pub fn decode_bytes(&self, precision: WeightPrecision) -> usize {
        let per_layer: usize = self.linears().map(|w| w.get(precision).bytes()).sum();
        per_layer + self.output.get(precision).bytes()
    }

    /// Every layer's linear layers.
    fn linears(&self) -> impl Iterator<Item = &Linear> {
        self.layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
    }
}

/// How a source orders each head's Q/K rows (and biases) for the rotary embedding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RotaryRows {
    /// Pairs `(2i, 2i+1)`, the order the forward pass rotates (Llama GGUF files).
    Adjacent,
    /// Pairs `(i, i + head_dim/2)`, the NEOX order of Hugging Face checkpoints and Qwen2
    /// GGUF files; reordered at load.
    HalfSplit,
}

/// Where tensors come from, addressed by their GGUF names (`blk.N.attn_q.weight`, ...).
pub trait TensorSource {
    /// `Ok(None)` when the tensor is absent.
    fn matrix(&self, name: &str) -> Result<Option<Matrix>>;
}

pub fn load_weights(
    src: &dyn TensorSource,
    cfg: &ModelConfig,
    rotary: RotaryRows,
    policy: PrecisionPolicy,
    shard: Shard,
) -> Result<Weights> {
    ensure!(
        shard.world >= 1 && shard.rank < shard.world,
        "invalid shard {shard:?}"
    );
    for (what, n) in [
        ("attention heads", cfg.n_heads),
        ("KV heads", cfg.n_kv_heads),
        ("FFN width", cfg.ffn_dim),
    ] {
        ensure!(
            n.is_multiple_of(shard.world),
            "{what} ({n}) do not split evenly over tensor-parallel degree {}",
            shard.world
        );
    }
    let need = |name: &str, rows: usize, cols: usize| -> Result<Matrix> {
        let m = src
            .matrix(name)?
            .with_context(|| format!("tensor {name} is missing"))?;
        ensure!(
            m.rows == rows && m.cols == cols,
            "tensor {name} has shape {}×{}, expected {rows}×{cols}",
            m.rows,
            m.cols
        );
        Ok(m)
    };
    let vector = |name: &str, n: usize| -> Result<Vec<f32>> { Ok(need(name, 1, n)?.to_f32()) };
    let (dim, hd) = (cfg.dim, cfg.head_dim);
    let q_rows = shard.part(cfg.n_heads * hd);
    let kv_rows = shard.part(cfg.n_kv_heads * hd);
    let ffn_rows = shard.part(cfg.ffn_dim);
    // Reorders this rank's Q/K rows (whole heads) into adjacent rotary pairs.
    let order = |heads: usize| -> Option<Vec<usize>> {
        (rotary == RotaryRows::HalfSplit).then(|| half_to_adjacent_rows(heads / shard.world, hd))
    };
    let (q_order, k_order) = (order(cfg.n_heads), order(cfg.n_kv_heads));
    let mut layers = Vec::with_capacity(cfg.n_layers);
    for i in 0..cfg.n_layers {
        let name = |t: &str| format!("blk.{i}.{t}.weight");
        let column = |t: &str,
                      rows: usize,
                      range: &std::ops::Range<usize>,
                      order: Option<&[usize]>,
                      precise: bool|
         -> Result<Linear> {
            let m = need(&name(t), rows, dim)?.select_rows(range.clone());
            let m = match order {
                Some(order) => permute_rows(&m, order),
                None => m,
            };
            Ok(Linear::new(m, policy, precise))
        };
        let bias = |t: &str,
                    rows: usize,
                    range: &std::ops::Range<usize>,
                    order: Option<&[usize]>|
         -> Result<Option<Vec<f32>>> {
            if !cfg.qkv_bias {
                return Ok(None);
            }
            let b = need(&format!("blk.{i}.{t}.bias"), 1, rows)?.to_f32();
            let b = &b[range.clone()];
            Ok(Some(match order {
                Some(order) => order.iter().map(|&r| b[r]).collect(),
                None => b.to_vec(),
            }))
        };
        let row = |t: &str, cols: usize, range: &std::ops::Range<usize>| -> Result<Linear> {
            let m = need(&name(t), dim, cols)?;
            let m = if shard.world > 1 {
                m.select_cols(range.clone())
            } else {
                m
            };
            Ok(Linear::new(m, policy, false))
        };
        let (q_heads, kv_heads) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
        layers.push(LayerWeights {
            attn_norm: vector(&name("attn_norm"), dim)?,
            wq: column("attn_q", q_heads, &q_rows, q_order.as_deref(), true)?,
            wk: column("attn_k", kv_heads, &kv_rows, k_order.as_deref(), true)?,
            wv: column("attn_v", kv_heads, &kv_rows, None, true)?,
            bq: bias("attn_q", q_heads, &q_rows, q_order.as_deref())?,
            bk: bias("attn_k", kv_heads, &kv_rows, k_order.as_deref())?,
            bv: bias("attn_v", kv_heads, &kv_rows, None)?,
            wo: row("attn_output", q_heads, &q_rows)?,
            ffn_norm: vector(&name("ffn_norm"), dim)?,
            w_gate: column("ffn_gate", cfg.ffn_dim, &ffn_rows, None, false)?,
            w_up: column("ffn_up", cfg.ffn_dim, &ffn_rows, None, false)?,
            w_down: row("ffn_down", cfg.ffn_dim, &ffn_rows)?,
        });
    }
    let token_embd = need("token_embd.weight", cfg.vocab_size, dim)?;
    let output = match src.matrix("output.weight")? {
        Some(_) => need("output.weight", cfg.vocab_size, dim)?,
        None => token_embd.clone(),
    };
    Ok(Weights {
        output: Linear::new(output, policy, true),
        token_embd,
        layers,
        output_norm: vector("output_norm.weight", dim)?,
        n_heads: cfg.n_heads / shard.world,
        n_kv_heads: cfg.n_kv_heads / shard.world,
        shard,
    })
}

impl TensorSource for GgufFile {
    fn matrix(&self, name: &str) -> Result<Option<Matrix>> {
        let Some(info) = self.tensors.get(name) else {
            return Ok(None);
        };
        let cols = info.dims[0] as usize;
        let rows = info.dims[1..].iter().product::<u64>() as usize;
        let bytes = self.tensor_bytes(info);
        let data = match info.ty {
            TensorType::F32 => WeightData::F32(self.tensor_blocks(info, le_f32)),
            TensorType::F16 => WeightData::F16(self.tensor_blocks(info, le_f16)),
            TensorType::Bf16 => WeightData::F32(bf16_to_f32(bytes).into()),
            TensorType::Q4_0 => WeightData::Q4_0(self.tensor_blocks(info, quant::parse_q4_0)),
            TensorType::Q4_1 => WeightData::Q4_1(self.tensor_blocks(info, quant::parse_q4_1)),
            TensorType::Q5_0 => WeightData::Q5_0(self.tensor_blocks(info, quant::parse_q5_0)),
            TensorType::Q5_1 => WeightData::Q5_1(self.tensor_blocks(info, quant::parse_q5_1)),
            TensorType::Q8_0 => WeightData::Q8_0(self.tensor_blocks(info, quant::parse_q8_0)),
            TensorType::Q4K => WeightData::Q4K(self.tensor_blocks(info, kquant::parse_q4_k)),
            TensorType::Q5K => WeightData::Q5K(self.tensor_blocks(info, kquant::parse_q5_k)),
            TensorType::Q6K => WeightData::Q6K(self.tensor_blocks(info, kquant::parse_q6_k)),
        };
        Ok(Some(Matrix { rows, cols, data }))
    }
}

fn le_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn le_u16(bytes: &[u8]) -> impl Iterator<Item = u16> + '_ {
    bytes
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
}

fn le_f16(bytes: &[u8]) -> Vec<f16> {
    le_u16(bytes).map(f16::from_bits).collect()
}

fn bf16_to_f32(bytes: &[u8]) -> Vec<f32> {
    le_u16(bytes).map(|b| bf16::from_bits(b).to_f32()).collect()
}

/// `bytes`, a slice of `map`, read in place where that is sound, else decoded by `decode`.
fn mapped_or<T: FileLayout>(
    map: &Arc<memmap2::Mmap>,
    bytes: &[u8],
    decode: impl FnOnce(&[u8]) -> Vec<T>,
) -> Blocks<T> {
    (bytes.as_ptr().addr().checked_sub(map.as_ptr().addr()))
        .and_then(|start| Blocks::mapped(map, start..start + bytes.len()))
        .unwrap_or_else(|| decode(bytes).into())
}

/// A Hugging Face model directory: `*.safetensors` shards read through memory maps.
pub struct SafetensorsDir {
    maps: Vec<(PathBuf, Arc<memmap2::Mmap>)>,
    /// HF tensor name → index into `maps`.
    index: HashMap<String, usize>,
}

impl SafetensorsDir {
    pub fn open(dir: &Path) -> Result<SafetensorsDir> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        files.sort();
        ensure!(
            !files.is_empty(),
            "no .safetensors files in {}",
            dir.display()
        );
        let mut maps = Vec::new();
        let mut index = HashMap::new();
        for path in files {
            let file = std::fs::File::open(&path)
                .with_context(|| format!("opening {}", path.display()))?;
            // SAFETY: mapped read-only; model files are not modified while served.
            let mmap = unsafe { memmap2::Mmap::map(&file) }?;
            let (_, meta) = safetensors::SafeTensors::read_metadata(&mmap)
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            for name in meta.tensors().keys() {
                index.insert(name.clone(), maps.len());
            }
            maps.push((path, Arc::new(mmap)));
        }
        Ok(SafetensorsDir { maps, index })
    }

    fn hf_name(name: &str) -> Option<String> {
        Some(match name {
            "token_embd.weight" => "model.embed_tokens.weight".into(),
            "output_norm.weight" => "model.norm.weight".into(),
            "output.weight" => "lm_head.weight".into(),
            _ => {
                let rest = name.strip_prefix("blk.")?;
                let (layer, tensor) = rest.split_once('.')?;
                let hf = match tensor {
                    "attn_norm.weight" => "input_layernorm.weight",
                    "attn_q.weight" => "self_attn.q_proj.weight",
                    "attn_k.weight" => "self_attn.k_proj.weight",
                    "attn_v.weight" => "self_attn.v_proj.weight",
                    "attn_q.bias" => "self_attn.q_proj.bias",
                    "attn_k.bias" => "self_attn.k_proj.bias",
                    "attn_v.bias" => "self_attn.v_proj.bias",
                    "attn_output.weight" => "self_attn.o_proj.weight",
                    "ffn_norm.weight" => "post_attention_layernorm.weight",
                    "ffn_gate.weight" => "mlp.gate_proj.weight",
                    "ffn_up.weight" => "mlp.up_proj.weight",
                    "ffn_down.weight" => "mlp.down_proj.weight",
                    _ => return None,
                };
                format!("model.layers.{layer}.{hf}")
            }
        })
    }
}

/// Source rows, per destination row, that reorder each head from the half-split rotary
/// layout (pairs `i`, `i + head_dim/2`) to the adjacent-pair layout (pairs `2i`, `2i+1`) the
/// forward pass uses: the permutation llama.cpp's converter applies to Llama's Q/K.
fn half_to_adjacent_rows(n_heads: usize, head_dim: usize) -> Vec<usize> {
    let half = head_dim / 2;
    let mut src_rows = Vec::with_capacity(n_heads * head_dim);
    for h in 0..n_heads {
        for j in 0..half {
            src_rows.push(h * head_dim + j);
            src_rows.push(h * head_dim + half + j);
        }
    }
    src_rows
}

/// Applies [`half_to_adjacent_rows`] to a matrix.
pub fn rotary_half_to_adjacent(m: &Matrix, n_heads: usize, head_dim: usize) -> Matrix {
    permute_rows(m, &half_to_adjacent_rows(n_heads, head_dim))
}

/// The inverse of [`rotary_half_to_adjacent`].
pub fn rotary_adjacent_to_half(m: &Matrix, n_heads: usize, head_dim: usize) -> Matrix {
    let mut src_rows = vec![0; n_heads * head_dim];
    for (dst, src) in half_to_adjacent_rows(n_heads, head_dim)
        .into_iter()
        .enumerate()
    {
        src_rows[src] = dst;
    }
    permute_rows(m, &src_rows)
}

/// Row `i` of the result is row `src_rows[i]` of `m`. Rows are whole blocks in every block
/// format, so every storage's rows are moved as stored.
fn permute_rows(m: &Matrix, src_rows: &[usize]) -> Matrix {
    fn pick<T: Clone>(v: &[T], rows: usize, src_rows: &[usize]) -> Blocks<T> {
        let per = v.len() / rows.max(1);
        src_rows
            .iter()
            .flat_map(|&r| v[r * per..(r + 1) * per].iter().cloned())
            .collect::<Vec<_>>()
            .into()
    }
    let data = match &m.data {
        WeightData::F16(v) => WeightData::F16(pick(v, m.rows, src_rows)),
        WeightData::Q4_0(v) => WeightData::Q4_0(pick(v, m.rows, src_rows)),
        WeightData::Q4_1(v) => WeightData::Q4_1(pick(v, m.rows, src_rows)),
        WeightData::Q5_0(v) => WeightData::Q5_0(pick(v, m.rows, src_rows)),
        WeightData::Q5_1(v) => WeightData::Q5_1(pick(v, m.rows, src_rows)),
        WeightData::Q8_0(v) => WeightData::Q8_0(pick(v, m.rows, src_rows)),
        WeightData::Q4K(v) => WeightData::Q4K(pick(v, m.rows, src_rows)),
        WeightData::Q4KX8(v) => {
            let rows = interleaved::rows_of(v, m.cols / kquant::QK_K, 0..m.rows);
            WeightData::Q4K(pick(&rows, m.rows, src_rows))
        }
        WeightData::Q6KX8(v) => {
            let rows = interleaved::rows_of(v, m.cols / kquant::QK_K, 0..m.rows);
            WeightData::Q6K(pick(&rows, m.rows, src_rows))
        }
        WeightData::Q5K(v) => WeightData::Q5K(pick(v, m.rows, src_rows)),
        WeightData::Q6K(v) => WeightData::Q6K(pick(v, m.rows, src_rows)),
        WeightData::F32(v) => WeightData::F32(pick(v, m.rows, src_rows)),
    };
    Matrix {
        rows: src_rows.len(),
        cols: m.cols,
        data,
    }
}

impl TensorSource for SafetensorsDir {
    fn matrix(&self, name: &str) -> Result<Option<Matrix>> {
        let Some(hf) = Self::hf_name(name) else {
            return Ok(None);
        };
        let Some(&file) = self.index.get(&hf) else {
            return Ok(None);
        };
        let (path, mmap) = &self.maps[file];
        let st = safetensors::SafeTensors::deserialize(mmap)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let view = st
            .tensor(&hf)
            .map_err(|e| anyhow::anyhow!("{}: {hf}: {e}", path.display()))?;
        let shape = view.shape();
        let (rows, cols) = match shape {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            _ => bail!("{hf}: unsupported shape {shape:?}"),
        };
        let bytes = view.data();
        let data = match view.dtype() {
            safetensors::Dtype::F32 => WeightData::F32(mapped_or(mmap, bytes, le_f32)),
            safetensors::Dtype::F16 => WeightData::F16(mapped_or(mmap, bytes, le_f16)),
            safetensors::Dtype::BF16 => WeightData::F32(bf16_to_f32(bytes).into()),
            other => bail!("{hf}: unsupported dtype {other:?}"),
        };
        Ok(Some(Matrix { rows, cols, data }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numbered(rows: usize, cols: usize) -> Matrix {
        Matrix::f32(
            rows,
            cols,
            (0..rows * cols).map(|v| v as f32 / 7.0).collect(),
        )
    }

    #[test]
    fn rotary_reordering_pairs_each_half_and_inverts() {
        assert_eq!(half_to_adjacent_rows(2, 4), vec![0, 2, 1, 3, 4, 6, 5, 7]);
        let m = numbered(8, 3);
        let there = rotary_half_to_adjacent(&m, 2, 4);
        assert_eq!(there.to_f32()[3..6], m.to_f32()[6..9]);
        assert_eq!(rotary_adjacent_to_half(&there, 2, 4).to_f32(), m.to_f32());
    }

    #[test]
    fn block_quantised_rows_move_as_blocks() {
        let m = numbered(8, 64).to_q8_0().expect("64 columns quantise");
        let permuted = rotary_half_to_adjacent(&m, 2, 4);
        assert!(matches!(permuted.data, WeightData::Q8_0(_)));
        assert_eq!(
            permuted.to_f32(),
            rotary_half_to_adjacent(&Matrix::f32(8, 64, m.to_f32()), 2, 4).to_f32()
        );
        let f16 = rotary_half_to_adjacent(&numbered(8, 3).to_f16_matrix(), 2, 4);
        assert!(matches!(f16.data, WeightData::F16(_)));
    }
}

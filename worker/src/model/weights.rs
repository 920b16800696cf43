//! The weights as plain structs, loaded from a GGUF file or a Hugging Face safetensors
//! directory, in the storage the precision policy asks for, and sliced for one
//! tensor-parallel rank.
//!
//! Tensor-parallel split (Megatron): Q/K/V and gate/up are column-parallel (each rank keeps
//! its heads' or its FFN slice's output rows), attention-out and down are row-parallel (each
//! rank keeps the matching input columns and the partial sums are all-reduced). Norms,
//! embeddings and the output head are replicated.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use half::{bf16, f16};

use super::gguf::{GgufFile, TensorType};
use super::{ModelConfig, PrecisionPolicy, WeightPrecision};
use crate::backend::{Matrix, WeightData, quant};

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
/// chunks, `full` for [`WeightPrecision::Full`]; a chunk asking for a missing one uses the other.
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
        let quantized = |m: &Matrix| {
            if m.is_quantized() {
                Some(m.clone())
            } else if keep_precise {
                None
            } else {
                m.to_q8_0()
            }
        };
        let (full, quant) = match policy {
            PrecisionPolicy::Fp32 => (Some(m.to_f32_matrix()), None),
            PrecisionPolicy::Fp16 => (Some(m.to_f16_matrix()), None),
            PrecisionPolicy::Int8 => match quantized(&m) {
                Some(q) => (None, Some(q)),
                None => (Some(m.to_f32_matrix()), None),
            },
            PrecisionPolicy::Auto { .. } => (Some(m.to_f32_matrix()), quantized(&m)),
        };
        Linear { full, quant }
    }
}

pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: Linear,
    pub wk: Linear,
    pub wv: Linear,
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
        let per_layer: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                    .iter()
                    .map(|w| w.bytes())
                    .sum::<usize>()
            })
            .sum();
        per_layer + self.token_embd.bytes() + self.output.bytes()
    }
}

/// Where tensors come from, addressed by their GGUF names (`blk.N.attn_q.weight`, ...).
pub trait TensorSource {
    /// `Ok(None)` when the tensor is absent.
    fn matrix(&self, name: &str) -> Result<Option<Matrix>>;
}

pub fn load_weights(
    src: &dyn TensorSource,
    cfg: &ModelConfig,
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
    let mut layers = Vec::with_capacity(cfg.n_layers);
    for i in 0..cfg.n_layers {
        let name = |t: &str| format!("blk.{i}.{t}.weight");
        let column = |t: &str,
                      rows: usize,
                      range: &std::ops::Range<usize>,
                      precise: bool|
         -> Result<Linear> {
            Ok(Linear::new(
                need(&name(t), rows, dim)?.select_rows(range.clone()),
                policy,
                precise,
            ))
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
        layers.push(LayerWeights {
            attn_norm: vector(&name("attn_norm"), dim)?,
            wq: column("attn_q", cfg.n_heads * hd, &q_rows, true)?,
            wk: column("attn_k", cfg.n_kv_heads * hd, &kv_rows, true)?,
            wv: column("attn_v", cfg.n_kv_heads * hd, &kv_rows, true)?,
            wo: row("attn_output", cfg.n_heads * hd, &q_rows)?,
            ffn_norm: vector(&name("ffn_norm"), dim)?,
            w_gate: column("ffn_gate", cfg.ffn_dim, &ffn_rows, false)?,
            w_up: column("ffn_up", cfg.ffn_dim, &ffn_rows, false)?,
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
            TensorType::F32 => WeightData::F32(le_f32(bytes)),
            TensorType::F16 => WeightData::F16(le_u16(bytes).map(f16::from_bits).collect()),
            TensorType::Bf16 => {
                WeightData::F32(le_u16(bytes).map(|b| bf16::from_bits(b).to_f32()).collect())
            }
            TensorType::Q4_0 => WeightData::Q4_0(quant::parse_q4_0(bytes)),
            TensorType::Q4_1 => WeightData::Q4_1(quant::parse_q4_1(bytes)),
            TensorType::Q5_0 => WeightData::Q8_0(quant::parse_q5_0_as_q8_0(bytes)),
            TensorType::Q5_1 => WeightData::F32(quant::dequantize_q5_1_bytes(bytes)),
            TensorType::Q8_0 => WeightData::Q8_0(quant::parse_q8_0(bytes)),
            TensorType::Q4K => WeightData::Q4K(crate::backend::kquant::parse_q4_k(bytes)),
            TensorType::Q5K => WeightData::Q5K(crate::backend::kquant::parse_q5_k(bytes)),
            TensorType::Q6K => WeightData::Q6K(crate::backend::kquant::parse_q6_k(bytes)),
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

/// A Hugging Face model directory: `*.safetensors` shards read through memory maps.
pub struct SafetensorsDir {
    maps: Vec<(PathBuf, memmap2::Mmap)>,
    /// HF tensor name → index into `maps`.
    index: HashMap<String, usize>,
    head_dim: usize,
    n_heads: usize,
    n_kv_heads: usize,
}

impl SafetensorsDir {
    pub fn open(dir: &Path, cfg: &ModelConfig) -> Result<SafetensorsDir> {
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
            maps.push((path, mmap));
        }
        Ok(SafetensorsDir {
            maps,
            index,
            head_dim: cfg.head_dim,
            n_heads: cfg.n_heads,
            n_kv_heads: cfg.n_kv_heads,
        })
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

/// Reorders the rows of each head from the half-split rotary layout (pairs `i`,
/// `i + head_dim/2`) to the adjacent-pair layout (pairs `2i`, `2i+1`) the forward pass uses,
/// the same permutation llama.cpp's converter applies when writing GGUF.
pub fn rotary_half_to_adjacent(m: &Matrix, n_heads: usize, head_dim: usize) -> Matrix {
    let half = head_dim / 2;
    let mut src_rows = Vec::with_capacity(n_heads * head_dim);
    for h in 0..n_heads {
        for j in 0..half {
            src_rows.push(h * head_dim + j);
            src_rows.push(h * head_dim + half + j);
        }
    }
    permute_rows(m, &src_rows)
}

/// The inverse of [`rotary_half_to_adjacent`].
pub fn rotary_adjacent_to_half(m: &Matrix, n_heads: usize, head_dim: usize) -> Matrix {
    let half = head_dim / 2;
    let mut src_rows = vec![0; n_heads * head_dim];
    for h in 0..n_heads {
        for j in 0..half {
            src_rows[h * head_dim + j] = h * head_dim + 2 * j;
            src_rows[h * head_dim + half + j] = h * head_dim + 2 * j + 1;
        }
    }
    permute_rows(m, &src_rows)
}

fn permute_rows(m: &Matrix, src_rows: &[usize]) -> Matrix {
    let c = m.cols;
    let data = m.to_f32();
    let mut out = Vec::with_capacity(data.len());
    for &r in src_rows {
        out.extend_from_slice(&data[r * c..(r + 1) * c]);
    }
    let permuted = Matrix::f32(m.rows, c, out);
    match m.data {
        WeightData::F16(_) => permuted.to_f16_matrix(),
        _ => permuted,
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
            safetensors::Dtype::F32 => WeightData::F32(le_f32(bytes)),
            safetensors::Dtype::F16 => WeightData::F16(le_u16(bytes).map(f16::from_bits).collect()),
            safetensors::Dtype::BF16 => {
                WeightData::F32(le_u16(bytes).map(|b| bf16::from_bits(b).to_f32()).collect())
            }
            other => bail!("{hf}: unsupported dtype {other:?}"),
        };
        let m = Matrix { rows, cols, data };
        Ok(Some(match name.rsplit('.').nth(1) {
            // A wrong shape is left for the loader's shape check to report.
            Some("attn_q") if m.rows == self.n_heads * self.head_dim => {
                rotary_half_to_adjacent(&m, self.n_heads, self.head_dim)
            }
            Some("attn_k") if m.rows == self.n_kv_heads * self.head_dim => {
                rotary_half_to_adjacent(&m, self.n_kv_heads, self.head_dim)
            }
            _ => m,
        }))
    }
}

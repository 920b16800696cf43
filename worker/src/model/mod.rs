//! The model layer: configuration, weights, tokenizer and the forward pass of a Llama-style
//! decoder (Llama, and Qwen2 with its Q/K/V biases), loaded from a GGUF file or a Hugging
//! Face safetensors directory.
//!
//! Plain data in, plain data out: [`Model::forward`] runs one engine step over a batch of
//! sequence chunks against a paged [`KvCache`]; scheduling and sampling live above this layer.

mod forward;
pub mod gguf;
mod group;
mod kv_cache;
pub mod tokenizer;
pub mod weights;

use npufleet_contract::precision::Precision;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};

use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, KvDtype};
use crate::collective::{Collective, CollectiveError};
pub use forward::StepBuffers;
pub use kv_cache::KvCache;
pub use tokenizer::{ChatMessage, StreamDecoder, Tokenizer};
use weights::{RotaryRows, Shard, Weights};

/// The architecture's numbers, llama2.c style.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: String,
    pub n_layers: usize,
    pub dim: usize,
    pub ffn_dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub add_bos: bool,
    /// The Q, K and V projections add a bias (Qwen2).
    pub qkv_bias: bool,
}

/// Architectures the forward pass implements (GGUF `general.architecture` names).
const ARCHITECTURES: &[&str] = &["llama", "qwen2"];

impl ModelConfig {
    fn validate(&self) -> Result<()> {
        ensure!(
            ARCHITECTURES.contains(&self.architecture.as_str()),
            "unsupported architecture {:?} (implemented: {})",
            self.architecture,
            ARCHITECTURES.join(", ")
        );
        for (name, v) in [
            ("layers", self.n_layers),
            ("dim", self.dim),
            ("ffn_dim", self.ffn_dim),
            ("heads", self.n_heads),
            ("kv heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab size", self.vocab_size),
            ("context length", self.context_length),
        ] {
            ensure!(v > 0, "model config: {name} is 0");
        }
        ensure!(
            self.n_heads.is_multiple_of(self.n_kv_heads),
            "model config: {} heads do not group evenly over {} KV heads",
            self.n_heads,
            self.n_kv_heads
        );
        ensure!(
            self.head_dim.is_multiple_of(2),
            "model config: head_dim {} is odd",
            self.head_dim
        );
        Ok(())
    }
}

/// How weights are multiplied for one sequence chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightPrecision {
    /// The quantised path: int8 weights or the file's 4/8-bit blocks, activations in int8.
    Int8,
    /// f32 arithmetic (weights stored f32, or f16 under the fp16 policy).
    Full,
}

/// The precision policy a worker is configured with.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PrecisionPolicy {
    Int8,
    Fp32,
    Fp16,
    /// Both storages are kept: prompts up to `int8_max_prompt_tokens` use int8, longer ones
    /// (where prefill is compute-bound and GEMM wins) use f32.
    Auto {
        int8_max_prompt_tokens: usize,
    },
}

impl PrecisionPolicy {
    /// The precision for work of `prompt_tokens` new tokens. Applied per chunk, decode steps
    /// (one token) take the int8 path under `auto` and long prefill chunks the f32 GEMM.
    pub fn for_prompt(&self, prompt_tokens: usize) -> WeightPrecision {
        match *self {
            PrecisionPolicy::Int8 => WeightPrecision::Int8,
            PrecisionPolicy::Fp32 | PrecisionPolicy::Fp16 => WeightPrecision::Full,
            PrecisionPolicy::Auto {
                int8_max_prompt_tokens,
            } => {
                if prompt_tokens <= int8_max_prompt_tokens {
                    WeightPrecision::Int8
                } else {
                    WeightPrecision::Full
                }
            }
        }
    }

    /// Every precision the policy can pick for some prompt.
    pub fn precisions(&self) -> Vec<WeightPrecision> {
        match *self {
            PrecisionPolicy::Int8
            | PrecisionPolicy::Auto {
                int8_max_prompt_tokens: usize::MAX,
            } => vec![WeightPrecision::Int8],
            PrecisionPolicy::Fp32 | PrecisionPolicy::Fp16 => vec![WeightPrecision::Full],
            PrecisionPolicy::Auto { .. } => vec![WeightPrecision::Int8, WeightPrecision::Full],
        }
    }

    /// The policy for a configured precision; `auto_int8_max_prompt_tokens` only matters under
    /// [`Precision::Auto`].
    pub fn new(precision: Precision, auto_int8_max_prompt_tokens: usize) -> Self {
        match precision {
            Precision::Int8 => PrecisionPolicy::Int8,
            Precision::Fp32 => PrecisionPolicy::Fp32,
            Precision::Fp16 => PrecisionPolicy::Fp16,
            Precision::Auto => PrecisionPolicy::Auto {
                int8_max_prompt_tokens: auto_int8_max_prompt_tokens,
            },
        }
    }

    pub fn precision(&self) -> Precision {
        match self {
            PrecisionPolicy::Int8 => Precision::Int8,
            PrecisionPolicy::Fp32 => Precision::Fp32,
            PrecisionPolicy::Fp16 => Precision::Fp16,
            PrecisionPolicy::Auto { .. } => Precision::Auto,
        }
    }
}

pub struct LoadOptions {
    pub policy: PrecisionPolicy,
    /// Compute threads (0 = all cores).
    pub threads: usize,
    /// `None` runs the whole model in this process (tensor-parallel degree 1).
    pub collective: Option<Arc<dyn Collective>>,
    /// Where the kernels run; `None` is the CPU with `threads` threads.
    pub backend: Option<Box<dyn Backend>>,
}

impl LoadOptions {
    /// The whole model on the CPU.
    pub fn cpu(policy: PrecisionPolicy, threads: usize) -> LoadOptions {
        LoadOptions {
            policy,
            threads,
            collective: None,
            backend: None,
        }
    }
}

pub struct Model {
    config: ModelConfig,
    weights: Weights,
    tokenizer: Tokenizer,
    backend: Box<dyn Backend>,
    collective: Option<Arc<dyn Collective>>,
    /// Set on rank 0 once it leads its group (see [`Model::leading`]).
    leader: Option<Arc<group::Leader>>,
    policy: PrecisionPolicy,
}

/// One sequence's part of an engine step.
pub struct SequenceChunk<'a> {
    pub tokens: &'a [u32],
    pub start_pos: usize,
    pub block_table: &'a [u32],
    pub want_logits: bool,
    pub precision: WeightPrecision,
}

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("chunk {chunk}: no tokens to process")]
    EmptyChunk { chunk: usize },
    #[error("chunk {chunk}: token id {token} is outside the vocabulary of {vocab_size} tokens")]
    InvalidToken {
        chunk: usize,
        token: u32,
        vocab_size: usize,
    },
    #[error("chunk {chunk}: positions up to {end} exceed the context length of {context_length}")]
    BeyondContext {
        chunk: usize,
        end: usize,
        context_length: usize,
    },
    #[error("chunk {chunk}: the block table covers {covered} positions but {needed} are needed")]
    BlockTableTooShort {
        chunk: usize,
        covered: usize,
        needed: usize,
    },
    #[error("chunk {chunk}: block {block} is outside the KV cache of {num_blocks} blocks")]
    InvalidBlock {
        chunk: usize,
        block: u32,
        num_blocks: usize,
    },
    #[error("the KV cache does not fit this model: {0}")]
    KvCacheMismatch(String),
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error("the pass was interrupted after {layers} of its layers")]
    Interrupted { layers: usize },
}

impl Model {
    /// Loads a GGUF file or a Hugging Face directory (config.json, *.safetensors, tokenizer.json).
    pub fn load(path: &Path, opts: LoadOptions) -> Result<Model> {
        let shard = match &opts.collective {
            Some(c) => Shard {
                rank: c.rank(),
                world: c.world_size(),
            },
            None => Shard::WHOLE,
        };
        let (config, weights, tokenizer) = if path.is_dir() {
            let config = hf_config(path)?;
            config.validate()?;
            let src = weights::SafetensorsDir::open(path)?;
            let w =
                weights::load_weights(&src, &config, RotaryRows::HalfSplit, opts.policy, shard)?;
            (config, w, Tokenizer::from_hf_dir(path)?)
        } else {
            let file = gguf::GgufFile::open(path)?;
            let tokenizer = Tokenizer::from_gguf(&file)?;
            let config = gguf_config(&file, &tokenizer)?;
            config.validate()?;
            // llama.cpp's converter permutes Llama's Q/K rows to adjacent pairs but leaves
            // Qwen2's as Hugging Face wrote them (llama.cpp rotates those with its NEOX rope).
            let rotary = if config.architecture == "qwen2" {
                RotaryRows::HalfSplit
            } else {
                RotaryRows::Adjacent
            };
            let w = weights::load_weights(&file, &config, rotary, opts.policy, shard)
                .with_context(|| format!("loading weights from {}", path.display()))?;
            (config, w, tokenizer)
        };
        ensure!(
            tokenizer.vocab_size() <= config.vocab_size,
            "the tokenizer has {} tokens but the model only {} embeddings",
            tokenizer.vocab_size(),
            config.vocab_size
        );
        let backend = match opts.backend {
            Some(backend) => backend,
            None => Box::new(CpuBackend::new(opts.threads)?),
        };
        Ok(Model {
            config,
            weights,
            tokenizer,
            backend,
            collective: opts.collective,
            leader: None,
            policy: opts.policy,
        })
    }

    /// Makes rank 0 of a tensor-parallel group drive the others: from now on every
    /// [`Model::forward`] first sends its plan to the ranks running [`Model::follow`], and an
    /// idle leader keeps them waiting with heartbeats. Without this, every rank calls
    /// `forward` itself in lock step.
    pub fn leading(mut self) -> Result<Model> {
        let collective = self
            .collective
            .clone()
            .context("only a tensor-parallel rank can lead a group")?;
        ensure!(
            collective.rank() == 0,
            "rank {} cannot lead its group: rank 0 leads",
            collective.rank()
        );
        if collective.world_size() > 1 {
            self.leader = Some(group::Leader::start(collective));
        }
        Ok(self)
    }

    /// A follower's whole life: runs the leader's steps against `kv` until the leader stops
    /// the group (`Ok`) or the ring fails (the error names the lost rank).
    pub fn follow(&self, kv: &mut KvCache) -> Result<(), ForwardError> {
        group::follow(self, kv)
    }

    /// Tells the followers to exit. Later forward passes fail.
    pub fn stop_group(&self) -> Result<(), CollectiveError> {
        self.leader.as_ref().map_or(Ok(()), |leader| leader.stop())
    }

    /// Why this leader's group can no longer run, once a collective has failed.
    pub fn group_failure(&self) -> Option<CollectiveError> {
        self.leader.as_ref().and_then(|leader| leader.failure())
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The weights as loaded: which storage each layer holds and where it lives.
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    pub fn policy(&self) -> PrecisionPolicy {
        self.policy
    }

    /// Which slice of the tensor-parallel split this process holds.
    pub fn shard(&self) -> Shard {
        self.weights.shard
    }

    /// The backend and kernels in use, for logs.
    pub fn backend_name(&self) -> String {
        self.backend.name()
    }

    /// Bytes of weights held in memory (every storage the policy keeps).
    pub fn weight_bytes(&self) -> usize {
        self.weights.bytes()
    }

    /// Bytes of weights a decode step reads: the memory traffic that bounds batch-1 decode.
    pub fn decode_weight_bytes(&self) -> usize {
        self.weights.decode_bytes(self.policy.for_prompt(1))
    }

    /// A cache for this rank's KV heads.
    pub fn new_kv_cache(&self, num_blocks: usize, block_size: usize, dtype: KvDtype) -> KvCache {
        KvCache::new(
            dtype,
            self.config.n_layers,
            self.weights.n_kv_heads,
            self.config.head_dim,
            num_blocks,
            block_size,
        )
    }

    /// One engine step over a batch of prefill chunks and decode tokens; see [`SequenceChunk`].
    /// Returns the last-token logits of each chunk with `want_logits`, in batch order.
    pub fn forward(
        &self,
        kv: &mut KvCache,
        batch: &[SequenceChunk<'_>],
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        let mut buffers = StepBuffers::default();
        self.forward_into(kv, batch, &mut buffers)?;
        Ok(buffers.logits().map(<[f32]>::to_vec).collect())
    }

    /// [`Model::forward`] for a caller that runs step after step: the activations live in
    /// `buffers`, reused from one step to the next, and the logits are left there
    /// ([`StepBuffers::logits`]).
    pub fn forward_into(
        &self,
        kv: &mut KvCache,
        batch: &[SequenceChunk<'_>],
        buffers: &mut StepBuffers,
    ) -> Result<(), ForwardError> {
        self.forward_unless(kv, batch, buffers, &|| false)
    }

    /// [`Model::forward_into`] that stops between two layers once `interrupted` returns
    /// true, with [`ForwardError::Interrupted`]. The caller runs the step again later: the
    /// positions the stopped pass wrote to the KV cache are then written again with the same
    /// values. A tensor-parallel group's step runs to its end, as its followers wait in the
    /// step's collectives.
    pub fn forward_unless(
        &self,
        kv: &mut KvCache,
        batch: &[SequenceChunk<'_>],
        buffers: &mut StepBuffers,
        interrupted: &(dyn Fn() -> bool + Sync),
    ) -> Result<(), ForwardError> {
        match &self.leader {
            Some(leader) if !batch.is_empty() => {
                // A plan the followers would refuse must not reach them.
                self.validate(kv, batch)?;
                leader.run(&group::plan_of(batch), || {
                    self.run_validated(kv, batch, buffers, &|| false)
                })
            }
            _ => self.forward_local(kv, batch, buffers, interrupted),
        }
    }

    /// The step on this rank alone (a leader's followers are not told).
    fn forward_local(
        &self,
        kv: &mut KvCache,
        batch: &[SequenceChunk<'_>],
        buffers: &mut StepBuffers,
        interrupted: &(dyn Fn() -> bool + Sync),
    ) -> Result<(), ForwardError> {
        self.validate(kv, batch)?;
        if batch.is_empty() {
            buffers.logits.clear();
            return Ok(());
        }
        self.run_validated(kv, batch, buffers, interrupted)
    }

    fn run_validated(
        &self,
        kv: &mut KvCache,
        batch: &[SequenceChunk<'_>],
        buffers: &mut StepBuffers,
        interrupted: &(dyn Fn() -> bool + Sync),
    ) -> Result<(), ForwardError> {
        let mut result = None;
        self.backend
            .run(&mut || result = Some(forward::forward(self, kv, batch, buffers, interrupted)));
        result.expect("the backend runs the forward pass")
    }

    fn validate(&self, kv: &KvCache, batch: &[SequenceChunk<'_>]) -> Result<(), ForwardError> {
        let cfg = &self.config;
        if kv.n_layers() != cfg.n_layers
            || kv.n_kv_heads() != self.weights.n_kv_heads
            || kv.head_dim() != cfg.head_dim
        {
            return Err(ForwardError::KvCacheMismatch(format!(
                "cache has {} layers × {} KV heads × {} dims, model needs {} × {} × {}",
                kv.n_layers(),
                kv.n_kv_heads(),
                kv.head_dim(),
                cfg.n_layers,
                self.weights.n_kv_heads,
                cfg.head_dim
            )));
        }
        if kv.block_size() == 0 {
            return Err(ForwardError::KvCacheMismatch("block size is 0".into()));
        }
        for (chunk, c) in batch.iter().enumerate() {
            if c.tokens.is_empty() {
                return Err(ForwardError::EmptyChunk { chunk });
            }
            if let Some(&token) = c.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(ForwardError::InvalidToken {
                    chunk,
                    token,
                    vocab_size: cfg.vocab_size,
                });
            }
            let end = c.start_pos + c.tokens.len();
            if end > cfg.context_length {
                return Err(ForwardError::BeyondContext {
                    chunk,
                    end,
                    context_length: cfg.context_length,
                });
            }
            let covered = c.block_table.len() * kv.block_size();
            if covered < end {
                return Err(ForwardError::BlockTableTooShort {
                    chunk,
                    covered,
                    needed: end,
                });
            }
            let used = &c.block_table[..end.div_ceil(kv.block_size())];
            if let Some(&block) = used.iter().find(|&&b| b as usize >= kv.num_blocks()) {
                return Err(ForwardError::InvalidBlock {
                    chunk,
                    block,
                    num_blocks: kv.num_blocks(),
                });
            }
        }
        Ok(())
    }

    fn all_reduce(&self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        match &self.collective {
            Some(c) if c.world_size() > 1 => c.all_reduce_sum(buf),
            _ => Ok(()),
        }
    }
}

fn gguf_config(file: &gguf::GgufFile, tokenizer: &Tokenizer) -> Result<ModelConfig> {
    let arch = file
        .get("general.architecture")
        .and_then(gguf::Value::as_str)
        .context("general.architecture is missing")?
        .to_string();
    let uint = |key: &str| -> Result<usize> {
        let full = format!("{arch}.{key}");
        file.get(&full)
            .and_then(gguf::Value::as_u64)
            .map(|v| v as usize)
            .with_context(|| format!("metadata {full} is missing or not an integer"))
    };
    let float = |key: &str, default: f64| -> f32 {
        file.get(&format!("{arch}.{key}"))
            .and_then(gguf::Value::as_f64)
            .unwrap_or(default) as f32
    };
    let dim = uint("embedding_length")?;
    let n_heads = uint("attention.head_count")?;
    let vocab_size = match uint("vocab_size") {
        Ok(v) => v,
        Err(_) => file
            .tensors
            .get("token_embd.weight")
            .and_then(|t| t.dims.get(1))
            .map(|&v| v as usize)
            .context("token_embd.weight is missing")?,
    };
    let token_id = |key: &str| -> Option<u32> {
        file.get(key)
            .and_then(gguf::Value::as_u64)
            .map(|v| v as u32)
    };
    let mut eos_token_ids: Vec<u32> =
        ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"]
            .iter()
            .filter_map(|k| token_id(k))
            .collect();
    eos_token_ids.extend(tokenizer.end_of_turn_tokens());
    eos_token_ids.sort_unstable();
    eos_token_ids.dedup();
    Ok(ModelConfig {
        n_layers: uint("block_count")?,
        dim,
        ffn_dim: uint("feed_forward_length")?,
        n_heads,
        n_kv_heads: uint("attention.head_count_kv").unwrap_or(n_heads),
        head_dim: uint("attention.key_length").unwrap_or(dim / n_heads.max(1)),
        vocab_size,
        context_length: uint("context_length")?,
        rope_theta: float("rope.freq_base", 10000.0),
        rms_eps: float("attention.layer_norm_rms_epsilon", 1e-5),
        eos_token_ids,
        bos_token_id: token_id("tokenizer.ggml.bos_token_id"),
        add_bos: file
            .get("tokenizer.ggml.add_bos_token")
            .and_then(gguf::Value::as_bool)
            .unwrap_or(false),
        qkv_bias: arch == "qwen2",
        architecture: arch,
    })
}

fn hf_config(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let uint = |key: &str| -> Result<usize> {
        v.get(key)
            .and_then(serde_json::Value::as_u64)
            .map(|n| n as usize)
            .with_context(|| format!("{}: {key} is missing or not an integer", path.display()))
    };
    let archs: Vec<&str> = v
        .get("architectures")
        .and_then(|a| a.as_array())
        .map(|a| a.iter().filter_map(|s| s.as_str()).collect())
        .unwrap_or_default();
    let model_type = v.get("model_type").and_then(|s| s.as_str()).unwrap_or("");
    let architecture = if model_type == "llama" || archs.contains(&"LlamaForCausalLM") {
        "llama".to_string()
    } else if model_type == "qwen2" || archs.contains(&"Qwen2ForCausalLM") {
        "qwen2".to_string()
    } else {
        bail!(
            "{}: unsupported model type {model_type:?} {archs:?}",
            path.display()
        );
    };
    let ids = |key: &str| -> Vec<u32> {
        match v.get(key) {
            Some(serde_json::Value::Number(n)) => {
                n.as_u64().map(|n| n as u32).into_iter().collect()
            }
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|n| n.as_u64())
                .map(|n| n as u32)
                .collect(),
            _ => Vec::new(),
        }
    };
    let dim = uint("hidden_size")?;
    let n_heads = uint("num_attention_heads")?;
    let add_bos = std::fs::read_to_string(dir.join("tokenizer_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|t| t.get("add_bos_token").and_then(|b| b.as_bool()))
        .unwrap_or(false);
    Ok(ModelConfig {
        n_layers: uint("num_hidden_layers")?,
        dim,
        ffn_dim: uint("intermediate_size")?,
        n_heads,
        n_kv_heads: uint("num_key_value_heads").unwrap_or(n_heads),
        head_dim: uint("head_dim").unwrap_or(dim / n_heads.max(1)),
        vocab_size: uint("vocab_size")?,
        context_length: uint("max_position_embeddings")?,
        rope_theta: v
            .get("rope_theta")
            .and_then(|x| x.as_f64())
            .unwrap_or(10000.0) as f32,
        rms_eps: v
            .get("rms_norm_eps")
            .and_then(|x| x.as_f64())
            .unwrap_or(1e-5) as f32,
        eos_token_ids: ids("eos_token_id"),
        bos_token_id: ids("bos_token_id").first().copied(),
        add_bos,
        qkv_bias: architecture == "qwen2",
        architecture,
    })
}

//! Small deterministic random-weight Llama models, written in the real formats (a GGUF file
//! or a Hugging Face safetensors directory) so tests exercise the same loaders as production.
//!
//! The same spec and seed give the same model in both formats: the safetensors Q/K rows use
//! the Hugging Face half-split rotary layout, the GGUF ones are permuted to the adjacent-pair
//! layout as llama.cpp's converter does.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};

use npufleet_worker::backend::{Matrix, quant};
use npufleet_worker::model::gguf::{self, TensorType, Value, WriteTensor};
use npufleet_worker::model::tokenizer::byte_level_bpe;
use npufleet_worker::model::weights::rotary_half_to_adjacent;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TestModelFormat {
    Gguf,
    Safetensors,
}

/// Storage of the weight matrices (norms are always f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TestWeightType {
    F32,
    F16,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
    #[value(name = "q4_1")]
    Q4_1,
}

#[derive(Clone, Debug, clap::Args)]
pub struct GenTestModelArgs {
    /// GGUF file to write, or the directory for the safetensors format.
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, value_enum, default_value = "gguf")]
    pub format: TestModelFormat,
    #[arg(long, default_value_t = 2)]
    pub layers: usize,
    #[arg(long, default_value_t = 64)]
    pub dim: usize,
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    #[arg(long, default_value_t = 4)]
    pub kv_heads: usize,
    /// FFN width; 0 picks 8/3 · dim rounded up to a multiple of 32.
    #[arg(long, default_value_t = 0)]
    pub ffn: usize,
    #[arg(long, default_value_t = 512)]
    pub vocab: usize,
    #[arg(long, default_value_t = 512)]
    pub context: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Weight storage (the safetensors format takes f32 or f16).
    #[arg(long, value_enum, default_value = "f32")]
    pub weight_type: TestWeightType,
    /// Share the output head with the token embeddings.
    #[arg(long)]
    pub tied: bool,
}

impl GenTestModelArgs {
    /// A spec with the command-line defaults, writing to `out`.
    pub fn new(out: PathBuf, format: TestModelFormat) -> Self {
        GenTestModelArgs {
            out,
            format,
            layers: 2,
            dim: 64,
            heads: 4,
            kv_heads: 4,
            ffn: 0,
            vocab: 512,
            context: 512,
            seed: 1,
            weight_type: TestWeightType::F32,
            tied: false,
        }
    }

    /// A GGUF spec of `layers` layers whose 8 heads and 4 KV heads split over 1, 2 and 4
    /// tensor-parallel ranks; `write_into` names the file.
    pub fn splittable(layers: usize, seed: u64) -> Self {
        GenTestModelArgs {
            layers,
            dim: 128,
            heads: 8,
            kv_heads: 4,
            seed,
            ..GenTestModelArgs::new(PathBuf::new(), TestModelFormat::Gguf)
        }
    }

    fn ffn_dim(&self) -> usize {
        if self.ffn > 0 {
            self.ffn
        } else {
            (self.dim * 8 / 3).div_ceil(32) * 32
        }
    }
}

pub fn run(args: GenTestModelArgs) -> Result<()> {
    let path = write_test_model(&args)?;
    println!("{}", path.display());
    Ok(())
}

const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
/// Text the byte-level merges are learnt from, so common English pieces become tokens.
const MERGE_CORPUS: &str = "the quick brown fox jumps over the lazy dog. hello world! \
    the cat sat on the mat and the dog sat on the log. once upon a time there was a little \
    model that could count 1 2 3 4 5 and say hello to the world in the morning and the evening.";

/// Writes the model and returns its path (the GGUF file or the directory).
pub fn write_test_model(args: &GenTestModelArgs) -> Result<PathBuf> {
    ensure!(
        args.layers > 0 && args.dim > 0 && args.heads > 0 && args.kv_heads > 0,
        "every size must be positive"
    );
    ensure!(
        args.dim.is_multiple_of(args.heads),
        "dim {} is not a multiple of heads {}",
        args.dim,
        args.heads
    );
    ensure!(
        args.heads.is_multiple_of(args.kv_heads),
        "heads {} do not group over kv heads {}",
        args.heads,
        args.kv_heads
    );
    ensure!(
        (args.dim / args.heads).is_multiple_of(2),
        "head_dim must be even"
    );
    let min_vocab = SPECIAL_TOKENS.len() + 256;
    ensure!(
        args.vocab >= min_vocab,
        "vocab must be at least {min_vocab} (specials + 256 bytes)"
    );
    let vocab = vocabulary(args.vocab);
    let w = random_weights(args);
    match args.format {
        TestModelFormat::Gguf => write_gguf(args, &w, &vocab)?,
        TestModelFormat::Safetensors => write_safetensors(args, &w, &vocab)?,
    }
    Ok(args.out.clone())
}

/// A byte-level BPE vocabulary: tokens (specials, the 256 byte symbols, learnt merges,
/// reserved padding), merges, and GGUF token types.
struct Vocabulary {
    tokens: Vec<String>,
    merges: Vec<String>,
    types: Vec<i32>,
}

fn vocabulary(size: usize) -> Vocabulary {
    let byte_chars = byte_chars();
    let mut tokens: Vec<String> = SPECIAL_TOKENS.iter().map(|s| s.to_string()).collect();
    let mut types = vec![3; SPECIAL_TOKENS.len()];
    tokens.extend(byte_chars.iter().map(|c| c.to_string()));
    types.extend(std::iter::repeat_n(1, 256));
    let mut words: Vec<Vec<String>> = MERGE_CORPUS
        .split(' ')
        .enumerate()
        .map(|(i, w)| {
            let text = if i == 0 {
                w.to_string()
            } else {
                format!(" {w}")
            };
            text.bytes()
                .map(|b| byte_chars[b as usize].to_string())
                .collect()
        })
        .collect();
    let mut merges = Vec::new();
    while tokens.len() < size {
        let mut counts: std::collections::BTreeMap<(String, String), usize> = Default::default();
        for w in &words {
            for p in w.windows(2) {
                *counts.entry((p[0].clone(), p[1].clone())).or_default() += 1;
            }
        }
        let Some(((a, b), _)) = counts
            .into_iter()
            .max_by(|x, y| x.1.cmp(&y.1).then(y.0.cmp(&x.0)))
        else {
            break;
        };
        let merged = format!("{a}{b}");
        for w in &mut words {
            let mut i = 0;
            while i + 1 < w.len() {
                if w[i] == a && w[i + 1] == b {
                    w[i] = merged.clone();
                    w.remove(i + 1);
                }
                i += 1;
            }
        }
        merges.push(format!("{a} {b}"));
        tokens.push(merged);
        types.push(1);
    }
    while tokens.len() < size {
        tokens.push(format!("<|reserved_{}|>", tokens.len()));
        types.push(3);
    }
    Vocabulary {
        tokens,
        merges,
        types,
    }
}

fn byte_chars() -> Vec<char> {
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            if matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff) {
                b as char
            } else {
                let c = char::from_u32(next).expect("valid char");
                next += 1;
                c
            }
        })
        .collect()
}

/// SplitMix64: a tiny fixed generator, so a seed means the same weights on every platform.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [−1, 1).
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Weights in Hugging Face layout, named by their GGUF names.
struct RandomWeights {
    tensors: Vec<(String, Matrix)>,
}

fn random_weights(a: &GenTestModelArgs) -> RandomWeights {
    let mut rng = Rng(a.seed);
    let hd = a.dim / a.heads;
    let ffn = a.ffn_dim();
    let mut matrix = |rows: usize, cols: usize| {
        // Uniform with variance 1/cols keeps activations near unit scale through the layers.
        let scale = (3.0 / cols as f32).sqrt();
        Matrix::f32(
            rows,
            cols,
            (0..rows * cols).map(|_| rng.uniform() * scale).collect(),
        )
    };
    let mut tensors = vec![("token_embd.weight".to_string(), matrix(a.vocab, a.dim))];
    for l in 0..a.layers {
        let n = |t: &str| format!("blk.{l}.{t}.weight");
        tensors.push((n("attn_q"), matrix(a.heads * hd, a.dim)));
        tensors.push((n("attn_k"), matrix(a.kv_heads * hd, a.dim)));
        tensors.push((n("attn_v"), matrix(a.kv_heads * hd, a.dim)));
        tensors.push((n("attn_output"), matrix(a.dim, a.heads * hd)));
        tensors.push((n("ffn_gate"), matrix(ffn, a.dim)));
        tensors.push((n("ffn_up"), matrix(ffn, a.dim)));
        tensors.push((n("ffn_down"), matrix(a.dim, ffn)));
    }
    if !a.tied {
        tensors.push(("output.weight".to_string(), matrix(a.vocab, a.dim)));
    }
    let mut norm = || {
        Matrix::f32(
            1,
            a.dim,
            (0..a.dim).map(|_| 1.0 + 0.1 * rng.uniform()).collect(),
        )
    };
    for l in 0..a.layers {
        tensors.push((format!("blk.{l}.attn_norm.weight"), norm()));
        tensors.push((format!("blk.{l}.ffn_norm.weight"), norm()));
    }
    tensors.push(("output_norm.weight".to_string(), norm()));
    RandomWeights { tensors }
}

fn write_gguf(a: &GenTestModelArgs, w: &RandomWeights, vocab: &Vocabulary) -> Result<()> {
    let hd = a.dim / a.heads;
    let s = |v: &str| Value::String(v.to_string());
    let u = |v: usize| Value::U32(v as u32);
    let metadata = vec![
        ("general.architecture".to_string(), s("llama")),
        ("general.name".to_string(), s("npufleet random test model")),
        ("llama.block_count".to_string(), u(a.layers)),
        ("llama.context_length".to_string(), u(a.context)),
        ("llama.embedding_length".to_string(), u(a.dim)),
        ("llama.feed_forward_length".to_string(), u(a.ffn_dim())),
        ("llama.attention.head_count".to_string(), u(a.heads)),
        ("llama.attention.head_count_kv".to_string(), u(a.kv_heads)),
        ("llama.rope.freq_base".to_string(), Value::F32(10000.0)),
        ("llama.rope.dimension_count".to_string(), u(hd)),
        (
            "llama.attention.layer_norm_rms_epsilon".to_string(),
            Value::F32(1e-5),
        ),
        ("llama.vocab_size".to_string(), u(a.vocab)),
        ("tokenizer.ggml.model".to_string(), s("gpt2")),
        ("tokenizer.ggml.pre".to_string(), s("smollm")),
        (
            "tokenizer.ggml.tokens".to_string(),
            Value::Array(vocab.tokens.iter().map(|t| s(t)).collect()),
        ),
        (
            "tokenizer.ggml.token_type".to_string(),
            Value::Array(vocab.types.iter().map(|&t| Value::I32(t)).collect()),
        ),
        (
            "tokenizer.ggml.merges".to_string(),
            Value::Array(vocab.merges.iter().map(|m| s(m)).collect()),
        ),
        ("tokenizer.ggml.bos_token_id".to_string(), Value::U32(1)),
        ("tokenizer.ggml.eos_token_id".to_string(), Value::U32(2)),
        (
            "tokenizer.ggml.add_bos_token".to_string(),
            Value::Bool(false),
        ),
        ("tokenizer.chat_template".to_string(), s(CHATML_TEMPLATE)),
    ];
    let mut tensors = Vec::new();
    for (name, m) in &w.tensors {
        let m = if name.ends_with("attn_q.weight") {
            rotary_half_to_adjacent(m, a.heads, hd)
        } else if name.ends_with("attn_k.weight") {
            rotary_half_to_adjacent(m, a.kv_heads, hd)
        } else {
            m.clone()
        };
        let values = m.to_f32();
        let is_norm = m.rows == 1;
        let ty = match a.weight_type {
            _ if is_norm => TensorType::F32,
            TestWeightType::F32 => TensorType::F32,
            TestWeightType::F16 => TensorType::F16,
            _ if !m.cols.is_multiple_of(quant::QK) => {
                bail!("{name}: {} columns cannot be block-quantised", m.cols)
            }
            TestWeightType::Q8_0 => TensorType::Q8_0,
            TestWeightType::Q4_0 => TensorType::Q4_0,
            TestWeightType::Q4_1 => TensorType::Q4_1,
        };
        let data = match ty {
            TensorType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            TensorType::F16 => values
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes())
                .collect(),
            TensorType::Q8_0 => quant::q8_0_bytes(&quant::quantize_q8_0(&values)),
            TensorType::Q4_0 => quant::q4_0_bytes(&quant::quantize_q4_0(&values)),
            TensorType::Q4_1 => quant::q4_1_bytes(&quant::quantize_q4_1(&values)),
            TensorType::Bf16
            | TensorType::Q5_0
            | TensorType::Q5_1
            | TensorType::Q4K
            | TensorType::Q5K
            | TensorType::Q6K => {
                unreachable!("not offered")
            }
        };
        let dims = if is_norm {
            vec![m.cols as u64]
        } else {
            vec![m.cols as u64, m.rows as u64]
        };
        tensors.push(WriteTensor {
            name: name.clone(),
            dims,
            ty,
            data,
        });
    }
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    gguf::write(&a.out, &metadata, &tensors)
}

fn hf_name(name: &str) -> String {
    match name {
        "token_embd.weight" => "model.embed_tokens.weight".into(),
        "output_norm.weight" => "model.norm.weight".into(),
        "output.weight" => "lm_head.weight".into(),
        _ => {
            let rest = name.strip_prefix("blk.").expect("layer tensor");
            let (layer, tensor) = rest.split_once('.').expect("layer tensor");
            let hf = match tensor {
                "attn_norm.weight" => "input_layernorm.weight",
                "attn_q.weight" => "self_attn.q_proj.weight",
                "attn_k.weight" => "self_attn.k_proj.weight",
                "attn_v.weight" => "self_attn.v_proj.weight",
                "attn_output.weight" => "self_attn.o_proj.weight",
                "ffn_norm.weight" => "post_attention_layernorm.weight",
                "ffn_gate.weight" => "mlp.gate_proj.weight",
                "ffn_up.weight" => "mlp.up_proj.weight",
                _ => "mlp.down_proj.weight",
            };
            format!("model.layers.{layer}.{hf}")
        }
    }
}

fn write_safetensors(a: &GenTestModelArgs, w: &RandomWeights, vocab: &Vocabulary) -> Result<()> {
    let dir = &a.out;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let (dtype, elem) = match a.weight_type {
        TestWeightType::F32 => (safetensors::Dtype::F32, 4),
        TestWeightType::F16 => (safetensors::Dtype::F16, 2),
        other => bail!("the safetensors format stores f32 or f16 weights, not {other:?}"),
    };
    let encoded: Vec<(String, Vec<usize>, Vec<u8>)> = w
        .tensors
        .iter()
        .map(|(name, m)| {
            let values = m.to_f32();
            let data: Vec<u8> = if elem == 4 || m.rows == 1 {
                values.iter().flat_map(|v| v.to_le_bytes()).collect()
            } else {
                values
                    .iter()
                    .flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes())
                    .collect()
            };
            let shape = if m.rows == 1 {
                vec![m.cols]
            } else {
                vec![m.rows, m.cols]
            };
            (hf_name(name), shape, data)
        })
        .collect();
    let views = encoded
        .iter()
        .map(|(name, shape, data)| {
            let dt = if data.len() == shape.iter().product::<usize>() * 4 {
                safetensors::Dtype::F32
            } else {
                dtype
            };
            safetensors::tensor::TensorView::new(dt, shape.clone(), data).map(|v| (name.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors"))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": a.dim,
        "intermediate_size": a.ffn_dim(),
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "vocab_size": a.vocab,
        "max_position_embeddings": a.context,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": a.tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": if elem == 4 { "float32" } else { "float16" },
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    let added: Vec<(u32, bool)> = vocab
        .types
        .iter()
        .enumerate()
        .filter(|(_, t)| **t == 3)
        .map(|(i, _)| (i as u32, true))
        .collect();
    byte_level_bpe(&vocab.tokens, &vocab.merges, &added, "smollm")?
        .save(dir.join("tokenizer.json"), true)
        .map_err(|e| anyhow::anyhow!("writing tokenizer.json: {e}"))?;
    let tokenizer_config = serde_json::json!({
        "chat_template": CHATML_TEMPLATE,
        "bos_token": SPECIAL_TOKENS[1],
        "eos_token": SPECIAL_TOKENS[2],
        "add_bos_token": false,
    });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tokenizer_config)?,
    )?;
    Ok(())
}

/// Writes a model into `dir` and returns its path: `model.gguf` or the directory itself.
pub fn write_into(dir: &Path, mut spec: GenTestModelArgs) -> Result<PathBuf> {
    spec.out = match spec.format {
        TestModelFormat::Gguf => dir.join("model.gguf"),
        TestModelFormat::Safetensors => dir.to_path_buf(),
    };
    write_test_model(&spec)
}

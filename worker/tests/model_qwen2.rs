//! The Qwen2 architecture (the DeepSeek-R1-Distill-Qwen models) on small random-weight
//! models written by `tests/reference/qwen2_model.py` the way llama.cpp's converter writes
//! Qwen2: agreement with the independent numpy forward pass (Q/K/V biases, NEOX rotary
//! pairs, tied and separate output heads, f32 and q8_0), the Hugging Face BF16 directory of
//! the same weights, tensor parallelism, the qwen2 pre-tokenizer and the real Qwen2.5 and
//! DeepSeek-R1-Distill chat templates.

mod model_support;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use model_support::*;
use npufleet_worker::model::tokenizer::render_chat_template;
use npufleet_worker::model::{Model, PrecisionPolicy, WeightPrecision};
use npufleet_worker::tools::tp_bench::generate_in_process;

const GEN: usize = 8;

/// Tight: the engine and numpy compute the same f32 model, only the summation order differs.
const LOGIT_TOLERANCE: f32 = 1e-3;

fn models_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("temporary directory")
    })
    .path()
}

fn template(name: &str) -> PathBuf {
    reference_script(&format!("templates/{name}"))
}

/// The model variants, written once per test process.
fn variant(name: &str) -> PathBuf {
    static WRITTEN: OnceLock<std::sync::Mutex<()>> = OnceLock::new();
    let _one_writer = WRITTEN
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let path = models_dir().join(format!("{name}.gguf"));
    if path.exists() {
        return path;
    }
    let qwen = template("qwen2.5-instruct.jinja");
    let qwen = qwen.to_str().unwrap();
    let hf_dir = models_dir().join("hf");
    let args: Vec<&str> = match name {
        "f32" => vec!["--weights", "f32", "--template", qwen],
        "f32-tied" => vec![
            "--weights",
            "f32",
            "--tied",
            "--template",
            qwen,
            "--hf-dir",
            hf_dir.to_str().unwrap(),
        ],
        "q8_0-tied" => vec!["--weights", "q8_0", "--tied", "--template", qwen],
        other => panic!("no variant {other}"),
    };
    write_qwen2_model(&path, &args)
}

fn prompts(model: &Model) -> Vec<Vec<u32>> {
    [
        "the quick brown fox",
        "<|im_start|>user\nhello world 12<|im_end|>\n<|im_start|>assistant\n",
        "a",
    ]
    .iter()
    .map(|p| model.tokenizer().encode(p))
    .collect()
}

/// Greedy ids equal the reference's and the reference's top logits agree within the
/// tolerance; returns the largest difference.
fn assert_matches_reference(path: &Path, policy: PrecisionPolicy) -> f32 {
    let model = load(path, policy);
    let prompts = prompts(&model);
    let reference = numpy_reference(path, &prompts, GEN);
    let mut max_diff = 0f32;
    for (prompt, steps) in prompts.iter().zip(&reference) {
        let forced: Vec<u32> = steps.iter().map(|s| s.token).collect();
        let (greedy_ids, _) = greedy(&model, prompt, GEN, WeightPrecision::Full);
        assert_eq!(
            greedy_ids,
            forced,
            "{}: greedy decoding of {prompt:?} follows numpy",
            path.display()
        );
        for (s, logits) in steps.iter().zip(forced_logits(
            &model,
            prompt,
            &forced,
            WeightPrecision::Full,
        )) {
            let what = path.display().to_string();
            let diff = top_logits_diff(&logits, s, LOGIT_TOLERANCE, &what);
            max_diff = max_diff.max(diff);
        }
        let distinct: std::collections::HashSet<_> = forced.iter().collect();
        assert!(
            distinct.len() > 1 || prompt.len() == 1,
            "a constant generation proves little: {forced:?}"
        );
    }
    max_diff
}

#[test]
fn gguf_config_reads_the_qwen2_metadata() {
    let model = load(&variant("f32"), PrecisionPolicy::Fp32);
    let cfg = model.config();
    assert_eq!(cfg.architecture, "qwen2");
    assert!(cfg.qkv_bias);
    assert_eq!(
        (
            cfg.n_layers,
            cfg.dim,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.head_dim
        ),
        (2, 64, 4, 2, 16)
    );
    assert_eq!((cfg.rope_theta, cfg.rms_eps), (1e6, 1e-6));
    let im_end = model.tokenizer().token_id("<|im_end|>").unwrap();
    assert!(cfg.eos_token_ids.contains(&im_end));
}

#[test]
fn f32_models_match_the_numpy_reference() {
    for name in ["f32", "f32-tied"] {
        let max_diff = assert_matches_reference(&variant(name), PrecisionPolicy::Fp32);
        eprintln!("{name}: max |Δlogit| vs numpy {max_diff:.2e}");
    }
}

#[test]
fn q8_0_model_matches_the_numpy_reference_and_int8_agrees_on_top1() {
    let path = variant("q8_0-tied");
    let max_diff = assert_matches_reference(&path, PrecisionPolicy::Fp32);
    // The int8 path also quantises activations: compared on the reference's tokens.
    let model = load(&path, PrecisionPolicy::Int8);
    let prompts = prompts(&model);
    let reference = numpy_reference(&path, &prompts, GEN);
    let (mut same, mut positions, mut int8_diff) = (0, 0, 0f32);
    for (prompt, steps) in prompts.iter().zip(&reference) {
        let forced: Vec<u32> = steps.iter().map(|s| s.token).collect();
        for (s, logits) in steps.iter().zip(forced_logits(
            &model,
            prompt,
            &forced,
            WeightPrecision::Int8,
        )) {
            positions += 1;
            same += usize::from(argmax(&logits) == s.token);
            int8_diff = s
                .top_ids
                .iter()
                .zip(&s.top_logits)
                .map(|(&id, &want)| (logits[id as usize] - want).abs())
                .fold(int8_diff, f32::max);
        }
    }
    eprintln!(
        "q8_0: f32 path max |Δlogit| {max_diff:.2e}; int8 path top-1 {same}/{positions}, max |Δlogit| {int8_diff:.2e}"
    );
    assert!(int8_diff < 0.1, "int8 logits drift by {int8_diff}");
    assert!(same * 10 >= positions * 8, "int8 top-1 {same}/{positions}");
}

#[test]
fn hugging_face_bf16_directory_computes_the_same_logits() {
    let gguf = load(&variant("f32-tied"), PrecisionPolicy::Fp32);
    let dir = models_dir().join("hf");
    // The directory needs a tokenizer.json; the GGUF vocabulary provides it.
    gguf.tokenizer()
        .hf()
        .save(dir.join("tokenizer.json"), false)
        .unwrap();
    let hf = load(&dir, PrecisionPolicy::Fp32);
    assert_eq!(hf.config().architecture, "qwen2");
    assert!(hf.config().qkv_bias);
    let prompt = gguf.tokenizer().encode("the quick brown fox jumps");
    let (a, la) = greedy(&gguf, &prompt, GEN, WeightPrecision::Full);
    let (b, lb) = greedy(&hf, &prompt, GEN, WeightPrecision::Full);
    assert_eq!(a, b);
    let max_diff = la
        .iter()
        .flatten()
        .zip(lb.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    eprintln!("hf bf16 vs gguf f32 (same values): max |Δlogit| {max_diff:.2e}");
    assert!(max_diff < 1e-4, "{max_diff}");
}

#[test]
fn tensor_parallel_ranks_split_the_biases_with_their_rows() {
    let path = variant("f32");
    let prompt = "hello world 12";
    let one = generate_in_process(&path, 1, PrecisionPolicy::Fp32, prompt, 12).unwrap();
    let two = generate_in_process(&path, 2, PrecisionPolicy::Fp32, prompt, 12).unwrap();
    assert_eq!(one.tokens, two.tokens);
    let distinct: std::collections::HashSet<_> = one.tokens.iter().collect();
    assert!(distinct.len() > 2, "{:?}", one.tokens);
}

#[test]
fn qwen2_pre_tokenizer_keeps_digits_apart() {
    let model = load(&variant("f32"), PrecisionPolicy::Fp32);
    let tok = model.tokenizer();
    let id = |t: &str| {
        tok.token_id(t)
            .unwrap_or_else(|| panic!("{t} in vocabulary"))
    };
    // " 12" is a learnt merge (GPT-2's split would keep it whole), yet Qwen2 splits the
    // space and every digit apart before the merges apply.
    assert!(tok.token_id("Ġ12").is_some());
    assert_eq!(tok.encode(" 12"), vec![id("Ġ"), id("1"), id("2")]);
    assert_eq!(
        tok.encode("<|im_start|>1<think>"),
        vec![id("<|im_start|>"), id("1"), id("<think>")]
    );
    for text in ["hello world 12 34!\n\n  the cat's mat", "ünïcode 思考 12"] {
        assert_eq!(tok.decode(&tok.encode(text)), text);
    }
}

fn read_template(name: &str) -> String {
    std::fs::read_to_string(template(name)).unwrap()
}

#[test]
fn real_qwen2_5_chat_template_renders() {
    let t = read_template("qwen2.5-instruct.jinja");
    let text = render_chat_template(&t, &messages(&[("user", "hi")]), true, "", "").unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    let conversation = messages(&[
        ("system", "Be brief."),
        ("user", "1+1?"),
        ("assistant", "2"),
        ("user", "2+2?"),
    ]);
    let text = render_chat_template(&t, &conversation, true, "", "").unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn real_deepseek_r1_distill_chat_template_renders() {
    let t = read_template("deepseek-r1-distill-qwen.jinja");
    let conversation = messages(&[
        ("system", "Be brief."),
        ("user", "1+1?"),
        ("assistant", "<think>\nadd\n</think>\n\n2"),
        ("user", "2+2?"),
    ]);
    let bos = "<｜begin▁of▁sentence｜>";
    let text = render_chat_template(&t, &conversation, true, bos, "").unwrap();
    // Earlier answers lose their reasoning (`split('</think>')[-1]`); the prompt opens a new
    // `<think>` block.
    assert_eq!(
        text,
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>1+1?<｜Assistant｜>\n\n2<｜end▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜><think>\n"
    );
}

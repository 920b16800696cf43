//! Code shared by the model tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use npufleet_worker::api::{
    FinishReason, GenerationEvent, GenerationStream, RequestTimings, Usage,
};

use npufleet_worker::backend::KvDtype;
use npufleet_worker::model::{
    ChatMessage, KvCache, LoadOptions, Model, PrecisionPolicy, SequenceChunk, WeightPrecision,
};

/// Logits after the prompt and after each of `forced` but the last (teacher forcing), so
/// one early difference cannot cascade into every later comparison. The cache is f32, as
/// the numpy reference computes.
pub fn forced_logits(
    model: &Model,
    prompt: &[u32],
    forced: &[u32],
    precision: WeightPrecision,
) -> Vec<Vec<f32>> {
    forced_logits_kv(model, prompt, forced, precision, KvDtype::F32)
}

/// [`forced_logits`] with a KV cache of `kv_dtype`.
pub fn forced_logits_kv(
    model: &Model,
    prompt: &[u32],
    forced: &[u32],
    precision: WeightPrecision,
    kv_dtype: KvDtype,
) -> Vec<Vec<f32>> {
    let blocks = (prompt.len() + forced.len()).div_ceil(BLOCK);
    let mut kv = model.new_kv_cache(blocks, BLOCK, kv_dtype);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut step = |tokens: &[u32], start_pos| {
        model
            .forward(
                &mut kv,
                &[SequenceChunk {
                    tokens,
                    start_pos,
                    block_table: &table,
                    want_logits: true,
                    precision,
                }],
            )
            .unwrap()
            .remove(0)
    };
    let mut out = vec![step(prompt, 0)];
    for (i, &t) in forced[..forced.len() - 1].iter().enumerate() {
        out.push(step(&[t], prompt.len() + i));
    }
    out
}

/// Chat messages from `(role, content)` pairs.
pub fn messages(list: &[(&str, &str)]) -> Vec<ChatMessage> {
    list.iter()
        .map(|(role, content)| ChatMessage {
            role: role.to_string(),
            content: content.to_string(),
        })
        .collect()
}

pub fn repo_root() -> PathBuf {
    // Read at run time: build outputs are shared between checkouts, so a path compiled in
    // could name another checkout.
    Path::new(&std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
        .parent()
        .expect("worker sits in the repository")
        .to_path_buf()
}

/// Runs a `tests/setup` script and returns the path it prints.
pub fn setup_path(script: &str) -> PathBuf {
    setup_path_with(script, &[])
}

/// As [`setup_path`], with arguments.
pub fn setup_path_with(script: &str, args: &[&str]) -> PathBuf {
    let root = repo_root();
    let out = run_ok(
        Command::new("bash")
            .arg(root.join("tests/setup").join(script))
            .args(args)
            .current_dir(&root),
        script,
    );
    PathBuf::from(String::from_utf8(out).expect("utf-8 path").trim())
}

/// Runs `command` to its end and returns its standard output; fails the test, showing the
/// standard error, when `what` does not succeed.
pub fn run_ok(command: &mut Command, what: &str) -> Vec<u8> {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("running {what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

pub fn smollm2_path() -> PathBuf {
    setup_path("model.sh")
}

pub fn load(path: &Path, policy: PrecisionPolicy) -> Model {
    Model::load(
        path,
        LoadOptions {
            policy,
            threads: 2,
            collective: None,
            backend: None,
        },
    )
    .expect("model loads")
}

pub const BLOCK: usize = 16;

/// Greedy decoding of `n` tokens after `prompt` (prefilled in one chunk), returning the
/// tokens and the logits each was chosen from. The cache is f32, as the numpy reference
/// computes.
pub fn greedy(
    model: &Model,
    prompt: &[u32],
    n: usize,
    precision: WeightPrecision,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    greedy_kv(model, prompt, n, precision, KvDtype::F32)
}

/// [`greedy`] with a KV cache of `kv_dtype`.
pub fn greedy_kv(
    model: &Model,
    prompt: &[u32],
    n: usize,
    precision: WeightPrecision,
    kv_dtype: KvDtype,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let total = prompt.len() + n;
    let blocks = total.div_ceil(BLOCK);
    let mut kv: KvCache = model.new_kv_cache(blocks, BLOCK, kv_dtype);
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let mut logits = model
        .forward(
            &mut kv,
            &[SequenceChunk {
                tokens: prompt,
                start_pos: 0,
                block_table: &table,
                want_logits: true,
                precision,
            }],
        )
        .expect("prefill")
        .remove(0);
    let (mut tokens, mut all) = (Vec::new(), Vec::new());
    for i in 0..n {
        let next = argmax(&logits);
        tokens.push(next);
        all.push(std::mem::take(&mut logits));
        if i + 1 == n {
            break;
        }
        logits = model
            .forward(
                &mut kv,
                &[SequenceChunk {
                    tokens: &[next],
                    start_pos: prompt.len() + i,
                    block_table: &table,
                    want_logits: true,
                    precision,
                }],
            )
            .expect("decode")
            .remove(0);
    }
    (tokens, all)
}

pub fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &x)| {
            if x > best.1 { (i, x) } else { best }
        })
        .0 as u32
}

/// The test environment's python (with `gguf` and numpy).
pub fn python() -> PathBuf {
    setup_path("python-env.sh")
}

pub fn reference_script(name: &str) -> PathBuf {
    Path::new(&std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
        .join("tests/reference")
        .join(name)
}

/// Writes the random Qwen2 GGUF file `out` with `tests/reference/qwen2_model.py` and its
/// `args` (`--weights`, `--tied`, `--template`, `--hf-dir`).
pub fn write_qwen2_model(out: &Path, args: &[&str]) -> PathBuf {
    run_ok(
        Command::new(python())
            .arg(reference_script("qwen2_model.py"))
            .arg(out)
            .args(args),
        "qwen2_model.py",
    );
    out.to_path_buf()
}

/// One greedy step of the numpy reference.
pub struct RefStep {
    pub token: u32,
    pub top_ids: Vec<u32>,
    pub top_logits: Vec<f32>,
}

/// Checks each of the reference's top logits at one step against `logits`, within
/// `tolerance` (`what` names the model in a failure); returns the largest difference.
pub fn top_logits_diff(logits: &[f32], step: &RefStep, tolerance: f32, what: &str) -> f32 {
    let mut max_diff = 0f32;
    for (&id, &want) in step.top_ids.iter().zip(&step.top_logits) {
        let diff = (logits[id as usize] - want).abs();
        max_diff = max_diff.max(diff);
        assert!(
            diff <= tolerance,
            "{what}: logit of token {id}: {} vs numpy {want}",
            logits[id as usize]
        );
    }
    max_diff
}

/// Greedy decoding of `n_gen` tokens after each prompt by `tests/reference/llama_numpy.py`.
pub fn numpy_reference(model: &Path, prompts: &[Vec<u32>], n_gen: usize) -> Vec<Vec<RefStep>> {
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let dir = tempfile::tempdir_in(&tmp).expect("temporary directory");
    let prompts_file = dir.path().join("prompts.json");
    std::fs::write(&prompts_file, serde_json::to_string(prompts).unwrap()).unwrap();
    let out = run_ok(
        Command::new(python())
            .arg(reference_script("llama_numpy.py"))
            .arg(model)
            .arg(&prompts_file)
            .arg(n_gen.to_string())
            .arg(tmp.join("llama-numpy-cache")),
        "the numpy reference",
    );
    let path = String::from_utf8(out).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path.trim()).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    json["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r["steps"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| RefStep {
                    token: s["token"].as_u64().unwrap() as u32,
                    top_ids: ids(&s["top_ids"]),
                    top_logits: s["top_logits"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|v| v.as_f64().unwrap() as f32)
                        .collect(),
                })
                .collect()
        })
        .collect()
}

/// What one request's stream carried.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub tokens: Vec<u32>,
    pub text: String,
    pub reason: FinishReason,
    pub usage: Usage,
    pub timings: RequestTimings,
}

/// Reads a stream to its end; panics on a failure event, a stream that ends early, or no
/// event within `deadline`.
pub fn collect_within(stream: GenerationStream, deadline: Duration) -> Outcome {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let mut stream = stream;
        let mut tokens = Vec::new();
        let mut text = String::new();
        loop {
            let event = tokio::time::timeout(deadline, stream.recv())
                .await
                .expect("timed out waiting for an event")
                .expect("the stream ended without a final event");
            match event {
                GenerationEvent::Token {
                    token_id,
                    text: piece,
                } => {
                    tokens.push(token_id);
                    text.push_str(&piece);
                }
                GenerationEvent::Finished {
                    reason,
                    usage,
                    timings,
                } => {
                    return Outcome {
                        tokens,
                        text,
                        reason,
                        usage,
                        timings,
                    };
                }
                GenerationEvent::Failed { message } => panic!("request failed: {message}"),
            }
        }
    })
}

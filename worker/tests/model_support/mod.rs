//! Code shared by the model tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use npufleet_worker::model::{
    KvCache, LoadOptions, Model, PrecisionPolicy, SequenceChunk, WeightPrecision,
};

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
    let root = repo_root();
    let out = Command::new("bash")
        .arg(root.join("tests/setup").join(script))
        .current_dir(&root)
        .output()
        .unwrap_or_else(|e| panic!("running {script}: {e}"));
    assert!(
        out.status.success(),
        "{script} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).expect("utf-8 path").trim())
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
/// tokens and the logits each was chosen from.
pub fn greedy(
    model: &Model,
    prompt: &[u32],
    n: usize,
    precision: WeightPrecision,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let total = prompt.len() + n;
    let blocks = total.div_ceil(BLOCK);
    let mut kv: KvCache = model.new_kv_cache(blocks, BLOCK);
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

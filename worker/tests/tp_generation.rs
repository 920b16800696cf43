//! Tensor-parallel greedy generation is token-for-token the same as TP 1, with ranks as
//! threads (in-process ring) and as separate processes (TCP ring from a real rank table).

mod model_support;

use std::path::{Path, PathBuf};

use model_support::smollm2_path as smollm2;
use npufleet_worker::model::PrecisionPolicy;
use npufleet_worker::tools::collective_bench;
use npufleet_worker::tools::tp_bench::generate_in_process;
use npufleet_worker_testkit::testmodel::{GenTestModelArgs, write_into};

const PROMPT: &str = "the quick brown fox jumps over the lazy dog";

/// A random-weight model whose 8 heads and 4 KV heads split over 1, 2 and 4 ranks.
fn random_model(dir: &Path) -> PathBuf {
    write_into(dir, GenTestModelArgs::splittable(3, 7)).unwrap()
}

fn generate_in_processes(model: &Path, world_size: usize, tokens: usize) -> Vec<u32> {
    let worker = Path::new(env!("CARGO_BIN_EXE_npufleet-worker"));
    collective_bench::generate_in_processes(worker, model, world_size, "fp32", PROMPT, tokens)
        .unwrap()
        .tokens
}

#[test]
fn random_model_generates_the_same_tokens_at_tp_1_2_and_4() {
    let dir = tempfile::tempdir().unwrap();
    let model = random_model(dir.path());
    for policy in [PrecisionPolicy::Fp32, PrecisionPolicy::Int8] {
        let baseline = generate_in_process(&model, 1, policy, PROMPT, 24).unwrap();
        assert_eq!(baseline.tokens.len(), 24);
        let distinct: std::collections::HashSet<_> = baseline.tokens.iter().collect();
        assert!(
            distinct.len() >= 4,
            "a degenerate generation proves little: {:?}",
            baseline.tokens
        );
        for tp in [2, 4] {
            let sharded = generate_in_process(&model, tp, policy, PROMPT, 24).unwrap();
            assert_eq!(sharded.tokens, baseline.tokens, "{policy:?} TP {tp}");
            assert!(sharded.decode_comm_seconds > 0.0);
        }
    }
}

#[test]
fn heads_that_do_not_split_evenly_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = random_model(dir.path());
    let err = generate_in_process(&model, 3, PrecisionPolicy::Fp32, PROMPT, 4).unwrap_err();
    let message = format!("{err:#}");
    assert!(
        message.contains("do not split evenly over tensor-parallel degree 3"),
        "{message}"
    );
}

#[test]
fn smollm2_generates_the_same_tokens_at_tp_1_and_3() {
    let model = smollm2();
    let baseline = generate_in_process(&model, 1, PrecisionPolicy::Fp32, PROMPT, 16).unwrap();
    let sharded = generate_in_process(&model, 3, PrecisionPolicy::Fp32, PROMPT, 16).unwrap();
    assert_eq!(sharded.tokens, baseline.tokens);
    let text = npufleet_worker::model::Model::load(
        &model,
        npufleet_worker::model::LoadOptions {
            policy: PrecisionPolicy::Fp32,
            threads: 1,
            collective: None,
            backend: None,
        },
    )
    .unwrap()
    .tokenizer()
    .decode(&baseline.tokens);
    assert!(
        text.split_whitespace().count() >= 3,
        "expected a few words, got {text:?}"
    );
}

#[test]
fn separate_processes_generate_the_same_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let model = random_model(dir.path());
    let baseline = generate_in_process(&model, 1, PrecisionPolicy::Fp32, PROMPT, 12)
        .unwrap()
        .tokens;
    assert_eq!(generate_in_processes(&model, 2, 12), baseline);
    assert_eq!(generate_in_processes(&model, 4, 12), baseline);
    let smollm2 = smollm2();
    let baseline = generate_in_process(&smollm2, 1, PrecisionPolicy::Fp32, PROMPT, 8)
        .unwrap()
        .tokens;
    assert_eq!(generate_in_processes(&smollm2, 3, 8), baseline);
}

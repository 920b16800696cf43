//! The `npufleet-gen-test-model` command line writes a model the worker loads, prints its
//! path, and refuses a spec it cannot write.

use std::process::Command;

use npufleet_worker::model::{LoadOptions, Model, PrecisionPolicy};

const GEN_TEST_MODEL: &str = env!("CARGO_BIN_EXE_npufleet-gen-test-model");

#[test]
fn command_line_writes_a_loadable_model() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tiny.gguf");
    let written = Command::new(GEN_TEST_MODEL)
        .args(["--format", "gguf", "--layers", "1"])
        .args(["--dim", "32", "--heads", "2", "--kv-heads", "1"])
        .args(["--vocab", "300", "--seed", "3", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        written.status.success(),
        "{}",
        String::from_utf8_lossy(&written.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&written.stdout).trim(),
        out.display().to_string()
    );
    let options = LoadOptions {
        policy: PrecisionPolicy::Fp32,
        threads: 1,
        collective: None,
        backend: None,
    };
    let model = Model::load(&out, options).expect("the written model loads");
    let config = model.config();
    assert_eq!(
        (config.n_layers, config.dim, config.vocab_size),
        (1, 32, 300)
    );

    let bad = Command::new(GEN_TEST_MODEL)
        .args(["--vocab", "10", "--out"])
        .arg(dir.path().join("x.gguf"))
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("vocab must be at least"));
}

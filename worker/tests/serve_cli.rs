//! Start-up failures of `npufleet-worker serve` name the problem and exit nonzero.

use std::process::Command;

fn serve(args: &[&str]) -> (i32, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_npufleet-worker"))
        .arg("serve")
        .args(args)
        .env_remove("NPUFLEET_MODEL")
        .output()
        .expect("running npufleet-worker");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn unknown_flags_and_values_are_named() {
    let (code, stderr) = serve(&["--model", "m.gguf", "--no-such-flag"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("--no-such-flag"), "{stderr}");

    let (code, stderr) = serve(&["--model", "m.gguf", "--precision", "int4"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("int4"), "{stderr}");

    let (code, stderr) = serve(&["--model", "m.gguf", "--grpc-addr", "nowhere"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("nowhere"), "{stderr}");
}

#[test]
fn an_unreadable_model_is_named() {
    let (code, stderr) = serve(&["--model", "/nonexistent/model.gguf"]);
    assert_ne!(code, 0);
    assert!(
        stderr.contains("cannot read the model at '/nonexistent/model.gguf'"),
        "{stderr}"
    );

    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("garbage.gguf");
    std::fs::write(&garbage, b"not a model").unwrap();
    let (code, stderr) = serve(&["--model", garbage.to_str().unwrap(), "--accelerator", "cpu"]);
    assert_ne!(code, 0);
    assert!(stderr.contains("cannot load the model"), "{stderr}");
}

#[test]
fn bad_prefix_templates_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let model = npufleet_worker_testkit::testmodel::write_test_model(
        &npufleet_worker_testkit::testmodel::GenTestModelArgs::new(
            dir.path().join("m.gguf"),
            npufleet_worker_testkit::testmodel::TestModelFormat::Gguf,
        ),
    )
    .unwrap();
    let (code, stderr) = serve(&[
        "--model",
        model.to_str().unwrap(),
        "--prefix-templates",
        "[1, 2]",
    ]);
    assert_ne!(code, 0);
    assert!(stderr.contains("JSON array of strings"), "{stderr}");
}

//! `npufleet-local` run as a built binary, not by cargo: with no `CARGO_MANIFEST_DIR`, it finds
//! the checkout from its flag or its working directory and fails with a plain error, never a
//! panic. The target directory given holds no release binaries, so each run stops at that
//! check, after the paths are resolved and before anything starts.

use std::path::Path;
use std::process::{Command, Output};

use npufleet_local::paths;
use npufleet_local::process::ScratchDir;

fn run_standalone(configure: impl FnOnce(&mut Command)) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_npufleet-local"));
    cmd.env_remove("CARGO_MANIFEST_DIR")
        .env_remove("NPUFLEET_REPO");
    configure(&mut cmd);
    cmd.output().expect("running npufleet-local")
}

/// Stopped at the missing release binaries: everything before that (the checkout) resolved.
fn assert_stopped_at_missing_binaries(output: &Output, empty: &Path) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let missing = empty.join("npufleet-operator");
    assert!(
        stderr.contains(&format!("{} is missing", missing.display())),
        "{stderr}"
    );
}

#[test]
fn the_built_binary_finds_the_checkout_by_flag_outside_it() {
    let empty = ScratchDir::new("standalone-flag").expect("scratch dir");
    let output = run_standalone(|cmd| {
        cmd.current_dir(empty.path())
            .arg("--repo")
            .arg(paths::repo_root())
            .arg("--target-dir")
            .arg(empty.path());
    });
    assert_stopped_at_missing_binaries(&output, empty.path());
}

#[test]
fn the_built_binary_finds_the_checkout_it_runs_in() {
    let empty = ScratchDir::new("standalone-cwd").expect("scratch dir");
    let output = run_standalone(|cmd| {
        cmd.current_dir(paths::repo_root().join("deploy"))
            .arg("--target-dir")
            .arg(empty.path());
    });
    assert_stopped_at_missing_binaries(&output, empty.path());
}

#[test]
fn a_directory_that_is_not_a_checkout_is_named() {
    let empty = ScratchDir::new("standalone-not-a-checkout").expect("scratch dir");
    let output = run_standalone(|cmd| {
        cmd.arg("--repo").arg(empty.path());
    });
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "{} is not an npufleet checkout",
            empty.path().display()
        )),
        "{stderr}"
    );
}

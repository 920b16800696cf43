//! The checked-in CANN bindings match what bindgen generates from torch-npu's headers today.

use std::path::PathBuf;
use std::process::Command;

/// `bindings.sh check` exits with this when the headers or bindgen are not installed.
const SKIPPED: i32 = 77;

#[test]
fn bindings_match_the_vendor_headers() {
    let script = PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"),
    )
    .join("ascend/bindings.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg("check")
        .output()
        .expect("running worker/ascend/bindings.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(SKIPPED) {
        // On a developer's machine a missing tool skips the check; in CI it is a failure,
        // so the drift check cannot silently stop running.
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true but the drift check could not run (run `worker/ascend/bindings.sh setup` \
             first):\n{stdout}\n{stderr}"
        );
        println!("drift check {stdout}");
        return;
    }
    assert!(
        out.status.success(),
        "bindings.sh check failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("bindings match"), "{stdout}");
}

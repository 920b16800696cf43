//! Writes the CRDs generated from the API types into `crds/generated/` and the Helm chart.
//! With `--check`, fails instead when a checked-in copy differs.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

fn main() -> ExitCode {
    let check = std::env::args().any(|a| a == "--check");
    let root =
        Path::new(&std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
            .join("..");
    let targets: Vec<PathBuf> = ["crds/generated", "charts/npufleet/crds"]
        .into_iter()
        .map(|dir| Path::new(dir).join(npufleet_crds::CRD_FILE))
        .collect();
    let yaml = match npufleet_crds::crd_yaml() {
        Ok(yaml) => yaml,
        Err(e) => {
            eprintln!("cannot serialise the CRD: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut failed = false;
    for target in &targets {
        let path = root.join(target);
        let current = std::fs::read_to_string(&path).unwrap_or_default();
        if current == yaml {
            continue;
        }
        if check {
            eprintln!(
                "{} is out of date; run `cargo run -p npufleet-crds --bin npufleet-crdgen`",
                target.display()
            );
            failed = true;
            continue;
        }
        let written = path
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(&path, &yaml));
        match written {
            Ok(()) => println!("wrote {}", target.display()),
            Err(e) => {
                eprintln!("cannot write {}: {e}", target.display());
                failed = true;
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

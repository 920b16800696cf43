//! `npufleet-gen-test-model`: writes a small deterministic random-weight model (GGUF or
//! safetensors) for tests, and prints its path.

use clap::Parser;
use npufleet_worker_testkit::testmodel::{self, GenTestModelArgs};

/// Write a small deterministic random-weight model (GGUF or safetensors) for tests.
#[derive(Parser)]
#[command(name = "npufleet-gen-test-model", version, about)]
struct Cli {
    #[command(flatten)]
    args: GenTestModelArgs,
}

fn main() -> std::process::ExitCode {
    match testmodel::run(Cli::parse().args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::from(2)
        }
    }
}

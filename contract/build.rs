//! Generates the gRPC code from the protocol files in `proto/`, which stay the single source:
//! messages, services, and the descriptor set served by gRPC reflection all come from them.

use std::path::PathBuf;

use prost::Message;

const PROTOS: &[&str] = &["inference/open_inference.proto", "npufleet/v1/load.proto"];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    if std::env::var_os("CARGO_FEATURE_GRPC").is_none() {
        return Ok(());
    }
    let descriptors = protox::compile(PROTOS, ["proto"])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out_dir.join("serving_descriptor.bin"),
        descriptors.encode_to_vec(),
    )?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}

//! Generates the client of the workers' load signal from the worker's own protocol file, so
//! that the two sides cannot drift apart.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const PROTO_ROOT: &str = "../worker/proto";
    const LOAD_PROTO: &str = "npufleet/v1/load.proto";
    println!("cargo:rerun-if-changed={PROTO_ROOT}/{LOAD_PROTO}");
    let descriptors = protox::compile([LOAD_PROTO], [PROTO_ROOT])?;
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}

//! Code generated at build time from `proto/`.

/// The Open Inference Protocol (package `inference`).
pub mod inference {
    tonic::include_proto!("inference");
}

/// npufleet's own services (package `npufleet.v1`).
pub mod npufleet {
    pub mod v1 {
        tonic::include_proto!("npufleet.v1");
    }
}

/// Encoded descriptors of every file in `proto/`, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/serving_descriptor.bin"));

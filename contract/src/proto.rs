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

/// The upper bounds, in seconds, of the latency histograms a worker's `LoadReport` carries:
/// ten a decade from 1 ms to 1,000 s, each 26 % above the last, so that a percentile read
/// from them is within a bucket's width of the truth (vLLM's own buckets jump from 1 s to
/// 2.5 s, where a p90 read from them sat at 2 s while every request took under 1.5 s).
pub fn load_report_latency_bounds() -> Vec<f64> {
    (0..=60)
        .map(|k| 1e-3 * 10f64.powf(f64::from(k) / 10.0))
        .collect()
}

/// Encoded descriptors of every file in `proto/`, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/serving_descriptor.bin"));

/// The canonical name of a gRPC status code (`UNAVAILABLE`), as the gRPC specification spells
/// it.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// What a `ModelStreamInfer` stream carries in place of the answer to request `id` that
/// failed with `status`: the stream goes on, as Triton's does. The message starts with the
/// code's name, so that a client tells a full queue from a bad request without a status.
pub fn stream_error(
    model_name: &str,
    id: &str,
    status: &tonic::Status,
) -> inference::ModelStreamInferResponse {
    inference::ModelStreamInferResponse {
        error_message: format!("{}: {}", code_name(status.code()), status.message()),
        infer_response: Some(inference::ModelInferResponse {
            model_name: model_name.to_string(),
            id: id.to_string(),
            ..Default::default()
        }),
    }
}

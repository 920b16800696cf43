//! The worker's listening ports and the names its pods and Services give them.

/// OpenAI HTTP API, KServe v2 REST, `/metrics` and `/health`.
pub const HTTP_PORT: u16 = 8000;
pub const HTTP_PORT_NAME: &str = "http";
/// Open Inference Protocol gRPC, the `WorkerLoad` signal, gRPC health and reflection.
pub const GRPC_PORT: u16 = 8001;
pub const GRPC_PORT_NAME: &str = "grpc";

//! HTTP headers and gRPC metadata keys the router adds to what it returns.

/// The pod that answered, on every response the router relays (HTTP header and gRPC metadata).
pub const REPLICA: &str = "x-npufleet-replica";

//! HTTP headers and gRPC metadata keys the router adds to what it returns or passes on.

/// The pod that answered, on every response the router relays (HTTP header and gRPC metadata).
pub const REPLICA: &str = "x-npufleet-replica";

/// W3C Trace Context: the trace a request belongs to, from the client or started by the
/// router, passed on to the worker (HTTP header and gRPC metadata). See [`crate::trace`].
pub const TRACEPARENT: &str = "traceparent";

/// The client's name for its request (HTTP), which the router's logs carry.
pub const REQUEST_ID: &str = "x-request-id";

/// The priority a request asks for in the router's flow control (an integer; higher is served
/// first), capped at its API key's (HTTP header and gRPC metadata).
pub const FLOW_PRIORITY: &str = "x-npufleet-priority";

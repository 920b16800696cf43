//! HTTP headers and gRPC metadata keys the router adds to what it returns or passes on.

/// The pod that answered, on every response the router relays (HTTP header and gRPC metadata).
pub const REPLICA: &str = "x-npufleet-replica";

/// W3C Trace Context: the trace a request belongs to, from the client or started by the
/// router, passed on to the worker (HTTP header and gRPC metadata). See [`crate::trace`].
pub const TRACEPARENT: &str = "traceparent";

/// The client's name for its request (HTTP), which the router's logs carry.
pub const REQUEST_ID: &str = "x-request-id";

/// The priority a request asks for in the router's flow control (an integer; higher is served
/// first), capped at its API key's (HTTP header and gRPC metadata). Under flow control the
/// router passes on the priority it admitted the request at, and the worker's scheduler runs
/// higher priorities first; without flow control the router passes none on.
pub const FLOW_PRIORITY: &str = "x-npufleet-priority";

/// The value of a [`FLOW_PRIORITY`] header, or the error that names what is wrong with it.
pub fn parse_priority(value: &[u8]) -> Result<i32, String> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .ok_or_else(|| {
            format!(
                "{FLOW_PRIORITY} must be an integer (higher is served first), got {:?}",
                String::from_utf8_lossy(value)
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_priority_is_an_integer_with_optional_blanks() {
        assert_eq!(parse_priority(b" -2 "), Ok(-2));
        assert_eq!(parse_priority(b"10"), Ok(10));
        for bad in [&b"high"[..], b"1.5", b"", b"99999999999", b"\xff"] {
            let error = parse_priority(bad).unwrap_err();
            assert!(error.contains(FLOW_PRIORITY), "{error}");
        }
    }
}

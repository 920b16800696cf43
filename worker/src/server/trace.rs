//! Each inference request's span, named by the W3C trace the router passed on (or the client
//! sent), so that the router's log lines for a request and the worker's share its trace id.

use std::time::Instant;

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use npufleet_contract::headers::TRACEPARENT;
use npufleet_contract::trace::TraceParent;
use tonic::metadata::MetadataMap;
use tracing::Instrument;

/// The span of one request to `endpoint`, carrying the trace id of `traceparent`. A value
/// the specification says to ignore leaves the id out: a malformed trace header is no reason
/// to refuse an inference.
pub fn request_span(endpoint: &str, traceparent: Option<&str>) -> tracing::Span {
    let span = tracing::info_span!("request", endpoint, trace_id = tracing::field::Empty);
    if let Some(trace) = traceparent.and_then(TraceParent::parse) {
        span.record("trace_id", trace.trace_id_hex());
        npufleet_contract::logging::follow(&span, &trace);
    }
    span
}

/// [`request_span`] for a gRPC method, from the call's metadata.
pub fn grpc_span(method: &str, metadata: &MetadataMap) -> tracing::Span {
    let traceparent = metadata.get(TRACEPARENT).and_then(|v| v.to_str().ok());
    request_span(method, traceparent)
}

/// HTTP middleware: runs the request in its span and logs one line when it is answered (for a
/// stream, when its headers go out; the stream's own lines follow in the same span).
pub async fn http_request(request: Request, next: Next) -> Response {
    let traceparent = request
        .headers()
        .get(TRACEPARENT)
        .and_then(|v| v.to_str().ok());
    let span = request_span(request.uri().path(), traceparent);
    let started = Instant::now();
    async move {
        let response = next.run(request).await;
        let status = response.status().as_u16();
        tracing::info!(status, elapsed_ms = elapsed_ms(started), "answered");
        response
    }
    .instrument(span)
    .await
}

/// Milliseconds since `started`, for the line a request logs when it is answered.
pub fn elapsed_ms(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX)
}

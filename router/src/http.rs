//! The HTTP front door: the OpenAI API and KServe v2 REST, proxied to a replica of the model
//! the request names, with the body streamed back as it arrives; plus the router's own
//! `/v1/models`, health and `/metrics`.

use std::sync::Arc;
use std::time::Instant;

use axum::Router as AxumRouter;
use axum::body::{Body, Bytes};
use axum::extract::rejection::{BytesRejection, FailedToBufferBody};
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use futures::{Stream, StreamExt};
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri, header};
use npufleet_contract::headers;
use npufleet_contract::logging::next_hop;
use serde_json::{Value, json};

use tracing::Instrument;

use crate::error::{Flavor, RouteError};
use crate::metrics::NO_REPLICA;
use crate::pool::Lease;
use crate::prompt::{Affinity, Prompt};
use crate::request::RoutedRequest;
use crate::retry::{self, Attempt, Reason, Unanswered};
use crate::route::Router;

#[derive(Clone)]
pub struct HttpState {
    pub router: Arc<Router>,
    pub upstream: reqwest::Client,
}

pub fn app(state: HttpState) -> AxumRouter {
    // The extractor refuses a larger body; the handlers answer that with the router's 413.
    let limit = state.router.settings.max_body_bytes;
    AxumRouter::new()
        .route("/v1/completions", post(openai))
        .route("/v1/chat/completions", post(openai))
        .route("/v1/models", get(models))
        .route("/v2/models/{name}", get(v2_model_metadata))
        .route("/v2/models/{name}/{*rest}", any(v2))
        .route("/v2/health/live", get(live))
        .route("/v2/health/ready", get(ready))
        .route("/healthz", get(live))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

fn body_or_error(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, RouteError> {
    body.map_err(|rejection| match rejection {
        BytesRejection::FailedToBufferBody(FailedToBufferBody::LengthLimitError(_)) => {
            RouteError::TooLarge { limit }
        }
        other => RouteError::BadRequest(format!("reading the request body failed: {other}")),
    })
}

async fn openai(
    State(state): State<HttpState>,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let upstream = Upstream::new(Method::POST, &uri, &headers);
    forward_body(&state, Flavor::OpenAi, None, upstream, body, |body, key| {
        RoutedRequest::openai(body, &headers, key)
    })
    .await
}

async fn v2_model_metadata(
    State(state): State<HttpState>,
    Path(name): Path<String>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let upstream = Upstream::new(Method::GET, &uri, &headers);
    forward_body(
        &state,
        Flavor::V2,
        Some(&name),
        upstream,
        Ok(Bytes::new()),
        |_, _| RoutedRequest::v2_rest(&name, &[], &headers, |_, _| Affinity::None),
    )
    .await
}

async fn v2(
    State(state): State<HttpState>,
    Path((name, _rest)): Path<(String, String)>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let upstream = Upstream::new(method, &uri, &headers);
    forward_body(
        &state,
        Flavor::V2,
        Some(&name),
        upstream,
        body,
        |body, key| RoutedRequest::v2_rest(&name, body, &headers, key),
    )
    .await
}

/// Reads the body, parses it into one routed request with `parse` (given the router's
/// affinity of a prompt), and forwards it; or answers the client's error in the protocol's words.
async fn forward_body(
    state: &HttpState,
    flavor: Flavor,
    model: Option<&str>,
    mut upstream: Upstream<'_>,
    body: Result<Bytes, BytesRejection>,
    parse: impl FnOnce(&[u8], &dyn Fn(&str, &Prompt) -> Affinity) -> Result<RoutedRequest, RouteError>,
) -> Response {
    let router = &state.router;
    let affinity = |model: &str, prompt: &Prompt| router.affinity(model, prompt);
    let request = body_or_error(body, router.settings.max_body_bytes)
        .and_then(|body| Ok((parse(&body, &affinity)?, body)));
    match request {
        Ok((request, body)) => {
            upstream.body = body;
            forward(state, flavor, &request, upstream)
                .instrument(request.span())
                .await
        }
        Err(error) => answer_error(state, flavor, model, error),
    }
}

fn answer_error(
    state: &HttpState,
    flavor: Flavor,
    model: Option<&str>,
    error: RouteError,
) -> Response {
    let response = error.into_response(flavor);
    count(state, model.unwrap_or(""), NO_REPLICA, response.status());
    response
}

fn count(state: &HttpState, model: &str, replica: &str, status: StatusCode) {
    state
        .router
        .metrics
        .requests
        .with_label_values(&[model, replica, status.as_str()])
        .inc();
}

/// The client's request as it goes to a replica: its method, path and body, and its headers
/// less hop-by-hop ones and those the client sets anew, with the request's trace.
struct Upstream<'a> {
    method: Method,
    uri: &'a Uri,
    headers: &'a HeaderMap,
    body: Bytes,
}

impl<'a> Upstream<'a> {
    /// The request as it came; its body is set once read.
    fn new(method: Method, uri: &'a Uri, headers: &'a HeaderMap) -> Self {
        Upstream {
            method,
            uri,
            headers,
            body: Bytes::new(),
        }
    }

    fn headers(&self, request: &RoutedRequest) -> HeaderMap {
        let mut out = self.headers.clone();
        for name in [
            header::HOST,
            header::CONNECTION,
            header::CONTENT_LENGTH,
            header::TRANSFER_ENCODING,
            header::TE,
            header::UPGRADE,
            HeaderName::from_static("keep-alive"),
            HeaderName::from_static("proxy-connection"),
            // Set per attempt from the lease: only flow control's admitted priority counts.
            HeaderName::from_static(headers::FLOW_PRIORITY),
        ] {
            out.remove(name);
        }
        if let Ok(trace) =
            HeaderValue::from_str(&next_hop(&tracing::Span::current(), &request.trace).to_string())
        {
            out.insert(headers::TRACEPARENT, trace);
        }
        out
    }
}

/// An attempt's failure, kept to answer the client with when no replica takes the request.
enum Failure {
    Transport(String),
    /// The replica's refusal (503 draining or warming up, 429 queue full), relayed as it came.
    Refused(reqwest::Response),
}

/// Sends the request to replicas of its model per the retry policy, and streams back the
/// answer of the one that takes it.
async fn forward(
    state: &HttpState,
    flavor: Flavor,
    request: &RoutedRequest,
    upstream: Upstream<'_>,
) -> Response {
    let uri = upstream.uri;
    let path = uri.path_and_query().map_or(uri.path(), |p| p.as_str());
    let headers = upstream.headers(request);
    let sent = retry::send(&state.router, request, None, |lease| {
        let mut headers = headers.clone();
        if let Some(priority) = lease.priority {
            headers.insert(headers::FLOW_PRIORITY, HeaderValue::from(priority));
        }
        let attempt = state
            .upstream
            .request(
                upstream.method.clone(),
                format!("http://{}:{}{path}", lease.ip, lease.http_port),
            )
            .headers(headers)
            .body(upstream.body.clone());
        let pod = lease.pod.clone();
        async move {
            let sent_at = Instant::now();
            match attempt.send().await {
                Ok(response) => match Reason::of_http_status(response.status()) {
                    Some(reason) => Attempt::Refused(reason, Failure::Refused(response)),
                    None => Attempt::Answered((sent_at, response)),
                },
                Err(error) => Attempt::Refused(
                    Reason::of_http_error(&error),
                    Failure::Transport(format!("{pod}: {error}")),
                ),
            }
        }
    })
    .await;
    let model = request.model.as_str();
    match sent {
        Ok((lease, (sent_at, response))) => stream_back(state, model, lease, sent_at, response),
        Err(Unanswered::Route(error)) => answer_error(state, flavor, Some(model), error),
        Err(Unanswered::Replica {
            pod,
            error: Failure::Refused(response),
        }) => relay_refusal(state, model, pod, response).await,
        Err(Unanswered::Replica {
            error: Failure::Transport(last),
            ..
        }) => answer_error(
            state,
            flavor,
            Some(model),
            RouteError::ReplicasFailed {
                model: model.to_owned(),
                last,
            },
        ),
    }
}

/// The last replica's refusal, as the client's answer.
async fn relay_refusal(
    state: &HttpState,
    model: &str,
    pod: String,
    response: reqwest::Response,
) -> Response {
    let status = response.status();
    count(state, model, &pod, status);
    let mut out = Response::builder().status(status);
    for (name, value) in response.headers() {
        if is_end_to_end(name) {
            out = out.header(name, value);
        }
    }
    let body = response.bytes().await.unwrap_or_default();
    out.header(headers::REPLICA, pod)
        .body(Body::from(body))
        .unwrap_or_else(|_| StatusCode::BAD_GATEWAY.into_response())
}

fn is_end_to_end(name: &HeaderName) -> bool {
    ![
        header::CONNECTION,
        header::TRANSFER_ENCODING,
        header::CONTENT_LENGTH,
        header::UPGRADE,
        header::TE,
    ]
    .contains(name)
        && name.as_str() != "keep-alive"
}

/// The replica's answer, streamed through as its bytes arrive. The lease (the replica's
/// in-flight count) lasts until the body ends or the client goes; the client going drops
/// the upstream response, which closes its connection and cancels the request there.
fn stream_back(
    state: &HttpState,
    model: &str,
    lease: Lease,
    sent_at: Instant,
    response: reqwest::Response,
) -> Response {
    let status = response.status();
    count(state, model, &lease.pod, status);
    let mut out = Response::builder().status(status);
    for (name, value) in response.headers() {
        if is_end_to_end(name) {
            out = out.header(name, value);
        }
    }
    let event_stream = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    out = out.header(
        headers::REPLICA,
        HeaderValue::from_str(&lease.pod).unwrap_or(HeaderValue::from_static("")),
    );
    let ttft = state
        .router
        .metrics
        .upstream_ttft_seconds
        .with_label_values(&[model]);
    let upstream = response.bytes_stream();
    let body = Passthrough {
        upstream: Box::pin(upstream),
        lease,
        span: tracing::Span::current(),
        sent_at,
        ttft: Some(ttft),
        event_stream,
        pending: Vec::new(),
        finished: false,
    };
    out.body(Body::from_stream(body.into_stream()))
        .unwrap_or_else(|_| StatusCode::BAD_GATEWAY.into_response())
}

type UpstreamBytes = std::pin::Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>;

struct Passthrough {
    upstream: UpstreamBytes,
    lease: Lease,
    /// The request's span: the body streams after the handler that entered it returned.
    span: tracing::Span,
    sent_at: Instant,
    ttft: Option<prometheus::Histogram>,
    /// Server-sent events: pass whole events only, so that a failure mid-event can still
    /// be told to the client as a well-formed error event.
    event_stream: bool,
    pending: Vec<u8>,
    finished: bool,
}

/// The end of the last complete event (`\n\n`) in `bytes`, if any.
fn complete_events_end(bytes: &[u8]) -> Option<usize> {
    bytes.windows(2).rposition(|w| w == b"\n\n").map(|i| i + 2)
}

/// The event a client reads when the replica fails after streaming began: an OpenAI-shaped
/// error, then the end of the stream.
pub fn stream_error_event(message: &str) -> Bytes {
    let error = json!({"error": {
        "message": message,
        "type": "server_error",
        "param": null,
        "code": "upstream_failed",
    }});
    Bytes::from(format!("data: {error}\n\ndata: [DONE]\n\n"))
}

impl Passthrough {
    fn into_stream(self) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send {
        futures::stream::unfold(self, |mut s| async move {
            loop {
                if s.finished {
                    return None;
                }
                match s.upstream.next().await {
                    Some(Ok(bytes)) => {
                        if let Some(ttft) = s.ttft.take() {
                            ttft.observe(s.sent_at.elapsed().as_secs_f64());
                            if s.event_stream {
                                s.lease.first_token();
                            } else {
                                s.lease.answer_began();
                            }
                        }
                        if !s.event_stream {
                            return Some((Ok(bytes), s));
                        }
                        s.pending.extend_from_slice(&bytes);
                        if let Some(end) = complete_events_end(&s.pending) {
                            let events: Vec<u8> = s.pending.drain(..end).collect();
                            return Some((Ok(Bytes::from(events)), s));
                        }
                    }
                    Some(Err(error)) => {
                        s.finished = true;
                        tracing::warn!(parent: &s.span, %error, "the replica failed mid-response");
                        let message = format!(
                            "replica {} failed after the response began: {error}",
                            s.lease.pod
                        );
                        if s.event_stream {
                            return Some((Ok(stream_error_event(&message)), s));
                        }
                        return Some((Err(std::io::Error::other(message)), s));
                    }
                    None => {
                        s.finished = true;
                        if s.pending.is_empty() {
                            return None;
                        }
                        let rest = std::mem::take(&mut s.pending);
                        return Some((Ok(Bytes::from(rest)), s));
                    }
                }
            }
        })
    }
}

async fn models(State(state): State<HttpState>) -> Response {
    let fleet = state.router.discovery.fleet.borrow().clone();
    let data: Vec<Value> = fleet
        .ready_models()
        .into_iter()
        .map(|name| json!({"id": name, "object": "model", "owned_by": "npufleet", "root": name}))
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn live() -> StatusCode {
    StatusCode::OK
}

/// Ready once both watches have listed: before that, every model would look unknown.
async fn ready(State(state): State<HttpState>) -> StatusCode {
    if *state.router.discovery.synced.borrow() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn metrics(State(state): State<HttpState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        state.router.metrics.render(),
    )
        .into_response()
}

async fn not_found(uri: Uri) -> Response {
    (
        StatusCode::NOT_FOUND,
        axum::Json(json!({"error": {
            "message": format!("no route for {}", uri.path()),
            "type": "invalid_request_error",
            "param": null,
            "code": "not_found",
        }})),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn complete_events_end_after_the_last_blank_line() {
        assert_eq!(complete_events_end(b"data: a\n\ndata: b"), Some(9));
        assert_eq!(complete_events_end(b"data: a\n\ndata: b\n\n"), Some(18));
        assert_eq!(complete_events_end(b"data: a\n"), None);
    }

    #[test]
    fn the_stream_error_event_is_one_json_event_then_done() {
        let event = stream_error_event("replica x failed");
        let text = std::str::from_utf8(&event).unwrap();
        let mut events = text.split("\n\n").filter(|e| !e.is_empty());
        let error: Value =
            serde_json::from_str(events.next().unwrap().strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(error["error"]["message"], "replica x failed");
        assert_eq!(events.next(), Some("data: [DONE]"));
        assert_eq!(events.next(), None);
    }
}

//! The HTTP surface: the OpenAI-compatible API, the Open Inference Protocol's REST form,
//! health and metrics, on one axum router.

use std::path::PathBuf;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use npufleet_contract::auth::ApiKey;
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::api::EngineState;
use crate::server::error::ServeError;
use crate::server::reasoning::ReasoningParser;
use crate::server::shared::Shared;
use crate::server::{auth, openai, rest};

#[derive(Clone)]
pub struct HttpState {
    pub shared: Arc<Shared>,
    /// Required on the OpenAI and inference routes when set.
    pub api_key: Option<ApiKey>,
    pub max_body_bytes: usize,
    pub thermal_root: Arc<PathBuf>,
    /// How chat answers' `<think>` reasoning is returned.
    pub reasoning_parser: ReasoningParser,
}

pub fn router(state: HttpState) -> Router {
    let limit = state.max_body_bytes;
    // The routes that serve or list the model need the key; probes, metadata and metrics stay
    // open.
    let protected = Router::new()
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/models", get(openai::models))
        .route("/v2/models/{name}/infer", post(rest::infer))
        .route(
            "/v2/models/{name}/versions/{version}/infer",
            post(rest::infer_version),
        )
        .route_layer(middleware::from_fn_with_state(
            state.api_key.clone(),
            auth::require_http,
        ));
    Router::new()
        .merge(protected)
        .route("/v2", get(rest::server_metadata))
        .route("/v2/health/live", get(rest::live))
        .route("/v2/health/ready", get(rest::ready))
        .route("/v2/models/{name}", get(rest::model_metadata))
        .route(
            "/v2/models/{name}/versions/{version}",
            get(rest::model_metadata_version),
        )
        .route("/v2/models/{name}/ready", get(rest::model_ready))
        .route(
            "/v2/models/{name}/versions/{version}/ready",
            get(rest::model_ready_version),
        )
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// An error in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.
pub struct OpenAiError(pub ServeError);

impl From<ServeError> for OpenAiError {
    fn from(err: ServeError) -> Self {
        OpenAiError(err)
    }
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        let err = self.0;
        let body = json!({
            "error": {
                "message": err.to_string(),
                "type": err.openai_type(),
                "param": err.param(),
                "code": err.openai_code(),
            }
        });
        with_retry_after(&err, (err.http_status(), axum::Json(body)).into_response())
    }
}

/// 429 and 503 answers say when to come back.
pub fn with_retry_after(err: &ServeError, mut response: Response) -> Response {
    if matches!(
        err,
        ServeError::QueueFull { .. } | ServeError::Unavailable(_)
    ) {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    response
}

/// A JSON body read without regard to `Content-Type`, with errors that name the problem.
pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned> FromRequest<HttpState> for JsonBody<T> {
    type Rejection = BodyError;

    async fn from_request(request: Request, state: &HttpState) -> Result<Self, Self::Rejection> {
        let BodyBytes(bytes) = BodyBytes::from_request(request, state).await?;
        parse_json(&bytes).map(JsonBody).map_err(BodyError::Invalid)
    }
}

/// A request body as bytes, for handlers that parse it themselves; a body over the limit is
/// refused by name.
pub struct BodyBytes(pub Bytes);

impl FromRequest<HttpState> for BodyBytes {
    type Rejection = BodyError;

    async fn from_request(request: Request, state: &HttpState) -> Result<Self, Self::Rejection> {
        Bytes::from_request(request, state)
            .await
            .map(BodyBytes)
            .map_err(|rejection| body_rejection(rejection, state.max_body_bytes))
    }
}

/// Parses a JSON request body, with an error that names the problem.
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ServeError> {
    serde_json::from_slice(body).map_err(|err| {
        ServeError::bad_request(format!(
            "the request body is not valid JSON for this endpoint: {err}"
        ))
    })
}

/// Why a request body could not be read; rendered in the caller endpoint's error shape.
pub enum BodyError {
    TooLarge(usize),
    Invalid(ServeError),
}

fn body_rejection(rejection: BytesRejection, limit: usize) -> BodyError {
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        BodyError::TooLarge(limit)
    } else {
        BodyError::Invalid(ServeError::bad_request(format!(
            "could not read the request body: {}",
            rejection.body_text()
        )))
    }
}

impl BodyError {
    pub fn message(&self) -> String {
        match self {
            BodyError::TooLarge(limit) => format!(
                "the request body is larger than the {limit}-byte limit \
                 (set by --max-body-bytes)"
            ),
            BodyError::Invalid(err) => err.to_string(),
        }
    }
}

impl IntoResponse for BodyError {
    fn into_response(self) -> Response {
        match self {
            BodyError::TooLarge(_) => {
                let body = json!({
                    "error": {
                        "message": self.message(),
                        "type": "invalid_request_error",
                        "param": null,
                        "code": "request_too_large",
                    }
                });
                (StatusCode::PAYLOAD_TOO_LARGE, axum::Json(body)).into_response()
            }
            BodyError::Invalid(err) => OpenAiError(err).into_response(),
        }
    }
}

/// A response in the OpenAI error shape for failures outside any endpoint's own handling.
fn error_response(status: StatusCode, message: String, code: &str) -> Response {
    let body = json!({
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": null,
            "code": code,
        }
    });
    (status, axum::Json(body)).into_response()
}

async fn not_found(request: Request) -> Response {
    error_response(
        StatusCode::NOT_FOUND,
        format!("no route for {} {}", request.method(), request.uri().path()),
        "not_found",
    )
}

async fn method_not_allowed(request: Request) -> Response {
    error_response(
        StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "{} is not allowed on {}",
            request.method(),
            request.uri().path()
        ),
        "method_not_allowed",
    )
}

/// The HTTP surface of a process whose ranks follow rank 0 in another pod: its probes pass
/// while the ranks run (the process exits when they end), and inference lives on rank 0.
pub fn follower_router() -> Router {
    let following = || async { (StatusCode::OK, axum::Json(json!({"status": "following"}))) };
    Router::new()
        .route("/v2/health/live", get(following))
        .route("/v2/health/ready", get(following))
        .route("/health", get(following))
        .fallback(|| async {
            error_response(
                StatusCode::NOT_FOUND,
                "this pod runs tensor-parallel ranks that follow rank 0; \
                 send inference requests to the group's rank-0 pod"
                    .to_string(),
                "not_found",
            )
        })
        .method_not_allowed_fallback(method_not_allowed)
}

/// Mirrors readiness, as vLLM's `/health` does for load balancers.
async fn health(State(state): State<HttpState>) -> Response {
    let shared = &state.shared;
    match shared.state() {
        EngineState::Ready => {
            (StatusCode::OK, axum::Json(json!({"status": "ready"}))).into_response()
        }
        EngineState::WarmingUp { done, total } => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "warming_up", "warmup_done": done, "warmup_total": total})),
        )
            .into_response(),
        EngineState::Draining | EngineState::Drained => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "draining"})),
        )
            .into_response(),
    }
}

async fn metrics(State(state): State<HttpState>) -> Response {
    let shared = &state.shared;
    let text = shared
        .metrics
        .render(&shared.engine.load(), shared.state(), &state.thermal_root);
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        text,
    )
        .into_response()
}

//! What every HTTP endpoint shares: its state, request bodies read within the size limit,
//! and errors in the OpenAI shape. The routes themselves are in `router.rs`.

use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use npufleet_contract::auth::ApiKey;
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::server::error::ServeError;
use crate::server::reasoning::ReasoningParser;
use crate::server::shared::Shared;

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
pub fn error_response(status: StatusCode, message: String, code: &str) -> Response {
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

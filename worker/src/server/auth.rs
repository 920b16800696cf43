//! The optional API key on the inference endpoints (`--api-key`; see
//! `npufleet_contract::auth`). Only the check's outcome is ever visible: the key and what a
//! client sent are neither logged nor echoed.

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use npufleet_contract::auth::{AUTHORIZATION, ApiKey};
use tonic::metadata::MetadataMap;

use crate::server::error::ServeError;
use crate::server::http::OpenAiError;

/// Passes a request when no key is configured or it presents the key.
pub fn check(key: Option<&ApiKey>, authorization: Option<&[u8]>) -> Result<(), ServeError> {
    match key {
        Some(key) if !key.accepts(authorization) => Err(ServeError::Unauthenticated),
        _ => Ok(()),
    }
}

/// The same check on a gRPC call's `authorization` metadata.
pub fn check_grpc(key: Option<&ApiKey>, metadata: &MetadataMap) -> Result<(), tonic::Status> {
    check(
        key,
        metadata.get(AUTHORIZATION).map(|value| value.as_bytes()),
    )
    .map_err(Into::into)
}

/// Middleware for the protected HTTP routes: 401 in the OpenAI error shape without the key.
pub async fn require_http(
    State(key): State<Option<ApiKey>>,
    request: Request,
    next: Next,
) -> Response {
    let authorization = request.headers().get(AUTHORIZATION);
    match check(key.as_ref(), authorization.map(|value| value.as_bytes())) {
        Ok(()) => next.run(request).await,
        Err(err) => OpenAiError(err).into_response(),
    }
}

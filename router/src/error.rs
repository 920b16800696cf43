//! Why the router itself answered a request instead of a replica, mapped to each protocol.

use std::time::Duration;

use axum::Json;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use serde_json::json;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RouteError {
    #[error("{0}")]
    BadRequest(String),
    #[error("the request body is larger than the router's limit of {limit} bytes")]
    TooLarge { limit: usize },
    #[error("model '{0}' is not served by any InferenceService this router sees")]
    ModelNotFound(String),
    #[error(
        "model '{model}' has no ready replica and {limit} requests are already waiting for one; retry later"
    )]
    HoldQueueFull {
        model: String,
        limit: usize,
        retry_after: Duration,
    },
    #[error(
        "API key '{key}' is over its {limit} limit for model '{model}'; retry after {} s",
        whole_seconds(*retry_after)
    )]
    RateLimited {
        model: String,
        key: String,
        limit: &'static str,
        retry_after: Duration,
    },
    #[error(
        "the request asks for {tokens} tokens (prompt and max_tokens), more than API key '{key}' may use in a minute on model '{model}' (tokensPerMinute {per_minute})"
    )]
    OverTokenBudget {
        model: String,
        key: String,
        tokens: u32,
        per_minute: u32,
    },
    #[error(
        "model '{model}' is saturated and {limit} requests of priority {priority} are already waiting; retry later"
    )]
    FlowQueueFull {
        model: String,
        priority: i32,
        limit: usize,
    },
    #[error(
        "model '{model}' was saturated for the whole {waited:?} the request may wait in the queue; retry later"
    )]
    FlowQueueTimedOut { model: String, waited: Duration },
    #[error("model '{model}' had no ready replica within {waited:?} of holding the request")]
    HoldTimedOut { model: String, waited: Duration },
    #[error("every replica of model '{model}' that was tried failed: {last}")]
    ReplicasFailed { model: String, last: String },
    #[error(
        "model '{model}' is served by the {engine} engine, which has no Open Inference Protocol gRPC API; use its OpenAI HTTP API"
    )]
    NoGrpc { model: String, engine: &'static str },
}

impl RouteError {
    pub fn http_status(&self) -> StatusCode {
        match self {
            RouteError::BadRequest(_) => StatusCode::BAD_REQUEST,
            RouteError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            RouteError::ModelNotFound(_) => StatusCode::NOT_FOUND,
            RouteError::HoldQueueFull { .. }
            | RouteError::RateLimited { .. }
            | RouteError::OverTokenBudget { .. }
            | RouteError::FlowQueueFull { .. }
            | RouteError::FlowQueueTimedOut { .. } => StatusCode::TOO_MANY_REQUESTS,
            RouteError::HoldTimedOut { .. } => StatusCode::SERVICE_UNAVAILABLE,
            RouteError::ReplicasFailed { .. } => StatusCode::BAD_GATEWAY,
            RouteError::NoGrpc { .. } => StatusCode::NOT_IMPLEMENTED,
        }
    }

    pub fn grpc_status(&self) -> tonic::Status {
        let message = self.to_string();
        match self {
            RouteError::BadRequest(_) => tonic::Status::invalid_argument(message),
            RouteError::TooLarge { .. } => tonic::Status::out_of_range(message),
            RouteError::ModelNotFound(_) => tonic::Status::not_found(message),
            RouteError::HoldQueueFull { .. }
            | RouteError::RateLimited { .. }
            | RouteError::OverTokenBudget { .. }
            | RouteError::FlowQueueFull { .. }
            | RouteError::FlowQueueTimedOut { .. } => tonic::Status::resource_exhausted(message),
            RouteError::HoldTimedOut { .. } | RouteError::ReplicasFailed { .. } => {
                tonic::Status::unavailable(message)
            }
            RouteError::NoGrpc { .. } => tonic::Status::unimplemented(message),
        }
    }

    /// The OpenAI error `code` string.
    fn openai_code(&self) -> &'static str {
        match self {
            RouteError::BadRequest(_) => "invalid_request",
            RouteError::TooLarge { .. } => "request_too_large",
            RouteError::ModelNotFound(_) => "model_not_found",
            RouteError::HoldQueueFull { .. } | RouteError::FlowQueueFull { .. } => "queue_full",
            RouteError::RateLimited { .. } | RouteError::OverTokenBudget { .. } => {
                "rate_limit_exceeded"
            }
            RouteError::FlowQueueTimedOut { .. } => "queue_timeout",
            RouteError::HoldTimedOut { .. } => "no_ready_replica",
            RouteError::ReplicasFailed { .. } => "upstream_failed",
            RouteError::NoGrpc { .. } => "not_implemented",
        }
    }

    fn openai_type(&self) -> &'static str {
        match self {
            RouteError::BadRequest(_)
            | RouteError::TooLarge { .. }
            | RouteError::ModelNotFound(_)
            | RouteError::NoGrpc { .. } => "invalid_request_error",
            RouteError::HoldQueueFull { .. }
            | RouteError::RateLimited { .. }
            | RouteError::OverTokenBudget { .. }
            | RouteError::FlowQueueFull { .. }
            | RouteError::FlowQueueTimedOut { .. } => "rate_limit_error",
            RouteError::HoldTimedOut { .. } | RouteError::ReplicasFailed { .. } => {
                "service_unavailable"
            }
        }
    }

    /// When a refused request may come back (the `Retry-After` of its 429).
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            RouteError::HoldQueueFull { retry_after, .. }
            | RouteError::RateLimited { retry_after, .. } => Some(*retry_after),
            RouteError::FlowQueueFull { .. } | RouteError::FlowQueueTimedOut { .. } => {
                Some(Duration::from_secs(1))
            }
            _ => None,
        }
    }

    fn set_retry_after(&self, response: &mut Response) {
        if let Some(after) = self.retry_after() {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(whole_seconds(after)));
        }
    }
}

/// A wait in whole seconds, rounded up and at least one: a client retrying sooner would be
/// refused again.
fn whole_seconds(wait: Duration) -> u64 {
    (wait.as_secs() + u64::from(wait.subsec_nanos() > 0)).max(1)
}

/// Which API shape an error body takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    /// `{"error": {"message", "type", "param", "code"}}`
    OpenAi,
    /// KServe v2 REST: `{"error": "<message>"}`
    V2,
}

impl RouteError {
    pub fn into_response(self, flavor: Flavor) -> Response {
        let body = match flavor {
            Flavor::OpenAi => json!({"error": {
                "message": self.to_string(),
                "type": self.openai_type(),
                "param": null,
                "code": self.openai_code(),
            }}),
            Flavor::V2 => json!({"error": self.to_string()}),
        };
        let mut response = (self.http_status(), Json(body)).into_response();
        self.set_retry_after(&mut response);
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_for_overload_are_429_with_a_retry_after_rounded_up() {
        let limited = RouteError::RateLimited {
            model: "chat".into(),
            key: "bulk".into(),
            limit: "requestsPerMinute",
            retry_after: Duration::from_millis(2_100),
        };
        assert!(limited.to_string().contains("retry after 3 s"), "{limited}");
        let response = limited.clone().into_response(Flavor::OpenAi);
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "3");
        assert_eq!(limited.grpc_status().code(), tonic::Code::ResourceExhausted);
        let expired = RouteError::FlowQueueTimedOut {
            model: "chat".into(),
            waited: Duration::from_secs(30),
        };
        let response = expired.into_response(Flavor::V2);
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
    }
}

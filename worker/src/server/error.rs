//! One error type for every surface, mapped to each protocol's status.

use npufleet_contract::auth;

use crate::api::SubmitError;

/// What an error is called in the OpenAI API (`type`, `code`) and in the rejection metric.
struct ErrorNames {
    openai_type: &'static str,
    openai_code: &'static str,
    kind: &'static str,
}

/// Why a request was not served.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ServeError {
    /// HTTP 400 / gRPC INVALID_ARGUMENT. `param` names the offending field when there is one.
    #[error("{message}")]
    BadRequest {
        message: String,
        param: Option<String>,
    },
    /// HTTP 404 / gRPC NOT_FOUND.
    #[error("model '{requested}' is not served here; this worker serves '{served}'")]
    ModelNotFound { requested: String, served: String },
    /// HTTP 401 / gRPC UNAUTHENTICATED: the API key is missing or wrong.
    #[error("{}", auth::UNAUTHENTICATED_MESSAGE)]
    Unauthenticated,
    /// HTTP 429 / gRPC RESOURCE_EXHAUSTED.
    #[error("the waiting queue is full ({limit} requests); retry later")]
    QueueFull { limit: usize },
    /// HTTP 503 / gRPC UNAVAILABLE.
    #[error("{0}")]
    Unavailable(String),
    /// HTTP 500 / gRPC INTERNAL: the request was accepted but failed inside the engine.
    #[error("{0}")]
    Internal(String),
}

impl ServeError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        ServeError::BadRequest {
            message: message.into(),
            param: None,
        }
    }

    pub fn bad_param(param: &str, message: impl Into<String>) -> Self {
        ServeError::BadRequest {
            message: message.into(),
            param: Some(param.to_string()),
        }
    }

    pub fn http_status(&self) -> http::StatusCode {
        use http::StatusCode;
        match self {
            ServeError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ServeError::ModelNotFound { .. } => StatusCode::NOT_FOUND,
            ServeError::Unauthenticated => StatusCode::UNAUTHORIZED,
            ServeError::QueueFull { .. } => StatusCode::TOO_MANY_REQUESTS,
            ServeError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ServeError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The OpenAI error `type` string.
    pub fn openai_type(&self) -> &'static str {
        self.names().openai_type
    }

    /// The OpenAI error `code` string.
    pub fn openai_code(&self) -> &'static str {
        self.names().openai_code
    }

    pub fn param(&self) -> Option<&str> {
        match self {
            ServeError::BadRequest { param, .. } => param.as_deref(),
            _ => None,
        }
    }

    /// A short name of the error kind, used as a metric label.
    pub fn kind(&self) -> &'static str {
        self.names().kind
    }

    /// Every name of this kind of error, side by side so that one kind reads as one row.
    fn names(&self) -> ErrorNames {
        let (openai_type, openai_code, kind) = match self {
            ServeError::BadRequest { .. } => (
                "invalid_request_error",
                "invalid_request",
                "invalid_argument",
            ),
            ServeError::ModelNotFound { .. } => {
                ("invalid_request_error", "model_not_found", "not_found")
            }
            ServeError::Unauthenticated => (
                "invalid_request_error",
                auth::INVALID_API_KEY_CODE,
                "unauthenticated",
            ),
            ServeError::QueueFull { .. } => ("rate_limit_error", "queue_full", "queue_full"),
            ServeError::Unavailable(_) => ("service_unavailable", "unavailable", "unavailable"),
            ServeError::Internal(_) => ("server_error", "internal_error", "internal"),
        };
        ErrorNames {
            openai_type,
            openai_code,
            kind,
        }
    }
}

impl From<SubmitError> for ServeError {
    fn from(err: SubmitError) -> Self {
        match err {
            SubmitError::Invalid { message, param } => ServeError::BadRequest {
                message,
                param: param.map(str::to_string),
            },
            SubmitError::QueueFull { limit } => ServeError::QueueFull { limit },
            SubmitError::WarmingUp { .. } | SubmitError::Draining => {
                ServeError::Unavailable(err.to_string())
            }
        }
    }
}

impl From<ServeError> for tonic::Status {
    fn from(err: ServeError) -> Self {
        let message = err.to_string();
        match err {
            ServeError::BadRequest { .. } => tonic::Status::invalid_argument(message),
            ServeError::ModelNotFound { .. } => tonic::Status::not_found(message),
            ServeError::Unauthenticated => tonic::Status::unauthenticated(message),
            ServeError::QueueFull { .. } => tonic::Status::resource_exhausted(message),
            ServeError::Unavailable(_) => tonic::Status::unavailable(message),
            ServeError::Internal(_) => tonic::Status::internal(message),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn submit_errors_map_to_protocol_statuses() {
        let cases = [
            (
                SubmitError::invalid("top_p", "bad"),
                http::StatusCode::BAD_REQUEST,
                tonic::Code::InvalidArgument,
            ),
            (
                SubmitError::QueueFull { limit: 4 },
                http::StatusCode::TOO_MANY_REQUESTS,
                tonic::Code::ResourceExhausted,
            ),
            (
                SubmitError::WarmingUp { done: 1, total: 3 },
                http::StatusCode::SERVICE_UNAVAILABLE,
                tonic::Code::Unavailable,
            ),
            (
                SubmitError::Draining,
                http::StatusCode::SERVICE_UNAVAILABLE,
                tonic::Code::Unavailable,
            ),
        ];
        for (submit, http_status, grpc_code) in cases {
            let named = matches!(submit, SubmitError::Invalid { .. });
            let err = ServeError::from(submit);
            assert_eq!(err.param().is_some(), named, "the field is kept");
            assert_eq!(err.http_status(), http_status);
            assert_eq!(tonic::Status::from(err).code(), grpc_code);
        }
    }

    #[test]
    fn unknown_model_names_both_models() {
        let err = ServeError::ModelNotFound {
            requested: "gpt-4".into(),
            served: "smollm2".into(),
        };
        let status = tonic::Status::from(err.clone());
        assert_eq!(status.code(), tonic::Code::NotFound);
        assert!(status.message().contains("gpt-4") && status.message().contains("smollm2"));
        assert_eq!(err.http_status(), http::StatusCode::NOT_FOUND);
    }
}

//! The HTTP surface on one axum router: the OpenAI-compatible API, the Open Inference
//! Protocol's REST form, health and metrics; and the probes-only router of a process whose
//! ranks follow rank 0 elsewhere.

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;

use crate::api::EngineState;
use crate::server::http::{HttpState, error_response};
use crate::server::{auth, openai, rest, trace};
use npufleet_contract::prompt::RECIPE_PATH;

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
        ))
        // Outside the key check, so a refused request is logged in its trace too.
        .route_layer(middleware::from_fn(trace::http_request));
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
        .route(RECIPE_PATH, get(prompt_recipe))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
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

/// How this worker turns prompts into token ids, for a router that names the blocks of a
/// prompt as this worker's prefix cache does. Open like the model metadata: it holds the
/// tokenizer and chat template, which the model's own card publishes.
async fn prompt_recipe(State(state): State<HttpState>) -> Response {
    let engine = state.shared.clone();
    match tokio::task::spawn_blocking(move || engine.engine.prompt_recipe()).await {
        Ok(Ok(recipe)) => axum::Json(recipe).into_response(),
        Ok(Err(error)) => error_response(StatusCode::NOT_FOUND, format!("{error:#}"), "not_found"),
        Err(error) => error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("writing the prompt recipe: {error}"),
            "internal_error",
        ),
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

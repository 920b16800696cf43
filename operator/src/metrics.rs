//! Prometheus metrics of the reconcile loop, and the HTTP server for `/metrics`, `/healthz`
//! and `/readyz`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry, TextEncoder,
};

#[derive(Clone)]
pub struct Metrics {
    /// Shared with every part of the operator that exports metrics.
    pub registry: Registry,
    reconciles: IntCounterVec,
    failures: IntCounterVec,
    duration: HistogramVec,
    api_requests: IntCounterVec,
}

impl Metrics {
    pub fn new() -> prometheus::Result<Self> {
        let registry = Registry::new();
        let reconciles = IntCounterVec::new(
            Opts::new(
                "npufleet_operator_reconciliations_total",
                "Reconciles of InferenceServices",
            ),
            &["controller"],
        )?;
        let failures = IntCounterVec::new(
            Opts::new(
                "npufleet_operator_reconcile_failures_total",
                "Reconciles that ended in an error, by error kind",
            ),
            &["controller", "error"],
        )?;
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "npufleet_operator_reconcile_duration_seconds",
                "Time one reconcile took",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
            &["controller"],
        )?;
        // controller-runtime's name for the same count, so one dashboard query covers both.
        let api_requests = IntCounterVec::new(
            Opts::new(
                "rest_client_requests_total",
                "Requests the operator sent to the Kubernetes API, by HTTP method",
            ),
            &["method"],
        )?;
        registry.register(Box::new(reconciles.clone()))?;
        registry.register(Box::new(api_requests.clone()))?;
        registry.register(Box::new(failures.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        Ok(Self {
            registry,
            reconciles,
            failures,
            duration,
            api_requests,
        })
    }

    /// A client whose every API request is counted in `rest_client_requests_total`, so the
    /// requests one reconcile costs can be read beside `npufleet_operator_reconciliations_total`.
    pub async fn counted_client(&self) -> kube::Result<kube::Client> {
        let config = kube::Config::infer()
            .await
            .map_err(kube::Error::InferConfig)?;
        let counter = self.api_requests.clone();
        Ok(kube::client::ClientBuilder::try_from(config)?
            .with_layer(&tower::util::MapRequestLayer::new(
                move |request: http::Request<kube::client::Body>| {
                    counter
                        .with_label_values(&[request.method().as_str()])
                        .inc();
                    request
                },
            ))
            .build())
    }

    /// Counts a reconcile; the returned timer records its duration when dropped.
    pub fn reconcile_started(&self, controller: &str) -> prometheus::HistogramTimer {
        self.reconciles.with_label_values(&[controller]).inc();
        self.duration.with_label_values(&[controller]).start_timer()
    }

    pub fn reconcile_failed(&self, controller: &str, error: &str) {
        self.failures.with_label_values(&[controller, error]).inc();
    }
}

/// Readiness of the process: set once the controller has started (as leader or standby).
#[derive(Clone, Default)]
pub struct Health {
    ready: Arc<AtomicBool>,
}

impl Health {
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Relaxed);
    }
}

#[derive(Clone)]
struct AppState {
    metrics: Metrics,
    health: Health,
}

async fn metrics_text(State(state): State<AppState>) -> impl IntoResponse {
    let mut buffer = Vec::new();
    match TextEncoder::new().encode(&state.metrics.registry.gather(), &mut buffer) {
        Ok(()) => (
            StatusCode::OK,
            [("content-type", TextEncoder::new().format_type().to_string())],
            buffer,
        ),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [("content-type", "text/plain".to_string())],
            e.to_string().into_bytes(),
        ),
    }
}

async fn readyz(State(state): State<AppState>) -> StatusCode {
    if state.health.ready.load(Ordering::Relaxed) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

pub async fn serve(addr: SocketAddr, metrics: Metrics, health: Health) -> anyhow::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { StatusCode::OK }))
        .route("/readyz", get(readyz))
        .with_state(AppState { metrics, health });
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(%addr, "serving metrics and health checks");
    axum::serve(listener, app).await?;
    Ok(())
}

//! The serving surfaces: the Open Inference Protocol over gRPC, the OpenAI API and the
//! protocol's REST form over HTTP, Prometheus metrics, and npufleet's load service, all in
//! front of one [`Engine`]. [`serve`] runs them on bound listeners until told to stop.
//!
//! Shutdown: on SIGTERM (or SIGINT) readiness turns false, new requests are refused with
//! 503 / UNAVAILABLE, and the engine drains. Once every accepted request has been answered,
//! open gRPC streams end with an OK status, both listeners close and the process exits 0.
//! If `--drain-timeout` passes first, every unanswered request ends with an error its client
//! sees (an SSE error event, a gRPC status, a 500) and the process exits non-zero.
//!
//! Both listeners take connections as [`npufleet_contract::listener`] does: `TCP_NODELAY`,
//! bounded connections, and header-read and idle timeouts.

pub mod auth;
pub mod error;
pub mod grpc;
pub mod http;
pub mod inference;
pub mod kv_events_zmq;
pub mod metrics;
pub mod oip;
pub mod openai;
pub mod reasoning;
pub mod rest;
pub mod router;
pub mod shared;
pub mod telemetry;
pub mod trace;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use npufleet_contract::auth::ApiKey;
use npufleet_contract::listener::{self, ConnectionLimits, Protocol};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic_health::ServingStatus;

use crate::api::{Engine, EngineState};
use crate::server::shared::Shared;
use npufleet_contract::proto::inference::grpc_inference_service_server::GrpcInferenceServiceServer;
use npufleet_contract::proto::npufleet::v1::worker_load_server::WorkerLoadServer;

/// What the serving surfaces are configured with.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The name clients address the model by.
    pub model_name: String,
    /// Forward passes the engine runs before the worker reports ready.
    pub warmup_iterations: u32,
    /// Longest wait for accepted requests to finish after the shutdown signal.
    pub drain_timeout: Duration,
    /// The key clients must send; `None` requires none.
    pub api_key: Option<ApiKey>,
    pub max_body_bytes: usize,
    pub max_grpc_message_bytes: usize,
    /// Longest wait for a client to take the next chunk of a streamed response.
    pub stalled_reader_timeout: Duration,
    /// Kernel send buffer of each HTTP connection.
    pub http_send_buffer_bytes: usize,
    /// What each listener bounds its connections by.
    pub connections: ConnectionLimits,
    pub reasoning_parser: reasoning::ReasoningParser,
    /// Where the prefix cache's events also go in vLLM's wire format.
    pub kv_events: Option<kv_events_zmq::ZmqEventsConfig>,
}

/// The gRPC and HTTP listeners, bound before serving so that port 0 can be asked for.
pub struct Listeners {
    pub grpc: TcpListener,
    pub http: TcpListener,
}

impl Listeners {
    pub async fn bind(grpc: SocketAddr, http: SocketAddr) -> anyhow::Result<Listeners> {
        Ok(Listeners {
            grpc: TcpListener::bind(grpc)
                .await
                .with_context(|| format!("cannot listen for gRPC on {grpc}"))?,
            http: TcpListener::bind(http)
                .await
                .with_context(|| format!("cannot listen for HTTP on {http}"))?,
        })
    }
}

/// Serves `engine` on `listeners` until `shutdown` resolves (with the signal's name), then
/// drains.
pub async fn serve(
    config: ServerConfig,
    engine: Arc<dyn Engine>,
    listeners: Listeners,
    shutdown: impl Future<Output = anyhow::Result<&'static str>>,
) -> anyhow::Result<()> {
    let shared = Arc::new(Shared::new(
        engine,
        config.model_name.clone(),
        config.warmup_iterations,
        config.stalled_reader_timeout,
    ));
    if let Some(kv_events) = config.kv_events.clone() {
        start_kv_event_publisher(&shared, kv_events).await?;
    }
    tracing::info!(
        grpc = %listeners.grpc.local_addr()?,
        http = %listeners.http.local_addr()?,
        model = %shared.model_name,
        "serving"
    );
    let health_service = start_background_tasks(&shared).await;
    let mut tasks = ServerTasks::start(&config, &shared, listeners, health_service)?;

    // A listener that stops by itself is fatal; otherwise serve until a signal.
    let signal: Result<&'static str, String> = tokio::select! {
        signal = shutdown => Ok(signal?),
        result = &mut tasks.grpc => {
            result.context("the gRPC server task failed")?;
            anyhow::bail!("the gRPC server stopped unexpectedly");
        }
        result = &mut tasks.http => {
            result.context("the HTTP server task failed")?;
            anyhow::bail!("the HTTP server stopped unexpectedly");
        }
        failure = engine_failure(&shared) => Err(failure),
    };
    match signal {
        Ok(signal) => drain_and_close(&shared, tasks, signal, config.drain_timeout).await,
        Err(failure) => {
            // The engine has failed every request it held; those answers reach their clients
            // before the process exits, rather than a connection that just closes.
            wait_answered(&shared, Instant::now() + ABANDON_GRACE).await;
            shared.close();
            let _ = tasks.close().await;
            anyhow::bail!("the engine stopped: {failure}");
        }
    }
}

/// Starts what runs beside the listeners: readiness reporting and NPU sampling. Returns the
/// health service, which already has a status for every service.
async fn start_background_tasks(
    shared: &Arc<Shared>,
) -> tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health> {
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    // Every service has a status before the first connection is accepted: a probe that comes
    // early must read NOT_SERVING, never "service not registered".
    let initial = report_readiness(shared, &health_reporter, None).await;
    tokio::spawn(track_readiness(shared.clone(), health_reporter, initial));
    if let Some(tool) = telemetry::find_npu_smi() {
        tokio::spawn(sample_npus(shared.clone(), tool));
    }
    health_service
}

/// Sets up the vLLM-format event sockets (a wrong endpoint fails the start) and publishes
/// on them until the worker closes.
async fn start_kv_event_publisher(
    shared: &Arc<Shared>,
    config: kv_events_zmq::ZmqEventsConfig,
) -> anyhow::Result<()> {
    if shared.engine.kv_events().is_none() {
        anyhow::bail!("--kv-events-endpoint: this engine publishes no prefix-cache events");
    }
    let publisher = kv_events_zmq::ZmqPublisher::start(config).await?;
    let shared = shared.clone();
    tokio::spawn(async move {
        if let Some(log) = shared.engine.kv_events() {
            publisher.run(log, shared.closing()).await;
        }
    });
    Ok(())
}

/// The gRPC services: health, reflection, the Open Inference Protocol and the load service.
fn grpc_app<H>(
    config: &ServerConfig,
    shared: &Arc<Shared>,
    health_service: tonic_health::pb::health_server::HealthServer<H>,
) -> anyhow::Result<axum::Router>
where
    H: tonic_health::pb::health_server::Health,
{
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(npufleet_contract::proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("cannot build the gRPC reflection service")?;
    Ok(tonic::service::Routes::new(health_service)
        .add_service(reflection)
        .add_service(
            GrpcInferenceServiceServer::new(grpc::InferenceService::new(
                shared.clone(),
                config.api_key.clone(),
            ))
            .max_decoding_message_size(config.max_grpc_message_bytes),
        )
        .add_service(WorkerLoadServer::new(grpc::LoadService::new(
            shared.clone(),
        )))
        .prepare()
        .into_axum_router()
        .layer(tower::util::MapResponseLayer::new(
            grpc::name_message_limit::<axum::body::Body>,
        )))
}

/// The two listeners' tasks and the flag that stops them.
struct ServerTasks {
    grpc: tokio::task::JoinHandle<()>,
    http: tokio::task::JoinHandle<()>,
    stop: watch::Sender<bool>,
}

impl ServerTasks {
    fn start<H>(
        config: &ServerConfig,
        shared: &Arc<Shared>,
        listeners: Listeners,
        health_service: tonic_health::pb::health_server::HealthServer<H>,
    ) -> anyhow::Result<ServerTasks>
    where
        H: tonic_health::pb::health_server::Health,
    {
        let (stop, stop_rx) = watch::channel(false);
        let grpc = tokio::spawn(listener::serve(
            listeners.grpc,
            grpc_app(config, shared, health_service)?,
            Protocol::Grpc,
            config.connections,
            |_| {},
            stopped(stop_rx.clone()),
        ));
        let router = router::router(http::HttpState {
            shared: shared.clone(),
            api_key: config.api_key.clone(),
            max_body_bytes: config.max_body_bytes,
            thermal_root: Arc::new(PathBuf::from("/sys/class/thermal")),
            reasoning_parser: config.reasoning_parser,
        });
        let send_buffer_bytes = config.http_send_buffer_bytes;
        let http = tokio::spawn(listener::serve(
            listeners.http,
            router,
            Protocol::Http,
            config.connections,
            move |connection| {
                if let Err(error) =
                    socket2::SockRef::from(connection).set_send_buffer_size(send_buffer_bytes)
                {
                    tracing::warn!(%error, "cannot bound a connection's send buffer");
                }
            },
            stopped(stop_rx),
        ));
        Ok(ServerTasks { grpc, http, stop })
    }

    /// Stops both listeners and waits up to [`CLOSE_GRACE`] for their connections to close;
    /// `None` when they did not.
    async fn close(
        self,
    ) -> Option<(
        Result<(), tokio::task::JoinError>,
        Result<(), tokio::task::JoinError>,
    )> {
        let _ = self.stop.send(true);
        tokio::time::timeout(CLOSE_GRACE, async {
            let grpc = self.grpc.await;
            let http = self.http.await;
            (grpc, http)
        })
        .await
        .ok()
    }
}

/// After the shutdown signal: refuses new requests, waits for accepted ones up to
/// `drain_timeout` (then answers the rest with an error), and closes the listeners.
async fn drain_and_close(
    shared: &Shared,
    tasks: ServerTasks,
    signal: &'static str,
    drain_timeout: Duration,
) -> anyhow::Result<()> {
    tracing::info!(signal, "draining");
    shared.begin_shutdown();
    let deadline = Instant::now() + drain_timeout;
    let drained = wait_drained(shared, deadline).await;
    let unanswered = shared.in_flight();
    if drained {
        tracing::info!("drained; every accepted request was answered");
    } else {
        abandon_unanswered(shared, unanswered, drain_timeout).await;
    }
    if let Some(failure) = shared.engine.failure() {
        anyhow::bail!("the engine stopped while draining: {failure}");
    }
    shared.close();
    match tasks.close().await {
        Some((grpc, http)) => {
            grpc.context("the gRPC server task failed")?;
            http.context("the HTTP server task failed")?;
        }
        None => tracing::warn!("connections still open after the drain; closing them"),
    }
    if !drained {
        anyhow::bail!(
            "the drain timeout of {drain_timeout:?} passed with {unanswered} requests unanswered"
        );
    }
    Ok(())
}

async fn abandon_unanswered(shared: &Shared, unanswered: usize, drain_timeout: Duration) {
    tracing::warn!(
        in_flight = unanswered,
        "drain timeout of {:?} passed; closing with requests unanswered",
        drain_timeout
    );
    // Each unanswered client gets an error (an SSE error event, a gRPC status, a 500)
    // rather than a connection that just closes.
    shared.abandon_in_flight(&format!(
        "the worker shut down before this request finished: the drain timeout of {:?} passed",
        drain_timeout
    ));
    wait_answered(shared, Instant::now() + ABANDON_GRACE).await;
}

/// How long clients whose requests a timed-out drain gave up on get to receive the error.
const ABANDON_GRACE: Duration = Duration::from_secs(1);
/// How long connections get to close once every stream has ended.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// Waits until every response has been handed to its connection, or the deadline.
async fn wait_answered(shared: &Shared, deadline: Instant) {
    while shared.in_flight() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Resolves once the stop flag is set.
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

/// Resolves with the name of the first SIGTERM or SIGINT.
pub async fn termination_signal() -> anyhow::Result<&'static str> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate()).context("cannot watch SIGTERM")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("cannot watch SIGINT")?;
    Ok(tokio::select! {
        _ = terminate.recv() => "SIGTERM",
        _ = interrupt.recv() => "SIGINT",
    })
}

/// Resolves with the reason once the engine has stopped for good (for example, a lost
/// tensor-parallel rank), so the process exits and its group is recreated.
async fn engine_failure(shared: &Shared) -> String {
    let mut ticks = tokio::time::interval(Duration::from_millis(100));
    loop {
        ticks.tick().await;
        if let Some(failure) = shared.engine.failure() {
            return failure;
        }
    }
}

/// Waits until the engine has nothing queued or running and every response has been handed
/// to its connection; `false` if the deadline came first.
async fn wait_drained(shared: &Shared, deadline: Instant) -> bool {
    loop {
        if shared.engine.state() == EngineState::Drained && shared.in_flight() == 0 {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Keeps gRPC health in step with readiness, for the whole server and the inference service.
async fn track_readiness(
    shared: Arc<Shared>,
    reporter: tonic_health::server::HealthReporter,
    mut last: ServingStatus,
) {
    let mut ticks = tokio::time::interval(Duration::from_millis(100));
    loop {
        ticks.tick().await;
        last = report_readiness(&shared, &reporter, Some(last)).await;
    }
}

/// Publishes readiness as the gRPC health of every service, when it differs from `last`.
async fn report_readiness(
    shared: &Shared,
    reporter: &tonic_health::server::HealthReporter,
    last: Option<ServingStatus>,
) -> ServingStatus {
    let status = if shared.ready() {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    };
    if last != Some(status) {
        for service in ["", "inference.GRPCInferenceService"] {
            reporter.set_service_status(service, status).await;
        }
    }
    status
}

/// Reads `npu-smi info` periodically for the metrics endpoint.
async fn sample_npus(shared: Arc<Shared>, tool: PathBuf) {
    let mut ticks = tokio::time::interval(Duration::from_secs(15));
    loop {
        ticks.tick().await;
        if let Some(chips) = telemetry::sample_npu_smi(&tool).await {
            shared.metrics.set_npu_chips(chips);
        }
    }
}

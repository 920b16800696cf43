//! The router's flags and its main loop: watches, load streams, and the HTTP and gRPC
//! listeners, until SIGTERM or Ctrl-C.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use npufleet_contract::listener::{self, ConnectionLimits, Protocol};
use npufleet_contract::logging::{self, LogFormat};
use npufleet_contract::ports::{GRPC_PORT, HTTP_PORT};
use npufleet_contract::proto::inference::grpc_inference_service_server::GrpcInferenceServiceServer;

use crate::discovery::Discovery;
use crate::grpc::GrpcFrontDoor;
use crate::http::{HttpState, app};
use crate::metrics::Metrics;
use crate::pool::{PickSettings, Pool};
use crate::prompt::{PrefixBlocks, Recipes};
use crate::retry::RetryPolicy;
use crate::route::{Router, Settings};

/// Routes OpenAI, KServe v2 REST and Open Inference Protocol requests over the ready replicas
/// of every InferenceService it sees, by model name.
#[derive(clap::Parser, Debug, Clone)]
#[command(version)]
pub struct Args {
    /// Address of the HTTP listener (OpenAI API, KServe v2 REST, /metrics, health).
    #[arg(long, env = "NPUFLEET_ROUTER_HTTP_ADDR", default_value_t = SocketAddr::from(([0, 0, 0, 0], HTTP_PORT)))]
    pub http_addr: SocketAddr,
    /// Address of the gRPC listener (Open Inference Protocol).
    #[arg(long, env = "NPUFLEET_ROUTER_GRPC_ADDR", default_value_t = SocketAddr::from(([0, 0, 0, 0], GRPC_PORT)))]
    pub grpc_addr: SocketAddr,
    /// Watch only this namespace (default: every namespace).
    #[arg(long, env = "NPUFLEET_ROUTER_NAMESPACE")]
    pub namespace: Option<String>,
    /// Replicas one request may be sent to, the first included, when earlier ones fail before
    /// answering (refused, reset, 503 draining, 429 queue full).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub max_attempts: u32,
    /// Milliseconds to wait before the first retry; each further one waits twice as long, up
    /// to --retry-backoff-max-ms, less a random part of up to half.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(0..=10_000))]
    pub retry_backoff_ms: u64,
    /// The longest wait, in milliseconds, between two attempts of one request.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub retry_backoff_max_ms: u64,
    /// Requests per model that may wait at once for a first ready replica; more get 429.
    #[arg(long, default_value_t = 256)]
    pub hold_queue: usize,
    /// Seconds a request waits for a ready replica before it is answered 503.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub hold_timeout_seconds: u64,
    /// The Retry-After (seconds) of a 429 when a model's hold queue is full.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub hold_retry_after_seconds: u64,
    /// Least seconds between two wake-up signals to one InferenceService at zero replicas.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub wake_interval_seconds: u64,
    /// Milliseconds between the load reports each worker streams to the router.
    #[arg(long, default_value_t = 250, value_parser = clap::value_parser!(u32).range(100..=5000))]
    pub load_interval_ms: u32,
    /// Leading prefix-cache blocks (of the worker's block size) that make up the
    /// prefix-affinity key.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub prefix_blocks: u32,
    /// Prefix-affinity keeps a prompt's replica while that replica's outstanding requests stay
    /// within this factor of the mean.
    #[arg(long, default_value_t = 1.25)]
    pub prefix_load_factor: f64,
    /// Cache-aware routing considers a replica for a prompt while it has at most this many
    /// requests outstanding beyond the least loaded replica's, and keeps the prompt on the
    /// one holding it as long as its cached prefix saves more than the prompts ahead cost.
    /// Every move costs the next replica a prefill and evicts what it held, so the holder
    /// keeps a prompt through small imbalances.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(0..=1024))]
    pub cache_slack: u32,
    /// Cache-aware routing has an idle replica compute a prefix that several prompts share
    /// (a system prompt), so that the prompts that start from it split between the replicas
    /// rather than pile onto the one that computed it first.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub copy_shared_prefixes: bool,
    /// Largest accepted request body (HTTP) or message (gRPC), in bytes; larger get 413.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// Milliseconds to wait for a TCP connection to a replica.
    #[arg(long, default_value_t = 1000)]
    pub connect_timeout_ms: u64,
    #[arg(long, env = "NPUFLEET_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// What the HTTP and gRPC listeners bound their connections by.
    #[command(flatten)]
    pub connections: ConnectionLimits,
}

impl Args {
    fn settings(&self) -> anyhow::Result<Settings> {
        if !(self.prefix_load_factor.is_finite() && self.prefix_load_factor >= 1.0) {
            anyhow::bail!(
                "--prefix-load-factor must be a number of at least 1.0, got {}",
                self.prefix_load_factor
            );
        }
        if self.retry_backoff_max_ms < self.retry_backoff_ms {
            anyhow::bail!(
                "--retry-backoff-max-ms ({}) must be at least --retry-backoff-ms ({})",
                self.retry_backoff_max_ms,
                self.retry_backoff_ms
            );
        }
        if self.hold_queue == 0 {
            anyhow::bail!("--hold-queue must be at least 1");
        }
        let load_interval = Duration::from_millis(self.load_interval_ms.into());
        Ok(Settings {
            retry: RetryPolicy {
                max_attempts: self.max_attempts as usize,
                backoff_base: Duration::from_millis(self.retry_backoff_ms),
                backoff_max: Duration::from_millis(self.retry_backoff_max_ms),
            },
            hold_queue: self.hold_queue,
            hold_timeout: Duration::from_secs(self.hold_timeout_seconds),
            hold_retry_after: Duration::from_secs(self.hold_retry_after_seconds),
            wake_interval: Duration::from_secs(self.wake_interval_seconds),
            pick: PickSettings {
                load_factor: self.prefix_load_factor,
                cache_slack: self.cache_slack,
                // Three missed reports: the stream is gone.
                report_max_age: load_interval * 3,
                copy_shared_prefixes: self.copy_shared_prefixes,
            },
            prefix: PrefixBlocks {
                max_blocks: self.prefix_blocks as usize,
            },
            max_body_bytes: self.max_body_bytes,
        })
    }
}

/// Runs the router until SIGTERM or Ctrl-C.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let _telemetry = logging::init(args.log_format, "npufleet-router");
    let settings = args.settings()?;
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API")?;
    let (discovery, watches) = Discovery::start(client.clone(), args.namespace.as_deref());
    let pool = Arc::new(Pool::default());
    let upstream = reqwest::Client::builder()
        .connect_timeout(Duration::from_millis(args.connect_timeout_ms))
        // Well before a worker closes a connection it kept alive, so that no request is sent
        // on one it is closing.
        .pool_idle_timeout(ConnectionLimits::default().http1_keep_alive() / 2)
        .build()?;
    let recipes = Arc::new(Recipes::new(upstream.clone()));
    let load_streams = crate::load::follow(
        discovery.fleet.clone(),
        pool.clone(),
        recipes.clone(),
        upstream.clone(),
        Duration::from_millis(args.load_interval_ms.into()),
        Duration::from_millis(args.connect_timeout_ms),
    );
    let metrics = Metrics::new()?;
    let router = Arc::new(Router::new(
        settings,
        discovery,
        pool,
        metrics,
        recipes,
        client,
        upstream.clone(),
    ));

    let http_listener = tokio::net::TcpListener::bind(args.http_addr)
        .await
        .with_context(|| format!("binding the HTTP listener to {}", args.http_addr))?;
    let grpc_listener = tokio::net::TcpListener::bind(args.grpc_addr)
        .await
        .with_context(|| format!("binding the gRPC listener to {}", args.grpc_addr))?;
    tracing::info!(http = %http_listener.local_addr()?, grpc = %grpc_listener.local_addr()?, namespace = args.namespace.as_deref().unwrap_or("(all)"), "routing");

    let http = listener::serve(
        http_listener,
        app(HttpState {
            router: router.clone(),
            upstream,
        }),
        Protocol::Http,
        args.connections,
        |_| {},
        shutdown_signal(),
    );
    let limit = router.settings.max_body_bytes;
    let grpc_service = GrpcInferenceServiceServer::new(GrpcFrontDoor::new(
        router.clone(),
        Duration::from_millis(args.connect_timeout_ms),
    ))
    .max_decoding_message_size(limit)
    .max_encoding_message_size(limit);
    let grpc = listener::serve(
        grpc_listener,
        tonic::service::Routes::new(grpc_service)
            .prepare()
            .into_axum_router(),
        Protocol::Grpc,
        args.connections,
        |_| {},
        shutdown_signal(),
    );

    // On SIGTERM both listeners stop accepting and finish the requests they have.
    tokio::select! {
        ((), ()) = futures::future::join(http, grpc) => {}
        () = watches => anyhow::bail!("the Kubernetes watches stopped"),
        () = load_streams => anyhow::bail!("the load streams stopped"),
    }
    tracing::info!("stopped");
    Ok(())
}

async fn shutdown_signal() {
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing the SIGTERM handler");
    tokio::select! {
        _ = terminate.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

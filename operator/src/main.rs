use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use clap::Parser;
use npufleet_contract::logging::{self, LogFormat};
use npufleet_operator::autoscaler::collect::{self, Collector};
use npufleet_operator::autoscaler::{self, Autoscaler};
use npufleet_operator::cache::WatchScope;
use npufleet_operator::external_metrics::{MetricsServer, MetricsStore, TlsSettings, tls};
use npufleet_operator::metrics::{self, Health, Metrics};
use npufleet_operator::{Context, Settings, leader};

/// Reconciles npufleet.io InferenceServices into Ascend worker fleets.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Worker image for InferenceServices that name none.
    #[arg(long, env = "NPUFLEET_WORKER_IMAGE", default_value = npufleet_operator::settings::DEFAULT_WORKER_IMAGE)]
    worker_image: String,
    /// Address of `/metrics`, `/healthz` and `/readyz`.
    #[arg(long, env = "NPUFLEET_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    /// Hold a Lease before reconciling, so only one replica acts.
    #[arg(long, env = "NPUFLEET_LEADER_ELECTION", default_value_t = true, action = clap::ArgAction::Set)]
    leader_election: bool,
    /// Namespace of the leader-election Lease (the operator's own).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    /// This replica's identity in the Lease.
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    #[arg(long, env = "NPUFLEET_CLUSTER_DOMAIN", default_value = "cluster.local")]
    cluster_domain: String,
    #[arg(long, env = "NPUFLEET_LOG_FORMAT", value_enum, default_value = "text")]
    log_format: LogFormat,
    /// Address of the external.metrics.k8s.io server (HTTPS); empty turns it off.
    #[arg(
        long,
        env = "NPUFLEET_EXTERNAL_METRICS_ADDR",
        default_value = "0.0.0.0:6443"
    )]
    external_metrics_addr: ListenAddr,
    /// PEM certificate chain the external metrics server presents (e.g. from cert-manager);
    /// when absent the operator makes a CA and certificate in `--external-metrics-secret`
    /// and writes the CA into the APIService's caBundle.
    #[arg(
        long,
        env = "NPUFLEET_EXTERNAL_METRICS_CERT_FILE",
        requires = "external_metrics_key_file"
    )]
    external_metrics_cert_file: Option<PathBuf>,
    /// PEM private key of `--external-metrics-cert-file`.
    #[arg(
        long,
        env = "NPUFLEET_EXTERNAL_METRICS_KEY_FILE",
        requires = "external_metrics_cert_file"
    )]
    external_metrics_key_file: Option<PathBuf>,
    /// The Service (in the operator's namespace) the APIService sends the aggregator to;
    /// the serving certificate is made for its DNS names.
    #[arg(
        long,
        env = "NPUFLEET_EXTERNAL_METRICS_SERVICE",
        default_value = "npufleet-external-metrics"
    )]
    external_metrics_service: String,
    /// The Secret (in the operator's namespace) that holds the operator-made CA and serving
    /// certificate, shared by every operator replica.
    #[arg(
        long,
        env = "NPUFLEET_EXTERNAL_METRICS_SECRET",
        default_value = "npufleet-external-metrics-tls"
    )]
    external_metrics_secret: String,
    /// Watch and write only this namespace (a namespaced install, RBAC by a Role there);
    /// empty: every namespace. One operator covers one namespace; a release per namespace
    /// covers several.
    #[arg(long, env = "NPUFLEET_WATCH_NAMESPACE", default_value = "")]
    watch_namespace: WatchScope,
    /// Seconds an InferenceService with `minReplicas: 0` must be idle (no request, no
    /// warming group, no wake request) before the built-in autoscaler takes it to zero.
    #[arg(
        long,
        env = "NPUFLEET_SCALE_TO_ZERO_IDLE_SECONDS",
        default_value_t = autoscaler::policy::DEFAULT_IDLE_BEFORE_ZERO.as_secs(),
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    scale_to_zero_idle_seconds: u64,
    /// The most pods one InferenceService may run; replica groups beyond it are not made
    /// and its status says so (`ReplicaFailure`, reason `PodLimitExceeded`).
    #[arg(
        long,
        env = "NPUFLEET_MAX_PODS_PER_SERVICE",
        default_value_t = npufleet_operator::settings::DEFAULT_MAX_PODS_PER_SERVICE,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    max_pods_per_service: u32,
}

/// A listen address, or none when given as an empty string.
#[derive(Clone, Debug)]
struct ListenAddr(Option<SocketAddr>);

impl FromStr for ListenAddr {
    type Err = std::net::AddrParseError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let text = text.trim();
        if text.is_empty() {
            return Ok(Self(None));
        }
        text.parse().map(|addr| Self(Some(addr)))
    }
}

/// What only the leader runs: the reconcile and the autoscaler. Returns when any part stops.
async fn lead(
    ctx: Arc<Context>,
    client: kube::Client,
    store: MetricsStore,
    settings: autoscaler::Settings,
) -> anyhow::Result<()> {
    let scaler = Autoscaler::new(
        client,
        ctx.scope.namespace(),
        &ctx.cache.stores,
        settings,
        store,
    )?;
    tokio::select! {
        () = npufleet_operator::run(ctx) => tracing::warn!("the controller stopped"),
        () = scaler.run() => tracing::warn!("the autoscaler stopped"),
    }
    Ok(())
}

/// What a replica runs until it leads: the load collection behind the external metrics, so
/// that an HPA query reaching this replica gets the same answer as from the leader. Dropped
/// on taking the lead, where the autoscaler collects from the shared cache instead.
async fn stand_by(
    client: &kube::Client,
    scope: &WatchScope,
    store: MetricsStore,
    settings: &autoscaler::Settings,
) {
    let (services, pods, watches) = collect::standby_stores(client, scope);
    let collector = Collector::new(
        settings.read_timeout,
        scope.namespace(),
        services,
        pods,
        store,
    );
    futures::join!(watches, collector.run(settings.tick));
}

/// The external metrics server's certificate and the aggregator's client CA.
async fn external_metrics_tls(client: &kube::Client, args: &Args) -> anyhow::Result<TlsSettings> {
    use anyhow::Context as _;
    let (cert_pem, key_pem) = match (
        &args.external_metrics_cert_file,
        &args.external_metrics_key_file,
    ) {
        (Some(cert), Some(key)) => (
            std::fs::read_to_string(cert).with_context(|| format!("reading {}", cert.display()))?,
            std::fs::read_to_string(key).with_context(|| format!("reading {}", key.display()))?,
        ),
        _ => {
            let names = tls::service_dns_names(
                &args.external_metrics_service,
                &args.lease_namespace,
                &args.cluster_domain,
            );
            let certificate = tls::ServingCertificate::ensure_in_secret(
                client,
                &args.lease_namespace,
                &args.external_metrics_secret,
                &names,
            )
            .await?;
            if !tls::publish_ca_bundle(client, &certificate.ca_pem).await? {
                tracing::warn!(
                    api_service = tls::API_SERVICE,
                    "the APIService is not registered, so no HPA reads this server"
                );
            }
            (certificate.cert_pem, certificate.key_pem)
        }
    };
    let client_auth = match tls::ClientAuth::from_cluster(client).await {
        Ok(auth) => Some(auth),
        Err(error) => {
            tracing::error!(
                error = format!("{error:#}"),
                "every external metrics request will be refused"
            );
            None
        }
    };
    Ok(TlsSettings {
        cert_pem,
        key_pem,
        client_auth,
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let _telemetry = logging::init(args.log_format, "npufleet-operator");
    let metrics = Metrics::new()?;
    let client = metrics.counted_client().await?;
    let identity = args
        .identity
        .clone()
        .unwrap_or_else(|| format!("npufleet-operator-{}", std::process::id()));
    let settings = Settings {
        worker_image: args.worker_image.clone(),
        cluster_domain: args.cluster_domain.clone(),
        max_pods_per_service: args.max_pods_per_service,
    };
    let health = Health::default();
    tracing::info!(
        namespace = args.watch_namespace.namespace().unwrap_or("<all>"),
        "watching"
    );
    let ctx = Arc::new(
        Context::new(
            client.clone(),
            settings,
            metrics.clone(),
            Some(identity.clone()),
        )
        .watching(args.watch_namespace.clone()),
    );

    let mut scaler_settings = autoscaler::Settings::default();
    scaler_settings.policy.idle_before_zero =
        std::time::Duration::from_secs(args.scale_to_zero_idle_seconds);
    let store = MetricsStore::default();
    let external_metrics = match args.external_metrics_addr.0 {
        Some(addr) => {
            let tls = external_metrics_tls(&client, &args).await?;
            let server = MetricsServer::bind(addr, store.clone(), &tls).await?;
            tracing::info!(addr = %server.local_addr()?, "serving external metrics");
            Some(tokio::spawn(server.run()))
        }
        None => None,
    };
    let external_metrics_stopped = async {
        match external_metrics {
            Some(server) => server.await,
            None => std::future::pending().await,
        }
    };

    let server = tokio::spawn(metrics::serve(args.metrics_addr, metrics, health.clone()));
    health.set_ready();
    let client_for_leader = client.clone();
    let operate = async {
        if args.leader_election {
            let (mut leading, _elector) =
                leader::elect(client, &args.lease_namespace, &identity).await?;
            tracing::info!(%identity, "waiting to lead");
            tokio::select! {
                led = leader::wait_for(&mut leading, true) => led?,
                () = stand_by(&client_for_leader, &ctx.scope, store.clone(), &scaler_settings) => {
                    anyhow::bail!("the standby watches ended");
                }
            }
            tracing::info!(%identity, "leading");
            tokio::select! {
                led = lead(ctx, client_for_leader, store, scaler_settings) => led?,
                lost = leader::wait_for(&mut leading, false) => {
                    lost?;
                    // Exit rather than reconcile without the lease; the Deployment restarts us.
                    anyhow::bail!("lost the leader lease");
                }
            }
        } else {
            lead(ctx, client_for_leader, store, scaler_settings).await?;
        }
        anyhow::Ok(())
    };
    tokio::select! {
        result = operate => result,
        served = server => Err(anyhow::anyhow!("metrics server stopped: {served:?}")),
        served = external_metrics_stopped => {
            Err(anyhow::anyhow!("external metrics server stopped: {served:?}"))
        }
    }
}

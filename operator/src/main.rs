use std::net::SocketAddr;
use std::sync::Arc;

use clap::Parser;
use npufleet_operator::metrics::{self, Health, Metrics};
use npufleet_operator::telemetry::{self, LogFormat};
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
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    telemetry::init(args.log_format);
    let client = kube::Client::try_default().await?;
    let identity = args
        .identity
        .clone()
        .unwrap_or_else(|| format!("npufleet-operator-{}", std::process::id()));
    let settings = Settings {
        worker_image: args.worker_image,
        cluster_domain: args.cluster_domain,
    };
    let metrics = Metrics::new()?;
    let health = Health::default();
    let ctx = Arc::new(Context::new(
        client.clone(),
        settings,
        metrics.clone(),
        Some(identity.clone()),
    ));

    let server = tokio::spawn(metrics::serve(args.metrics_addr, metrics, health.clone()));
    health.set_ready();
    let operate = async {
        if args.leader_election {
            let (mut leading, _elector) =
                leader::elect(client, &args.lease_namespace, &identity).await?;
            tracing::info!(%identity, "waiting to lead");
            leader::wait_for(&mut leading, true).await?;
            tracing::info!(%identity, "leading");
            tokio::select! {
                () = npufleet_operator::run(ctx) => {}
                lost = leader::wait_for(&mut leading, false) => {
                    lost?;
                    // Exit rather than reconcile without the lease; the Deployment restarts us.
                    anyhow::bail!("lost the leader lease");
                }
            }
        } else {
            npufleet_operator::run(ctx).await;
        }
        anyhow::Ok(())
    };
    tokio::select! {
        result = operate => result,
        served = server => Err(anyhow::anyhow!("metrics server stopped: {served:?}")),
    }
}

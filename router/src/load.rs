//! One `WorkerLoad.WatchLoad` stream per serving replica, feeding its reports into the pool,
//! started and stopped as replicas come and go.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use npufleet_contract::ports::GRPC_PORT;
use npufleet_contract::proto::npufleet::v1::worker_load_client::WorkerLoadClient;
use npufleet_contract::proto::npufleet::v1::{LoadReport, WatchLoadRequest, WorkerState};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::Endpoint;

use crate::discovery::Fleet;
use crate::policy::ReportedLoad;
use crate::pool::{Pool, ReplicaState, Report};

/// Follows the fleet: a load stream for every serving replica, none for the others.
pub async fn follow(
    mut fleet: watch::Receiver<Arc<Fleet>>,
    pool: Arc<Pool>,
    interval: Duration,
    connect_timeout: Duration,
) {
    let mut streams: HashMap<IpAddr, JoinHandle<()>> = HashMap::new();
    loop {
        let live: Vec<IpAddr> = fleet
            .borrow_and_update()
            .models
            .values()
            .flat_map(|m| m.endpoints.iter().map(|e| e.ip))
            .collect();
        streams.retain(|ip, task| {
            let keep = live.contains(ip);
            if !keep {
                task.abort();
            }
            keep
        });
        pool.retain(&live);
        for ip in &live {
            streams.entry(*ip).or_insert_with(|| {
                tokio::spawn(watch_replica(
                    *ip,
                    pool.replica(*ip),
                    interval,
                    connect_timeout,
                ))
            });
        }
        if fleet.changed().await.is_err() {
            break;
        }
    }
    for task in streams.values() {
        task.abort();
    }
}

/// Reads the replica's load stream until the task is aborted, reconnecting after failures.
async fn watch_replica(
    ip: IpAddr,
    state: Arc<ReplicaState>,
    interval: Duration,
    connect_timeout: Duration,
) {
    let interval_ms = u32::try_from(interval.as_millis()).unwrap_or(u32::MAX);
    loop {
        if let Err(error) = stream_reports(ip, &state, interval_ms, connect_timeout).await {
            tracing::debug!(%ip, %error, "load stream ended");
        }
        // The replica is still listed (the task is aborted when it goes): try again after one
        // report interval, so a restarting worker is not hammered.
        tokio::time::sleep(interval).await;
    }
}

async fn stream_reports(
    ip: IpAddr,
    state: &ReplicaState,
    interval_ms: u32,
    connect_timeout: Duration,
) -> anyhow::Result<()> {
    let channel = Endpoint::from_shared(format!(
        "http://{}",
        std::net::SocketAddr::new(ip, GRPC_PORT)
    ))?
    .connect_timeout(connect_timeout)
    .connect()
    .await?;
    let mut reports = WorkerLoadClient::new(channel)
        .watch_load(WatchLoadRequest { interval_ms })
        .await?
        .into_inner();
    while let Some(report) = reports.message().await? {
        state.set_report(to_report(&report));
    }
    Ok(())
}

fn to_report(report: &LoadReport) -> Report {
    let draining = matches!(report.state(), WorkerState::Draining | WorkerState::Drained);
    Report {
        load: ReportedLoad {
            waiting: report.waiting,
            running: report.running,
            kv_cache_usage: report.kv_cache_usage,
        },
        draining,
        received: Instant::now(),
    }
}

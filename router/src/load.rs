//! One load watch per serving replica, feeding its reports into the pool, started and stopped
//! as replicas come and go: this project's worker pushes its load over a `WorkerLoad.WatchLoad`
//! stream (and publishes its prefix-cache block size once in its `/metrics`); another engine's
//! load is scraped from the Prometheus series the contract's engine table names; an engine
//! with none is routed on the router's own in-flight counts.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use npufleet_contract::ports::{GRPC_PORT, HTTP_PORT};
use npufleet_contract::proto::npufleet::v1::worker_load_client::WorkerLoadClient;
use npufleet_contract::proto::npufleet::v1::{
    LoadReport, WatchKvEventsRequest, WatchLoadRequest, WorkerState,
};
use npufleet_contract::runtime::{LoadMetrics, LoadSource};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::Endpoint;

use crate::discovery::Fleet;
use crate::policy::ReportedLoad;
use crate::pool::{Pool, ReplicaState, Report};
use crate::prompt::{Recipes, cache_block_size};

/// Follows the fleet: a load stream for every serving replica, none for the others; and the
/// prompt recipe of every cache-aware model fetched as soon as it has a replica, so its first
/// requests are already placed by their token blocks.
pub async fn follow(
    mut fleet: watch::Receiver<Arc<Fleet>>,
    pool: Arc<Pool>,
    recipes: Arc<Recipes>,
    http: reqwest::Client,
    interval: Duration,
    connect_timeout: Duration,
) {
    let mut streams: HashMap<IpAddr, (Watched, JoinHandle<()>)> = HashMap::new();
    loop {
        for (name, model) in &fleet.borrow().models {
            if model.routes_on_cached_blocks() && !model.endpoints.is_empty() {
                recipes.get(name, model.first_http_address());
            }
        }
        let live: HashMap<IpAddr, Watched> = fleet
            .borrow_and_update()
            .models
            .values()
            .flat_map(|m| {
                let watched = Watched {
                    load: m.load.clone(),
                    http_port: m.http_port,
                };
                m.endpoints.iter().map(move |e| (e.ip, watched.clone()))
            })
            .collect();
        streams.retain(|ip, (watched, task)| {
            let keep = live.get(ip) == Some(watched);
            if !keep {
                task.abort();
            }
            keep
        });
        pool.retain(&live.keys().copied().collect::<Vec<_>>());
        for (ip, watched) in live {
            let state = pool.replica(ip);
            let http = http.clone();
            streams.entry(ip).or_insert_with(|| {
                let task = match &watched.load {
                    LoadSource::WorkerStream => tokio::spawn(async move {
                        tokio::join!(
                            watch_replica(ip, state.clone(), http, interval, connect_timeout),
                            follow_cache(ip, state, interval, connect_timeout),
                        );
                    }),
                    LoadSource::Scrape(metrics) => {
                        let port = metrics.port.unwrap_or(watched.http_port);
                        let url = format!("http://{}{}", SocketAddr::new(ip, port), metrics.path);
                        tokio::spawn(scrape_replica(url, metrics.clone(), state, http, interval))
                    }
                    LoadSource::RouterCounts => tokio::spawn(async {}),
                };
                (watched, task)
            });
        }
        if fleet.changed().await.is_err() {
            break;
        }
    }
    for (_, task) in streams.values() {
        task.abort();
    }
}

/// What a replica's watch follows; a change restarts it.
#[derive(Clone, PartialEq)]
struct Watched {
    load: LoadSource,
    http_port: u16,
}

/// Scrapes an engine's load every `interval` until aborted. A failed scrape or a missing
/// series leaves the last report to age out, after which the replica is routed on the
/// router's in-flight counts: never on a zero it did not report.
async fn scrape_replica(
    url: String,
    metrics: LoadMetrics,
    state: Arc<ReplicaState>,
    http: reqwest::Client,
    interval: Duration,
) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let scraped = async {
            let text = http
                .get(&url)
                .timeout(interval.max(Duration::from_secs(1)))
                .send()
                .await?
                .error_for_status()?
                .text()
                .await?;
            metrics.read(&text).map_err(anyhow::Error::msg)
        };
        match scraped.await {
            Ok(load) => state.set_report(Report {
                load: ReportedLoad::new(load.waiting, load.running, load.kv_cache_usage),
                draining: false,
                prompt_chunk: None,
                received: Instant::now(),
            }),
            Err(error) => tracing::debug!(%url, error = format!("{error:#}"), "scraping load"),
        }
    }
}

/// Reads the replica's load stream until the task is aborted, reconnecting after failures.
async fn watch_replica(
    ip: IpAddr,
    state: Arc<ReplicaState>,
    http: reqwest::Client,
    interval: Duration,
    connect_timeout: Duration,
) {
    let interval_ms = u32::try_from(interval.as_millis()).unwrap_or(u32::MAX);
    let mut block_size_known = false;
    loop {
        if !block_size_known {
            match read_block_size(&http, ip).await {
                Ok(tokens) => {
                    state.set_block_size(tokens);
                    block_size_known = true;
                }
                Err(error) => tracing::debug!(%ip, %error, "no prefix-cache block size yet"),
            }
        }
        if let Err(error) = stream_reports(ip, &state, interval_ms, connect_timeout).await {
            tracing::debug!(%ip, %error, "load stream ended");
        }
        // The replica is still listed (the task is aborted when it goes): try again after one
        // report interval, so a restarting worker is not hammered.
        tokio::time::sleep(interval).await;
    }
}

/// Follows the replica's prefix-cache events until the task is aborted. While the stream is
/// down (a restarting worker, a router that just started) the replica's view is empty, and
/// each new stream starts with a snapshot.
async fn follow_cache(
    ip: IpAddr,
    state: Arc<ReplicaState>,
    interval: Duration,
    connect_timeout: Duration,
) {
    loop {
        if let Err(error) = stream_cache_events(ip, &state, connect_timeout).await {
            tracing::debug!(%ip, error = format!("{error:#}"), "cache event stream ended");
        }
        state.forget_cached();
        tokio::time::sleep(interval).await;
    }
}

async fn stream_cache_events(
    ip: IpAddr,
    state: &ReplicaState,
    connect_timeout: Duration,
) -> anyhow::Result<()> {
    let channel = Endpoint::from_shared(format!("http://{}", SocketAddr::new(ip, GRPC_PORT)))?
        .connect_timeout(connect_timeout)
        .connect()
        .await?;
    let mut batches = WorkerLoadClient::new(channel)
        .watch_kv_events(WatchKvEventsRequest {})
        .await?
        .into_inner();
    while let Some(batch) = batches.message().await? {
        // A gap means missed events: resubscribing starts over from a snapshot.
        state.apply_kv_events(&batch).map_err(|gap| {
            anyhow::anyhow!(
                "missed cache events: expected batch {}, got {}",
                gap.expected,
                gap.got
            )
        })?;
    }
    Ok(())
}

/// The replica's prefix-cache block size, from the `vllm:cache_config_info` series an
/// Endpoint Picker reads too.
async fn read_block_size(http: &reqwest::Client, ip: IpAddr) -> anyhow::Result<usize> {
    let url = format!(
        "http://{}/metrics",
        std::net::SocketAddr::new(ip, HTTP_PORT)
    );
    let metrics = http
        .get(&url)
        .timeout(Duration::from_secs(5))
        .send()
        .await?
        .error_for_status()?
        .text()
        .await?;
    cache_block_size(&metrics)
        .ok_or_else(|| anyhow::anyhow!("{url} has no vllm:cache_config_info block_size"))
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
        load: ReportedLoad::new(report.waiting, report.running, report.kv_cache_usage),
        draining,
        prompt_chunk: (report.prompt_chunk_tokens > 0).then_some(report.prompt_chunk_tokens),
        received: Instant::now(),
    }
}

//! Reads a replica's load: this project's worker over gRPC (`npufleet.v1.WorkerLoad/GetLoad`),
//! keeping one lazily connected channel per worker address; any other engine from the
//! Prometheus series the contract's engine table (or the InferenceService) names.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

use npufleet_contract::proto::npufleet::v1::worker_load_client::WorkerLoadClient;
use npufleet_contract::proto::npufleet::v1::{GetLoadRequest, LoadReport, WorkerState};
use npufleet_contract::runtime::LoadMetrics;

/// Where one replica's load is read.
#[derive(Clone, Debug, PartialEq)]
pub enum LoadTarget {
    /// The worker's `WorkerLoad` service at `host:port`.
    Worker(String),
    /// An engine's Prometheus text at `url`, read through `metrics`.
    Scrape { url: String, metrics: LoadMetrics },
    /// The engine publishes no load; the reason says so where the load would be.
    Silent(String),
}

pub struct LoadReader {
    timeout: Duration,
    channels: Mutex<HashMap<String, Channel>>,
    http: reqwest::Client,
}

impl LoadReader {
    /// `timeout` bounds each read, connection included, so that one stuck worker cannot
    /// stall a tick.
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            channels: Mutex::new(HashMap::new()),
            http: reqwest::Client::builder()
                .timeout(timeout)
                .build()
                .expect("an HTTP client without TLS settings builds"),
        }
    }

    pub async fn read(&self, target: &LoadTarget) -> anyhow::Result<LoadReport> {
        match target {
            LoadTarget::Worker(address) => self.read_worker(address).await,
            LoadTarget::Scrape { url, metrics } => self.scrape(url, metrics).await,
            LoadTarget::Silent(reason) => Err(anyhow::anyhow!("{reason}")),
        }
    }

    /// An engine's load from its metrics. Answering at all means it is up: its readiness is
    /// the pod's, which the group's state already counts.
    async fn scrape(&self, url: &str, metrics: &LoadMetrics) -> anyhow::Result<LoadReport> {
        let text = self
            .http
            .get(url)
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .map_err(|e| anyhow::anyhow!("scraping {url}: {e}"))?
            .text()
            .await
            .map_err(|e| anyhow::anyhow!("scraping {url}: {e}"))?;
        let load = metrics
            .read(&text)
            .map_err(|e| anyhow::anyhow!("{url}: {e}"))?;
        Ok(LoadReport {
            waiting: load.waiting,
            running: load.running,
            kv_cache_usage: load.kv_cache_usage,
            state: WorkerState::Ready.into(),
            ..Default::default()
        })
    }

    /// The load report of the worker whose load service listens on `address` (`host:port`).
    async fn read_worker(&self, address: &str) -> anyhow::Result<LoadReport> {
        let channel = self.channel(address)?;
        let mut client = WorkerLoadClient::new(channel);
        let reply = tokio::time::timeout(self.timeout, client.get_load(GetLoadRequest {}))
            .await
            .map_err(|_| {
                anyhow::anyhow!("no load report from {address} within {:?}", self.timeout)
            })?
            .map_err(|status| {
                anyhow::anyhow!("load report from {address}: {}", status.message())
            })?;
        Ok(reply.into_inner())
    }

    /// Drops the channels of workers that are gone.
    pub fn retain(&self, live: &std::collections::HashSet<String>) {
        self.lock().retain(|address, _| live.contains(address));
    }

    fn channel(&self, address: &str) -> anyhow::Result<Channel> {
        let mut channels = self.lock();
        if let Some(channel) = channels.get(address) {
            return Ok(channel.clone());
        }
        let channel = Endpoint::from_shared(format!("http://{address}"))
            .map_err(|e| anyhow::anyhow!("worker address {address:?}: {e}"))?
            .connect_timeout(self.timeout)
            .timeout(self.timeout)
            .connect_lazy();
        channels.insert(address.to_owned(), channel.clone());
        Ok(channel)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Channel>> {
        self.channels.lock().unwrap_or_else(|e| e.into_inner())
    }
}

//! Reads the workers' load signal (`npufleet.v1.WorkerLoad/GetLoad`) over gRPC, keeping one
//! lazily connected channel per worker address.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

use npufleet_contract::proto::npufleet::v1::worker_load_client::WorkerLoadClient;
use npufleet_contract::proto::npufleet::v1::{GetLoadRequest, LoadReport};

pub struct LoadReader {
    timeout: Duration,
    channels: Mutex<HashMap<String, Channel>>,
}

impl LoadReader {
    /// `timeout` bounds each read, connection included, so that one stuck worker cannot
    /// stall a tick.
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            channels: Mutex::new(HashMap::new()),
        }
    }

    /// The load report of the worker whose load service listens on `address` (`host:port`).
    pub async fn read(&self, address: &str) -> anyhow::Result<LoadReport> {
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

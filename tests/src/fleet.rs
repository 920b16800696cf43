//! Client-side view of a worker fleet: which pods serve, and least-outstanding-requests
//! routing across them (nothing routes Service traffic on a machine without kube-proxy).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Result;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use tokio::sync::{Mutex, Notify};

/// Ready and not terminating.
pub fn is_serving(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Ready, non-terminating front-end (rank 0) worker addresses, as an endpoints controller
/// would list them.
pub async fn serving_addresses(pods: &Api<Pod>) -> Result<Vec<String>> {
    let list = pods
        .list(&ListParams::default().labels("npufleet.io/rank=0"))
        .await?;
    Ok(list
        .items
        .iter()
        .filter(|p| is_serving(p))
        .filter_map(|p| p.status.as_ref()?.pod_ip.clone())
        .collect())
}

/// Routes each request to the serving address with the fewest requests in flight.
#[derive(Default)]
pub struct Router {
    addresses: Mutex<Vec<String>>,
    in_flight: Mutex<HashMap<String, u32>>,
    changed: Notify,
}

impl Router {
    pub async fn set_addresses(&self, addresses: Vec<String>) {
        *self.addresses.lock().await = addresses;
        self.changed.notify_waiters();
    }

    async fn try_pick(&self) -> Option<String> {
        let addresses = self.addresses.lock().await.clone();
        let mut in_flight = self.in_flight.lock().await;
        let chosen = addresses
            .iter()
            .min_by_key(|a| in_flight.get(*a).copied().unwrap_or(0))?
            .clone();
        *in_flight.entry(chosen.clone()).or_default() += 1;
        Some(chosen)
    }

    /// An address to send the next request to; when none serves, waits (at most `wait`)
    /// for the address list to change. Pair every `Some` with [`Router::release`].
    pub async fn pick(&self, wait: Duration) -> Option<String> {
        let changed = self.changed.notified();
        if let Some(address) = self.try_pick().await {
            return Some(address);
        }
        let _ = tokio::time::timeout(wait, changed).await;
        self.try_pick().await
    }

    pub async fn release(&self, address: &str) {
        if let Some(n) = self.in_flight.lock().await.get_mut(address) {
            *n = n.saturating_sub(1);
        }
    }
}

/// Closed-loop clients: each sends one request through the [`Router`], waits for the answer,
/// and repeats until stopped. Counts what was sent, what failed and which address answered.
#[derive(Default)]
pub struct Load {
    pub router: Router,
    sent: AtomicU64,
    failed: AtomicU64,
    failures: Mutex<Vec<String>>,
    answered_by: Mutex<HashMap<String, u64>>,
    stop: AtomicBool,
}

impl Load {
    /// Starts `clients` loops posting `body` to `path` on the picked worker's HTTP port.
    pub fn start(
        self: &Arc<Self>,
        clients: u32,
        path: &'static str,
        body: serde_json::Value,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(120))
            .build()
            .expect("HTTP client");
        (0..clients)
            .map(|_| tokio::spawn(self.clone().client_loop(http.clone(), path, body.clone())))
            .collect()
    }

    async fn client_loop(
        self: Arc<Self>,
        http: reqwest::Client,
        path: &str,
        body: serde_json::Value,
    ) {
        while !self.stop.load(Ordering::Relaxed) {
            let Some(address) = self.router.pick(Duration::from_millis(250)).await else {
                continue;
            };
            self.sent.fetch_add(1, Ordering::Relaxed);
            let response = http
                .post(format!("http://{address}:8000{path}"))
                .json(&body)
                .send()
                .await;
            let outcome = match response {
                Ok(r) if r.status().is_success() => r
                    .json::<serde_json::Value>()
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string()),
                Ok(r) => Err(format!("{address}: HTTP {}", r.status())),
                Err(e) => Err(format!("{address}: {e}")),
            };
            self.router.release(&address).await;
            match outcome {
                Ok(()) => *self.answered_by.lock().await.entry(address).or_default() += 1,
                Err(failure) => {
                    self.failed.fetch_add(1, Ordering::Relaxed);
                    self.failures.lock().await.push(failure);
                }
            }
        }
    }

    /// Ends the loops after their current request.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }

    pub async fn failures(&self) -> Vec<String> {
        self.failures.lock().await.clone()
    }

    /// Answered requests per worker address.
    pub async fn answered_by(&self) -> HashMap<String, u64> {
        self.answered_by.lock().await.clone()
    }
}

//! Client-side view of a worker fleet: which pods serve, and least-outstanding-requests
//! routing across them (nothing routes Service traffic on a machine without kube-proxy).

use std::collections::HashMap;
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

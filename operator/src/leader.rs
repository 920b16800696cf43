//! Leader election through a `coordination.k8s.io` Lease, so that of several operator replicas
//! only one reconciles.

use kube::Client;
use kube_lease_manager::{LeaseManagerBuilder, LeaseParams};
use tokio::sync::watch;

use crate::labels::FIELD_MANAGER;

pub const LEASE_NAME: &str = "npufleet-operator";

/// Lease duration and the grace before expiry at which the holder renews it, seconds.
pub const LEASE_SECONDS: u64 = 15;
const RENEW_GRACE_SECONDS: u64 = 5;

/// Holds the lease in the background; the channel turns `true` while this process leads.
pub async fn elect(
    client: Client,
    namespace: &str,
    identity: &str,
) -> anyhow::Result<(
    watch::Receiver<bool>,
    tokio::task::JoinHandle<kube_lease_manager::Result<kube_lease_manager::LeaseManager>>,
)> {
    let manager = LeaseManagerBuilder::new(client, LEASE_NAME)
        .with_namespace(namespace)
        .with_parameters(
            LeaseParams::new(identity, LEASE_SECONDS, RENEW_GRACE_SECONDS)
                .with_field_manager(FIELD_MANAGER),
        )
        .build()
        .await?;
    Ok(manager.watch().await)
}

/// Waits until `leading` turns to `want`; errors if the elector stopped.
pub async fn wait_for(leading: &mut watch::Receiver<bool>, want: bool) -> anyhow::Result<()> {
    leading.wait_for(|&is_leader| is_leader == want).await?;
    Ok(())
}

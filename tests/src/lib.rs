//! The end-to-end tests' support, on the local platform (`npufleet-local`, re-exported here:
//! control planes built from the upstream binaries, the node agent, the paths of the project's
//! own binaries, model and Python clients): the operator as a process, monitoring, and
//! closed-loop clients.
//!
//! A test binary shares one cluster ([`cluster::shared`]) and gives each test its own
//! namespace, so the control plane starts once per binary.

pub mod access;
pub mod fleet;
pub mod inventory;
pub mod monitoring;
pub mod operator;
pub mod service;

pub use npufleet_local::{
    chart, cluster, crd, net, node_agent, paths, process, real_node, runtime, wait,
};

/// Runs `test` on the shared cluster with an admin client; a failure comes back with the tail
/// of every process's log ([`cluster::Cluster::diagnose`]).
pub async fn on_shared_cluster<T, F, Fut>(test: F) -> anyhow::Result<T>
where
    F: FnOnce(&'static cluster::Cluster, kube::Client) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let c = cluster::shared();
    let client = c.client().await?;
    c.diagnose(test(c, client).await)
}

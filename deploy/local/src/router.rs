//! The fleet's front door on the local platform: the product's router (`npufleet-router`)
//! started as a process against the local control plane, and which worker pods it would
//! route to.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::Result;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use npufleet_contract::{labels, pods};

use crate::cluster::Cluster;
use crate::net::free_addr;
use crate::process::Process;
use crate::{paths, wait};

/// Ready, non-terminating front-end (rank 0) worker addresses, as an endpoints controller
/// would list them.
pub async fn serving_addresses(pods: &Api<Pod>) -> Result<Vec<String>> {
    let list = pods
        .list(&ListParams::default().labels(labels::SERVING_PODS))
        .await?;
    Ok(list
        .items
        .iter()
        .filter(|p| pods::serves(p))
        .filter_map(|p| p.status.as_ref()?.pod_ip.clone())
        .collect())
}

/// `npufleet-router` running as a child process against the local cluster; killed
/// when dropped.
pub struct RunningRouter {
    pub process: Process,
    pub http: SocketAddr,
    pub grpc: SocketAddr,
}

impl RunningRouter {
    /// Starts the router binary watching `namespace`, with `extra_args` appended to its flags,
    /// and waits until it has listed the cluster (`/readyz`). Logs to `<name>.log` in the
    /// cluster's scratch directory.
    pub async fn start(
        cluster: &Cluster,
        name: &str,
        namespace: &str,
        extra_args: &[&str],
    ) -> Result<Self> {
        let binary = paths::workspace_bin("npufleet-router")?;
        let kubeconfig = cluster.kubeconfig();
        Self::start_binary(&binary, cluster, kubeconfig, name, namespace, extra_args).await
    }

    /// [`RunningRouter::start`] with the router binary at `binary`, authenticating with
    /// `kubeconfig`'s credentials (a ServiceAccount's token to run it as the chart does).
    pub async fn start_binary(
        binary: &Path,
        cluster: &Cluster,
        kubeconfig: &Path,
        name: &str,
        namespace: &str,
        extra_args: &[&str],
    ) -> Result<Self> {
        let (http, grpc) = (free_addr()?, free_addr()?);
        let mut cmd = Command::new(binary);
        cmd.arg("--http-addr")
            .arg(http.to_string())
            .arg("--grpc-addr")
            .arg(grpc.to_string())
            .args(["--namespace", namespace])
            .args(extra_args)
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "info,npufleet_router=debug");
        let mut process =
            Process::start(name, cmd, &cluster.scratch().join(format!("{name}.log")))?;
        let probe = reqwest::Client::new();
        let ready = format!("http://{http}/readyz");
        let became_ready = wait::until(
            &format!("{name} ready"),
            Duration::from_secs(30),
            || async {
                let response = probe.get(&ready).send().await?;
                Ok(response.status().is_success().then_some(()))
            },
        )
        .await;
        if let Err(not_ready) = became_ready {
            process.ensure_running()?;
            return Err(not_ready.context(process.log_tail(20)));
        }
        Ok(RunningRouter {
            process,
            http,
            grpc,
        })
    }

    /// `http://<router>` followed by `path`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }

    /// The router's `/metrics` text.
    pub async fn metrics(&self) -> Result<String> {
        Ok(reqwest::get(self.url("/metrics"))
            .await?
            .error_for_status()?
            .text()
            .await?)
    }
}

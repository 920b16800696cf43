//! The monitoring stack of CCE's Cloud Native Cluster Monitoring add-on as processes against a
//! test cluster: Prometheus discovering worker pods through the cluster's API with the scrape
//! job in `deploy/cce/prometheus-scrape.yaml`, and prometheus-adapter serving
//! `external.metrics.k8s.io` from the rules in `deploy/cce/adapter-rules.yaml`, registered as
//! the aggregated `APIService` with a verified serving certificate.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Endpoints, Service};
use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use npufleet_operator::external_metrics::tls::{ServingCertificate, service_dns_names};
use serde_json::json;

use crate::cluster::Cluster;
use crate::net::free_port;
use crate::process::Process;
use crate::{paths, wait};

/// The APIService CCE's add-on (and the chart, when it serves the metrics itself) registers.
pub const EXTERNAL_METRICS_API_SERVICE: &str = "v1beta1.external.metrics.k8s.io";

const ADAPTER_SERVICE: &str = "prometheus-adapter";
const MANAGER: &str = "npufleet-tests-monitoring";

/// The shipped scrape job, adapter rules and dashboards.
pub fn deploy_file(relative: &str) -> PathBuf {
    paths::repo_root().join("deploy").join(relative)
}

/// Prometheus as a process, scraping the worker pods of one namespace.
pub struct Prometheus {
    _process: Process,
    url: String,
    http: reqwest::Client,
}

impl Prometheus {
    /// Starts Prometheus with the shipped scrape job, told only how to reach `cluster`'s API
    /// server and to watch `namespace` (tests share one cluster), and waits until it is ready.
    pub async fn start(cluster: &Cluster, namespace: &str) -> Result<Self> {
        let bin = tokio::task::spawn_blocking(paths::monitoring_bin).await??;
        let shipped = std::fs::read_to_string(deploy_file("cce/prometheus-scrape.yaml"))?;
        let mut config: serde_yaml::Value = serde_yaml::from_str(&shipped)?;
        let jobs = config["scrape_configs"]
            .as_sequence_mut()
            .context("prometheus-scrape.yaml has no scrape_configs")?;
        for job in jobs {
            let discovery = job["kubernetes_sd_configs"]
                .as_sequence_mut()
                .context("a scrape job without kubernetes_sd_configs")?;
            for sd in discovery {
                sd["kubeconfig_file"] = cluster.kubeconfig().display().to_string().into();
                sd["namespaces"] = serde_yaml::from_str(&format!("names: [{namespace}]"))?;
            }
        }
        let dir = cluster.scratch().join(format!("prometheus-{namespace}"));
        std::fs::create_dir_all(&dir)?;
        let config_file = dir.join("prometheus.yml");
        std::fs::write(&config_file, serde_yaml::to_string(&config)?)?;
        let port = free_port()?;
        let mut cmd = Command::new(bin.join("prometheus"));
        cmd.arg(format!("--config.file={}", config_file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn");
        let process = start_checked("prometheus", cmd, &dir.join("prometheus.log"))?;
        let url = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        wait::until("Prometheus ready", Duration::from_secs(60), || async {
            exited(&process)?;
            let status = http.get(format!("{url}/-/ready")).send().await?.status();
            Ok(status.is_success().then_some(()))
        })
        .await?;
        Ok(Self {
            _process: process.into_inner().expect("process lock"),
            url,
            http,
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// The series an instant PromQL query returns; an error names the query and Prometheus'
    /// reason when it refuses it (a syntax error, an unknown function).
    pub async fn query(&self, promql: &str) -> Result<Vec<serde_json::Value>> {
        let body: serde_json::Value = self
            .http
            .get(format!("{}/api/v1/query", self.url))
            .query(&[("query", promql)])
            .send()
            .await?
            .json()
            .await?;
        anyhow::ensure!(
            body["status"] == "success",
            "Prometheus refused {promql:?}: {} {}",
            body["errorType"],
            body["error"]
        );
        Ok(body["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }
}

/// prometheus-adapter as a process, registered as the cluster's external metrics API.
pub struct Adapter {
    _process: Process,
    pub certificate: ServingCertificate,
}

impl Adapter {
    /// Starts prometheus-adapter on the shipped rules against `prometheus`, serving a
    /// certificate for its Service in `namespace` and authenticating the aggregator by the
    /// request-header CA the cluster publishes, and registers it the way CCE's add-on does: a
    /// Service and the `v1beta1.external.metrics.k8s.io` APIService trusting its CA. Returns
    /// once the APIService is Available.
    pub async fn register(
        cluster: &Cluster,
        client: &Client,
        namespace: &str,
        prometheus: &Prometheus,
    ) -> Result<Self> {
        let bin = tokio::task::spawn_blocking(paths::monitoring_bin).await??;
        let dir = cluster
            .scratch()
            .join(format!("prometheus-adapter-{namespace}"));
        std::fs::create_dir_all(&dir)?;
        let certificate = ServingCertificate::generate(&service_dns_names(
            ADAPTER_SERVICE,
            namespace,
            "cluster.local",
        ))?;
        let (cert_file, key_file) = (dir.join("tls.crt"), dir.join("tls.key"));
        std::fs::write(&cert_file, &certificate.cert_pem)?;
        std::fs::write(&key_file, &certificate.key_pem)?;
        // Endpoints may not be loopback addresses: serve on the host's own address.
        let host = host_address()?;
        let port = free_port()?;
        let kubeconfig = cluster.kubeconfig().display().to_string();
        let mut cmd = Command::new(bin.join("prometheus-adapter"));
        cmd.arg(format!("--bind-address={host}"))
            .arg(format!("--secure-port={port}"))
            .arg(format!("--tls-cert-file={}", cert_file.display()))
            .arg(format!("--tls-private-key-file={}", key_file.display()))
            .arg(format!("--lister-kubeconfig={kubeconfig}"))
            .arg(format!("--authentication-kubeconfig={kubeconfig}"))
            .arg(format!("--authorization-kubeconfig={kubeconfig}"))
            .arg(format!("--prometheus-url={}", prometheus.url()))
            .arg(format!(
                "--config={}",
                deploy_file("cce/adapter-rules.yaml").display()
            ))
            // The adapter serves only the series it found at its last relist; its 10-minute
            // default would hide a fleet that started after it for that long.
            .arg("--metrics-relist-interval=15s")
            .arg("--v=1");
        let process = start_checked("prometheus-adapter", cmd, &dir.join("adapter.log"))?;

        let apply = PatchParams::apply(MANAGER).force();
        let service = json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": ADAPTER_SERVICE, "namespace": namespace},
            "spec": {"ports": [{"name": "https", "port": 443, "targetPort": port}]},
        });
        Api::<Service>::namespaced(client.clone(), namespace)
            .patch(ADAPTER_SERVICE, &apply, &Patch::Apply(service))
            .await?;
        let endpoints = json!({
            "apiVersion": "v1", "kind": "Endpoints",
            "metadata": {"name": ADAPTER_SERVICE, "namespace": namespace},
            "subsets": [{
                "addresses": [{"ip": host.to_string()}],
                "ports": [{"name": "https", "port": port}],
            }],
        });
        Api::<Endpoints>::namespaced(client.clone(), namespace)
            .patch(ADAPTER_SERVICE, &apply, &Patch::Apply(endpoints))
            .await?;
        use base64::Engine as _;
        let api_service = json!({
            "apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
            "metadata": {"name": EXTERNAL_METRICS_API_SERVICE},
            "spec": {
                "group": "external.metrics.k8s.io", "version": "v1beta1",
                "groupPriorityMinimum": 100, "versionPriority": 100,
                "service": {"name": ADAPTER_SERVICE, "namespace": namespace, "port": 443},
                "caBundle": base64::engine::general_purpose::STANDARD.encode(&certificate.ca_pem),
            },
        });
        let api_services: Api<APIService> = Api::all(client.clone());
        api_services
            .patch(
                EXTERNAL_METRICS_API_SERVICE,
                &apply,
                &Patch::Apply(api_service),
            )
            .await?;
        wait::until(
            "prometheus-adapter's APIService Available",
            Duration::from_secs(90),
            || async {
                exited(&process)?;
                let svc = api_services.get(EXTERNAL_METRICS_API_SERVICE).await?;
                let conditions = svc.status.and_then(|s| s.conditions).unwrap_or_default();
                if conditions
                    .iter()
                    .any(|c| c.type_ == "Available" && c.status == "True")
                {
                    Ok(Some(()))
                } else {
                    anyhow::bail!("conditions: {conditions:?}")
                }
            },
        )
        .await?;
        Ok(Self {
            _process: process.into_inner().expect("process lock"),
            certificate,
        })
    }
}

/// Fails, and stops the polling, when `process` has exited.
/// Starts `cmd` as [`Process::start`] does, in a lock: the polling closures that check it has
/// not [`exited`] may only borrow it.
fn start_checked(
    name: &str,
    cmd: Command,
    log: &std::path::Path,
) -> Result<std::sync::Mutex<Process>> {
    Ok(std::sync::Mutex::new(Process::start(name, cmd, log)?))
}

fn exited(process: &std::sync::Mutex<Process>) -> Result<()> {
    process
        .lock()
        .expect("process lock")
        .ensure_running()
        .map_err(wait::fatal)
}

/// The first non-loopback IPv4 address of this machine, where an extension API server listens
/// for the aggregator (an Endpoints address may not be a loopback one).
pub fn host_address() -> Result<Ipv4Addr> {
    let mut addrs: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `addrs` with a list we free with freeifaddrs below.
    if unsafe { libc::getifaddrs(&mut addrs) } != 0 {
        return Err(std::io::Error::last_os_error()).context("listing network interfaces");
    }
    let mut found = None;
    let mut cursor = addrs;
    while !cursor.is_null() && found.is_none() {
        // SAFETY: `cursor` points into the list getifaddrs returned, which is still alive.
        let entry = unsafe { &*cursor };
        if !entry.ifa_addr.is_null()
            // SAFETY: ifa_addr is non-null and points to a sockaddr of the family it names.
            && i32::from(unsafe { (*entry.ifa_addr).sa_family }) == libc::AF_INET
        {
            // SAFETY: an AF_INET address is a sockaddr_in.
            let v4 = unsafe { &*(entry.ifa_addr as *const libc::sockaddr_in) };
            let ip = Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr));
            if !ip.is_loopback() {
                found = Some(ip);
            }
        }
        cursor = entry.ifa_next;
    }
    // SAFETY: freeing the list getifaddrs allocated, once.
    unsafe { libc::freeifaddrs(addrs) };
    found.context("this machine has no non-loopback IPv4 address for the aggregator to reach")
}

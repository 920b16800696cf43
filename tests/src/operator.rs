//! The operator's controller and built-in autoscaler running inside a test process, against
//! one namespace, with scaling windows short enough for a test to watch a scale-down.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::events::v1::Event;
use kube::Client;
use kube::api::{Api, ListParams, Patch, PatchParams};
use npufleet_crds::InferenceService;
use npufleet_operator::autoscaler::policy::PolicyConfig;
use npufleet_operator::autoscaler::{self, Autoscaler};
use npufleet_operator::external_metrics::MetricsStore;
use npufleet_operator::metrics::Metrics;
use npufleet_operator::{Context, Settings};
use tokio::task::JoinHandle;

use crate::cluster::Cluster;
use crate::net::free_port;
use crate::paths;
use crate::process::Process;
use crate::wait;

/// Stops the controller and the autoscaler when dropped.
pub struct RunningOperator {
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for RunningOperator {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// How long a `minReplicas: 0` service stays idle before the test autoscaler takes it to zero.
pub const IDLE_BEFORE_ZERO: Duration = Duration::from_secs(6);

/// Starts the controller and the built-in autoscaler for `namespace`.
pub fn start_with_builtin_autoscaler(client: &Client, namespace: &str) -> Result<RunningOperator> {
    let operator = Arc::new(Context::new(
        client.clone(),
        Settings::default(),
        Metrics::new()?,
        None,
    ));
    let settings = autoscaler::Settings {
        policy: PolicyConfig {
            stable_window: Duration::from_secs(8),
            panic_window: Duration::from_secs(2),
            scale_down_delay: Duration::from_secs(4),
            idle_before_zero: IDLE_BEFORE_ZERO,
            ..PolicyConfig::default()
        },
        ..autoscaler::Settings::default()
    };
    let scaler = Autoscaler::new(
        client.clone(),
        Some(namespace),
        &operator.cache.stores,
        settings,
        MetricsStore::default(),
    )?;
    Ok(RunningOperator {
        tasks: vec![
            tokio::spawn(npufleet_operator::run(operator)),
            tokio::spawn(scaler.run()),
        ],
    })
}

/// Applies `service` with server-side apply as `manager`, retrying while the CRD is new.
pub async fn apply(
    services: &Api<InferenceService>,
    manager: &str,
    service: &InferenceService,
) -> Result<()> {
    let name = service.metadata.name.clone().unwrap_or_default();
    wait::until(
        "InferenceService apply",
        Duration::from_secs(30),
        || async {
            Ok(Some(
                services
                    .patch(
                        &name,
                        &PatchParams::apply(manager).force(),
                        &Patch::Apply(service),
                    )
                    .await?,
            ))
        },
    )
    .await?;
    Ok(())
}

/// The operator binary as a child process with `kubeconfig`'s credentials, electing a leader
/// through its Lease in `lease_namespace` as `identity`, with the external metrics server off.
/// Logs to `<identity>.log` in the cluster's scratch directory.
pub fn spawn_binary(
    cluster: &Cluster,
    kubeconfig: &Path,
    lease_namespace: &str,
    identity: &str,
) -> Result<Process> {
    let mut cmd = binary_command(kubeconfig, lease_namespace, identity)?;
    cmd.arg("--external-metrics-addr=");
    start_binary(cluster, identity, cmd)
}

/// One of several operator replicas in `namespace`, with the admin's credentials: it
/// elects through its Lease there, watches and writes only there (so that replicas of other
/// tests in the same cluster keep out), and serves external metrics on `external_metrics`
/// when given. Logs to `<identity>.log` in the cluster's scratch directory.
pub fn spawn_replica(
    cluster: &Cluster,
    namespace: &str,
    identity: &str,
    external_metrics: Option<SocketAddr>,
) -> Result<Process> {
    let mut cmd = binary_command(cluster.kubeconfig(), namespace, identity)?;
    cmd.args(["--watch-namespace", namespace]).arg(format!(
        "--external-metrics-addr={}",
        external_metrics.map(|a| a.to_string()).unwrap_or_default()
    ));
    start_binary(cluster, identity, cmd)
}

fn binary_command(kubeconfig: &Path, lease_namespace: &str, identity: &str) -> Result<Command> {
    let (mut cmd, _) = command(kubeconfig, "info")?;
    cmd.args(["--lease-namespace", lease_namespace, "--identity", identity]);
    Ok(cmd)
}

/// The operator binary with `kubeconfig`'s credentials, logging at `rust_log`, serving its
/// metrics on a free loopback port (returned); the caller adds the rest of its flags.
pub fn command(kubeconfig: &Path, rust_log: &str) -> Result<(Command, u16)> {
    let port = free_port()?;
    let mut cmd = Command::new(paths::workspace_bin("npufleet-operator")?);
    cmd.arg("--metrics-addr")
        .arg(format!("127.0.0.1:{port}"))
        .env("KUBECONFIG", kubeconfig)
        .env("RUST_LOG", rust_log);
    Ok((cmd, port))
}

fn start_binary(cluster: &Cluster, identity: &str, cmd: Command) -> Result<Process> {
    Process::start(
        identity,
        cmd,
        &cluster.scratch().join(format!("{identity}.log")),
    )
}

/// `metric` over the InferenceServices `selector` picks in `namespace`, asked directly of
/// the operator replica (in `namespace`) whose external metrics server listens on `addr`,
/// the way kube-apiserver's aggregator asks it: with the aggregator's client certificate,
/// trusting the operator's CA. The `ExternalMetricValueList`'s items.
pub async fn external_metric(
    cluster: &Cluster,
    client: &Client,
    addr: SocketAddr,
    namespace: &str,
    metric: &str,
    selector: &str,
) -> Result<Vec<serde_json::Value>> {
    use npufleet_operator::external_metrics::GROUP_VERSION;
    let service = "npufleet-external-metrics";
    // Made by the first replica to start; every replica serves this one.
    let certificate = external_metrics_certificate(client, service, namespace).await?;
    let host = format!("{service}.{namespace}.svc");
    let http = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(
            certificate.ca_pem.as_bytes(),
        )?)
        .identity(cluster.front_proxy_identity()?)
        .resolve(&host, addr)
        .timeout(Duration::from_secs(10))
        .build()?;
    let list: serde_json::Value = http
        .get(format!(
            "https://{host}:{}/apis/{GROUP_VERSION}/namespaces/{namespace}/{metric}",
            addr.port()
        ))
        .query(&[("labelSelector", selector)])
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    anyhow::ensure!(
        list["kind"] == "ExternalMetricValueList",
        "not an ExternalMetricValueList: {list}"
    );
    Ok(list["items"].as_array().cloned().unwrap_or_default())
}

/// The external metrics server's CA and serving certificate for Service `service` in
/// `namespace`, as every operator replica ensures it: made once, kept in the Secret the chart
/// names.
pub async fn external_metrics_certificate(
    client: &Client,
    service: &str,
    namespace: &str,
) -> Result<npufleet_operator::external_metrics::tls::ServingCertificate> {
    use npufleet_operator::external_metrics::tls;
    let names = tls::service_dns_names(service, namespace, "cluster.local");
    tls::ServingCertificate::ensure_in_secret(
        client,
        namespace,
        "npufleet-external-metrics-tls",
        &names,
    )
    .await
}

/// Who holds the operator's leader Lease in `namespace`, if anyone.
pub async fn leader(client: &Client, namespace: &str) -> Result<Option<String>> {
    let lease = Api::<Lease>::namespaced(client.clone(), namespace)
        .get_opt(npufleet_operator::leader::LEASE_NAME)
        .await?;
    Ok(lease.and_then(|l| l.spec).and_then(|s| s.holder_identity))
}

/// Waits until `identity` holds the operator's leader Lease in `namespace`.
pub async fn wait_leader(
    client: &Client,
    namespace: &str,
    identity: &str,
    timeout: Duration,
) -> Result<()> {
    wait::until(&format!("{identity} leading"), timeout, || async {
        let holder = leader(client, namespace).await?;
        Ok((holder.as_deref() == Some(identity)).then_some(()))
    })
    .await
}

/// `spec.replicas` of one InferenceService as a watch delivers each change: the highest count
/// seen and when it first rose above one. Stops watching when dropped.
pub struct ReplicaWatch {
    max: Arc<std::sync::atomic::AtomicI32>,
    first_scale_up: Arc<std::sync::Mutex<Option<std::time::Instant>>>,
    task: JoinHandle<()>,
}

impl ReplicaWatch {
    pub fn start(services: &Api<InferenceService>, name: &str) -> Self {
        use futures::StreamExt;
        use kube::runtime::{WatchStreamExt, watcher};
        let max = Arc::new(std::sync::atomic::AtomicI32::new(0));
        let first_scale_up = Arc::new(std::sync::Mutex::new(None));
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let changes = watcher(services.clone(), config)
            .default_backoff()
            .applied_objects();
        let task = tokio::spawn({
            let (max, first_scale_up) = (max.clone(), first_scale_up.clone());
            async move {
                futures::pin_mut!(changes);
                while let Some(change) = changes.next().await {
                    let Ok(service) = change else { continue };
                    let replicas = service.spec.replicas;
                    max.fetch_max(replicas, std::sync::atomic::Ordering::Relaxed);
                    if replicas > 1 {
                        let mut first = first_scale_up.lock().expect("not poisoned");
                        first.get_or_insert_with(std::time::Instant::now);
                    }
                }
            }
        });
        Self {
            max,
            first_scale_up,
            task,
        }
    }

    /// The highest `spec.replicas` seen so far.
    pub fn max(&self) -> i32 {
        self.max.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// When `spec.replicas` first rose above one, if it has.
    pub fn first_scale_up(&self) -> Option<std::time::Instant> {
        *self.first_scale_up.lock().expect("not poisoned")
    }
}

impl Drop for ReplicaWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Events about object `name` in `namespace` with `reason`, as the apiserver lists them.
pub async fn events(
    client: &Client,
    namespace: &str,
    name: &str,
    reason: &str,
) -> Result<Vec<Event>> {
    let list = Api::<Event>::namespaced(client.clone(), namespace)
        .list(&ListParams::default())
        .await?;
    Ok(list
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .filter(|e| e.reason.as_deref() == Some(reason))
        .collect())
}

/// Sets InferenceService `name`'s `spec.replicas` with a merge patch, as a user editing the
/// manifest would.
pub async fn set_replicas(
    services: &Api<InferenceService>,
    name: &str,
    replicas: i32,
) -> Result<()> {
    services
        .patch(name, &PatchParams::default(), &replicas_patch(replicas))
        .await?;
    Ok(())
}

/// Sets InferenceService `name`'s replicas through its scale subresource, as `kubectl scale`
/// and an HPA do.
pub async fn scale(services: &Api<InferenceService>, name: &str, replicas: i32) -> Result<()> {
    services
        .patch_scale(name, &PatchParams::default(), &replicas_patch(replicas))
        .await?;
    Ok(())
}

fn replicas_patch(replicas: i32) -> Patch<serde_json::Value> {
    Patch::Merge(serde_json::json!({"spec": {"replicas": replicas}}))
}

/// A test's namespace with the InferenceService CRD served and the controller and built-in
/// autoscaler running in this process for it ([`start_with_builtin_autoscaler`]).
pub struct OperatedNamespace {
    pub namespace: String,
    pub services: Api<InferenceService>,
    pub pods: Api<k8s_openapi::api::core::v1::Pod>,
    _operator: RunningOperator,
}

impl OperatedNamespace {
    /// The namespace of `c` for `test`; `manager` applies the CRD.
    pub async fn start(c: &Cluster, client: &Client, test: &str, manager: &str) -> Result<Self> {
        let namespace = c.namespace(client, test).await?;
        crate::crd::install_inference_service(client, manager).await?;
        Ok(Self {
            _operator: start_with_builtin_autoscaler(client, &namespace)?,
            services: Api::namespaced(client.clone(), &namespace),
            pods: Api::namespaced(client.clone(), &namespace),
            namespace,
        })
    }
}

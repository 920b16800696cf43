//! A test-only node agent: it owns one Node and runs the worker pods bound to it as real
//! local processes, each on its own loopback address, so that the operator, the workers and
//! kube-controller-manager work together on one machine with no container runtime.
//!
//! What it does for each pod, as a kubelet would: starts the container's command with its
//! arguments and environment, reports `podIP`, phase and the Ready condition (from the
//! pod's HTTP readiness probe), and on deletion runs a preStop sleep, sends SIGTERM, waits
//! out the grace period, and removes the pod. It keeps the Node's Lease and Ready condition fresh. Only the
//! worker binary and the programs it is given (an engine such as llama.cpp's server, by the
//! image's or the command's name) can run: a pod whose command is anything else fails with a
//! message. As in a pod's own network namespace, an argument `0.0.0.0` (listen everywhere)
//! listens on the pod's address, and `$(VAR)` in arguments expands as the kubelet expands it.
//!
//! ConfigMap volumes (the HCCL rank table) are projected into a directory per pod and kept in
//! step with the ConfigMap, as the kubelet does; with no mount namespace, environment values
//! that point into a ConfigMap volume's mount path are pointed at that directory instead.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Container, Node, Pod, Secret};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use npufleet_contract::{env, ports};
use serde_json::json;
use tokio::task::JoinHandle;

use crate::pod_subnet::PodSubnet;
use crate::process::Process;

/// The label on every agent-owned node; pods select a node with it.
pub const NODE_AGENT_LABEL: &str = "npufleet.io/node-agent";
/// `spec.scheduling` of an `InferenceService` whose pods run on the agent `node`.
pub fn scheduling(node: &str) -> serde_json::Value {
    json!({
        "nodeSelector": {NODE_AGENT_LABEL: node},
        "tolerations": [{"key": NODE_AGENT_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
    })
}

const WORKER_BINARY_NAME: &str = "npufleet-worker";
const FIELD_MANAGER: &str = "npufleet-test-node-agent";
const LEASE_DURATION_SECONDS: i32 = 40;
const HEARTBEAT: Duration = Duration::from_secs(5);
const PROBE_INTERVAL: Duration = Duration::from_millis(250);

/// How the agent's node looks and where its pods run.
#[derive(Clone, Debug)]
pub struct NodeAgentConfig {
    pub node_name: String,
    /// The binary a container whose command is `npufleet-worker` runs.
    pub worker_binary: PathBuf,
    /// The /24 of 127.77.0.0/16 tried first for the node and its pods; one another local
    /// platform holds is passed over ([`PodSubnet::claim`]).
    pub preferred_subnet: u8,
    /// Where each pod's output goes (`<namespace>_<pod>.log`).
    pub log_dir: PathBuf,
    pub capacity: BTreeMap<String, String>,
    /// Other programs a container may run, by the name of its command or its image.
    pub programs: BTreeMap<String, PathBuf>,
}

impl NodeAgentConfig {
    pub fn new(node_name: &str, worker_binary: PathBuf, log_dir: PathBuf, subnet: u8) -> Self {
        Self {
            node_name: node_name.to_owned(),
            worker_binary,
            preferred_subnet: subnet,
            log_dir,
            capacity: [("cpu", "64"), ("memory", "256Gi"), ("pods", "110")]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
            programs: BTreeMap::new(),
        }
    }

    /// Lets containers whose command (or, without one, whose image) is `name` run `binary`.
    pub fn with_program(mut self, name: &str, binary: PathBuf) -> Self {
        self.programs.insert(name.to_owned(), binary);
        self
    }

    /// The binary a container runs: its command's, else its image's entrypoint.
    fn program(&self, container: &Container) -> Result<(PathBuf, Vec<String>)> {
        let image = container.image.as_deref().unwrap_or_default();
        let repository = image.split(['@', ':']).next().unwrap_or_default();
        let (name, rest) = match container.command.as_deref() {
            Some([program, rest @ ..]) => (
                std::path::Path::new(program)
                    .file_name()
                    .and_then(|n| n.to_str())
                    .unwrap_or(program),
                rest.to_vec(),
            ),
            Some([]) => bail!("the container's command is empty"),
            None => (
                repository.rsplit('/').next().unwrap_or_default(),
                Vec::new(),
            ),
        };
        if name == WORKER_BINARY_NAME {
            return Ok((self.worker_binary.clone(), rest));
        }
        match self.programs.get(name) {
            Some(binary) => Ok((binary.clone(), rest)),
            None => bail!(
                "the node agent runs {WORKER_BINARY_NAME} and {:?}, not {name:?} (image {image:?})",
                self.programs.keys().collect::<Vec<_>>()
            ),
        }
    }
}

/// `$(VAR)` replaced by the variable's value, `$$` by `$`, unknown references left as they are:
/// the kubelet's expansion of a container's command and arguments.
fn expand(arg: &str, vars: &HashMap<String, String>) -> String {
    let mut out = String::with_capacity(arg.len());
    let mut rest = arg;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        if let Some(after) = tail.strip_prefix("$$") {
            out.push('$');
            rest = after;
        } else if let Some((name, after)) = tail
            .strip_prefix("$(")
            .and_then(|t| t.split_once(')'))
            .filter(|(name, _)| vars.contains_key(*name))
        {
            out.push_str(&vars[name]);
            rest = after;
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

struct RunningPod {
    /// The pod as it was when started (its spec holds the probe).
    pod: Pod,
    address: Ipv4Addr,
    process: Process,
    ready: bool,
    config_volumes: Vec<ConfigVolume>,
}

/// A ConfigMap volume of a running pod and the directory it is projected into.
#[derive(Clone)]
struct ConfigVolume {
    config_map: String,
    dir: PathBuf,
}

struct Shared {
    config: NodeAgentConfig,
    node_address: Ipv4Addr,
    client: Client,
    pods: Mutex<HashMap<String, RunningPod>>,
    free: Mutex<Vec<Ipv4Addr>>,
    /// Pods whose shutdown has started, so that a watch event does not start it twice.
    stopping: Mutex<HashSet<String>>,
}

/// A running node agent; dropping it stops its pods and its node goes NotReady.
pub struct NodeAgent {
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
    /// Released only after [`Drop::drop`] has killed the pods bound to its addresses.
    _subnet: PodSubnet,
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
        // Dropping each Process kills its process group.
        self.shared.pods.lock().expect("pods").clear();
    }
}

impl NodeAgent {
    /// Registers the node, waits for it to be Ready, and starts serving its pods.
    pub async fn start(client: Client, config: NodeAgentConfig) -> Result<Self> {
        std::fs::create_dir_all(&config.log_dir)
            .with_context(|| format!("creating {}", config.log_dir.display()))?;
        let subnet = PodSubnet::claim(config.preferred_subnet)?;
        // Popped from the end: the lowest address goes first.
        let free = subnet.pod_addresses().rev().collect();
        let shared = Arc::new(Shared {
            config,
            node_address: subnet.node_address(),
            client,
            pods: Mutex::new(HashMap::new()),
            free: Mutex::new(free),
            stopping: Mutex::new(HashSet::new()),
        });
        shared.register_node().await?;
        let tasks = vec![
            tokio::spawn(heartbeat(shared.clone())),
            tokio::spawn(watch_pods(shared.clone())),
            tokio::spawn(probe_pods(shared.clone())),
        ];
        Ok(Self {
            shared,
            tasks,
            _subnet: subnet,
        })
    }

    pub fn node_name(&self) -> &str {
        &self.shared.config.node_name
    }

    /// Waits until the scheduler may place pods here. The apiserver taints every new node
    /// `node.kubernetes.io/not-ready` until the node lifecycle controller sees it Ready (a
    /// few seconds); a pod created meanwhile fails to schedule once, with a warning event.
    pub async fn wait_schedulable(&self, timeout: Duration) -> Result<()> {
        let nodes: Api<Node> = Api::all(self.shared.client.clone());
        let name = self.node_name();
        crate::wait::until(
            &format!("node {name} without node.kubernetes.io taints"),
            timeout,
            || async {
                let node = nodes.get(name).await?;
                let taints = node
                    .spec
                    .and_then(|s| s.taints)
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|t| t.key.starts_with("node.kubernetes.io/"))
                    .map(|t| t.key)
                    .collect::<Vec<_>>();
                if taints.is_empty() {
                    Ok(Some(()))
                } else {
                    bail!("tainted {}", taints.join(", "))
                }
            },
        )
        .await
    }

    /// The process id of the running pod `namespace/name`, for tests that signal a worker
    /// directly (SIGKILL, SIGSTOP) the way a crash or a hang would.
    pub fn pid(&self, pod: &str) -> Option<u32> {
        let pods = self.shared.pods.lock().expect("pods");
        pods.get(pod).map(|running| running.process.pid())
    }

    /// `(namespace/name, address)` of every pod process currently running.
    pub fn running(&self) -> Vec<(String, Ipv4Addr)> {
        self.shared
            .pods
            .lock()
            .expect("pods")
            .iter()
            .map(|(key, pod)| (key.clone(), pod.address))
            .collect()
    }
}

impl Shared {
    async fn register_node(&self) -> Result<()> {
        let name = &self.config.node_name;
        let node: Node = serde_json::from_value(json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {
                    NODE_AGENT_LABEL: name,
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                },
            },
            // Only pods meant for an agent run here: a pod meant for a KWOK node in the same
            // cluster would otherwise land here, fail to start and be recreated by the operator.
            "spec": {"taints": [{"key": NODE_AGENT_LABEL, "value": name, "effect": "NoSchedule"}]},
        }))?;
        let nodes: Api<Node> = Api::all(self.client.clone());
        match nodes.create(&PostParams::default(), &node).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(e).with_context(|| format!("creating node {name}")),
        }
        self.report_node_status().await?;
        self.renew_lease().await
    }

    async fn report_node_status(&self) -> Result<()> {
        let now = Timestamp::now();
        let address = self.node_address.to_string();
        let status = json!({
            "status": {
                "capacity": self.config.capacity,
                "allocatable": self.config.capacity,
                "addresses": [{"type": "InternalIP", "address": address}],
                "conditions": [
                    {"type": "Ready", "status": "True", "reason": "NodeAgentReady",
                     "message": "test node agent is running", "lastHeartbeatTime": now,
                     "lastTransitionTime": now},
                    {"type": "MemoryPressure", "status": "False", "reason": "NodeAgentReady",
                     "lastHeartbeatTime": now, "lastTransitionTime": now},
                    {"type": "DiskPressure", "status": "False", "reason": "NodeAgentReady",
                     "lastHeartbeatTime": now, "lastTransitionTime": now},
                    {"type": "PIDPressure", "status": "False", "reason": "NodeAgentReady",
                     "lastHeartbeatTime": now, "lastTransitionTime": now},
                ],
                "nodeInfo": {
                    "architecture": "amd64", "operatingSystem": "linux",
                    "kubeletVersion": "npufleet-test-node-agent", "kubeProxyVersion": "",
                    "bootID": "", "containerRuntimeVersion": "process://local",
                    "kernelVersion": "", "machineID": "", "osImage": "", "systemUUID": "",
                },
            }
        });
        Api::<Node>::all(self.client.clone())
            .patch_status(
                &self.config.node_name,
                &PatchParams::default(),
                &Patch::Merge(status),
            )
            .await
            .with_context(|| format!("reporting node {} status", self.config.node_name))?;
        Ok(())
    }

    async fn renew_lease(&self) -> Result<()> {
        let name = &self.config.node_name;
        let lease = json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": name, "namespace": "kube-node-lease"},
            "spec": {
                "holderIdentity": name,
                "leaseDurationSeconds": LEASE_DURATION_SECONDS,
                "renewTime": k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(Timestamp::now()),
            }
        });
        Api::<Lease>::namespaced(self.client.clone(), "kube-node-lease")
            .patch(
                name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(lease),
            )
            .await
            .with_context(|| format!("renewing node lease {name}"))?;
        Ok(())
    }

    async fn start_pod(&self, pod: &Pod) -> Result<()> {
        let key = pod_key(pod);
        if self.pods.lock().expect("pods").contains_key(&key) {
            return Ok(());
        }
        let address = self
            .free
            .lock()
            .expect("free addresses")
            .pop()
            .context("the node agent ran out of pod addresses")?;
        let started = match self.secret_values(pod).await {
            Ok(secrets) => self.spawn(pod, address, &secrets),
            Err(error) => Err(error),
        };
        let (process, config_volumes) = match started {
            Ok(started) => started,
            Err(error) => {
                self.free.lock().expect("free addresses").push(address);
                self.patch_pod_status(
                    pod,
                    json!({
                        "phase": "Failed",
                        "reason": "StartError",
                        "message": format!("{error:#}"),
                    }),
                )
                .await?;
                return Err(error);
            }
        };
        self.pods.lock().expect("pods").insert(
            key,
            RunningPod {
                pod: pod.clone(),
                address,
                process,
                ready: false,
                config_volumes,
            },
        );
        let now = Timestamp::now();
        let container = &pod.spec.as_ref().context("pod has no spec")?.containers[0];
        self.patch_pod_status(
            pod,
            json!({
                "phase": "Running",
                "podIP": address.to_string(),
                "podIPs": [{"ip": address.to_string()}],
                "hostIP": self.node_address.to_string(),
                "startTime": now,
                "conditions": conditions(false, now),
                "containerStatuses": [container_status(container, false, now)],
            }),
        )
        .await
    }

    /// Writes every key of each ConfigMap volume into its directory, atomically per file, so a
    /// reader polling the file never sees half of it. A ConfigMap that does not exist yet
    /// leaves the directory as it is, as the kubelet keeps retrying.
    async fn project(&self, namespace: &str, volumes: &[ConfigVolume]) -> Result<()> {
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), namespace);
        for volume in volumes {
            let Some(config_map) = api.get_opt(&volume.config_map).await? else {
                continue;
            };
            for (key, value) in config_map.data.iter().flatten() {
                let path = volume.dir.join(key);
                if std::fs::read_to_string(&path).is_ok_and(|current| current == *value) {
                    continue;
                }
                let staged = volume.dir.join(format!(".{key}.new"));
                std::fs::write(&staged, value)
                    .and_then(|()| std::fs::rename(&staged, &path))
                    .with_context(|| format!("projecting {}", path.display()))?;
            }
        }
        Ok(())
    }

    /// The values of the pod's `secretKeyRef` environment variables, by (Secret, key), read
    /// from the apiserver as a kubelet reads them.
    async fn secret_values(&self, pod: &Pod) -> Result<SecretValues> {
        let secrets: Api<Secret> =
            Api::namespaced(self.client.clone(), &pod.namespace().unwrap_or_default());
        let mut values = SecretValues::new();
        let references = pod
            .spec
            .iter()
            .flat_map(|spec| &spec.containers)
            .flat_map(|container| container.env.iter().flatten())
            .filter_map(|var| var.value_from.as_ref()?.secret_key_ref.as_ref());
        for reference in references {
            let secret = secrets
                .get(&reference.name)
                .await
                .with_context(|| format!("reading Secret {}", reference.name))?;
            let value = secret
                .data
                .as_ref()
                .and_then(|data| data.get(&reference.key))
                .with_context(|| {
                    format!("Secret {} has no key {}", reference.name, reference.key)
                })?;
            values.insert(
                (reference.name.clone(), reference.key.clone()),
                String::from_utf8(value.0.clone()).with_context(|| {
                    format!(
                        "Secret {} key {} is not UTF-8",
                        reference.name, reference.key
                    )
                })?,
            );
        }
        Ok(values)
    }

    fn spawn(
        &self,
        pod: &Pod,
        address: Ipv4Addr,
        secrets: &SecretValues,
    ) -> Result<(Process, Vec<ConfigVolume>)> {
        let spec = pod.spec.as_ref().context("pod has no spec")?;
        let [container] = spec.containers.as_slice() else {
            bail!(
                "the node agent runs single-container pods; this one has {}",
                spec.containers.len()
            );
        };
        let (binary, command_args) = self.config.program(container)?;
        let mut cmd = std::process::Command::new(binary);
        cmd.env_clear();
        cmd.env("PATH", std::env::var_os("PATH").unwrap_or_default());
        let volumes_dir = self.config.log_dir.join("volumes").join(format!(
            "{}_{}",
            pod.namespace().unwrap_or_default(),
            pod.name_any()
        ));
        let mut config_volumes = Vec::new();
        let mut mounts = Vec::new();
        for mount in container.volume_mounts.iter().flatten() {
            let config_map = spec
                .volumes
                .iter()
                .flatten()
                .find(|v| v.name == mount.name)
                .and_then(|v| v.config_map.as_ref());
            if let Some(config_map) = config_map {
                let dir = volumes_dir.join(&mount.name);
                std::fs::create_dir_all(&dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
                mounts.push((mount.mount_path.clone(), dir.clone()));
                config_volumes.push(ConfigVolume {
                    config_map: config_map.name.clone(),
                    dir,
                });
            }
        }
        let mut vars = HashMap::new();
        for var in container.env.iter().flatten() {
            let mut value = match (&var.value, &var.value_from) {
                (Some(value), _) => value.clone(),
                (None, Some(from)) => field_value(pod, from, address, secrets)?,
                (None, None) => String::new(),
            };
            for (mount_path, dir) in &mounts {
                if let Some(rest) = value.strip_prefix(mount_path.as_str())
                    && (rest.is_empty() || rest.starts_with('/'))
                {
                    value = format!("{}{rest}", dir.display());
                }
            }
            cmd.env(&var.name, &value);
            vars.insert(var.name.clone(), value);
        }
        let listen_here = |arg: String| {
            if arg == "0.0.0.0" {
                address.to_string()
            } else {
                arg
            }
        };
        cmd.args(
            command_args
                .iter()
                .chain(container.args.iter().flatten())
                .map(|arg| listen_here(expand(arg, &vars))),
        );
        // Every worker listens on its own address: the ports stay the pod's own.
        for (variable, port_name, default) in [
            (env::GRPC_ADDR, ports::GRPC_PORT_NAME, ports::GRPC_PORT),
            (env::HTTP_ADDR, ports::HTTP_PORT_NAME, ports::HTTP_PORT),
        ] {
            cmd.env(
                variable,
                format!("{address}:{}", port(container, port_name, default)),
            );
        }
        let log = self.config.log_dir.join(format!(
            "{}_{}.log",
            pod.namespace().unwrap_or_default(),
            pod.name_any()
        ));
        Ok((Process::start(&pod_key(pod), cmd, &log)?, config_volumes))
    }

    async fn patch_pod_status(&self, pod: &Pod, status: serde_json::Value) -> Result<()> {
        let api: Api<Pod> =
            Api::namespaced(self.client.clone(), &pod.namespace().unwrap_or_default());
        match api
            .patch_status(
                &pod.name_any(),
                &PatchParams::default(),
                &Patch::Merge(json!({"status": status})),
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(e).with_context(|| format!("updating status of pod {}", pod_key(pod))),
        }
    }

    /// SIGTERM, the grace period, SIGKILL, then the pod object goes.
    async fn stop_pod(&self, pod: &Pod) -> Result<()> {
        let key = pod_key(pod);
        if !self.stopping.lock().expect("stopping").insert(key.clone()) {
            return Ok(());
        }
        let running = self.pods.lock().expect("pods").remove(&key);
        if let Some(mut running) = running {
            let grace = pod
                .metadata
                .deletion_grace_period_seconds
                .or_else(|| {
                    pod.spec
                        .as_ref()
                        .and_then(|s| s.termination_grace_period_seconds)
                })
                .unwrap_or(30);
            let deadline = tokio::time::Instant::now() + Duration::from_secs(grace.max(0) as u64);
            // A preStop sleep keeps the worker serving while endpoints drop the pod.
            let pre_stop = pod
                .spec
                .as_ref()
                .and_then(|s| s.containers.first())
                .and_then(|c| c.lifecycle.as_ref())
                .and_then(|l| l.pre_stop.as_ref())
                .and_then(|h| h.sleep.as_ref())
                .map_or(0, |s| s.seconds.max(0) as u64);
            tokio::time::sleep_until(
                deadline.min(tokio::time::Instant::now() + Duration::from_secs(pre_stop)),
            )
            .await;
            running.process.signal(libc::SIGTERM);
            while running.process.try_wait().is_none() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            if running.process.try_wait().is_none() {
                running.process.kill();
            }
            self.free
                .lock()
                .expect("free addresses")
                .push(running.address);
        }
        let api: Api<Pod> =
            Api::namespaced(self.client.clone(), &pod.namespace().unwrap_or_default());
        let result = api
            .delete(&pod.name_any(), &DeleteParams::default().grace_period(0))
            .await;
        self.stopping.lock().expect("stopping").remove(&key);
        match result {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(e).with_context(|| format!("removing pod {key}")),
        }
    }
}

async fn heartbeat(shared: Arc<Shared>) {
    loop {
        tokio::time::sleep(HEARTBEAT).await;
        for result in [
            shared.renew_lease().await,
            shared.report_node_status().await,
        ] {
            if let Err(error) = result {
                tracing::warn!(error = format!("{error:#}"), "node agent heartbeat");
            }
        }
    }
}

async fn watch_pods(shared: Arc<Shared>) {
    let api: Api<Pod> = Api::all(shared.client.clone());
    let config =
        watcher::Config::default().fields(&format!("spec.nodeName={}", shared.config.node_name));
    let mut events = watcher(api, config)
        .default_backoff()
        .applied_objects()
        .boxed();
    while let Some(event) = events.next().await {
        let pod = match event {
            Ok(pod) => pod,
            Err(error) => {
                tracing::warn!(%error, "node agent pod watch");
                continue;
            }
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let result = if pod.metadata.deletion_timestamp.is_some() {
                shared.stop_pod(&pod).await
            } else if is_finished(&pod) {
                Ok(())
            } else {
                shared.start_pod(&pod).await
            };
            if let Err(error) = result {
                tracing::warn!(
                    pod = pod_key(&pod),
                    error = format!("{error:#}"),
                    "node agent"
                );
            }
        });
    }
}

/// Runs each pod's readiness probe and reports changes; reports pods whose process exited.
async fn probe_pods(shared: Arc<Shared>) {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(1))
        .build()
        .expect("HTTP client");
    loop {
        tokio::time::sleep(PROBE_INTERVAL).await;
        let running: Vec<(String, Pod, Ipv4Addr, bool, Vec<ConfigVolume>)> = shared
            .pods
            .lock()
            .expect("pods")
            .iter()
            .map(|(k, p)| {
                let volumes = p.config_volumes.clone();
                (k.clone(), p.pod.clone(), p.address, p.ready, volumes)
            })
            .collect();
        for (key, pod, address, was_ready, volumes) in running {
            if let Err(error) = shared
                .project(&pod.namespace().unwrap_or_default(), &volumes)
                .await
            {
                tracing::warn!(
                    pod = key,
                    error = format!("{error:#}"),
                    "projecting volumes"
                );
            }
            let exited = shared
                .pods
                .lock()
                .expect("pods")
                .get_mut(&key)
                .and_then(|p| p.process.try_wait());
            if let Some(status) = exited {
                let gone = shared.pods.lock().expect("pods").remove(&key);
                shared.free.lock().expect("free addresses").push(address);
                let tail = gone.map(|p| p.process.log_tail(80)).unwrap_or_default();
                let container = pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.containers.first().cloned())
                    .unwrap_or_default();
                let result = shared
                    .patch_pod_status(
                        &pod,
                        json!({
                            "phase": if status.success() { "Succeeded" } else { "Failed" },
                            "conditions": conditions(false, Timestamp::now()),
                            "containerStatuses": [exited_status(&container, status, &tail, Timestamp::now())],
                        }),
                    )
                    .await;
                if let Err(error) = result {
                    tracing::warn!(pod = key, error = format!("{error:#}"), "reporting exit");
                }
                continue;
            }
            let ready = probe(&http, &pod, address).await;
            if ready != was_ready {
                if let Some(p) = shared.pods.lock().expect("pods").get_mut(&key) {
                    p.ready = ready;
                }
                let now = Timestamp::now();
                let container = pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.containers.first().cloned())
                    .unwrap_or_default();
                let result = shared
                    .patch_pod_status(
                        &pod,
                        json!({
                            "conditions": conditions(ready, now),
                            "containerStatuses": [container_status(&container, ready, now)],
                        }),
                    )
                    .await;
                if let Err(error) = result {
                    tracing::warn!(
                        pod = key,
                        error = format!("{error:#}"),
                        "reporting readiness"
                    );
                }
            }
        }
    }
}

/// The container's HTTP readiness probe against the pod's address; ready when it has none.
async fn probe(http: &reqwest::Client, pod: &Pod, address: Ipv4Addr) -> bool {
    let Some(container) = pod.spec.as_ref().and_then(|s| s.containers.first()) else {
        return false;
    };
    let Some(get) = container
        .readiness_probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
    else {
        return true;
    };
    let port = match &get.port {
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(p) => *p,
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(name) => {
            port(container, name, 0)
        }
    };
    let path = get.path.as_deref().unwrap_or("/");
    http.get(format!("http://{address}:{port}{path}"))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
}

fn pod_key(pod: &Pod) -> String {
    format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any())
}

fn is_finished(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

fn port(container: &Container, name: &str, default: u16) -> i32 {
    container
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some(name))
        .map_or(i32::from(default), |p| p.container_port)
}

/// A container's memory limit in bytes, or the machine's memory where it sets none, as a
/// kubelet reports node allocatable memory.
fn resource_value(
    pod: &Pod,
    selector: &k8s_openapi::api::core::v1::ResourceFieldSelector,
) -> Result<String> {
    // The apiserver stores an unset divisor as "0", which means 1.
    let unit_divisor = selector
        .divisor
        .as_ref()
        .is_none_or(|d| d.0 == "0" || d.0 == "1");
    if selector.resource != "limits.memory" || !unit_divisor {
        bail!(
            "the node agent resolves only resourceFieldRef limits.memory without a divisor, not {}",
            selector.resource
        );
    }
    let limit = pod
        .spec
        .iter()
        .flat_map(|s| &s.containers)
        .find(|c| {
            selector
                .container_name
                .as_deref()
                .is_none_or(|n| n == c.name)
        })
        .and_then(|c| {
            c.resources
                .as_ref()?
                .limits
                .as_ref()?
                .get("memory")
                .cloned()
        });
    match limit {
        Some(quantity) => Ok(quantity_bytes(&quantity.0)
            .with_context(|| format!("memory limit {:?}", quantity.0))?
            .to_string()),
        None => {
            let meminfo = std::fs::read_to_string("/proc/meminfo")?;
            let kib: u64 = meminfo
                .lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .context("no MemTotal in /proc/meminfo")?;
            Ok((kib * 1024).to_string())
        }
    }
}

/// Bytes in a memory quantity such as `512Mi`, `1G` or `1048576`.
fn quantity_bytes(quantity: &str) -> Result<u64> {
    const SUFFIXES: [(&str, u64); 8] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];
    let (number, scale) = SUFFIXES
        .iter()
        .find_map(|(suffix, scale)| Some((quantity.strip_suffix(suffix)?, *scale)))
        .unwrap_or((quantity, 1));
    let number: u64 = number
        .parse()
        .with_context(|| format!("{quantity:?} is not a whole memory quantity"))?;
    Ok(number * scale)
}

/// Secret values by (Secret name, key).
type SecretValues = BTreeMap<(String, String), String>;

fn field_value(
    pod: &Pod,
    from: &k8s_openapi::api::core::v1::EnvVarSource,
    address: Ipv4Addr,
    secrets: &SecretValues,
) -> Result<String> {
    if let Some(resource) = &from.resource_field_ref {
        return resource_value(pod, resource);
    }
    if let Some(reference) = &from.secret_key_ref {
        return secrets
            .get(&(reference.name.clone(), reference.key.clone()))
            .cloned()
            .with_context(|| {
                format!(
                    "Secret {} key {} was not read",
                    reference.name, reference.key
                )
            });
    }
    let Some(field) = &from.field_ref else {
        bail!(
            "the node agent resolves only fieldRef, resourceFieldRef and secretKeyRef environment variables"
        );
    };
    Ok(match field.field_path.as_str() {
        "metadata.name" => pod.name_any(),
        "metadata.namespace" => pod.namespace().unwrap_or_default(),
        "metadata.uid" => pod.uid().unwrap_or_default(),
        "spec.nodeName" => pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default(),
        "status.podIP" | "status.hostIP" => address.to_string(),
        path if path.starts_with("metadata.labels['") => {
            let key = &path["metadata.labels['".len()..path.len().saturating_sub(2)];
            pod.labels().get(key).cloned().unwrap_or_default()
        }
        path if path.starts_with("metadata.annotations['") => {
            let key = &path["metadata.annotations['".len()..path.len().saturating_sub(2)];
            pod.annotations().get(key).cloned().unwrap_or_default()
        }
        other => bail!("the node agent cannot resolve fieldRef {other:?}"),
    })
}

fn conditions(ready: bool, now: Timestamp) -> serde_json::Value {
    let status = if ready { "True" } else { "False" };
    json!([
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
        {"type": "Initialized", "status": "True", "lastTransitionTime": now},
        {"type": "ContainersReady", "status": status, "lastTransitionTime": now},
        {"type": "Ready", "status": status, "lastTransitionTime": now},
    ])
}

fn container_status(container: &Container, ready: bool, now: Timestamp) -> serde_json::Value {
    with_state(container, ready, json!({"running": {"startedAt": now}}))
}

/// A container's status in `state`; its process runs (or ran) once, never restarted.
fn with_state(container: &Container, ready: bool, state: serde_json::Value) -> serde_json::Value {
    json!({
        "name": container.name,
        "image": container.image.clone().unwrap_or_default(),
        "imageID": "",
        "ready": ready,
        "started": state.get("running").is_some(),
        "restartCount": 0,
        "state": state,
    })
}

/// The status of a container whose process exited, as a kubelet reports it under
/// `FallbackToLogsOnError`: a failed container's termination message is its log's last 80
/// lines, at most 2048 bytes of them.
fn exited_status(
    container: &Container,
    status: std::process::ExitStatus,
    log_tail: &str,
    now: Timestamp,
) -> serde_json::Value {
    const MAX_MESSAGE_BYTES: usize = 2048;
    // Killed by a signal: the shell's convention, as a kubelet reports it.
    let code = status.code().unwrap_or_else(|| {
        128 + std::os::unix::process::ExitStatusExt::signal(&status).unwrap_or(0)
    });
    let mut start = log_tail.len().saturating_sub(MAX_MESSAGE_BYTES);
    while !log_tail.is_char_boundary(start) {
        start += 1;
    }
    let (reason, message) = if code == 0 {
        ("Completed", "")
    } else {
        ("Error", &log_tail[start..])
    };
    let terminated = json!({"terminated": {
        "exitCode": code,
        "reason": reason,
        "message": message,
        "finishedAt": now,
    }});
    with_state(container, false, terminated)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exited_container_keeps_the_logs_end_as_a_kubelet_does() {
        use std::os::unix::process::ExitStatusExt;
        let container = Container {
            name: "worker".into(),
            ..Default::default()
        };
        let log: String = (0..200)
            .map(|i| format!("line {i:03} ........\n"))
            .collect();
        let failed = exited_status(
            &container,
            ExitStatusExt::from_raw(2 << 8),
            &log,
            Timestamp::now(),
        );
        let terminated = &failed["state"]["terminated"];
        assert_eq!(
            (
                terminated["exitCode"].as_i64(),
                terminated["reason"].as_str()
            ),
            (Some(2), Some("Error"))
        );
        let message = terminated["message"].as_str().unwrap();
        assert!(
            message.len() <= 2048 && message.ends_with("line 199 ........\n"),
            "{message}"
        );
        let killed = exited_status(
            &container,
            ExitStatusExt::from_raw(9),
            &log,
            Timestamp::now(),
        );
        assert_eq!(
            killed["state"]["terminated"]["exitCode"].as_i64(),
            Some(137)
        );
        let done = exited_status(
            &container,
            ExitStatusExt::from_raw(0),
            &log,
            Timestamp::now(),
        );
        assert_eq!(done["state"]["terminated"]["message"].as_str(), Some(""));
    }

    #[test]
    fn arguments_expand_as_the_kubelet_expands_them() {
        let vars = HashMap::from([
            ("NPUFLEET_MODEL".to_owned(), "/models/m.gguf".to_owned()),
            ("PORT".to_owned(), "8080".to_owned()),
        ]);
        assert_eq!(expand("$(NPUFLEET_MODEL)", &vars), "/models/m.gguf");
        assert_eq!(expand("--port=$(PORT)", &vars), "--port=8080");
        // Escaped, unknown and unterminated references stay as written.
        assert_eq!(expand("$$(PORT)", &vars), "$(PORT)");
        assert_eq!(expand("$(UNSET) $(PORT", &vars), "$(UNSET) $(PORT");
        assert_eq!(expand("cost: $5", &vars), "cost: $5");
    }

    #[test]
    fn a_container_runs_its_commands_program_or_its_images_entrypoint() {
        let config = NodeAgentConfig::new("n", "/bin/worker".into(), "/tmp".into(), 1)
            .with_program("llama-server", "/bin/llama-server".into());
        let container = |image: &str, command: Option<Vec<&str>>| Container {
            image: Some(image.to_owned()),
            command: command.map(|c| c.into_iter().map(str::to_owned).collect()),
            ..Default::default()
        };
        let program = |c: &Container| config.program(c);
        assert_eq!(
            program(&container("registry/npufleet-worker:1", None)).unwrap(),
            ("/bin/worker".into(), vec![])
        );
        assert_eq!(
            program(&container(
                "ghcr.io/x:server",
                Some(vec!["/app/llama-server", "-v"])
            ))
            .unwrap(),
            ("/bin/llama-server".into(), vec!["-v".to_owned()])
        );
        let error = program(&container("vllm-ascend:v1", Some(vec!["vllm", "serve"])))
            .unwrap_err()
            .to_string();
        assert!(error.contains("\"vllm\""), "{error}");
    }
}

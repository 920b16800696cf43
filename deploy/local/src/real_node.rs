//! A real Kubernetes node on this machine: containerd (runc, overlayfs, cgroupfs), kubelet
//! registered to the cluster's apiserver with its own client certificate, a CNI bridge for
//! pods, kube-proxy (iptables) for Services and CoreDNS for cluster DNS, from
//! `tests/setup/node.sh`.
//!
//! Pods get addresses of [`POD_CIDR`] on a bridge the node makes, with a route to
//! 198.18.0.0/15 only: no default route, no masquerade, and the host drops whatever a pod sends
//! anywhere but the bridge, so no pod traffic leaves the machine. Pods reach the apiserver, which
//! listens on loopback only, through the `kubernetes` Service: its endpoint is a relay on the
//! bridge address, so the chart's operator and router run in-cluster as they do on CCE.
//!
//! The node takes host-wide names (the bridge, kube-proxy's iptables chains, the `kubepods`
//! cgroups, port 53 on the bridge address), so one machine runs one at a time: a second is
//! refused while the first runs, and a node starting after one that crashed first removes what
//! that one left (containers and their shims, mounts, network namespaces, the bridge,
//! iptables chains, cgroups). Everything it starts stops with it: its daemons as process
//! groups, its pods' containers by [`RealNode`]'s drop or the exit clean-up.

use std::io::ErrorKind;
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::cluster::{Cluster, SERVICE_CLUSTER_IP_RANGE, node_ready};
use crate::net::free_port;
use crate::paths::{self, ImageArchive};
use crate::process::{self, Process};
use crate::wait;

/// The node's name in the cluster.
pub const NODE_NAME: &str = "real-node-0";
/// The label on the real node (value `true`); a pod selects it with this.
pub const REAL_NODE_LABEL: &str = "npufleet.io/real-node";
/// The pods' addresses: part of 198.18.0.0/15 (RFC 2544), which no real network uses.
pub const POD_CIDR: &str = "198.18.64.0/20";
/// The node's address on its bridge: the pods' gateway, kubelet's and CoreDNS's address.
pub const NODE_ADDRESS: Ipv4Addr = Ipv4Addr::new(198, 18, 64, 1);
/// Where pods route everything they reach: pods, Services and the node, nothing else.
const POD_ROUTE: &str = "198.18.0.0/15";
const POD_PREFIX_LENGTH: u8 = 20;
const BRIDGE: &str = "npufleet0";
/// The cluster DNS domain.
pub const CLUSTER_DOMAIN: &str = "cluster.local";
/// The image every pod's sandbox runs (containerd's `sandbox_image`).
const PAUSE: &str = "pause";
/// Marks the host's firewall rules the node adds, so that clean-up finds exactly those.
const RULE_COMMENT: &str = "npufleet-real-node";
/// What the containerd socket's path ends with, in every real node's directory: how a
/// node's containerd shims are told apart from any other containerd's.
const CONTAINERD_SOCKET: &str = "real-node/containerd.sock";
/// The cgroup kubelet puts pods under (cgroupfs driver, default cgroup root).
const POD_CGROUP: &str = "kubepods";
/// The user CoreDNS reads Services and pods as.
const COREDNS_USER: &str = "npufleet:coredns";
const START_TIMEOUT: Duration = Duration::from_secs(90);

/// A running real node. Dropping it stops its daemons and removes its pods' containers,
/// mounts and network.
pub struct RealNode {
    processes: Mutex<Vec<Process>>,
    dir: PathBuf,
    /// kubelet, kube-proxy and CoreDNS.
    bin: PathBuf,
    ctr: PathBuf,
    images: Vec<ImageArchive>,
    clean_up: u64,
    started_in: Duration,
    /// Pods' way to the apiserver, which listens on loopback only.
    _relay: Option<ApiRelay>,
    /// Held for as long as the node runs: one real node per machine.
    _claim: UnixListener,
}

impl RealNode {
    /// Starts containerd, imports the node's images, and starts kubelet, kube-proxy and
    /// CoreDNS against `cluster`; returns once the node is Ready and DNS answers.
    pub async fn start(cluster: &Cluster, client: &Client) -> Result<RealNode> {
        let started = Instant::now();
        if let Some(why) = unavailable() {
            bail!("{why}");
        }
        let claim = claim_machine()?;
        let bin = tokio::task::spawn_blocking(paths::node_bin).await??;
        let images = tokio::task::spawn_blocking(paths::node_images).await??;
        let pause = images
            .iter()
            .find(|image| image.name == PAUSE)
            .context("tests/setup/node.sh lists no pause image")?
            .tag
            .clone();
        tear_down();

        let dir = cluster.scratch().join("real-node");
        for sub in [
            "containerd/root",
            "containerd/state",
            "cni/conf",
            "cni/ipam",
            "kubelet",
        ] {
            std::fs::create_dir_all(dir.join(sub))?;
        }
        let mut node = RealNode {
            processes: Mutex::new(Vec::new()),
            dir: dir.clone(),
            bin,
            ctr: which("ctr")?,
            images,
            clean_up: process::register_clean_up(tear_down),
            started_in: Duration::ZERO,
            _relay: None,
            _claim: claim,
        };
        make_network()?;
        let api_port = cluster_api_port(cluster)?;
        let relay = ApiRelay::start(api_port)?;
        publish_apiserver(client, api_port).await?;

        node.start_containerd(&pause).await?;

        node.start_kubelet(cluster)?;
        let proxy_healthz = node.start_kube_proxy(cluster)?;
        let coredns_ready = node.start_coredns(cluster, client).await?;
        node.wait_serving(client, proxy_healthz, coredns_ready)
            .await?;
        node._relay = Some(relay);
        node.started_in = started.elapsed();
        Ok(node)
    }

    async fn start_containerd(&self, pause: &str) -> Result<()> {
        let containerd_config = self.dir.join("containerd.toml");
        std::fs::write(&containerd_config, containerd_toml(&self.dir, pause))?;
        std::fs::write(
            self.dir.join("cni/conf/10-npufleet.conflist"),
            cni_conflist(&self.dir),
        )?;
        let mut containerd = Command::new(which("containerd")?);
        containerd.arg("--config").arg(&containerd_config);
        self.spawn("containerd", containerd)?;
        wait::until("containerd", START_TIMEOUT, || async {
            self.ensure_running().map_err(wait::fatal)?;
            Ok(self
                .ctr()
                .arg("version")
                .output()
                .is_ok_and(|out| out.status.success())
                .then_some(()))
        })
        .await?;
        let archives: Vec<PathBuf> = self.images.iter().map(|i| i.path.clone()).collect();
        self.import(&archives)?;
        Ok(())
    }

    fn start_kubelet(&self, cluster: &Cluster) -> Result<()> {
        let kubelet_kubeconfig = cluster.kubeconfig_with_certificate(
            &format!("system:node:{NODE_NAME}"),
            &["system:nodes"],
            "kubelet.kubeconfig",
        )?;
        let kubelet_config = self.dir.join("kubelet.yaml");
        let kubelet_healthz = free_port()?;
        std::fs::write(
            &kubelet_config,
            kubelet_yaml(&self.dir, &cluster.ca_file(), kubelet_healthz)?,
        )?;
        let mut kubelet = Command::new(self.bin.join("kubelet"));
        kubelet
            .arg(format!("--config={}", kubelet_config.display()))
            .arg(format!("--kubeconfig={}", kubelet_kubeconfig.display()))
            .arg(format!("--hostname-override={NODE_NAME}"))
            .arg(format!("--node-ip={NODE_ADDRESS}"))
            .arg(format!("--node-labels={REAL_NODE_LABEL}=true"))
            .arg(format!("--root-dir={}", self.dir.join("kubelet").display()))
            .arg(format!(
                "--cert-dir={}",
                self.dir.join("kubelet/pki").display()
            ))
            .arg("--v=1");
        self.spawn("kubelet", kubelet)?;
        Ok(())
    }

    /// Starts kube-proxy; returns its healthz port.
    fn start_kube_proxy(&self, cluster: &Cluster) -> Result<u16> {
        let proxy_kubeconfig = cluster.kubeconfig_with_certificate(
            "system:kube-proxy",
            &[],
            "kube-proxy.kubeconfig",
        )?;
        let proxy_config = self.dir.join("kube-proxy.yaml");
        let proxy_healthz = free_port()?;
        std::fs::write(
            &proxy_config,
            kube_proxy_yaml(&proxy_kubeconfig, proxy_healthz)?,
        )?;
        let mut proxy = Command::new(self.bin.join("kube-proxy"));
        proxy.arg(format!("--config={}", proxy_config.display()));
        self.spawn("kube-proxy", proxy)?;
        Ok(proxy_healthz)
    }

    /// Starts CoreDNS; returns its readiness port.
    async fn start_coredns(&self, cluster: &Cluster, client: &Client) -> Result<u16> {
        grant_coredns(client).await?;
        let coredns_kubeconfig =
            cluster.kubeconfig_with_certificate(COREDNS_USER, &[], "coredns.kubeconfig")?;
        let corefile = self.dir.join("Corefile");
        let coredns_ready = free_port()?;
        std::fs::write(&corefile, corefile_text(&coredns_kubeconfig, coredns_ready))?;
        let mut coredns = Command::new(self.bin.join("coredns"));
        coredns.arg("-conf").arg(&corefile);
        self.spawn("coredns", coredns)?;
        Ok(coredns_ready)
    }

    /// Waits until the node is Ready and kube-proxy and CoreDNS have synced.
    async fn wait_serving(
        &self,
        client: &Client,
        proxy_healthz: u16,
        coredns_ready: u16,
    ) -> Result<()> {
        let nodes: Api<Node> = Api::all(client.clone());
        wait::until(
            &format!("node {NODE_NAME} Ready"),
            START_TIMEOUT,
            || async {
                self.ensure_running().map_err(wait::fatal)?;
                Ok(nodes
                    .get_opt(NODE_NAME)
                    .await?
                    .filter(node_ready)
                    .map(|_| ()))
            },
        )
        .await
        .map_err(|e| anyhow::anyhow!("{e:#}{}", self.log_tails(20)))?;
        let http = reqwest::Client::new();
        for (what, url) in [
            (
                "kube-proxy's first sync",
                format!("http://127.0.0.1:{proxy_healthz}/healthz"),
            ),
            (
                "CoreDNS's first sync",
                format!("http://127.0.0.1:{coredns_ready}/ready"),
            ),
        ] {
            wait::until(what, START_TIMEOUT, || async {
                self.ensure_running().map_err(wait::fatal)?;
                let answer = http.get(&url).send().await;
                Ok(answer.is_ok_and(|a| a.status().is_success()).then_some(()))
            })
            .await
            .map_err(|e| anyhow::anyhow!("{e:#}{}", self.log_tails(20)))?;
        }
        Ok(())
    }

    fn spawn(&self, name: &str, cmd: Command) -> Result<()> {
        let log = self.dir.join(format!("{name}.log"));
        let process = Process::start(name, cmd, &log)?;
        self.processes.lock().expect("processes").push(process);
        Ok(())
    }

    /// How long [`RealNode::start`] took, images imported and DNS answering.
    pub fn started_in(&self) -> Duration {
        self.started_in
    }

    /// `ctr` against this node's containerd, in the namespace kubelet's containers live in.
    pub fn ctr(&self) -> Command {
        let mut cmd = Command::new(&self.ctr);
        cmd.arg("--address")
            .arg(self.dir.join("containerd.sock"))
            .args(["--namespace", "k8s.io"]);
        cmd
    }

    /// The images the node was given ([`paths::node_images`]).
    pub fn images(&self) -> &[ImageArchive] {
        &self.images
    }

    /// Imports image archives (`ctr images import`), so that pods run them without a
    /// registry: pods name them by tag with `imagePullPolicy: IfNotPresent` or `Never`.
    pub fn import(&self, archives: &[PathBuf]) -> Result<()> {
        for archive in archives {
            let mut cmd = self.ctr();
            cmd.args(["images", "import"]).arg(archive);
            process::stdout_of(cmd)
                .with_context(|| format!("importing {} into the real node", archive.display()))?;
        }
        Ok(())
    }

    /// Fails with the log tail of any daemon that has exited.
    pub fn ensure_running(&self) -> Result<()> {
        for p in self.processes.lock().expect("processes").iter_mut() {
            p.ensure_running()?;
        }
        Ok(())
    }

    /// The last `lines` lines of every daemon's log, for failure messages.
    pub fn log_tails(&self, lines: usize) -> String {
        self.processes
            .lock()
            .expect("processes")
            .iter()
            .map(|p| format!("\n--- {} ---\n{}", p.name(), p.log_tail(lines)))
            .collect()
    }
}

impl Drop for RealNode {
    fn drop(&mut self) {
        // kubelet first, so that it starts no container while the rest stops.
        let mut processes = self.processes.lock().expect("processes");
        for p in processes.iter_mut().rev() {
            p.kill();
        }
        processes.clear();
        tear_down();
        process::unregister_clean_up(self.clean_up);
    }
}

/// The apiserver's port, from the cluster's URL.
fn cluster_api_port(cluster: &Cluster) -> Result<u16> {
    let url = cluster.server_url();
    url.rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .with_context(|| format!("no port in the apiserver's URL {url}"))
}

/// Relays TCP from the node's bridge address to the apiserver on loopback, so that pods reach
/// it through the `kubernetes` Service without the apiserver listening beyond loopback. Stops
/// accepting when dropped.
struct ApiRelay {
    stop: Arc<AtomicBool>,
    address: std::net::SocketAddr,
}

impl ApiRelay {
    fn start(api_port: u16) -> Result<ApiRelay> {
        let address = std::net::SocketAddr::from((NODE_ADDRESS, api_port));
        let listener = TcpListener::bind(address)
            .with_context(|| format!("listening on {address} for the apiserver relay"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        std::thread::Builder::new()
            .name("apiserver-relay".into())
            .spawn(move || {
                for pod in listener.incoming() {
                    if stopped.load(Ordering::Relaxed) {
                        break;
                    }
                    let Ok(pod) = pod else { continue };
                    let Ok(apiserver) = TcpStream::connect((Ipv4Addr::LOCALHOST, api_port)) else {
                        continue;
                    };
                    let _ = relay_both_ways(pod, apiserver);
                }
            })?;
        Ok(ApiRelay { stop, address })
    }
}

impl Drop for ApiRelay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the accept loop so that it sees the flag and closes the listener.
        let _ = TcpStream::connect(self.address);
    }
}

fn relay_both_ways(a: TcpStream, b: TcpStream) -> std::io::Result<()> {
    for (mut from, mut to) in [(a.try_clone()?, b.try_clone()?), (b, a)] {
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut from, &mut to);
            let _ = to.shutdown(std::net::Shutdown::Write);
        });
    }
    Ok(())
}

/// Points the `kubernetes` Service at the relay. The apiserver keeps no endpoints of its own
/// (`--endpoint-reconciler-type=none`: it listens on loopback, which no endpoint may name).
async fn publish_apiserver(client: &Client, api_port: u16) -> Result<()> {
    let slice = json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "kubernetes",
            "namespace": "default",
            "labels": {
                "kubernetes.io/service-name": "kubernetes",
                "endpointslice.kubernetes.io/managed-by": "npufleet-local",
            },
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [NODE_ADDRESS.to_string()], "conditions": {"ready": true}}],
        "ports": [{"name": "https", "port": api_port, "protocol": "TCP"}],
    });
    Api::<EndpointSlice>::namespaced(client.clone(), "default")
        .patch(
            "kubernetes",
            &PatchParams::apply("npufleet-local").force(),
            &Patch::Apply(slice),
        )
        .await
        .context("publishing the apiserver as the kubernetes Service's endpoint")?;
    Ok(())
}

/// One real node per machine: an abstract Unix socket held while it runs (released however
/// its holder exits).
fn claim_machine() -> Result<UnixListener> {
    let name = "npufleet-local/real-node";
    let address = SocketAddr::from_abstract_name(name.as_bytes())?;
    match UnixListener::bind_addr(&address) {
        Ok(claim) => Ok(claim),
        Err(e) if e.kind() == ErrorKind::AddrInUse => bail!(
            "another local platform on this machine runs a real node (it holds bridge {BRIDGE} and the kubepods cgroups); stop it first"
        ),
        Err(e) => Err(e).with_context(|| format!("claiming {name}")),
    }
}

fn which(tool: &str) -> Result<PathBuf> {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .map(|dir| dir.join(tool))
        .find(|path| path.is_file())
        .with_context(|| format!("{tool} is not installed; tests/setup/node.sh installs it"))
}

fn run(program: &str, args: &[&str]) -> Result<String> {
    let mut cmd = Command::new(which(program)?);
    cmd.args(args);
    process::stdout_of(cmd)
}

fn write_sysctl(key: &str, value: &str) -> Result<()> {
    let path = Path::new("/proc/sys").join(key.replace('.', "/"));
    std::fs::write(&path, value).with_context(|| format!("setting {key}={value}"))
}

/// The bridge with the node's address, forwarding on (pods reach Services through the node),
/// bridged traffic through iptables (a pod reaching a Service backed by a pod on the same
/// bridge gets its answers un-NATed), and a drop of anything pods send off the bridge.
fn make_network() -> Result<()> {
    run("ip", &["link", "add", BRIDGE, "type", "bridge"])?;
    let address = format!("{NODE_ADDRESS}/{POD_PREFIX_LENGTH}");
    run("ip", &["addr", "add", &address, "dev", BRIDGE])?;
    run("ip", &["link", "set", BRIDGE, "up"])?;
    // The host reaches Services from the bridge's address, in the pods' range, so that pods
    // answer it directly; and a Service kube-proxy has no rules for yet goes nowhere instead
    // of out of the default route.
    let source = NODE_ADDRESS.to_string();
    run(
        "ip",
        &[
            "route",
            "add",
            SERVICE_CLUSTER_IP_RANGE,
            "dev",
            BRIDGE,
            "src",
            &source,
        ],
    )?;
    if std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward")?.trim() == "0" {
        std::fs::write(forwarding_marker(), "")?;
    }
    write_sysctl("net.ipv4.ip_forward", "1")?;
    write_sysctl("net.bridge.bridge-nf-call-iptables", "1")?;
    run("iptables", &off_bridge_drop("-I"))?;
    Ok(())
}

fn off_bridge_drop(action: &str) -> Vec<&str> {
    vec![
        action,
        "FORWARD",
        "-i",
        BRIDGE,
        "!",
        "-o",
        BRIDGE,
        "-m",
        "comment",
        "--comment",
        RULE_COMMENT,
        "-j",
        "DROP",
    ]
}

/// Present while a real node has turned forwarding on that was off before it.
fn forwarding_marker() -> PathBuf {
    std::env::temp_dir().join("npufleet-real-node-turned-forwarding-on")
}

/// Removes whatever a real node on this machine left: called before a node starts (a crashed
/// one's leftovers) and when it stops. Only one node runs at a time, so all of it is stale.
fn tear_down() {
    kill_shims();
    kill_cgroup(POD_CGROUP);
    unmount_node_dirs();
    let _ = run("ip", &["link", "del", BRIDGE]);
    while run("iptables", &off_bridge_drop("-D")).is_ok() {}
    if std::fs::remove_file(forwarding_marker()).is_ok() {
        let _ = write_sysctl("net.ipv4.ip_forward", "0");
    }
    for tool in ["iptables", "ip6tables"] {
        let _ = remove_chains(tool);
    }
}

/// containerd's shims outlive containerd (they are their own session); each names the socket
/// of the containerd that started it.
fn kill_shims() {
    for pid in shims() {
        // SAFETY: a plain kill of a process found above; a stale id only yields ESRCH.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

/// The process ids of every real node's containerd shims.
fn shims() -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_string_lossy().parse::<i32>().ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            let is_shim = args
                .first()
                .is_some_and(|a| a.ends_with(b"containerd-shim-runc-v2"));
            let ours = args
                .windows(2)
                .any(|w| w[0] == b"-address" && w[1].ends_with(CONTAINERD_SOCKET.as_bytes()));
            (is_shim && ours).then_some(pid)
        })
        .collect()
}

/// What a real node has left on this machine (none while none runs): its bridge, shims,
/// pod cgroups, mounts and firewall chains, one line each.
pub fn leftovers() -> Vec<String> {
    let mut found = Vec::new();
    if Path::new("/sys/class/net").join(BRIDGE).exists() {
        found.push(format!("bridge {BRIDGE}"));
    }
    let shims = shims();
    if !shims.is_empty() {
        found.push(format!("containerd shims {shims:?}"));
    }
    if let Ok(hierarchies) = std::fs::read_dir("/sys/fs/cgroup") {
        for h in hierarchies.flatten() {
            let cgroup = h.path().join(POD_CGROUP);
            if cgroup.is_dir() {
                found.push(format!("cgroup {}", cgroup.display()));
            }
        }
    }
    let temp = std::env::temp_dir();
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mounts = mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .filter(|point| {
            point.starts_with(&*temp.to_string_lossy()) && point.contains("/real-node/")
        })
        .count();
    if mounts > 0 {
        found.push(format!("{mounts} mounts below a real node's directory"));
    }
    for tool in ["iptables-save", "ip6tables-save"] {
        let rules = run(tool, &[]).unwrap_or_default();
        let ours = rules
            .lines()
            .filter(|l| l.contains("KUBE-") || l.contains("CNI-") || l.contains(RULE_COMMENT))
            .count();
        if ours > 0 {
            found.push(format!(
                "{ours} lines of kube-proxy's, CNI's or the node's rules in {tool}"
            ));
        }
    }
    found
}

/// Why this machine cannot run a real node, when it cannot.
pub fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    (unsafe { libc::geteuid() } != 0).then(|| {
        "a real node needs root: it makes a bridge, firewall rules, mounts and cgroups".to_owned()
    })
}

/// Kills every process in cgroup `name` and below, in every v1 hierarchy, and removes the
/// cgroups once empty.
fn kill_cgroup(name: &str) {
    let Ok(hierarchies) = std::fs::read_dir("/sys/fs/cgroup") else {
        return;
    };
    let roots: Vec<PathBuf> = hierarchies
        .flatten()
        .map(|h| h.path().join(name))
        .filter(|p| p.is_dir())
        .collect();
    for root in &roots {
        for dir in cgroup_dirs(root) {
            let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
            for pid in procs.lines().filter_map(|p| p.trim().parse::<i32>().ok()) {
                // SAFETY: killing a container process of this node's pods.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
    // A killed process leaves its cgroup only once it has exited.
    let deadline = Instant::now() + Duration::from_secs(10);
    for root in &roots {
        for dir in cgroup_dirs(root).iter().rev() {
            while std::fs::remove_dir(dir).is_err() && dir.exists() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// `root` and every cgroup below it, parents before children.
fn cgroup_dirs(root: &Path) -> Vec<PathBuf> {
    let mut dirs = vec![root.to_path_buf()];
    let mut i = 0;
    while i < dirs.len() {
        if let Ok(entries) = std::fs::read_dir(&dirs[i]) {
            dirs.extend(entries.flatten().map(|e| e.path()).filter(|p| p.is_dir()));
        }
        i += 1;
    }
    dirs
}

/// Container root filesystems, sandbox network namespaces and kubelet's volume mounts of any
/// real node's directory.
fn unmount_node_dirs() {
    let temp = std::env::temp_dir();
    process::unmount_below(&temp, |mount_point| {
        mount_point.to_string_lossy().contains("/real-node/")
    });
}

/// Drops the chains kube-proxy, kubelet and the CNI plugins made (`KUBE-*`, `CNI-*`) and every
/// rule that jumps to them, table by table, as one atomic `iptables-restore` of each.
fn remove_chains(tool: &str) -> Result<()> {
    for table in ["nat", "filter", "mangle"] {
        let saved = run(&format!("{tool}-save"), &["-t", table])?;
        if !saved.contains("KUBE-") && !saved.contains("CNI-") {
            continue;
        }
        let kept: String = saved
            .lines()
            .filter(|line| !line.contains("KUBE-") && !line.contains("CNI-"))
            .map(|line| format!("{line}\n"))
            .collect();
        let mut restore = std::process::Command::new(which(&format!("{tool}-restore"))?);
        restore.stdin(std::process::Stdio::piped());
        let mut child = restore.spawn()?;
        std::io::Write::write_all(child.stdin.as_mut().context("stdin")?, kept.as_bytes())?;
        drop(child.stdin.take());
        let status = child.wait()?;
        anyhow::ensure!(status.success(), "{tool}-restore -t {table} failed");
    }
    Ok(())
}

fn containerd_toml(dir: &Path, pause: &str) -> String {
    let d = dir.display();
    format!(
        r#"version = 2
root = "{d}/containerd/root"
state = "{d}/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = "{d}/containerd.sock"

[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/containerd/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  netns_mounts_under_state_dir = true
  enable_unprivileged_ports = false
  enable_unprivileged_icmp = false
  # Kubelet asks for negative OOM scores (-998 for sandboxes), which only a holder of
  # CAP_SYS_RESOURCE may set; a machine may withhold that even from root (a container or
  # sandboxed VM), and then every container start fails. Pods get no lower score than
  # containerd's own.
  restrict_oom_score_adj = true

[plugins."io.containerd.grpc.v1.cri".containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
  SystemdCgroup = false

[plugins."io.containerd.grpc.v1.cri".cni]
  bin_dir = "/usr/lib/cni"
  conf_dir = "{d}/cni/conf"
"#
    )
}

fn cni_conflist(dir: &Path) -> String {
    json!({
        "cniVersion": "1.0.0",
        "name": "npufleet",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": true,
                "ipMasq": false,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "dataDir": dir.join("cni/ipam"),
                    "ranges": [[{"subnet": POD_CIDR, "gateway": NODE_ADDRESS.to_string()}]],
                    "routes": [{"dst": POD_ROUTE}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": true}},
        ],
    })
    .to_string()
}

fn kubelet_yaml(dir: &Path, client_ca: &Path, healthz_port: u16) -> Result<String> {
    Ok(serde_json::to_string(&json!({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": NODE_ADDRESS.to_string(),
        "port": free_port()?,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "authentication": {
            "anonymous": {"enabled": false},
            "webhook": {"enabled": true},
            "x509": {"clientCAFile": client_ca},
        },
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": format!("unix://{}", dir.join("containerd.sock").display()),
        "cgroupDriver": "cgroupfs",
        "failSwapOn": false,
        "clusterDNS": [NODE_ADDRESS.to_string()],
        "clusterDomain": CLUSTER_DOMAIN,
        // No host resolvers for pods: nothing they look up leaves the machine.
        "resolvConf": "",
        "podLogsDir": dir.join("pod-logs"),
        // A shared machine's disk is not this node's to police, and nothing can be pulled
        // back once collected.
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "registerNode": true,
        "rotateCertificates": false,
        "serializeImagePulls": false,
        "syncFrequency": "10s",
        "nodeStatusUpdateFrequency": "5s",
    }))?)
}

fn kube_proxy_yaml(kubeconfig: &Path, healthz_port: u16) -> Result<String> {
    Ok(serde_json::to_string(&json!({
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "clientConnection": {"kubeconfig": kubeconfig},
        "hostnameOverride": NODE_NAME,
        "clusterCIDR": POD_CIDR,
        "bindAddress": "127.0.0.1",
        "healthzBindAddress": format!("127.0.0.1:{healthz_port}"),
        "metricsBindAddress": format!("127.0.0.1:{}", free_port()?),
        "nodePortAddresses": [format!("{NODE_ADDRESS}/32")],
        // Host-wide conntrack sizing is not this node's to change.
        "conntrack": {"maxPerCore": 0},
        "iptables": {"localhostNodePorts": false, "syncPeriod": "30s", "minSyncPeriod": "0s"},
    }))?)
}

fn corefile_text(kubeconfig: &Path, ready_port: u16) -> String {
    // Only the cluster's zones: any other name gets REFUSED, none is forwarded.
    format!(
        "{CLUSTER_DOMAIN}:53 in-addr.arpa:53 {{\n    bind {NODE_ADDRESS}\n    errors\n    ready 127.0.0.1:{ready_port}\n    kubernetes {CLUSTER_DOMAIN} in-addr.arpa {{\n        kubeconfig {}\n        pods insecure\n    }}\n    cache 5\n    loadbalance\n}}\n",
        kubeconfig.display()
    )
}

/// What CoreDNS's kubernetes plugin reads, for [`COREDNS_USER`].
async fn grant_coredns(client: &Client) -> Result<()> {
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
    let params = PatchParams::apply("npufleet-local").force();
    let role: ClusterRole = serde_json::from_value(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "npufleet:coredns"},
        "rules": [
            {"apiGroups": [""], "resources": ["services", "pods", "namespaces"], "verbs": ["list", "watch"]},
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
        ],
    }))?;
    Api::<ClusterRole>::all(client.clone())
        .patch("npufleet:coredns", &params, &Patch::Apply(&role))
        .await
        .context("granting CoreDNS its reads")?;
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "npufleet:coredns"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "npufleet:coredns"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": COREDNS_USER}],
    }))?;
    Api::<ClusterRoleBinding>::all(client.clone())
        .patch("npufleet:coredns", &params, &Patch::Apply(&binding))
        .await
        .context("granting CoreDNS its reads")?;
    Ok(())
}

//! A throw-away Kubernetes control plane from the upstream binaries: etcd and
//! kube-apiserver (RBAC on) on free loopback ports, optionally kube-controller-manager,
//! kube-scheduler and KWOK with fake nodes.
//!
//! TLS is real: a CA, a serving certificate for 127.0.0.1 and a service-account signing key
//! are made per cluster, and the admin authenticates with a bearer token in
//! `system:masters`, so kubectl, helm and kube-rs all connect the way they would to a real
//! cluster.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, Node, ServiceAccount};
use kube::api::{Api, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

use crate::net::free_port;
use crate::paths;
use crate::process::{Process, ScratchDir};
use crate::real_node::RealNode;
use crate::wait;

/// The Services' ClusterIP range: part of 198.18.0.0/15 (RFC 2544), which no real network
/// uses, so no Service address can shadow one the machine reaches.
pub const SERVICE_CLUSTER_IP_RANGE: &str = "198.19.0.0/16";
/// The `kubernetes` Service's ClusterIP: the first address of [`SERVICE_CLUSTER_IP_RANGE`].
pub const KUBERNETES_SERVICE_IP: std::net::Ipv4Addr = std::net::Ipv4Addr::new(198, 19, 0, 1);

/// The label KWOK selects the nodes it fakes by.
pub const KWOK_NODE_LABEL: &str = "npufleet.io/fake-node";
/// Addresses KWOK hands its fake nodes and their pods. Nothing listens on them; they come from
/// the benchmarking range 198.18.0.0/15 so that no object of the local cluster names a private
/// or public network (KWOK's defaults are 10.0.0.0/24 and 196.168.0.1).
const KWOK_POD_CIDR: &str = "198.18.128.0/20";
const KWOK_NODE_IP: &str = "198.18.127.1";

/// A node KWOK keeps Ready; its capacity is what the scheduler places pods against.
#[derive(Debug, Clone)]
pub struct FakeNode {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub capacity: BTreeMap<String, String>,
}

impl FakeNode {
    /// An Atlas 800-style server: 8 × Ascend 910 (910B3) as the MindCluster device plugin
    /// advertises them.
    pub fn ascend910(name: &str) -> Self {
        Self::with_accelerator(
            name,
            "huawei.com/Ascend910",
            "8",
            &[
                ("accelerator", "huawei-Ascend910"),
                ("node.kubernetes.io/npu.chip.name", "910B3"),
                ("accelerator-type", "module-910b-8"),
            ],
        )
    }

    /// A CCE node with the "CCE AI Suite (Ascend NPU)" add-on's resource name.
    pub fn cce_ascend1980(name: &str) -> Self {
        Self::with_accelerator(
            name,
            "huawei.com/ascend-1980",
            "8",
            &[
                ("accelerator", "huawei-Ascend910"),
                ("node.kubernetes.io/npu.chip.name", "910B3"),
            ],
        )
    }

    /// A plain CPU node.
    pub fn cpu(name: &str) -> Self {
        Self {
            name: name.to_string(),
            labels: BTreeMap::new(),
            capacity: base_capacity(),
        }
    }

    fn with_accelerator(name: &str, resource: &str, count: &str, labels: &[(&str, &str)]) -> Self {
        let mut capacity = base_capacity();
        capacity.insert(resource.to_string(), count.to_string());
        Self {
            name: name.to_string(),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            capacity,
        }
    }
}

fn base_capacity() -> BTreeMap<String, String> {
    [("cpu", "64"), ("memory", "512Gi"), ("pods", "110")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Which components run beside etcd and kube-apiserver.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    pub controller_manager: bool,
    pub scheduler: bool,
    pub kwok: bool,
    pub nodes: Vec<FakeNode>,
    /// kube-controller-manager's HPA sync period (upstream default 15 s).
    pub hpa_sync_period: Duration,
    /// kube-controller-manager's HPA scale-down stabilisation (upstream default 5 min).
    pub hpa_downscale_stabilization: Duration,
    /// Extra kube-apiserver flags.
    pub apiserver_args: Vec<String>,
    /// A real node: containerd, kubelet, kube-proxy and CoreDNS on this machine
    /// ([`RealNode`]); needs root and `tests/setup/node.sh`.
    pub real_node: bool,
}

impl ClusterOptions {
    /// etcd and kube-apiserver only: API behaviour (validation, apply, watches).
    pub fn api_only() -> Self {
        Self {
            controller_manager: false,
            scheduler: false,
            kwok: false,
            nodes: Vec::new(),
            hpa_sync_period: Duration::from_secs(15),
            hpa_downscale_stabilization: Duration::from_secs(300),
            apiserver_args: Vec::new(),
            real_node: false,
        }
    }

    /// The control plane with a real node ([`RealNode`]) and no fake ones, so that every pod
    /// runs in a container.
    pub fn real_node() -> Self {
        Self {
            controller_manager: true,
            scheduler: true,
            real_node: true,
            ..Self::api_only()
        }
    }

    /// Every component, two fake Ascend 910 servers, a fake CCE 910B server and a CPU node.
    /// HPA timings are shortened so HPA behaviour shows within a test's time.
    pub fn full() -> Self {
        Self {
            controller_manager: true,
            scheduler: true,
            kwok: true,
            nodes: vec![
                FakeNode::ascend910("ascend-node-0"),
                FakeNode::ascend910("ascend-node-1"),
                FakeNode::cce_ascend1980("cce-node-0"),
                FakeNode::cpu("cpu-node-0"),
            ],
            hpa_sync_period: Duration::from_secs(2),
            hpa_downscale_stabilization: Duration::from_secs(10),
            apiserver_args: Vec::new(),
            real_node: false,
        }
    }
}

/// A running control plane. Dropping it kills every process and removes its data.
pub struct Cluster {
    /// Dropped first: its pods go while the control plane still runs.
    real_node: Option<RealNode>,
    processes: Mutex<Vec<Process>>,
    server: String,
    kubeconfig: PathBuf,
    bin: PathBuf,
    started_in: Duration,
    ca: rcgen::Issuer<'static, rcgen::KeyPair>,
    dir: ScratchDir,
}

/// An hour's token of ServiceAccount `namespace/account`.
pub async fn service_account_token(
    client: &Client,
    namespace: &str,
    account: &str,
) -> Result<String> {
    let request = TokenRequest {
        spec: TokenRequestSpec {
            audiences: vec![],
            expiration_seconds: Some(3600),
            bound_object_ref: None,
        },
        ..Default::default()
    };
    Ok(Api::<ServiceAccount>::namespaced(client.clone(), namespace)
        .create_token_request(account, &PostParams::default(), &request)
        .await
        .with_context(|| format!("token for ServiceAccount {namespace}/{account}"))?
        .status
        .context("token status")?
        .token)
}

/// The cluster shared by every test of one test binary, with all components
/// ([`ClusterOptions::full`]). Tests isolate themselves with [`Cluster::namespace`].
pub fn shared() -> &'static Cluster {
    static SHARED: OnceLock<Cluster> = OnceLock::new();
    SHARED.get_or_init(|| {
        crate::runtime::block_on_own_thread(Cluster::start(ClusterOptions::full()))
            .unwrap_or_else(|e| panic!("starting the shared test cluster: {e:#}"))
    })
}

/// The real-node cluster ([`ClusterOptions::real_node`]) shared by every test of one test
/// binary. One real node runs per machine, so test binaries that use one run one at a time.
pub fn shared_real_node() -> &'static Cluster {
    static SHARED: OnceLock<Cluster> = OnceLock::new();
    SHARED.get_or_init(|| {
        crate::runtime::block_on_own_thread(Cluster::start(ClusterOptions::real_node()))
            .unwrap_or_else(|e| panic!("starting the shared real-node cluster: {e:#}"))
    })
}

struct Pki {
    ca: rcgen::Issuer<'static, rcgen::KeyPair>,
    ca_pem: String,
    ca_file: PathBuf,
    cert_file: PathBuf,
    key_file: PathBuf,
    sa_key_file: PathBuf,
    sa_pub_file: PathBuf,
    /// The request-header (front-proxy) CA and the client certificate kube-apiserver's
    /// aggregator presents to extension API servers, as kubeadm sets them up.
    front_proxy_ca_file: PathBuf,
    front_proxy_cert_file: PathBuf,
    front_proxy_key_file: PathBuf,
    /// The client certificate kube-apiserver presents to kubelets (logs, exec).
    kubelet_client_cert_file: PathBuf,
    kubelet_client_key_file: PathBuf,
}

/// The cluster CA's certificate, in the scratch directory.
const CA_FILE: &str = "ca.crt";

/// The common name of the aggregator's client certificate, the one allowed request-header name.
pub const FRONT_PROXY_CLIENT: &str = "front-proxy-client";

fn make_pki(dir: &Path) -> Result<Pki> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};

    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "npufleet-test-ca");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let issuer = rcgen::Issuer::new(ca_params, ca_key);

    let server_key = KeyPair::generate()?;
    // Pods reach the apiserver at the `kubernetes` Service, by its ClusterIP
    // (KUBERNETES_SERVICE_HOST) or its DNS names.
    let mut server_params = CertificateParams::new(vec![
        "127.0.0.1".to_string(),
        "localhost".to_string(),
        KUBERNETES_SERVICE_IP.to_string(),
        "kubernetes".to_string(),
        "kubernetes.default".to_string(),
        "kubernetes.default.svc".to_string(),
        format!(
            "kubernetes.default.svc.{}",
            crate::real_node::CLUSTER_DOMAIN
        ),
    ])?;
    server_params
        .distinguished_name
        .push(DnType::CommonName, "kube-apiserver");
    let server_cert = server_params.signed_by(&server_key, &issuer)?;

    let sa_key = KeyPair::generate()?;
    let (kubelet_client_cert, kubelet_client_key) = client_certificate(
        &issuer,
        "kube-apiserver-kubelet-client",
        &["system:masters"],
    )?;

    let pki = Pki {
        ca: issuer,
        ca_pem: ca_cert.pem(),
        ca_file: dir.join(CA_FILE),
        cert_file: dir.join("apiserver.crt"),
        key_file: dir.join("apiserver.key"),
        sa_key_file: dir.join("sa.key"),
        sa_pub_file: dir.join("sa.pub"),
        front_proxy_ca_file: dir.join("front-proxy-ca.crt"),
        front_proxy_cert_file: dir.join("front-proxy-client.crt"),
        front_proxy_key_file: dir.join("front-proxy-client.key"),
        kubelet_client_cert_file: dir.join("apiserver-kubelet-client.crt"),
        kubelet_client_key_file: dir.join("apiserver-kubelet-client.key"),
    };
    std::fs::write(&pki.kubelet_client_cert_file, kubelet_client_cert)?;
    std::fs::write(&pki.kubelet_client_key_file, kubelet_client_key)?;
    std::fs::write(&pki.ca_file, &pki.ca_pem)?;
    std::fs::write(&pki.cert_file, server_cert.pem())?;
    std::fs::write(&pki.key_file, server_key.serialize_pem())?;
    std::fs::write(&pki.sa_key_file, sa_key.serialize_pem())?;
    std::fs::write(&pki.sa_pub_file, sa_key.public_key_pem())?;

    let proxy_ca_key = KeyPair::generate()?;
    let mut proxy_ca_params = CertificateParams::new(Vec::<String>::new())?;
    proxy_ca_params
        .distinguished_name
        .push(DnType::CommonName, "npufleet-test-front-proxy-ca");
    proxy_ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    proxy_ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let proxy_ca_cert = proxy_ca_params.self_signed(&proxy_ca_key)?;
    let proxy_issuer = rcgen::Issuer::new(proxy_ca_params, proxy_ca_key);
    let proxy_key = KeyPair::generate()?;
    let mut proxy_params = CertificateParams::new(Vec::<String>::new())?;
    proxy_params
        .distinguished_name
        .push(DnType::CommonName, FRONT_PROXY_CLIENT);
    proxy_params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let proxy_cert = proxy_params.signed_by(&proxy_key, &proxy_issuer)?;
    std::fs::write(&pki.front_proxy_ca_file, proxy_ca_cert.pem())?;
    std::fs::write(&pki.front_proxy_cert_file, proxy_cert.pem())?;
    std::fs::write(&pki.front_proxy_key_file, proxy_key.serialize_pem())?;
    Ok(pki)
}

/// A client certificate and its key (PEM) for user `common_name` in `groups`, signed by `ca`.
fn client_certificate(
    ca: &rcgen::Issuer<'static, rcgen::KeyPair>,
    common_name: &str,
    groups: &[&str],
) -> Result<(String, String)> {
    use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, KeyPair};
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    for group in groups {
        params
            .distinguished_name
            .push(DnType::OrganizationName, *group);
    }
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let cert = params.signed_by(&key, ca)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// How a kubeconfig's user proves who it is.
enum Credential<'a> {
    Token(&'a str),
    Certificate { cert_pem: &'a str, key_pem: &'a str },
}

fn kubeconfig_yaml(server: &str, ca_pem: &str, credential: Credential<'_>) -> String {
    use base64::Engine as _;
    use std::fmt::Write;
    let b64 = |text: &str| base64::engine::general_purpose::STANDARD.encode(text.as_bytes());
    let ca_b64 = b64(ca_pem);
    let user = match credential {
        Credential::Token(token) => format!("    token: {token}\n"),
        Credential::Certificate { cert_pem, key_pem } => format!(
            "    client-certificate-data: {}\n    client-key-data: {}\n",
            b64(cert_pem),
            b64(key_pem)
        ),
    };
    let mut s = String::new();
    let _ = write!(
        s,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca_b64}\nusers:\n- name: admin\n  user:\n{user}contexts:\n- name: local\n  context:\n    cluster: local\n    user: admin\ncurrent-context: local\n"
    );
    s
}

fn random_token() -> String {
    rand::random::<[u8; 24]>()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn etcd_command(bin: &Path, d: &Path, port: u16, peer_port: u16) -> Command {
    let mut etcd = Command::new(bin.join("etcd"));
    etcd.args([
        format!("--data-dir={}", d.join("etcd").display()),
        format!("--listen-client-urls=http://127.0.0.1:{port}"),
        format!("--advertise-client-urls=http://127.0.0.1:{port}"),
        format!("--listen-peer-urls=http://127.0.0.1:{peer_port}"),
        format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}"),
        format!("--initial-cluster=default=http://127.0.0.1:{peer_port}"),
        "--unsafe-no-fsync=true".to_string(),
        "--log-level=warn".to_string(),
    ]);
    etcd
}

fn apiserver_command(bin: &Path, d: &Path, pki: &Pki, etcd_port: u16, api_port: u16) -> Command {
    let mut apiserver = Command::new(bin.join("kube-apiserver"));
    apiserver.args([
        format!("--etcd-servers=http://127.0.0.1:{etcd_port}"),
        "--bind-address=127.0.0.1".to_string(),
        "--advertise-address=127.0.0.1".to_string(),
        format!("--secure-port={api_port}"),
        format!("--cert-dir={}", d.join("certs").display()),
        format!("--tls-cert-file={}", pki.cert_file.display()),
        format!("--tls-private-key-file={}", pki.key_file.display()),
        format!("--client-ca-file={}", pki.ca_file.display()),
        format!("--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}"),
        "--allow-privileged=true".to_string(),
        "--authorization-mode=Node,RBAC".to_string(),
        format!(
            "--kubelet-client-certificate={}",
            pki.kubelet_client_cert_file.display()
        ),
        format!(
            "--kubelet-client-key={}",
            pki.kubelet_client_key_file.display()
        ),
        "--kubelet-preferred-address-types=InternalIP".to_string(),
        format!("--token-auth-file={}", d.join("tokens.csv").display()),
        format!("--service-account-issuer=https://127.0.0.1:{api_port}"),
        format!("--service-account-key-file={}", pki.sa_pub_file.display()),
        format!(
            "--service-account-signing-key-file={}",
            pki.sa_key_file.display()
        ),
        "--api-audiences=https://kubernetes.default.svc".to_string(),
        "--endpoint-reconciler-type=none".to_string(),
        // kube-proxy runs only beside a real node: the aggregator reaches extension servers
        // at their endpoints.
        "--enable-aggregator-routing=true".to_string(),
        "--enable-priority-and-fairness=false".to_string(),
        // The aggregation layer authenticates itself to extension API servers with a
        // client certificate from this CA, published in
        // kube-system/extension-apiserver-authentication.
        format!(
            "--requestheader-client-ca-file={}",
            pki.front_proxy_ca_file.display()
        ),
        format!("--requestheader-allowed-names={FRONT_PROXY_CLIENT}"),
        "--requestheader-username-headers=X-Remote-User".to_string(),
        "--requestheader-group-headers=X-Remote-Group".to_string(),
        "--requestheader-extra-headers-prefix=X-Remote-Extra-".to_string(),
        format!(
            "--proxy-client-cert-file={}",
            pki.front_proxy_cert_file.display()
        ),
        format!(
            "--proxy-client-key-file={}",
            pki.front_proxy_key_file.display()
        ),
        "--v=0".to_string(),
    ]);
    apiserver
}

/// kube-controller-manager or kube-scheduler: the admin kubeconfig for everything, no leader
/// election, serving on a loopback port of its own.
fn component_command(
    bin: &Path,
    name: &str,
    kubeconfig: &Path,
    cert_dir: &Path,
) -> Result<Command> {
    let mut command = Command::new(bin.join(name));
    command.args([
        format!("--kubeconfig={}", kubeconfig.display()),
        format!("--authentication-kubeconfig={}", kubeconfig.display()),
        format!("--authorization-kubeconfig={}", kubeconfig.display()),
        "--leader-elect=false".to_string(),
        "--bind-address=127.0.0.1".to_string(),
        format!("--secure-port={}", free_port()?),
        format!("--cert-dir={}", cert_dir.display()),
    ]);
    Ok(command)
}

fn controller_manager_command(
    bin: &Path,
    d: &Path,
    kubeconfig: &Path,
    pki: &Pki,
    opts: &ClusterOptions,
) -> Result<Command> {
    let mut kcm = component_command(
        bin,
        "kube-controller-manager",
        kubeconfig,
        &d.join("kcm-certs"),
    )?;
    kcm.args([
        "--controllers=*".to_string(),
        format!(
            "--service-account-private-key-file={}",
            pki.sa_key_file.display()
        ),
        format!("--root-ca-file={}", pki.ca_file.display()),
        format!(
            "--horizontal-pod-autoscaler-sync-period={}s",
            opts.hpa_sync_period.as_secs().max(1)
        ),
        format!(
            "--horizontal-pod-autoscaler-downscale-stabilization={}s",
            opts.hpa_downscale_stabilization.as_secs()
        ),
    ]);
    Ok(kcm)
}

fn kwok_command(bin: &Path, kubeconfig: &Path) -> Result<Command> {
    let stages = paths::kwok_stages()?;
    let configs = [
        "node/fast/node-initialize.yaml",
        "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
        "pod/fast/pod-ready.yaml",
        "pod/fast/pod-complete.yaml",
        "pod/fast/pod-delete.yaml",
    ]
    .iter()
    .map(|c| stages.join(c).display().to_string())
    .collect::<Vec<_>>()
    .join(",");
    let mut kwok = Command::new(bin.join("kwok"));
    kwok.args([
        format!("--kubeconfig={}", kubeconfig.display()),
        "--manage-all-nodes=false".to_string(),
        format!("--manage-nodes-with-label-selector={KWOK_NODE_LABEL}=true"),
        format!("--server-address=127.0.0.1:{}", free_port()?),
        "--node-lease-duration-seconds=40".to_string(),
        format!("--cidr={KWOK_POD_CIDR}"),
        format!("--node-ip={KWOK_NODE_IP}"),
        format!("--config={configs}"),
    ]);
    Ok(kwok)
}

/// Whether `node` says it is Ready.
pub fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

impl Cluster {
    /// Starts the control plane and waits until the apiserver is ready and, when asked,
    /// the fake nodes are Ready.
    pub async fn start(opts: ClusterOptions) -> Result<Cluster> {
        let started = Instant::now();
        let bin = tokio::task::spawn_blocking(paths::control_plane_bin).await??;
        let dir = ScratchDir::new("cluster")?;
        let d = dir.path().to_path_buf();
        let pki = make_pki(&d)?;
        let token = random_token();
        std::fs::write(
            d.join("tokens.csv"),
            format!("{token},admin,admin,\"system:masters\"\n"),
        )?;

        let etcd_port = free_port()?;
        let etcd_peer_port = free_port()?;
        let api_port = free_port()?;
        let server = format!("https://127.0.0.1:{api_port}");
        let kubeconfig = d.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            kubeconfig_yaml(&server, &pki.ca_pem, Credential::Token(&token)),
        )?;

        // Built before `cluster` takes the CA out of `pki`.
        let mut apiserver = apiserver_command(&bin, &d, &pki, etcd_port, api_port);
        apiserver.args(&opts.apiserver_args);
        let kcm = (opts.controller_manager)
            .then(|| controller_manager_command(&bin, &d, &kubeconfig, &pki, &opts))
            .transpose()?;
        let mut cluster = Cluster {
            real_node: None,
            processes: Mutex::new(Vec::new()),
            server: server.clone(),
            kubeconfig: kubeconfig.clone(),
            bin: bin.clone(),
            started_in: Duration::ZERO,
            ca: pki.ca,
            dir,
        };

        cluster.spawn("etcd", etcd_command(&bin, &d, etcd_port, etcd_peer_port))?;
        cluster.spawn("kube-apiserver", apiserver)?;

        let client = wait::until(
            "kube-apiserver /readyz",
            Duration::from_secs(90),
            || async {
                cluster.ensure_running().map_err(wait::fatal)?;
                let client = cluster.client().await?;
                let req = http::Request::get("/readyz").body(Vec::new())?;
                client.request_text(req).await?;
                Ok(Some(client))
            },
        )
        .await?;

        if let Some(kcm) = kcm {
            cluster.spawn("kube-controller-manager", kcm)?;
        }
        if opts.scheduler {
            let scheduler = component_command(
                &bin,
                "kube-scheduler",
                &kubeconfig,
                &d.join("scheduler-certs"),
            )?;
            cluster.spawn("kube-scheduler", scheduler)?;
        }
        if opts.kwok {
            cluster.spawn("kwok", kwok_command(&bin, &kubeconfig)?)?;
            for node in &opts.nodes {
                cluster.add_fake_node(&client, node).await?;
            }
        }
        if opts.controller_manager {
            // The service-account controller creating `default` proves the controllers run.
            let sa: Api<k8s_openapi::api::core::v1::ServiceAccount> =
                Api::namespaced(client.clone(), "default");
            wait::until(
                "the default ServiceAccount",
                Duration::from_secs(60),
                || async {
                    cluster.ensure_running().map_err(wait::fatal)?;
                    Ok(sa.get_opt("default").await?)
                },
            )
            .await?;
        }
        if opts.real_node {
            cluster.real_node = Some(RealNode::start(&cluster, &client).await?);
        }
        Ok(Cluster {
            started_in: started.elapsed(),
            ..cluster
        })
    }

    /// The real node, when [`ClusterOptions::real_node`] asked for one.
    pub fn real_node(&self) -> Option<&RealNode> {
        self.real_node.as_ref()
    }

    /// A kubeconfig for user `common_name` in `groups`, who authenticates with a client
    /// certificate from the cluster's CA (as kubelets and kube-proxy do), written to
    /// `file_name` in the scratch directory.
    pub fn kubeconfig_with_certificate(
        &self,
        common_name: &str,
        groups: &[&str],
        file_name: &str,
    ) -> Result<PathBuf> {
        let (cert_pem, key_pem) = client_certificate(&self.ca, common_name, groups)?;
        let ca_pem = std::fs::read_to_string(self.ca_file())?;
        let path = self.scratch().join(file_name);
        std::fs::write(
            &path,
            kubeconfig_yaml(
                &self.server,
                &ca_pem,
                Credential::Certificate {
                    cert_pem: &cert_pem,
                    key_pem: &key_pem,
                },
            ),
        )?;
        Ok(path)
    }

    /// The cluster's CA certificate file.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join(CA_FILE)
    }

    fn spawn(&self, name: &str, cmd: Command) -> Result<()> {
        let log = self.dir.path().join(format!("{name}.log"));
        let process = Process::start(name, cmd, &log)?;
        self.processes.lock().expect("processes").push(process);
        Ok(())
    }

    /// Kills the component `name` (`kube-apiserver`, `etcd`, …) as a crash would and starts it
    /// again with the same command line, for fault tests. Returns once it has been started;
    /// waiting for it to serve is the caller's.
    pub fn restart(&self, name: &str) -> Result<()> {
        let mut processes = self.processes.lock().expect("processes");
        let process = processes
            .iter_mut()
            .find(|p| p.name() == name)
            .with_context(|| format!("this cluster runs no {name}"))?;
        process.restart()
    }

    /// Fails with the log tail of any component that has exited.
    pub fn ensure_running(&self) -> Result<()> {
        for p in self.processes.lock().expect("processes").iter_mut() {
            p.ensure_running()?;
        }
        if let Some(node) = &self.real_node {
            node.ensure_running()?;
        }
        Ok(())
    }

    /// How long [`Cluster::start`] took.
    pub fn started_in(&self) -> Duration {
        self.started_in
    }

    pub fn server_url(&self) -> &str {
        &self.server
    }

    /// An admin kubeconfig (bearer token in `system:masters`, real CA).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// A directory for a test's own files, removed with the cluster.
    /// A kubeconfig like the admin's whose every user authenticates with `token`, written to
    /// `file_name` in the scratch directory.
    pub fn kubeconfig_with_token(&self, token: &str, file_name: &str) -> Result<PathBuf> {
        let mut config: serde_yaml::Value =
            serde_yaml::from_str(&std::fs::read_to_string(self.kubeconfig())?)?;
        let users = config["users"]
            .as_sequence_mut()
            .context("kubeconfig has users")?;
        for user in users {
            user["user"] = serde_yaml::to_value(serde_json::json!({ "token": token }))?;
        }
        let path = self.scratch().join(file_name);
        std::fs::write(&path, serde_yaml::to_string(&config)?)?;
        Ok(path)
    }

    /// The client certificate kube-apiserver's aggregator presents to extension API servers,
    /// for a test that asks one of them directly as the aggregator would.
    pub fn front_proxy_identity(&self) -> Result<reqwest::Identity> {
        let dir = self.dir.path();
        let mut pem = std::fs::read(dir.join("front-proxy-client.crt"))?;
        pem.extend(std::fs::read(dir.join("front-proxy-client.key"))?);
        Ok(reqwest::Identity::from_pem(&pem)?)
    }

    pub fn scratch(&self) -> &Path {
        self.dir.path()
    }

    /// A fresh admin client. Create one per test: a client belongs to the async runtime
    /// that created it.
    pub async fn client(&self) -> Result<Client> {
        Ok(Client::try_from(self.config().await?)?)
    }

    /// The admin client's configuration, for a test that needs a client set up differently.
    pub async fn config(&self) -> Result<Config> {
        let kc = Kubeconfig::read_from(&self.kubeconfig)?;
        Ok(Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?)
    }

    /// A client that authenticates with `token` (for example a ServiceAccount's) instead of
    /// the admin's, against the same server and CA.
    pub async fn client_with_token(&self, token: &str) -> Result<Client> {
        let kc = Kubeconfig::read_from(&self.kubeconfig)?;
        let mut config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
        config.auth_info.token = Some(token.to_string().into());
        Ok(Client::try_from(config)?)
    }

    /// A pinned control-plane binary (`kubectl`, `helm`, …).
    pub fn tool(&self, name: &str) -> PathBuf {
        self.bin.join(name)
    }

    /// `kubectl` against this cluster.
    pub fn kubectl(&self) -> Command {
        let mut cmd = Command::new(self.tool("kubectl"));
        cmd.env("KUBECONFIG", &self.kubeconfig);
        cmd
    }

    /// `helm` against this cluster, with its state kept in the cluster's scratch dir.
    pub fn helm(&self) -> Command {
        let mut cmd = Command::new(self.tool("helm"));
        let home = self.dir.path().join("helm");
        cmd.env("KUBECONFIG", &self.kubeconfig)
            .env("HELM_CACHE_HOME", home.join("cache"))
            .env("HELM_CONFIG_HOME", home.join("config"))
            .env("HELM_DATA_HOME", home.join("data"));
        cmd
    }

    /// Creates a namespace named after the test with a unique suffix.
    pub async fn namespace(&self, client: &Client, test: &str) -> Result<String> {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let base: String = test
            .to_ascii_lowercase()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .take(40)
            .collect();
        let name = format!(
            "{}-{}-{}",
            base.trim_matches('-'),
            std::process::id() % 10_000,
            N.fetch_add(1, Ordering::Relaxed)
        );
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": { "name": name }
        }))?;
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .with_context(|| format!("creating namespace {name}"))?;
        Ok(name)
    }

    /// Registers a node that KWOK keeps Ready, and waits for it to be Ready.
    pub async fn add_fake_node(&self, client: &Client, node: &FakeNode) -> Result<()> {
        let mut labels = node.labels.clone();
        labels.insert(KWOK_NODE_LABEL.to_string(), "true".to_string());
        labels.insert("kubernetes.io/hostname".to_string(), node.name.clone());
        labels.insert("kubernetes.io/os".to_string(), "linux".to_string());
        labels.insert("kubernetes.io/arch".to_string(), "amd64".to_string());
        labels.insert("type".to_string(), "kwok".to_string());
        let obj: Node = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": node.name,
                "labels": labels,
                "annotations": { "node.alpha.kubernetes.io/ttl": "0", "kwok.x-k8s.io/node": "fake" }
            },
            "spec": {},
            "status": {
                "capacity": node.capacity,
                "allocatable": node.capacity,
                "nodeInfo": {
                    "architecture": "amd64", "operatingSystem": "linux",
                    "kubeletVersion": "fake", "kubeProxyVersion": "fake",
                    "bootID": "", "containerRuntimeVersion": "", "kernelVersion": "",
                    "machineID": "", "osImage": "", "systemUUID": ""
                }
            }
        }))?;
        let nodes: Api<Node> = Api::all(client.clone());
        nodes
            .create(&PostParams::default(), &obj)
            .await
            .with_context(|| format!("creating node {}", node.name))?;
        wait::until(
            &format!("node {} Ready", node.name),
            Duration::from_secs(60),
            || async {
                self.ensure_running().map_err(wait::fatal)?;
                let n = nodes.get(&node.name).await?;
                Ok(node_ready(&n).then_some(()))
            },
        )
        .await
    }

    /// The log file of a component, for diagnosing a failed test.
    pub fn component_log(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.log"))
    }

    /// Fails unless `f` succeeds; on failure appends the components' log tails.
    pub fn diagnose<T>(&self, result: Result<T>) -> Result<T> {
        result.map_err(|e| {
            let mut msg = format!("{e:#}");
            for p in self.processes.lock().expect("processes").iter() {
                msg.push_str(&format!("\n--- {} ---\n{}", p.name(), p.log_tail(15)));
            }
            if let Some(node) = &self.real_node {
                msg.push_str(&node.log_tails(15));
            }
            // Worker pods run by node agents log under the scratch directory.
            for entry in walk_logs(self.scratch()) {
                let text = std::fs::read_to_string(&entry).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(15).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                msg.push_str(&format!(
                    "\n--- {} ---\n{}",
                    entry.display(),
                    tail.join("\n")
                ));
            }
            anyhow::anyhow!(msg)
        })
    }
}

/// The `*.log` files of the node agents' directories (`agent-*` below `dir`).
fn walk_logs(dir: &Path) -> Vec<PathBuf> {
    let mut logs = Vec::new();
    for sub in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if !sub.path().is_dir() || !sub.file_name().to_string_lossy().starts_with("agent") {
            continue;
        }
        for file in std::fs::read_dir(sub.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            if file.path().extension().is_some_and(|e| e == "log") {
                logs.push(file.path());
            }
        }
    }
    logs.sort();
    logs
}

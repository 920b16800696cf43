//! The real node of the local platform (containerd, kubelet, kube-proxy, CoreDNS on this
//! machine): a container of the tests' own image runs under the restricted Pod Security
//! Standard, kubelet's readiness probe makes it Ready, its Service's ClusterIP answers from
//! the node and its DNS name from another pod, and kubelet restarts a container the runtime
//! killed.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::{Api, PostParams};
use npufleet_tests::cluster::{self, Cluster};
use npufleet_tests::real_node::{self, CLUSTER_DOMAIN, REAL_NODE_LABEL, RealNode};
use npufleet_tests::{access, paths, wait};
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(60);
const PORT: u16 = 8080;

/// The real-node tests pass without running where no real node can run (not root).
fn skipped() -> bool {
    let why = real_node::unavailable();
    if let Some(why) = &why {
        println!("skipping the real-node test: {why}");
    }
    why.is_some()
}

fn node(c: &Cluster) -> &RealNode {
    c.real_node()
        .expect("the real-node cluster has a real node")
}

fn netcheck_image(c: &Cluster) -> String {
    paths::image_tag(node(c).images(), "netcheck")
        .expect("tests/setup/node.sh lists the netcheck image")
}

/// A pod of one netcheck container, as the restricted standard wants it.
fn netcheck_pod(c: &Cluster, name: &str, args: &[&str], restart: &str) -> Result<Pod> {
    let probe: Value = if args[0] == "serve" {
        json!({"httpGet": {"path": "/healthz", "port": PORT}, "periodSeconds": 1})
    } else {
        Value::Null
    };
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "nodeSelector": {REAL_NODE_LABEL: "true"},
            "restartPolicy": restart,
            "terminationGracePeriodSeconds": 1,
            "enableServiceLinks": false,
            "securityContext": {"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "netcheck",
                "image": netcheck_image(c),
                "imagePullPolicy": "Never",
                "args": args,
                "ports": [{"containerPort": PORT}],
                "readinessProbe": probe,
                "securityContext": {
                    "allowPrivilegeEscalation": false,
                    "capabilities": {"drop": ["ALL"]},
                    "readOnlyRootFilesystem": true,
                },
            }],
        },
    }))?)
}

fn in_range(ip: Ipv4Addr, cidr: &str) -> Result<bool> {
    let (base, bits) = cidr.split_once('/').context("a CIDR has a prefix length")?;
    let mask = u32::MAX.checked_shl(32 - bits.parse::<u32>()?).unwrap_or(0);
    Ok(u32::from(ip) & mask == u32::from(base.parse::<Ipv4Addr>()?) & mask)
}

fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Creates a serving netcheck pod and waits for kubelet to report it Ready; returns how long
/// that took.
async fn serving_pod(c: &Cluster, pods: &Api<Pod>, name: &str) -> Result<Duration> {
    let created = Instant::now();
    pods.create(
        &PostParams::default(),
        &netcheck_pod(c, name, &["serve", &format!(":{PORT}")], "Always")?,
    )
    .await
    .with_context(|| format!("creating pod {name}"))?;
    c.diagnose(
        wait::until(&format!("pod {name} Ready"), TIMEOUT, || async {
            Ok(is_ready(&pods.get(name).await?).then_some(()))
        })
        .await,
    )?;
    Ok(created.elapsed())
}

#[tokio::test]
async fn a_pod_is_ready_by_its_probe_and_reached_by_service_ip_and_dns_name() -> Result<()> {
    if skipped() {
        return Ok(());
    }
    let c = cluster::shared_real_node();
    println!(
        "real-node cluster started in {:.1} s (node {:.1} s of it)",
        c.started_in().as_secs_f64(),
        node(c).started_in().as_secs_f64()
    );
    let client = c.client().await?;
    let ns = access::restricted_namespace(c, &client, "real-node-service").await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let ready_in = serving_pod(c, &pods, "echo").await?;
    println!(
        "pod create -> Ready on the real node: {:.2} s",
        ready_in.as_secs_f64()
    );

    let service: Service = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "echo"},
        "spec": {"selector": {"app": "echo"}, "ports": [{"port": 80, "targetPort": PORT}]},
    }))?;
    let service = Api::<Service>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &service)
        .await?;
    let cluster_ip = service
        .spec
        .and_then(|s| s.cluster_ip)
        .context("the Service got no ClusterIP")?;
    assert!(
        in_range(cluster_ip.parse()?, cluster::SERVICE_CLUSTER_IP_RANGE)?,
        "ClusterIP {cluster_ip} is outside {}",
        cluster::SERVICE_CLUSTER_IP_RANGE
    );

    // From the node: kube-proxy's rules take the ClusterIP to the pod.
    // A fresh connection each try: one opened before kube-proxy's rules would keep going where
    // it first went.
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .pool_max_idle_per_host(0)
        .build()?;
    let url = format!("http://{cluster_ip}/");
    let body = c.diagnose(
        wait::until(&format!("{url} from the node"), TIMEOUT, || async {
            let answer = http.get(&url).send().await?.error_for_status()?;
            Ok(Some(answer.text().await?))
        })
        .await,
    )?;
    assert_eq!(body, "netcheck echo\n");

    // From another pod, by name: CoreDNS answers, kube-proxy routes.
    let name = format!("echo.{ns}.svc.{CLUSTER_DOMAIN}");
    let fetch = netcheck_pod(c, "fetch", &["fetch", &format!("http://{name}/")], "Never")?;
    pods.create(&PostParams::default(), &fetch).await?;
    let phase = c.diagnose(
        wait::until("pod fetch to finish", TIMEOUT, || async {
            let phase = pods.get("fetch").await?.status.and_then(|s| s.phase);
            Ok(phase.filter(|p| p == "Succeeded" || p == "Failed"))
        })
        .await,
    )?;
    let log = pods.logs("fetch", &Default::default()).await?;
    assert_eq!(phase, "Succeeded", "fetching http://{name}/ failed: {log}");
    assert!(log.ends_with("netcheck echo\n"), "fetch printed {log:?}");
    Ok(())
}

#[tokio::test]
async fn kubelet_restarts_a_container_the_runtime_killed() -> Result<()> {
    if skipped() {
        return Ok(());
    }
    let c = cluster::shared_real_node();
    let client = c.client().await?;
    let ns = access::restricted_namespace(c, &client, "real-node-restart").await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    serving_pod(c, &pods, "victim").await?;
    let status = pods.get("victim").await?.status.unwrap_or_default();
    let container = &status.container_statuses.unwrap_or_default()[0];
    let id = container
        .container_id
        .as_deref()
        .and_then(|id| id.strip_prefix("containerd://"))
        .context("the container has no containerd id")?
        .to_owned();

    let mut kill = node(c).ctr();
    kill.args(["tasks", "kill", "--signal", "SIGKILL", &id]);
    npufleet_tests::process::stdout_of(kill)?;

    c.diagnose(
        wait::until("the container restarted and Ready", TIMEOUT, || async {
            let pod = pods.get("victim").await?;
            let restarts = pod
                .status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .map_or(0, |cs| cs[0].restart_count);
            Ok((restarts >= 1 && is_ready(&pod)).then_some(()))
        })
        .await,
    )?;
    Ok(())
}

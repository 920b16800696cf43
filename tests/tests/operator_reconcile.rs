//! The operator as shipped: the chart installed with the real helm, the operator binary running
//! with nothing but the chart's ServiceAccount token (so only the chart's RBAC), reconciling
//! the samples and worker groups on KWOK nodes.

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::ClusterRole;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use npufleet_tests::process::Process;
use npufleet_tests::{cluster, paths, runtime, service, wait};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TIMEOUT: Duration = Duration::from_secs(90);
const RELEASE_NAMESPACE: &str = "npufleet-system";
const IDENTITY: &str = "operator-under-test";

struct Operator {
    metrics_port: u16,
    _process: Process,
}

fn pod_group_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("scheduling.volcano.sh", "v1beta1", "PodGroup"),
        "podgroups",
    )
}

/// The Gateway API Inference Extension's own InferencePool CRD, from its release module.
async fn serve_inference_pools(client: &Client) -> Result<()> {
    let file = tokio::task::spawn_blocking(paths::inference_pool_crd).await??;
    let crd: CustomResourceDefinition = serde_yaml::from_str(&std::fs::read_to_string(&file)?)
        .with_context(|| format!("parsing {}", file.display()))?;
    let name = crd.name_any();
    Api::<CustomResourceDefinition>::all(client.clone())
        .create(&PostParams::default(), &crd)
        .await?;
    npufleet_tests::crd::wait_established(client, &name).await
}

fn run(mut cmd: Command) -> Result<String> {
    let out = cmd.output()?;
    if !out.status.success() {
        bail!(
            "{:?} failed: {}{}",
            cmd,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

async fn http_get(port: u16, path: &str) -> Result<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let code = response
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("status line")?;
    Ok((code, response))
}

async fn start_operator(c: &cluster::Cluster) -> Result<Operator> {
    let client = c.client().await?;
    npufleet_tests::crd::serve_volcano_pod_groups(&client, "npufleet-tests").await?;
    serve_inference_pools(&client).await?;
    let chart = paths::repo_root().join("charts/npufleet");
    let mut helm = c.helm();
    helm.args(["install", "npufleet"]).arg(&chart).args([
        "--namespace",
        RELEASE_NAMESPACE,
        "--create-namespace",
    ]);
    run(helm).context("helm install")?;

    let token = cluster::service_account_token(&client, RELEASE_NAMESPACE, "npufleet").await?;
    let kubeconfig = c.kubeconfig_with_token(&token, "operator-kubeconfig.yaml")?;
    let (mut cmd, metrics_port) =
        npufleet_tests::operator::command(&kubeconfig, "info,npufleet_operator=debug")?;
    cmd.args([
        "--external-metrics-addr=",
        "--lease-namespace",
        RELEASE_NAMESPACE,
    ])
    .args(["--identity", IDENTITY, "--log-format", "json"]);
    let process = Process::start(
        "npufleet-operator",
        cmd,
        &c.scratch().join("npufleet-operator.log"),
    )?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    wait::until("the operator holds the leader Lease", TIMEOUT, || async {
        let lease = leases.get_opt("npufleet-operator").await?;
        let holder = lease.and_then(|l| l.spec).and_then(|s| s.holder_identity);
        Ok((holder.as_deref() == Some(IDENTITY)).then_some(()))
    })
    .await?;
    Ok(Operator {
        metrics_port,
        _process: process,
    })
}

/// The operator shared by the tests of this file: one leader, whatever test runs first.
fn operator() -> &'static Operator {
    static OPERATOR: OnceLock<Operator> = OnceLock::new();
    OPERATOR.get_or_init(|| {
        let c = cluster::shared();
        let result = runtime::block_on_own_thread(start_operator(c));
        c.diagnose(result)
            .expect("operator starts under the chart's RBAC")
    })
}

fn operator_log() -> String {
    let path = cluster::shared().scratch().join("npufleet-operator.log");
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .rev()
        .take(30)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect::<Vec<_>>()
        .join("\n")
}

async fn get_pod(pods: &Api<Pod>, name: &str) -> Result<Option<Pod>> {
    Ok(pods.get_opt(name).await?)
}

fn env_of(pod: &Pod) -> Vec<(String, String)> {
    let container = &pod.spec.as_ref().expect("spec").containers[0];
    container
        .env
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|e| {
            let value = e.value.unwrap_or_else(|| {
                e.value_from
                    .and_then(|v| v.field_ref)
                    .map(|f| format!("fieldRef:{}", f.field_path))
                    .unwrap_or_default()
            });
            (e.name, value)
        })
        .collect()
}

fn env_value(pod: &Pod, name: &str) -> Option<String> {
    env_of(pod)
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v)
}

fn limit(pod: &Pod, resource: &str) -> Option<String> {
    let container = &pod.spec.as_ref()?.containers[0];
    Some(
        container
            .resources
            .as_ref()?
            .limits
            .as_ref()?
            .get(resource)?
            .0
            .clone(),
    )
}

async fn condition(
    api: &Api<DynamicObject>,
    name: &str,
    type_: &str,
) -> Result<Option<(String, String)>> {
    let object = api.get(name).await?;
    let found = object.data["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .map(|c| {
            (
                c["status"].as_str().unwrap_or("").to_string(),
                c["reason"].as_str().unwrap_or("").to_string(),
            )
        });
    Ok(found)
}

/// With the shared operator running, a namespace for `test` and in it InferenceService `name`
/// on Ascend 910, `devices` per pod, tensor-parallel `tensor`, created: the admin client, the
/// namespace, and its InferenceServices' API.
async fn ascend_service(
    c: &cluster::Cluster,
    test: &str,
    name: &str,
    devices: u32,
    tensor: u32,
) -> Result<(Client, String, Api<DynamicObject>)> {
    operator();
    let client = c.client().await?;
    let ns = c.namespace(&client, test).await?;
    let isvcs: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        &ns,
        &npufleet_tests::service::api_resource(),
    );
    let isvc: DynamicObject = serde_json::from_value(service::unread_json(
        None,
        name,
        json!({
            "model": {"name": format!("{name}-model")},
            "accelerator": {"type": "ascend910", "devicesPerPod": devices},
            "parallelism": {"tensor": tensor},
        }),
    ))?;
    isvcs.create(&PostParams::default(), &isvc).await?;
    Ok((client, ns, isvcs))
}

/// Waits until InferenceService `name` is Ready, told as `what`.
async fn wait_ready(isvcs: &Api<DynamicObject>, name: &str, what: &str) -> Result<()> {
    wait::until(what, TIMEOUT, || async {
        let ready = condition(isvcs, name, "Ready").await?.map(|c| c.0);
        Ok((ready.as_deref() == Some("True")).then_some(()))
    })
    .await
    .with_context(operator_log)
}

async fn rank_table(config_maps: &Api<ConfigMap>, name: &str) -> Result<Option<Value>> {
    let Some(cm) = config_maps.get_opt(name).await? else {
        return Ok(None);
    };
    let text = cm
        .data
        .and_then(|d| d.get("hccl.json").cloned())
        .context("hccl.json key")?;
    Ok(Some(serde_json::from_str(&text)?))
}

#[tokio::test]
async fn chart_installs_a_least_privilege_operator_that_leads() -> Result<()> {
    let op = operator();
    let c = cluster::shared();
    let client = c.client().await?;
    let mut lint = c.helm();
    lint.args(["lint", "--strict"])
        .arg(paths::repo_root().join("charts/npufleet"));
    let linted = run(lint)?;
    assert!(linted.contains("0 chart(s) failed"), "{linted}");
    let role = Api::<ClusterRole>::all(client.clone())
        .get("npufleet")
        .await?;
    for rule in role.rules.unwrap_or_default() {
        let resources = rule.resources.unwrap_or_default();
        assert!(
            !resources.iter().any(|r| r == "secrets" || r == "*"),
            "{resources:?}"
        );
        assert!(!rule.verbs.iter().any(|v| v == "*"), "{:?}", rule.verbs);
    }
    let crd = Api::<CustomResourceDefinition>::all(client.clone())
        .get("inferenceservices.npufleet.io")
        .await?;
    assert_eq!(
        crd.spec.names.short_names.as_deref(),
        Some(&["infsvc".to_string()][..])
    );
    let deployment = run({
        let mut k = c.kubectl();
        k.args([
            "get",
            "deployment",
            "npufleet",
            "-n",
            RELEASE_NAMESPACE,
            "-o",
            "json",
        ]);
        k
    })?;
    let deployment: Value = serde_json::from_str(&deployment)?;
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(container["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(
        deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"],
        true
    );
    assert_eq!(
        container["image"],
        "ghcr.io/npufleet/npufleet-operator:0.1.0"
    );

    let (code, _) = http_get(op.metrics_port, "/readyz").await?;
    assert_eq!(code, 200);
    let (code, _) = http_get(op.metrics_port, "/healthz").await?;
    assert_eq!(code, 200);
    let (code, _) = http_get(op.metrics_port, "/metrics").await?;
    assert_eq!(code, 200);
    Ok(())
}

#[tokio::test]
async fn samples_reconcile_into_the_documented_ascend_objects() -> Result<()> {
    let op = operator();
    let c = cluster::shared();
    let client = c.client().await?;
    let ns = c.namespace(&client, "operator-samples").await?;
    let samples = paths::repo_root().join("deploy/samples");
    run({
        let mut k = c.kubectl();
        k.args(["apply", "-n", &ns, "-f"]).arg(&samples);
        k
    })?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let isvcs: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        &ns,
        &npufleet_tests::service::api_resource(),
    );

    // DeepSeek-style 13B: two replica groups of one pod with 4 x Ascend 910, TP 4.
    let result = wait::until("every sample's pods exist", TIMEOUT, || async {
        let names = [
            "deepseek-13b-0-0",
            "deepseek-13b-1-0",
            "qwen-7b-cce-0-0",
            "qwen-7b-cce-0-1",
            "smollm2-0-0",
        ];
        for name in names {
            if get_pod(&pods, name).await?.is_none() {
                return Ok(None);
            }
        }
        Ok(Some(()))
    })
    .await;
    result.with_context(operator_log)?;

    let pod = pods.get("deepseek-13b-0-0").await?;
    let spec = pod.spec.clone().context("spec")?;
    assert_eq!(limit(&pod, "huawei.com/Ascend910").as_deref(), Some("4"));
    let requests = spec.containers[0]
        .resources
        .as_ref()
        .and_then(|r| r.requests.clone())
        .context("requests")?;
    assert_eq!(
        requests["huawei.com/Ascend910"].0, "4",
        "extended resources: requests equal limits"
    );
    let selector = spec.node_selector.clone().context("node selector")?;
    assert_eq!(selector["accelerator"], "huawei-Ascend910");
    assert_eq!(selector["node.kubernetes.io/npu.chip.name"], "910B3");
    for (name, value) in [
        ("HCCL_IF_IP", "fieldRef:status.podIP"),
        ("HCCL_CONNECT_TIMEOUT", "600"),
        (
            "RANK_TABLE_FILE",
            "/user/serverid/devindex/config/hccl.json",
        ),
        ("NPUFLEET_MODEL", "/models/deepseek-13b-chat"),
        ("NPUFLEET_SERVED_MODEL_NAME", "deepseek-13b-chat"),
        (
            "NPUFLEET_PREFIX_TEMPLATES",
            r#"["You are a helpful assistant."]"#,
        ),
    ] {
        assert_eq!(env_value(&pod, name).as_deref(), Some(value), "{name}");
    }
    assert_eq!(
        spec.containers[0].args.as_deref(),
        Some(&["serve".to_string()][..])
    );
    let mount = spec.containers[0]
        .volume_mounts
        .clone()
        .unwrap_or_default()
        .into_iter()
        .find(|m| m.name == "rank-table")
        .context("rank-table mount")?;
    assert_eq!(mount.mount_path, "/user/serverid/devindex/config");
    let owner = &pod.owner_references()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str(), owner.controller),
        ("InferenceService", "deepseek-13b", Some(true))
    );
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let table = rank_table(&config_maps, "rings-config-deepseek-13b-0")
        .await?
        .context("rank table")?;
    assert_eq!(table["version"], "1.0");
    assert_eq!(
        table["status"], "initializing",
        "its PVC does not exist, so the pod never gets an IP"
    );

    let services: Api<Service> = Api::namespaced(client.clone(), &ns);
    let client_svc = services.get("deepseek-13b").await?.spec.context("spec")?;
    let ports: Vec<(String, i32)> = client_svc
        .ports
        .unwrap_or_default()
        .into_iter()
        .map(|p| (p.name.unwrap_or_default(), p.port))
        .collect();
    assert_eq!(
        ports,
        [("http".to_string(), 8000), ("grpc".to_string(), 8001)]
    );
    let headless = services
        .get("deepseek-13b-ranks")
        .await?
        .spec
        .context("spec")?;
    assert_eq!(headless.cluster_ip.as_deref(), Some("None"));
    assert_eq!(headless.publish_not_ready_addresses, Some(true));
    let pdb = Api::<PodDisruptionBudget>::namespaced(client.clone(), &ns)
        .get("deepseek-13b")
        .await?;
    // Two groups of one pod, one group of them allowed out: a budget of whole pods, as the
    // disruption controller would otherwise count groups through the scale subresource.
    assert_eq!(
        pdb.spec.and_then(|s| s.min_available),
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(1))
    );

    // CCE: one TP-4 group of two pods with 2 x ascend-1980, gang-scheduled by Volcano.
    for rank in 0..2 {
        let pod = pods.get(&format!("qwen-7b-cce-0-{rank}")).await?;
        assert_eq!(limit(&pod, "huawei.com/ascend-1980").as_deref(), Some("2"));
        let spec = pod.spec.clone().context("spec")?;
        assert_eq!(spec.scheduler_name.as_deref(), Some("volcano"));
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        assert_eq!(
            pod.annotations()["scheduling.k8s.io/group-name"],
            "qwen-7b-cce-0"
        );
        assert_eq!(pod.annotations()["hccl/rankIndex"], rank.to_string());
        assert_eq!(
            env_value(&pod, "HCCL_ALGO").as_deref(),
            Some("level0:NA;level1:ring")
        );
        assert_eq!(
            env_value(&pod, "HCCL_SOCKET_IFNAME").as_deref(),
            Some("eth0")
        );
    }
    let pod_groups: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &ns, &pod_group_resource());
    let group = pod_groups.get("qwen-7b-cce-0").await?;
    assert_eq!(group.data["spec"]["minMember"], 2);
    assert_eq!(
        group.data["spec"]["minResources"]["huawei.com/ascend-1980"],
        "4"
    );

    // CPU: no accelerator, no rank table; KWOK runs it, so it becomes Ready.
    let pod = pods.get("smollm2-0-0").await?;
    assert!(limit(&pod, "huawei.com/Ascend910").is_none());
    assert!(env_value(&pod, "RANK_TABLE_FILE").is_none());
    assert_eq!(
        env_value(&pod, "NPUFLEET_MODEL").as_deref(),
        Some("/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    );
    wait_ready(&isvcs, "smollm2", "smollm2 Ready").await?;
    let smollm2 = isvcs.get("smollm2").await?;
    assert_eq!(smollm2.data["status"]["readyReplicas"], 1);
    assert_eq!(
        smollm2.data["status"]["selector"],
        "npufleet.io/inference-service=smollm2,npufleet.io/rank=0"
    );
    assert_eq!(smollm2.data["status"]["modelState"], "Loaded");
    assert_eq!(
        smollm2.data["status"]["endpoints"]["grpc"],
        format!("smollm2.{ns}.svc.cluster.local:8001")
    );

    // The scale subresource reads the same counts an HPA would.
    let scale: Value = serde_json::from_str(&run({
        let mut k = c.kubectl();
        k.args([
            "get",
            "--raw",
            &format!("/apis/npufleet.io/v1alpha1/namespaces/{ns}/inferenceservices/smollm2/scale"),
        ]);
        k
    })?)?;
    assert_eq!(scale["status"]["replicas"], 1);
    assert_eq!(
        scale["status"]["selector"],
        "npufleet.io/inference-service=smollm2,npufleet.io/rank=0"
    );

    let (_, metrics) = http_get(op.metrics_port, "/metrics").await?;
    assert!(
        metrics.contains("npufleet_operator_reconciliations_total"),
        "{metrics}"
    );
    Ok(())
}

#[tokio::test]
async fn a_failed_rank_degrades_the_service_and_its_group_is_recreated() -> Result<()> {
    let c = cluster::shared();
    let (client, ns, isvcs) = ascend_service(c, "operator-recreate", "tp", 2, 4).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    wait_ready(&isvcs, "tp", "tp Ready").await?;
    assert_eq!(
        condition(&isvcs, "tp", "RankTableReady")
            .await?
            .map(|c| c.0)
            .as_deref(),
        Some("True")
    );
    let first: Vec<Pod> = vec![pods.get("tp-0-0").await?, pods.get("tp-0-1").await?];
    let table = rank_table(&config_maps, "rings-config-tp-0")
        .await?
        .context("rank table")?;
    assert_eq!(table["status"], "completed");
    assert_eq!(table["server_count"], "2");
    for (rank, pod) in first.iter().enumerate() {
        let ip = pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.clone())
            .context("pod IP")?;
        let server = &table["server_list"][rank];
        assert_eq!(server["container_ip"], ip.as_str());
        let ids: Vec<&str> = server["device"]
            .as_array()
            .context("devices")?
            .iter()
            .map(|d| d["rank_id"].as_str().unwrap_or(""))
            .collect();
        assert_eq!(ids, [(2 * rank).to_string(), (2 * rank + 1).to_string()]);
    }

    // The device plugin's allocation record replaces the defaults.
    let allocation = json!({"pod_name": "tp-0-1", "server_id": "10.0.0.12", "host_ip": "10.0.0.12", "super_pod_id": "-1",
        "devices": [{"device_id": "4", "device_ip": "192.168.101.5"}, {"device_id": "5", "device_ip": "192.168.101.6"}]});
    let annotate = json!({"metadata": {"annotations": {"ascend.kubectl.kubernetes.io/ascend-910-configuration": allocation.to_string()}}});
    pods.patch("tp-0-1", &PatchParams::default(), &Patch::Merge(&annotate))
        .await?;
    wait::until("rank table uses the device plugin's devices", TIMEOUT, || async {
        let table = rank_table(&config_maps, "rings-config-tp-0").await?.context("rank table")?;
        let expected = json!({"server_id": "10.0.0.12", "host_ip": "10.0.0.12", "container_ip": first[1].status.as_ref().and_then(|s| s.pod_ip.clone()),
            "device": [{"device_id": "4", "device_ip": "192.168.101.5", "rank_id": "2"}, {"device_id": "5", "device_ip": "192.168.101.6", "rank_id": "3"}]});
        Ok((table["server_list"][1] == expected).then_some(()))
    })
    .await
    .with_context(operator_log)?;

    // Rank 1 fails: the service degrades and the whole group is recreated. The recreated group
    // can be ready again before a poll would see Degraded, so every version of the object is
    // watched from here on.
    let degraded_seen = Arc::new(AtomicBool::new(false));
    let (listed_tx, listed_rx) = tokio::sync::oneshot::channel();
    let watch = tokio::spawn({
        let seen = degraded_seen.clone();
        let stream = watcher::watcher(
            isvcs.clone(),
            watcher::Config::default().fields("metadata.name=tp"),
        );
        async move {
            let mut stream = std::pin::pin!(stream);
            let mut listed = Some(listed_tx);
            while let Some(Ok(event)) = stream.next().await {
                let object = match event {
                    watcher::Event::Apply(o) | watcher::Event::InitApply(o) => o,
                    watcher::Event::InitDone => {
                        if let Some(tx) = listed.take() {
                            tx.send(()).ok();
                        }
                        continue;
                    }
                    _ => continue,
                };
                let degraded = object.data["status"]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| {
                        c["type"] == "Degraded"
                            && c["status"] == "True"
                            && c["reason"] == "RankFailed"
                    });
                if degraded {
                    seen.store(true, Ordering::Relaxed);
                }
            }
        }
    });
    tokio::time::timeout(TIMEOUT, listed_rx)
        .await
        .context("the watch did not start")??;
    let failed =
        json!({"status": {"phase": "Failed", "reason": "Error", "message": "HCCL timeout"}});
    pods.patch_status("tp-0-1", &PatchParams::default(), &Patch::Merge(&failed))
        .await?;
    wait::until("tp Degraded", TIMEOUT, || async {
        Ok(degraded_seen.load(Ordering::Relaxed).then_some(()))
    })
    .await
    .with_context(operator_log)?;
    watch.abort();
    let old_uids: Vec<String> = first.iter().filter_map(|p| p.uid()).collect();
    wait::until("group recreated and Ready again", TIMEOUT, || async {
        for name in ["tp-0-0", "tp-0-1"] {
            match get_pod(&pods, name).await? {
                Some(p) if !old_uids.contains(&p.uid().unwrap_or_default()) => {}
                _ => return Ok(None),
            }
        }
        let ready = condition(&isvcs, "tp", "Ready").await?.map(|c| c.0);
        let degraded = condition(&isvcs, "tp", "Degraded").await?.map(|c| c.0);
        Ok(
            (ready.as_deref() == Some("True") && degraded.as_deref() == Some("False"))
                .then_some(()),
        )
    })
    .await
    .with_context(operator_log)?;
    let status = isvcs.get("tp").await?.data["status"].clone();
    assert!(
        status["lastFailure"]
            .as_str()
            .unwrap_or("")
            .contains("HCCL timeout"),
        "{status}"
    );
    let events = run({
        let mut k = c.kubectl();
        k.args(["get", "events.events.k8s.io", "-n", &ns, "-o", "json"]);
        k
    })?;
    assert!(events.contains("GroupRecreating"), "{events}");
    let pods_now = pods
        .list(&ListParams::default().labels("npufleet.io/inference-service=tp"))
        .await?;
    assert_eq!(pods_now.items.len(), 2);
    Ok(())
}

/// With the Gateway API Inference Extension installed (its real CRD), an InferenceService that
/// names an endpoint picker gets an InferencePool of its serving pods, which the CRD's own
/// schema accepts, under the chart's RBAC; naming none takes the pool away.
#[tokio::test]
async fn an_endpoint_picker_gets_an_inference_pool_of_the_serving_pods() -> Result<()> {
    let _op = operator();
    let c = cluster::shared();
    let client = c.client().await?;
    let ns = c.namespace(&client, "operator-inference-pool").await?;
    let isvcs: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        &ns,
        &npufleet_tests::service::api_resource(),
    );
    let pool_resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("inference.networking.k8s.io", "v1", "InferencePool"),
        "inferencepools",
    );
    let pools: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &pool_resource);
    let service: DynamicObject = serde_json::from_value(service::manifest_json(
        Some(&ns),
        "qwen2.5-0.5b",
        json!({
            "model": {"name": "qwen", "source": {"imagePath": "/models/qwen.gguf"}},
            "accelerator": {"type": "cpu"},
            "routing": {"endpointPicker": {"service": "qwen-epp"}},
        }),
    ))?;
    isvcs
        .patch(
            "qwen2.5-0.5b",
            &PatchParams::apply("inference-pool-test").force(),
            &Patch::Apply(&service),
        )
        .await?;

    let pool = wait::until("the InferencePool", TIMEOUT, || async {
        Ok(pools.get_opt("qwen2.5-0.5b").await?)
    })
    .await
    .with_context(operator_log)?;
    assert_eq!(
        pool.data["spec"]["selector"]["matchLabels"]["npufleet.io/rank"], "0",
        "{pool:?}"
    );
    assert_eq!(
        pool.data["spec"]["selector"]["matchLabels"]["npufleet.io/inference-service"],
        "qwen2.5-0.5b"
    );
    assert_eq!(
        pool.data["spec"]["targetPorts"],
        json!([{"number": npufleet_contract::ports::HTTP_PORT}])
    );
    assert_eq!(pool.data["spec"]["endpointPickerRef"]["name"], "qwen-epp");
    assert_eq!(
        pool.data["spec"]["endpointPickerRef"]["port"]["number"],
        9002
    );
    let owner = pool.owner_references().first().context("an owner")?;
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str()),
        ("InferenceService", "qwen2.5-0.5b")
    );
    wait::until("status.inferencePool", TIMEOUT, || async {
        let isvc = isvcs.get("qwen2.5-0.5b").await?;
        Ok((isvc.data["status"]["inferencePool"] == "qwen2.5-0.5b").then_some(()))
    })
    .await?;

    isvcs
        .patch(
            "qwen2.5-0.5b",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"routing": {"endpointPicker": null}}})),
        )
        .await?;
    wait::until("the InferencePool deleted", TIMEOUT, || async {
        let gone = pools.get_opt("qwen2.5-0.5b").await?.is_none();
        let isvc = isvcs.get("qwen2.5-0.5b").await?;
        Ok((gone && isvc.data["status"]["inferencePool"].is_null()).then_some(()))
    })
    .await
    .with_context(operator_log)?;
    Ok(())
}

/// Pods that come and go faster than the controller reads (a large service deleted, a node's
/// pods evicted) once left the operator's stores waiting forever on a reader nothing would
/// wake: every later change went unseen until a restart. After a burst of thousands of pod
/// events the operator must still see and repair a lost pod within seconds.
#[tokio::test]
async fn after_a_burst_of_pod_events_a_deleted_pod_is_still_recreated() -> Result<()> {
    const BURST_PODS: usize = 1500;
    const CLIENTS: usize = 16;
    let (client, ns, isvcs) =
        ascend_service(cluster::shared(), "operator-burst", "tp2", 1, 2).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    wait_ready(&isvcs, "tp2", "tp2 Ready").await?;

    // Each pod carries the label the operator watches and is deleted as soon as it exists
    // (never scheduled, so at once): the watch delivers each creation and deletion together.
    let started = std::time::Instant::now();
    let burst = futures::stream::iter(0..BURST_PODS)
        .map(|i| {
            let pods = pods.clone();
            async move {
                let pod: Pod = serde_json::from_value(json!({
                    "metadata": {
                        "name": format!("burst-{i}"),
                        "labels": {"app.kubernetes.io/managed-by": "npufleet-operator"},
                    },
                    "spec": {
                        "schedulerName": "nobody-schedules-these",
                        "containers": [{"name": "c", "image": "burst"}],
                    }
                }))?;
                pods.create(&PostParams::default(), &pod).await?;
                pods.delete(&format!("burst-{i}"), &Default::default())
                    .await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(CLIENTS)
        .collect::<Vec<_>>()
        .await;
    for result in burst {
        result?;
    }
    eprintln!(
        "{} pod events in {:.1} s",
        2 * BURST_PODS,
        started.elapsed().as_secs_f64()
    );

    let old = pods.get("tp2-0-1").await?.uid();
    pods.delete("tp2-0-1", &Default::default()).await?;
    wait::until(
        "tp2-0-1 recreated after the burst",
        Duration::from_secs(30),
        || async {
            Ok(get_pod(&pods, "tp2-0-1")
                .await?
                .filter(|p| p.uid() != old)
                .map(|_| ()))
        },
    )
    .await
    .with_context(operator_log)?;
    wait_ready(&isvcs, "tp2", "tp2 Ready again").await?;
    Ok(())
}

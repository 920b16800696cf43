//! The operator under large changes, on the real control plane with KWOK's nodes: a service of
//! many groups shows its progress while it is made, and `kubectl drain` of a node running
//! tensor-parallel groups (the drain evicts one rank, the disruption budget refuses the rest,
//! and the evicted rank's peer must leave with it) makes each group again exactly once, on the
//! node left; none of the replacements is evicted by the drain's retries.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use npufleet_crds::InferenceService;
use npufleet_tests::operator::OperatedNamespace;
use npufleet_tests::service::unread as service;
use npufleet_tests::{cluster, wait};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(120);
const MANAGER: &str = "operator-drain-test";

fn kubectl(c: &cluster::Cluster, args: &[&str]) -> Result<String> {
    let mut cmd = c.kubectl();
    cmd.args(args);
    let out = cmd.output()?;
    if !out.status.success() {
        bail!(
            "kubectl {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

async fn ready_groups(services: &Api<InferenceService>, name: &str) -> Result<Option<i32>> {
    let service = services.get(name).await?;
    let status = service.status.unwrap_or_default();
    let ready = status
        .conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    Ok(ready.then_some(status.ready_replicas))
}

/// Every pod UID seen under each pod name, from a watch started before anything happens.
async fn record_incarnations(
    pods: Api<Pod>,
) -> Result<(
    Arc<Mutex<BTreeMap<String, BTreeSet<String>>>>,
    tokio::task::JoinHandle<()>,
)> {
    let seen: Arc<Mutex<BTreeMap<String, BTreeSet<String>>>> = Arc::default();
    let (listed_tx, listed_rx) = tokio::sync::oneshot::channel();
    let task = tokio::spawn({
        let seen = seen.clone();
        async move {
            let mut listed = Some(listed_tx);
            let mut stream = std::pin::pin!(watcher::watcher(pods, watcher::Config::default()));
            while let Some(Ok(event)) = stream.next().await {
                match event {
                    watcher::Event::Apply(pod) | watcher::Event::InitApply(pod) => {
                        if let (Ok(mut seen), Some(uid)) = (seen.lock(), pod.uid()) {
                            seen.entry(pod.name_any()).or_default().insert(uid);
                        }
                    }
                    watcher::Event::InitDone => {
                        if let Some(tx) = listed.take() {
                            tx.send(()).ok();
                        }
                    }
                    _ => {}
                }
            }
        }
    });
    tokio::time::timeout(TIMEOUT, listed_rx)
        .await
        .context("the pod watch did not start")??;
    Ok((seen, task))
}

async fn nodes_of(pods: &Api<Pod>) -> Result<BTreeMap<String, String>> {
    Ok(pods
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .map(|p| {
            let node = p.spec.and_then(|s| s.node_name).unwrap_or_default();
            (p.metadata.name.unwrap_or_default(), node)
        })
        .collect())
}

/// A service of 150 single-pod groups is made in batches, and its status counts them meanwhile.
async fn a_large_service_shows_its_progress(client: &Client, ns: &str) -> Result<()> {
    let services: Api<InferenceService> = Api::namespaced(client.clone(), ns);
    let wide = service(
        ns,
        "wide",
        json!({
            "model": {"name": "wide-model"},
            "replicas": 150,
        }),
    )?;
    services.create(&PostParams::default(), &wide).await?;
    let message = wait::until("wide Progressing with CreatingGroups", TIMEOUT, || async {
        let status = services.get("wide").await?.status.unwrap_or_default();
        Ok(status
            .conditions
            .into_iter()
            .find(|c| c.type_ == "Progressing" && c.reason == "CreatingGroups")
            .map(|c| c.message))
    })
    .await?;
    assert!(
        message.contains(" of 150 replica groups created, "),
        "{message}"
    );
    services.delete("wide", &Default::default()).await?;
    Ok(())
}

/// One test: the operator runs in this process and watches every namespace, so a second one
/// beside it would fight it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_services_show_progress_and_a_drain_recreates_each_group_once() -> Result<()> {
    let c = cluster::shared();
    let client: Client = c.client().await?;
    let operated = OperatedNamespace::start(c, &client, "operator-drain", MANAGER).await?;
    let ns = operated.namespace.clone();
    let wide = c.namespace(&client, "operator-wide").await?;
    a_large_service_shows_its_progress(&client, &wide).await?;
    let pods = operated.pods.clone();
    let (incarnations, recorder) = record_incarnations(pods.clone()).await?;

    // Every pod starts on ascend-node-0, the node to drain.
    kubectl(c, &["cordon", "ascend-node-1"])?;
    let services = &operated.services;
    let tp2 = service(
        &ns,
        "tp2",
        json!({
            "model": {"name": "tp2-model"},
            "replicas": 2,
            "accelerator": {"type": "ascend910", "devicesPerPod": 1},
            "parallelism": {"tensor": 2},
        }),
    )?;
    services.create(&PostParams::default(), &tp2).await?;
    wait::until("tp2 Ready with 2 groups", TIMEOUT, || async {
        Ok(ready_groups(services, "tp2").await?.filter(|&n| n == 2))
    })
    .await?;
    let before = nodes_of(&pods).await?;
    assert!(
        before.len() == 4 && before.values().all(|n| n == "ascend-node-0"),
        "{before:?}"
    );
    kubectl(c, &["uncordon", "ascend-node-1"])?;

    let drain = tokio::task::spawn_blocking({
        move || {
            kubectl(
                c,
                &[
                    "drain",
                    "ascend-node-0",
                    "--pod-selector=npufleet.io/inference-service=tp2",
                    "--delete-emptydir-data",
                    "--ignore-daemonsets",
                    "--timeout=150s",
                ],
            )
        }
    });
    let drained = drain.await??;
    eprintln!("{drained}");
    wait::until("tp2 Ready again on ascend-node-1", TIMEOUT, || async {
        let ready = ready_groups(services, "tp2").await?.filter(|&n| n == 2);
        let nodes = nodes_of(&pods).await?;
        let moved = nodes.len() == 4 && nodes.values().all(|n| n == "ascend-node-1");
        Ok(ready.filter(|_| moved))
    })
    .await?;
    recorder.abort();
    let incarnations = incarnations.lock().expect("watch task ended").clone();
    for (name, uids) in &incarnations {
        assert_eq!(
            uids.len(),
            2,
            "pod {name} was made {} times (once, then once on the node left): {incarnations:?}",
            uids.len()
        );
    }
    assert_eq!(incarnations.len(), 4, "{incarnations:?}");
    Ok(())
}

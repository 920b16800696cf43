//! Rollouts and placement on the real control plane (kube-apiserver, etcd, kube-scheduler,
//! kube-controller-manager and KWOK nodes), with the operator's controller in this process:
//! - a one-replica service whose spec changes gets a surge group that is Ready before the old
//!   group is deleted, so it never stops serving;
//! - the ranks of a tensor-parallel group land on one server, groups on different servers, and
//!   CPU workers stay off NPU servers, as placed by kube-scheduler.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use kube::runtime::watcher;
use npufleet_contract::pods;
use npufleet_crds::{InferenceService, NODE_LABEL_ACCELERATOR};
use npufleet_operator::labels;
use npufleet_operator::resources::pod::SERVER_TOPOLOGY_KEY;
use npufleet_tests::cluster::FakeNode;
use npufleet_tests::operator::OperatedNamespace;
use npufleet_tests::service::unread;
use npufleet_tests::{operator, wait};
use serde_json::json;

const MANAGER: &str = "operator-rollout-topology-test";
const TIMEOUT: Duration = Duration::from_secs(30);

/// Each test runs its own controller, and a controller reconciles every namespace: one test at
/// a time, so no two controllers act on the same service.
static ONE_CONTROLLER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn ready_condition(service: &InferenceService) -> Option<&str> {
    service
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .map(|c| c.status.as_str())
}

fn template_hash(pod: &Pod) -> Option<String> {
    pod.labels().get(labels::TEMPLATE_HASH).cloned()
}

/// A pod watch event, stamped when it arrived.
struct Seen {
    at: Instant,
    event: watcher::Event<Pod>,
}

/// Every event of the pods of `service`, in the order the apiserver sent them, until
/// dropped. Returns once the initial list is in, so later changes are all seen.
struct PodEvents {
    rx: tokio::sync::mpsc::UnboundedReceiver<Seen>,
    task: tokio::task::JoinHandle<()>,
}

impl PodEvents {
    async fn start(pods: &Api<Pod>, service: &str) -> Result<Self> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let (listed_tx, listed_rx) = tokio::sync::oneshot::channel();
        let config =
            watcher::Config::default().labels(&format!("{}={service}", labels::INFERENCE_SERVICE));
        let stream = watcher::watcher(pods.clone(), config);
        let task = tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            let mut listed = Some(listed_tx);
            while let Some(event) = stream.next().await {
                let Ok(event) = event else { continue };
                let init_done = matches!(event, watcher::Event::InitDone);
                if tx
                    .send(Seen {
                        at: Instant::now(),
                        event,
                    })
                    .is_err()
                {
                    return;
                }
                if let Some(listed) = listed.take_if(|_| init_done) {
                    listed.send(()).ok();
                }
            }
        });
        let events = Self { rx, task };
        tokio::time::timeout(TIMEOUT, listed_rx)
            .await
            .context("the pod watch did not list")?
            .context("the pod watch ended before listing")?;
        Ok(events)
    }

    fn take(&mut self) -> Vec<Seen> {
        let mut seen = Vec::new();
        while let Ok(s) = self.rx.try_recv() {
            seen.push(s);
        }
        seen
    }
}

impl Drop for PodEvents {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The pods as the watch knew them after one event, and when it arrived.
struct Snapshot {
    at: Instant,
    pods: BTreeMap<String, Pod>,
}

impl Snapshot {
    fn live(&self) -> impl Iterator<Item = &Pod> {
        self.pods
            .values()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
    }

    fn serving(&self) -> usize {
        self.live().filter(|p| pods::serves(p)).count()
    }
}

/// Replays the watch into the state after each event. A relist (after a dropped watch)
/// rebuilds the state, and no snapshot is taken while it is half built.
fn replay(events: &[Seen]) -> Vec<Snapshot> {
    let mut pods: BTreeMap<String, Pod> = BTreeMap::new();
    let mut relisting: Option<BTreeMap<String, Pod>> = None;
    let mut snapshots = Vec::new();
    for &Seen { at, ref event } in events {
        match event.clone() {
            watcher::Event::Init => {
                relisting = Some(BTreeMap::new());
                continue;
            }
            watcher::Event::InitApply(pod) => {
                relisting
                    .get_or_insert_with(BTreeMap::new)
                    .insert(pod.uid().unwrap_or_default(), pod);
                continue;
            }
            watcher::Event::InitDone => pods = relisting.take().unwrap_or_default(),
            watcher::Event::Apply(pod) => {
                pods.insert(pod.uid().unwrap_or_default(), pod);
            }
            watcher::Event::Delete(pod) => {
                pods.remove(&pod.uid().unwrap_or_default());
            }
        }
        snapshots.push(Snapshot {
            at,
            pods: pods.clone(),
        });
    }
    snapshots
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_of_a_one_replica_service_keeps_it_serving() -> Result<()> {
    let _one = ONE_CONTROLLER.lock().await;
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let operated = OperatedNamespace::start(c, &client, "rollout-one-replica", MANAGER).await?;
        let OperatedNamespace { namespace: ns, services, pods, .. } = &operated;

        // Default rollout settings: the surge group is what keeps one replica serving.
        let spec = |revision: &str| {
            json!({
                "replicas": 1,
                "template": {"env": [{"name": "REVISION", "value": revision}]},
            })
        };
        operator::apply(services, MANAGER, &unread(ns, "chat", spec("1"))?).await?;
        let old = wait::until("chat Ready on its first spec", TIMEOUT, || async {
            let service = services.get("chat").await?;
            let list = pods.list(&ListParams::default()).await?.items;
            match (ready_condition(&service), list.as_slice()) {
                (Some("True"), [pod]) if pods::serves(pod) => Ok(Some(pod.clone())),
                (ready, list) => bail!("Ready {ready:?}, {} pods", list.len()),
            }
        })
        .await?;
        let old_uid = old.uid().context("uid")?;
        let old_hash = template_hash(&old).context("template hash")?;

        let mut watch = PodEvents::start(pods, "chat").await?;
        let changed = Instant::now();
        operator::apply(services, MANAGER, &unread(ns, "chat", spec("2"))?).await?;
        let generation = services
            .get("chat")
            .await?
            .metadata
            .generation
            .context("generation")?;

        let new = wait::until("the rollout to finish", Duration::from_secs(45), || async {
            let service = services.get("chat").await?;
            let observed = service.status.as_ref().and_then(|s| s.observed_generation);
            let list = pods.list(&ListParams::default()).await?.items;
            match (ready_condition(&service), observed, list.as_slice()) {
                (Some("True"), Some(g), [pod])
                    if g == generation
                        && pod.uid().as_deref() != Some(old_uid.as_str())
                        && pod.metadata.deletion_timestamp.is_none()
                        && pods::serves(pod) =>
                {
                    Ok(Some(pod.clone()))
                }
                (ready, observed, list) => bail!(
                    "Ready {ready:?}, observedGeneration {observed:?} of {generation}, pods {:?}",
                    list.iter().map(|p| p.name_any()).collect::<Vec<_>>()
                ),
            }
        })
        .await?;
        let new_hash = template_hash(&new).context("template hash")?;
        ensure!(new_hash != old_hash, "the new pod carries the old template hash {old_hash}");

        // The watch has delivered the final state once it shows the old pod gone and the new
        // one Ready; everything before that is the rollout as it happened.
        let mut seen = Vec::new();
        wait::until("the watch to catch up", TIMEOUT, || {
            seen.extend(watch.take());
            let done = replay(&seen)
                .last()
                .is_some_and(|s| !s.pods.contains_key(&old_uid) && s.serving() == 1);
            async move { Ok(done.then_some(())) }
        })
        .await?;
        drop(watch);
        let snapshots = replay(&seen);

        let new_ready = snapshots
            .iter()
            .position(|s| s.live().any(|p| template_hash(p).as_deref() == Some(&new_hash) && pods::serves(p)))
            .context("the new pod never showed Ready in the watch")?;
        let old_terminating = snapshots
            .iter()
            .position(|s| {
                s.pods
                    .get(&old_uid)
                    .is_none_or(|p| p.metadata.deletion_timestamp.is_some())
            })
            .context("the old pod never showed terminating in the watch")?;
        let old_gone = snapshots
            .iter()
            .position(|s| !s.pods.contains_key(&old_uid))
            .context("the old pod never showed deleted in the watch")?;
        let least_serving = snapshots.iter().map(Snapshot::serving).min().unwrap_or(0);
        let most_live = snapshots.iter().map(|s| s.live().count()).max().unwrap_or(0);
        let since = |i: usize| snapshots[i].at.duration_since(changed).as_secs_f64();
        eprintln!(
            "one-replica rollout over {} pod events: new pod Ready after {:.2} s, old pod terminating after {:.2} s, deleted after {:.2} s; serving pods never below {least_serving}, at most {most_live} live",
            snapshots.len(),
            since(new_ready),
            since(old_terminating),
            since(old_gone),
        );
        ensure!(
            new_ready < old_terminating,
            "the old pod was terminating (event {old_terminating}) before a pod of the new spec was Ready (event {new_ready})"
        );
        ensure!(least_serving >= 1, "at some instant no pod of the service was Ready and not terminating");
        ensure!(most_live <= 2, "{most_live} live pods at once: more than replicas + maxSurge");

        let rolled = wait::until("the RollingGroup event", TIMEOUT, || async {
            let found: Vec<(String, String)> =
                npufleet_tests::operator::events(&client, ns, "chat", "RollingGroup")
                    .await?
                    .into_iter()
                    .map(|e| {
                        (
                            e.related.and_then(|r| r.name).unwrap_or_default(),
                            e.note.unwrap_or_default(),
                        )
                    })
                    .collect();
            Ok((!found.is_empty()).then_some(found))
        })
        .await?;
        ensure!(
            rolled
                .iter()
                .any(|(related, note)| related == &old.name_any() && note.contains("replica group 0")),
            "no RollingGroup event names group 0 and pod {}: {rolled:?}",
            old.name_any()
        );
        Ok(())
    })
    .await
    .context("the one-replica rollout test")
}

/// The server (the node's `SERVER_TOPOLOGY_KEY` label) each pod of `service` was bound to,
/// by pod name, once every one of `count` pods is bound.
async fn placements(
    pods: &Api<Pod>,
    nodes: &Api<Node>,
    service: &str,
    count: usize,
) -> Result<BTreeMap<String, String>> {
    let selector = format!("{}={service}", labels::INFERENCE_SERVICE);
    let bound = wait::until(
        &format!("{count} pods of {service} bound"),
        TIMEOUT,
        || async {
            let list = pods
                .list(&ListParams::default().labels(&selector))
                .await?
                .items;
            let bound: BTreeMap<String, String> = list
                .iter()
                .filter_map(|p| Some((p.name_any(), p.spec.as_ref()?.node_name.clone()?)))
                .collect();
            ensure!(
                bound.len() == count && list.len() == count,
                "{} pods, bound: {bound:?}",
                list.len()
            );
            Ok(Some(bound))
        },
    )
    .await?;
    let mut servers = BTreeMap::new();
    for (pod, node) in bound {
        let node = nodes.get(&node).await?;
        let server = node
            .labels()
            .get(SERVER_TOPOLOGY_KEY)
            .with_context(|| {
                format!(
                    "node {} has no {SERVER_TOPOLOGY_KEY} label",
                    node.name_any()
                )
            })?
            .clone();
        servers.insert(pod, server);
    }
    Ok(servers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_of_a_group_share_a_server_and_groups_spread() -> Result<()> {
    let _one = ONE_CONTROLLER.lock().await;
    npufleet_tests::on_shared_cluster(|c, client| async move {
        // The shared cluster has two Ascend 910 servers; a third gives the scheduler a real
        // choice for every rank.
        c.add_fake_node(&client, &FakeNode::ascend910("ascend-node-2"))
            .await?;
        let operated = OperatedNamespace::start(c, &client, "placement", MANAGER).await?;
        let OperatedNamespace {
            namespace: ns,
            services,
            pods,
            ..
        } = &operated;
        let nodes: Api<Node> = Api::all(client.clone());

        // Two pods of 2 NPUs per group: two groups would fit on one 8-NPU server, so where
        // they go is placement policy, not capacity.
        let tp = unread(
            ns,
            "tp",
            json!({
                "replicas": 2,
                "accelerator": {"type": "ascend910", "devicesPerPod": 2},
                "parallelism": {"tensor": 4},
            }),
        )?;
        let cpu = unread(ns, "cpu", json!({"replicas": 3}))?;
        operator::apply(services, MANAGER, &tp).await?;
        operator::apply(services, MANAGER, &cpu).await?;

        let tp_servers = placements(pods, &nodes, "tp", 4).await?;
        let cpu_servers = placements(pods, &nodes, "cpu", 3).await?;
        let mut groups: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for pod in pods
            .list(&ListParams::default().labels(&format!("{}=tp", labels::INFERENCE_SERVICE)))
            .await?
            .items
        {
            let group = pod
                .labels()
                .get(labels::GROUP)
                .cloned()
                .context("group label")?;
            groups
                .entry(group)
                .or_default()
                .insert(tp_servers[&pod.name_any()].clone());
        }
        eprintln!("placements: tp {tp_servers:?}; cpu {cpu_servers:?}");
        ensure!(groups.len() == 2, "two groups expected: {groups:?}");
        for (group, servers) in &groups {
            ensure!(
                servers.len() == 1,
                "the ranks of group {group} are split over {servers:?}"
            );
        }
        let used: BTreeSet<&String> = groups.values().flatten().collect();
        ensure!(used.len() == 2, "both groups on one server: {groups:?}");

        for (pod, server) in &cpu_servers {
            let node = nodes.get(server).await?;
            ensure!(
                !node.labels().contains_key(NODE_LABEL_ACCELERATOR),
                "CPU pod {pod} was placed on NPU server {server}"
            );
        }

        wait::until("tp serving on both groups", TIMEOUT, || async {
            let service = services.get("tp").await?;
            let ready = service.status.as_ref().map_or(0, |s| s.ready_replicas);
            Ok((ready == 2).then_some(()))
        })
        .await?;
        Ok(())
    })
    .await
    .context("the placement test")
}

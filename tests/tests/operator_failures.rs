//! What a user sees when an InferenceService cannot run as asked, on the local control plane
//! (kube-apiserver, kube-controller-manager with its disruption controller, kube-scheduler
//! and KWOK nodes), with the operator's controller running in this process: a rejection at
//! admission, a condition in status and a Warning event naming the object and the
//! apiserver's or scheduler's own message.

use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::Client;
use kube::api::{Api, DynamicObject, EvictParams, ListParams, Patch, PatchParams, PostParams};
use npufleet_operator::metrics::Metrics;
use npufleet_operator::{Context, Settings};
use npufleet_tests::cluster::FakeNode;
use npufleet_tests::service::unread_json;
use npufleet_tests::{cluster, crd, wait};
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(45);

/// The CRD and one controller for every test of this binary, on a thread and runtime of
/// their own so they outlive each test's runtime.
fn operator() {
    static STARTED: OnceLock<()> = OnceLock::new();
    STARTED.get_or_init(|| {
        let c = cluster::shared();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let started = async {
                    let client = c.client().await?;
                    crd::install_inference_service(&client, "operator-failures-test").await?;
                    let ctx = Context::new(client, Settings::default(), Metrics::new()?, None);
                    anyhow::Ok(std::sync::Arc::new(ctx))
                }
                .await;
                match started {
                    Ok(ctx) => {
                        ready_tx.send(Ok(())).expect("test waits");
                        npufleet_operator::run(ctx).await;
                    }
                    Err(e) => ready_tx.send(Err(e)).expect("test waits"),
                }
            });
        });
        ready_rx
            .recv()
            .expect("operator thread")
            .unwrap_or_else(|e| panic!("starting the operator: {e:#}"));
    });
}

struct Fixture {
    client: Client,
    namespace: String,
    services: Api<DynamicObject>,
}

async fn fixture(test: &str) -> Result<Fixture> {
    operator();
    let c = cluster::shared();
    let client = c.client().await?;
    let namespace = c.namespace(&client, test).await?;
    let services = Api::namespaced_with(
        client.clone(),
        &namespace,
        &npufleet_tests::service::api_resource(),
    );
    Ok(Fixture {
        client,
        namespace,
        services,
    })
}

impl Fixture {
    /// Creates [`service`] `name` with `spec` in the test's namespace.
    async fn create(&self, name: &str, spec: Value) -> Result<()> {
        self.services
            .create(&PostParams::default(), &service(name, spec)?)
            .await?;
        Ok(())
    }
}

fn service(name: &str, spec: Value) -> Result<DynamicObject> {
    Ok(serde_json::from_value(unread_json(None, name, spec))?)
}

/// The condition `type_` of the service, as (status, reason, message).
async fn condition(
    services: &Api<DynamicObject>,
    name: &str,
    type_: &str,
) -> Result<Option<(String, String, String)>> {
    let object = services.get(name).await?;
    Ok(object.data["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .map(|c| {
            let text = |key: &str| c[key].as_str().unwrap_or_default().to_string();
            (text("status"), text("reason"), text("message"))
        }))
}

/// Waits until condition `type_` has `status` and `reason`, returning its message.
async fn wait_condition(
    f: &Fixture,
    name: &str,
    type_: &str,
    status: &str,
    reason: &str,
) -> Result<String> {
    let found = wait::until(
        &format!("{name} {type_}={status} ({reason})"),
        TIMEOUT,
        || async {
            let found = condition(&f.services, name, type_).await?;
            match found {
                Some((s, r, message)) if s == status && r == reason => Ok(Some(message)),
                other => bail!("{type_} is {other:?}"),
            }
        },
    )
    .await;
    cluster::shared().diagnose(found)
}

/// The events about InferenceService `name`, as (type, reason, related object name, note).
async fn events(f: &Fixture, name: &str) -> Result<Vec<(String, String, String, String)>> {
    let list = Api::<Event>::namespaced(f.client.clone(), &f.namespace)
        .list(&ListParams::default())
        .await?;
    Ok(list
        .items
        .into_iter()
        .filter(|e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                && e.regarding.as_ref().and_then(|r| r.kind.as_deref()) == Some("InferenceService")
        })
        .map(|e| {
            (
                e.type_.unwrap_or_default(),
                e.reason.unwrap_or_default(),
                e.related.and_then(|r| r.name).unwrap_or_default(),
                e.note.unwrap_or_default(),
            )
        })
        .collect())
}

async fn wait_event(
    f: &Fixture,
    name: &str,
    reason: &str,
    related: &str,
) -> Result<(String, String)> {
    wait::until(
        &format!("{reason} event about {related}"),
        TIMEOUT,
        || async {
            let found = events(f, name).await?;
            Ok(found
                .into_iter()
                .find(|(_, r, rel, _)| r == reason && rel == related)
                .map(|(type_, _, _, note)| (type_, note)))
        },
    )
    .await
}

/// Creates [`service`] `name` with `spec`, whose first pod the apiserver refuses; once the
/// service says so, its `ReplicaFailure` message and the `FailedCreate` event's type and note.
async fn refused(f: &Fixture, name: &str, spec: Value) -> Result<(String, String, String)> {
    f.create(name, spec).await?;
    let message = wait_condition(f, name, "ReplicaFailure", "True", "FailedCreate").await?;
    let (type_, note) = wait_event(f, name, "FailedCreate", &format!("{name}-0-0")).await?;
    Ok((message, type_, note))
}

#[tokio::test]
async fn a_refused_pod_shows_as_a_replica_failure_and_a_warning_event_while_the_rest_is_made()
-> Result<()> {
    let f = fixture("refused-pod").await?;
    let (message, type_, note) = refused(
        &f,
        "llm",
        json!({"scheduling": {"priorityClassName": "no-such-class"}}),
    )
    .await?;
    assert!(
        message.contains("creating Pod llm-0-0")
            && message.contains("no PriorityClass with name no-such-class was found"),
        "{message}"
    );
    assert_eq!(type_, "Warning");
    assert!(note.contains("no PriorityClass"), "{note}");
    // The reconcile went on past the refusal: the Services exist.
    let services: Api<Service> = Api::namespaced(f.client.clone(), &f.namespace);
    assert!(services.get_opt("llm").await?.is_some());
    assert!(services.get_opt("llm-ranks").await?.is_some());

    // Fixing the spec clears the condition, as a Deployment's.
    f.services
        .patch(
            "llm",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"scheduling": {"priorityClassName": null}}})),
        )
        .await?;
    wait_condition(&f, "llm", "Ready", "True", "AllReplicasReady").await?;
    assert_eq!(condition(&f.services, "llm", "ReplicaFailure").await?, None);
    Ok(())
}

#[tokio::test]
async fn a_pod_security_violation_names_the_policy_in_status() -> Result<()> {
    let f = fixture("restricted").await?;
    let namespaces: Api<Namespace> = Api::all(f.client.clone());
    let label =
        json!({"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}});
    namespaces
        .patch(&f.namespace, &PatchParams::default(), &Patch::Merge(label))
        .await?;
    let (message, _, note) = refused(
        &f,
        "cann",
        json!({"template": {
            "volumes": [{"name": "cann", "hostPath": {"path": "/usr/local/Ascend"}}],
            "volumeMounts": [{"name": "cann", "mountPath": "/usr/local/Ascend", "readOnly": true}],
        }}),
    )
    .await?;
    assert!(
        message.contains("violates PodSecurity \"restricted:latest\"")
            && message.contains("hostPath"),
        "{message}"
    );
    assert!(note.contains("hostPath"), "{note}");
    Ok(())
}

#[tokio::test]
async fn model_like_names_get_valid_object_names_and_events_name_each_group() -> Result<()> {
    let f = fixture("model-names").await?;
    for name in ["qwen2.5-0.5b", "7b-chat"] {
        f.create(name, json!({})).await?;
    }
    for name in ["qwen2.5-0.5b", "7b-chat"] {
        wait_condition(&f, name, "Ready", "True", "AllReplicasReady").await?;
    }
    let base = npufleet_operator::resources::names::base_of("qwen2.5-0.5b");
    assert!(base.starts_with("qwen2-5-0-5b-"), "{base}");
    let services: Api<Service> = Api::namespaced(f.client.clone(), &f.namespace);
    assert!(services.get_opt(&base).await?.is_some());
    let status = f.services.get("qwen2.5-0.5b").await?.data["status"].clone();
    assert_eq!(
        status["endpoints"]["grpc"],
        format!("{base}.{}.svc.cluster.local:8001", f.namespace)
    );
    let pods: Api<Pod> = Api::namespaced(f.client.clone(), &f.namespace);
    let digit = npufleet_operator::resources::names::base_of("7b-chat");
    assert!(pods.get_opt(&format!("{digit}-0-0")).await?.is_some());

    // Scaling 1 -> 3: one event per new group, each with its own message.
    f.services
        .patch(
            "qwen2.5-0.5b",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 3}})),
        )
        .await?;
    for group in 1..3 {
        let (_, note) = wait_event(
            &f,
            "qwen2.5-0.5b",
            "CreatingGroup",
            &format!("{base}-{group}-0"),
        )
        .await?;
        assert_eq!(note, format!("creating replica group {group} (1 pods)"));
    }
    Ok(())
}

#[tokio::test]
async fn pod_template_mistakes_are_rejected_at_admission_naming_the_field() -> Result<()> {
    let f = fixture("admission").await?;
    let cases = [
        (
            json!({"template": {"resources": {"limits": {"memory": "lots"}}}}),
            "spec.template.resources.limits values must be quantities",
        ),
        (
            json!({"template": {"resources": {"requests": {"cpu": "4"}, "limits": {"cpu": "2"}}}}),
            "spec.template.resources.requests must be less than or equal to spec.template.resources.limits",
        ),
        (
            json!({"template": {"imagePullPolicy": "Sometimes"}}),
            "spec.template.imagePullPolicy: Unsupported value: \"Sometimes\"",
        ),
        (
            json!({"template": {"env": [{"name": "A=B", "value": "x"}]}}),
            "spec.template.env names must be non-empty printable ASCII without '='",
        ),
        (
            json!({"scheduling": {"nodeSelector": {"bad key!": "x"}}}),
            "spec.scheduling.nodeSelector keys must be label keys",
        ),
        (
            json!({"model": {"source": {"imagePath": null, "volume": {"name": "weights", "path": "m.gguf"}}},
                   "template": {"volumes": [{"name": "other", "emptyDir": {}}]}}),
            "spec.model.source.volume.name must name a volume declared in spec.template.volumes",
        ),
        (
            json!({"template": {"volumes": [{"name": "tmp", "emptyDir": {}}]}}),
            "spec.template.volumes must not use the operator's volume names",
        ),
        (
            json!({"template": {"volumes": [{"name": "w", "emptyDir": {}}],
                   "volumeMounts": [{"name": "w", "mountPath": "/models"}]}}),
            "spec.template.volumeMounts must not mount at /tmp, /models",
        ),
        (
            json!({"rollout": {"maxSurge": 0, "maxUnavailable": 0}}),
            "spec.rollout.maxSurge and spec.rollout.maxUnavailable must not both be 0",
        ),
    ];
    for (i, (spec, expected)) in cases.into_iter().enumerate() {
        let isvc = service(&format!("bad-{i}"), spec.clone())?;
        match f.services.create(&PostParams::default(), &isvc).await {
            Ok(_) => bail!("{spec} was admitted; expected: {expected}"),
            Err(kube::Error::Api(status)) => {
                assert_eq!(status.code, 422, "{spec}: {}", status.message);
                assert!(
                    status.message.contains(expected),
                    "{spec}: {} does not say {expected}",
                    status.message
                );
            }
            Err(other) => return Err(other).context(format!("creating {spec}")),
        }
    }
    // A valid template with a volume and a mount is admitted.
    let good = service(
        "good",
        json!({"template": {
            "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": 2, "memory": "2Gi"}},
            "imagePullPolicy": "IfNotPresent",
            "env": [{"name": "RUST_LOG", "value": "debug"}],
            "volumes": [{"name": "cache", "emptyDir": {}}],
            "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
        }, "scheduling": {"nodeSelector": {"example.com/pool": "inference"}}}),
    )?;
    f.services.create(&PostParams::default(), &good).await?;
    Ok(())
}

#[tokio::test]
async fn pending_groups_turn_into_progress_deadline_exceeded_naming_the_reason() -> Result<()> {
    let f = fixture("pending").await?;
    let too_big = service(
        "too-big",
        json!({"accelerator": {"type": "ascend910", "devicesPerPod": 16},
               "parallelism": {"tensor": 16}, "progressDeadlineSeconds": 3}),
    )?;
    let no_claim = service(
        "no-claim",
        json!({"model": {"source": {"imagePath": null,
                   "persistentVolumeClaim": {"claimName": "weights", "path": "m.gguf"}}},
               "progressDeadlineSeconds": 3}),
    )?;
    f.services.create(&PostParams::default(), &too_big).await?;
    f.services.create(&PostParams::default(), &no_claim).await?;

    let message = wait_condition(
        &f,
        "too-big",
        "Progressing",
        "False",
        "ProgressDeadlineExceeded",
    )
    .await?;
    assert!(
        message.contains("pod too-big-0-0 Unschedulable")
            && message.contains("Insufficient huawei.com/Ascend910"),
        "{message}"
    );
    let (_, _, ready) = condition(&f.services, "too-big", "Ready")
        .await?
        .context("Ready")?;
    assert!(
        ready.contains("Insufficient huawei.com/Ascend910"),
        "{ready}"
    );
    let (type_, note) =
        wait_event(&f, "too-big", "ProgressDeadlineExceeded", "too-big-0-0").await?;
    assert_eq!(type_, "Warning");
    assert!(note.contains("Insufficient"), "{note}");

    let message = wait_condition(
        &f,
        "no-claim",
        "Progressing",
        "False",
        "ProgressDeadlineExceeded",
    )
    .await?;
    assert!(
        message.contains("persistentvolumeclaim \"weights\" not found"),
        "{message}"
    );
    Ok(())
}

/// Cordons or uncordons `node`, as `kubectl drain` starts and `kubectl uncordon` ends.
async fn set_unschedulable(client: &Client, node: &str, unschedulable: bool) -> Result<()> {
    Api::<Node>::all(client.clone())
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"unschedulable": unschedulable}})),
        )
        .await?;
    Ok(())
}

#[tokio::test]
async fn evictions_never_take_more_than_the_budgeted_groups_out_of_service() -> Result<()> {
    let f = fixture("disruption").await?;
    // A server of its own, drained as `kubectl drain` does: cordoned, then evicted pod by pod.
    // Cordoned, it cannot take an evicted group back, so the group stays out of service the
    // way a real group does while its model loads.
    let node = "drain-test-node";
    cluster::shared()
        .add_fake_node(&f.client, &FakeNode::ascend910(node))
        .await?;
    f.create(
        "tp2",
        json!({"replicas": 2, "accelerator": {"type": "ascend910", "devicesPerPod": 1},
               "parallelism": {"tensor": 2},
               "scheduling": {"nodeSelector": {"kubernetes.io/hostname": node}}}),
    )
    .await?;
    wait_condition(&f, "tp2", "Ready", "True", "AllReplicasReady").await?;
    let budgets: Api<PodDisruptionBudget> = Api::namespaced(f.client.clone(), &f.namespace);
    // The disruption controller has counted all four pods and allows one disruption.
    wait::until("the budget allows one disruption", TIMEOUT, || async {
        let status = budgets.get("tp2").await?.status.context("status")?;
        Ok((status.expected_pods == 4
            && status.current_healthy == 4
            && status.disruptions_allowed == 1)
            .then_some(()))
    })
    .await?;

    set_unschedulable(&f.client, node, true).await?;
    // The client retries a 429 by default, backing off for minutes; a refused eviction is
    // what this test looks for, so it must come back at once, as `kubectl drain` sees it.
    let mut config = cluster::shared().config().await?;
    config.default_retry = false;
    let pods: Api<Pod> = Api::namespaced(Client::try_from(config)?, &f.namespace);
    pods.evict("tp2-0-0", &EvictParams::default())
        .await
        .context("the first eviction is within the budget")?;
    match pods.evict("tp2-1-0", &EvictParams::default()).await {
        Ok(_) => bail!("a second group was evicted while the first is out of service"),
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 429, "{}", status.message);
            assert!(
                status
                    .message
                    .contains("would violate the pod's disruption budget"),
                "{}",
                status.message
            );
        }
        Err(other) => return Err(other.into()),
    }
    // Still refused once the controller has recounted: the evicted group is down as a whole.
    wait::until("group 0 out of service", TIMEOUT, || async {
        let status = budgets.get("tp2").await?.status.context("status")?;
        Ok((status.current_healthy == 2 && status.disruptions_allowed == 0).then_some(()))
    })
    .await?;
    let refused = pods.evict("tp2-1-1", &EvictParams::default()).await;
    assert!(
        matches!(&refused, Err(kube::Error::Api(s)) if s.code == 429),
        "{refused:?}"
    );
    // The evicted group's new pods wait on the cordoned server, and Ready says so.
    wait::until("Ready names the unschedulable pod", TIMEOUT, || async {
        let (_, _, ready) = condition(&f.services, "tp2", "Ready")
            .await?
            .context("Ready")?;
        Ok(
            (ready.starts_with("1 of 2 replica groups ready") && ready.contains("unschedulable"))
                .then_some(()),
        )
    })
    .await?;
    set_unschedulable(&f.client, node, false).await?;
    Ok(())
}

/// A server that stops reporting (KWOK stops heartbeating it, as a dead kubelet would): after
/// the node controller's grace period and `nodeLossTolerationSeconds` the taint manager evicts
/// the group's pod, which no kubelet will ever confirm gone; the operator removes it and makes
/// the group again on the server that is left.
#[tokio::test]
async fn a_group_on_a_lost_node_is_made_again_on_another() -> Result<()> {
    let f = fixture("node-loss").await?;
    const POOL: &str = "npufleet.io/test-pool";
    let c = cluster::shared();
    for name in ["node-loss-a", "node-loss-b"] {
        let mut node = FakeNode::ascend910(name);
        node.labels.insert(POOL.into(), "node-loss".into());
        // The node controller stops evicting in a zone where most nodes are not ready;
        // a zone of their own keeps this test's lost node out of other tests' counts.
        node.labels
            .insert("topology.kubernetes.io/zone".into(), "node-loss".into());
        c.add_fake_node(&f.client, &node).await?;
    }
    f.create(
        "lost",
        json!({"accelerator": {"type": "ascend910", "devicesPerPod": 1},
               "scheduling": {"nodeSelector": {POOL: "node-loss"}, "nodeLossTolerationSeconds": 1}}),
    ).await?;
    wait_condition(&f, "lost", "Ready", "True", "AllReplicasReady").await?;
    let pods: Api<Pod> = Api::namespaced(f.client.clone(), &f.namespace);
    let first = pods.get("lost-0-0").await?;
    let lost_node = first
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .context("the pod is bound")?;

    let nodes: Api<Node> = Api::all(f.client.clone());
    nodes
        .patch(
            &lost_node,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {cluster::KWOK_NODE_LABEL: null}}})),
        )
        .await?;
    let lost_at = std::time::Instant::now();
    let replacement = wait::until(
        "the group serving on the other server",
        Duration::from_secs(180),
        || async {
            let Some(pod) = pods.get_opt("lost-0-0").await? else {
                return Ok(None);
            };
            let moved = pod.metadata.uid != first.metadata.uid
                && pod.spec.as_ref().and_then(|s| s.node_name.as_deref())
                    != Some(lost_node.as_str());
            let ready = pod
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            Ok((moved && ready).then_some(pod))
        },
    )
    .await;
    let replacement = match replacement {
        Ok(pod) => pod,
        Err(err) => {
            let node = nodes.get(&lost_node).await?;
            let pod = pods.get_opt("lost-0-0").await?;
            let notes = events(&f, "lost").await?;
            return Err(err.context(format!(
                "lost node: {:?} {:?}\npod: {:?}\nevents: {notes:?}",
                node.spec.and_then(|s| s.taints),
                node.status.and_then(|s| s.conditions),
                pod.map(|p| (
                    p.metadata.deletion_timestamp,
                    p.spec.and_then(|s| s.node_name),
                    p.status
                )),
            )));
        }
    };
    eprintln!(
        "serving again on {} {:.1} s after {lost_node} stopped reporting",
        replacement
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default(),
        lost_at.elapsed().as_secs_f64()
    );
    wait_condition(&f, "lost", "Ready", "True", "AllReplicasReady").await?;
    let notes = events(&f, "lost").await?;
    assert!(
        notes
            .iter()
            .any(|(_, reason, _, note)| reason == "NodeLost" && note.contains("lost-0-0")),
        "{notes:?}"
    );
    nodes.delete(&lost_node, &Default::default()).await?;
    Ok(())
}

//! Who owns the replica count, on the real control plane, as a user sees it:
//! - with built-in autoscaling, `replicas` above `maxReplicas` never creates more than the
//!   maximum, and a `spec.replicas` set by hand (`kubectl scale`, a re-applied manifest) is
//!   put back to the autoscaler's count with a warning, creating no pod; `kubectl get` shows
//!   the count the operator drives toward;
//! - workers whose load cannot be read hold the count (the autoscaler once read them as
//!   idle and scaled 3 -> 1), with `ScalingActive=False` and a warning naming how many;
//! - `minReplicas: 0` takes an idle fleet to zero, says so in status and events, and a
//!   router's wake annotation brings one replica group back;
//! - `mode: hpa` with `minReplicas: 0` is refused at admission naming the field, never
//!   silently run at one.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use npufleet_contract::annotations::WAKE_REQUESTED_AT;
use npufleet_crds::InferenceService;
use npufleet_operator::autoscaler::policy::Reason;
use npufleet_operator::autoscaler::{
    FIELD_MANAGER as AUTOSCALER, MANUAL_SCALE_REVERTED, METRICS_UNAVAILABLE, SCALING_ACTIVE,
};
use npufleet_tests::fleet::{Testbed, unreachable_node, unreachable_placement};
use npufleet_tests::operator::OperatedNamespace;
use npufleet_tests::{cluster, service, wait};
use serde_json::json;

const MANAGER: &str = "autoscaling-replicas-test";

/// Every pod name ever seen in `namespace`, collected by a watch until dropped.
struct PodsSeen {
    names: Arc<Mutex<BTreeSet<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl PodsSeen {
    fn start(pods: Api<Pod>) -> Self {
        let names: Arc<Mutex<BTreeSet<String>>> = Arc::default();
        let task = tokio::spawn({
            let names = names.clone();
            async move {
                watcher(pods, watcher::Config::default())
                    .default_backoff()
                    .applied_objects()
                    .for_each(|pod| {
                        if let Ok(pod) = pod {
                            names.lock().expect("names").insert(pod.name_any());
                        }
                        async {}
                    })
                    .await;
            }
        });
        Self { names, task }
    }

    fn names(&self) -> BTreeSet<String> {
        self.names.lock().expect("names").clone()
    }
}

impl Drop for PodsSeen {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Pods not terminating: the groups the reconcile keeps.
async fn live_pods(pods: &Api<Pod>) -> Result<usize> {
    let list = pods.list(&ListParams::default()).await?;
    Ok(list
        .items
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .count())
}

fn autoscaled_count(service: &InferenceService) -> Option<i32> {
    service
        .status
        .as_ref()?
        .autoscaling
        .as_ref()?
        .desired_replicas
}

/// A CPU service `chat` in `namespace` under the built-in autoscaler (at least one replica
/// group, at most `max`) asking for `replicas`, its pods on the node made by
/// [`unreachable_node`]: KWOK runs them, Ready, with no worker behind them.
fn unreachable_service(
    namespace: &str,
    node: &str,
    replicas: i32,
    max: i32,
) -> Result<InferenceService> {
    service::unread_smollm2(
        namespace,
        "chat",
        json!({
            "replicas": replicas,
            "autoscaling": {"mode": "builtin", "minReplicas": 1, "maxReplicas": max},
            "scheduling": unreachable_placement(node),
        }),
    )
}

/// A namespace for `test` with the operator running, and in it [`unreachable_service`] asking
/// for `replicas` of at most `max`, on an [`unreachable_node`] of its own on `subnet`; with
/// every pod name the namespace has had, watched from before the service was applied, and the
/// manifest applied.
async fn unreachable_fleet(
    c: &cluster::Cluster,
    client: &Client,
    test: &str,
    subnet: u8,
    (replicas, max): (i32, i32),
) -> Result<(OperatedNamespace, PodsSeen, InferenceService)> {
    let node = format!("unreachable-{test}");
    unreachable_node(client, &node, subnet).await?;
    let operated = OperatedNamespace::start(c, client, test, MANAGER).await?;
    let seen = PodsSeen::start(operated.pods.clone());
    let manifest = unreachable_service(&operated.namespace, &node, replicas, max)?;
    npufleet_tests::operator::apply(&operated.services, MANAGER, &manifest).await?;
    Ok((operated, seen, manifest))
}

/// Runs `kubectl` with `args` off the async threads; its stdout, or its stderr as the error.
async fn kubectl(args: &[&str]) -> Result<String> {
    let owned: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    let output =
        tokio::task::spawn_blocking(move || cluster::shared().kubectl().args(&owned).output())
            .await??;
    anyhow::ensure!(
        output.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8(output.stdout)?)
}

/// The value of `column` in `kubectl get`'s one-row table.
fn column(table: &str, column: &str) -> Option<String> {
    let mut lines = table.lines();
    let header: Vec<&str> = lines.next()?.split_whitespace().collect();
    let row: Vec<&str> = lines.next()?.split_whitespace().collect();
    let index = header.iter().position(|h| *h == column)?;
    row.get(index).map(|v| (*v).to_owned())
}

/// Waits for a `ManualScaleReverted` event whose note starts as `expected` does.
async fn reverted(client: &Client, ns: &str, expected: &str) -> Result<String> {
    wait::until(expected, Duration::from_secs(30), || async {
        let events =
            npufleet_tests::operator::events(client, ns, "chat", MANUAL_SCALE_REVERTED).await?;
        let notes: Vec<String> = events.into_iter().filter_map(|e| e.note).collect();
        match notes.iter().find(|n| n.starts_with(expected)) {
            Some(note) => Ok(Some(note.clone())),
            None => anyhow::bail!("{MANUAL_SCALE_REVERTED} events: {notes:?}"),
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_count_set_by_hand_is_put_back_to_the_autoscalers_with_a_warning() -> Result<()> {
    npufleet_tests::on_shared_cluster(|c, client| async move {
        // The autoscaler cannot read these workers, so it holds what it has.
        let (operated, seen, manifest) =
            unreachable_fleet(c, &client, "autoscaling-replicas", 1, (10, 3)).await?;
        let OperatedNamespace { namespace: ns, services, pods, .. } = &operated;

        // The manifest's 10 is cut to the maximum, and spec.replicas says so.
        let note = reverted(&client, ns, "spec.replicas 10 reverted to 3: ").await?;
        assert!(
            note.contains("autoscaler owns the replica count") && note.contains("maxReplicas"),
            "{note}"
        );
        wait::until("three serving replica groups", Duration::from_secs(30), || async {
            let service = services.get("chat").await?;
            let status = service.status.clone().unwrap_or_default();
            let live = live_pods(pods).await?;
            let shown = (service.spec.replicas, status.desired_replicas, status.ready_replicas, live);
            if shown == (3, Some(3), 3, 3) {
                Ok(Some(()))
            } else {
                anyhow::bail!("spec.replicas, status.desiredReplicas, readyReplicas, live pods: {shown:?}")
            }
        })
        .await?;
        let created = seen.names();
        assert_eq!(created.len(), 3, "replicas: 10 with maxReplicas: 3 created {created:?}");
        let table = kubectl(&["get", "infsvc", "chat", "-n", ns]).await?;
        assert_eq!(column(&table, "DESIRED").as_deref(), Some("3"), "{table}");
        assert_eq!(column(&table, "READY").as_deref(), Some("3"), "{table}");

        // The count is written by the autoscaler's own field manager.
        let service = services.get("chat").await?;
        let managers: Vec<(String, String)> = service
            .managed_fields()
            .iter()
            .filter_map(|f| {
                let fields = serde_json::to_string(f.fields_v1.as_ref()?).ok()?;
                Some((f.manager.clone()?, fields))
            })
            .collect();
        assert!(
            managers
                .iter()
                .any(|(m, fields)| m == AUTOSCALER && fields.contains("f:desiredReplicas")),
            "status.autoscaling.desiredReplicas is not owned by {AUTOSCALER}: {managers:?}"
        );

        // kubectl scale is answered, not silently dropped.
        kubectl(&["scale", "infsvc/chat", "--replicas=4", "-n", ns]).await?;
        reverted(&client, ns, "spec.replicas 4 reverted to 3: ").await?;
        wait::until("spec.replicas back at 3", Duration::from_secs(30), || async {
            let replicas = services.get("chat").await?.spec.replicas;
            if replicas == 3 { Ok(Some(())) } else { anyhow::bail!("spec.replicas {replicas}") }
        })
        .await?;

        // A GitOps tool re-applies the manifest with replicas: 10.
        npufleet_tests::operator::apply(services, MANAGER, &manifest).await?;
        let reapplied = services.get("chat").await?;
        let generation = reapplied.metadata.generation;
        reverted(&client, ns, "spec.replicas 10 reverted to 3: ").await?;
        wait::until(
            "the re-applied count put back and seen by the reconcile",
            Duration::from_secs(30),
            || async {
                let service = services.get("chat").await?;
                let status = service.status.clone().unwrap_or_default();
                let shown = (service.spec.replicas, status.desired_replicas);
                if shown == (3, Some(3)) && status.observed_generation > generation {
                    Ok(Some(()))
                } else {
                    anyhow::bail!("spec.replicas, status.desiredReplicas: {shown:?}, observed generation {:?}", status.observed_generation)
                }
            },
        )
        .await?;
        assert_eq!(live_pods(pods).await?, 3);
        assert_eq!(seen.names(), created, "a count set by hand created pods");
        assert_eq!(autoscaled_count(&services.get("chat").await?), Some(3));
        Ok(())
    })
    .await
}

/// How long the count must hold: the autoscaler that read unreachable workers as idle
/// scaled down once the test policy's stable window (8 s) and scale-down delay (4 s) had
/// passed since it first saw the service.
const HOLD: Duration = Duration::from_secs(15);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_whose_load_cannot_be_read_hold_the_count_and_say_why() -> Result<()> {
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let (operated, ..) = unreachable_fleet(c, &client, "metrics-unavailable", 2, (3, 5)).await?;
        let OperatedNamespace { namespace: ns, services, pods, .. } = &operated;

        let condition = wait::until("ScalingActive=False", Duration::from_secs(45), || async {
            let service = services.get("chat").await?;
            let conditions = service
                .status
                .and_then(|s| s.autoscaling)
                .map(|a| a.conditions)
                .unwrap_or_default();
            let found = conditions.iter().find(|c| c.type_ == SCALING_ACTIVE && c.status == "False");
            match found {
                Some(c) if c.message.starts_with("the load of 3 of 3") => Ok(Some(c.clone())),
                _ => anyhow::bail!("status.autoscaling.conditions {conditions:?}"),
            }
        })
        .await?;
        let holding_since = Instant::now();
        assert_eq!(condition.reason, METRICS_UNAVAILABLE);
        let message = &condition.message;
        assert!(
            message.starts_with("the load of 3 of 3 serving workers could not be read; first: ")
                && message.contains("127.78.2.")
                && message.ends_with("the replica count will not fall until every serving worker answers"),
            "{message}"
        );
        // One warning when it turned, however the count of unread workers grew after.
        let warnings = npufleet_tests::operator::events(&client, ns, "chat", METRICS_UNAVAILABLE).await?;
        let note = warnings.last().and_then(|e| e.note.clone()).context("no MetricsUnavailable event")?;
        assert!(note.contains("serving workers could not be read; first: "), "{note}");

        wait::until("the count to hold through the old scale-down time", HOLD * 2, || async {
            let service = services.get("chat").await?;
            let live = live_pods(pods).await?;
            let held = (service.spec.replicas, autoscaled_count(&service), live);
            if held != (3, Some(3), 3) {
                return Err(wait::fatal(anyhow::anyhow!(
                    "spec.replicas, status.autoscaling.desiredReplicas, live pods {held:?} after {:?} unread",
                    holding_since.elapsed()
                )));
            }
            Ok((holding_since.elapsed() >= HOLD).then_some(()))
        })
        .await?;
        for reason in [Reason::ScaleDown, Reason::RateLimited, Reason::Idle] {
            let reason = reason.as_str();
            let scaled = npufleet_tests::operator::events(&client, ns, "chat", reason).await?;
            assert!(scaled.is_empty(), "a {reason} event: {:?}", scaled.last().and_then(|e| e.note.clone()));
        }
        let service = services.get("chat").await?;
        let queue = service.status.and_then(|s| s.autoscaling).and_then(|a| a.queue_depth);
        assert_eq!(queue, None, "a load never read is shown as a queue of {queue:?}");
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_fleet_scales_to_zero_and_a_wake_request_brings_it_back() -> Result<()> {
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let bed = Testbed::start(c, &client, "scale-to-zero", 61, MANAGER).await?;
        let ns = bed.namespace.clone();
        let _operator = bed.start_operator()?;
        bed.apply_smollm2(
            "chat",
            json!({"autoscaling": {"mode": "builtin", "minReplicas": 0, "maxReplicas": 2}}),
        )
        .await?;
        let services = bed.services();
        let ready = |service: &InferenceService| service.status.as_ref().map_or(0, |s| s.ready_replicas);
        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
        let pod_states = || async {
            let list = pods.list(&ListParams::default()).await?;
            anyhow::Ok(
                list.items
                    .iter()
                    .map(|p| {
                        let status = p.status.clone().unwrap_or_default();
                        format!(
                            "{} on {:?}: {:?} {:?}",
                            p.name_any(),
                            p.spec.as_ref().and_then(|s| s.node_name.clone()),
                            status.phase,
                            status.conditions.unwrap_or_default().iter().map(|c| format!("{}={} {:?}", c.type_, c.status, c.message)).collect::<Vec<_>>()
                        )
                    })
                    .collect::<Vec<_>>(),
            )
        };
        wait::until("the first replica group ready", Duration::from_secs(120), || async {
            let service = services.get("chat").await?;
            if ready(&service) == 1 {
                Ok(Some(()))
            } else {
                let notes: Vec<String> = Api::<Event>::namespaced(client.clone(), &ns)
                    .list(&ListParams::default())
                    .await?
                    .items
                    .into_iter()
                    .map(|e| format!("{:?}: {:?}", e.reason, e.note))
                    .collect();
                anyhow::bail!("pods: {:?}; status {:?}; events {notes:?}", pod_states().await?, service.status)
            }
        })
        .await?;

        let idle_from = Instant::now();
        let at_zero = wait::until("the idle fleet at zero", Duration::from_secs(60), || async {
            let service = services.get("chat").await?;
            let live = pods.list(&ListParams::default()).await?.items.len();
            let count = autoscaled_count(&service);
            if count == Some(0) && live == 0 {
                Ok(Some(service))
            } else {
                anyhow::bail!("status.autoscaling.desiredReplicas {count:?}, {live} pods")
            }
        })
        .await?;
        let to_zero = idle_from.elapsed();
        assert!(
            to_zero >= npufleet_tests::operator::IDLE_BEFORE_ZERO,
            "went to zero {to_zero:?} after the last request"
        );
        // Status says so: Ready with reason ScaledToZero, and an event with the idle time.
        let conditions = at_zero.status.as_ref().map(|s| s.conditions.clone()).unwrap_or_default();
        let ready_condition = wait::until("the Ready condition at zero", Duration::from_secs(10), || async {
            let service = services.get("chat").await?;
            let condition = service
                .status
                .and_then(|s| s.conditions.into_iter().find(|c| c.type_ == "Ready"));
            Ok(condition.filter(|c| c.reason == "ScaledToZero"))
        })
        .await
        .with_context(|| format!("conditions: {conditions:?}"))?;
        assert_eq!(ready_condition.status, "True");
        let scaled = npufleet_tests::operator::events(&client, &ns, "chat", "ScaledToZero").await?;
        let note = scaled.last().and_then(|e| e.note.clone()).context("no ScaledToZero event")?;
        assert!(note.contains("1 -> 0 replicas: no request for"), "{note}");

        // A router holding a request writes the wake annotation.
        let woke = Instant::now();
        let annotation = json!({"metadata": {"annotations": {
            WAKE_REQUESTED_AT: k8s_openapi::jiff::Timestamp::now().to_string()
        }}});
        services
            .patch("chat", &PatchParams::default(), &Patch::Merge(annotation))
            .await?;
        wait::until("the woken replica group ready", Duration::from_secs(120), || async {
            let service = services.get("chat").await?;
            let count = autoscaled_count(&service);
            if count == Some(1) && ready(&service) == 1 {
                Ok(Some(()))
            } else {
                anyhow::bail!("status.autoscaling.desiredReplicas {count:?}, {} ready", ready(&service))
            }
        })
        .await?;
        let wake_to_ready = woke.elapsed();
        let wakes = npufleet_tests::operator::events(&client, &ns, "chat", "Wake").await?;
        let note = wakes.last().and_then(|e| e.note.clone()).context("no Wake event")?;
        assert!(note.contains("0 -> 1 replicas"), "{note}");
        eprintln!(
            "scale to zero: at zero {:.1} s after the last request (idle window {:?}); wake annotation to a ready group {:.1} s",
            to_zero.as_secs_f64(),
            npufleet_tests::operator::IDLE_BEFORE_ZERO,
            wake_to_ready.as_secs_f64()
        );
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hpa_mode_with_min_replicas_zero_is_rejected_at_admission() -> Result<()> {
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let ns = c.namespace(&client, "hpa-min-zero").await?;
        npufleet_tests::crd::install_inference_service(&client, MANAGER).await?;
        let services: Api<InferenceService> = Api::namespaced(client.clone(), &ns);
        let manifest = service::unread_smollm2(
            &ns,
            "chat",
            json!({"autoscaling": {"mode": "hpa", "minReplicas": 0, "maxReplicas": 3}}),
        )?;
        let refused = services
            .patch(
                "chat",
                &PatchParams::apply(MANAGER).force(),
                &Patch::Apply(&manifest),
            )
            .await
            .expect_err("minReplicas 0 under the HPA was accepted");
        let kube::Error::Api(status) = refused else {
            anyhow::bail!("not refused by the apiserver: {refused}");
        };
        assert_eq!(status.code, 422, "{status:?}");
        let message = status.message;
        assert!(
            message.contains("spec.autoscaling.minReplicas")
                && message.contains("only the built-in autoscaler scales to zero"),
            "{message}"
        );
        assert!(services.get_opt("chat").await?.is_none());
        Ok(())
    })
    .await
}

//! Who owns the replica count, on the real control plane, as a user sees it:
//! - with built-in autoscaling, `replicas` above `maxReplicas` never creates more than the
//!   maximum, and re-applying a manifest's `replicas` does not fight the autoscaler, whose
//!   count lives in `status.autoscaling` under its own field manager;
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
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use npufleet_contract::annotations::WAKE_REQUESTED_AT;
use npufleet_contract::env as worker_env;
use npufleet_crds::InferenceService;
use npufleet_operator::autoscaler::FIELD_MANAGER as AUTOSCALER;
use npufleet_tests::node_agent::{self, NodeAgent, NodeAgentConfig};
use npufleet_tests::{cluster, paths, wait};
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_are_clamped_and_a_reapplied_manifest_does_not_fight_the_autoscaler() -> Result<()>
{
    let c = cluster::shared();
    let client = c.client().await?;
    let result = async {
        let ns = c.namespace(&client, "autoscaling-replicas").await?;
        npufleet_tests::crd::install_inference_service(&client, MANAGER).await?;
        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
        let seen = PodsSeen::start(pods.clone());
        let _operator = npufleet_tests::operator::start_with_builtin_autoscaler(&client, &ns)?;

        let services: Api<InferenceService> = Api::namespaced(client.clone(), &ns);
        // KWOK runs these pods; without a worker behind them they never report load, so the
        // autoscaler settles at the minimum.
        let manifest: InferenceService = serde_json::from_value(json!({
            "apiVersion": "npufleet.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": ns},
            "spec": {
                "model": {"name": "smollm2", "source": {"imagePath": "/models/smollm2.gguf"}},
                "replicas": 10,
                "accelerator": {"type": "cpu"},
                "autoscaling": {"mode": "builtin", "minReplicas": 1, "maxReplicas": 3},
            }
        }))?;
        npufleet_tests::operator::apply(&services, MANAGER, &manifest).await?;

        wait::until("three replica groups", Duration::from_secs(30), || async {
            let live = live_pods(&pods).await?;
            Ok((live == 3).then_some(()))
        })
        .await?;
        wait::until(
            "the autoscaler's scale-down to one group",
            Duration::from_secs(45),
            || async {
                let service = services.get("chat").await?;
                let live = live_pods(&pods).await?;
                let count = autoscaled_count(&service);
                if count == Some(1) && live == 1 {
                    Ok(Some(()))
                } else {
                    anyhow::bail!("status.autoscaling.desiredReplicas {count:?}, {live} pods")
                }
            },
        )
        .await?;
        let created = seen.names();
        assert_eq!(
            created.len(),
            3,
            "replicas: 10 with maxReplicas: 3 created {created:?}"
        );

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
        assert_eq!(
            service.spec.replicas, 1,
            "the decision is copied to the scale subresource"
        );

        // A GitOps tool re-applies the manifest with replicas: 10.
        npufleet_tests::operator::apply(&services, MANAGER, &manifest).await?;
        let reapplied = services.get("chat").await?;
        assert_eq!(reapplied.spec.replicas, 10);
        let generation = reapplied.metadata.generation;
        wait::until(
            "the reconcile to see the re-applied spec",
            Duration::from_secs(30),
            || async {
                let observed = services
                    .get("chat")
                    .await?
                    .status
                    .and_then(|s| s.observed_generation);
                Ok((observed >= generation).then_some(()))
            },
        )
        .await?;
        let live = live_pods(&pods).await?;
        assert_eq!(live, 1, "the re-applied replicas created groups");
        assert_eq!(
            seen.names(),
            created,
            "the re-applied replicas created pods"
        );
        assert_eq!(autoscaled_count(&services.get("chat").await?), Some(1));
        Ok(())
    }
    .await;
    c.diagnose(result)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_fleet_scales_to_zero_and_a_wake_request_brings_it_back() -> Result<()> {
    let c = cluster::shared();
    let client = c.client().await?;
    let result = async {
        let ns = c.namespace(&client, "scale-to-zero").await?;
        npufleet_tests::crd::install_inference_service(&client, MANAGER).await?;
        let model_path = tokio::task::spawn_blocking(paths::smollm2_gguf).await??;
        let worker = paths::workspace_bin("npufleet-worker")?;
        let node = "agent-scale-to-zero-0";
        let _agent = NodeAgent::start(
            client.clone(),
            NodeAgentConfig::new(node, worker, c.scratch().join("agent-scale-to-zero"), 61),
        )
        .await?;
        let _operator = npufleet_tests::operator::start_with_builtin_autoscaler(&client, &ns)?;

        let services: Api<InferenceService> = Api::namespaced(client.clone(), &ns);
        let manifest: InferenceService = serde_json::from_value(json!({
            "apiVersion": "npufleet.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": ns},
            "spec": {
                "model": {"name": "smollm2", "source": {"imagePath": model_path.display().to_string()}},
                "accelerator": {"type": "cpu"},
                "engine": {"warmupIterations": 1},
                "autoscaling": {"mode": "builtin", "minReplicas": 0, "maxReplicas": 2},
                "scheduling": node_agent::scheduling(node),
                "template": {"env": [{"name": worker_env::THREADS, "value": "1"}]},
            }
        }))?;
        npufleet_tests::operator::apply(&services, MANAGER, &manifest).await?;
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
    }
    .await;
    c.diagnose(result)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hpa_mode_with_min_replicas_zero_is_rejected_at_admission() -> Result<()> {
    let c = cluster::shared();
    let client = c.client().await?;
    let result = async {
        let ns = c.namespace(&client, "hpa-min-zero").await?;
        npufleet_tests::crd::install_inference_service(&client, MANAGER).await?;
        let services: Api<InferenceService> = Api::namespaced(client.clone(), &ns);
        let manifest: InferenceService = serde_json::from_value(json!({
            "apiVersion": "npufleet.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": ns},
            "spec": {
                "model": {"name": "smollm2", "source": {"imagePath": "/models/smollm2.gguf"}},
                "accelerator": {"type": "cpu"},
                "autoscaling": {"mode": "hpa", "minReplicas": 0, "maxReplicas": 3},
            }
        }))?;
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
    }
    .await;
    c.diagnose(result)
}

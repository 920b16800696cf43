//! Proves the local control plane is the real thing: CRDs become Established, the
//! apiserver validates against their schema with its own messages, the scheduler places
//! pods on KWOK nodes by extended resource, and kube-controller-manager garbage-collects
//! owned objects.

use std::time::Duration;

use anyhow::Result;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, DeleteParams, DynamicObject, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use npufleet_tests::{cluster, wait};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(60);

/// The shared cluster, an admin client and a namespace of it for `test`.
async fn shared_namespace(test: &str) -> Result<(&'static cluster::Cluster, Client, String)> {
    let c = cluster::shared();
    let client = c.client().await?;
    let ns = c.namespace(&client, test).await?;
    Ok((c, client, ns))
}

fn widget_crd() -> Result<CustomResourceDefinition> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": { "name": "widgets.smoke.npufleet.io" },
        "spec": {
            "group": "smoke.npufleet.io",
            "names": { "kind": "Widget", "plural": "widgets", "singular": "widget" },
            "scope": "Namespaced",
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "schema": { "openAPIV3Schema": {
                    "type": "object",
                    "properties": { "spec": {
                        "type": "object",
                        "required": ["size"],
                        "properties": { "size": { "type": "integer", "minimum": 1, "maximum": 8 } }
                    }}
                }}
            }]
        }
    }))?)
}

#[tokio::test]
async fn crd_objects_are_validated_by_the_apiserver() -> Result<()> {
    let (_, client, ns) = shared_namespace("smoke-crd").await?;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    crds.create(&PostParams::default(), &widget_crd()?).await?;
    npufleet_tests::crd::wait_established(&client, "widgets.smoke.npufleet.io").await?;

    let gvk = GroupVersionKind::gvk("smoke.npufleet.io", "v1", "Widget");
    let ar = ApiResource::from_gvk(&gvk);
    let widgets: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &ar);
    let good: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "smoke.npufleet.io/v1", "kind": "Widget",
        "metadata": { "name": "good" }, "spec": { "size": 4 }
    }))?;
    // The discovery cache of a freshly established CRD can lag a moment.
    wait::until("Widget create", TIMEOUT, || async {
        Ok(Some(widgets.create(&PostParams::default(), &good).await?))
    })
    .await?;
    let read = widgets.get("good").await?;
    assert_eq!(read.data["spec"]["size"], json!(4));

    let bad: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "smoke.npufleet.io/v1", "kind": "Widget",
        "metadata": { "name": "bad" }, "spec": { "size": 99 }
    }))?;
    let err = widgets
        .create(&PostParams::default(), &bad)
        .await
        .expect_err("size 99 violates the schema's maximum");
    let msg = err.to_string();
    assert!(
        msg.contains("spec.size") && msg.contains("less than or equal to 8"),
        "the apiserver's own validation message names the field: {msg}"
    );
    Ok(())
}

#[tokio::test]
async fn deleting_an_owner_garbage_collects_what_it_owns() -> Result<()> {
    let (c, client, ns) = shared_namespace("smoke-gc").await?;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let owner: ConfigMap = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": { "name": "owner" }
    }))?;
    let owner = cms.create(&PostParams::default(), &owner).await?;
    let owned: ConfigMap = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {
            "name": "owned",
            "ownerReferences": [{
                "apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
                "uid": owner.metadata.uid.clone().expect("uid"),
                "controller": true, "blockOwnerDeletion": true
            }]
        }
    }))?;
    cms.create(&PostParams::default(), &owned).await?;
    cms.delete("owner", &DeleteParams::background()).await?;
    c.diagnose(
        wait::until("the owned ConfigMap to be collected", TIMEOUT, || async {
            Ok(cms.get_opt("owned").await?.is_none().then_some(()))
        })
        .await,
    )
}

#[tokio::test]
async fn the_scheduler_places_npu_pods_on_kwok_nodes_by_extended_resource() -> Result<()> {
    let (c, client, ns) = shared_namespace("smoke-sched").await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let pod = |name: &str, npus: &str| -> Result<Pod> {
        Ok(serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod", "metadata": { "name": name },
            "spec": {
                "containers": [{
                    "name": "worker", "image": "npufleet/worker:test",
                    "resources": {
                        "requests": { "huawei.com/Ascend910": npus },
                        "limits": { "huawei.com/Ascend910": npus }
                    }
                }]
            }
        }))?)
    };
    pods.create(&PostParams::default(), &pod("fits", "4")?)
        .await?;
    pods.create(&PostParams::default(), &pod("too-big", "16")?)
        .await?;
    let node = c.diagnose(
        wait::until("the 4-NPU pod Running on a 910 node", TIMEOUT, || async {
            let p = pods.get("fits").await?;
            let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
            Ok(running.then(|| p.spec.and_then(|s| s.node_name).unwrap_or_default()))
        })
        .await,
    )?;
    assert!(node.starts_with("ascend-node-"), "placed on {node}");
    let reason = wait::until("the 16-NPU pod Unschedulable", TIMEOUT, || async {
        let p = pods.get("too-big").await?;
        let conditions = p.status.and_then(|s| s.conditions).unwrap_or_default();
        let unscheduled = conditions
            .into_iter()
            .find(|c| c.type_ == "PodScheduled" && c.status == "False");
        Ok(unscheduled.and_then(|c| c.message))
    })
    .await?;
    assert!(
        reason.contains("Insufficient huawei.com/Ascend910"),
        "scheduler names the missing resource: {reason}"
    );
    Ok(())
}

#[tokio::test]
async fn a_private_cluster_serves_the_pinned_kubernetes_version() -> Result<()> {
    let started = std::time::Instant::now();
    let api_only = cluster::Cluster::start(cluster::ClusterOptions::api_only()).await?;
    let version = api_only.client().await?.apiserver_version().await?;
    assert_eq!(version.git_version, "v1.34.4");
    let elapsed = started.elapsed();
    println!("api-only cluster ready in {:.1} s", elapsed.as_secs_f64());
    Ok(())
}

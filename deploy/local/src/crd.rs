//! Installing the project's CRD into a local cluster.

use std::time::Duration;

use anyhow::Result;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, CustomResourceExt};
use npufleet_crds::InferenceService;

use crate::wait;

/// Waits until the apiserver reports the CRD `name` Established (its API is served).
pub async fn wait_established(client: &Client, name: &str) -> Result<()> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    wait::until(
        &format!("CRD {name} Established"),
        Duration::from_secs(60),
        || async {
            let crd = crds.get(name).await?;
            let established = crd
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True");
            Ok(established.then_some(()))
        },
    )
    .await
}

/// Applies the InferenceService CRD generated from the Rust types (server-side apply under
/// `manager`) and waits until it is served.
pub async fn install_inference_service(client: &Client, manager: &str) -> Result<()> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = InferenceService::crd();
    let name = crd.metadata.name.clone().unwrap_or_default();
    crds.patch(
        &name,
        &PatchParams::apply(manager).force(),
        &Patch::Apply(&crd),
    )
    .await?;
    wait_established(client, &name).await
}

/// Volcano's PodGroup API, served without Volcano itself: enough for the operator to discover
/// it and create PodGroups (which nothing then schedules).
pub async fn serve_volcano_pod_groups(client: &Client, manager: &str) -> Result<()> {
    let crd: CustomResourceDefinition = serde_json::from_value(serde_json::json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "podgroups.scheduling.volcano.sh"},
        "spec": {
            "group": "scheduling.volcano.sh",
            "names": {"kind": "PodGroup", "plural": "podgroups", "singular": "podgroup", "shortNames": ["pg"]},
            "scope": "Namespaced",
            "versions": [{"name": "v1beta1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}]
        }
    }))?;
    let name = crd.metadata.name.clone().unwrap_or_default();
    Api::<CustomResourceDefinition>::all(client.clone())
        .patch(
            &name,
            &PatchParams::apply(manager).force(),
            &Patch::Apply(&crd),
        )
        .await?;
    wait_established(client, &name).await?;
    // Established can come before discovery lists the group, and the operator finds the API
    // by discovery.
    wait::until("PodGroup API served", Duration::from_secs(60), || async {
        Ok(client
            .list_api_group_resources("scheduling.volcano.sh/v1beta1")
            .await
            .ok()
            .map(|_| ()))
    })
    .await
}

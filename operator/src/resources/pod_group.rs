//! Volcano's gang-scheduling unit (`scheduling.volcano.sh/v1beta1` `PodGroup`), one per
//! replica group, so all ranks of a group are bound together or not at all.

use std::collections::BTreeMap;

use kube::api::{ApiResource, DynamicObject, GroupVersionKind, ObjectMeta};
use kube::{Resource, ResourceExt};
use npufleet_crds::InferenceService;

use super::names;
use crate::labels;

pub fn api_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("scheduling.volcano.sh", "v1beta1", "PodGroup"),
        "podgroups",
    )
}

pub fn build(isvc: &InferenceService, group: i32) -> DynamicObject {
    let spec = &isvc.spec;
    let pods = isvc.pods_per_replica();
    let mut group_labels = labels::common(isvc);
    group_labels.insert(labels::GROUP.to_string(), group.to_string());
    let mut min_resources = BTreeMap::new();
    if let Some(resource) = spec.accelerator.resource_name() {
        min_resources.insert(
            resource,
            (pods * spec.accelerator.devices_per_pod).to_string(),
        );
    }
    let mut pod_group_spec = serde_json::json!({ "minMember": pods });
    if !min_resources.is_empty() {
        pod_group_spec["minResources"] = serde_json::json!(min_resources);
    }
    if let Some(priority) = &spec.scheduling.priority_class_name {
        pod_group_spec["priorityClassName"] = serde_json::json!(priority);
    }
    let mut object =
        DynamicObject::new(&names::group(isvc, group), &api_resource()).data(serde_json::json!({
            "spec": pod_group_spec,
        }));
    object.metadata = ObjectMeta {
        name: Some(names::group(isvc, group)),
        namespace: isvc.namespace(),
        labels: Some(group_labels),
        owner_references: isvc.controller_owner_ref(&()).map(|o| vec![o]),
        ..Default::default()
    };
    object
}

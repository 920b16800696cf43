//! The Gateway API Inference Extension's `InferencePool` (`inference.networking.k8s.io/v1`):
//! the serving pods of an InferenceService as one pool an inference gateway routes to through
//! the endpoint picker the service names. The worker's `/metrics` carries the `vllm:` names
//! the picker reads.

use kube::api::{ApiResource, DynamicObject, GroupVersionKind, ObjectMeta};
use kube::{Resource, ResourceExt};

use npufleet_crds::{EndpointPicker, InferenceService};

use crate::labels;

pub const API_VERSION: &str = "inference.networking.k8s.io/v1";

pub fn api_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("inference.networking.k8s.io", "v1", "InferencePool"),
        "inferencepools",
    )
}

/// The pool's name: the InferenceService's own (any valid one is a valid object name).
pub fn name(isvc: &InferenceService) -> String {
    isvc.name_any()
}

/// The pool of `isvc`'s group leaders (the pods that serve clients, one per replica group),
/// on the worker's HTTP port, picked among by `picker`.
pub fn build(isvc: &InferenceService, picker: &EndpointPicker) -> DynamicObject {
    let mut object = DynamicObject::new(&name(isvc), &api_resource()).data(serde_json::json!({
        "spec": {
            "selector": {"matchLabels": labels::group_leaders(isvc)},
            "targetPorts": [{"number": isvc.spec.runtime.http_port()}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": picker.service,
                "port": {"number": picker.port},
            },
        },
    }));
    object.metadata = ObjectMeta {
        name: Some(name(isvc)),
        namespace: isvc.namespace(),
        labels: Some(labels::common(isvc)),
        owner_references: isvc.controller_owner_ref(&()).map(|o| vec![o]),
        ..Default::default()
    };
    object
}

//! Label and annotation keys the operator writes and selects on.

use std::collections::BTreeMap;

use kube::ResourceExt;
use npufleet_crds::InferenceService;

pub const FIELD_MANAGER: &str = "npufleet-operator";
/// The field manager of `status.lastFailure` alone, which the operator's every-reconcile status
/// write leaves out.
pub const LAST_FAILURE_MANAGER: &str = "npufleet-operator-last-failure";

pub const NAME: &str = "app.kubernetes.io/name";
pub const INSTANCE: &str = "app.kubernetes.io/instance";
pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
pub use npufleet_contract::labels::{GROUP, INFERENCE_SERVICE, RANK, SERVING_RANK};
pub const TEMPLATE_HASH: &str = "npufleet.io/template-hash";
/// On the pods of a replica group that an eviction broke: they leave the disruption budget,
/// so the drain that evicted one rank evicts the others itself instead of waiting on a budget
/// only their group's return would refill.
pub const EVICTABLE: &str = "npufleet.io/evictable";
/// On every object the operator applies: the digest of the object as last applied, so a
/// reconcile that would apply the same again can leave it alone (the informer cache holds
/// the annotation; comparing it costs no request).
pub const APPLIED_DIGEST: &str = "npufleet.io/applied-digest";

pub const WORKER_NAME: &str = "npufleet-worker";

/// ascend-operator's rank annotation and MindCluster's job-type label, so Ascend tooling
/// recognises the pods.
pub const HCCL_RANK_INDEX: &str = "hccl/rankIndex";
pub const RING_CONTROLLER: &str = "ring-controller.atlas";
/// The annotation Volcano reads to bind a pod to its PodGroup.
pub const VOLCANO_GROUP_NAME: &str = "scheduling.k8s.io/group-name";
/// The device plugin's allocation record on each NPU pod.
pub const ASCEND_910_CONFIGURATION: &str = "ascend.kubectl.kubernetes.io/ascend-910-configuration";

/// Labels on every object made for `isvc`.
pub fn common(isvc: &InferenceService) -> BTreeMap<String, String> {
    BTreeMap::from([
        (NAME.to_string(), WORKER_NAME.to_string()),
        (INSTANCE.to_string(), isvc.name_any()),
        (MANAGED_BY.to_string(), FIELD_MANAGER.to_string()),
        (INFERENCE_SERVICE.to_string(), isvc.name_any()),
    ])
}

/// Selects every worker pod of `isvc`.
pub fn workers(isvc: &InferenceService) -> BTreeMap<String, String> {
    BTreeMap::from([(INFERENCE_SERVICE.to_string(), isvc.name_any())])
}

/// Selects the rank-0 pod of each replica group: the pod that serves clients. One pod per
/// replica, so an HPA that counts selected pods counts replica groups.
pub fn group_leaders(isvc: &InferenceService) -> BTreeMap<String, String> {
    let mut labels = workers(isvc);
    labels.insert(RANK.to_string(), SERVING_RANK.to_string());
    labels
}

pub fn selector_string(labels: &BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

//! The fleet model: how worker pods form replica groups, when a group serves, how many groups
//! run and who decides that, and the mark a scale-down leaves on the groups it removes. The
//! reconcile, the status, the disruption budget and the autoscaler all read the fleet through
//! this module; none of them decides these for itself.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use npufleet_contract::pods;
use npufleet_crds::{AutoscalingMode, InferenceService};

use crate::labels;

/// Set by the built-in autoscaler on the serving pod of each group it chose for removal, just
/// before it writes a scale-down, and taken off groups an earlier decision chose but that
/// stayed; the reconcile removes marked groups first.
pub const SCALE_DOWN_ANNOTATION: &str = "npufleet.io/scale-down";

/// Who sets the number of replica groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CountOwner {
    /// Whoever writes `spec.replicas`: a user or a manifest.
    Spec,
    /// The built-in autoscaler, through `status.autoscaling.desiredReplicas` once it decided.
    Autoscaler,
    /// A HorizontalPodAutoscaler, through `spec.replicas` (the scale subresource).
    Hpa,
}

pub fn count_owner(service: &InferenceService) -> CountOwner {
    match service.spec.autoscaling.as_ref().map(|a| a.mode) {
        None => CountOwner::Spec,
        Some(AutoscalingMode::Builtin) => CountOwner::Autoscaler,
        Some(AutoscalingMode::Hpa) => CountOwner::Hpa,
    }
}

/// The replica groups to run: `spec.replicas` by hand or under an HPA, the built-in
/// autoscaler's own count once it has one, always within the autoscaling bounds.
pub fn desired_groups(service: &InferenceService) -> i32 {
    let spec = &service.spec;
    let Some(autoscaling) = spec.autoscaling.as_ref() else {
        return spec.replicas.max(0);
    };
    let decided = match count_owner(service) {
        CountOwner::Autoscaler => service
            .status
            .as_ref()
            .and_then(|s| s.autoscaling.as_ref())
            .and_then(|a| a.desired_replicas),
        CountOwner::Spec | CountOwner::Hpa => None,
    };
    let min = autoscaling.min_replicas.max(0);
    decided
        .unwrap_or(spec.replicas)
        .clamp(min, autoscaling.max_replicas.max(min))
}

/// The serving pod (rank 0) of each of `service`'s replica groups among `pods`: chosen by the
/// labels the operator puts on them, as `status.selector` says to outsiders.
pub fn serving_pods<'a>(
    service: &InferenceService,
    pods: impl IntoIterator<Item = &'a Pod>,
) -> impl Iterator<Item = &'a Pod> {
    selected(service, labels::group_leaders(service), pods)
}

/// Every worker pod of `service` among `pods`, by the labels the operator puts on them.
pub fn worker_pods<'a>(
    service: &InferenceService,
    pods: impl IntoIterator<Item = &'a Pod>,
) -> impl Iterator<Item = &'a Pod> {
    selected(service, labels::workers(service), pods)
}

/// The pods among `pods` in `service`'s namespace that carry every label of `wanted`.
fn selected<'a>(
    service: &InferenceService,
    wanted: BTreeMap<String, String>,
    pods: impl IntoIterator<Item = &'a Pod>,
) -> impl Iterator<Item = &'a Pod> {
    let namespace = service.namespace();
    pods.into_iter().filter(move |pod| {
        pod.namespace() == namespace
            && wanted
                .iter()
                .all(|(key, value)| pod.labels().get(key) == Some(value))
    })
}

/// A worker pod's replica group and rank, from its labels.
pub fn group_and_rank(pod: &Pod) -> Option<(i32, i32)> {
    let number = |key: &str| pod.labels().get(key)?.parse().ok();
    Some((number(labels::GROUP)?, number(labels::RANK)?))
}

/// When the Eviction API evicted `pod` (a drain, or anything else that honours disruption
/// budgets), from the `DisruptionTarget` condition the apiserver sets before deleting it.
pub fn evicted_at(pod: &Pod) -> Option<Time> {
    let conditions = pod.status.as_ref()?.conditions.as_ref()?;
    conditions
        .iter()
        .find(|c| {
            c.type_ == "DisruptionTarget"
                && c.status == "True"
                && c.reason.as_deref() == Some("EvictionByEvictionAPI")
        })
        .and_then(|c| c.last_transition_time.clone())
}

pub fn phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

/// One replica group's pods.
#[derive(Default, Debug)]
pub struct ReplicaGroup<'a> {
    /// Pods not being deleted, by rank.
    pub live: BTreeMap<i32, &'a Pod>,
    /// Pods being deleted.
    pub terminating: usize,
}

impl ReplicaGroup<'_> {
    /// Every one of `ranks` ranks has a live pod.
    pub fn is_complete(&self, ranks: i32) -> bool {
        self.live.len() == usize::try_from(ranks).unwrap_or(0)
            && (0..ranks).all(|r| self.live.contains_key(&r))
    }

    /// The built-in autoscaler chose the group for removal ([`SCALE_DOWN_ANNOTATION`]).
    pub fn is_marked(&self) -> bool {
        self.live
            .values()
            .any(|p| p.annotations().contains_key(SCALE_DOWN_ANNOTATION))
    }

    /// The pod that serves clients and reports the group's load ([`labels::SERVING_RANK`]),
    /// unless it is gone or leaving.
    pub fn serving_pod(&self) -> Option<&Pod> {
        self.live
            .iter()
            .find(|(rank, _)| rank.to_string() == labels::SERVING_RANK)
            .map(|(_, pod)| *pod)
    }

    /// The group serves: every rank is there and ready, and no pod of it is leaving.
    pub fn is_ready(&self, ranks: i32) -> bool {
        self.terminating == 0
            && self.is_complete(ranks)
            && self.live.values().all(|p| pods::serves(p))
    }
}

/// Groups `pods` by their group label; pods without group and rank labels are not workers.
pub fn groups<'a>(pods: impl IntoIterator<Item = &'a Pod>) -> BTreeMap<i32, ReplicaGroup<'a>> {
    let mut groups: BTreeMap<i32, ReplicaGroup<'a>> = BTreeMap::new();
    for pod in pods {
        let Some((group, rank)) = group_and_rank(pod) else {
            continue;
        };
        let entry = groups.entry(group).or_default();
        if pod.metadata.deletion_timestamp.is_some() {
            entry.terminating += 1;
        } else {
            entry.live.insert(rank, pod);
        }
    }
    groups
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    /// A CPU InferenceService `ml/chat` with `spec` over the required fields, and `status`.
    pub(crate) fn service(spec: serde_json::Value, status: serde_json::Value) -> InferenceService {
        let mut object = json!({
            "apiVersion": "npufleet.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "ml"},
            "spec": {
                "model": {"name": "smollm2", "source": {"imagePath": "/models/m.gguf"}},
                "accelerator": {"type": "cpu"},
            },
            "status": status,
        });
        for (key, value) in spec.as_object().unwrap() {
            object["spec"][key] = value.clone();
        }
        serde_json::from_value(object).unwrap()
    }

    #[test]
    fn the_count_is_the_autoscalers_and_always_within_bounds() {
        let builtin = json!({"mode": "builtin", "minReplicas": 1, "maxReplicas": 3});
        let decided = json!({"autoscaling": {"desiredReplicas": 2}});
        // A manifest's replicas above the maximum never creates more than the maximum.
        let fresh = service(json!({"replicas": 10, "autoscaling": builtin}), json!({}));
        assert_eq!(desired_groups(&fresh), 3);
        // Once the autoscaler decided, a re-applied manifest's replicas changes nothing.
        let reapplied = service(
            json!({"replicas": 10, "autoscaling": builtin}),
            decided.clone(),
        );
        assert_eq!(desired_groups(&reapplied), 2);
        let lowered = service(
            json!({"replicas": 1, "autoscaling": {"maxReplicas": 1}}),
            decided.clone(),
        );
        assert_eq!(
            desired_groups(&lowered),
            1,
            "a lowered maximum cuts at once"
        );
        // Under an HPA, spec.replicas is the HPA's count, clamped too.
        let hpa = json!({"mode": "hpa", "minReplicas": 2, "maxReplicas": 4});
        let under_hpa = service(json!({"replicas": 9, "autoscaling": hpa}), decided);
        assert_eq!(desired_groups(&under_hpa), 4);
        let by_hand = service(json!({"replicas": 9}), json!({}));
        assert_eq!(desired_groups(&by_hand), 9);
        let zero = json!({"minReplicas": 0, "maxReplicas": 3});
        let at_zero = service(
            json!({"replicas": 1, "autoscaling": zero}),
            json!({"autoscaling": {"desiredReplicas": 0}}),
        );
        assert_eq!(desired_groups(&at_zero), 0);
    }

    #[test]
    fn the_count_has_one_owner() {
        let owner = |spec| count_owner(&service(spec, json!({})));
        assert_eq!(owner(json!({"replicas": 2})), CountOwner::Spec);
        let builtin = json!({"autoscaling": {"mode": "builtin", "maxReplicas": 3}});
        assert_eq!(owner(builtin), CountOwner::Autoscaler);
        let hpa = json!({"autoscaling": {"mode": "hpa", "minReplicas": 1, "maxReplicas": 3}});
        assert_eq!(owner(hpa), CountOwner::Hpa);
    }

    fn pod(namespace: &str, service: &str, group: i32, rank: i32) -> Pod {
        let mut pod = Pod::default();
        pod.metadata.name = Some(format!("{service}-{group}-{rank}"));
        pod.metadata.namespace = Some(namespace.into());
        pod.metadata.labels = Some(
            [
                (labels::INFERENCE_SERVICE, service.to_string()),
                (labels::GROUP, group.to_string()),
                (labels::RANK, rank.to_string()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        );
        pod
    }

    #[test]
    fn the_serving_pods_are_rank_zero_of_the_service_in_its_namespace_without_a_status() {
        let chat = service(json!({"replicas": 2}), json!(null));
        let pods = [
            pod("ml", "chat", 0, 0),
            pod("ml", "chat", 0, 1),
            pod("ml", "chat", 1, 0),
            pod("ml", "other", 0, 0),
            pod("elsewhere", "chat", 0, 0),
        ];
        let names: Vec<String> = serving_pods(&chat, &pods).map(|p| p.name_any()).collect();
        assert_eq!(names, ["chat-0-0", "chat-1-0"]);
    }
}

//! A replica group as everyone in the operator sees it: the pods of one group, by rank, and the
//! one rule for when a pod and a group are ready. The reconcile, the status and the autoscaler
//! all read groups through this module.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use npufleet_contract::pods;

use crate::labels;

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

//! The reconcile as a pure function: an InferenceService and what exists in the cluster in,
//! the objects that should exist and the changes to make out. No I/O, so every decision is
//! unit-tested with plain data.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use kube::api::DynamicObject;
use npufleet_contract::pods;
use npufleet_crds::{InferenceService, InferenceServiceStatus};

use crate::autoscaler::SCALE_DOWN_ANNOTATION;
use crate::labels;
use crate::replica_group::{self, ReplicaGroup, phase};
use crate::resources::{self, inference_pool, names, pod, pod_group, rank_table, services};
use crate::settings::{self, Settings};
use crate::status::{self, Observation};

/// What exists in the cluster for one InferenceService.
#[derive(Debug, Default, Clone)]
pub struct Observed {
    /// Pods labelled with the InferenceService's name.
    pub pods: Vec<Pod>,
    /// Names of the rank-table ConfigMaps it owns.
    pub rank_tables: Vec<String>,
    /// Names of the Volcano PodGroups it owns.
    pub pod_groups: Vec<String>,
    /// Whether `scheduling.volcano.sh/v1beta1` PodGroups are served.
    pub volcano_served: bool,
    /// Whether `inference.networking.k8s.io/v1` InferencePools are served.
    pub inference_pools_served: bool,
    /// The [`labels::APPLIED_DIGEST`] of each applied object found, by kind and name.
    pub applied: BTreeMap<(String, String), String>,
    /// When the Eviction API last evicted a pod of each replica group, where it did lately.
    pub evictions: BTreeMap<i32, Time>,
}

/// An object an Event is about besides the InferenceService (the Events API's `related`).
/// The recorder aggregates events by reason and related object, so naming the object keeps
/// one series, with its own message, per object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Related {
    pub kind: String,
    pub name: String,
}

impl Related {
    pub fn pod(name: String) -> Self {
        Self {
            kind: "Pod".to_string(),
            name,
        }
    }
}

/// Something worth an Event on the InferenceService.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    pub warning: bool,
    pub reason: &'static str,
    pub message: String,
    pub related: Option<Related>,
}

/// The desired objects and the changes that get there.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Objects to apply: those missing, or whose desired form differs from the one last
    /// applied (by [`labels::APPLIED_DIGEST`]).
    pub services: Vec<Service>,
    pub disruption_budget: Option<PodDisruptionBudget>,
    pub rank_tables: Vec<ConfigMap>,
    pub pod_groups: Vec<DynamicObject>,
    /// Applied every time: no cache watches InferencePools.
    pub inference_pool: Option<DynamicObject>,
    /// Pods that do not exist yet.
    pub create_pods: Vec<Pod>,
    pub delete_pods: Vec<String>,
    /// Pods to label [`labels::EVICTABLE`]: the peers of an evicted rank.
    pub make_evictable: Vec<String>,
    /// Pods evicted from a lost node: no kubelet will confirm their end, and their group
    /// cannot be made again under the same names until they are gone.
    pub force_delete_pods: Vec<String>,
    pub delete_rank_tables: Vec<String>,
    pub delete_pod_groups: Vec<String>,
    /// The InferencePool made for an endpoint picker the spec no longer names.
    pub delete_inference_pool: Option<String>,
    pub notes: Vec<Note>,
    /// What the status was built from; the controller rebuilds it with the failures of its
    /// writes.
    pub observation: Observation,
    pub status: InferenceServiceStatus,
    /// When a waiting group reaches its progress deadline, so the reconcile runs again then.
    pub recheck_after: Option<Duration>,
}

/// Why a pod that is not ready waits, in the words of whoever said so: the scheduler (an
/// unschedulable pod, a missing PersistentVolumeClaim) or the kubelet (an image that cannot be
/// pulled, a container that cannot be created).
fn waiting_reason(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    let name = pod.name_any();
    let unscheduled = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False");
    if let Some(condition) = unscheduled {
        return Some(format!(
            "pod {name} {}: {}",
            condition.reason.as_deref().unwrap_or("not scheduled"),
            condition.message.as_deref().unwrap_or("no message")
        ));
    }
    let containers = status
        .init_container_statuses
        .iter()
        .flatten()
        .chain(status.container_statuses.iter().flatten());
    for container in containers {
        let Some(waiting) = container.state.as_ref().and_then(|s| s.waiting.as_ref()) else {
            continue;
        };
        let reason = waiting.reason.as_deref().unwrap_or_default();
        // The normal steps of a start, not a reason to worry.
        if reason.is_empty() || reason == "ContainerCreating" || reason == "PodInitializing" {
            continue;
        }
        let mut text = format!("pod {name} container {} {reason}", container.name);
        if let Some(message) = waiting.message.as_deref().filter(|m| !m.is_empty()) {
            text.push_str(": ");
            text.push_str(message);
        }
        return Some(text);
    }
    None
}

/// Since when a group that is not ready has been waiting: the newest of its pods' creation
/// and of their last Ready transitions, so a pod that turns unready later starts its clock
/// then.
fn waiting_since(pods: &[&Pod]) -> Option<k8s_openapi::jiff::Timestamp> {
    pods.iter()
        .flat_map(|p| {
            let created = p.metadata.creation_timestamp.as_ref().map(|t| t.0);
            let unready = p
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready" && c.status != "True"))
                .and_then(|c| c.last_transition_time.as_ref())
                .map(|t| t.0);
            created.into_iter().chain(unready)
        })
        .max()
}

fn failure_of(pod: &Pod) -> String {
    let status = pod.status.as_ref();
    let reason = status
        .and_then(|s| s.reason.clone())
        .unwrap_or_else(|| "Failed".to_string());
    let message = status.and_then(|s| s.message.clone()).unwrap_or_default();
    let mut text = format!("pod {} failed ({reason})", pod.name_any());
    if !message.is_empty() {
        text.push_str(": ");
        text.push_str(&message);
    }
    text
}

/// The event reason of a replica group being made.
pub const CREATING_GROUP: &str = "CreatingGroup";

/// How long the peers of an evicted rank wait for the drain that evicted it to evict them
/// too (kubectl retries every 5 s) before the operator deletes them itself. Were they deleted
/// at once, their group would be made again under the same names before the drain retried,
/// and the drain would evict the new pods by those names: every group recreated twice.
pub const EVICTED_PEER_GRACE: Duration = Duration::from_secs(20);

/// How soon a reconcile runs again while a pod is settling.
pub const SETTLING_RECHECK: Duration = Duration::from_secs(10);

/// Terminating, or placed on a node and not ready: the cluster is expected to move it on.
fn is_settling(pod: &Pod) -> bool {
    let placed = pod.spec.as_ref().is_some_and(|s| s.node_name.is_some());
    pod.metadata.deletion_timestamp.is_some() || (placed && !pods::serves(pod))
}

/// Brings the next reconcile forward to at most `within` from now.
fn recheck_within(recheck_after: &mut Option<Duration>, within: Duration) {
    *recheck_after = Some(recheck_after.map_or(within, |r| r.min(within)));
}

/// Evicted by the taint manager from a node that stopped reporting (the Pod's
/// `DisruptionTarget` condition says so) and still waiting for that node's kubelet.
fn evicted_from_lost_node(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_some()
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|conditions| {
                conditions.iter().any(|c| {
                    c.type_ == "DisruptionTarget"
                        && c.status == "True"
                        && c.reason.as_deref() == Some("DeletionByTaintManager")
                })
            })
}

/// The replica group numbers to run, given the groups with live pods (mapped to whether the
/// autoscaler marked them for removal). Scaling down drops marked groups first, so the
/// least-loaded groups go, then the highest-numbered; scaling up takes the lowest free numbers.
pub fn kept_groups(existing: &BTreeMap<i32, bool>, desired: i32) -> BTreeSet<i32> {
    let desired = usize::try_from(desired).unwrap_or(0);
    let mut kept: BTreeSet<i32> = existing.keys().copied().collect();
    if kept.len() > desired {
        let mut removal_order: Vec<(&i32, &bool)> = existing.iter().collect();
        removal_order.sort_by_key(|&(&group, &marked)| (!marked, std::cmp::Reverse(group)));
        let surplus = kept.len() - desired;
        for (group, _) in removal_order.into_iter().take(surplus) {
            kept.remove(group);
        }
    }
    let missing = desired - kept.len();
    let free: Vec<i32> = (0..)
        .filter(|group| !existing.contains_key(group))
        .take(missing)
        .collect();
    kept.extend(free);
    kept
}

/// The replica groups to run: those asked for, as far as `max_pods` pods hold them.
pub fn groups_within_limit(asked: i32, ranks: i32, max_pods: u32) -> i32 {
    let fit = i32::try_from(max_pods).unwrap_or(i32::MAX) / ranks.max(1);
    asked.min(fit)
}

/// What is left of `grace` since `since`.
fn left_of(grace: Duration, since: &Time, now: &Time) -> Duration {
    let elapsed = Duration::try_from(now.0.duration_since(since.0)).unwrap_or_default();
    grace.saturating_sub(elapsed)
}

pub fn plan(isvc: &InferenceService, observed: &Observed, settings: &Settings, now: &Time) -> Plan {
    let asked = crate::autoscaler::desired_replicas(isvc);
    let ranks = isvc.pods_per_replica();
    let desired = groups_within_limit(asked, ranks, settings.max_pods_per_service);
    let hash = resources::template_hash(isvc, settings);
    let scheduler = pod::scheduler_name(isvc);
    let wants_volcano = scheduler.as_deref() == Some("volcano");
    let uses_rank_table = pod::uses_rank_table(isvc);

    let groups = replica_group::groups(&observed.pods);

    let mut create_pods = Vec::new();
    let mut delete_pods = Vec::new();
    let mut notes = Vec::new();
    let force_delete_pods: Vec<String> = observed
        .pods
        .iter()
        .filter(|p| evicted_from_lost_node(p))
        .map(|p| p.name_any())
        .collect();
    for name in &force_delete_pods {
        notes.push(Note {
            warning: true,
            reason: "NodeLost",
            message: format!(
                "pod {name} was evicted from a node that stopped reporting; removing it so its group can be made elsewhere"
            ),
            related: Some(Related::pod(name.clone())),
        });
    }
    let mut seen = Observation {
        desired_groups: desired,
        uses_rank_table,
        volcano_missing: wants_volcano && !observed.volcano_served,
        ..Default::default()
    };
    if desired < asked {
        let message = format!(
            "{asked} replica groups of {ranks} pods would be {} pods; this operator runs at most {} pods per InferenceService (--max-pods-per-service), so {desired} replica groups",
            i64::from(asked) * i64::from(ranks),
            settings.max_pods_per_service
        );
        if isvc.status.as_ref().is_none_or(|s| {
            !s.conditions
                .iter()
                .any(|c| c.reason == status::POD_LIMIT_EXCEEDED && c.message == message)
        }) {
            notes.push(Note {
                warning: true,
                reason: status::POD_LIMIT_EXCEEDED,
                message: message.clone(),
                related: None,
            });
        }
        seen.pod_limit = Some(message);
    }
    let mut make_evictable = Vec::new();
    // Pods this reconcile may still create: a group is never split, so one larger than the
    // batch is made alone.
    let mut create_budget = settings::CREATE_BATCH_PODS.max(u32::try_from(ranks).unwrap_or(1));
    let mut rank_tables = Vec::new();
    let mut outdated = Vec::new();
    let mut in_transition = false;
    let mut failures = Vec::new();
    let mut recheck_after = None;
    let progress_deadline = k8s_openapi::jiff::SignedDuration::from_secs(i64::from(
        isvc.spec.progress_deadline_seconds,
    ));

    let existing: BTreeMap<i32, bool> = groups
        .iter()
        .filter(|(_, group)| !group.live.is_empty())
        .map(|(&g, group)| {
            let marked = group
                .live
                .values()
                .any(|p| p.annotations().contains_key(SCALE_DOWN_ANNOTATION));
            (g, marked)
        })
        .collect();
    // While groups run an outdated spec, up to `maxSurge` extra groups are made ahead of
    // replacing them, so serving capacity never drops below `desired` during a rollout.
    let stale_groups = groups
        .values()
        .filter(|group| {
            group
                .live
                .values()
                .any(|p| p.labels().get(labels::TEMPLATE_HASH) != Some(&hash))
        })
        .count();
    let surge = usize::try_from(isvc.spec.rollout.max_surge)
        .unwrap_or(0)
        .min(stale_groups);
    let kept = kept_groups(&existing, desired.saturating_add(surge as i32));

    for (&g, group) in &groups {
        if !group.live.is_empty() && !kept.contains(&g) {
            delete_pods.extend(group.live.values().map(|p| p.name_any()));
            notes.push(Note {
                warning: false,
                reason: "ScaledDown",
                message: format!("deleting replica group {g}"),
                related: Some(Related::pod(names::pod(isvc, g, 0))),
            });
        }
    }

    for &g in &kept {
        let empty = ReplicaGroup::default();
        let group = groups.get(&g).unwrap_or(&empty);
        let failed = group.live.values().find(|p| phase(p) == "Failed");
        let complete = group.is_complete(ranks);
        let stale = group
            .live
            .values()
            .any(|p| p.labels().get(labels::TEMPLATE_HASH) != Some(&hash));
        let mut recreating = false;

        let mut failed_pod = None;
        if let Some(failed) = failed {
            failures.push(failure_of(failed));
            failed_pod = Some(failed.name_any());
            recreating = true;
        } else if !group.live.is_empty() && !complete && !stale {
            let missing: Vec<String> = (0..ranks)
                .filter(|r| !group.live.contains_key(r))
                .map(|r| r.to_string())
                .collect();
            failures.push(format!(
                "replica group {g} lost rank(s) {}",
                missing.join(",")
            ));
            recreating = true;
        } else if !group.live.is_empty() && !complete {
            // Built for another tensor-parallel layout: nothing to keep serving.
            delete_pods.extend(group.live.values().map(|p| p.name_any()));
            notes.push(Note {
                warning: false,
                reason: "RollingGroup",
                message: format!("replacing replica group {g} with the current spec"),
                related: Some(Related::pod(names::pod(isvc, g, 0))),
            });
            in_transition = true;
            continue;
        }

        // A rank lost to an eviction: its peers leave the disruption budget and are left for
        // the evicting drain, for a while, rather than deleted at once.
        let drain_grace = observed
            .evictions
            .get(&g)
            .filter(|_| recreating && failed_pod.is_none())
            .map(|at| left_of(EVICTED_PEER_GRACE, at, now))
            .filter(|left| !left.is_zero());
        if let Some(left) = drain_grace {
            let newly: Vec<String> = group
                .live
                .values()
                .filter(|p| !p.labels().contains_key(labels::EVICTABLE))
                .map(|p| p.name_any())
                .collect();
            if !newly.is_empty() {
                notes.push(Note {
                    warning: true,
                    reason: "GroupRecreating",
                    message: format!(
                        "recreating replica group {g}: {}; evicted, so its other pods ({}) leave the disruption budget for the eviction's drain, and are deleted in {}s if it does not evict them",
                        failures.last().cloned().unwrap_or_default(),
                        newly.join(", "),
                        left.as_secs()
                    ),
                    related: Some(Related::pod(names::pod(isvc, g, 0))),
                });
            }
            make_evictable.extend(newly);
            recheck_within(&mut recheck_after, left);
            in_transition = true;
        } else if recreating {
            delete_pods.extend(group.live.values().map(|p| p.name_any()));
            notes.push(Note {
                warning: true,
                reason: "GroupRecreating",
                message: format!(
                    "recreating replica group {g}: {}",
                    failures.last().cloned().unwrap_or_default()
                ),
                related: Some(Related::pod(
                    failed_pod.unwrap_or_else(|| names::pod(isvc, g, 0)),
                )),
            });
            in_transition = true;
        } else if group.live.is_empty() {
            in_transition = true;
            let fits = u32::try_from(ranks).unwrap_or(0) <= create_budget;
            if group.terminating == 0 && fits {
                create_budget -= u32::try_from(ranks).unwrap_or(0);
                create_pods.extend((0..ranks).map(|r| pod::build(isvc, settings, g, r, &hash)));
                notes.push(Note {
                    warning: false,
                    reason: CREATING_GROUP,
                    message: format!("creating replica group {g} ({ranks} pods)"),
                    related: Some(Related::pod(names::pod(isvc, g, 0))),
                });
            } else if group.terminating == 0 {
                // Made by a later reconcile, rank table and all; this one's status shows
                // how far it got.
                seen.groups_to_create += 1;
                continue;
            }
        } else {
            if group.is_ready(ranks) {
                seen.ready_groups += 1;
            } else {
                in_transition = true;
                let waiting = group
                    .live
                    .values()
                    .filter(|p| !pods::serves(p))
                    .find_map(|p| waiting_reason(p));
                let pods: Vec<&Pod> = group.live.values().copied().collect();
                let deadline = waiting_since(&pods).map(|since| since + progress_deadline);
                match deadline {
                    Some(deadline) if deadline <= now.0 => {
                        let message = format!(
                            "replica group {g} not ready within spec.progressDeadlineSeconds ({}s): {}",
                            isvc.spec.progress_deadline_seconds,
                            waiting.as_deref().unwrap_or("its pods are not ready")
                        );
                        if seen.stalled.is_none() {
                            notes.push(Note {
                                warning: true,
                                reason: "ProgressDeadlineExceeded",
                                message: message.clone(),
                                related: Some(Related::pod(names::pod(isvc, g, 0))),
                            });
                            seen.stalled = Some(message);
                        }
                    }
                    Some(deadline) => {
                        let left =
                            Duration::try_from(deadline.duration_since(now.0)).unwrap_or_default();
                        recheck_within(&mut recheck_after, left);
                    }
                    None => {}
                }
                if seen.waiting.is_none() {
                    seen.waiting = waiting;
                }
            }
            if stale {
                outdated.push(g);
            }
        }
        seen.any_pod_running |= group.live.values().any(|p| phase(p) == "Running");

        if uses_rank_table {
            let members: Vec<Option<&Pod>> = (0..ranks)
                .map(|r| {
                    if recreating {
                        None
                    } else {
                        group.live.get(&r).copied()
                    }
                })
                .collect();
            let table = rank_table::build(&members, isvc.spec.accelerator.devices_per_pod);
            if table.status == npufleet_contract::rank_table::STATUS_COMPLETED {
                seen.rank_tables_completed += 1;
            }
            rank_tables.push(resources::rank_table_config_map(isvc, g, &table));
        }
    }

    // Every change reaches the reconcile through a watch, but a pod the cluster is moving on
    // (terminating, or on a node and not ready) is looked at again soon regardless: one
    // missed event must not leave a group unrepaired until the periodic resync.
    if observed.pods.iter().any(is_settling) {
        recheck_within(&mut recheck_after, SETTLING_RECHECK);
    }
    if seen.groups_to_create > 0 {
        recheck_within(&mut recheck_after, Duration::ZERO);
    }
    seen.outdated_groups = outdated.len() as i32;
    // Roll one group at a time, and only while every other group (surge groups included) is
    // serving: with a surge group ready, taking an outdated one out leaves `desired` serving.
    if let (false, Some(&g)) = (in_transition, outdated.first()) {
        if let Some(group) = groups.get(&g) {
            delete_pods.extend(group.live.values().map(|p| p.name_any()));
        }
        notes.push(Note {
            warning: false,
            reason: "RollingGroup",
            message: format!("replacing replica group {g} with the current spec"),
            related: Some(Related::pod(names::pod(isvc, g, 0))),
        });
    }
    seen.existing_groups = groups.values().filter(|g| !g.live.is_empty()).count() as i32;
    if !failures.is_empty() {
        seen.failure = Some(failures.join("; "));
    }

    let rank_table_names: Vec<String> = kept
        .iter()
        .filter(|_| uses_rank_table)
        .map(|&g| names::rank_table(isvc, g))
        .collect();
    let pod_groups: Vec<DynamicObject> = if wants_volcano && observed.volcano_served {
        kept.iter().map(|&g| pod_group::build(isvc, g)).collect()
    } else {
        Vec::new()
    };
    let pod_group_names: Vec<String> = pod_groups.iter().map(|o| o.name_any()).collect();

    let picker = isvc.spec.routing.endpoint_picker.as_ref();
    let inference_pool = picker
        .filter(|_| observed.inference_pools_served)
        .map(|picker| inference_pool::build(isvc, picker));
    if picker.is_some() && !observed.inference_pools_served {
        notes.push(Note {
            warning: true,
            reason: "InferencePoolNotServed",
            message: format!(
                "spec.routing.endpointPicker is set but {} InferencePools are not served; install the Gateway API Inference Extension CRDs",
                inference_pool::API_VERSION
            ),
            related: None,
        });
    }
    seen.inference_pool = inference_pool.as_ref().map(|pool| pool.name_any());
    let made_pool = isvc.status.as_ref().and_then(|s| s.inference_pool.clone());
    // Where the API is no longer served, the pools went with it.
    let delete_inference_pool =
        made_pool.filter(|_| inference_pool.is_none() && observed.inference_pools_served);

    let changed = Changed(&observed.applied);
    Plan {
        services: [services::headless(isvc), services::client(isvc)]
            .into_iter()
            .filter_map(|s| changed.stamp(s))
            .collect(),
        disruption_budget: changed.stamp(services::disruption_budget(isvc, desired)),
        rank_tables: rank_tables
            .into_iter()
            .filter_map(|t| changed.stamp(t))
            .collect(),
        pod_groups: pod_groups
            .into_iter()
            .filter_map(|g| changed.stamp(g))
            .collect(),
        inference_pool,
        create_pods,
        delete_pods,
        make_evictable,
        force_delete_pods,
        delete_rank_tables: observed
            .rank_tables
            .iter()
            .filter(|n| !rank_table_names.contains(n))
            .cloned()
            .collect(),
        delete_pod_groups: observed
            .pod_groups
            .iter()
            .filter(|n| !pod_group_names.contains(n))
            .cloned()
            .collect(),
        delete_inference_pool,
        notes,
        status: status::build(isvc, settings, &seen, now),
        observation: seen,
        recheck_after,
    }
}

/// Picks out the desired objects that need applying.
struct Changed<'a>(&'a BTreeMap<(String, String), String>);

impl Changed<'_> {
    /// `object` with its [`labels::APPLIED_DIGEST`], or `None` when the cluster's copy
    /// already carries that digest.
    fn stamp<K>(&self, mut object: K) -> Option<K>
    where
        K: kube::Resource + serde::Serialize,
    {
        let value = serde_json::to_value(&object).unwrap_or_default();
        let kind = value["kind"].as_str().unwrap_or_default().to_string();
        let digest = resources::digest(&value);
        if self.0.get(&(kind, object.name_any())) == Some(&digest) {
            return None;
        }
        object
            .annotations_mut()
            .insert(labels::APPLIED_DIGEST.to_string(), digest);
        Some(object)
    }
}

#[cfg(test)]
mod tests;

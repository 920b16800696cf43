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

use crate::fleet::{self, ReplicaGroup, phase};
use crate::labels;
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
        // A container in CrashLoopBackOff: the back-off says when, its last exit says why.
        let last = container
            .last_state
            .as_ref()
            .and_then(|s| s.terminated.as_ref());
        if let Some(exit) = last {
            text.push_str("; last exit ");
            text.push_str(&pods::exit_summary(exit));
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
    format!("pod {} {}", pod.name_any(), pods::failure(pod))
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

/// What decides which groups go first when there are more than wanted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Standing {
    /// The built-in autoscaler chose it for removal, as the least loaded.
    pub marked: bool,
    /// Built from an older spec.
    pub stale: bool,
    /// Every pod of it serves.
    pub serving: bool,
}

/// The replica group numbers to run, given the groups with live pods. Scaling down drops
/// the groups the autoscaler marked first (the least loaded), then those of an older spec,
/// then those not serving, then the highest-numbered; scaling up takes the lowest free
/// numbers.
pub fn kept_groups(existing: &BTreeMap<i32, Standing>, desired: i32) -> BTreeSet<i32> {
    let desired = usize::try_from(desired).unwrap_or(0);
    let mut kept: BTreeSet<i32> = existing.keys().copied().collect();
    if kept.len() > desired {
        let mut removal_order: Vec<(&i32, &Standing)> = existing.iter().collect();
        removal_order.sort_by_key(|&(&group, standing)| {
            (
                !standing.marked,
                !standing.stale,
                standing.serving,
                std::cmp::Reverse(group),
            )
        });
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

/// The reconcile, stage by stage: [`count`] the replica groups to run, choose which
/// ([`membership`]), bring each to the current spec ([`rollout`]), build the objects around
/// them ([`objects`]) and say how far it got ([`status::build`]).
pub fn plan(isvc: &InferenceService, observed: &Observed, settings: &Settings, now: &Time) -> Plan {
    let count = count(isvc, settings);
    let groups = fleet::groups(&observed.pods);
    let hash = resources::template_hash(isvc, settings);
    let membership = membership(
        &groups,
        count.desired,
        count.ranks,
        isvc.spec.rollout.max_surge,
        &hash,
    );
    let inputs = Inputs {
        isvc,
        observed,
        settings,
        now,
        count: &count,
        hash: &hash,
    };
    let Rollout {
        changes,
        rank_tables,
        mut seen,
    } = rollout(&inputs, &groups, &membership);
    let objects = objects(isvc, observed, &membership.kept, count.desired, rank_tables);
    seen.inference_pool = objects.inference_pool.as_ref().map(|pool| pool.name_any());
    let mut notes = changes.notes;
    notes.extend(objects.note);
    Plan {
        services: objects.services,
        disruption_budget: objects.disruption_budget,
        rank_tables: objects.rank_tables,
        pod_groups: objects.pod_groups,
        inference_pool: objects.inference_pool,
        create_pods: changes.create_pods,
        delete_pods: changes.delete_pods,
        make_evictable: changes.make_evictable,
        force_delete_pods: changes.force_delete_pods,
        delete_rank_tables: objects.delete_rank_tables,
        delete_pod_groups: objects.delete_pod_groups,
        delete_inference_pool: objects.delete_inference_pool,
        notes,
        status: status::build(isvc, settings, &seen, now),
        observation: seen,
        recheck_after: changes.recheck_after,
    }
}

/// Stage one: how many replica groups to run.
#[derive(Debug, Clone, PartialEq)]
pub struct Count {
    /// The groups asked for by whoever owns the count.
    pub asked: i32,
    /// Pods per group.
    pub ranks: i32,
    /// The groups to run: those asked for, as far as the operator's pod limit holds them.
    pub desired: i32,
    /// Why `desired` is below `asked`.
    pub pod_limit: Option<String>,
}

pub fn count(isvc: &InferenceService, settings: &Settings) -> Count {
    let asked = fleet::desired_groups(isvc);
    let ranks = isvc.pods_per_replica();
    let desired = groups_within_limit(asked, ranks, settings.max_pods_per_service);
    let pod_limit = (desired < asked).then(|| {
        format!(
            "{asked} replica groups of {ranks} pods would be {} pods; this operator runs at most {} pods per InferenceService (--max-pods-per-service), so {desired} replica groups",
            i64::from(asked) * i64::from(ranks),
            settings.max_pods_per_service
        )
    });
    Count {
        asked,
        ranks,
        desired,
        pod_limit,
    }
}

/// The warning that the pod limit cuts the count, unless the status already carries it.
fn pod_limit_note(isvc: &InferenceService, count: &Count) -> Option<Note> {
    let message = count.pod_limit.as_ref()?;
    let said = isvc.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.reason == status::POD_LIMIT_EXCEEDED && &c.message == message)
    });
    (!said).then(|| Note {
        warning: true,
        reason: status::POD_LIMIT_EXCEEDED,
        message: message.clone(),
        related: None,
    })
}

/// Stage two: the replica group numbers to run, and the groups with pods that go.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Membership {
    pub kept: BTreeSet<i32>,
    pub scaled_down: Vec<i32>,
}

/// While groups run an outdated spec (`hash` is the current one), up to `max_surge` extra
/// groups are kept ahead of replacing them, so serving capacity never drops below `desired`
/// during a rollout.
pub fn membership(
    groups: &BTreeMap<i32, ReplicaGroup>,
    desired: i32,
    ranks: i32,
    max_surge: i32,
    hash: &str,
) -> Membership {
    let existing: BTreeMap<i32, Standing> = groups
        .iter()
        .filter(|(_, group)| !group.live.is_empty())
        .map(|(&g, group)| {
            let standing = Standing {
                marked: group.is_marked(),
                stale: is_stale(group, hash),
                serving: group.is_ready(ranks),
            };
            (g, standing)
        })
        .collect();
    let stale_groups = existing.values().filter(|s| s.stale).count();
    let surge = usize::try_from(max_surge).unwrap_or(0).min(stale_groups);
    let surge = i32::try_from(surge).unwrap_or(i32::MAX);
    let kept = kept_groups(&existing, desired.saturating_add(surge));
    let scaled_down = existing
        .keys()
        .filter(|g| !kept.contains(g))
        .copied()
        .collect();
    Membership { kept, scaled_down }
}

/// Some live pod of `group` was built from another spec than the one `hash` digests.
fn is_stale(group: &ReplicaGroup, hash: &str) -> bool {
    group
        .live
        .values()
        .any(|p| p.labels().get(labels::TEMPLATE_HASH).map(String::as_str) != Some(hash))
}

/// What the rollout stage reads.
struct Inputs<'a> {
    isvc: &'a InferenceService,
    observed: &'a Observed,
    settings: &'a Settings,
    now: &'a Time,
    count: &'a Count,
    /// The current [`resources::template_hash`].
    hash: &'a str,
}

/// The changes to pods the rollout makes, and why.
#[derive(Debug, Default, Clone)]
pub struct PodChanges {
    pub create_pods: Vec<Pod>,
    pub delete_pods: Vec<String>,
    pub make_evictable: Vec<String>,
    pub force_delete_pods: Vec<String>,
    pub notes: Vec<Note>,
    pub recheck_after: Option<Duration>,
}

/// Stage three's result: the pod changes, the rank tables of the kept groups, and what the
/// status is built from.
#[derive(Debug, Clone)]
pub struct Rollout {
    pub changes: PodChanges,
    pub rank_tables: Vec<ConfigMap>,
    pub seen: Observation,
}

/// Stage three: every kept group brought towards the current spec — failed ones recreated,
/// missing ones created a batch at a time, outdated ones replaced one at a time.
fn rollout(
    inputs: &Inputs,
    groups: &BTreeMap<i32, ReplicaGroup>,
    membership: &Membership,
) -> Rollout {
    let mut rolling = Rolling::new(inputs);
    rolling.remove_lost_node_pods();
    rolling
        .changes
        .notes
        .extend(pod_limit_note(inputs.isvc, inputs.count));
    for &g in &membership.scaled_down {
        rolling.scale_down(g, &groups[&g]);
    }
    let empty = ReplicaGroup::default();
    for &g in &membership.kept {
        rolling.group(g, groups.get(&g).unwrap_or(&empty));
    }
    rolling.finish(groups)
}

/// The rollout under way.
struct Rolling<'a> {
    inputs: &'a Inputs<'a>,
    changes: PodChanges,
    rank_tables: Vec<ConfigMap>,
    seen: Observation,
    /// Pods this reconcile may still create: a group is never split, so one larger than the
    /// batch is made alone.
    create_budget: u32,
    failures: Vec<String>,
    /// Some group is being made, repaired or is not ready yet.
    in_transition: bool,
    /// Groups running an outdated spec, and whether each serves.
    outdated: Vec<(i32, bool)>,
}

/// How a kept group's pods stand.
enum Health {
    /// No rank is lost or failed (the group may be empty, or not ready yet).
    Whole,
    /// A rank failed (that pod) or is missing: the group is made again.
    Broken { failed_pod: Option<String> },
    /// Built for another tensor-parallel layout: nothing to keep serving.
    OtherLayout,
}

impl<'a> Rolling<'a> {
    fn new(inputs: &'a Inputs<'a>) -> Self {
        let ranks = inputs.count.ranks;
        let wants_volcano = pod::scheduler_name(inputs.isvc).as_deref() == Some("volcano");
        Self {
            inputs,
            changes: PodChanges::default(),
            rank_tables: Vec::new(),
            seen: Observation {
                desired_groups: inputs.count.desired,
                uses_rank_table: pod::uses_rank_table(inputs.isvc),
                volcano_missing: wants_volcano && !inputs.observed.volcano_served,
                pod_limit: inputs.count.pod_limit.clone(),
                ..Default::default()
            },
            create_budget: settings::CREATE_BATCH_PODS.max(u32::try_from(ranks).unwrap_or(1)),
            failures: Vec::new(),
            in_transition: false,
            outdated: Vec::new(),
        }
    }

    fn note(&mut self, warning: bool, reason: &'static str, message: String, pod: String) {
        self.changes.notes.push(Note {
            warning,
            reason,
            message,
            related: Some(Related::pod(pod)),
        });
    }

    fn first_pod(&self, g: i32) -> String {
        names::pod(self.inputs.isvc, g, 0)
    }

    fn delete_group(&mut self, group: &ReplicaGroup) {
        let names = group.live.values().map(|p| p.name_any());
        self.changes.delete_pods.extend(names);
    }

    fn remove_lost_node_pods(&mut self) {
        let lost: Vec<String> = self
            .inputs
            .observed
            .pods
            .iter()
            .filter(|p| evicted_from_lost_node(p))
            .map(|p| p.name_any())
            .collect();
        for name in &lost {
            let message = format!(
                "pod {name} was evicted from a node that stopped reporting; removing it so its group can be made elsewhere"
            );
            self.note(true, "NodeLost", message, name.clone());
        }
        self.changes.force_delete_pods = lost;
    }

    fn scale_down(&mut self, g: i32, group: &ReplicaGroup) {
        self.delete_group(group);
        let pod = self.first_pod(g);
        self.note(
            false,
            "ScaledDown",
            format!("deleting replica group {g}"),
            pod,
        );
    }

    /// One kept group: repaired, made, or watched until it serves; and its rank table.
    fn group(&mut self, g: i32, group: &ReplicaGroup) {
        let failed_pod = match self.health(g, group) {
            Health::OtherLayout => return self.replace_now(g, group),
            Health::Broken { failed_pod } => Some(failed_pod),
            Health::Whole => None,
        };
        let recreating = failed_pod.is_some();
        let drain_grace = self
            .inputs
            .observed
            .evictions
            .get(&g)
            .filter(|_| matches!(failed_pod, Some(None)))
            .map(|at| left_of(EVICTED_PEER_GRACE, at, self.inputs.now))
            .filter(|left| !left.is_zero());
        if let Some(left) = drain_grace {
            self.leave_for_drain(g, group, left);
        } else if let Some(failed_pod) = failed_pod {
            self.recreate(g, group, failed_pod);
        } else if group.live.is_empty() {
            if !self.create(g, group) {
                return;
            }
        } else {
            self.watch(g, group);
        }
        self.seen.any_pod_running |= group.live.values().any(|p| phase(p) == "Running");
        if self.seen.uses_rank_table {
            self.rank_table(g, group, recreating);
        }
    }

    /// Whether `group` lost or failed a rank; a loss is recorded as a failure.
    fn health(&mut self, g: i32, group: &ReplicaGroup) -> Health {
        let ranks = self.inputs.count.ranks;
        if let Some(failed) = group.live.values().find(|p| phase(p) == "Failed") {
            self.failures.push(failure_of(failed));
            return Health::Broken {
                failed_pod: Some(failed.name_any()),
            };
        }
        if group.live.is_empty() || group.is_complete(ranks) {
            return Health::Whole;
        }
        if is_stale(group, self.inputs.hash) {
            return Health::OtherLayout;
        }
        let missing: Vec<String> = (0..ranks)
            .filter(|r| !group.live.contains_key(r))
            .map(|r| r.to_string())
            .collect();
        self.failures.push(format!(
            "replica group {g} lost rank(s) {}",
            missing.join(",")
        ));
        Health::Broken { failed_pod: None }
    }

    fn replace_now(&mut self, g: i32, group: &ReplicaGroup) {
        self.delete_group(group);
        self.note_replacing(g);
        self.in_transition = true;
    }

    fn note_replacing(&mut self, g: i32) {
        let message = format!("replacing replica group {g} with the current spec");
        let pod = self.first_pod(g);
        self.note(false, "RollingGroup", message, pod);
    }

    /// A rank lost to an eviction: its peers leave the disruption budget and are left for
    /// the evicting drain, for a while, rather than deleted at once.
    fn leave_for_drain(&mut self, g: i32, group: &ReplicaGroup, left: Duration) {
        let newly: Vec<String> = group
            .live
            .values()
            .filter(|p| !p.labels().contains_key(labels::EVICTABLE))
            .map(|p| p.name_any())
            .collect();
        if !newly.is_empty() {
            let message = format!(
                "recreating replica group {g}: {}; evicted, so its other pods ({}) leave the disruption budget for the eviction's drain, and are deleted in {}s if it does not evict them",
                self.failures.last().cloned().unwrap_or_default(),
                newly.join(", "),
                left.as_secs()
            );
            let pod = self.first_pod(g);
            self.note(true, "GroupRecreating", message, pod);
        }
        self.changes.make_evictable.extend(newly);
        recheck_within(&mut self.changes.recheck_after, left);
        self.in_transition = true;
    }

    fn recreate(&mut self, g: i32, group: &ReplicaGroup, failed_pod: Option<String>) {
        self.delete_group(group);
        let message = format!(
            "recreating replica group {g}: {}",
            self.failures.last().cloned().unwrap_or_default()
        );
        let pod = failed_pod.unwrap_or_else(|| self.first_pod(g));
        self.note(true, "GroupRecreating", message, pod);
        self.in_transition = true;
    }

    /// Makes a group with no live pods once its old pods are gone, if the batch holds it;
    /// `false` when a later reconcile makes it, rank table and all.
    fn create(&mut self, g: i32, group: &ReplicaGroup) -> bool {
        self.in_transition = true;
        if group.terminating > 0 {
            return true;
        }
        let ranks = self.inputs.count.ranks;
        let size = u32::try_from(ranks).unwrap_or(0);
        if size > self.create_budget {
            // This reconcile's status shows how far it got.
            self.seen.groups_to_create += 1;
            return false;
        }
        self.create_budget -= size;
        let Inputs {
            isvc,
            settings,
            hash,
            ..
        } = *self.inputs;
        let pods = (0..ranks).map(|r| pod::build(isvc, settings, g, r, hash));
        self.changes.create_pods.extend(pods);
        let message = format!("creating replica group {g} ({ranks} pods)");
        let pod = self.first_pod(g);
        self.note(false, CREATING_GROUP, message, pod);
        true
    }

    /// A group with all its ranks: counted when it serves, else timed against the progress
    /// deadline; queued for replacement when it runs an outdated spec.
    fn watch(&mut self, g: i32, group: &ReplicaGroup) {
        let serving = group.is_ready(self.inputs.count.ranks);
        if serving {
            self.seen.ready_groups += 1;
        } else {
            self.in_transition = true;
            self.wait_for_ready(g, group);
        }
        if is_stale(group, self.inputs.hash) {
            self.outdated.push((g, serving));
        }
    }

    fn wait_for_ready(&mut self, g: i32, group: &ReplicaGroup) {
        let isvc = self.inputs.isvc;
        let now = self.inputs.now;
        let waiting = group
            .live
            .values()
            .filter(|p| !pods::serves(p))
            .find_map(|p| waiting_reason(p));
        let progress_deadline = k8s_openapi::jiff::SignedDuration::from_secs(i64::from(
            isvc.spec.progress_deadline_seconds,
        ));
        let pods: Vec<&Pod> = group.live.values().copied().collect();
        match waiting_since(&pods).map(|since| since + progress_deadline) {
            Some(deadline) if deadline <= now.0 => self.stall(g, waiting.as_deref()),
            Some(deadline) => {
                let left = Duration::try_from(deadline.duration_since(now.0)).unwrap_or_default();
                recheck_within(&mut self.changes.recheck_after, left);
            }
            None => {}
        }
        if self.seen.waiting.is_none() {
            self.seen.waiting = waiting;
        }
    }

    /// Says once per reconcile that a group missed its progress deadline, and why.
    fn stall(&mut self, g: i32, waiting: Option<&str>) {
        if self.seen.stalled.is_some() {
            return;
        }
        let message = format!(
            "replica group {g} not ready within spec.progressDeadlineSeconds ({}s): {}",
            self.inputs.isvc.spec.progress_deadline_seconds,
            waiting.unwrap_or("its pods are not ready")
        );
        let pod = self.first_pod(g);
        self.note(true, "ProgressDeadlineExceeded", message.clone(), pod);
        self.seen.stalled = Some(message);
    }

    /// The group's rank table; a group being made again lists none of its old pods.
    fn rank_table(&mut self, g: i32, group: &ReplicaGroup, recreating: bool) {
        let isvc = self.inputs.isvc;
        let members: Vec<Option<&Pod>> = (0..self.inputs.count.ranks)
            .map(|r| group.live.get(&r).copied().filter(|_| !recreating))
            .collect();
        let table = rank_table::build(&members, isvc.spec.accelerator.devices_per_pod);
        if table.status == npufleet_contract::rank_table::STATUS_COMPLETED {
            self.seen.rank_tables_completed += 1;
        }
        self.rank_tables
            .push(resources::rank_table_config_map(isvc, g, &table));
    }

    /// Rolls one outdated group, and counts what was seen.
    fn finish(mut self, groups: &BTreeMap<i32, ReplicaGroup>) -> Rollout {
        // Every change reaches the reconcile through a watch, but a pod the cluster is moving
        // on (terminating, or on a node and not ready) is looked at again soon regardless:
        // one missed event must not leave a group unrepaired until the periodic resync.
        if self.inputs.observed.pods.iter().any(is_settling) {
            recheck_within(&mut self.changes.recheck_after, SETTLING_RECHECK);
        }
        if self.seen.groups_to_create > 0 {
            recheck_within(&mut self.changes.recheck_after, Duration::ZERO);
        }
        self.seen.outdated_groups = i32::try_from(self.outdated.len()).unwrap_or(i32::MAX);
        // An outdated group that does not serve (crash-looping on the spec it was made with)
        // holds no capacity: it is replaced at once, or it would hold up the rollout that
        // fixes it. One that serves goes only while every other group (surge groups
        // included) serves: with a surge group ready, taking it out leaves `desired` serving.
        let next = match self.outdated.iter().find(|&&(_, serving)| !serving) {
            Some(&next) => Some(next),
            None if !self.in_transition => self.outdated.first().copied(),
            None => None,
        };
        if let Some((g, serving)) = next {
            if let Some(group) = groups.get(&g) {
                self.delete_group(group);
            }
            if serving {
                self.note_replacing(g);
            } else {
                // A surge group is not made again once nothing is outdated: "deleting" holds
                // either way.
                let message =
                    format!("deleting replica group {g}: it runs an older spec and does not serve");
                let pod = self.first_pod(g);
                self.note(false, "RollingGroup", message, pod);
            }
        }
        let existing = groups.values().filter(|g| !g.live.is_empty()).count();
        self.seen.existing_groups = i32::try_from(existing).unwrap_or(i32::MAX);
        if !self.failures.is_empty() {
            self.seen.failure = Some(self.failures.join("; "));
        }
        Rollout {
            changes: self.changes,
            rank_tables: self.rank_tables,
            seen: self.seen,
        }
    }
}

/// Stage four: the objects around the groups, those to apply and those to delete.
#[derive(Debug, Clone, Default)]
pub struct Objects {
    pub services: Vec<Service>,
    pub disruption_budget: Option<PodDisruptionBudget>,
    pub rank_tables: Vec<ConfigMap>,
    pub pod_groups: Vec<DynamicObject>,
    pub inference_pool: Option<DynamicObject>,
    pub delete_rank_tables: Vec<String>,
    pub delete_pod_groups: Vec<String>,
    pub delete_inference_pool: Option<String>,
    /// Why an endpoint picker gets no InferencePool.
    pub note: Option<Note>,
}

/// The objects of the `kept` groups, given their `rank_tables`, and of the service; only
/// those that differ from what was last applied are kept for applying.
pub fn objects(
    isvc: &InferenceService,
    observed: &Observed,
    kept: &BTreeSet<i32>,
    desired: i32,
    rank_tables: Vec<ConfigMap>,
) -> Objects {
    let wants_volcano = pod::scheduler_name(isvc).as_deref() == Some("volcano");
    let pod_groups: Vec<DynamicObject> = if wants_volcano && observed.volcano_served {
        kept.iter().map(|&g| pod_group::build(isvc, g)).collect()
    } else {
        Vec::new()
    };
    let not_in = |names: &[String], wanted: &[String]| -> Vec<String> {
        let unwanted = names.iter().filter(|n| !wanted.contains(n));
        unwanted.cloned().collect()
    };
    // Every kept group's, also of a group this reconcile did not get to.
    let rank_table_names: Vec<String> = kept
        .iter()
        .filter(|_| pod::uses_rank_table(isvc))
        .map(|&g| names::rank_table(isvc, g))
        .collect();
    let pod_group_names: Vec<String> = pod_groups.iter().map(|o| o.name_any()).collect();
    let (inference_pool, note) = inference_pool(isvc, observed);
    let made_pool = isvc.status.as_ref().and_then(|s| s.inference_pool.clone());
    let changed = Changed(&observed.applied);
    Objects {
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
        // Where the API is no longer served, the pools went with it.
        delete_inference_pool: made_pool
            .filter(|_| inference_pool.is_none() && observed.inference_pools_served),
        inference_pool,
        delete_rank_tables: not_in(&observed.rank_tables, &rank_table_names),
        delete_pod_groups: not_in(&observed.pod_groups, &pod_group_names),
        note,
    }
}

/// The InferencePool for the spec's endpoint picker, or why there is none.
fn inference_pool(
    isvc: &InferenceService,
    observed: &Observed,
) -> (Option<DynamicObject>, Option<Note>) {
    let Some(picker) = isvc.spec.routing.endpoint_picker.as_ref() else {
        return (None, None);
    };
    if observed.inference_pools_served {
        return (Some(inference_pool::build(isvc, picker)), None);
    }
    let note = Note {
        warning: true,
        reason: "InferencePoolNotServed",
        message: format!(
            "spec.routing.endpointPicker is set but {} InferencePools are not served; install the Gateway API Inference Extension CRDs",
            inference_pool::API_VERSION
        ),
        related: None,
    };
    (None, Some(note))
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

//! The InferenceService status from what one reconcile saw: counts, endpoints, model state and
//! Deployment-style conditions whose transition times survive unchanged conditions.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::ResourceExt;
use npufleet_contract::ports;
use npufleet_crds::{Endpoints, InferenceService, InferenceServiceStatus, ModelState};

use crate::labels;
use crate::resources::names;
use crate::settings::Settings;

pub const READY: &str = "Ready";
pub const PROGRESSING: &str = "Progressing";
/// At least `replicas - spec.rollout.maxUnavailable` groups serve, as on a Deployment.
pub const AVAILABLE: &str = "Available";
pub const DEGRADED: &str = "Degraded";
pub const RANK_TABLE_READY: &str = "RankTableReady";
/// Present while the operator cannot create or delete an object, as on a Deployment.
pub const REPLICA_FAILURE: &str = "ReplicaFailure";
/// The `ReplicaFailure` reason while a service asks for more pods than the operator runs.
pub const POD_LIMIT_EXCEEDED: &str = "PodLimitExceeded";
/// Longest message a condition carries here; the API allows 32 KiB, a reader far less.
const MAX_CONDITION_MESSAGE: usize = 4096;

/// What the planner counted.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Observation {
    pub desired_groups: i32,
    /// Groups with at least one live pod, surplus ones included.
    pub existing_groups: i32,
    /// Desired groups whose every rank is running and ready.
    pub ready_groups: i32,
    /// Desired groups running pods built from an older spec.
    pub outdated_groups: i32,
    /// Desired groups whose rank table is `completed` (all of them when no table is used).
    pub rank_tables_completed: i32,
    pub uses_rank_table: bool,
    /// A rank failed during this reconcile and its group is being recreated.
    pub failure: Option<String>,
    pub any_pod_running: bool,
    /// Volcano was asked for but its PodGroup API is not served.
    pub volcano_missing: bool,
    /// Why the first group that is not ready waits (scheduler or kubelet message).
    pub waiting: Option<String>,
    /// A group that has not become ready within the progress deadline, and why.
    pub stalled: Option<String>,
    /// Writes the apiserver refused in this reconcile, with its message (set by the controller).
    pub apply_failures: Vec<String>,
    /// The InferencePool kept for the service's endpoint picker.
    pub inference_pool: Option<String>,
    /// Why fewer replica groups run than asked: the operator's pod limit.
    pub pod_limit: Option<String>,
    /// Desired groups not made yet because this reconcile created its batch of pods.
    pub groups_to_create: i32,
}

/// Cuts `text` to at most `max` bytes on a character boundary.
pub fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max.saturating_sub(3);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

fn set(
    conditions: &mut Vec<Condition>,
    previous: &[Condition],
    generation: Option<i64>,
    now: &Time,
    update: (&str, bool, &str, String),
) {
    let (type_, status, reason, message) = update;
    let status = if status { "True" } else { "False" }.to_string();
    let last_transition_time = previous
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map_or_else(|| now.clone(), |c| c.last_transition_time.clone());
    conditions.push(Condition {
        type_: type_.to_string(),
        status,
        reason: reason.to_string(),
        message,
        observed_generation: generation,
        last_transition_time,
    });
}

fn is_true<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions
        .iter()
        .find(|c| c.type_ == type_ && c.status == "True")
}

/// A condition's status, reason and message.
type Verdict = (bool, String, String);

fn verdict(status: bool, reason: &str, message: String) -> Verdict {
    (status, reason.to_string(), message)
}

pub fn build(
    isvc: &InferenceService,
    settings: &Settings,
    seen: &Observation,
    now: &Time,
) -> InferenceServiceStatus {
    let previous = isvc.status.clone().unwrap_or_default();
    let generation = isvc.metadata.generation;
    let desired = seen.desired_groups;
    let degraded = degraded(seen, &previous.conditions);
    let mut verdicts = vec![
        (READY, ready(seen)),
        (
            AVAILABLE,
            available(seen, isvc.spec.rollout.max_unavailable),
        ),
        (PROGRESSING, progressing(seen)),
        (DEGRADED, degraded.clone()),
    ];
    verdicts.extend(replica_failure(seen).map(|v| (REPLICA_FAILURE, v)));
    verdicts.push((RANK_TABLE_READY, rank_table_ready(seen)));
    let mut conditions = Vec::new();
    for (type_, (status, reason, message)) in verdicts {
        let update = (type_, status, reason.as_str(), message);
        set(
            &mut conditions,
            &previous.conditions,
            generation,
            now,
            update,
        );
    }

    let host = format!(
        "{}.{}.svc.{}",
        names::client_service(isvc),
        isvc.namespace().unwrap_or_default(),
        settings.cluster_domain
    );
    InferenceServiceStatus {
        observed_generation: generation,
        desired_replicas: Some(desired),
        replicas: seen.existing_groups,
        ready_replicas: seen.ready_groups,
        selector: Some(labels::selector_string(&labels::group_leaders(isvc))),
        conditions,
        endpoints: Some(Endpoints {
            grpc: format!("{host}:{}", ports::GRPC_PORT),
            http: format!("http://{host}:{}", ports::HTTP_PORT),
        }),
        model_state: Some(model_state(seen, degraded.0)),
        // Written on its own by the controller (`LAST_FAILURE_MANAGER`), so a later status
        // write that no longer sees the failed pod, or reads a cache that predates the write,
        // cannot take it away: it stays after recovery, like a container's `lastState`.
        last_failure: None,
        // Left out of the operator's apply so the autoscaler's field manager keeps it.
        autoscaling: None,
        inference_pool: seen.inference_pool.clone(),
    }
}

/// Every desired group serves.
fn serving(seen: &Observation) -> bool {
    seen.ready_groups >= seen.desired_groups
}

/// Serving at full size, every group on the current spec.
fn all_ready(seen: &Observation) -> bool {
    serving(seen) && seen.outdated_groups == 0
}

/// Ready says whether the service serves at full size; a rollout in progress is told by
/// Progressing, as a Deployment keeps the two apart, so a surging rollout stays Ready.
fn ready(seen: &Observation) -> Verdict {
    let desired = seen.desired_groups;
    if desired == 0 {
        return verdict(true, "ScaledToZero", "no replica groups are desired".into());
    }
    if serving(seen) {
        let message = format!("{desired} of {desired} replica groups ready");
        return verdict(true, "AllReplicasReady", message);
    }
    let mut message = format!("{} of {desired} replica groups ready", seen.ready_groups);
    if let Some(waiting) = &seen.waiting {
        message.push_str("; ");
        message.push_str(waiting);
    }
    let message = truncate(&message, MAX_CONDITION_MESSAGE);
    verdict(false, "ReplicasNotReady", message)
}

/// `message`, then why a pod waits where one does: a surging rollout stays Ready, so only
/// Progressing can say that its new group cannot be scheduled or started.
fn with_waiting(mut message: String, seen: &Observation) -> String {
    if let Some(waiting) = &seen.waiting {
        message.push_str("; waiting: ");
        message.push_str(waiting);
    }
    truncate(&message, MAX_CONDITION_MESSAGE)
}

fn available(seen: &Observation, max_unavailable: i32) -> Verdict {
    let min_available = (seen.desired_groups - max_unavailable).max(0);
    let ready = seen.ready_groups;
    if ready >= min_available {
        let message = format!("{ready} replica groups ready, at least {min_available} needed");
        verdict(true, "MinimumReplicasAvailable", message)
    } else {
        let message = format!(
            "{ready} replica groups ready, {min_available} needed (replicas less spec.rollout.maxUnavailable)"
        );
        verdict(false, "MinimumReplicasUnavailable", message)
    }
}

fn progressing(seen: &Observation) -> Verdict {
    let desired = seen.desired_groups;
    let steady = all_ready(seen) && seen.existing_groups == desired;
    if steady {
        let message = "every replica group runs the current spec".into();
        verdict(false, "Converged", message)
    } else if let Some(stalled) = &seen.stalled {
        let message = truncate(stalled, MAX_CONDITION_MESSAGE);
        verdict(false, "ProgressDeadlineExceeded", message)
    } else if seen.volcano_missing {
        let message =
            "schedulerName is volcano but scheduling.volcano.sh/v1beta1 PodGroups are not served";
        verdict(true, "WaitingForVolcano", message.into())
    } else if seen.groups_to_create > 0 {
        let message = format!(
            "{} of {desired} replica groups created, {} ready; {} pods are created at a time",
            desired - seen.groups_to_create,
            seen.ready_groups,
            crate::settings::CREATE_BATCH_PODS
        );
        verdict(true, "CreatingGroups", message)
    } else if seen.outdated_groups > 0 {
        let message = format!("{} replica groups run an older spec", seen.outdated_groups);
        verdict(true, "RollingGroups", with_waiting(message, seen))
    } else {
        let message = format!(
            "{} of {desired} replica groups ready, {} exist",
            seen.ready_groups, seen.existing_groups
        );
        verdict(true, "ReconcilingGroups", with_waiting(message, seen))
    }
}

/// Degraded stays on from a rank failure until every group is ready again, so the recovery
/// is visible rather than a blip between two reconciles.
fn degraded(seen: &Observation, previous: &[Condition]) -> Verdict {
    match (&seen.failure, is_true(previous, DEGRADED)) {
        (Some(failure), _) => verdict(true, "RankFailed", failure.clone()),
        (None, Some(prev)) if !all_ready(seen) => (true, prev.reason.clone(), prev.message.clone()),
        _ => {
            let message = "no replica group is recovering from a failure".into();
            verdict(false, "Healthy", message)
        }
    }
}

/// Present only while a write was refused or the pod limit cuts the count.
fn replica_failure(seen: &Observation) -> Option<Verdict> {
    let (reason, message) = if !seen.apply_failures.is_empty() {
        ("FailedCreate", seen.apply_failures.join("; "))
    } else {
        (POD_LIMIT_EXCEEDED, seen.pod_limit.clone()?)
    };
    Some(verdict(
        true,
        reason,
        truncate(&message, MAX_CONDITION_MESSAGE),
    ))
}

fn rank_table_ready(seen: &Observation) -> Verdict {
    let desired = seen.desired_groups;
    if !seen.uses_rank_table {
        let message = "a single CPU pod per group needs no rank table".into();
        verdict(true, "NotRequired", message)
    } else if seen.rank_tables_completed >= desired {
        let message = format!("{desired} rank tables completed");
        verdict(true, "AllRanksKnown", message)
    } else {
        let message = format!(
            "{} of {desired} rank tables completed",
            seen.rank_tables_completed
        );
        verdict(false, "WaitingForRanks", message)
    }
}

fn model_state(seen: &Observation, degraded: bool) -> ModelState {
    if seen.ready_groups > 0 {
        ModelState::Loaded
    } else if degraded {
        ModelState::FailedToLoad
    } else if seen.any_pod_running {
        ModelState::Loading
    } else {
        ModelState::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(desired: i32, ready: i32) -> Observation {
        Observation {
            desired_groups: desired,
            existing_groups: desired,
            ready_groups: ready,
            uses_rank_table: true,
            ..Default::default()
        }
    }

    #[test]
    fn ready_counts_serving_groups_and_says_why_one_waits() {
        assert_eq!(ready(&seen(0, 0)).1, "ScaledToZero");
        assert!(ready(&seen(2, 2)).0);
        let waiting = Observation {
            waiting: Some("pod llm-1-0 Unschedulable: no nodes".into()),
            ..seen(2, 1)
        };
        let (status, reason, message) = ready(&waiting);
        assert_eq!((status, reason.as_str()), (false, "ReplicasNotReady"));
        assert_eq!(
            message,
            "1 of 2 replica groups ready; pod llm-1-0 Unschedulable: no nodes"
        );
    }

    #[test]
    fn availability_allows_max_unavailable_groups_down() {
        assert!(available(&seen(3, 2), 1).0);
        assert!(!available(&seen(3, 1), 1).0);
    }

    #[test]
    fn progressing_names_what_the_rollout_waits_for_first() {
        assert_eq!(progressing(&seen(2, 2)).1, "Converged");
        let creating = Observation {
            groups_to_create: 1,
            volcano_missing: true,
            ..seen(2, 0)
        };
        assert_eq!(progressing(&creating).1, "WaitingForVolcano");
        let rolling = Observation {
            outdated_groups: 1,
            ..seen(2, 2)
        };
        assert_eq!(
            progressing(&rolling),
            verdict(
                true,
                "RollingGroups",
                "1 replica groups run an older spec".into()
            )
        );
        // A surge group that cannot be placed: Ready holds, Progressing says why.
        let surge_waits = Observation {
            waiting: Some(
                "pod llm-2-0 Unschedulable: 0/1 nodes are available: 1 Insufficient cpu.".into(),
            ),
            ..rolling
        };
        assert!(ready(&surge_waits).0);
        assert_eq!(
            progressing(&surge_waits).2,
            "1 replica groups run an older spec; waiting: pod llm-2-0 Unschedulable: 0/1 nodes are available: 1 Insufficient cpu."
        );
    }

    #[test]
    fn degraded_lasts_from_a_failure_until_every_group_is_ready() {
        let failed = Observation {
            failure: Some("pod llm-0-1 failed (Error)".into()),
            ..seen(2, 1)
        };
        let (status, reason, _) = degraded(&failed, &[]);
        assert!(status);
        let previous = vec![Condition {
            type_: DEGRADED.into(),
            status: "True".into(),
            reason: reason.clone(),
            message: "pod llm-0-1 failed (Error)".into(),
            observed_generation: None,
            last_transition_time: Time(Default::default()),
        }];
        assert_eq!(degraded(&seen(2, 1), &previous).1, "RankFailed");
        assert_eq!(degraded(&seen(2, 2), &previous).1, "Healthy");
    }

    #[test]
    fn a_refused_write_outranks_the_pod_limit_as_the_replica_failure() {
        assert_eq!(replica_failure(&seen(1, 1)), None);
        let limited = Observation {
            pod_limit: Some("too many pods".into()),
            ..seen(1, 1)
        };
        assert_eq!(replica_failure(&limited).unwrap().1, POD_LIMIT_EXCEEDED);
        let refused = Observation {
            apply_failures: vec!["pods is forbidden".into()],
            ..limited
        };
        assert_eq!(replica_failure(&refused).unwrap().1, "FailedCreate");
    }

    #[test]
    fn rank_tables_are_ready_once_every_desired_group_has_one_completed() {
        assert_eq!(rank_table_ready(&seen(2, 0)).1, "WaitingForRanks");
        let completed = Observation {
            rank_tables_completed: 2,
            ..seen(2, 0)
        };
        assert_eq!(rank_table_ready(&completed).1, "AllRanksKnown");
        let cpu = Observation {
            uses_rank_table: false,
            ..seen(2, 0)
        };
        assert_eq!(rank_table_ready(&cpu).1, "NotRequired");
    }
}

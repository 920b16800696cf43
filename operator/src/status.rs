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

pub fn build(
    isvc: &InferenceService,
    settings: &Settings,
    seen: &Observation,
    now: &Time,
) -> InferenceServiceStatus {
    let previous = isvc.status.clone().unwrap_or_default();
    let generation = isvc.metadata.generation;
    let desired = seen.desired_groups;
    // Ready says whether the service serves at full size; a rollout in progress is told by
    // Progressing, as a Deployment keeps the two apart, so a surging rollout stays Ready.
    let serving = seen.ready_groups >= desired;
    let all_ready = serving && seen.outdated_groups == 0;
    let steady = all_ready && seen.existing_groups == desired;
    let mut conditions = Vec::new();

    let ready = if desired == 0 {
        (
            true,
            "ScaledToZero",
            "no replica groups are desired".to_string(),
        )
    } else if serving {
        (
            true,
            "AllReplicasReady",
            format!("{desired} of {desired} replica groups ready"),
        )
    } else {
        let mut message = format!("{} of {desired} replica groups ready", seen.ready_groups);
        if let Some(waiting) = &seen.waiting {
            message.push_str("; ");
            message.push_str(waiting);
        }
        (
            false,
            "ReplicasNotReady",
            truncate(&message, MAX_CONDITION_MESSAGE),
        )
    };
    set(
        &mut conditions,
        &previous.conditions,
        generation,
        now,
        (READY, ready.0, ready.1, ready.2),
    );

    let min_available = (desired - isvc.spec.rollout.max_unavailable).max(0);
    let available = if seen.ready_groups >= min_available {
        (
            true,
            "MinimumReplicasAvailable",
            format!(
                "{} replica groups ready, at least {min_available} needed",
                seen.ready_groups
            ),
        )
    } else {
        (
            false,
            "MinimumReplicasUnavailable",
            format!(
                "{} replica groups ready, {min_available} needed (replicas less spec.rollout.maxUnavailable)",
                seen.ready_groups
            ),
        )
    };
    set(
        &mut conditions,
        &previous.conditions,
        generation,
        now,
        (AVAILABLE, available.0, available.1, available.2),
    );

    let progressing = if steady {
        (
            false,
            "Converged",
            "every replica group runs the current spec".to_string(),
        )
    } else if let Some(stalled) = &seen.stalled {
        (
            false,
            "ProgressDeadlineExceeded",
            truncate(stalled, MAX_CONDITION_MESSAGE),
        )
    } else if seen.volcano_missing {
        (
            true,
            "WaitingForVolcano",
            "schedulerName is volcano but scheduling.volcano.sh/v1beta1 PodGroups are not served"
                .to_string(),
        )
    } else if seen.groups_to_create > 0 {
        (
            true,
            "CreatingGroups",
            format!(
                "{} of {desired} replica groups created, {} ready; {} pods are created at a time",
                desired - seen.groups_to_create,
                seen.ready_groups,
                crate::settings::CREATE_BATCH_PODS
            ),
        )
    } else if seen.outdated_groups > 0 {
        (
            true,
            "RollingGroups",
            format!("{} replica groups run an older spec", seen.outdated_groups),
        )
    } else {
        (
            true,
            "ReconcilingGroups",
            format!(
                "{} of {desired} replica groups ready, {} exist",
                seen.ready_groups, seen.existing_groups
            ),
        )
    };
    set(
        &mut conditions,
        &previous.conditions,
        generation,
        now,
        (PROGRESSING, progressing.0, progressing.1, progressing.2),
    );

    // Degraded stays on from a rank failure until every group is ready again, so the
    // recovery is visible rather than a blip between two reconciles.
    let degraded = match (&seen.failure, is_true(&previous.conditions, DEGRADED)) {
        (Some(failure), _) => (true, "RankFailed".to_string(), failure.clone()),
        (None, Some(prev)) if !all_ready => (true, prev.reason.clone(), prev.message.clone()),
        _ => (
            false,
            "Healthy".to_string(),
            "no replica group is recovering from a failure".to_string(),
        ),
    };
    set(
        &mut conditions,
        &previous.conditions,
        generation,
        now,
        (DEGRADED, degraded.0, &degraded.1, degraded.2.clone()),
    );

    let replica_failure = if !seen.apply_failures.is_empty() {
        Some(("FailedCreate", seen.apply_failures.join("; ")))
    } else {
        seen.pod_limit
            .as_ref()
            .map(|limit| (POD_LIMIT_EXCEEDED, limit.clone()))
    };
    if let Some((reason, message)) = replica_failure {
        set(
            &mut conditions,
            &previous.conditions,
            generation,
            now,
            (
                REPLICA_FAILURE,
                true,
                reason,
                truncate(&message, MAX_CONDITION_MESSAGE),
            ),
        );
    }

    let rank_table = if !seen.uses_rank_table {
        (
            true,
            "NotRequired",
            "a single CPU pod per group needs no rank table".to_string(),
        )
    } else if seen.rank_tables_completed >= desired {
        (
            true,
            "AllRanksKnown",
            format!("{desired} rank tables completed"),
        )
    } else {
        (
            false,
            "WaitingForRanks",
            format!(
                "{} of {desired} rank tables completed",
                seen.rank_tables_completed
            ),
        )
    };
    set(
        &mut conditions,
        &previous.conditions,
        generation,
        now,
        (RANK_TABLE_READY, rank_table.0, rank_table.1, rank_table.2),
    );

    let model_state = if seen.ready_groups > 0 {
        ModelState::Loaded
    } else if degraded.0 {
        ModelState::FailedToLoad
    } else if seen.any_pod_running {
        ModelState::Loading
    } else {
        ModelState::Pending
    };

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
        model_state: Some(model_state),
        // Written on its own by the controller (`LAST_FAILURE_MANAGER`), so a later status
        // write that no longer sees the failed pod, or reads a cache that predates the write,
        // cannot take it away: it stays after recovery, like a container's `lastState`.
        last_failure: None,
        // Left out of the operator's apply so the autoscaler's field manager keeps it.
        autoscaling: None,
        inference_pool: seen.inference_pool.clone(),
    }
}

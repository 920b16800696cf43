//! When a worker pod serves, and why one failed: the rules the operator (replica groups,
//! status, the autoscaler), the router (which replicas take requests) and the local platform
//! share.

use k8s_openapi::api::core::v1::{ContainerStateTerminated, Pod};

/// Running, Ready by its probes, and not being deleted: the pods an endpoints controller would
/// list as ready, and the only ones a request may be sent to.
pub fn serves(pod: &Pod) -> bool {
    let status = pod.status.as_ref();
    pod.metadata.deletion_timestamp.is_none()
        && status.and_then(|s| s.phase.as_deref()) == Some("Running")
        && status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Why a failed pod failed, in the kubelet's words: the pod's reason and message, then each
/// container's exit. A kubelet leaves the pod's own message empty when a container fails; why
/// is in the container's termination message.
pub fn failure(pod: &Pod) -> String {
    let status = pod.status.as_ref();
    let reason = status.and_then(|s| s.reason.as_deref()).unwrap_or("Failed");
    let mut text = format!("failed ({reason})");
    if let Some(message) = status
        .and_then(|s| s.message.as_deref())
        .filter(|m| !m.is_empty())
    {
        text.push_str(": ");
        text.push_str(message);
    }
    let exits = status
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|c| Some((c, c.state.as_ref()?.terminated.as_ref()?)))
        .filter(|(_, exit)| exit.exit_code != 0);
    for (container, exit) in exits {
        text.push_str(&format!(
            "; container {} exited {}",
            container.name,
            exit_summary(exit)
        ));
    }
    text
}

/// How many of a termination message's last lines a status keeps: the error a program
/// prints last, with its cause, rather than its whole log.
const EXIT_MESSAGE_LINES: usize = 2;

/// A container's exit in a line: its code, the kubelet's reason and the end of the
/// termination message (the log's tail under `FallbackToLogsOnError`).
pub fn exit_summary(exit: &ContainerStateTerminated) -> String {
    let mut text = format!("with code {}", exit.exit_code);
    if let Some(reason) = exit.reason.as_deref().filter(|r| !r.is_empty()) {
        text.push_str(&format!(" ({reason})"));
    }
    let lines: Vec<&str> = exit
        .message
        .as_deref()
        .unwrap_or_default()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    if !lines.is_empty() {
        text.push_str(": ");
        text.push_str(&lines[lines.len().saturating_sub(EXIT_MESSAGE_LINES)..].join(" "));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodCondition, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn pod(phase: &str, ready: &str, deleting: bool) -> Pod {
        let mut pod = Pod {
            status: Some(PodStatus {
                phase: Some(phase.to_string()),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".to_string(),
                    status: ready.to_string(),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        };
        if deleting {
            pod.metadata.deletion_timestamp = Some(Time(Default::default()));
        }
        pod
    }

    #[test]
    fn only_a_running_ready_pod_not_being_deleted_serves() {
        assert!(serves(&pod("Running", "True", false)));
        assert!(!serves(&pod("Running", "False", false)));
        assert!(!serves(&pod("Running", "True", true)));
        assert!(!serves(&pod("Pending", "True", false)));
        assert!(!serves(&Pod::default()));
    }
}

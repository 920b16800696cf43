//! When a worker pod serves: the one rule the operator (replica groups, status, the
//! autoscaler), the router (which replicas take requests) and the local platform share.

use k8s_openapi::api::core::v1::Pod;

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

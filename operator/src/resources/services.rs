//! The headless Service for rank discovery, the client Service and the PodDisruptionBudget.

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::ObjectMeta;
use kube::{Resource, ResourceExt};
use npufleet_crds::InferenceService;

use super::names;
use npufleet_contract::ports;

use crate::labels;

fn metadata(isvc: &InferenceService, name: String) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: isvc.namespace(),
        labels: Some(labels::common(isvc)),
        owner_references: isvc.controller_owner_ref(&()).map(|o| vec![o]),
        ..Default::default()
    }
}

fn port(name: &str, port: u16, app_protocol: &str) -> ServicePort {
    ServicePort {
        name: Some(name.to_string()),
        port: i32::from(port),
        target_port: Some(IntOrString::String(name.to_string())),
        protocol: Some("TCP".to_string()),
        app_protocol: Some(app_protocol.to_string()),
        ..Default::default()
    }
}

/// Every rank of every group, published before it is ready: ranks must find each other to
/// become ready at all.
pub fn headless(isvc: &InferenceService) -> Service {
    Service {
        metadata: metadata(isvc, names::headless_service(isvc)),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".to_string()),
            publish_not_ready_addresses: Some(true),
            selector: Some(labels::workers(isvc)),
            ports: Some(vec![port(ports::HTTP_PORT_NAME, ports::HTTP_PORT, "http")]),
            ..Default::default()
        }),
        status: None,
    }
}

/// The address clients use: the rank-0 pod of each group, over HTTP and gRPC.
pub fn client(isvc: &InferenceService) -> Service {
    Service {
        metadata: metadata(isvc, names::client_service(isvc)),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".to_string()),
            selector: Some(labels::group_leaders(isvc)),
            ports: Some(vec![
                port(ports::HTTP_PORT_NAME, ports::HTTP_PORT, "http"),
                port(ports::GRPC_PORT_NAME, ports::GRPC_PORT, "kubernetes.io/h2c"),
            ]),
            ..Default::default()
        }),
        status: None,
    }
}

/// Evictions take at most `spec.disruptionBudget.maxUnavailable` replica groups out of
/// service. The budget counts pods: `minAvailable` is every desired pod but that many, so each
/// eviction spends one group's allowance, and the operator then stops the evicted pod's
/// peers (a group missing a rank cannot serve), which takes the group out as a whole. An
/// integer `minAvailable` also keeps the disruption controller from counting expected pods
/// through the scale subresource, which counts groups, not pods. Pods that are not ready may
/// always be evicted, so a drain never waits on a group that is down anyway; nor are the
/// peers of an evicted rank counted (labelled [`labels::EVICTABLE`]), so the drain that
/// evicted it takes them too. `desired` is the replica groups the operator runs.
pub fn disruption_budget(isvc: &InferenceService, desired: i32) -> PodDisruptionBudget {
    let pods = desired.max(0) * isvc.pods_per_replica();
    let min_available = (pods - isvc.spec.disruption_budget.max_unavailable).max(0);
    PodDisruptionBudget {
        metadata: metadata(isvc, names::disruption_budget(isvc)),
        spec: Some(PodDisruptionBudgetSpec {
            min_available: Some(IntOrString::Int(min_available)),
            selector: Some(LabelSelector {
                match_labels: Some(labels::workers(isvc)),
                match_expressions: Some(vec![LabelSelectorRequirement {
                    key: labels::EVICTABLE.to_string(),
                    operator: "DoesNotExist".to_string(),
                    values: None,
                }]),
            }),
            unhealthy_pod_eviction_policy: Some("AlwaysAllow".to_string()),
            ..Default::default()
        }),
        status: None,
    }
}

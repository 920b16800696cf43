//! `spec.autoscaling.mode: hpa`: the `autoscaling/v2` HorizontalPodAutoscaler that scales an
//! `InferenceService` through its scale subresource on the operator's own external metric.

use k8s_openapi::api::autoscaling::v2::{
    CrossVersionObjectReference, ExternalMetricSource, HorizontalPodAutoscaler,
    HorizontalPodAutoscalerSpec, MetricIdentifier, MetricSpec, MetricTarget,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kube::{Resource, ResourceExt};
use npufleet_crds::{AutoscalingSpec, InferenceService};

use crate::external_metrics::{OBJECTIVE_REPLICAS, QUEUE_DEPTH, SERVICE_LABEL};

/// Why `mode: hpa` refuses `minReplicas: 0`: an HPA cannot wake a target from zero on the
/// operator's metric, and its `minReplicas: 0` needs an alpha feature gate.
pub const MIN_ZERO_NEEDS_BUILTIN: &str = "spec.autoscaling.minReplicas must be at least 1 with mode hpa: a HorizontalPodAutoscaler scales to zero only behind the alpha HPAScaleToZero feature gate and cannot see requests waiting for a fleet at zero; use mode builtin to scale to zero";

/// The HPA for `service`, named like it and owned by it (deleted with it).
pub fn desired(
    service: &InferenceService,
    autoscaling: &AutoscalingSpec,
) -> anyhow::Result<HorizontalPodAutoscaler> {
    let name = service.name_any();
    let owner = service
        .controller_owner_ref(&())
        .ok_or_else(|| anyhow::anyhow!("InferenceService {name} has no uid yet"))?;
    anyhow::ensure!(
        autoscaling.min_replicas >= 1,
        "{MIN_ZERO_NEEDS_BUILTIN}, got minReplicas {}",
        autoscaling.min_replicas
    );
    anyhow::ensure!(
        autoscaling.max_replicas >= 1,
        "spec.autoscaling.maxReplicas must be at least 1, got {}",
        autoscaling.max_replicas
    );
    // With objectives the metric is the count itself: replicas = ceil(count / 1). Else
    // replicas = ceil(total queue depth / target per replica).
    let (metric, per_replica) = match autoscaling.objectives {
        Some(_) => (OBJECTIVE_REPLICAS, 1),
        None => (QUEUE_DEPTH, autoscaling.target_queue_depth),
    };
    Ok(HorizontalPodAutoscaler {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: service.namespace(),
            owner_references: Some(vec![owner]),
            labels: Some(
                [(SERVICE_LABEL.to_owned(), name.clone())]
                    .into_iter()
                    .collect(),
            ),
            ..ObjectMeta::default()
        },
        spec: Some(HorizontalPodAutoscalerSpec {
            scale_target_ref: CrossVersionObjectReference {
                api_version: Some(InferenceService::api_version(&()).into_owned()),
                kind: InferenceService::kind(&()).into_owned(),
                name: name.clone(),
            },
            min_replicas: Some(autoscaling.min_replicas),
            max_replicas: autoscaling.max_replicas.max(autoscaling.min_replicas),
            metrics: Some(vec![MetricSpec {
                type_: "External".to_owned(),
                external: Some(ExternalMetricSource {
                    metric: MetricIdentifier {
                        name: metric.to_owned(),
                        selector: Some(LabelSelector {
                            match_labels: Some([(SERVICE_LABEL.to_owned(), name)].into()),
                            ..LabelSelector::default()
                        }),
                    },
                    target: MetricTarget {
                        type_: "AverageValue".to_owned(),
                        average_value: Some(Quantity(per_replica.to_string())),
                        ..MetricTarget::default()
                    },
                }),
                ..MetricSpec::default()
            }]),
            behavior: None,
        }),
        status: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(autoscaling: serde_json::Value) -> InferenceService {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "npufleet.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "ml", "uid": "1234"},
            "spec": {
                "model": {"name": "smollm2", "source": {"imagePath": "/models/m.gguf"}},
                "accelerator": {"type": "cpu"},
                "autoscaling": autoscaling,
            }
        }))
        .expect("valid InferenceService")
    }

    #[test]
    fn the_hpa_targets_the_scale_subresource_on_the_external_queue_metric() {
        let svc = service(
            serde_json::json!({"mode": "hpa", "minReplicas": 2, "maxReplicas": 6, "targetQueueDepth": 3}),
        );
        let hpa = desired(&svc, svc.spec.autoscaling.as_ref().unwrap()).unwrap();
        let value = serde_json::to_value(&hpa).unwrap();
        let spec = &value["spec"];
        assert_eq!(spec["scaleTargetRef"]["apiVersion"], "npufleet.io/v1alpha1");
        assert_eq!(spec["scaleTargetRef"]["kind"], "InferenceService");
        assert_eq!(spec["scaleTargetRef"]["name"], "chat");
        assert_eq!(spec["minReplicas"], 2);
        assert_eq!(spec["maxReplicas"], 6);
        let metric = &spec["metrics"][0];
        assert_eq!(metric["type"], "External");
        assert_eq!(metric["external"]["metric"]["name"], QUEUE_DEPTH);
        assert_eq!(
            metric["external"]["metric"]["selector"]["matchLabels"][SERVICE_LABEL],
            "chat"
        );
        assert_eq!(metric["external"]["target"]["type"], "AverageValue");
        assert_eq!(metric["external"]["target"]["averageValue"], "3");
        assert_eq!(value["metadata"]["ownerReferences"][0]["uid"], "1234");
        assert_eq!(value["metadata"]["ownerReferences"][0]["controller"], true);
    }

    #[test]
    fn with_objectives_the_hpa_asks_for_the_count_they_imply() {
        let svc = service(serde_json::json!({
            "mode": "hpa", "minReplicas": 1, "maxReplicas": 6,
            "objectives": {"ttft": {"target": "800ms"}},
        }));
        let hpa = desired(&svc, svc.spec.autoscaling.as_ref().unwrap()).unwrap();
        let value = serde_json::to_value(&hpa).unwrap();
        let external = &value["spec"]["metrics"][0]["external"];
        assert_eq!(external["metric"]["name"], OBJECTIVE_REPLICAS);
        assert_eq!(external["target"]["type"], "AverageValue");
        assert_eq!(external["target"]["averageValue"], "1");
    }

    #[test]
    fn min_replicas_zero_is_refused_not_turned_into_one() {
        let svc = service(serde_json::json!({"mode": "hpa", "minReplicas": 0, "maxReplicas": 6}));
        let error = desired(&svc, svc.spec.autoscaling.as_ref().unwrap()).unwrap_err();
        let message = error.to_string();
        assert!(
            message.contains("minReplicas") && message.contains("mode builtin"),
            "{message}"
        );
    }
}

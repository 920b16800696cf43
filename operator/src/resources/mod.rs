//! Builders of the objects an InferenceService owns. Pure: they read only the spec.

pub mod inference_pool;
pub mod names;
pub mod pod;
pub mod pod_group;
pub mod rank_table;
pub mod runtime;
pub mod services;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::ObjectMeta;
use kube::{Resource, ResourceExt};
use npufleet_crds::InferenceService;

use crate::labels;
use crate::settings::Settings;

/// The rank table ConfigMap of `group`.
pub fn rank_table_config_map(
    isvc: &InferenceService,
    group: i32,
    table: &npufleet_contract::rank_table::Document,
) -> ConfigMap {
    let mut cm_labels = labels::common(isvc);
    cm_labels.insert(labels::GROUP.to_string(), group.to_string());
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(names::rank_table(isvc, group)),
            namespace: isvc.namespace(),
            labels: Some(cm_labels),
            owner_references: isvc.controller_owner_ref(&()).map(|o| vec![o]),
            ..Default::default()
        },
        data: Some(
            [(
                npufleet_contract::rank_table::FILE_NAME.to_string(),
                serde_json::to_string(table).unwrap_or_default(),
            )]
            .into(),
        ),
        ..Default::default()
    }
}

/// A digest of everything in the spec that shapes a worker pod (not `replicas`,
/// `autoscaling`, `routing`, `rollout` nor `disruptionBudget`), so pods built from an older
/// spec can be found and replaced. The fields added since the first release count only when
/// set, so that a fleet that does not use them keeps its hash across operator upgrades; left
/// out, adding an API key to a running fleet never reached its pods.
pub fn template_hash(isvc: &InferenceService, settings: &Settings) -> String {
    let spec = &isvc.spec;
    let mut shape = serde_json::json!({
        "model": spec.model,
        "accelerator": spec.accelerator,
        "parallelism": spec.parallelism,
        "engine": spec.engine,
        "scheduling": spec.scheduling,
        "template": spec.template,
        "workerImage": settings.worker_image,
    });
    if spec.runtime != npufleet_crds::RuntimeSpec::default() {
        shape["runtime"] = serde_json::json!(spec.runtime);
    }
    if spec.runtime.engine == npufleet_crds::Engine::Mindie {
        // MindIE's launch script waits this long for its rank table.
        shape["progressDeadlineSeconds"] = serde_json::json!(spec.progress_deadline_seconds);
    }
    if let Some(secret) = &spec.api_key_secret {
        shape["apiKeySecret"] = serde_json::json!(secret);
    }
    digest(&shape)
}

/// A short digest of `value`'s JSON. FNV-1a: stable across Rust releases, unlike the
/// standard library's hasher, so a new operator build recognises what an older one wrote.
pub fn digest(value: &serde_json::Value) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in value.to_string().bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{:010x}", hash & 0xff_ffff_ffff)
}

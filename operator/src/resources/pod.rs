//! The worker pod of one rank of one replica group.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, ConfigMapVolumeSource, Container, EmptyDirVolumeSource, EnvVar,
    EnvVarSource, HTTPGetAction, Lifecycle, LifecycleHandler, NodeAffinity, NodeSelector,
    NodeSelectorRequirement, NodeSelectorTerm, ObjectFieldSelector,
    PersistentVolumeClaimVolumeSource, Pod, PodAffinity, PodAffinityTerm, PodAntiAffinity,
    PodSecurityContext, PodSpec, Probe, ResourceFieldSelector, ResourceRequirements,
    SeccompProfile, SecurityContext, SleepAction, Toleration, Volume, VolumeMount,
    WeightedPodAffinityTerm,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::ObjectMeta;
use kube::{Resource, ResourceExt};
use npufleet_crds::{AcceleratorType, InferenceService};

use npufleet_contract::{annotations as annotation, env as worker_env_names, ports, rank_table};

use super::names;
use super::runtime;
use crate::labels;
use crate::settings::Settings;

pub use npufleet_crds::MODEL_DIR;
use npufleet_crds::{MODEL_VOLUME, RANK_TABLE_VOLUME, TMP_DIR, TMP_VOLUME};
pub const WORKER_CONTAINER: &str = "worker";
/// The distroless `nonroot` user the worker image runs as.
const WORKER_UID: i64 = 65532;
/// Seconds the pod keeps serving after deletion so Services stop routing to it before the
/// worker receives SIGTERM and drains.
const PRE_STOP_SLEEP_SECONDS: i64 = 5;

/// Where the worker finds the weights, as seen inside the container.
pub fn model_path(isvc: &InferenceService) -> String {
    let source = &isvc.spec.model.source;
    if let Some(claim) = &source.persistent_volume_claim {
        format!("{MODEL_DIR}/{}", claim.path)
    } else if let Some(volume) = &source.volume {
        format!("{MODEL_DIR}/{}", volume.path)
    } else {
        source.image_path.clone().unwrap_or_default()
    }
}

/// Whether the group gets a rank table: always on NPUs (HCCL needs it even inside one
/// server) and for CPU groups spanning several pods.
pub fn uses_rank_table(isvc: &InferenceService) -> bool {
    isvc.spec.accelerator.kind.is_npu() || isvc.pods_per_replica() > 1
}

/// The scheduler the pods ask for: the user's, else Volcano where the platform requires it.
pub fn scheduler_name(isvc: &InferenceService) -> Option<String> {
    let spec = &isvc.spec;
    spec.scheduling.scheduler_name.clone().or_else(|| {
        let cce_910 = spec.accelerator.platform == npufleet_crds::Platform::Cce
            && spec.accelerator.kind == AcceleratorType::Ascend910;
        cce_910.then(|| "volcano".to_string())
    })
}

pub(super) fn env(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value: Some(value.into()),
        value_from: None,
    }
}

pub(super) fn env_from_field(name: &str, field_path: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: field_path.to_string(),
                api_version: None,
            }),
            ..Default::default()
        }),
    }
}

/// Taints a node gets when it stops reporting; a pod tolerating them for a while stays bound.
const NODE_LOSS_TAINTS: [&str; 2] = [
    "node.kubernetes.io/not-ready",
    "node.kubernetes.io/unreachable",
];

/// The user's tolerations, plus a bounded stay on a lost node for each node-loss taint the
/// user does not tolerate already (the apiserver would otherwise add 300 s).
fn tolerations(scheduling: &npufleet_crds::SchedulingSpec) -> Vec<Toleration> {
    let seconds = scheduling
        .node_loss_toleration_seconds
        .unwrap_or(npufleet_crds::DEFAULT_NODE_LOSS_TOLERATION_SECONDS);
    let mut tolerations = scheduling.tolerations.clone();
    for taint in NODE_LOSS_TAINTS {
        if !tolerations.iter().any(|t| t.key.as_deref() == Some(taint)) {
            tolerations.push(Toleration {
                key: Some(taint.to_string()),
                operator: Some("Exists".to_string()),
                effect: Some("NoExecute".to_string()),
                toleration_seconds: Some(seconds),
                value: None,
            });
        }
    }
    tolerations
}

/// The worker container's memory limit, in bytes (the node's allocatable memory when the pod
/// sets none), so the worker can size its KV cache to fit.
fn memory_limit_env() -> EnvVar {
    EnvVar {
        name: worker_env_names::MEMORY_LIMIT_BYTES.to_string(),
        value: None,
        value_from: Some(EnvVarSource {
            resource_field_ref: Some(ResourceFieldSelector {
                container_name: Some(WORKER_CONTAINER.to_string()),
                resource: "limits.memory".to_string(),
                divisor: None,
            }),
            ..Default::default()
        }),
    }
}

/// HCCL's settings from `spec.parallelism.hccl`, for every engine on NPUs: HCCL reads them
/// itself, whichever framework opens the communicator.
pub(super) fn hccl_env(isvc: &InferenceService) -> Vec<EnvVar> {
    if !isvc.spec.accelerator.kind.is_npu() {
        return Vec::new();
    }
    let hccl = &isvc.spec.parallelism.hccl;
    let mut vars = vec![env_from_field(worker_env_names::HCCL_IF_IP, "status.podIP")];
    if let Some(algorithm) = hccl.algorithm {
        vars.push(env(
            worker_env_names::HCCL_ALGO,
            format!("level0:NA;level1:{}", algorithm.as_str()),
        ));
    }
    if let Some(timeout) = hccl.connect_timeout_seconds {
        vars.push(env(
            worker_env_names::HCCL_CONNECT_TIMEOUT,
            timeout.to_string(),
        ));
    }
    if let Some(ifname) = &hccl.socket_ifname {
        vars.push(env(worker_env_names::HCCL_SOCKET_IFNAME, ifname.clone()));
    }
    vars
}

/// The worker's configuration and the HCCL variables; the user's `template.env` wins on clashes.
pub fn worker_env(isvc: &InferenceService) -> Vec<EnvVar> {
    let spec = &isvc.spec;
    let engine = &spec.engine;
    let mut vars = vec![
        env(worker_env_names::MODEL, model_path(isvc)),
        env(worker_env_names::SERVED_MODEL_NAME, spec.model.name.clone()),
        env(
            worker_env_names::GRPC_ADDR,
            format!("0.0.0.0:{}", ports::GRPC_PORT),
        ),
        env(
            worker_env_names::HTTP_ADDR,
            format!("0.0.0.0:{}", ports::HTTP_PORT),
        ),
        env(
            worker_env_names::MAX_BATCH_SIZE,
            engine.max_batch_size.to_string(),
        ),
        env(
            worker_env_names::QUEUE_LIMIT,
            engine.queue_limit.to_string(),
        ),
        env(
            worker_env_names::WARMUP_ITERATIONS,
            engine.warmup_iterations.to_string(),
        ),
        env(worker_env_names::PRECISION, engine.precision.as_str()),
        env(
            worker_env_names::ACCELERATOR,
            spec.accelerator.kind.as_str(),
        ),
        memory_limit_env(),
    ];
    if !engine.prefix_templates.is_empty() {
        // Templates may span lines, so they travel as a JSON array of strings.
        let templates = serde_json::Value::from(engine.prefix_templates.clone()).to_string();
        vars.push(env(worker_env_names::PREFIX_TEMPLATES, templates));
    }
    // The worker stops accepting work and finishes in-flight requests within this time.
    vars.push(env(
        worker_env_names::DRAIN_TIMEOUT,
        engine.drain_seconds.to_string(),
    ));
    if uses_rank_table(isvc) {
        vars.push(env(
            worker_env_names::RANK_TABLE_FILE,
            format!("{}/{}", rank_table::MOUNT_DIR, rank_table::FILE_NAME),
        ));
        // The worker finds its own entry in the rank table by its pod IP (`container_ip`).
        vars.push(env_from_field(worker_env_names::POD_IP, "status.podIP"));
    }
    vars.extend(hccl_env(isvc));
    if let Some(secret) = &spec.api_key_secret {
        // The kubelet resolves the key; the operator needs no right to read Secrets.
        vars.push(EnvVar {
            name: worker_env_names::API_KEY.to_string(),
            value_from: Some(EnvVarSource {
                secret_key_ref: Some(secret.clone()),
                ..EnvVarSource::default()
            }),
            ..EnvVar::default()
        });
    }
    let user = &spec.template.env;
    vars.retain(|v| !user.iter().any(|u| u.name == v.name));
    vars.extend(user.iter().cloned());
    vars
}

fn resources(isvc: &InferenceService) -> Option<ResourceRequirements> {
    let template = isvc.spec.template.resources.clone().unwrap_or_default();
    let mut requests = template.requests;
    let mut limits = template.limits;
    if let Some(name) = isvc.spec.accelerator.resource_name() {
        // Extended resources must be requested with requests equal to limits.
        let count = Quantity(isvc.spec.accelerator.devices_per_pod.to_string());
        requests.insert(name.clone(), count.clone());
        limits.insert(name, count);
    }
    (!requests.is_empty() || !limits.is_empty()).then(|| ResourceRequirements {
        requests: (!requests.is_empty()).then_some(requests),
        limits: (!limits.is_empty()).then_some(limits),
        claims: None,
    })
}

fn http_probe(port: &str, path: &str, period_seconds: i32, failure_threshold: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_string()),
            port: IntOrString::String(port.to_string()),
            ..Default::default()
        }),
        period_seconds: Some(period_seconds),
        failure_threshold: Some(failure_threshold),
        timeout_seconds: Some(2),
        ..Default::default()
    }
}

fn volumes(isvc: &InferenceService, group: i32) -> (Vec<Volume>, Vec<VolumeMount>) {
    let mount = |name: &str, path: &str| VolumeMount {
        name: name.to_string(),
        mount_path: path.to_string(),
        read_only: Some(true),
        ..Default::default()
    };
    let mut volumes = vec![Volume {
        name: TMP_VOLUME.to_string(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Default::default()
    }];
    let mut mounts = vec![VolumeMount {
        name: TMP_VOLUME.to_string(),
        mount_path: TMP_DIR.to_string(),
        ..Default::default()
    }];
    if uses_rank_table(isvc) {
        volumes.push(Volume {
            name: RANK_TABLE_VOLUME.to_string(),
            config_map: Some(ConfigMapVolumeSource {
                name: names::rank_table(isvc, group),
                ..Default::default()
            }),
            ..Default::default()
        });
        mounts.push(mount(RANK_TABLE_VOLUME, rank_table::MOUNT_DIR));
    }
    let source = &isvc.spec.model.source;
    if let Some(claim) = &source.persistent_volume_claim {
        volumes.push(Volume {
            name: MODEL_VOLUME.to_string(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: claim.claim_name.clone(),
                read_only: Some(true),
            }),
            ..Default::default()
        });
        mounts.push(mount(MODEL_VOLUME, MODEL_DIR));
    } else if let Some(volume) = &source.volume {
        mounts.push(mount(&volume.name, MODEL_DIR));
    }
    if let Some((volume, volume_mount)) = runtime::shared_memory(isvc) {
        volumes.push(volume);
        mounts.push(volume_mount);
    }
    volumes.extend(isvc.spec.template.volumes.iter().cloned());
    mounts.extend(isvc.spec.template.volume_mounts.iter().cloned());
    (volumes, mounts)
}

/// The node label that names one server: the ranks of a group talk over HCCS inside it.
pub const SERVER_TOPOLOGY_KEY: &str = "kubernetes.io/hostname";
/// NPUs of one Ascend training/inference server (Atlas 800, Atlas 900 module): a group that
/// needs more cannot share one server, so its co-location is only preferred.
const NPUS_PER_SERVER: i32 = 8;

/// Placement of a group's pods. The parts of `spec.scheduling.affinity` the user sets are
/// theirs; the operator fills the rest:
/// - pod affinity: the pods of one group on one server (required where the group's devices fit
///   in one server, preferred otherwise and for CPU groups);
/// - pod anti-affinity: groups preferably on different servers, so one server's loss takes one
///   group;
/// - node affinity: CPU workers only on nodes without an `accelerator` label, so they never take
///   an NPU server's CPU and memory.
pub fn affinity(isvc: &InferenceService, group: i32) -> Option<Affinity> {
    let mut affinity = isvc.spec.scheduling.affinity.clone().unwrap_or_default();
    let service = labels::workers(isvc);
    let mut this_group = service.clone();
    this_group.insert(labels::GROUP.to_string(), group.to_string());
    let pods = isvc.pods_per_replica();
    if affinity.pod_affinity.is_none() && pods > 1 {
        let term = PodAffinityTerm {
            label_selector: Some(LabelSelector {
                match_labels: Some(this_group),
                match_expressions: None,
            }),
            topology_key: SERVER_TOPOLOGY_KEY.to_string(),
            ..Default::default()
        };
        let accelerator = &isvc.spec.accelerator;
        let fits =
            accelerator.kind.is_npu() && pods * accelerator.devices_per_pod <= NPUS_PER_SERVER;
        affinity.pod_affinity = Some(if fits {
            PodAffinity {
                required_during_scheduling_ignored_during_execution: Some(vec![term]),
                ..Default::default()
            }
        } else {
            PodAffinity {
                preferred_during_scheduling_ignored_during_execution: Some(vec![
                    WeightedPodAffinityTerm {
                        weight: 100,
                        pod_affinity_term: term,
                    },
                ]),
                ..Default::default()
            }
        });
    }
    if affinity.pod_anti_affinity.is_none() {
        affinity.pod_anti_affinity = Some(PodAntiAffinity {
            preferred_during_scheduling_ignored_during_execution: Some(vec![
                WeightedPodAffinityTerm {
                    weight: 50,
                    pod_affinity_term: PodAffinityTerm {
                        label_selector: Some(LabelSelector {
                            match_labels: Some(service),
                            match_expressions: Some(vec![LabelSelectorRequirement {
                                key: labels::GROUP.to_string(),
                                operator: "NotIn".to_string(),
                                values: Some(vec![group.to_string()]),
                            }]),
                        }),
                        topology_key: SERVER_TOPOLOGY_KEY.to_string(),
                        ..Default::default()
                    },
                },
            ]),
            ..Default::default()
        });
    }
    if affinity.node_affinity.is_none() && !isvc.spec.accelerator.kind.is_npu() {
        affinity.node_affinity = Some(NodeAffinity {
            required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                node_selector_terms: vec![NodeSelectorTerm {
                    match_expressions: Some(vec![NodeSelectorRequirement {
                        key: npufleet_crds::NODE_LABEL_ACCELERATOR.to_string(),
                        operator: "DoesNotExist".to_string(),
                        values: None,
                    }]),
                    match_fields: None,
                }],
            }),
            ..Default::default()
        });
    }
    Some(affinity)
}

/// The worker container: the model server with its ports, probes and drain, locked down.
fn worker_container(
    isvc: &InferenceService,
    settings: &Settings,
    volume_mounts: Vec<VolumeMount>,
) -> Container {
    let spec = &isvc.spec;
    let engine = runtime::render(isvc);
    let port = engine.probe_port;
    Container {
        name: WORKER_CONTAINER.to_string(),
        image: Some(
            spec.template
                .image
                .clone()
                .unwrap_or_else(|| settings.worker_image.clone()),
        ),
        image_pull_policy: spec
            .template
            .image_pull_policy
            .map(|p| p.as_str().to_string()),
        command: engine.command,
        args: Some(engine.args),
        working_dir: engine.working_dir,
        ports: Some(engine.ports),
        env: Some(engine.env),
        resources: resources(isvc),
        volume_mounts: Some(volume_mounts),
        // Loading and warming a large model takes minutes (up to 30 here); liveness starts
        // only after it. Probed every second, because kubelet reports a pod Ready no sooner
        // than its next probe: at 5 s a small model served 5 s after it could have, and a
        // scale-up under load waited as long.
        startup_probe: Some(http_probe(port, &engine.liveness_path, 1, 1800)),
        readiness_probe: Some(http_probe(port, &engine.readiness_path, 2, 2)),
        liveness_probe: Some(http_probe(port, &engine.liveness_path, 10, 3)),
        lifecycle: Some(Lifecycle {
            pre_stop: Some(LifecycleHandler {
                sleep: Some(SleepAction {
                    seconds: PRE_STOP_SLEEP_SECONDS,
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            privileged: Some(false),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".to_string()]),
                add: None,
            }),
            ..Default::default()
        }),
        termination_message_policy: Some("FallbackToLogsOnError".to_string()),
        ..Default::default()
    }
}

/// The pod of rank `rank` in replica group `group`, labelled with `template_hash` so a
/// changed spec can be rolled group by group.
pub fn build(
    isvc: &InferenceService,
    settings: &Settings,
    group: i32,
    rank: i32,
    template_hash: &str,
) -> Pod {
    let spec = &isvc.spec;
    let name = names::pod(isvc, group, rank);
    let mut pod_labels = labels::common(isvc);
    pod_labels.insert(labels::GROUP.to_string(), group.to_string());
    pod_labels.insert(labels::RANK.to_string(), rank.to_string());
    pod_labels.insert(labels::TEMPLATE_HASH.to_string(), template_hash.to_string());
    if spec.accelerator.kind == AcceleratorType::Ascend910 {
        pod_labels.insert(
            labels::RING_CONTROLLER.to_string(),
            "ascend-910".to_string(),
        );
    }
    let mut annotations = BTreeMap::from([(labels::HCCL_RANK_INDEX.to_string(), rank.to_string())]);
    let (metrics_port, metrics_path) = runtime::metrics_endpoint(isvc);
    annotations.insert(
        annotation::METRICS_PORT_NAME.to_string(),
        metrics_port.to_string(),
    );
    annotations.insert(annotation::METRICS_PATH.to_string(), metrics_path);
    let scheduler = scheduler_name(isvc);
    if scheduler.as_deref() == Some("volcano") {
        annotations.insert(
            labels::VOLCANO_GROUP_NAME.to_string(),
            names::group(isvc, group),
        );
    }
    let mut node_selector = spec.accelerator.node_selector();
    node_selector.extend(spec.scheduling.node_selector.clone());
    let (volumes, volume_mounts) = volumes(isvc, group);
    let drain_seconds = i64::from(spec.engine.drain_seconds);

    let container = worker_container(isvc, settings, volume_mounts);

    Pod {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: isvc.namespace(),
            labels: Some(pod_labels),
            annotations: Some(annotations),
            owner_references: isvc.controller_owner_ref(&()).map(|o| vec![o]),
            ..Default::default()
        },
        spec: Some(PodSpec {
            hostname: Some(name),
            subdomain: Some(names::headless_service(isvc)),
            containers: vec![container],
            volumes: Some(volumes),
            // A rank that restarts in place would leave its peers in a broken communicator:
            // multi-pod groups fail as a whole and the operator recreates them.
            restart_policy: Some(
                if isvc.pods_per_replica() > 1 {
                    "Never"
                } else {
                    "Always"
                }
                .to_string(),
            ),
            termination_grace_period_seconds: Some(drain_seconds + PRE_STOP_SLEEP_SECONDS),
            scheduler_name: scheduler,
            node_selector: (!node_selector.is_empty()).then_some(node_selector),
            tolerations: Some(tolerations(&spec.scheduling)),
            affinity: affinity(isvc, group),
            priority_class_name: spec.scheduling.priority_class_name.clone(),
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                run_as_user: Some(WORKER_UID),
                run_as_group: Some(WORKER_UID),
                fs_group: Some(WORKER_UID),
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".to_string(),
                    localhost_profile: None,
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpu_service(extra: serde_json::Value) -> InferenceService {
        let mut spec = serde_json::json!({
            "model": {"name": "m", "source": {"imagePath": "/models/m.gguf"}},
            "accelerator": {"type": "cpu"},
        });
        spec.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let mut isvc = InferenceService::new("llm", serde_json::from_value(spec).unwrap());
        isvc.metadata.namespace = Some("ns".into());
        isvc
    }

    #[test]
    fn the_api_key_comes_from_the_named_secret_key() {
        let isvc = cpu_service(serde_json::json!({
            "apiKeySecret": {"name": "llm-keys", "key": "api-key"},
        }));
        let vars = worker_env(&isvc);
        let var = vars
            .iter()
            .find(|v| v.name == worker_env_names::API_KEY)
            .expect("the API key variable");
        assert_eq!(var.value, None, "the key must not be copied into the pod");
        let selector = var
            .value_from
            .as_ref()
            .and_then(|from| from.secret_key_ref.as_ref())
            .expect("a secretKeyRef");
        assert_eq!(
            (selector.name.as_str(), selector.key.as_str()),
            ("llm-keys", "api-key")
        );

        let open = worker_env(&cpu_service(serde_json::json!({})));
        assert!(!open.iter().any(|v| v.name == worker_env_names::API_KEY));
    }
}

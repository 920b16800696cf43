//! `InferenceService` (`npufleet.io/v1alpha1`): one served model on a fleet of Ascend (or CPU)
//! workers. Validation lives in the schema and in CEL rules so that the apiserver itself rejects
//! bad objects with a message naming the field.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, EnvVar, SecretKeySelector, Toleration, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use npufleet_contract::accelerator::AcceleratorType;
pub use npufleet_contract::precision::Precision;
pub use npufleet_contract::runtime::{Engine, LoadMetrics, LoadSource};

pub const GROUP: &str = "npufleet.io";
pub const VERSION: &str = "v1alpha1";

/// Desired state of a served model.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "npufleet.io",
    version = "v1alpha1",
    kind = "InferenceService",
    plural = "inferenceservices",
    singular = "inferenceservice",
    shortname = "infsvc",
    category = "npufleet",
    namespaced,
    status = "InferenceServiceStatus",
    derive = "PartialEq",
    doc = "An LLM served by a fleet of tensor-parallel worker groups on Ascend NPUs or CPUs.",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyReplicas", description = "Replica groups whose every rank is ready"),
    printcolumn(name = "Desired", type_ = "integer", json_path = ".status.desiredReplicas", description = "Replica groups the operator is driving toward"),
    printcolumn(name = "TP", type_ = "integer", json_path = ".spec.parallelism.tensor", description = "Tensor-parallel degree"),
    printcolumn(name = "Accelerator", type_ = "string", json_path = ".spec.accelerator.type"),
    printcolumn(name = "Runtime", type_ = "string", json_path = ".spec.runtime.engine", description = "The engine serving the model"),
    printcolumn(name = "Queue", type_ = "number", json_path = ".status.autoscaling.queueDepth", description = "Mean waiting requests per replica, as the autoscaler last saw it"),
    printcolumn(name = "Model", type_ = "string", json_path = ".status.modelState", priority = 1),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = Rule::new("size(self.metadata.name) <= 40")
        .message("metadata.name must be at most 40 characters: worker pods are named <name>-<group>-<rank>"),
)]
#[x_kube(validation = Rule::new("self.parallelism.tensor % self.accelerator.devicesPerPod == 0")
    .message("spec.parallelism.tensor must be a multiple of spec.accelerator.devicesPerPod (pods per replica = tensor / devicesPerPod)")
    .field_path(".parallelism.tensor"))]
#[x_kube(validation = Rule::new("!(self.accelerator.platform == 'cce' && self.accelerator.type == 'ascend910') || !has(self.scheduling) || !has(self.scheduling.schedulerName) || self.scheduling.schedulerName == 'volcano'")
    .message("spec.scheduling.schedulerName must be volcano: CCE schedules Ascend 910 (ascend-1980) devices only through Volcano")
    .field_path(".scheduling.schedulerName"))]
#[x_kube(validation = Rule::new("!has(self.model.source.volume) || (has(self.template) && has(self.template.volumes) && self.template.volumes.exists(v, v.name == self.model.source.volume.name))")
    .message("spec.model.source.volume.name must name a volume declared in spec.template.volumes")
    .field_path(".model.source.volume.name"))]
#[x_kube(validation = Rule::new("!has(self.runtime) || self.runtime.engine == 'npufleet' || (has(self.template) && has(self.template.image))")
    .message("spec.template.image must name the engine's image when spec.runtime.engine is not npufleet: the operator's default image is its own worker")
    .field_path(".template.image"))]
#[x_kube(validation = Rule::new("!has(self.runtime) || !(self.runtime.engine in ['generic', 'vllm-ascend']) || self.parallelism.tensor <= self.accelerator.devicesPerPod")
    .message("spec.parallelism.tensor must not exceed spec.accelerator.devicesPerPod for the generic and vllm-ascend runtimes: they serve a replica from one pod")
    .field_path(".parallelism.tensor"))]
#[x_kube(validation = Rule::new("!has(self.rollout) || self.rollout.maxSurge > 0 || self.rollout.maxUnavailable > 0")
    .message("spec.rollout.maxSurge and spec.rollout.maxUnavailable must not both be 0: a rollout could never start")
    .field_path(".rollout"))]
#[schemars(transform = crate::schema::tidy)]
#[serde(rename_all = "camelCase")]
pub struct InferenceServiceSpec {
    /// The model to serve.
    pub model: ModelSpec,

    /// Replica groups; each group is `parallelism.tensor / accelerator.devicesPerPod` pods.
    /// This is the scale subresource's spec path: an autoscaler may own it.
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 0, max = 1000))]
    pub replicas: i32,

    /// The accelerator every rank runs on. Immutable: moving a fleet to other hardware cannot
    /// be rolled in place.
    #[x_kube(validation = Rule::new("self == oldSelf")
        .message("spec.accelerator is immutable: create a new InferenceService to move to other hardware"))]
    pub accelerator: AcceleratorSpec,

    /// Tensor parallelism and the HCCL collective settings.
    #[serde(default)]
    pub parallelism: ParallelismSpec,

    /// Batching, queueing and numeric settings of the worker engine.
    #[serde(default)]
    pub engine: EngineSpec,

    /// Replica autoscaling; absent means the replica count is set by hand or an external HPA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<AutoscalingSpec>,

    /// How `npufleet-router` spreads this model's requests over its replicas.
    #[serde(default)]
    pub routing: RoutingSpec,

    /// Where worker pods may run.
    #[serde(default)]
    pub scheduling: SchedulingSpec,

    /// How a changed spec replaces running replica groups.
    #[serde(default)]
    pub rollout: RolloutSpec,

    /// Replica groups a voluntary disruption (a node drain, an eviction) may take out of
    /// service at once.
    #[serde(default)]
    pub disruption_budget: DisruptionBudgetSpec,

    /// Seconds a replica group may take to become ready before `Progressing` turns `False`
    /// with reason `ProgressDeadlineExceeded`, naming why it waits (as a Deployment's).
    #[serde(default = "default_progress_deadline_seconds")]
    #[schemars(range(min = 1, max = 86400))]
    pub progress_deadline_seconds: i32,

    /// The engine the worker pods run: this project's worker, a vendor engine, or any
    /// OpenAI-compatible server.
    #[serde(default)]
    pub runtime: RuntimeSpec,

    /// Overrides for the worker container.
    #[serde(default)]
    pub template: WorkerTemplate,

    /// A key of a Secret in this namespace holding the API key clients must present to the
    /// workers (`Authorization: Bearer <key>`, or the same gRPC metadata), as vLLM's
    /// `--api-key`. The pods read it as an environment variable; the operator never reads the
    /// Secret. Absent: no key is required.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_secret: Option<SecretKeySelector>,
}

fn default_replicas() -> i32 {
    1
}

fn default_progress_deadline_seconds() -> i32 {
    600
}

/// Rollout bounds, in replica groups, as a Deployment's `RollingUpdate` counts pods.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutSpec {
    /// Groups created above `replicas` while old ones are replaced.
    #[serde(default = "default_max_surge")]
    #[schemars(range(min = 0, max = 1000))]
    pub max_surge: i32,
    /// Groups below `replicas` that may be out of service during a rollout.
    #[serde(default)]
    #[schemars(range(min = 0, max = 1000))]
    pub max_unavailable: i32,
}

impl Default for RolloutSpec {
    fn default() -> Self {
        Self {
            max_surge: default_max_surge(),
            max_unavailable: 0,
        }
    }
}

/// One surge group and none unavailable: a one-replica service keeps serving while it rolls.
fn default_max_surge() -> i32 {
    1
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DisruptionBudgetSpec {
    /// Replica groups that evictions may take out of service at once.
    #[serde(default = "default_max_unavailable_groups")]
    #[schemars(range(min = 0, max = 1000))]
    pub max_unavailable: i32,
}

impl Default for DisruptionBudgetSpec {
    fn default() -> Self {
        Self {
            max_unavailable: default_max_unavailable_groups(),
        }
    }
}

fn default_max_unavailable_groups() -> i32 {
    1
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ModelSpec {
    /// The model name clients use (OpenAI `model`, Open Inference Protocol `model_name`).
    #[x_kube(validation = Rule::new("self.matches('^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$')")
        .message("spec.model.name must be 1-128 characters of letters, digits and . _ : / -, starting with a letter or digit"))]
    #[schemars(length(max = 128))]
    pub name: String,

    /// Where the weights are.
    pub source: ModelSource,

    /// File format of the weights.
    #[serde(default)]
    pub format: ModelFormat,
}

/// Exactly one of the three sources.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[x_kube(validation = Rule::new("[has(self.imagePath), has(self.persistentVolumeClaim), has(self.volume)].filter(x, x).size() == 1")
    .message("spec.model.source must set exactly one of imagePath, persistentVolumeClaim, volume"))]
#[serde(rename_all = "camelCase")]
pub struct ModelSource {
    /// An absolute path baked into the worker image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.startsWith('/') && !self.contains('..')")
        .message("spec.model.source.imagePath must be an absolute path without '..'"))]
    #[schemars(length(max = 4096))]
    pub image_path: Option<String>,

    /// A PersistentVolumeClaim mounted read-only at `/models`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim: Option<ClaimModelSource>,

    /// A volume declared in `spec.template.volumes`, mounted read-only at `/models`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<VolumeModelSource>,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClaimModelSource {
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$')")
        .message("spec.model.source.persistentVolumeClaim.claimName must be a DNS subdomain name"))]
    #[schemars(length(max = 253))]
    pub claim_name: String,
    /// Path of the GGUF file or safetensors directory inside the claim.
    #[x_kube(validation = Rule::new("size(self) > 0 && !self.startsWith('/') && !self.contains('..')")
        .message("spec.model.source.persistentVolumeClaim.path must be a non-empty relative path without '..'"))]
    #[schemars(length(max = 4096))]
    pub path: String,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VolumeModelSource {
    /// Name of a volume in `spec.template.volumes`.
    #[x_kube(validation = Rule::new("size(self) > 0").message("spec.model.source.volume.name must not be empty"))]
    pub name: String,
    /// Path of the GGUF file or safetensors directory inside the volume.
    #[x_kube(validation = Rule::new("size(self) > 0 && !self.startsWith('/') && !self.contains('..')")
        .message("spec.model.source.volume.path must be a non-empty relative path without '..'"))]
    #[schemars(length(max = 4096))]
    pub path: String,
}

/// Weights format the worker loads.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum ModelFormat {
    #[default]
    Gguf,
    Safetensors,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = Rule::new("self.type != 'cpu' || !has(self.resourceName)")
    .message("spec.accelerator.resourceName must not be set when spec.accelerator.type is cpu")
    .field_path(".resourceName"))]
#[x_kube(validation = Rule::new("self.type != 'cpu' || !has(self.chipName)")
    .message("spec.accelerator.chipName must not be set when spec.accelerator.type is cpu: CPU workers select no NPU chip")
    .field_path(".chipName"))]
#[x_kube(validation = Rule::new("self.platform != 'cce' || self.type == 'cpu' || self.devicesPerPod in [1, 2, 4, 8]")
    .message("spec.accelerator.devicesPerPod must be 1, 2, 4 or 8 on CCE")
    .field_path(".devicesPerPod"))]
#[serde(rename_all = "camelCase")]
pub struct AcceleratorSpec {
    /// The chip family.
    #[serde(rename = "type")]
    pub kind: AcceleratorType,

    /// Which device plugin names the resource: MindCluster (`huawei.com/Ascend910`) or
    /// Huawei Cloud CCE (`huawei.com/ascend-1980`).
    #[serde(default)]
    pub platform: Platform,

    /// Devices each pod requests (CPU workers: ranks per pod).
    #[serde(default = "default_devices_per_pod")]
    #[schemars(range(min = 1, max = 16))]
    pub devices_per_pod: i32,

    /// Extended resource name, overriding the platform preset (e.g. a virtual NPU
    /// `huawei.com/Ascend910-2c`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$')")
        .message("spec.accelerator.resourceName must be a domain-prefixed extended resource name such as huawei.com/Ascend910"))]
    #[schemars(length(max = 253))]
    pub resource_name: Option<String>,

    /// Chip model (`node.kubernetes.io/npu.chip.name`, e.g. `910B3`) the pods must land on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$')")
        .message("spec.accelerator.chipName must be a valid label value such as 910B3"))]
    #[schemars(length(max = 63))]
    pub chip_name: Option<String>,
}

fn default_devices_per_pod() -> i32 {
    1
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Platform {
    #[default]
    Mindcluster,
    Cce,
}

impl AcceleratorSpec {
    /// The extended resource each pod requests: the override, else the platform preset; `None`
    /// for CPU workers.
    pub fn resource_name(&self) -> Option<String> {
        if let Some(name) = &self.resource_name {
            return Some(name.clone());
        }
        let preset = match (self.platform, self.kind) {
            (_, AcceleratorType::Cpu) => return None,
            (Platform::Mindcluster, AcceleratorType::Ascend910) => "huawei.com/Ascend910",
            (Platform::Mindcluster, AcceleratorType::Ascend310p) => "huawei.com/Ascend310P",
            (Platform::Cce, AcceleratorType::Ascend910) => "huawei.com/ascend-1980",
            (Platform::Cce, AcceleratorType::Ascend310p) => "huawei.com/ascend-310",
        };
        Some(preset.to_string())
    }

    /// Node labels that place pods on this hardware. The MindCluster `accelerator` label is
    /// only set by its node labeller, so CCE nodes are selected by chip name alone.
    pub fn node_selector(&self) -> BTreeMap<String, String> {
        let mut labels = BTreeMap::new();
        let family = match self.kind {
            AcceleratorType::Ascend910 => Some("huawei-Ascend910"),
            AcceleratorType::Ascend310p => Some("huawei-Ascend310P"),
            AcceleratorType::Cpu => None,
        };
        if let (Platform::Mindcluster, Some(family)) = (self.platform, family) {
            labels.insert(NODE_LABEL_ACCELERATOR.to_string(), family.to_string());
        }
        if let (true, Some(chip)) = (self.kind.is_npu(), &self.chip_name) {
            labels.insert(NODE_LABEL_CHIP_NAME.to_string(), chip.clone());
        }
        labels
    }
}

pub const NODE_LABEL_ACCELERATOR: &str = "accelerator";
pub const NODE_LABEL_CHIP_NAME: &str = "node.kubernetes.io/npu.chip.name";

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ParallelismSpec {
    /// Tensor-parallel degree: ranks per replica group.
    #[serde(default = "default_tensor")]
    #[schemars(range(min = 1, max = 64))]
    pub tensor: i32,

    /// HCCL settings, exported as `HCCL_*` variables to every rank.
    #[serde(default)]
    pub hccl: HcclSpec,
}

impl Default for ParallelismSpec {
    fn default() -> Self {
        Self {
            tensor: default_tensor(),
            hccl: HcclSpec::default(),
        }
    }
}

fn default_tensor() -> i32 {
    1
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct HcclSpec {
    /// Inter-server algorithm (`HCCL_ALGO=level0:NA;level1:<algorithm>`); unset keeps HCCL's
    /// adaptive choice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<HcclAlgorithm>,

    /// `HCCL_CONNECT_TIMEOUT`, seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 120, max = 7200))]
    pub connect_timeout_seconds: Option<i32>,

    /// `HCCL_SOCKET_IFNAME`: `eth,enp` prefixes, `=eth0` exact, `^docker` excluded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^[=^]?[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*$')")
        .message("spec.parallelism.hccl.socketIfname must be comma-separated interface names, optionally prefixed by = or ^"))]
    #[schemars(length(max = 256))]
    pub socket_ifname: Option<String>,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum HcclAlgorithm {
    #[serde(rename = "ring")]
    Ring,
    #[serde(rename = "H-D_R")]
    HalvingDoubling,
    #[serde(rename = "NHR")]
    Nhr,
    #[serde(rename = "NB")]
    Nb,
    #[serde(rename = "pipeline")]
    Pipeline,
    #[serde(rename = "pairwise")]
    Pairwise,
}

impl HcclAlgorithm {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ring => "ring",
            Self::HalvingDoubling => "H-D_R",
            Self::Nhr => "NHR",
            Self::Nb => "NB",
            Self::Pipeline => "pipeline",
            Self::Pairwise => "pairwise",
        }
    }
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EngineSpec {
    /// Sequences decoded together in one step.
    #[serde(default = "default_max_batch_size")]
    #[schemars(range(min = 1, max = 4096))]
    pub max_batch_size: i32,

    /// Requests allowed to wait; beyond it the worker answers 429 / RESOURCE_EXHAUSTED.
    #[serde(default = "default_queue_limit")]
    #[schemars(range(min = 1, max = 1000000))]
    pub queue_limit: i32,

    /// Forward passes run before the worker reports ready. They are timed at several prompt
    /// lengths and batch sizes, a first measure of the serving shape for the latency
    /// objectives' capacity model (the first round of shapes is not timed; the default
    /// gives enough passes of each kind to fit a line).
    #[serde(default = "default_warmup_iterations")]
    #[schemars(range(min = 0, max = 100000))]
    pub warmup_iterations: i32,

    /// Matmul precision; `auto` picks by prompt length.
    #[serde(default)]
    pub precision: Precision,

    /// Prompt prefixes (e.g. system prompts) whose KV cache is computed once and shared.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    #[x_kube(validation = Rule::new("self.all(t, size(t) > 0)")
        .message("spec.engine.prefixTemplates must not contain empty templates"))]
    pub prefix_templates: Vec<String>,

    /// Seconds a stopping worker gets to finish in-flight requests.
    #[serde(default = "default_drain_seconds")]
    #[schemars(range(min = 0, max = 3600))]
    pub drain_seconds: i32,
}

impl Default for EngineSpec {
    fn default() -> Self {
        Self {
            max_batch_size: default_max_batch_size(),
            queue_limit: default_queue_limit(),
            warmup_iterations: default_warmup_iterations(),
            precision: Precision::default(),
            prefix_templates: Vec::new(),
            drain_seconds: default_drain_seconds(),
        }
    }
}

fn default_max_batch_size() -> i32 {
    128
}
fn default_queue_limit() -> i32 {
    1024
}
/// `spec.engine.warmupIterations` when not given.
pub const DEFAULT_WARMUP_ITERATIONS: i32 = 100;
fn default_warmup_iterations() -> i32 {
    DEFAULT_WARMUP_ITERATIONS
}
fn default_drain_seconds() -> i32 {
    30
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = Rule::new("self.minReplicas <= self.maxReplicas")
    .message("spec.autoscaling.minReplicas must be less than or equal to spec.autoscaling.maxReplicas")
    .field_path(".minReplicas"))]
// An HPA cannot scale from zero without the alpha HPAScaleToZero gate, and it would silently
// raise 0 to 1; only the built-in autoscaler holds a fleet at zero.
#[x_kube(validation = Rule::new("self.mode != 'hpa' || self.minReplicas >= 1")
    .message("spec.autoscaling.minReplicas must be at least 1 when spec.autoscaling.mode is hpa (only the built-in autoscaler scales to zero)")
    .field_path(".minReplicas"))]
#[serde(rename_all = "camelCase")]
pub struct AutoscalingSpec {
    /// Which loop owns `spec.replicas`.
    #[serde(default)]
    pub mode: AutoscalingMode,

    #[serde(default = "default_min_replicas")]
    #[schemars(range(min = 0, max = 1000))]
    pub min_replicas: i32,

    #[schemars(range(min = 1, max = 1000))]
    pub max_replicas: i32,

    /// Waiting requests per replica group the autoscaler aims for.
    #[serde(default = "default_target_queue_depth")]
    #[schemars(range(min = 1, max = 100000))]
    pub target_queue_depth: i32,

    /// Latency targets to size the fleet by, in place of `targetQueueDepth`: the fewest
    /// replica groups whose predicted time to first token and time per output token meet
    /// them, predicted from the measured arrival rate, prompt and output lengths and a model
    /// of the replicas' step times learned from the workers (`status.autoscaling.capacity`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub objectives: Option<ObjectivesSpec>,
}

/// Latency objectives; at least one is set.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[x_kube(validation = Rule::new("has(self.ttft) || has(self.tpot)")
    .message("spec.autoscaling.objectives must set ttft, tpot or both"))]
#[x_kube(validation = Rule::new(percentile_rule("ttft"))
    .message("spec.autoscaling.objectives.ttft.percentile must be greater than 0 and less than 100")
    .field_path(".ttft.percentile"))]
#[x_kube(validation = Rule::new(target_rule("ttft"))
    .message("spec.autoscaling.objectives.ttft.target must be a positive duration in ms or s, such as 800ms or 1.5s")
    .field_path(".ttft.target"))]
#[x_kube(validation = Rule::new(percentile_rule("tpot"))
    .message("spec.autoscaling.objectives.tpot.percentile must be greater than 0 and less than 100")
    .field_path(".tpot.percentile"))]
#[x_kube(validation = Rule::new(target_rule("tpot"))
    .message("spec.autoscaling.objectives.tpot.target must be a positive duration in ms or s, such as 80ms or 0.1s")
    .field_path(".tpot.target"))]
#[serde(rename_all = "camelCase")]
pub struct ObjectivesSpec {
    /// Time to first token: from a request reaching a worker to its first output token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft: Option<LatencyObjective>,
    /// Time per output token after the first (inter-token latency) of a request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpot: Option<LatencyObjective>,
}

/// `percentile` per cent of requests should see at most `target`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LatencyObjective {
    /// In (0, 100), exclusive; 90 if unset.
    #[serde(default = "default_objective_percentile")]
    pub percentile: f64,
    /// A duration as Kubernetes writes them, restricted to milliseconds or seconds: `800ms`,
    /// `1.5s`.
    #[schemars(length(max = 32))]
    pub target: String,
}

fn default_objective_percentile() -> f64 {
    90.0
}

/// The grammar of an objective's target and of a queue's time to live, a decimal number and the unit `ms` or `s`, as a
/// regular expression in a CEL string literal (hence the doubled backslash).
const OBJECTIVE_DURATION_CEL: &str = "^[0-9]+(\\\\.[0-9]+)?(ms|s)$";

fn percentile_rule(field: &str) -> String {
    format!(
        "!has(self.{field}) || (self.{field}.percentile > 0.0 && self.{field}.percentile < 100.0)"
    )
}

fn target_rule(field: &str) -> String {
    format!(
        "!has(self.{field}) || (self.{field}.target.matches('{OBJECTIVE_DURATION_CEL}') && duration(self.{field}.target) > duration('0s'))"
    )
}

impl LatencyObjective {
    /// The target as a duration; `Err` names what is wrong with it (the apiserver refuses
    /// such a value already, this guards objects admitted before the rule).
    pub fn target(&self) -> Result<std::time::Duration, String> {
        parse_objective_duration(&self.target)
    }

    /// The percentile as a fraction in (0, 1).
    pub fn quantile(&self) -> Result<f64, String> {
        let p = self.percentile;
        if p > 0.0 && p < 100.0 {
            Ok(p / 100.0)
        } else {
            Err(format!(
                "percentile {p} is not greater than 0 and less than 100"
            ))
        }
    }
}

/// Parses `800ms` or `1.5s` (a decimal number and the unit `ms` or `s`) into a positive
/// duration.
pub fn parse_objective_duration(text: &str) -> Result<std::time::Duration, String> {
    let bad = || format!("{text:?} is not a positive duration in ms or s, such as 800ms or 1.5s");
    let (number, scale) = if let Some(n) = text.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else {
        return Err(bad());
    };
    let well_formed = !number.is_empty()
        && !number.starts_with('.')
        && !number.ends_with('.')
        && number.chars().filter(|&c| c == '.').count() <= 1
        && number.chars().all(|c| c.is_ascii_digit() || c == '.');
    if !well_formed {
        return Err(bad());
    }
    let value: f64 = number.parse().map_err(|_| bad())?;
    let seconds = value * scale;
    if !(seconds > 0.0 && seconds.is_finite() && seconds < 1e9) {
        return Err(bad());
    }
    Ok(std::time::Duration::from_secs_f64(seconds))
}

fn default_min_replicas() -> i32 {
    1
}
/// The queue depth per replica group the built-in autoscaler aims for when none is given.
pub const DEFAULT_TARGET_QUEUE_DEPTH: i32 = 5;

fn default_target_queue_depth() -> i32 {
    DEFAULT_TARGET_QUEUE_DEPTH
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RoutingSpec {
    /// `cache-aware` (default): among the replicas with at most the router's `--cache-slack`
    /// requests outstanding beyond the least loaded replica's, the one where the prompt's
    /// prefill costs least: the part of it its prefix cache holds, as the workers' own cache
    /// events tell, weighed against the prompts ahead of it there (before the router has
    /// timed the model's prompts, the one holding the longest part; then by least load); for
    /// an engine that publishes no cache events, as `prefix-affinity`. `least-load`: the
    /// replica with the fewest requests outstanding (the router's own count and the worker's
    /// reported queue, prompts still in their prefill weighing more) and the emptiest KV
    /// cache.
    /// `prefix-affinity`: requests whose prompts start with the same bytes go to the same
    /// replica, as long as it is not loaded beyond that bound. `round-robin`: in turn.
    #[serde(default)]
    pub policy: RoutingPolicy,

    /// A Gateway API Inference Extension endpoint picker for this service. When set, and the
    /// `inference.networking.k8s.io/v1` InferencePool API is served, the operator keeps an
    /// InferencePool named after the service that selects its serving (rank-0) pods and names
    /// this picker, so an inference gateway (CCE's AI inference gateway, llm-d) can route to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_picker: Option<EndpointPicker>,

    /// Priorities, fairness and per-key limits in the router. Without it every request is
    /// sent to a replica as it arrives and waits in the replica's own queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flow_control: Option<FlowControl>,
}

/// The router's flow control for one InferenceService. Each router replica holds requests
/// beyond `maxConcurrencyPerReplica` per replica in its own queue, one band per priority:
/// the highest band is served first, and within a band the key that has been served the
/// fewest tokens goes next. A request whose band is full, or that waited `queueTtl`, is
/// answered 429 with Retry-After; so is one over its key's rate limits.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = Rule::new(format!("self.queueTtl.matches('{OBJECTIVE_DURATION_CEL}') && duration(self.queueTtl) > duration('0s')"))
    .message("spec.routing.flowControl.queueTtl must be a positive duration in ms or s, such as 500ms or 30s")
    .field_path(".queueTtl"))]
#[x_kube(validation = Rule::new("!has(self.maxConcurrencyPerReplica) || self.reservedPerReplica < self.maxConcurrencyPerReplica")
    .message("spec.routing.flowControl.reservedPerReplica must be less than maxConcurrencyPerReplica")
    .field_path(".reservedPerReplica"))]
#[x_kube(validation = Rule::new("self.keys.all(k, self.keys.exists_one(o, o.name == k.name) && self.keys.exists_one(o, o.apiKeySha256 == k.apiKeySha256))")
    .message("spec.routing.flowControl.keys must not repeat a name or an apiKeySha256")
    .field_path(".keys"))]
#[serde(rename_all = "camelCase")]
pub struct FlowControl {
    /// Requests one router sends a replica at once; more wait in the router, where priority
    /// and fairness decide which goes next. Default: `engine.maxBatchSize` plus the
    /// autoscaler's `targetQueueDepth` (when autoscaling), so a replica runs full batches and
    /// its own queue still shows the autoscaler the demand.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100000))]
    pub max_concurrency_per_replica: Option<u32>,
    /// Places of `maxConcurrencyPerReplica` on each replica that only requests of the highest
    /// priority among `default` and `keys` may take, so that they start at once while lower
    /// priorities keep the other places busy. 0 (default): every priority shares every place.
    #[serde(default)]
    #[schemars(range(min = 0, max = 100000))]
    pub reserved_per_replica: u32,
    /// Requests that may wait in one priority band of a router's queue; more get 429.
    #[serde(default = "default_max_queued")]
    #[schemars(range(min = 1, max = 100000))]
    pub max_queued: u32,
    /// How long a request may wait in the queue before it is answered 429: `500ms`, `30s`.
    #[serde(default = "default_queue_ttl")]
    #[schemars(length(max = 32))]
    pub queue_ttl: String,
    /// Priority and limits of requests whose API key is not in `keys` (or that carry none).
    #[serde(default)]
    pub default: KeyPolicy,
    /// Priority and limits per API key.
    #[serde(default)]
    #[schemars(length(max = 256))]
    pub keys: Vec<FlowKey>,
}

/// One API key's place in the flow control. The router matches the key a request presents
/// (`Authorization: Bearer <key>`) by its SHA-256, so neither the resource nor the router
/// holds the key: `printf %s "$KEY" | sha256sum`.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FlowKey {
    /// The name metrics and logs use for the key.
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub name: String,
    /// Lower-case hex SHA-256 of the key.
    #[schemars(length(min = 64, max = 64), regex(pattern = r"^[0-9a-f]{64}$"))]
    pub api_key_sha256: String,
    #[serde(flatten)]
    pub policy: KeyPolicy,
}

/// The priority and rate limits of a key's requests.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct KeyPolicy {
    /// Higher is served first. A request may ask for a lower priority with the
    /// `x-npufleet-priority` header, never a higher one.
    #[serde(default)]
    #[schemars(range(min = -1000, max = 1000))]
    pub priority: i32,
    /// Requests per minute, per router replica; over it, 429 with Retry-After.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub requests_per_minute: Option<u32>,
    /// Prompt and requested output tokens per minute, per router replica (a request is
    /// charged its prompt and its `max_tokens` as it is admitted); over it, 429 with
    /// Retry-After.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub tokens_per_minute: Option<u32>,
}

fn default_max_queued() -> u32 {
    256
}
fn default_queue_ttl() -> String {
    "30s".to_owned()
}

impl FlowControl {
    /// The queue's time to live; `Err` names what is wrong (the apiserver refuses such a
    /// value already; this guards objects admitted before the rule).
    pub fn queue_ttl(&self) -> Result<std::time::Duration, String> {
        parse_objective_duration(&self.queue_ttl)
    }
}

/// The endpoint picker Service an InferencePool names (its `endpointPickerRef`).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPicker {
    /// Service name of the picker, in the InferenceService's namespace.
    #[schemars(length(min = 1, max = 63))]
    pub service: String,
    /// The picker's ext-proc gRPC port.
    #[serde(default = "default_endpoint_picker_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
}

fn default_endpoint_picker_port() -> i32 {
    9002
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[serde(rename_all = "kebab-case")]
pub enum RoutingPolicy {
    #[default]
    CacheAware,
    LeastLoad,
    PrefixAffinity,
    RoundRobin,
}

impl RoutingPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::CacheAware => "cache-aware",
            Self::LeastLoad => "least-load",
            Self::PrefixAffinity => "prefix-affinity",
            Self::RoundRobin => "round-robin",
        }
    }
}

/// `builtin`: the operator's own loop writes the scale subresource. `hpa`: an
/// `autoscaling/v2` HorizontalPodAutoscaler does, from the operator's external metric.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum AutoscalingMode {
    #[default]
    Builtin,
    Hpa,
}

/// See [`SchedulingSpec::node_loss_toleration_seconds`].
pub const DEFAULT_NODE_LOSS_TOLERATION_SECONDS: i64 = 30;

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct SchedulingSpec {
    /// e.g. `volcano`; a Volcano PodGroup per replica group is created when that API is served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$')")
        .message("spec.scheduling.schedulerName must be a DNS subdomain name"))]
    #[schemars(length(max = 253))]
    pub scheduler_name: Option<String>,

    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 16), transform = bound_label_values)]
    #[x_kube(validation = Rule::new(format!("self.all(k, k.matches('{LABEL_KEY}') && self[k].matches('{LABEL_VALUE}'))"))
        .message("spec.scheduling.nodeSelector keys must be label keys ([prefix/]name, the name 1-63 letters, digits, '-', '_' or '.' starting and ending with a letter or digit) and values label values"))]
    pub node_selector: BTreeMap<String, String>,

    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,

    /// Seconds a worker pod stays bound to a node that stopped reporting
    /// (`node.kubernetes.io/not-ready` or `unreachable`) before it is evicted and its group
    /// made again elsewhere. Default 30, against Kubernetes' 300: an idle accelerator fleet is
    /// expensive. A toleration for either taint in `tolerations` takes precedence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 86400))]
    pub node_loss_toleration_seconds: Option<i64>,

    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,

    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct WorkerTemplate {
    /// Worker image; the operator's default otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("size(self) > 0 && !self.contains(' ')")
        .message("spec.template.image must be a non-empty image reference"))]
    #[schemars(length(max = 1024))]
    pub image: Option<String>,

    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<ImagePullPolicy>,

    /// Extra variables; they override the operator's on name clashes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 128), transform = bound_env_names)]
    #[x_kube(validation = Rule::new("self.all(e, e.name.matches('^[ -<>-~]+$'))")
        .message("spec.template.env names must be non-empty printable ASCII without '='"))]
    pub env: Vec<EnvVar>,

    /// CPU and memory; the accelerator request is added by the operator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<WorkerResources>,

    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), transform = bound_volume_names)]
    #[x_kube(validation = Rule::new(format!("self.all(v, !(v.name in ['{TMP_VOLUME}', '{RANK_TABLE_VOLUME}', '{MODEL_VOLUME}', '{SHM_VOLUME}']))"))
        .message(format!("spec.template.volumes must not use the operator's volume names {TMP_VOLUME}, {RANK_TABLE_VOLUME}, {MODEL_VOLUME} and {SHM_VOLUME}").as_str()))]
    pub volumes: Vec<Volume>,

    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), transform = bound_mount_paths)]
    #[x_kube(validation = Rule::new(format!("self.all(m, !(m.mountPath in ['{TMP_DIR}', '{TMP_DIR}/', '{MODEL_DIR}', '{MODEL_DIR}/', '{RANK_TABLE_DIR}', '{RANK_TABLE_DIR}/']))"))
        .message(format!("spec.template.volumeMounts must not mount at {TMP_DIR}, {MODEL_DIR} or {RANK_TABLE_DIR}: the operator mounts there").as_str()))]
    pub volume_mounts: Vec<VolumeMount>,
}

/// The engine in the worker container. The operator renders what the engine's deployment
/// guide asks (command, arguments, ports, probes, rank table, environment); the fields here
/// add to it, and for the `generic` engine are all there is.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[x_kube(validation = Rule::new("self.engine != 'npufleet' || (!has(self.command) && !has(self.args) && !has(self.port) && !has(self.readinessPath) && !has(self.metrics))")
    .message("spec.runtime.command, args, port, readinessPath and metrics apply only to other engines: the npufleet worker is configured by spec.engine"))]
#[x_kube(validation = Rule::new("self.engine != 'generic' || has(self.port)")
    .message("spec.runtime.port is required for the generic engine: the port its OpenAI API listens on")
    .field_path(".port"))]
#[serde(rename_all = "camelCase")]
pub struct RuntimeSpec {
    #[serde(default)]
    pub engine: Engine,

    /// The container's command; the image's entrypoint when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub command: Vec<String>,

    /// For `generic`, the engine's arguments; for `vllm-ascend` and `mindie`, appended to
    /// the operator's. `$(NPUFLEET_MODEL)`, `$(NPUFLEET_SERVED_MODEL_NAME)` and
    /// `$(NPUFLEET_HTTP_PORT)` expand to the model path, the served name and the port.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256))]
    pub args: Vec<String>,

    /// The port the engine serves its OpenAI API on (the engine's default otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<i32>,

    /// The HTTP path that answers 200 once the engine can serve (default `/health`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.startsWith('/')")
        .message("spec.runtime.readinessPath must be an absolute HTTP path"))]
    #[schemars(length(max = 1024))]
    pub readiness_path: Option<String>,

    /// The engine's Prometheus series for queue depth, running requests and KV-cache use,
    /// in place of the engine's own (vLLM's `vllm:*`, MindIE's unprefixed names). Without
    /// any, the fleet is routed and scaled on the router's own counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<LoadMetrics>,
}

impl RuntimeSpec {
    /// The port of the engine's OpenAI HTTP API.
    pub fn http_port(&self) -> u16 {
        self.port
            .and_then(|p| u16::try_from(p).ok())
            .or(self.engine.default_http_port())
            .unwrap_or(npufleet_contract::ports::HTTP_PORT)
    }

    pub fn readiness_path(&self) -> &str {
        self.readiness_path
            .as_deref()
            .unwrap_or(self.engine.default_readiness_path())
    }

    /// How the operator and the router learn a replica's load.
    pub fn load_source(&self) -> LoadSource {
        LoadSource::of(self.engine, self.metrics.as_ref())
    }
}

// Length bounds on strings that CEL rules read: the apiserver refuses a rule whose cost it
// cannot bound below its budget. Each matches the limit the pod API itself enforces.

/// Sets `maxLength` on the string at `path` (a chain of schema keys) below `schema`.
fn bound_string(schema: &mut schemars::Schema, path: &[&str], max: u64) {
    let Some(mut target) = schema.as_object_mut() else {
        return;
    };
    for key in path {
        match target.get_mut(*key).and_then(|next| next.as_object_mut()) {
            Some(next) => target = next,
            None => return,
        }
    }
    target.insert("maxLength".to_string(), max.into());
}

fn bound_env_names(schema: &mut schemars::Schema) {
    bound_string(schema, &["items", "properties", "name"], 256);
}

fn bound_volume_names(schema: &mut schemars::Schema) {
    bound_string(schema, &["items", "properties", "name"], 63);
}

fn bound_mount_paths(schema: &mut schemars::Schema) {
    bound_string(schema, &["items", "properties", "mountPath"], 1024);
}

fn bound_label_values(schema: &mut schemars::Schema) {
    bound_string(schema, &["additionalProperties"], 63);
}

fn bound_quantities(schema: &mut schemars::Schema) {
    bound_string(schema, &["additionalProperties"], 64);
}

/// Paths and volume names the operator's pod uses, which a template may not take.
pub const TMP_DIR: &str = "/tmp";
pub const MODEL_DIR: &str = "/models";
pub const RANK_TABLE_DIR: &str = npufleet_contract::rank_table::MOUNT_DIR;
pub const TMP_VOLUME: &str = "tmp";
pub const RANK_TABLE_VOLUME: &str = "rank-table";
pub const MODEL_VOLUME: &str = "model";
/// The vendor engines' shared-memory volume, at `/dev/shm`.
pub const SHM_VOLUME: &str = "dshm";

/// A Kubernetes label key: an optional DNS-subdomain prefix and a name.
const LABEL_KEY: &str = "^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$";
/// A Kubernetes label value (may be empty).
const LABEL_VALUE: &str = "^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$";

#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImagePullPolicy {
    Always,
    IfNotPresent,
    Never,
}

impl ImagePullPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Always => "Always",
            Self::IfNotPresent => "IfNotPresent",
            Self::Never => "Never",
        }
    }
}

/// The worker container's CPU and memory, checked at admission as the pod would be.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.requests) || !has(self.limits) || self.requests.all(k, !(k in self.limits) || !isQuantity(string(self.requests[k])) || !isQuantity(string(self.limits[k])) || quantity(string(self.requests[k])).compareTo(quantity(string(self.limits[k]))) <= 0)")
    .message("spec.template.resources.requests must be less than or equal to spec.template.resources.limits for each resource"))]
pub struct WorkerResources {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 8), transform = bound_quantities)]
    #[x_kube(validation = Rule::new("self.all(k, isQuantity(string(self[k])))")
        .message("spec.template.resources.limits values must be quantities such as 500m, 4 or 16Gi"))]
    pub limits: BTreeMap<String, Quantity>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 8), transform = bound_quantities)]
    #[x_kube(validation = Rule::new("self.all(k, isQuantity(string(self[k])))")
        .message("spec.template.resources.requests values must be quantities such as 500m, 4 or 16Gi"))]
    pub requests: BTreeMap<String, Quantity>,
}

/// Observed state, written by the operator (and `autoscaling` by the autoscaler).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[schemars(transform = crate::schema::tidy)]
#[serde(rename_all = "camelCase")]
pub struct InferenceServiceStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Replica groups the operator is driving toward: `spec.replicas`, or with
    /// `spec.autoscaling.mode: builtin` the autoscaler's decision, always within
    /// `spec.autoscaling`'s bounds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_replicas: Option<i32>,

    /// Replica groups that exist (the scale subresource's status path).
    #[serde(default)]
    pub replicas: i32,

    /// Replica groups whose every rank is ready.
    #[serde(default)]
    pub ready_replicas: i32,

    /// Label selector of the worker pods, serialised for the scale subresource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,

    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,

    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints: Option<Endpoints>,

    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_state: Option<ModelState>,

    /// The most recent failure that made a replica group restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<String>,

    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<AutoscalingStatus>,

    /// The InferencePool the operator keeps for `spec.routing.endpointPicker`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference_pool: Option<String>,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Endpoints {
    /// Open Inference Protocol gRPC address (`host:port`).
    pub grpc: String,
    /// HTTP base URL (OpenAI-compatible and Open Inference Protocol REST).
    pub http: String,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelState {
    Pending,
    Loading,
    Loaded,
    FailedToLoad,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct AutoscalingStatus {
    /// Mean waiting requests per ready replica group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_depth: Option<f64>,
    /// The replica groups the built-in autoscaler decided on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_replicas: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scale_time: Option<Time>,
    /// The autoscaler's own conditions, as a HorizontalPodAutoscaler has them: `ScalingActive`
    /// says whether it can read the load of every serving worker; with
    /// `spec.autoscaling.objectives`, `ObjectivesMet` whether the ready replica groups are
    /// predicted to meet them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,
    /// With `spec.autoscaling.objectives`: the demand measured, what the capacity model
    /// predicts and the replica groups that implies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub objectives: Option<ObjectivesStatus>,
    /// The step-time model learned from the workers, kept here so that a restarted operator
    /// starts from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<CapacityStatus>,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ObjectivesStatus {
    /// Requests per second arriving at the fleet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arrival_rate: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mean_prompt_tokens: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mean_output_tokens: Option<f64>,
    /// Seconds a new replica group took from being asked for to ready, as last measured
    /// (a default until one is); the count covers the load expected that far ahead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_seconds: Option<f64>,
    /// The fewest replica groups predicted to meet every objective, each taking at most
    /// 90 % of the rate one group is predicted to serve within them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas_implied: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft: Option<ObjectivePrediction>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpot: Option<ObjectivePrediction>,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ObjectivePrediction {
    pub percentile: f64,
    pub target_seconds: f64,
    /// The percentile predicted with the ready replica groups; absent when they cannot keep
    /// up with the arrivals at all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_seconds: Option<f64>,
    /// The percentile predicted with `replicasImplied` groups.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_seconds_at_implied: Option<f64>,
    /// What the workers measured over the last window with enough of it (20 s): for TTFT
    /// the percentile of at least 20 first tokens, for TPOT the mean wait between tokens
    /// over at least 20 decode steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_seconds: Option<f64>,
    /// `measuredSeconds` over the prediction for that window's arrivals and replica groups
    /// (bounded to 0.25..4); the predictions above are multiplied by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<f64>,
}

/// Least-squares sums of step durations against step sizes, over every step the workers
/// reported, and the lines fitted to them.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct CapacityStatus {
    /// Prefill steps: seconds against the prompt positions they compute.
    pub prefill: StepFit,
    /// Decode steps: seconds against their batch.
    pub decode: StepFit,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct StepFit {
    pub steps: f64,
    pub size_sum: f64,
    pub seconds_sum: f64,
    pub size_squared_sum: f64,
    pub size_seconds_sum: f64,
    /// The fitted line, or the conservative default while too few steps were seen.
    pub intercept_seconds: f64,
    pub seconds_per_unit: f64,
    /// Whether the line is learned (`true`) or the default.
    pub learned: bool,
}

impl InferenceService {
    /// Pods in one replica group.
    pub fn pods_per_replica(&self) -> i32 {
        (self.spec.parallelism.tensor / self.spec.accelerator.devices_per_pod.max(1)).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objective_targets_parse_in_milliseconds_or_seconds_and_refuse_the_rest() {
        assert_eq!(
            parse_objective_duration("800ms"),
            Ok(std::time::Duration::from_millis(800))
        );
        assert_eq!(
            parse_objective_duration("1.5s"),
            Ok(std::time::Duration::from_millis(1500))
        );
        for bad in [
            "0ms", "0.0s", "", "ms", "1.s", ".5s", "1m", "-1s", "1e3ms", "1.2.3s", "80",
        ] {
            let error = parse_objective_duration(bad).unwrap_err();
            assert!(
                error.contains("positive duration in ms or s"),
                "{bad}: {error}"
            );
        }
        let objective = LatencyObjective {
            percentile: 100.0,
            target: "80ms".into(),
        };
        assert!(objective.quantile().unwrap_err().contains("less than 100"));
    }
}

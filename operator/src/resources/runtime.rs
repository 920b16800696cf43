//! What the worker container runs, per engine: its command and arguments, environment, ports
//! and probe paths. Everything around it (volumes, placement, security, drain) is the same
//! pod for every engine ([`super::pod`]).

use k8s_openapi::api::core::v1::{ContainerPort, EnvVar};
use npufleet_contract::runtime::MINDIE_MANAGEMENT_PORT;
use npufleet_contract::{env as env_names, ports, rank_table};
use npufleet_crds::{Engine, InferenceService, TMP_DIR};

use super::pod::{env, env_from_field, model_path, uses_rank_table, worker_env};

/// The name of the port the probes use when it is not the HTTP port (MindIE's management
/// port).
pub const HEALTH_PORT_NAME: &str = "health";
/// The name of the engine's Prometheus port when it is not the HTTP port.
pub const METRICS_PORT_NAME: &str = "metrics";

/// The engine-specific part of the worker container.
#[derive(Debug, PartialEq)]
pub struct EngineContainer {
    /// `None`: the image's entrypoint.
    pub command: Option<Vec<String>>,
    pub args: Vec<String>,
    pub env: Vec<EnvVar>,
    pub ports: Vec<ContainerPort>,
    /// The named port and path of the readiness, startup and liveness probes.
    pub probe_port: &'static str,
    pub readiness_path: String,
    pub liveness_path: String,
}

pub fn render(isvc: &InferenceService) -> EngineContainer {
    let runtime = &isvc.spec.runtime;
    let mut rendered = match runtime.engine {
        Engine::Npufleet => npufleet(isvc),
        Engine::Generic => generic(isvc),
        Engine::VllmAscend => vllm_ascend(isvc),
        Engine::Mindie => mindie(isvc),
    };
    rendered.args.extend(runtime.args.iter().cloned());
    if !runtime.command.is_empty() {
        rendered.command = Some(runtime.command.clone());
    }
    if let Some(path) = &runtime.readiness_path {
        rendered.readiness_path.clone_from(path);
    }
    if let Some(port) = runtime.metrics.as_ref().and_then(|m| m.port)
        && port != runtime.http_port()
        && !rendered
            .ports
            .iter()
            .any(|p| p.container_port == i32::from(port))
    {
        rendered.ports.push(container_port(METRICS_PORT_NAME, port));
    }
    // The user's `template.env` wins on clashes.
    let user = &isvc.spec.template.env;
    rendered
        .env
        .retain(|v| !user.iter().any(|u| u.name == v.name));
    rendered.env.extend(user.iter().cloned());
    rendered
}

fn container_port(name: &str, port: u16) -> ContainerPort {
    ContainerPort {
        name: Some(name.into()),
        container_port: i32::from(port),
        protocol: Some("TCP".into()),
        ..Default::default()
    }
}

/// This project's worker: configured entirely by environment variables.
fn npufleet(isvc: &InferenceService) -> EngineContainer {
    EngineContainer {
        command: None,
        args: vec!["serve".to_string()],
        env: worker_env(isvc),
        ports: vec![
            container_port(ports::HTTP_PORT_NAME, ports::HTTP_PORT),
            container_port(ports::GRPC_PORT_NAME, ports::GRPC_PORT),
        ],
        probe_port: ports::HTTP_PORT_NAME,
        readiness_path: "/v2/health/ready".to_string(),
        liveness_path: "/v2/health/live".to_string(),
    }
}

/// The variables every other engine gets: what its arguments may name, and where a
/// multi-pod group's rank table is.
fn engine_env(isvc: &InferenceService) -> Vec<EnvVar> {
    let spec = &isvc.spec;
    let mut vars = vec![
        env(env_names::MODEL, model_path(isvc)),
        env(env_names::SERVED_MODEL_NAME, spec.model.name.clone()),
        env(env_names::HTTP_PORT, spec.runtime.http_port().to_string()),
        // The root filesystem is read-only: caches (Hugging Face, vLLM's compile cache) go
        // under the home directory, which is the writable scratch volume.
        env("HOME", TMP_DIR),
    ];
    if uses_rank_table(isvc) {
        vars.push(env(
            env_names::RANK_TABLE_FILE,
            format!("{}/{}", rank_table::MOUNT_DIR, rank_table::FILE_NAME),
        ));
        vars.push(env_from_field(env_names::POD_IP, "status.podIP"));
    }
    if let Some(secret) = &spec.api_key_secret {
        vars.push(EnvVar {
            name: env_names::API_KEY.to_string(),
            value_from: Some(k8s_openapi::api::core::v1::EnvVarSource {
                secret_key_ref: Some(secret.clone()),
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    vars
}

/// Any OpenAI-compatible server: the InferenceService says everything.
fn generic(isvc: &InferenceService) -> EngineContainer {
    let runtime = &isvc.spec.runtime;
    EngineContainer {
        command: None,
        args: Vec::new(),
        env: engine_env(isvc),
        ports: vec![container_port(ports::HTTP_PORT_NAME, runtime.http_port())],
        probe_port: ports::HTTP_PORT_NAME,
        readiness_path: runtime.readiness_path().to_string(),
        liveness_path: runtime.readiness_path().to_string(),
    }
}

/// `vllm serve` from the vllm-ascend image.
fn vllm_ascend(isvc: &InferenceService) -> EngineContainer {
    let spec = &isvc.spec;
    let port = spec.runtime.http_port();
    let mut env = engine_env(isvc);
    if spec.accelerator.kind.is_npu() {
        env.push(env_from_field(env_names::HCCL_IF_IP, "status.podIP"));
    }
    EngineContainer {
        command: Some(vec!["vllm".to_string(), "serve".to_string()]),
        args: vec![
            model_path(isvc),
            "--served-model-name".to_string(),
            spec.model.name.clone(),
            "--host".to_string(),
            "0.0.0.0".to_string(),
            "--port".to_string(),
            port.to_string(),
            "--tensor-parallel-size".to_string(),
            spec.parallelism.tensor.to_string(),
            "--max-num-seqs".to_string(),
            spec.engine.max_batch_size.to_string(),
        ],
        env,
        ports: vec![container_port(ports::HTTP_PORT_NAME, port)],
        probe_port: ports::HTTP_PORT_NAME,
        readiness_path: spec.runtime.readiness_path().to_string(),
        liveness_path: spec.runtime.readiness_path().to_string(),
    }
}

/// MindIE Service's daemon, with its metrics switched on.
fn mindie(isvc: &InferenceService) -> EngineContainer {
    let spec = &isvc.spec;
    let mut vars = engine_env(isvc);
    vars.push(env("MIES_SERVICE_MONITOR_MODE", "1"));
    let mut ports = vec![
        container_port(ports::HTTP_PORT_NAME, spec.runtime.http_port()),
        container_port(HEALTH_PORT_NAME, MINDIE_MANAGEMENT_PORT),
    ];
    if let Some(metrics) = Engine::Mindie.default_load_metrics().and_then(|m| m.port) {
        ports.push(container_port(METRICS_PORT_NAME, metrics));
    }
    EngineContainer {
        command: None,
        args: Vec::new(),
        env: vars,
        ports,
        probe_port: HEALTH_PORT_NAME,
        readiness_path: spec.runtime.readiness_path().to_string(),
        liveness_path: "/v2/health/live".to_string(),
    }
}

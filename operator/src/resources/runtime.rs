//! What the worker container runs, per engine: its command and arguments, environment, ports,
//! working directory and probe paths, and the shared memory a vendor engine gets. Everything
//! around it (volumes, placement, security, drain) is the same pod for every engine
//! ([`super::pod`]).
//!
//! vllm-ascend and MindIE are rendered as their vendors' published deployment guides run them.
//! The files under `runtime/` hold those guides' containers (each names its repository, file
//! and commit) with every difference from the rendering listed and explained; the tests below
//! hold the rendering to them.

use k8s_openapi::api::core::v1::{
    ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource, SecretKeySelector, Volume,
    VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use npufleet_contract::annotations::NO_METRICS_PORT;
use npufleet_contract::runtime::{METRICS_PATH, MINDIE_MANAGEMENT_PORT};
use npufleet_contract::{env as env_names, ports, rank_table};
use npufleet_crds::{Engine, InferenceService, LoadSource, Precision, TMP_DIR};

use super::pod::{env, env_from_field, hccl_env, model_path, uses_rank_table, worker_env};

/// The name of the port the probes use when it is not the HTTP port (MindIE's management
/// port).
pub const HEALTH_PORT_NAME: &str = "health";
/// The name of the engine's Prometheus port when it is not the HTTP port.
pub const METRICS_PORT_NAME: &str = "metrics";
use npufleet_crds::SHM_VOLUME;
const SHM_DIR: &str = "/dev/shm";
/// `docker run --shm-size=1g` in vllm-ascend's guides; MindIE's asks for at least 1 GB in a
/// container. Memory-backed, so it counts against the container's memory limit.
const SHM_SIZE: &str = "1Gi";
/// The port MindIE's ranks meet on at rank 0 (`MASTER_PORT`): "any free port", its guide
/// says; this is torch.distributed's customary one.
pub const MINDIE_MASTER_PORT: u16 = 29500;
/// Where MindIE's launch script puts its own copies of the rank table and `config.json`, in the
/// writable home directory: MindIE refuses files its user does not own or that others may
/// read, and the mounted ConfigMaps are root's.
const MINDIE_RANK_TABLE_COPY: &str = "\"$HOME/mindie-hccl.json\"";
const MINDIE_CONFIG_COPY: &str = "\"$HOME/mindie-config.json\"";

/// The engine-specific part of the worker container.
#[derive(Debug, PartialEq)]
pub struct EngineContainer {
    /// `None`: the image's entrypoint.
    pub command: Option<Vec<String>>,
    pub args: Vec<String>,
    pub env: Vec<EnvVar>,
    pub ports: Vec<ContainerPort>,
    /// `None`: the image's.
    pub working_dir: Option<String>,
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

/// Where the engine's Prometheus metrics are: the name of the container port, and the path
/// (the pod's [`npufleet_contract::annotations::METRICS_PORT_NAME`] and `METRICS_PATH`).
pub fn metrics_endpoint(isvc: &InferenceService) -> (&'static str, String) {
    let runtime = &isvc.spec.runtime;
    match runtime.load_source() {
        LoadSource::WorkerStream => (ports::HTTP_PORT_NAME, METRICS_PATH.to_string()),
        LoadSource::Scrape(metrics) => {
            let separate = metrics.port.is_some_and(|port| port != runtime.http_port());
            let name = if separate {
                METRICS_PORT_NAME
            } else {
                ports::HTTP_PORT_NAME
            };
            (name, metrics.path)
        }
        LoadSource::RouterCounts => (NO_METRICS_PORT, METRICS_PATH.to_string()),
    }
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
        working_dir: None,
        probe_port: ports::HTTP_PORT_NAME,
        readiness_path: isvc.spec.runtime.readiness_path().to_string(),
        liveness_path: "/v2/health/live".to_string(),
    }
}

/// The vendor engines' and the generic engine's shared memory: vllm-ascend's and MindIE's
/// guides mount a memory-backed `/dev/shm` (their processes pass tensors through it), and the
/// container runtime's default is 64 MiB. This project's worker needs none.
pub fn shared_memory(isvc: &InferenceService) -> Option<(Volume, VolumeMount)> {
    if isvc.spec.runtime.engine == Engine::Npufleet {
        return None;
    }
    let volume = Volume {
        name: SHM_VOLUME.to_string(),
        empty_dir: Some(EmptyDirVolumeSource {
            medium: Some("Memory".to_string()),
            size_limit: Some(Quantity(SHM_SIZE.to_string())),
        }),
        ..Default::default()
    };
    let mount = VolumeMount {
        name: SHM_VOLUME.to_string(),
        mount_path: SHM_DIR.to_string(),
        ..Default::default()
    };
    Some((volume, mount))
}

/// What every other engine's arguments may name (`$(NPUFLEET_MODEL)` and the like).
fn engine_env(isvc: &InferenceService) -> Vec<EnvVar> {
    let spec = &isvc.spec;
    vec![
        env(env_names::MODEL, model_path(isvc)),
        env(env_names::SERVED_MODEL_NAME, spec.model.name.clone()),
        env(env_names::HTTP_PORT, spec.runtime.http_port().to_string()),
        // The root filesystem is read-only: caches (Hugging Face, vLLM's compile cache, MindIE's
        // logs) go under the home directory, which is the writable scratch volume.
        env("HOME", TMP_DIR),
    ]
}

fn rank_table_path() -> String {
    format!("{}/{}", rank_table::MOUNT_DIR, rank_table::FILE_NAME)
}

/// Where a group's rank table is, and the pod's IP, which finds its entry in it.
fn rank_table_env(isvc: &InferenceService) -> Vec<EnvVar> {
    if !uses_rank_table(isvc) {
        return Vec::new();
    }
    vec![
        env(env_names::RANK_TABLE_FILE, rank_table_path()),
        env_from_field(env_names::POD_IP, "status.podIP"),
    ]
}

/// `name` from the Secret key `spec.apiKeySecret` names: the kubelet resolves it, the operator
/// needs no right to read Secrets.
fn secret_env(name: &str, secret: &SecretKeySelector) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value: None,
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(secret.clone()),
            ..Default::default()
        }),
    }
}

/// Any OpenAI-compatible server: the InferenceService says everything.
fn generic(isvc: &InferenceService) -> EngineContainer {
    let runtime = &isvc.spec.runtime;
    let mut vars = engine_env(isvc);
    vars.extend(rank_table_env(isvc));
    if let Some(secret) = &isvc.spec.api_key_secret {
        vars.push(secret_env(env_names::API_KEY, secret));
    }
    EngineContainer {
        command: None,
        args: Vec::new(),
        env: vars,
        ports: vec![container_port(ports::HTTP_PORT_NAME, runtime.http_port())],
        working_dir: None,
        probe_port: ports::HTTP_PORT_NAME,
        readiness_path: runtime.readiness_path().to_string(),
        liveness_path: runtime.readiness_path().to_string(),
    }
}

/// `vllm serve` as vllm-ascend's Kubernetes guide runs it (`runtime/vllm-ascend-kthena.json`):
/// the weights' path, the served name and the tensor-parallel size, HCCL and the collective
/// sockets on the pod's network, `/health` probed on the API port. vllm-ascend's image has no
/// entrypoint of its own (its guides start a shell), so the command is given.
fn vllm_ascend(isvc: &InferenceService) -> EngineContainer {
    let spec = &isvc.spec;
    let port = spec.runtime.http_port();
    let mut args = vec![
        model_path(isvc),
        "--served-model-name".to_string(),
        spec.model.name.clone(),
        "--tensor-parallel-size".to_string(),
        spec.parallelism.tensor.to_string(),
        "--max-num-seqs".to_string(),
        spec.engine.max_batch_size.to_string(),
        "--port".to_string(),
        port.to_string(),
    ];
    args.extend(vllm_precision(spec.engine.precision).map(str::to_string));
    let mut vars = engine_env(isvc);
    // Every model source here is a local path: nothing is fetched from the Hub, and a pod
    // without egress must not wait on it.
    vars.push(env("HF_HUB_OFFLINE", "1"));
    vars.extend(hccl_env(isvc));
    vars.extend(collective_socket_env(isvc));
    if let Some(secret) = &spec.api_key_secret {
        // vLLM's `--api-key`; it guards `/v1/*` and leaves `/health` open to the probes.
        vars.push(secret_env("VLLM_API_KEY", secret));
    }
    EngineContainer {
        command: Some(vec!["vllm".to_string(), "serve".to_string()]),
        args,
        env: vars,
        ports: vec![container_port(ports::HTTP_PORT_NAME, port)],
        // CANN compiles operators into the working directory (`kernel_meta`); the root
        // filesystem is read-only.
        working_dir: Some(TMP_DIR.to_string()),
        probe_port: ports::HTTP_PORT_NAME,
        readiness_path: spec.runtime.readiness_path().to_string(),
        liveness_path: spec.runtime.readiness_path().to_string(),
    }
}

/// vLLM's flags for `spec.engine.precision`. `int8` serves ModelSlim-quantised (W8A8)
/// weights, which vllm-ascend loads with `--quantization ascend`; `fp16` is vLLM's
/// `--dtype float16` (what Atlas 300I runs). `auto` (this project's per-prompt choice) and
/// `fp32` add nothing: the weights' own dtype is used, as in every vllm-ascend guide, none of
/// which runs float32 on an NPU.
fn vllm_precision(precision: Precision) -> impl Iterator<Item = &'static str> {
    let flags: &[&str] = match precision {
        Precision::Int8 => &["--quantization", "ascend"],
        Precision::Fp16 => &["--dtype", "float16"],
        Precision::Fp32 | Precision::Auto => &[],
    };
    flags.iter().copied()
}

/// The guide names HCCL's interface to Gloo (vLLM's CPU process group) and to the
/// tensor-parallel sockets too. They take plain interface names, not HCCL's forms: `=eth0`
/// (exact) is passed as `eth0`, and an exclusion (`^docker`) has no equivalent, so they are
/// then left to choose.
fn collective_socket_env(isvc: &InferenceService) -> Vec<EnvVar> {
    let Some(ifname) = &isvc.spec.parallelism.hccl.socket_ifname else {
        return Vec::new();
    };
    if !isvc.spec.accelerator.kind.is_npu() || ifname.starts_with('^') {
        return Vec::new();
    }
    let names = ifname.trim_start_matches('=');
    vec![
        env("GLOO_SOCKET_IFNAME", names),
        env("TP_SOCKET_IFNAME", names),
    ]
}

/// MindIE's server as its guides run it (`runtime/mindie.json`): the service and management
/// planes on the pod's IP, metrics on, logs to stdout and, for a group over several pods, the
/// rank table and rank 0's address. The rest of its configuration is `config.json`, which
/// the operator does not write (see `deploy/platforms/ascend.md`).
fn mindie(isvc: &InferenceService) -> EngineContainer {
    let spec = &isvc.spec;
    let mut vars = engine_env(isvc);
    vars.extend(hccl_env(isvc));
    vars.extend([
        // Both planes bind 127.0.0.x otherwise, out of the kubelet's and the router's reach.
        env_from_field("MIES_CONTAINER_IP", "status.podIP"),
        env_from_field("MIES_CONTAINER_MANAGEMENT_IP", "status.podIP"),
        // `/metrics` answers only with this set; the fleet's load is read from it.
        env("MIES_SERVICE_MONITOR_MODE", "1"),
        // Otherwise MindIE logs only to files, out of `kubectl logs`' reach.
        env("MINDIE_LOG_TO_STDOUT", "1"),
    ]);
    if isvc.pods_per_replica() > 1 {
        vars.push(env(env_names::RANK_TABLE_FILE, rank_table_path()));
        vars.push(env("MASTER_PORT", MINDIE_MASTER_PORT.to_string()));
    }
    let mut ports = vec![
        container_port(ports::HTTP_PORT_NAME, spec.runtime.http_port()),
        container_port(HEALTH_PORT_NAME, MINDIE_MANAGEMENT_PORT),
    ];
    if let Some(metrics) = Engine::Mindie.default_load_metrics().and_then(|m| m.port) {
        ports.push(container_port(METRICS_PORT_NAME, metrics));
    }
    EngineContainer {
        command: Some(vec![
            "/bin/bash".to_string(),
            "-c".to_string(),
            mindie_launch(isvc),
            "mindie".to_string(),
        ]),
        args: Vec::new(),
        env: vars,
        ports,
        // CANN compiles operators into the working directory (`kernel_meta`), which MindIE's
        // quick start says must be writable; the root filesystem is read-only.
        working_dir: Some(TMP_DIR.to_string()),
        probe_port: HEALTH_PORT_NAME,
        readiness_path: spec.runtime.readiness_path().to_string(),
        liveness_path: "/v2/health/live".to_string(),
    }
}

/// The shell that starts MindIE, as the vendor's Kubernetes boot script does: the image's
/// CANN, ATB and MindIE environments (a container command gets no login shell to source
/// them), the user's `config.json` and the rank table copied to files MindIE's user owns with
/// mode 640 (it refuses others), and, over several pods, a wait for the completed rank table,
/// whose first server is rank 0 (`MASTER_IP`). Arguments are passed on to `mindie_llm_server`.
fn mindie_launch(isvc: &InferenceService) -> String {
    let mut script = String::from(
        "for f in /usr/local/Ascend/ascend-toolkit/set_env.sh /usr/local/Ascend/cann/set_env.sh \
         /usr/local/Ascend/nnal/atb/set_env.sh /usr/local/Ascend/mindie/set_env.sh; do\n  \
         if [ -f \"$f\" ]; then . \"$f\"; fi\ndone\n",
    );
    script.push_str(&format!(
        "if [ -n \"$MIES_CONFIG_JSON_PATH\" ]; then\n  \
         install -m 640 \"$MIES_CONFIG_JSON_PATH\" {MINDIE_CONFIG_COPY} || exit 1\n  \
         export MIES_CONFIG_JSON_PATH={MINDIE_CONFIG_COPY}\nfi\n"
    ));
    if isvc.pods_per_replica() > 1 {
        let deadline = isvc.spec.progress_deadline_seconds;
        script.push_str(&format!(
            "deadline=$((SECONDS + {deadline}))\n\
             until MASTER_IP=$(python3 -c 'import json, os; t = json.load(open(os.environ[\"RANK_TABLE_FILE\"])); \
             assert t[\"status\"] == \"completed\"; print(t[\"server_list\"][0][\"container_ip\"])' 2>/dev/null); do\n  \
             if [ \"$SECONDS\" -ge \"$deadline\" ]; then echo \"rank table $RANK_TABLE_FILE not completed after {deadline}s\" >&2; exit 1; fi\n  \
             sleep 1\ndone\n\
             install -m 640 \"$RANK_TABLE_FILE\" {MINDIE_RANK_TABLE_COPY} || exit 1\n\
             export MASTER_IP RANK_TABLE_FILE={MINDIE_RANK_TABLE_COPY}\n"
        ));
    }
    script.push_str("exec mindie_llm_server \"$@\"\n");
    script
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::{Path, PathBuf};
    use std::process::Command;

    use k8s_openapi::api::core::v1::{Container, Pod, Probe};
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    use serde_json::{Value, json};

    use super::*;
    use crate::settings::Settings;

    /// vllm-ascend's Kubernetes guide, with the rendering's differences from it.
    const VLLM_ASCEND_GUIDE: &str = include_str!("runtime/vllm-ascend-kthena.json");
    /// MindIE's multi-node and container guides, with the rendering's differences from them.
    const MINDIE_GUIDE: &str = include_str!("runtime/mindie.json");

    fn service(spec: Value) -> InferenceService {
        let mut isvc = InferenceService::new("llm", serde_json::from_value(spec).unwrap());
        isvc.metadata.namespace = Some("ns".into());
        isvc
    }

    fn fixture(text: &str) -> (InferenceService, Value) {
        let fixture: Value = serde_json::from_str(text).unwrap();
        (service(fixture["inferenceService"].clone()), fixture)
    }

    /// Rank 0 of group 0, as the operator builds it.
    fn pod_of(isvc: &InferenceService) -> Pod {
        super::super::pod::build(isvc, &Settings::default(), 0, 0, "hash")
    }

    fn worker(pod: &Pod) -> &Container {
        &pod.spec.as_ref().unwrap().containers[0]
    }

    fn strings(value: &Value) -> Vec<String> {
        serde_json::from_value(value.clone()).unwrap()
    }

    /// The pod's annotations tell the shipped scrape job where each engine's metrics are.
    #[test]
    fn each_engines_metrics_are_announced_on_its_pods() {
        let announced = |spec: Value| {
            let annotations = pod_of(&service(spec)).metadata.annotations.unwrap();
            (
                annotations[npufleet_contract::annotations::METRICS_PORT_NAME].clone(),
                annotations[npufleet_contract::annotations::METRICS_PATH].clone(),
            )
        };
        let base = json!({"model": {"name": "m", "source": {"imagePath": "/m.gguf"}},
                          "accelerator": {"type": "cpu"}});
        let with = |runtime: Value| {
            let mut spec = base.clone();
            spec["runtime"] = runtime;
            spec["template"] = json!({"image": "engine:1"});
            spec
        };
        assert_eq!(announced(base.clone()), ("http".into(), "/metrics".into()));
        assert_eq!(
            announced(with(json!({"engine": "generic", "port": 8080,
                "metrics": {"path": "/stats", "waiting": "q"}}))),
            ("http".into(), "/stats".into())
        );
        assert_eq!(
            announced(with(json!({"engine": "mindie"}))),
            ("metrics".into(), "/metrics".into())
        );
        assert_eq!(
            announced(with(json!({"engine": "generic", "port": 8080}))).0,
            npufleet_contract::annotations::NO_METRICS_PORT
        );
    }

    /// Variables as `name -> value`; a field reference reads `field:<path>`, a Secret key
    /// `secret:<name>/<key>`.
    fn env_map(vars: &[EnvVar]) -> BTreeMap<String, String> {
        vars.iter()
            .map(|v| {
                let from = v.value_from.as_ref();
                let value = match (&v.value, from.and_then(|f| f.field_ref.as_ref())) {
                    (Some(value), _) => value.clone(),
                    (None, Some(field)) => format!("field:{}", field.field_path),
                    (None, None) => {
                        let key = from.and_then(|f| f.secret_key_ref.as_ref()).unwrap();
                        format!("secret:{}/{}", key.name, key.key)
                    }
                };
                (v.name.clone(), value)
            })
            .collect()
    }

    /// A fixture's variable, read the same way.
    fn fixture_var(var: &Value) -> (String, String) {
        let value = match (var["value"].as_str(), var["fieldPath"].as_str()) {
            (Some(value), _) => value.to_string(),
            (None, Some(path)) => format!("field:{path}"),
            (None, None) => panic!("{var} has neither value nor fieldPath"),
        };
        (var["name"].as_str().unwrap().to_string(), value)
    }

    /// A `vllm serve` command line: the positional model path, and each `--flag [value]`.
    fn flags(args: &[String]) -> (String, BTreeMap<String, Option<String>>) {
        let mut parsed = BTreeMap::new();
        let mut rest = args[1..].iter().peekable();
        while let Some(flag) = rest.next() {
            assert!(flag.starts_with("--"), "{flag} is not a flag in {args:?}");
            let value = rest.next_if(|v| !v.starts_with("--")).cloned();
            parsed.insert(flag.clone(), value);
        }
        (args[0].clone(), parsed)
    }

    fn port_numbers(container: &Container) -> Vec<i64> {
        let ports = container.ports.as_ref().unwrap();
        ports.iter().map(|p| i64::from(p.container_port)).collect()
    }

    /// A probe's path and the number of the port it names.
    fn probe_target(container: &Container, probe: &Option<Probe>) -> Value {
        let get = probe.as_ref().unwrap().http_get.as_ref().unwrap();
        let IntOrString::String(name) = &get.port else {
            panic!("probes name their port")
        };
        let ports = container.ports.as_ref().unwrap();
        let port = ports
            .iter()
            .find(|p| p.name.as_ref() == Some(name))
            .unwrap();
        json!({"path": get.path, "port": port.container_port})
    }

    /// The pod's `/dev/shm` volume: its mount path, medium and size.
    fn shared_memory_of(pod: &Pod) -> Value {
        let spec = pod.spec.as_ref().unwrap();
        let volume = spec.volumes.as_ref().unwrap();
        let volume = volume.iter().find(|v| v.name == SHM_VOLUME).unwrap();
        let dir = volume.empty_dir.as_ref().unwrap();
        let mounts = worker(pod).volume_mounts.as_ref().unwrap();
        let mount = mounts.iter().find(|m| m.name == SHM_VOLUME).unwrap();
        json!({"mountPath": mount.mount_path, "medium": dir.medium,
               "sizeLimit": dir.size_limit.as_ref().unwrap().0})
    }

    /// Ports, probes and shared memory are the guide's, the working directory and the memory's
    /// size as the fixture explains.
    fn assert_pod_matches(pod: &Pod, fixture: &Value) {
        let (container, guide) = (worker(pod), &fixture["container"]);
        let ports: Vec<i64> = serde_json::from_value(guide["ports"].clone()).unwrap();
        assert_eq!(port_numbers(container), ports);
        let readiness = probe_target(container, &container.readiness_probe);
        assert_eq!(readiness, guide["readinessProbe"]);
        let liveness = probe_target(container, &container.liveness_probe);
        assert_eq!(liveness, guide["livenessProbe"]);
        let startup = probe_target(container, &container.startup_probe);
        assert_eq!(startup, guide["livenessProbe"]);
        let working_dir = &fixture["differences"]["workingDir"]["rendered"];
        assert_eq!(json!(container.working_dir), *working_dir);
        let mut shared_memory = guide["sharedMemory"].clone();
        shared_memory["sizeLimit"] =
            fixture["differences"]["sharedMemorySizeLimit"]["rendered"].clone();
        assert_eq!(shared_memory_of(pod), shared_memory);
    }

    #[test]
    fn vllm_ascend_is_rendered_as_its_kubernetes_guide_runs_it() {
        let (isvc, fixture) = fixture(VLLM_ASCEND_GUIDE);
        let (guide, differences) = (&fixture["container"], &fixture["differences"]);
        let pod = pod_of(&isvc);
        let container = worker(&pod);
        assert_eq!(json!(container.command), differences["command"]["rendered"]);

        let (guide_model, mut expected) = flags(&strings(&guide["args"]));
        for dropped in differences["argsNotRendered"].as_array().unwrap() {
            let flag = dropped["flag"].as_str().unwrap();
            assert!(expected.remove(flag).is_some(), "{flag} is not the guide's");
        }
        for added in differences["argsAdded"].as_array().unwrap() {
            let value = added["value"].as_str().map(str::to_string);
            expected.insert(added["flag"].as_str().unwrap().to_string(), value);
        }
        let (model, rendered) = flags(container.args.as_ref().unwrap());
        assert_eq!((model, rendered), (guide_model, expected));

        let mut expected: BTreeMap<_, _> = guide["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(fixture_var)
            .collect();
        for dropped in differences["envNotRendered"].as_array().unwrap() {
            let name = dropped["name"].as_str().unwrap();
            assert!(expected.remove(name).is_some(), "{name} is not the guide's");
        }
        expected.extend(
            differences["envAdded"]
                .as_array()
                .unwrap()
                .iter()
                .map(fixture_var),
        );
        assert_eq!(env_map(container.env.as_ref().unwrap()), expected);
        assert_pod_matches(&pod, &fixture);
    }

    #[test]
    fn mindie_is_rendered_as_its_guides_run_it() {
        let (isvc, fixture) = fixture(MINDIE_GUIDE);
        let (guide, differences) = (&fixture["container"], &fixture["differences"]);
        let pod = pod_of(&isvc);
        let container = worker(&pod);
        let command = container.command.as_ref().unwrap();
        assert_eq!(command[..2], ["/bin/bash", "-c"]);
        let script = &command[2];
        let program = guide["program"].as_str().unwrap();
        assert!(
            script.ends_with(&format!("exec {program} \"$@\"\n")),
            "{script}"
        );
        for sourced in strings(&guide["sourcedEnvironments"]) {
            assert!(
                script.contains(&sourced),
                "{sourced} is not sourced:\n{script}"
            );
        }
        let exports: Vec<&str> = script
            .lines()
            .filter(|l| l.starts_with("export "))
            .collect();
        for name in strings(&guide["launchScriptExports"]) {
            let exported = exports
                .iter()
                .any(|l| l.split([' ', '=']).any(|w| w == name));
            assert!(exported, "{name} is not exported:\n{script}");
            assert!(differences["launchScriptExports"][&name].is_string());
        }

        let mut expected: BTreeMap<_, _> = guide["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(fixture_var)
            .collect();
        expected.extend(
            differences["envAdded"]
                .as_array()
                .unwrap()
                .iter()
                .map(fixture_var),
        );
        assert_eq!(env_map(container.env.as_ref().unwrap()), expected);
        assert_pod_matches(&pod, &fixture);
    }

    /// A scratch directory of this test process, removed when dropped.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(test: &str) -> Scratch {
            let dir = std::env::temp_dir().join(format!("npufleet-{test}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Runs MindIE's launch script with `HOME` at `home`, the rank table at `table` and, on
    /// `PATH`, a `mindie_llm_server` that prints what it was started with.
    fn launch(isvc: &InferenceService, home: &Path, table: &Path) -> std::process::Output {
        let server = home.join("bin/mindie_llm_server");
        std::fs::create_dir_all(server.parent().unwrap()).unwrap();
        let print = "#!/bin/sh\necho \"args=$*\"\necho \"MASTER_IP=$MASTER_IP\"\n\
                     echo \"RANK_TABLE_FILE=$RANK_TABLE_FILE\"\n\
                     echo \"mode=$(stat -c %a \"$RANK_TABLE_FILE\")\"\n";
        std::fs::write(&server, print).unwrap();
        Command::new("chmod")
            .arg("755")
            .arg(&server)
            .status()
            .unwrap();
        let mut command = render(isvc).command.unwrap();
        command.extend(["--expert-parallel".to_string()]);
        let path = format!(
            "{}:{}",
            server.parent().unwrap().display(),
            std::env::var("PATH").unwrap()
        );
        Command::new(&command[0])
            .args(&command[1..])
            .env("HOME", home)
            .env("PATH", path)
            .env("RANK_TABLE_FILE", table)
            .env_remove("MIES_CONFIG_JSON_PATH")
            .output()
            .unwrap()
    }

    fn mindie_two_pods(deadline_seconds: i32) -> InferenceService {
        let (mut isvc, _) = fixture(MINDIE_GUIDE);
        isvc.spec.progress_deadline_seconds = deadline_seconds;
        isvc
    }

    #[test]
    fn the_mindie_launch_starts_the_server_from_rank_zero_of_a_completed_rank_table() {
        let scratch = Scratch::new("mindie-launch");
        let table = scratch.0.join("hccl.json");
        let servers = json!([
            {"server_id": "10.0.0.1", "container_ip": "198.18.0.10", "device": []},
            {"server_id": "10.0.0.2", "container_ip": "198.18.0.11", "device": []},
        ]);
        let document = json!({"status": "completed", "version": "1.0", "server_count": "2",
                              "server_list": servers});
        std::fs::write(&table, document.to_string()).unwrap();
        let output = launch(&mindie_two_pods(600), &scratch.0, &table);
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let copy = scratch.0.join("mindie-hccl.json");
        let expected = format!(
            "args=--expert-parallel\nMASTER_IP=198.18.0.10\nRANK_TABLE_FILE={}\nmode=640\n",
            copy.display()
        );
        assert_eq!(stdout, expected);
        assert_eq!(std::fs::read_to_string(copy).unwrap(), document.to_string());
    }

    #[test]
    fn the_mindie_launch_gives_up_on_a_rank_table_never_completed() {
        let scratch = Scratch::new("mindie-launch-deadline");
        let table = scratch.0.join("hccl.json");
        let document = json!({"status": "initializing", "version": "1.0", "server_count": "1",
                              "server_list": []});
        std::fs::write(&table, document.to_string()).unwrap();
        let output = launch(&mindie_two_pods(1), &scratch.0, &table);
        assert!(!output.status.success());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("not completed after 1s"), "{stderr}");
        assert!(output.stdout.is_empty(), "the server must not start");
    }

    #[test]
    fn a_single_pod_mindie_neither_waits_for_a_rank_table_nor_meets_a_master() {
        let (mut isvc, _) = fixture(MINDIE_GUIDE);
        isvc.spec.parallelism.tensor = 4;
        let rendered = render(&isvc);
        let script = &rendered.command.as_ref().unwrap()[2];
        assert!(
            !script.contains("MASTER_IP") && !script.contains("RANK_TABLE_FILE"),
            "{script}"
        );
        let vars = env_map(&rendered.env);
        assert!(!vars.contains_key("RANK_TABLE_FILE") && !vars.contains_key("MASTER_PORT"));
    }

    fn vllm_service(extra: Value) -> InferenceService {
        let (isvc, _) = fixture(VLLM_ASCEND_GUIDE);
        let mut spec = serde_json::to_value(&isvc.spec).unwrap();
        json_merge(&mut spec, extra);
        service(spec)
    }

    fn json_merge(target: &mut Value, patch: Value) {
        match (target, patch) {
            (Value::Object(target), Value::Object(patch)) => {
                for (key, value) in patch {
                    json_merge(target.entry(key).or_insert(Value::Null), value);
                }
            }
            (target, patch) => *target = patch,
        }
    }

    #[test]
    fn vllm_ascend_maps_the_precisions_it_runs() {
        let flags_for = |precision: &str| {
            let isvc = vllm_service(json!({"engine": {"precision": precision}}));
            flags(&render(&isvc).args).1
        };
        let int8 = flags_for("int8");
        assert_eq!(int8["--quantization"].as_deref(), Some("ascend"));
        assert_eq!(flags_for("fp16")["--dtype"].as_deref(), Some("float16"));
        for unmapped in ["fp32", "auto"] {
            let flags = flags_for(unmapped);
            assert!(!flags.contains_key("--dtype") && !flags.contains_key("--quantization"));
        }
    }

    #[test]
    fn gloo_gets_hccl_interface_names_but_not_its_exclusions() {
        let vars = |ifname: &str| {
            let isvc = vllm_service(json!({"parallelism": {"hccl": {"socketIfname": ifname}}}));
            env_map(&render(&isvc).env)
        };
        let exact = vars("=eth0");
        assert_eq!(exact["HCCL_SOCKET_IFNAME"], "=eth0");
        assert_eq!(
            (
                exact["GLOO_SOCKET_IFNAME"].as_str(),
                exact["TP_SOCKET_IFNAME"].as_str()
            ),
            ("eth0", "eth0")
        );
        let excluded = vars("^docker");
        assert_eq!(excluded["HCCL_SOCKET_IFNAME"], "^docker");
        assert!(
            !excluded.contains_key("GLOO_SOCKET_IFNAME")
                && !excluded.contains_key("TP_SOCKET_IFNAME")
        );
    }

    #[test]
    fn vllm_reads_the_api_key_as_its_own() {
        let isvc = vllm_service(json!({"apiKeySecret": {"name": "keys", "key": "api"}}));
        let vars = env_map(&render(&isvc).env);
        assert_eq!(vars["VLLM_API_KEY"], "secret:keys/api");
        assert!(!vars.contains_key(env_names::API_KEY));
    }

    #[test]
    fn the_generic_engine_runs_what_the_spec_says() {
        let isvc = service(json!({
            "model": {"name": "smollm2", "source": {"persistentVolumeClaim": {"claimName": "models", "path": "smollm2.gguf"}}},
            "accelerator": {"type": "cpu"},
            "runtime": {
                "engine": "generic",
                "command": ["llama-server"],
                "args": ["-m", "$(NPUFLEET_MODEL)", "--port", "$(NPUFLEET_HTTP_PORT)", "--metrics"],
                "port": 8080,
                "readinessPath": "/v1/models",
            },
            "template": {"image": "ghcr.io/ggml-org/llama.cpp:server"},
            "apiKeySecret": {"name": "keys", "key": "api"},
        }));
        let pod = pod_of(&isvc);
        let container = worker(&pod);
        assert_eq!(container.command, Some(vec!["llama-server".to_string()]));
        let args = [
            "-m",
            "$(NPUFLEET_MODEL)",
            "--port",
            "$(NPUFLEET_HTTP_PORT)",
            "--metrics",
        ];
        assert_eq!(container.args.as_deref(), Some(&args.map(String::from)[..]));
        let vars = env_map(container.env.as_ref().unwrap());
        let expected = BTreeMap::from([
            (env_names::MODEL, "/models/smollm2.gguf"),
            (env_names::SERVED_MODEL_NAME, "smollm2"),
            (env_names::HTTP_PORT, "8080"),
            ("HOME", TMP_DIR),
            (env_names::API_KEY, "secret:keys/api"),
        ]);
        let expected: BTreeMap<String, String> = expected
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(vars, expected);
        assert_eq!(port_numbers(container), [8080]);
        let path = json!({"path": "/v1/models", "port": 8080});
        assert_eq!(probe_target(container, &container.readiness_probe), path);
        assert_eq!(probe_target(container, &container.liveness_probe), path);
    }

    #[test]
    fn template_env_overrides_the_rendered_variables() {
        let isvc = vllm_service(json!({"template": {"env": [
            {"name": "HF_HUB_OFFLINE", "value": "0"},
            {"name": "PYTORCH_NPU_ALLOC_CONF", "value": "expandable_segments:True"},
        ]}}));
        let rendered = render(&isvc);
        let offline: Vec<_> = rendered
            .env
            .iter()
            .filter(|v| v.name == "HF_HUB_OFFLINE")
            .collect();
        assert_eq!(offline.len(), 1);
        assert_eq!(offline[0].value.as_deref(), Some("0"));
        let vars = env_map(&rendered.env);
        assert_eq!(vars["PYTORCH_NPU_ALLOC_CONF"], "expandable_segments:True");
    }

    #[test]
    fn only_the_npufleet_worker_goes_without_shared_memory() {
        let own = service(json!({
            "model": {"name": "m", "source": {"imagePath": "/models/m.gguf"}},
            "accelerator": {"type": "cpu"},
        }));
        assert_eq!(shared_memory(&own), None);
        assert!(shared_memory(&vllm_service(json!({}))).is_some());
    }
}

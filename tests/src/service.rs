//! InferenceService manifests as the tests write them: the resource's header once, and a
//! SmolLM2 CPU service whose defaults each test overrides only where it differs.

use std::path::Path;

use anyhow::Result;
use kube::Resource;
use kube::core::ApiResource;
use npufleet_contract::env as worker_env;
use npufleet_contract::runtime;
use npufleet_crds::InferenceService;
use serde_json::{Value, json};

use crate::node_agent;

/// The model name the SmolLM2 services serve under.
pub const SMOLLM2: &str = "smollm2";

/// The InferenceService API for untyped objects: what tests use to write what the typed
/// resource could not hold, and to read status as served.
pub fn api_resource() -> ApiResource {
    ApiResource::erase::<InferenceService>(&())
}

/// The InferenceService manifest `name` with `spec`, in `namespace` (or, without one, in the
/// namespace of the API it is written through).
pub fn manifest_json(namespace: Option<&str>, name: &str, spec: Value) -> Value {
    let mut metadata = json!({"name": name});
    if let Some(namespace) = namespace {
        metadata["namespace"] = namespace.into();
    }
    json!({
        "apiVersion": InferenceService::api_version(&()),
        "kind": InferenceService::kind(&()),
        "metadata": metadata,
        "spec": spec,
    })
}

/// [`manifest_json`] read into the typed resource.
pub fn manifest(namespace: &str, name: &str, spec: Value) -> Result<InferenceService> {
    Ok(serde_json::from_value(manifest_json(
        Some(namespace),
        name,
        spec,
    ))?)
}

/// An OpenAI chat request to SmolLM2 of one user message, at most `max_tokens`.
pub fn chat(content: &str, max_tokens: u32) -> Value {
    json!({
        "model": SMOLLM2,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    })
}

/// The worker template's environment: one compute thread per worker, then `extra`.
pub fn worker_env(extra: &[(&str, &str)]) -> Value {
    std::iter::once((worker_env::THREADS, "1"))
        .chain(extra.iter().copied())
        .map(|(name, value)| json!({"name": name, "value": value}))
        .collect()
}

/// InferenceService `name` serving the SmolLM2 file at `model_path` on the node agent `node`:
/// [`on_node_agent`].
pub fn smollm2(
    namespace: &str,
    name: &str,
    model_path: &Path,
    node: &str,
    spec: Value,
) -> Result<InferenceService> {
    on_node_agent(namespace, name, (SMOLLM2, model_path), node, spec)
}

/// InferenceService `name` serving `model` (its name and file) on CPU on the node agent
/// `node`, one warm-up iteration and one compute thread per worker, with `spec` merged over
/// that (objects field by field, anything else replaced).
pub fn on_node_agent(
    namespace: &str,
    name: &str,
    (model, model_path): (&str, &Path),
    node: &str,
    spec: Value,
) -> Result<InferenceService> {
    let mut full = json!({
        "model": {"name": model, "source": {"imagePath": model_path.display().to_string()}},
        "accelerator": {"type": "cpu"},
        "engine": {"warmupIterations": 1},
        "scheduling": node_agent::scheduling(node),
        "template": {"env": worker_env(&[])},
    });
    merge(&mut full, spec);
    manifest(namespace, name, full)
}

/// The manifest of InferenceService `name` on CPU naming model `m` at a path no worker reads
/// (for tests whose pods KWOK fakes, or that never run), with `spec` merged over that as
/// [`on_node_agent`] does; in `namespace`, as [`manifest_json`].
pub fn unread_json(namespace: Option<&str>, name: &str, spec: Value) -> Value {
    let mut full = json!({
        "model": {"name": "m", "source": {"imagePath": "/models/m.gguf"}},
        "accelerator": {"type": "cpu"},
    });
    merge(&mut full, spec);
    manifest_json(namespace, name, full)
}

/// [`unread_json`] read into the typed resource.
pub fn unread(namespace: &str, name: &str, spec: Value) -> Result<InferenceService> {
    Ok(serde_json::from_value(unread_json(
        Some(namespace),
        name,
        spec,
    ))?)
}

/// [`unread`], naming SmolLM2.
pub fn unread_smollm2(namespace: &str, name: &str, spec: Value) -> Result<InferenceService> {
    let mut full = json!({
        "model": {"name": SMOLLM2, "source": {"imagePath": "/models/smollm2.gguf"}},
    });
    merge(&mut full, spec);
    unread(namespace, name, full)
}

/// The port llama-server listens on in its pods (its own default).
pub const LLAMA_SERVER_PORT: u16 = 8080;

/// The `generic` runtime running `llama-server` from llama.cpp's published server image, as a
/// user writes it: the model path, served name and port from the operator's variables, two
/// request slots (more requests are deferred: its queue), HTTP threads for every client,
/// metrics on.
pub fn llama_server_runtime() -> Value {
    json!({
        "runtime": {
            "engine": "generic",
            "command": ["llama-server"],
            "args": [
                "--model", "$(NPUFLEET_MODEL)", "--alias", "$(NPUFLEET_SERVED_MODEL_NAME)",
                "--host", "0.0.0.0", "--port", "$(NPUFLEET_HTTP_PORT)",
                "--parallel", "2", "--ctx-size", "4096", "--threads", "1", "--metrics",
                // One HTTP thread per connection it holds: with fewer than the clients, its
                // probes and metrics wait behind them and the pod reads as not ready.
                "--threads-http", "32",
            ],
            "port": LLAMA_SERVER_PORT,
            "metrics": {"waiting": runtime::LLAMA_CPP_WAITING, "running": runtime::LLAMA_CPP_RUNNING},
        },
        "template": {"image": "ghcr.io/ggml-org/llama.cpp:server"},
    })
}

/// `extra` over `base`, as [`on_node_agent`] merges a test's spec.
pub fn merged(mut base: Value, extra: Value) -> Value {
    merge(&mut base, extra);
    base
}

/// `patch` over `base` as a JSON merge patch (RFC 7386) does, without its null-deletes.
fn merge(base: &mut Value, patch: Value) {
    match (base, patch) {
        (Value::Object(base), Value::Object(patch)) => {
            for (key, value) in patch {
                merge(base.entry(key).or_insert(Value::Null), value);
            }
        }
        (base, patch) => *base = patch,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_overrides_merge_into_objects_and_replace_the_rest() {
        let service = smollm2(
            "ns",
            "chat",
            Path::new("/models/m.gguf"),
            "agent-0",
            json!({
                "replicas": 2,
                "engine": {"drainSeconds": 5},
                "template": {"env": [{"name": "A", "value": "1"}]},
            }),
        )
        .unwrap();
        let spec = serde_json::to_value(&service.spec).unwrap();
        assert_eq!(spec["replicas"], 2);
        assert_eq!(spec["engine"]["warmupIterations"], 1);
        assert_eq!(spec["engine"]["drainSeconds"], 5);
        assert_eq!(
            spec["template"]["env"],
            json!([{"name": "A", "value": "1"}])
        );
        assert_eq!(spec["model"]["name"], SMOLLM2);
    }
}

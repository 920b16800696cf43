//! The apiserver itself rejects invalid InferenceServices, with a message naming the field,
//! using the checked-in CRD exactly as generated.

use anyhow::{Context, Result, bail};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use npufleet_tests::{cluster, paths, process};
use serde_json::{Value, json};

async fn install_crd(client: &Client) -> Result<()> {
    let path = paths::repo_root()
        .join("crds/generated")
        .join(npufleet_crds::CRD_FILE);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let crd: CustomResourceDefinition = serde_yaml::from_str(&text)?;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    crds.patch(
        "inferenceservices.npufleet.io",
        &PatchParams::apply("crd-test").force(),
        &Patch::Apply(&crd),
    )
    .await
    .context("the apiserver accepts the generated CRD")?;
    npufleet_tests::crd::wait_established(client, "inferenceservices.npufleet.io").await
}

/// The generated CRD installed and a namespace for `test`: the namespace and its
/// InferenceServices' API.
async fn namespace_with_crd(test: &str) -> Result<(String, Api<DynamicObject>)> {
    let c = cluster::shared();
    let client = c.client().await?;
    install_crd(&client).await?;
    let ns = c.namespace(&client, test).await?;
    let api = Api::namespaced_with(client, &ns, &npufleet_tests::service::api_resource());
    Ok((ns, api))
}

fn valid(name: &str) -> Value {
    json!({
        "apiVersion": "npufleet.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "deepseek-13b", "source": {"imagePath": "/models/m.gguf"}},
            "replicas": 1,
            "accelerator": {"type": "ascend910", "devicesPerPod": 4},
            "parallelism": {"tensor": 4},
        }
    })
}

/// Sets `pointer` (a JSON pointer below the object) to `value`, creating parents.
fn with(mut object: Value, pointer: &str, value: Value) -> Value {
    let mut target = &mut object;
    let parts: Vec<&str> = pointer.trim_start_matches('/').split('/').collect();
    for (i, part) in parts.iter().enumerate() {
        if i + 1 == parts.len() {
            target[*part] = value;
            break;
        }
        if target.get(*part).is_none() {
            target[*part] = json!({});
        }
        target = &mut target[*part];
    }
    object
}

fn without(mut object: Value, pointer: &str) -> Value {
    let (parent, key) = pointer.rsplit_once('/').expect("pointer has a parent");
    if let Some(map) = object.pointer_mut(parent).and_then(Value::as_object_mut) {
        map.remove(key);
    }
    object
}

async fn rejection(api: &Api<DynamicObject>, object: Value) -> Result<String> {
    let object: DynamicObject = serde_json::from_value(object)?;
    match api.create(&PostParams::default(), &object).await {
        Ok(_) => bail!("accepted"),
        Err(kube::Error::Api(status)) if status.code == 422 => Ok(status.message),
        Err(e) => bail!("unexpected error: {e}"),
    }
}

/// Each case's value, put in place by `build`, is refused with a message naming its field.
async fn expect_rejections(
    api: &Api<DynamicObject>,
    cases: &[(Value, &str)],
    build: impl Fn(Value) -> Value,
) {
    let mut failures = Vec::new();
    for (value, field) in cases {
        match rejection(api, build(value.clone())).await {
            Ok(message) if message.contains(field) => {}
            Ok(message) => {
                failures.push(format!("{value}: message does not name {field}: {message}"))
            }
            Err(e) => failures.push(format!("{value}: {e:#}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test]
async fn invalid_inference_services_are_rejected_naming_the_field() -> Result<()> {
    let (_, api) = namespace_with_crd("crd-validation").await?;

    let base = valid("ok");
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "vendor engine without its image",
            with(
                base.clone(),
                "/spec/runtime",
                json!({"engine": "vllm-ascend"}),
            ),
            "spec.template.image",
        ),
        (
            "generic engine without its port",
            with(
                with(base.clone(), "/spec/runtime", json!({"engine": "generic"})),
                "/spec/template/image",
                json!("engine:1"),
            ),
            "spec.runtime.port",
        ),
        (
            "runtime arguments for the worker",
            with(base.clone(), "/spec/runtime", json!({"args": ["--x"]})),
            "spec.runtime.command, args",
        ),
        (
            "vllm-ascend across pods",
            with(
                with(
                    with(
                        base.clone(),
                        "/spec/runtime",
                        json!({"engine": "vllm-ascend"}),
                    ),
                    "/spec/template/image",
                    json!("vllm-ascend:1"),
                ),
                "/spec/parallelism/tensor",
                json!(8),
            ),
            "spec.parallelism.tensor",
        ),
        (
            "tensor not a multiple of devicesPerPod",
            with(base.clone(), "/spec/parallelism/tensor", json!(6)),
            "spec.parallelism.tensor",
        ),
        (
            "unknown accelerator type",
            with(base.clone(), "/spec/accelerator/type", json!("tpu")),
            "spec.accelerator.type",
        ),
        (
            "unknown platform",
            with(base.clone(), "/spec/accelerator/platform", json!("aws")),
            "spec.accelerator.platform",
        ),
        (
            "devicesPerPod out of range",
            with(base.clone(), "/spec/accelerator/devicesPerPod", json!(0)),
            "spec.accelerator.devicesPerPod",
        ),
        (
            "CCE device count",
            with(
                with(
                    with(base.clone(), "/spec/accelerator/platform", json!("cce")),
                    "/spec/accelerator/devicesPerPod",
                    json!(3),
                ),
                "/spec/parallelism/tensor",
                json!(3),
            ),
            "spec.accelerator.devicesPerPod",
        ),
        (
            "resource name on CPU",
            with(
                with(
                    base.clone(),
                    "/spec/accelerator",
                    json!({"type": "cpu", "resourceName": "huawei.com/Ascend910"}),
                ),
                "/spec/parallelism/tensor",
                json!(1),
            ),
            "spec.accelerator.resourceName",
        ),
        (
            "chip name on CPU",
            with(
                with(
                    base.clone(),
                    "/spec/accelerator",
                    json!({"type": "cpu", "chipName": "910B3"}),
                ),
                "/spec/parallelism/tensor",
                json!(1),
            ),
            "spec.accelerator.chipName must not be set when spec.accelerator.type is cpu",
        ),
        (
            "malformed resource name",
            with(
                base.clone(),
                "/spec/accelerator/resourceName",
                json!("Ascend 910"),
            ),
            "spec.accelerator.resourceName",
        ),
        (
            "no model source",
            with(base.clone(), "/spec/model/source", json!({})),
            "spec.model.source",
        ),
        (
            "two model sources",
            with(
                base.clone(),
                "/spec/model/source/persistentVolumeClaim",
                json!({"claimName": "w", "path": "m"}),
            ),
            "spec.model.source",
        ),
        (
            "relative image path",
            with(
                base.clone(),
                "/spec/model/source/imagePath",
                json!("models/m.gguf"),
            ),
            "spec.model.source.imagePath",
        ),
        (
            "escaping claim path",
            with(
                base.clone(),
                "/spec/model/source",
                json!({"persistentVolumeClaim": {"claimName": "w", "path": "../etc"}}),
            ),
            "spec.model.source.persistentVolumeClaim.path",
        ),
        (
            "empty model name",
            with(base.clone(), "/spec/model/name", json!("")),
            "spec.model.name",
        ),
        (
            "missing model",
            without(base.clone(), "/spec/model"),
            "spec.model",
        ),
        (
            "negative replicas",
            with(base.clone(), "/spec/replicas", json!(-1)),
            "spec.replicas",
        ),
        (
            "minReplicas above maxReplicas",
            with(
                base.clone(),
                "/spec/autoscaling",
                json!({"minReplicas": 5, "maxReplicas": 2}),
            ),
            "spec.autoscaling.minReplicas",
        ),
        (
            "minReplicas 0 under the HPA",
            with(
                base.clone(),
                "/spec/autoscaling",
                json!({"mode": "hpa", "minReplicas": 0, "maxReplicas": 2}),
            ),
            "only the built-in autoscaler scales to zero",
        ),
        (
            "zero target queue depth",
            with(
                base.clone(),
                "/spec/autoscaling",
                json!({"maxReplicas": 2, "targetQueueDepth": 0}),
            ),
            "spec.autoscaling.targetQueueDepth",
        ),
        (
            "unknown autoscaling mode",
            with(
                base.clone(),
                "/spec/autoscaling",
                json!({"maxReplicas": 2, "mode": "magic"}),
            ),
            "spec.autoscaling.mode",
        ),
        (
            "HCCL timeout below 120 s",
            with(
                base.clone(),
                "/spec/parallelism/hccl/connectTimeoutSeconds",
                json!(30),
            ),
            "spec.parallelism.hccl.connectTimeoutSeconds",
        ),
        (
            "unknown HCCL algorithm",
            with(
                base.clone(),
                "/spec/parallelism/hccl/algorithm",
                json!("butterfly"),
            ),
            "spec.parallelism.hccl.algorithm",
        ),
        (
            "malformed socket interface",
            with(
                base.clone(),
                "/spec/parallelism/hccl/socketIfname",
                json!("eth 0"),
            ),
            "spec.parallelism.hccl.socketIfname",
        ),
        (
            "zero batch size",
            with(base.clone(), "/spec/engine/maxBatchSize", json!(0)),
            "spec.engine.maxBatchSize",
        ),
        (
            "unknown precision",
            with(base.clone(), "/spec/engine/precision", json!("fp4")),
            "spec.engine.precision",
        ),
        (
            "empty prefix template",
            with(
                base.clone(),
                "/spec/engine/prefixTemplates",
                json!(["sys", ""]),
            ),
            "spec.engine.prefixTemplates",
        ),
        (
            "CCE 910 without Volcano",
            with(
                with(base.clone(), "/spec/accelerator/platform", json!("cce")),
                "/spec/scheduling/schedulerName",
                json!("default-scheduler"),
            ),
            "spec.scheduling.schedulerName",
        ),
        (
            "model volume not declared",
            with(
                base.clone(),
                "/spec/model/source",
                json!({"volume": {"name": "weights", "path": "m"}}),
            ),
            "spec.model.source.volume",
        ),
        (
            "name too long for pod names",
            with(base.clone(), "/metadata/name", json!("a".repeat(41))),
            "metadata.name",
        ),
    ];
    assert!(cases.len() >= 15);
    let mut failures = Vec::new();
    for (i, (what, object, field)) in cases.into_iter().enumerate() {
        let object = if what == "name too long for pod names" {
            object
        } else {
            with(object, "/metadata/name", json!(format!("bad-{i}")))
        };
        match rejection(&api, object).await {
            Ok(message) if message.contains(field) => {}
            Ok(message) => {
                failures.push(format!("{what}: message does not name {field}: {message}"))
            }
            Err(e) => failures.push(format!("{what}: {e:#}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    // The valid object is accepted, defaulted, and its accelerator cannot be changed.
    let created = api
        .create(
            &PostParams::default(),
            &serde_json::from_value(valid("ok"))?,
        )
        .await?;
    assert_eq!(created.data["spec"]["engine"]["maxBatchSize"], 128);
    assert_eq!(created.data["spec"]["engine"]["warmupIterations"], 100);
    assert_eq!(
        created.data["spec"]["accelerator"]["platform"],
        "mindcluster"
    );
    let change = json!({"spec": {"accelerator": {"type": "ascend310p", "devicesPerPod": 4}}});
    match api
        .patch("ok", &PatchParams::default(), &Patch::Merge(&change))
        .await
    {
        Err(kube::Error::Api(status)) if status.code == 422 => {
            assert!(
                status.message.contains("spec.accelerator"),
                "{}",
                status.message
            )
        }
        other => bail!("changing the accelerator was not rejected: {other:?}"),
    }
    Ok(())
}

#[tokio::test]
async fn an_optional_enum_offers_only_its_values_and_takes_null_as_unset() -> Result<()> {
    let (_, api) = namespace_with_crd("crd-enums").await?;

    let sometimes = with(
        valid("sometimes"),
        "/spec/template/imagePullPolicy",
        json!("Sometimes"),
    );
    let message = rejection(&api, sometimes).await?;
    assert!(
        message.contains(
            r#"spec.template.imagePullPolicy: Unsupported value: "Sometimes": supported values: "Always", "IfNotPresent", "Never""#
        ) && !message.contains(r#""null""#),
        "{message}"
    );
    let message = rejection(
        &api,
        with(
            valid("ring"),
            "/spec/parallelism/hccl/algorithm",
            json!("butterfly"),
        ),
    )
    .await?;
    assert!(
        message
            .contains(r#"supported values: "ring", "H-D_R", "NHR", "NB", "pipeline", "pairwise""#)
            && !message.contains(r#""null""#),
        "{message}"
    );

    // An explicit null means unset, as for any optional field.
    let nulls = with(
        with(
            valid("nulls"),
            "/spec/template/imagePullPolicy",
            Value::Null,
        ),
        "/spec/parallelism/hccl/algorithm",
        Value::Null,
    );
    let created = api
        .create(&PostParams::default(), &serde_json::from_value(nulls)?)
        .await
        .context("explicit nulls refused")?;
    let spec = &created.data["spec"];
    assert!(spec["template"].get("imagePullPolicy").is_none(), "{spec}");
    assert!(
        spec["parallelism"]["hccl"].get("algorithm").is_none(),
        "{spec}"
    );
    Ok(())
}

#[tokio::test]
async fn latency_objectives_take_positive_durations_and_open_percentiles_naming_the_field()
-> Result<()> {
    let (_, api) = namespace_with_crd("crd-objectives").await?;
    let objectives = |value: Value| {
        with(
            valid("objectives"),
            "/spec/autoscaling",
            json!({"minReplicas": 1, "maxReplicas": 4, "objectives": value}),
        )
    };
    let cases = [
        (
            json!({}),
            "spec.autoscaling.objectives must set ttft, tpot or both",
        ),
        (
            json!({"ttft": {"percentile": 100, "target": "800ms"}}),
            "spec.autoscaling.objectives.ttft.percentile",
        ),
        (
            json!({"tpot": {"percentile": 0, "target": "80ms"}}),
            "spec.autoscaling.objectives.tpot.percentile",
        ),
        (
            json!({"ttft": {"target": "0ms"}}),
            "spec.autoscaling.objectives.ttft.target",
        ),
        (
            json!({"tpot": {"target": "fast"}}),
            "spec.autoscaling.objectives.tpot.target",
        ),
        (
            json!({"tpot": {"target": "1m"}}),
            "spec.autoscaling.objectives.tpot.target",
        ),
    ];
    expect_rejections(&api, &cases, objectives).await;

    let accepted = objectives(json!({
        "ttft": {"percentile": 99.5, "target": "1.5s"},
        "tpot": {"target": "80ms"},
    }));
    let created = api
        .create(&PostParams::default(), &serde_json::from_value(accepted)?)
        .await
        .context("valid objectives refused")?;
    let objectives = &created.data["spec"]["autoscaling"]["objectives"];
    assert_eq!(objectives["tpot"]["percentile"], 90.0, "{objectives}");
    Ok(())
}

#[tokio::test]
async fn flow_control_refuses_bad_durations_digests_and_repeated_keys_naming_the_field()
-> Result<()> {
    let (_, api) = namespace_with_crd("crd-flow-control").await?;
    let flow = |value: Value| {
        with(
            valid("flow"),
            "/spec/routing",
            json!({"flowControl": value}),
        )
    };
    let digest = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
    let key = |name: &str, sha: &str| json!({"name": name, "apiKeySha256": sha});
    let cases = [
        (
            json!({"queueTtl": "1m"}),
            "spec.routing.flowControl.queueTtl",
        ),
        (
            json!({"queueTtl": "0s"}),
            "spec.routing.flowControl.queueTtl",
        ),
        (
            json!({"maxQueued": 0}),
            "spec.routing.flowControl.maxQueued",
        ),
        (
            json!({"maxConcurrencyPerReplica": 2, "reservedPerReplica": 2}),
            "spec.routing.flowControl.reservedPerReplica must be less than maxConcurrencyPerReplica",
        ),
        (
            json!({"maxConcurrencyPerReplica": 0}),
            "spec.routing.flowControl.maxConcurrencyPerReplica",
        ),
        (
            json!({"keys": [key("gold", "NOTHEX")]}),
            "spec.routing.flowControl.keys[0].apiKeySha256",
        ),
        (
            json!({"keys": [key("Gold!", digest)]}),
            "spec.routing.flowControl.keys[0].name",
        ),
        (
            json!({"keys": [key("gold", digest), key("gold", &digest.replace('9', "8"))]}),
            "spec.routing.flowControl.keys must not repeat a name or an apiKeySha256",
        ),
        (
            json!({"keys": [key("gold", digest), key("bulk", digest)]}),
            "spec.routing.flowControl.keys must not repeat a name or an apiKeySha256",
        ),
        (
            json!({"default": {"requestsPerMinute": 0}}),
            "spec.routing.flowControl.default.requestsPerMinute",
        ),
    ];
    expect_rejections(&api, &cases, flow).await;

    let created = api
        .create(
            &PostParams::default(),
            &serde_json::from_value(flow(json!({
                "keys": [{"name": "gold", "apiKeySha256": digest, "priority": 10, "tokensPerMinute": 100000}],
            })))?,
        )
        .await
        .context("valid flow control refused")?;
    let flow = &created.data["spec"]["routing"]["flowControl"];
    assert_eq!(
        (flow["queueTtl"].as_str(), flow["maxQueued"].as_u64()),
        (Some("30s"), Some(256)),
        "{flow}"
    );
    Ok(())
}

#[tokio::test]
async fn samples_are_valid() -> Result<()> {
    let (ns, _) = namespace_with_crd("crd-samples").await?;
    let samples = paths::repo_root().join("deploy/samples");
    let mut apply = cluster::shared().kubectl();
    apply
        .args(["apply", "--dry-run=server", "-n", &ns, "-f"])
        .arg(&samples);
    let text = process::stdout_of(apply)?;
    let mut objects = 0;
    for file in std::fs::read_dir(&samples)? {
        let manifest = std::fs::read_to_string(file?.path())?;
        objects += manifest.lines().filter(|l| l.starts_with("kind:")).count();
    }
    assert!(objects >= 3, "deploy/samples holds {objects} objects");
    assert_eq!(
        text.matches("created (server dry run)").count(),
        objects,
        "{text}"
    );
    Ok(())
}

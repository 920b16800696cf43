//! `mode: hpa` the way CCE runs it: the operator's own external metrics server stays off,
//! Prometheus scrapes the real worker pods (SmolLM2 on CPU, run by the node agent) with the
//! shipped scrape job, prometheus-adapter serves `npufleet_queue_depth` from the shipped rules
//! as the aggregated `v1beta1.external.metrics.k8s.io`, and kube-controller-manager's HPA
//! (the one the operator creates, unchanged) scales the `InferenceService` up under a burst of
//! clients and back down after it. The same Prometheus then runs every query of the shipped
//! Grafana dashboard against the live fleet.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
use kube::api::Api;
use npufleet_operator::external_metrics::{QUEUE_DEPTH, SERVICE_LABEL};
use npufleet_tests::fleet::{Load, RunningRouter, Testbed};
use npufleet_tests::monitoring::{Adapter, EXTERNAL_METRICS_API_SERVICE, Prometheus, deploy_file};
use npufleet_tests::operator::ReplicaWatch;
use npufleet_tests::{cluster, paths, service, wait};
use serde_json::json;

const MANAGER: &str = "autoscaling-prometheus-adapter-test";
const TARGET_QUEUE: u32 = 2;
const CLIENTS: u32 = 6;
/// A panel whose description says it needs an exporter the test cluster does not run is
/// checked for syntax only.
const NEEDS: &str = "Needs ";

/// Runs `kubectl` off the async threads.
async fn kubectl(args: &[&str]) -> Result<String> {
    let c = cluster::shared();
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    let out = tokio::task::spawn_blocking(move || c.kubectl().args(&args).output()).await??;
    anyhow::ensure!(
        out.status.success(),
        "kubectl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// Every `(panel title, description, expr)` of the shipped dashboard, with the dashboard's
/// variables set to `namespace` and the service `chat`.
fn dashboard_queries(namespace: &str) -> Result<Vec<(String, String, String)>> {
    let text = std::fs::read_to_string(deploy_file("dashboards/npufleet-fleet.json"))?;
    let dashboard: serde_json::Value = serde_json::from_str(&text)?;
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().context("no panels")? {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"]
                .as_str()
                .context("a target without expr")?
                .replace("$namespace", namespace)
                .replace("$inference_service", "chat")
                .replace("$__rate_interval", "1m")
                .replace("$__range", "5m");
            queries.push((
                panel["title"].as_str().unwrap_or_default().to_owned(),
                panel["description"].as_str().unwrap_or_default().to_owned(),
                expr,
            ));
        }
    }
    Ok(queries)
}

/// `helm install` of the chart with its external metrics server asked for, on a cluster whose
/// external metrics API belongs to prometheus-adapter: the APIService is not touched (same
/// spec and metadata, no helm field manager), the chart renders no metrics Service, and the operator runs
/// with its server off.
/// The HPA that follows still reads the adapter, which proves the same end to end.
async fn chart_leaves_the_adapter_alone(client: &kube::Client) -> Result<()> {
    let c = cluster::shared();
    let api_services: Api<APIService> = Api::all(client.clone());
    let before = api_services.get(EXTERNAL_METRICS_API_SERVICE).await?;
    let release_ns = c.namespace(client, "chart-beside-adapter").await?;
    let mut helm = c.helm();
    helm.args(["install", "npufleet"])
        .arg(paths::repo_root().join("charts/npufleet"))
        .args(["-n", &release_ns, "--skip-crds"])
        .args(["--set", "externalMetrics.enabled=true"]);
    let out = tokio::task::spawn_blocking(move || helm.output()).await??;
    anyhow::ensure!(
        out.status.success(),
        "helm install failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let notes = String::from_utf8_lossy(&out.stdout);
    assert!(
        notes.contains("external.metrics.k8s.io is already served by"),
        "{notes}"
    );
    // The resourceVersion is no witness: the aggregator rewrites the APIService's status
    // whenever it re-probes the adapter. What helm would change is the spec, the labels and
    // annotations, and a field manager of its own.
    let after = api_services.get(EXTERNAL_METRICS_API_SERVICE).await?;
    assert_eq!(
        serde_json::to_value(&after.spec)?,
        serde_json::to_value(&before.spec)?,
        "helm install changed the adapter's APIService"
    );
    assert_eq!(after.metadata.labels, before.metadata.labels);
    assert_eq!(after.metadata.annotations, before.metadata.annotations);
    let managers: Vec<_> = after
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter_map(|m| m.manager.as_deref())
        .collect();
    assert!(
        !managers.iter().any(|m| m.contains("helm")),
        "helm manages fields of the adapter's APIService: {managers:?}"
    );
    let services: Api<Service> = Api::namespaced(client.clone(), &release_ns);
    assert!(
        services
            .get_opt("npufleet-external-metrics")
            .await?
            .is_none(),
        "the chart rendered its own metrics Service"
    );
    let deployment = Api::<Deployment>::namespaced(client.clone(), &release_ns)
        .get("npufleet")
        .await?;
    let args = serde_json::to_value(&deployment.spec)?["template"]["spec"]["containers"][0]["args"]
        .clone();
    assert!(
        args.as_array()
            .is_some_and(|a| a.iter().any(|v| v == "--external-metrics-addr=")),
        "the operator would serve external metrics: {args}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hpa_scales_through_prometheus_adapter_on_the_shipped_rules() -> Result<()> {
    hpa_through_prometheus_adapter(Fleet::Worker).await
}

/// The same with an engine this project did not write: llama.cpp's `llama-server` as the
/// `generic` runtime, its `llamacpp:*` series read by the shipped rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hpa_scales_llama_server_through_prometheus_adapter_on_the_shipped_rules() -> Result<()>
{
    hpa_through_prometheus_adapter(Fleet::LlamaServer).await
}

#[derive(Clone, Copy, PartialEq)]
enum Fleet {
    /// This project's worker; the shipped dashboard's queries are checked against it too.
    Worker,
    LlamaServer,
}

/// One adapter at a time: each registers itself as the cluster's only
/// `v1beta1.external.metrics.k8s.io`.
static ADAPTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn hpa_through_prometheus_adapter(fleet: Fleet) -> Result<()> {
    let _only = ADAPTER.lock().await;
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let (test, subnet, programs, runtime) = match fleet {
            Fleet::Worker => ("prometheus-adapter", 43, vec![], json!({})),
            Fleet::LlamaServer => {
                let binary = tokio::task::spawn_blocking(paths::llama_server).await??;
                (
                    "prometheus-adapter-llama",
                    45,
                    vec![("llama-server", binary)],
                    service::llama_server_runtime(),
                )
            }
        };
        let bed = Testbed::start_with_programs(c, &client, test, subnet, MANAGER, &programs).await?;
        let ns = bed.namespace.clone();
        let prometheus = Prometheus::start(c, &ns).await?;
        let _adapter = Adapter::register(c, &client, &ns, &prometheus).await?;
        if fleet == Fleet::Worker {
            chart_leaves_the_adapter_alone(&client).await?;
        }
        // The controller and the autoscaler loop, which in mode hpa only writes the HPA; no
        // external metrics server is started.
        let _operator = bed.start_operator()?;
        bed.apply_smollm2(
            "chat",
            service::merged(
                runtime,
                json!({
                    "engine": {"drainSeconds": 60},
                    "autoscaling": {"mode": "hpa", "minReplicas": 1, "maxReplicas": 3, "targetQueueDepth": TARGET_QUEUE},
                }),
            ),
        )
        .await?;
        bed.wait_serving(1).await?;
        let services = bed.services();

        // Prometheus found the worker through the API server, the adapter relisted it, and the
        // aggregator serves the adapter's answer for the operator's selector.
        let path = format!(
            "/apis/external.metrics.k8s.io/v1beta1/namespaces/{ns}/{QUEUE_DEPTH}?labelSelector={SERVICE_LABEL}%3Dchat"
        );
        let idle: serde_json::Value =
            wait::until("the adapter serving npufleet_queue_depth", Duration::from_secs(90), || async {
                let list: serde_json::Value =
                    serde_json::from_str(&kubectl(&["get", "--raw", &path]).await?)?;
                anyhow::ensure!(list["items"].as_array().is_some_and(|i| !i.is_empty()), "{list}");
                Ok(Some(list))
            })
            .await?;
        assert_eq!(idle["kind"], "ExternalMetricValueList");
        assert_eq!(idle["items"][0]["value"], "0", "{idle}");

        let hpas: Api<HorizontalPodAutoscaler> = Api::namespaced(client.clone(), &ns);
        let replicas = ReplicaWatch::start(&services, "chat");

        let router = RunningRouter::start(c, "router-adapter", &ns, &[]).await?;
        let load = Load::through(&router);
        let burst_started = Instant::now();
        load.start(
            CLIENTS,
            "/v1/chat/completions",
            service::chat("Name three rivers in Europe.", 24),
        );
        wait::until("the HPA's first scale-up", Duration::from_secs(120), || async {
            let desired = services.get("chat").await?.spec.replicas;
            if desired > 1 { Ok(Some(())) } else { anyhow::bail!("spec.replicas = {desired}") }
        })
        .await?;
        let first_up = replicas
            .first_scale_up()
            .map_or(burst_started.elapsed(), |t| t.duration_since(burst_started));

        // `kubectl get hpa` shows the adapter's current value against the target.
        let shown = wait::until("kubectl get hpa showing the metric", Duration::from_secs(30), || async {
            let shown = kubectl(&["get", "hpa", "chat", "-n", &ns]).await?;
            let status = hpas.get("chat").await?.status.context("no HPA status")?;
            let current = status
                .current_metrics
                .unwrap_or_default()
                .into_iter()
                .find_map(|m| m.external)
                .and_then(|e| e.current.average_value)
                .map(|q| q.0);
            match current {
                Some(value) if shown.contains(&format!("{value}/{TARGET_QUEUE} (avg)")) => {
                    Ok(Some(shown))
                }
                _ => anyhow::bail!("current {current:?}:\n{shown}"),
            }
        })
        .await?;

        // Every panel of the shipped dashboard, against this fleet while it is under load.
        let mut checked = Vec::new();
        let panels = match fleet {
            Fleet::Worker => dashboard_queries(&ns)?,
            Fleet::LlamaServer => Vec::new(),
        };
        for (title, description, expr) in panels {
            let needs_exporter = description.contains(NEEDS);
            let series = if needs_exporter {
                prometheus.query(&expr).await?
            } else {
                wait::until(&format!("series for panel {title:?}: {expr}"), Duration::from_secs(60), || async {
                    let series = prometheus.query(&expr).await?;
                    Ok((!series.is_empty()).then_some(series))
                })
                .await?
            };
            checked.push(format!(
                "{title}: {} series{}",
                series.len(),
                if needs_exporter { " (syntax only: needs an exporter the test cluster lacks)" } else { "" }
            ));
        }

        load.stop().await?;
        let burst = burst_started.elapsed();
        let down_started = Instant::now();
        bed.wait_scaled_to("chat", (1, 1), "the HPA scaling chat back to 1")
            .await?;

        let (sent, failed) = (load.sent(), load.failed());
        eprintln!(
            "prometheus-adapter HPA ({test}): {CLIENTS} clients for {:.1} s, {sent} requests, {failed} failed; first scale-up {:.1} s after the burst began; back to 1 replica {:.1} s after it ended\n{shown}\ndashboard:\n  {}",
            burst.as_secs_f64(),
            first_up.as_secs_f64(),
            down_started.elapsed().as_secs_f64(),
            checked.join("\n  "),
        );
        assert_eq!(failed, 0, "failed requests: {:?}", load.failures().await);
        Ok(())
    })
    .await
}

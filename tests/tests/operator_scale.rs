//! Scale: 500 InferenceServices created concurrently on KWOK nodes, timing how fast the operator
//! brings them all to Ready, sampling its peak memory and counting the API requests it sends per
//! reconcile, with release builds as users run them. It fails when the operator misses the
//! targets it has met so far. Slow, so not part of the default suite:
//!   make scale-test

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use npufleet_tests::cluster::{Cluster, ClusterOptions, FakeNode};
use npufleet_tests::process::Process;
use npufleet_tests::{paths, service, wait};
use serde_json::json;

const SERVICES: usize = 500;
/// KWOK nodes hold 110 pods each.
const EXTRA_NODES: usize = 4;
/// Creates in flight at once, as `kubectl apply -f dir/` or a GitOps sync would send them.
const CONCURRENT_CREATES: usize = 32;
/// Every service Ready within this of the first create (28.4 s measured on 2 cores).
const READY_WITHIN: Duration = Duration::from_secs(60);
/// The operator's peak resident memory over the run (90.8 MiB measured).
const PEAK_RSS_MIB: f64 = 100.0;

/// Peak resident memory of `pid` so far (`VmHWM`), in KiB.
fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Sum of every series of a counter in Prometheus text.
fn counter_sum(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(['{', ' ']))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test]
#[ignore = "takes minutes; run explicitly to measure throughput and memory"]
async fn five_hundred_inference_services_reach_ready() -> Result<()> {
    let mut options = ClusterOptions::full();
    options
        .nodes
        .extend((0..EXTRA_NODES).map(|i| FakeNode::cpu(&format!("scale-cpu-{i}"))));
    let c = Cluster::start(options).await?;
    let client = c.client().await?;
    let crd_path = paths::repo_root()
        .join("crds/generated")
        .join(npufleet_crds::CRD_FILE);
    let crd: CustomResourceDefinition = serde_yaml::from_str(&std::fs::read_to_string(crd_path)?)?;
    Api::<CustomResourceDefinition>::all(client.clone())
        .patch(
            "inferenceservices.npufleet.io",
            &PatchParams::apply("scale-test").force(),
            &Patch::Apply(&crd),
        )
        .await?;
    let resource = service::api_resource();
    wait::until(
        "InferenceService API served",
        Duration::from_secs(60),
        || async {
            let served = client
                .list_api_group_resources("npufleet.io/v1alpha1")
                .await;
            Ok(served
                .ok()
                .filter(|l| l.resources.iter().any(|r| r.name == resource.plural))
                .map(|_| ()))
        },
    )
    .await?;
    let ns = c.namespace(&client, "scale").await?;

    let (mut cmd, port) = npufleet_tests::operator::command(c.kubeconfig(), "warn")?;
    cmd.args([
        "--external-metrics-addr=",
        "--leader-election=false",
        "--log-format",
        "json",
    ]);
    let operator = Process::start(
        "npufleet-operator",
        cmd,
        &c.scratch().join("scale-operator.log"),
    )?;

    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &resource);
    let started = Instant::now();
    futures::stream::iter(0..SERVICES)
        .map(|i| {
            let api = api.clone();
            async move {
                let object: DynamicObject = serde_json::from_value(service::unread_json(
                    None,
                    &format!("svc-{i}"),
                    json!({}),
                ))?;
                api.create(&PostParams::default(), &object).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(CONCURRENT_CREATES)
        .try_collect::<()>()
        .await?;
    let created_in = started.elapsed();
    let mut peak = 0;
    wait::until(
        "every InferenceService Ready",
        Duration::from_secs(900),
        || {
            let api = api.clone();
            peak = peak.max(peak_rss_kib(operator.pid()).unwrap_or(0));
            async move {
                let list = api.list(&ListParams::default()).await?;
                let ready = list
                    .items
                    .iter()
                    .filter(|o| {
                        o.data["status"]["conditions"].as_array().is_some_and(|cs| {
                            cs.iter()
                                .any(|c| c["type"] == "Ready" && c["status"] == "True")
                        })
                    })
                    .count();
                Ok((ready == SERVICES).then_some(()))
            }
        },
    )
    .await
    .context("waiting for Ready")?;
    let elapsed = started.elapsed();
    let peak = peak.max(peak_rss_kib(operator.pid()).unwrap_or(0));
    let metrics = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await?
        .text()
        .await?;
    let api_requests = counter_sum(&metrics, "rest_client_requests_total");
    let reconciles = counter_sum(&metrics, "npufleet_operator_reconciliations_total");
    println!(
        "{SERVICES} InferenceServices Ready in {:.1} s (created in {:.1} s, {CONCURRENT_CREATES} at a time): \
         {:.1} services/s; operator peak RSS {:.1} MiB; {api_requests} API requests over {reconciles} \
         reconciles ({:.2} per reconcile)",
        elapsed.as_secs_f64(),
        created_in.as_secs_f64(),
        SERVICES as f64 / elapsed.as_secs_f64(),
        peak as f64 / 1024.0,
        api_requests / reconciles.max(1.0),
    );
    anyhow::ensure!(
        elapsed <= READY_WITHIN,
        "{SERVICES} InferenceServices took {:.1} s to be Ready, more than the {} s target",
        elapsed.as_secs_f64(),
        READY_WITHIN.as_secs()
    );
    anyhow::ensure!(
        peak as f64 / 1024.0 <= PEAK_RSS_MIB,
        "the operator's peak RSS was {:.1} MiB, more than the {PEAK_RSS_MIB} MiB target",
        peak as f64 / 1024.0
    );
    Ok(())
}

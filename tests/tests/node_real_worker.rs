//! The product as a user installs it, on the real node: `helm install` of the chart as shipped
//! (only the image references set to this build's local images) runs the operator and the
//! router as pods, Ready by kubelet's probes and reaching the apiserver through the
//! `kubernetes` Service; the sample InferenceService (`deploy/samples/cpu-smollm2.yaml`) gets a
//! worker container made Ready by kubelet's probes; a stream goes through the router's Service
//! ClusterIP from the node and its DNS name answers from a pod; the service scales 1 → 2 → 1
//! under streaming load with no failed request, the removed pod gone within its grace period;
//! the worker's memory stays under its cgroup limit.
//!
//! Its own test binary: it needs its own real node (one per machine) and the images of this
//! build.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use npufleet_contract::labels;
use npufleet_contract::ports::HTTP_PORT;
use npufleet_crds::InferenceService;
use npufleet_tests::chart::{self, LocalImages};
use npufleet_tests::cluster::{Cluster, ClusterOptions};
use npufleet_tests::fleet::{Load, request_once, worker_metrics};
use npufleet_tests::real_node::{self, CLUSTER_DOMAIN, REAL_NODE_LABEL};
use npufleet_tests::{access, operator, paths, process, wait};
use serde_json::json;

const SAMPLE: &str = "deploy/samples/cpu-smollm2.yaml";
const MANAGER: &str = "node-real-worker-test";
/// Pulling nothing, but starting the engine and warming it up on 2 shared cores.
const TIMEOUT: Duration = Duration::from_secs(180);

fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The worker pods of `service`, by name.
async fn workers(pods: &Api<Pod>, service: &str) -> Result<Vec<Pod>> {
    let selector = format!("{}={service}", labels::INFERENCE_SERVICE);
    Ok(pods
        .list(&ListParams::default().labels(&selector))
        .await?
        .items)
}

/// The pod's memory cgroup (v1, kubelet's cgroupfs layout): peak usage, working set (usage
/// less inactive file pages, what kubelet evicts and reports by) and limit, in bytes.
fn memory_of(pod: &Pod) -> Result<(u64, u64, u64)> {
    let uid = pod.metadata.uid.as_deref().context("the pod has no uid")?;
    let root = std::path::Path::new("/sys/fs/cgroup/memory/kubepods");
    let dir = [
        root.join(format!("pod{uid}")),
        root.join(format!("burstable/pod{uid}")),
        root.join(format!("besteffort/pod{uid}")),
    ]
    .into_iter()
    .find(|d| d.is_dir())
    .with_context(|| format!("no memory cgroup for pod {uid} under {}", root.display()))?;
    let read = |file: &str| -> Result<String> {
        std::fs::read_to_string(dir.join(file))
            .with_context(|| format!("{}", dir.join(file).display()))
    };
    let number = |file: &str| -> Result<u64> { Ok(read(file)?.trim().parse()?) };
    let inactive_file = read("memory.stat")?
        .lines()
        .find_map(|l| l.strip_prefix("total_inactive_file "))
        .context("memory.stat has no total_inactive_file")?
        .parse::<u64>()?;
    let usage = number("memory.usage_in_bytes")?;
    Ok((
        number("memory.max_usage_in_bytes")?,
        usage.saturating_sub(inactive_file),
        number("memory.limit_in_bytes")?,
    ))
}

/// The burst that fills the KV cache: requests at once, and the prompt's length in repeats of a
/// six-token phrase: about 12,000 tokens, of the 20,000 the sample's 1 GiB limit gives.
const BURST_REQUESTS: usize = 8;
const BURST_PROMPT_REPEATS: usize = 250;
/// Prefill of the whole burst shares two cores with everything else on the machine.
const BURST_TIMEOUT: Duration = Duration::from_secs(300);

/// The worker's `vllm:kv_cache_usage_perc`, a fraction.
async fn kv_cache_usage(http: &reqwest::Client, ip: &str) -> Result<f64> {
    let metrics = worker_metrics(http, ip).await?;
    metrics
        .lines()
        .find(|l| l.starts_with("vllm:kv_cache_usage_perc"))
        .and_then(|l| l.rsplit_once(' '))
        .context("no vllm:kv_cache_usage_perc")?
        .1
        .parse()
        .context("vllm:kv_cache_usage_perc")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_serves_the_sample_and_scales_it_under_load_on_the_real_node() -> Result<()> {
    if let Some(why) = real_node::unavailable() {
        println!("skipping the real-node test: {why}");
        return Ok(());
    }
    let images =
        tokio::task::spawn_blocking(|| LocalImages::build(&paths::target_bin_dir())).await??;
    let mut sample: InferenceService =
        serde_yaml::from_str(&std::fs::read_to_string(paths::repo_root().join(SAMPLE))?)?;
    // The sample names the published image; the same image of this build, by its local name.
    let published = sample
        .spec
        .template
        .image
        .clone()
        .context("the sample names no image")?;
    let worker_image = chart::reference(&images.worker_smollm2);
    ensure!(
        published
            .rsplit_once('/')
            .map(|(_, name_and_tag)| name_and_tag)
            == worker_image
                .rsplit_once('/')
                .map(|(_, name_and_tag)| name_and_tag),
        "the sample names {published}, this build's smollm2 worker is {worker_image}"
    );
    sample.spec.template.image = Some(worker_image);
    // The sample asks a whole core per replica; this node has two, shared with the chart's
    // pods, and the test runs two replicas.
    sample
        .spec
        .template
        .resources
        .get_or_insert_default()
        .requests
        .insert(
            "cpu".into(),
            k8s_openapi::apimachinery::pkg::api::resource::Quantity("500m".into()),
        );

    let c = Cluster::start(ClusterOptions::real_node()).await?;
    let node = c.real_node().context("the cluster has a real node")?;
    let imported = Instant::now();
    node.import(&images.archives())?;
    println!(
        "images imported in {:.1} s",
        imported.elapsed().as_secs_f64()
    );
    let client = c.client().await?;

    // helm install, as a user would, with the images of this build.
    let release_ns = access::restricted_namespace(&c, &client, "npufleet-system").await?;
    let installed = Instant::now();
    chart::install(&c, &release_ns, &images).await?;
    println!(
        "helm install -> operator and router pods Ready: {:.1} s",
        installed.elapsed().as_secs_f64()
    );

    // kubectl apply of the sample.
    let ns = access::restricted_namespace(&c, &client, "serving").await?;
    let services: Api<InferenceService> = Api::namespaced(client.clone(), &ns);
    let name = sample
        .metadata
        .name
        .clone()
        .context("the sample has a name")?;
    sample.metadata.namespace = Some(ns.clone());
    let created = Instant::now();
    operator::apply(&services, MANAGER, &sample).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let first = c.diagnose(
        wait::until(
            "a worker pod Ready by kubelet's probes",
            TIMEOUT,
            || async { Ok(workers(&pods, &name).await?.into_iter().find(is_ready)) },
        )
        .await,
    )?;
    println!(
        "InferenceService applied -> worker pod Ready: {:.1} s",
        created.elapsed().as_secs_f64()
    );

    // A stream through the router's Service, from the node.
    let base = chart::router_url(&c, &release_ns).await?;
    let body = json!({
        "model": sample.spec.model.name,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 16,
        "stream": true,
    });
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(0)
        .build()?;
    let url = format!("{base}/v1/chat/completions");
    // The routers learn of the pod from their watch; until then they hold the request.
    c.diagnose(
        wait::until(
            "a stream through the router's ClusterIP",
            TIMEOUT,
            || async { Ok(request_once(&http, &url, &body).await.ok()) },
        )
        .await,
    )?;

    // The router's DNS name, from a pod.
    let dns_name = format!("{}.{release_ns}.svc.{CLUSTER_DOMAIN}", chart::ROUTER);
    let netcheck = paths::image_tag(node.images(), "netcheck")
        .context("tests/setup/node.sh lists the netcheck image")?;
    let fetch: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "fetch-models"},
        "spec": {
            "nodeSelector": {REAL_NODE_LABEL: "true"},
            "restartPolicy": "Never",
            "securityContext": {"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "netcheck",
                "image": netcheck,
                "imagePullPolicy": "Never",
                "args": ["fetch", format!("http://{dns_name}:{HTTP_PORT}/v1/models")],
                "securityContext": {
                    "allowPrivilegeEscalation": false,
                    "capabilities": {"drop": ["ALL"]},
                    "readOnlyRootFilesystem": true,
                },
            }],
        },
    }))?;
    pods.create(&PostParams::default(), &fetch).await?;
    let phase = c.diagnose(
        wait::until(
            "the pod fetching /v1/models by DNS name",
            TIMEOUT,
            || async {
                let phase = pods.get("fetch-models").await?.status.and_then(|s| s.phase);
                Ok(phase.filter(|p| p == "Succeeded" || p == "Failed"))
            },
        )
        .await,
    )?;
    let log = pods.logs("fetch-models", &Default::default()).await?;
    ensure!(
        phase == "Succeeded" && log.contains(&sample.spec.model.name),
        "fetching /v1/models from {dns_name} in a pod: {phase}: {log}"
    );

    // Scale 1 -> 2 under streaming load.
    let load = Load::at(base.clone());
    load.start(4, "/v1/chat/completions", body.clone());
    load.wait_sent(8, "requests at one replica").await?;
    let scaled_up = Instant::now();
    operator::set_replicas(&services, &name, 2).await?;
    c.diagnose(
        wait::until(
            "both replicas answering through the router",
            TIMEOUT,
            || async { Ok((load.answered_by().await.len() == 2).then_some(())) },
        )
        .await,
    )?;
    println!(
        "replicas 1 -> 2: second replica answering through the router {:.1} s after the patch",
        scaled_up.elapsed().as_secs_f64()
    );

    load.stop().await?;
    ensure!(
        load.failed() == 0,
        "{} of {} requests failed while scaling up: {:?}",
        load.failed(),
        load.sent(),
        load.failures().await
    );

    // The runtime kills one replica's container: kubelet restarts it, and meanwhile the router
    // sends every new request to the other. Only streams already running on it may break.
    let clients = 4;
    let load = Load::at(base.clone());
    load.start(clients, "/v1/chat/completions", body.clone());
    load.wait_sent(8, "requests at two replicas").await?;
    let victim = workers(&pods, &name)
        .await?
        .into_iter()
        .find(|p| p.metadata.name.as_deref() != first.metadata.name.as_deref())
        .context("no second replica")?;
    let victim_name = victim.metadata.name.clone().unwrap_or_default();
    let container = victim
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.first())
        .and_then(|c| c.container_id.as_deref())
        .and_then(|id| id.strip_prefix("containerd://"))
        .context("the second replica has no containerd id")?
        .to_owned();
    let survivor = first.metadata.name.clone().unwrap_or_default();
    let survivor_before = load
        .answered_by()
        .await
        .get(&survivor)
        .copied()
        .unwrap_or(0);
    let mut kill = node.ctr();
    kill.args(["tasks", "kill", "--signal", "SIGKILL", &container]);
    process::stdout_of(kill)?;
    let killed = Instant::now();
    c.diagnose(
        wait::until(
            "the killed container restarted by kubelet and Ready",
            TIMEOUT,
            || async {
                let pod = pods.get(&victim_name).await?;
                let restarts = pod
                    .status
                    .as_ref()
                    .and_then(|s| s.container_statuses.as_ref())
                    .and_then(|cs| cs.first())
                    .map_or(0, |c| c.restart_count);
                Ok((restarts >= 1 && is_ready(&pod)).then_some(()))
            },
        )
        .await,
    )?;
    let restarted_in = killed.elapsed();
    let survivor_answered = load
        .answered_by()
        .await
        .get(&survivor)
        .copied()
        .unwrap_or(0)
        - survivor_before;
    load.stop().await?;
    println!(
        "a killed worker container: restarted and Ready again in {:.1} s; meanwhile {survivor_answered} answers from the other replica; requests sent {}, failed {}",
        restarted_in.as_secs_f64(),
        load.sent(),
        load.failed(),
    );
    ensure!(
        survivor_answered > 0,
        "no request was answered while {victim_name} restarted"
    );
    ensure!(
        load.failed() <= u64::from(clients),
        "{} requests failed, more than the {clients} that can have been running on the killed container: {:?}",
        load.failed(),
        load.failures().await
    );

    // Scale 2 -> 1 under load: the removed pod drains and goes within its grace.
    let load = Load::at(base.clone());
    load.start(clients, "/v1/chat/completions", body.clone());
    load.wait_sent(8, "requests before the scale-down").await?;
    let before: HashSet<String> = workers(&pods, &name)
        .await?
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect();
    let scaled_down = Instant::now();
    operator::set_replicas(&services, &name, 1).await?;
    let grace = Duration::from_secs(
        first
            .spec
            .as_ref()
            .and_then(|s| s.termination_grace_period_seconds)
            .context("the worker pod has no grace period")? as u64,
    );
    let deleting_since = std::sync::Mutex::new(None);
    let removed = c.diagnose(
        wait::until("one replica left", TIMEOUT, || async {
            let now = workers(&pods, &name).await?;
            if now.iter().any(|p| p.metadata.deletion_timestamp.is_some()) {
                deleting_since
                    .lock()
                    .expect("deletion time")
                    .get_or_insert_with(Instant::now);
            }
            let names: HashSet<String> = now.into_iter().filter_map(|p| p.metadata.name).collect();
            Ok((names.len() == 1).then(|| before.difference(&names).cloned().collect::<Vec<_>>()))
        })
        .await,
    )?;
    let drained_in = deleting_since
        .into_inner()
        .expect("deletion time")
        .map_or(Duration::ZERO, |t: Instant| t.elapsed());
    load.wait_sent(8, "requests after the scale-down").await?;
    load.stop().await?;
    println!(
        "replicas 2 -> 1: {removed:?} gone {:.1} s after the patch, {:.1} s after its deletion (grace {} s); requests sent {}, failed {}, refused as overload {}",
        scaled_down.elapsed().as_secs_f64(),
        drained_in.as_secs_f64(),
        grace.as_secs(),
        load.sent(),
        load.failed(),
        load.rejected(),
    );
    ensure!(
        load.failed() == 0,
        "{} of {} requests failed: {:?}",
        load.failed(),
        load.sent(),
        load.failures().await
    );
    ensure!(
        drained_in < grace,
        "the removed pod took {drained_in:?}, beyond its grace period {grace:?}"
    );

    // A burst of long, distinct prompts, enough to fill most of the KV cache at once.
    let patient = reqwest::Client::builder().timeout(BURST_TIMEOUT).build()?;
    let burst_started = Instant::now();
    let burst: Vec<_> = (0..BURST_REQUESTS)
        .map(|i| {
            let http = patient.clone();
            let url = url.clone();
            let prompt = format!(
                "{i} {}",
                "tell me more about the sea ".repeat(BURST_PROMPT_REPEATS)
            );
            let body = json!({
                "model": sample.spec.model.name,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 8,
                "stream": true,
            });
            tokio::spawn(async move { request_once(&http, &url, &body).await })
        })
        .collect();
    let left_ip = workers(&pods, &name)
        .await?
        .into_iter()
        .find_map(|p| p.status.and_then(|s| s.pod_ip))
        .context("no worker address")?;
    // The KV cache's use sampled at every poll until the whole burst is answered.
    let kv_peak = std::sync::Mutex::new(0.0_f64);
    wait::until("the burst answered", BURST_TIMEOUT, || async {
        let usage = kv_cache_usage(&http, &left_ip).await.unwrap_or(0.0);
        let mut peak = kv_peak.lock().expect("peak");
        *peak = peak.max(usage);
        Ok(burst.iter().all(|b| b.is_finished()).then_some(()))
    })
    .await?;
    let kv_peak = kv_peak.into_inner().expect("peak");
    for request in burst {
        request.await?.context("a request of the burst")?;
    }
    println!(
        "a burst of {BURST_REQUESTS} long prompts: answered in {:.1} s, peak KV-cache use {:.0}%",
        burst_started.elapsed().as_secs_f64(),
        kv_peak * 100.0
    );

    // The remaining worker was never OOM-killed, and stays under its cgroup limit.
    let left = workers(&pods, &name)
        .await?
        .into_iter()
        .next()
        .context("no worker left")?;
    let status = left
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.first())
        .context("the worker has no container status")?;
    ensure!(
        status.restart_count == 0
            && status
                .last_state
                .as_ref()
                .and_then(|s| s.terminated.as_ref())
                .is_none(),
        "the worker container restarted: {:?}",
        status.last_state
    );
    let (peak, working_set, limit) = memory_of(&left)?;
    println!(
        "worker memory: peak {} MiB, working set {} MiB, limit {} MiB",
        peak >> 20,
        working_set >> 20,
        limit >> 20
    );
    ensure!(
        working_set < limit,
        "working set {working_set} at or above the limit {limit}"
    );
    let pod_ip = left
        .status
        .and_then(|s| s.pod_ip)
        .context("the worker has no address")?;
    let metrics = worker_metrics(&http, &pod_ip).await?;
    let cache = metrics
        .lines()
        .find(|l| l.starts_with("vllm:cache_config_info"))
        .context("the worker exports no vllm:cache_config_info")?;
    println!("worker KV cache, sized from its limit: {cache}");

    // A bad value in the template's environment: the worker exits on it, kubelet backs off
    // restarting it, and the InferenceService's Ready condition says why in the worker's words.
    let mut bad = sample.clone();
    bad.metadata.name = Some(format!("{name}-bad-value"));
    bad.metadata.resource_version = None;
    bad.spec
        .template
        .env
        .push(k8s_openapi::api::core::v1::EnvVar {
            name: npufleet_contract::env::LONG_PREFILL_TOKEN_THRESHOLD.into(),
            value: Some("abc".into()),
            ..Default::default()
        });
    operator::apply(&services, MANAGER, &bad).await?;
    let bad_name = bad.metadata.name.clone().unwrap_or_default();
    let message = c.diagnose(
        wait::until(
            "the Ready condition naming the worker's error",
            TIMEOUT,
            || async {
                let status = services.get(&bad_name).await?.status.unwrap_or_default();
                Ok(status
                    .conditions
                    .into_iter()
                    .find(|c| c.type_ == "Ready" && c.message.contains("CrashLoopBackOff"))
                    .map(|c| c.message))
            },
        )
        .await,
    )?;
    println!("a bad environment value: {message}");
    ensure!(
        message.contains("invalid value 'abc' for '--long-prefill-token-threshold"),
        "the Ready condition does not name the bad value: {message}"
    );
    services.delete(&bad_name, &Default::default()).await?;
    Ok(())
}

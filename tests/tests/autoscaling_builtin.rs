//! `mode: builtin` end to end on the real control plane: the operator's reconcile makes the
//! worker pods, kube-scheduler binds them to a node-agent node, the node agent runs the real
//! worker (SmolLM2 on CPU) on its own loopback address, and the autoscaler reads the workers'
//! load signal and scales the `InferenceService` through its scale subresource. A burst of
//! closed-loop clients takes the service from 1 replica to what the load needs and, after the
//! burst, back to 1, with every request answered.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams};
use npufleet_crds::InferenceService;
use npufleet_operator::autoscaler::policy::PolicyConfig;
use npufleet_operator::autoscaler::{self, Autoscaler};
use npufleet_operator::external_metrics::MetricsStore;
use npufleet_operator::metrics::Metrics;
use npufleet_operator::{Context as OperatorContext, Settings};
use npufleet_tests::fleet::{Router, serving_addresses};
use npufleet_tests::node_agent::{NODE_AGENT_LABEL, NodeAgent, NodeAgentConfig};
use npufleet_tests::{cluster, paths, wait};
use serde_json::json;
use tokio::sync::Mutex;

const MANAGER: &str = "autoscaling-builtin-test";
const TARGET_QUEUE: u32 = 2;
const CLIENTS: u32 = 6;

struct Load {
    sent: AtomicU64,
    failed: AtomicU64,
    failures: Mutex<Vec<String>>,
    router: Router,
    stop: AtomicBool,
}

/// One closed-loop client: a chat completion, wait for the answer, repeat.
async fn client_loop(load: Arc<Load>, http: reqwest::Client, model: String) {
    while !load.stop.load(Ordering::Relaxed) {
        let Some(address) = load.router.pick(Duration::from_millis(250)).await else {
            continue;
        };
        load.sent.fetch_add(1, Ordering::Relaxed);
        let response = http
            .post(format!("http://{address}:8000/v1/chat/completions"))
            .json(&json!({
                "model": model,
                "messages": [{"role": "user", "content": "Name three rivers in Europe."}],
                "max_tokens": 24,
            }))
            .send()
            .await;
        let outcome = match response {
            Ok(r) if r.status().is_success() => r
                .json::<serde_json::Value>()
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            Ok(r) => Err(format!("{address}: HTTP {}", r.status())),
            Err(e) => Err(format!("{address}: {e}")),
        };
        load.router.release(&address).await;
        if let Err(failure) = outcome {
            load.failed.fetch_add(1, Ordering::Relaxed);
            load.failures.lock().await.push(failure);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_takes_one_replica_to_what_the_load_needs_and_back_without_failures() -> Result<()>
{
    let c = cluster::shared();
    let client = c.client().await?;
    let result = async {
        let ns = c.namespace(&client, "autoscaling-builtin").await?;
        npufleet_tests::crd::install_inference_service(&client, MANAGER).await?;
        let model_path = tokio::task::spawn_blocking(paths::smollm2_gguf).await??;
        let worker = paths::workspace_bin("npufleet-worker")?;
        let node = "agent-builtin-0";
        let _agent = NodeAgent::start(
            client.clone(),
            NodeAgentConfig::new(node, worker, c.scratch().join("agent-builtin"), 41),
        )
        .await?;

        let operator = Arc::new(OperatorContext::new(
            client.clone(),
            Settings::default(),
            Metrics::new()?,
            None,
        ));
        let reconcile = tokio::spawn(npufleet_operator::run(operator));
        let store = MetricsStore::default();
        // Shorter windows than the defaults so that the scale-down shows within a test.
        let settings = autoscaler::Settings {
            policy: PolicyConfig {
                stable_window: Duration::from_secs(8),
                panic_window: Duration::from_secs(2),
                scale_down_delay: Duration::from_secs(4),
                ..PolicyConfig::default()
            },
            ..autoscaler::Settings::default()
        };
        let (scaler, watches) = Autoscaler::new(client.clone(), Some(&ns), settings, store)?;
        let watches = tokio::spawn(watches);
        let scaling = tokio::spawn(scaler.run());

        let services: Api<InferenceService> = Api::namespaced(client.clone(), &ns);
        let service: InferenceService = serde_json::from_value(json!({
            "apiVersion": "npufleet.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": ns},
            "spec": {
                "model": {"name": "smollm2", "source": {"imagePath": model_path.display().to_string()}},
                "replicas": 1,
                "accelerator": {"type": "cpu"},
                "engine": {"warmupIterations": 1, "drainSeconds": 60},
                "autoscaling": {"mode": "builtin", "minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": TARGET_QUEUE},
                "scheduling": {"nodeSelector": {NODE_AGENT_LABEL: node}},
                "template": {"env": [{"name": "NPUFLEET_THREADS", "value": "1"}]},
            }
        }))?;
        wait::until("InferenceService create", Duration::from_secs(30), || async {
            Ok(Some(
                services
                    .patch("chat", &PatchParams::apply(MANAGER).force(), &Patch::Apply(&service))
                    .await?,
            ))
        })
        .await?;

        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
        wait::until("the first replica serving", Duration::from_secs(180), || async {
            let serving = serving_addresses(&pods).await?;
            Ok((serving.len() == 1).then_some(()))
        })
        .await?;

        // Watch the desired count while the load runs.
        let max_desired = Arc::new(AtomicU32::new(1));
        let first_scale_up: Arc<Mutex<Option<Instant>>> = Arc::default();
        let load = Arc::new(Load {
            sent: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            failures: Mutex::default(),
            router: Router::default(),
            stop: AtomicBool::new(false),
        });
        let watcher = {
            let (services, pods, load) = (services.clone(), pods.clone(), load.clone());
            let (max_desired, first_scale_up) = (max_desired.clone(), first_scale_up.clone());
            tokio::spawn(async move {
                loop {
                    if let Ok(service) = services.get("chat").await {
                        let desired = u32::try_from(service.spec.replicas).unwrap_or(0);
                        max_desired.fetch_max(desired, Ordering::Relaxed);
                        if desired > 1 {
                            first_scale_up.lock().await.get_or_insert_with(Instant::now);
                        }
                    }
                    if let Ok(addresses) = serving_addresses(&pods).await {
                        load.router.set_addresses(addresses).await;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        };

        let http = reqwest::Client::builder().timeout(Duration::from_secs(120)).build()?;
        let burst_started = Instant::now();
        let clients: Vec<_> = (0..CLIENTS)
            .map(|_| tokio::spawn(client_loop(load.clone(), http.clone(), "smollm2".into())))
            .collect();

        let needed = CLIENTS.div_ceil(TARGET_QUEUE);
        wait::until("every needed replica serving under load", Duration::from_secs(240), || async {
            let serving = serving_addresses(&pods).await?.len() as u32;
            if serving >= needed { Ok(Some(())) } else { anyhow::bail!("{serving} serving") }
        })
        .await?;
        let scaled_up_in = burst_started.elapsed();
        // Keep the load on the full fleet until every client has been served by it again,
        // then end the burst.
        let sent_at_full_fleet = load.sent.load(Ordering::Relaxed);
        wait::until("the full fleet to answer another round", Duration::from_secs(120), || async {
            let sent = load.sent.load(Ordering::Relaxed);
            Ok((sent >= sent_at_full_fleet + 2 * u64::from(CLIENTS)).then_some(()))
        })
        .await?;
        load.stop.store(true, Ordering::Relaxed);
        for client in clients {
            client.await?;
        }
        let burst = burst_started.elapsed();

        wait::until("the scale-down back to one serving replica", Duration::from_secs(180), || async {
            let desired = services.get("chat").await?.spec.replicas;
            let live = pods.list(&ListParams::default()).await?.items.len();
            if desired == 1 && live == 1 { Ok(Some(())) } else { anyhow::bail!("desired {desired}, {live} pods") }
        })
        .await?;
        watcher.abort();

        let first_up = first_scale_up
            .lock()
            .await
            .context("the service never scaled up")?
            .duration_since(burst_started);
        let sent = load.sent.load(Ordering::Relaxed);
        let failed = load.failed.load(Ordering::Relaxed);
        eprintln!(
            "burst: {CLIENTS} clients for {:.1} s, {sent} requests, {failed} failed; first scale-up decision {:.2} s after the burst began; {needed} replicas serving after {:.1} s; max desired {}",
            burst.as_secs_f64(),
            first_up.as_secs_f64(),
            scaled_up_in.as_secs_f64(),
            max_desired.load(Ordering::Relaxed),
        );
        assert_eq!(failed, 0, "failed requests: {:?}", load.failures.lock().await);
        assert!(sent >= u64::from(CLIENTS), "only {sent} requests");
        // Closed-loop clients never put more than CLIENTS requests in the system: anything
        // above CLIENTS / target would be a cascade while replicas warm up.
        assert_eq!(max_desired.load(Ordering::Relaxed), needed);
        // Loose enough for a busy two-core machine; the figure itself is printed above.
        assert!(first_up < Duration::from_secs(10), "first scale-up after {first_up:?}");

        scaling.abort();
        watches.abort();
        reconcile.abort();
        Ok(())
    }
    .await;
    c.diagnose(result)
}

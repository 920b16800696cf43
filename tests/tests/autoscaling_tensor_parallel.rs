//! A tensor-parallel service (2 ranks, one pod each) under the built-in autoscaler on the real
//! control plane: each replica group is two real worker processes joined by the TCP ring
//! through the operator's `hccl.json`, and a load burst takes the service from one group to
//! two and back. Groups come and go whole, every group serves, and no request fails.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use npufleet_contract::env as worker_env;
use npufleet_contract::pods;
use npufleet_tests::fleet::{Load, RunningRouter, Testbed};
use npufleet_tests::{paths, process, service, wait};
use serde_json::json;

const MANAGER: &str = "autoscaling-tp-test";
const TARGET_QUEUE: u32 = 3;
const CLIENTS: u32 = 6;

/// Group index → ranks of its live (non-terminating) pods.
async fn groups(pods: &Api<Pod>) -> Result<BTreeMap<String, Vec<String>>> {
    let mut groups: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for pod in pods.list(&ListParams::default()).await?.items {
        if pod.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let labels = pod.labels();
        let group = labels.get("npufleet.io/group").cloned().unwrap_or_default();
        let rank = labels.get("npufleet.io/rank").cloned().unwrap_or_default();
        groups.entry(group).or_default().push(rank);
    }
    for ranks in groups.values_mut() {
        ranks.sort();
    }
    Ok(groups)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tp2_service_scales_by_whole_groups_and_every_group_serves() -> Result<()> {
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let bed = Testbed::start(c, &client, "autoscaling-tp", 42, MANAGER).await?;
        let ns = bed.namespace.clone();
        // A random-weight model whose 8 heads and 4 KV heads split over 2 ranks.
        let model = c.scratch().join("tp-model.gguf");
        let mut generate = std::process::Command::new(paths::workspace_bin("npufleet-gen-test-model")?);
        generate
            .args(["--layers", "2", "--dim", "128", "--heads", "8"])
            .args(["--kv-heads", "4", "--context", "2048", "--out"])
            .arg(&model);
        process::stdout_of(generate)?;
        let _operator = bed.start_operator()?;
        bed.apply_on_agent(
            "tp",
            ("tiny", &model),
            json!({
                "replicas": 1,
                "accelerator": {"type": "cpu", "devicesPerPod": 1},
                "parallelism": {"tensor": 2},
                "engine": {"drainSeconds": 60},
                "autoscaling": {"mode": "builtin", "minReplicas": 1, "maxReplicas": 2, "targetQueueDepth": TARGET_QUEUE},
                "template": {"env": service::worker_env(&[(worker_env::IGNORE_EOS, "true")])},
            }),
        )
        .await?;
        bed.wait_serving(1).await?;
        let (services, pods) = (bed.services(), bed.pods());
        let first = groups(&pods).await?;
        ensure!(
            first.values().all(|ranks| ranks == &["0", "1"]) && first.len() == 1,
            "one group of ranks 0 and 1 expected, got {first:?}"
        );

        let router = RunningRouter::start(c, "router-tp", &ns, &[]).await?;
        let load = Load::through(&router);
        let max_desired = Arc::new(AtomicU32::new(1));
        let max_groups = Arc::new(AtomicU32::new(1));
        let watcher = {
            let (services, pods) = (services.clone(), pods.clone());
            let (max_desired, max_groups) = (max_desired.clone(), max_groups.clone());
            tokio::spawn(async move {
                let mut samples = tokio::time::interval(Duration::from_millis(100));
                loop {
                    samples.tick().await;
                    if let Ok(service) = services.get("tp").await {
                        let desired = u32::try_from(service.spec.replicas).unwrap_or(0);
                        max_desired.fetch_max(desired, Ordering::Relaxed);
                    }
                    if let Ok(groups) = groups(&pods).await {
                        max_groups.fetch_max(groups.len() as u32, Ordering::Relaxed);
                    }
                }
            })
        };

        let burst_started = Instant::now();
        load.start(
            CLIENTS,
            "/v1/completions",
            json!({"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 48}),
        );
        let needed = CLIENTS.div_ceil(TARGET_QUEUE);
        bed.wait_serving_at_least(needed as usize, "both groups serving under load")
            .await?;
        let scaled_up_in = burst_started.elapsed();
        let both = groups(&pods).await?;
        ensure!(
            both.len() == 2 && both.values().all(|ranks| ranks == &["0", "1"]),
            "two whole groups expected, got {both:?}"
        );
        // Keep the burst on until both groups' leaders have answered (the router names the
        // answering pod).
        wait::until("every group to answer", Duration::from_secs(120), || async {
            let serving: Vec<String> = pods
                .list(&ListParams::default().labels("npufleet.io/rank=0"))
                .await?
                .items
                .iter()
                .filter(|p| pods::serves(p))
                .map(|p| p.name_any())
                .collect();
            let answered = load.answered_by().await;
            let all = serving.iter().all(|a| answered.get(a).is_some_and(|&n| n > 0));
            Ok(all.then_some(()))
        })
        .await?;
        load.stop().await?;

        bed.wait_scaled_to("tp", (1, 2), "the scale-down back to one group")
            .await?;
        let last = groups(&pods).await?;
        ensure!(last.len() == 1, "one group expected after the scale-down, got {last:?}");
        watcher.abort();

        let (sent, failed) = (load.sent(), load.failed());
        let answered = load.answered_by().await;
        eprintln!(
            "TP-2 burst: {CLIENTS} clients, {sent} requests, {failed} failed; {needed} groups serving after {:.1} s; answered per group leader {answered:?}; max desired {}",
            scaled_up_in.as_secs_f64(),
            max_desired.load(Ordering::Relaxed),
        );
        assert_eq!(failed, 0, "failed requests: {:?}", load.failures().await);
        assert!(answered.len() >= 2, "only {answered:?} answered");
        assert_eq!(max_desired.load(Ordering::Relaxed), needed);
        assert_eq!(max_groups.load(Ordering::Relaxed), needed);

        Ok(())
    })
    .await
    .context("the TP-2 autoscaling test")
}

//! `mode: builtin` end to end on the real control plane: the operator's reconcile makes the
//! worker pods, kube-scheduler binds them to a node-agent node, the node agent runs the real
//! worker (SmolLM2 on CPU) on its own loopback address, and the autoscaler reads the workers'
//! load signal and scales the `InferenceService` through its scale subresource. A burst of
//! closed-loop clients takes the service from 1 replica to what the load needs and, after the
//! burst, back to 1, with every request answered. The clients send through `npufleet-router`,
//! started as its own process, which spreads them over the replicas as they turn ready.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use npufleet_tests::fleet::{Load, RunningRouter, Testbed};
use npufleet_tests::operator::ReplicaWatch;
use npufleet_tests::{service, wait};
use serde_json::json;

const MANAGER: &str = "autoscaling-builtin-test";
const TARGET_QUEUE: u32 = 2;
const CLIENTS: u32 = 6;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_takes_one_replica_to_what_the_load_needs_and_back_without_failures() -> Result<()>
{
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let bed = Testbed::start(c, &client, "autoscaling-builtin", 41, MANAGER).await?;
        let _operator = bed.start_operator()?;
        bed.apply_smollm2(
            "chat",
            json!({
                "replicas": 1,
                "engine": {"drainSeconds": 60},
                "autoscaling": {"mode": "builtin", "minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": TARGET_QUEUE},
            }),
        )
        .await?;
        bed.wait_serving(1).await?;

        // Watch the desired count while the load runs.
        let router = RunningRouter::start(c, "router-builtin", &bed.namespace, &[]).await?;
        let load = Load::through(&router);
        let services = bed.services();
        let replicas = ReplicaWatch::start(&services, "chat");

        let burst_started = Instant::now();
        load.start(
            CLIENTS,
            "/v1/chat/completions",
            service::chat("Name three rivers in Europe.", 24),
        );

        let needed = CLIENTS.div_ceil(TARGET_QUEUE);
        bed.wait_serving_at_least(needed as usize, "every needed replica serving under load")
            .await?;
        let scaled_up_in = burst_started.elapsed();
        // Keep the load on the full fleet until every client has been served by it again,
        // then end the burst.
        let sent_at_full_fleet = load.sent();
        wait::until("the full fleet to answer another round", Duration::from_secs(120), || async {
            let sent = load.sent();
            Ok((sent >= sent_at_full_fleet + 2 * u64::from(CLIENTS)).then_some(()))
        })
        .await?;
        load.stop().await?;
        let burst = burst_started.elapsed();

        bed.wait_scaled_to("chat", (1, 1), "the scale-down back to one serving replica")
            .await?;

        let first_up = replicas
            .first_scale_up()
            .context("the service never scaled up")?
            .duration_since(burst_started);
        let sent = load.sent();
        let failed = load.failed();
        eprintln!(
            "burst: {CLIENTS} clients for {:.1} s, {sent} requests, {failed} failed; first scale-up decision {:.2} s after the burst began; {needed} replicas serving after {:.1} s; max desired {}",
            burst.as_secs_f64(),
            first_up.as_secs_f64(),
            scaled_up_in.as_secs_f64(),
            replicas.max(),
        );
        assert_eq!(failed, 0, "failed requests: {:?}", load.failures().await);
        assert!(sent >= u64::from(CLIENTS), "only {sent} requests");
        // Closed-loop clients never put more than CLIENTS requests in the system: anything
        // above CLIENTS / target would be a cascade while replicas warm up.
        assert_eq!(replicas.max(), i32::try_from(needed)?);
        // Loose enough for a busy two-core machine; the figure itself is printed above.
        assert!(first_up < Duration::from_secs(10), "first scale-up after {first_up:?}");

        Ok(())
    })
    .await
}

//! An engine this project did not write, end to end: llama.cpp's own C++ `llama-server`
//! (built from the llama.cpp source the pinned llama-cpp-python package carries), serving the
//! same SmolLM2 file as the `generic` runtime of an InferenceService with its `llamacpp:*`
//! series named as the load signal. The operator renders its pod, the node agent runs it, the
//! router routes to it, the built-in autoscaler reads its metrics and scales it 1 -> 3 -> 1,
//! then to zero when idle, and a request sent at zero is held, wakes the fleet and is answered.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use npufleet_contract::runtime;
use npufleet_tests::fleet::{Load, RunningRouter, Testbed};
use npufleet_tests::operator::ReplicaWatch;
use npufleet_tests::service::{self, LLAMA_SERVER_PORT as PORT, llama_server_runtime, merged};
use npufleet_tests::{paths, wait};
use serde_json::{Value, json};

const MANAGER: &str = "runtime-generic-test";
const TARGET_QUEUE: u32 = 2;
const CLIENTS: u32 = 6;
/// One chat request through the router, answered with a message.
async fn say_hello(http: &reqwest::Client, router: &RunningRouter) -> Result<()> {
    let answer: Value = http
        .post(router.url("/v1/chat/completions"))
        .json(&service::chat("Say hello.", 8))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    anyhow::ensure!(
        answer["choices"][0]["message"]["content"].is_string(),
        "{answer}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama_server_is_routed_scaled_on_its_own_metrics_and_woken_from_zero() -> Result<()> {
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let llama_server = tokio::task::spawn_blocking(paths::llama_server).await??;
        let bed = Testbed::start_with_programs(
            c,
            &client,
            "runtime-generic",
            44,
            MANAGER,
            &[("llama-server", llama_server)],
        )
        .await?;
        let _operator = bed.start_operator()?;
        let autoscaling = |min: u32| {
            json!({"mode": "builtin", "minReplicas": min, "maxReplicas": 3, "targetQueueDepth": TARGET_QUEUE})
        };
        bed.apply_smollm2(
            "chat",
            merged(
                llama_server_runtime(),
                json!({"replicas": 1, "autoscaling": autoscaling(1)}),
            ),
        )
        .await?;
        let addresses = bed.wait_serving(1).await?;

        // The pod is llama.cpp's server, not the worker: its metrics say so.
        let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build()?;
        let metrics = http
            .get(format!("http://{}:{PORT}/metrics", addresses[0]))
            .send()
            .await?
            .text()
            .await?;
        assert!(metrics.contains(runtime::LLAMA_CPP_WAITING), "{metrics}");

        let router =
            RunningRouter::start(c, "router-generic", &bed.namespace, &["--wake-interval-seconds", "1"])
                .await?;
        say_hello(&http, &router).await?;
        // Open Inference Protocol gRPC is the worker's own; the router says so by name.
        let mut grpc = npufleet_contract::proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient::connect(
            format!("http://{}", router.grpc),
        )
        .await?;
        let refused = grpc
            .model_infer(npufleet_contract::proto::inference::ModelInferRequest {
                model_name: service::SMOLLM2.into(),
                ..Default::default()
            })
            .await
            .expect_err("gRPC inference to a generic engine");
        assert_eq!(refused.code(), tonic::Code::Unimplemented, "{refused:?}");
        assert!(refused.message().contains("generic engine"), "{}", refused.message());

        // A burst: the autoscaler reads llama-server's deferred and processing requests.
        let services = bed.services();
        let replicas = ReplicaWatch::start(&services, "chat");
        let load = Load::through(&router);
        let burst_started = Instant::now();
        load.start(CLIENTS, "/v1/chat/completions", service::chat("Name three rivers in Europe.", 24));
        let needed = CLIENTS.div_ceil(TARGET_QUEUE);
        let scaled_up = bed
            .wait_serving_at_least(needed as usize, "three llama-server replicas serving under load")
            .await;
        if let Err(error) = scaled_up {
            let status = services.get("chat").await?.status;
            anyhow::bail!("{error:#}; status: {status:?}");
        }
        let scaled_up_in = burst_started.elapsed();
        let queue = services
            .get("chat")
            .await?
            .status
            .and_then(|s| s.autoscaling)
            .and_then(|a| a.queue_depth);
        assert!(queue.is_some(), "the autoscaler never read llama-server's load");
        let sent_at_full_fleet = load.sent();
        wait::until("the full fleet to answer another round", Duration::from_secs(120), || async {
            Ok((load.sent() >= sent_at_full_fleet + 2 * u64::from(CLIENTS)).then_some(()))
        })
        .await?;
        load.stop().await?;
        let answered_by = load.answered_by().await;
        bed.wait_scaled_to("chat", (1, 1), "the scale-down back to one llama-server").await?;
        let (sent, failed) = (load.sent(), load.failed());
        assert_eq!(failed, 0, "failed requests: {:?}", load.failures().await);
        assert_eq!(replicas.max(), i32::try_from(needed)?);
        assert!(answered_by.len() >= 2, "the router used one replica: {answered_by:?}");

        // Idle at minReplicas 0: to zero; a request then is held, wakes the fleet, and is
        // answered.
        bed.apply_smollm2(
            "chat",
            merged(llama_server_runtime(), json!({"replicas": 1, "autoscaling": autoscaling(0)})),
        )
        .await?;
        bed.wait_scaled_to("chat", (0, 0), "the idle llama-server fleet at zero").await?;
        let woken = Instant::now();
        say_hello(&http, &router).await.context("the request held at zero")?;
        let wake_to_answer = woken.elapsed();
        eprintln!(
            "llama-server as the generic runtime: {CLIENTS} clients, {sent} requests, {failed} failed; \
             {needed} replicas serving {:.1} s after the burst began; answered by {answered_by:?}; \
             woken from zero and answered in {:.2} s",
            scaled_up_in.as_secs_f64(),
            wake_to_answer.as_secs_f64()
        );
        Ok(())
    })
    .await
}

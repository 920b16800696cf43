//! Flow control end to end: a real control plane, a SmolLM2 worker, the router as its own
//! process and an InferenceService whose `spec.routing.flowControl` lets one request at a time
//! reach the replica. Requests beyond that wait in the router: a high-priority key's request
//! overtakes the low-priority ones queued before it, a full band and an expired wait are
//! answered 429 with Retry-After, and a key over its request rate gets 429 (and
//! RESOURCE_EXHAUSTED over gRPC) while the others are served. The replica is told each
//! request's priority and runs the higher first.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use futures::StreamExt;
use kube::api::{Patch, PatchParams};
use npufleet_contract::env as worker_env;
use npufleet_contract::headers::FLOW_PRIORITY;
use npufleet_contract::proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
use npufleet_contract::proto::inference::{InferParameter, ModelInferRequest, infer_parameter};
use npufleet_tests::fleet::{RunningRouter, Testbed, sse_error, sse_has_text};
use npufleet_tests::{service, wait};
use serde_json::{Value, json};

const MANAGER: &str = "router-flow-control-test";
const MODEL: &str = service::SMOLLM2;
const GOLD: &str = "gold-key-0123";
const BULK: &str = "bulk-key-4567";
const METERED: &str = "metered-key-89ab";

/// The hex SHA-256 of `key`, as `printf %s "$KEY" | sha256sum` prints it.
fn sha256(key: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(key)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn chat(question: &str, max_tokens: u32) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "stream": true,
    })
}

/// One streamed answer: its status, `Retry-After` and error code when refused, when its
/// first generated text arrived and when it ended.
#[derive(Debug)]
struct Answer {
    status: u16,
    retry_after: Option<u64>,
    code: Option<String>,
    first_token: Option<Instant>,
    done: Instant,
}

async fn send(
    router: &RunningRouter,
    key: &str,
    priority: Option<i32>,
    body: Value,
) -> Result<Answer> {
    send_to(&router.url(""), key, priority, body).await
}

/// [`send`] to a router by its base URL, for requests spawned onto their own tasks.
async fn send_to(base: &str, key: &str, priority: Option<i32>, body: Value) -> Result<Answer> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()?;
    let mut request = http
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&body);
    if let Some(priority) = priority {
        request = request.header(FLOW_PRIORITY, priority.to_string());
    }
    let response = request.send().await.context("sending")?;
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get(http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok()?.parse().ok());
    if status != 200 {
        let body: Value = response.json().await?;
        return Ok(Answer {
            status,
            retry_after,
            code: body["error"]["code"].as_str().map(str::to_owned),
            first_token: None,
            done: Instant::now(),
        });
    }
    let mut stream = response.bytes_stream();
    let (mut text, mut first_token) = (String::new(), None);
    while let Some(bytes) = stream.next().await {
        text.push_str(&String::from_utf8_lossy(&bytes?));
        if first_token.is_none() && sse_has_text(&text) {
            first_token = Some(Instant::now());
        }
    }
    ensure!(sse_error(&text).is_none(), "the stream failed: {text}");
    Ok(Answer {
        status,
        retry_after,
        code: None,
        first_token,
        done: Instant::now(),
    })
}

/// The sum of the router's `name` series whose labels contain every one of `labels`.
async fn router_series(router: &RunningRouter, name: &str, labels: &[&str]) -> Result<f64> {
    let metrics = router.metrics().await?;
    Ok(metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| labels.iter().all(|label| l.contains(label)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

async fn wait_series(
    router: &RunningRouter,
    name: &str,
    labels: &[&str],
    value: f64,
) -> Result<()> {
    wait::until(
        &format!("{name}{labels:?} = {value}"),
        Duration::from_secs(60),
        || async { Ok((router_series(router, name, labels).await? == value).then_some(())) },
    )
    .await
}

const QUEUED: &str = "npufleet_router_flow_queued_requests";
const IN_FLIGHT: &str = "npufleet_router_in_flight_requests";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priorities_overtake_full_queues_and_limited_keys_get_429() -> Result<()> {
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let bed = Testbed::start(c, &client, "router-flow", 47, MANAGER).await?;
        let _operator = bed.start_operator()?;
        let key = |name: &str, key: &str, policy: Value| {
            let mut entry = json!({"name": name, "apiKeySha256": sha256(key)});
            entry.as_object_mut().unwrap().extend(policy.as_object().unwrap().clone());
            entry
        };
        bed.apply_smollm2(
            "chat",
            json!({
                "replicas": 1,
                "engine": {"drainSeconds": 5, "maxBatchSize": 1},
                "template": {"env": service::worker_env(&[(worker_env::IGNORE_EOS, "true")])},
                "routing": {"policy": "least-load", "flowControl": {
                    "maxConcurrencyPerReplica": 1,
                    "maxQueued": 2,
                    "queueTtl": "60s",
                    "keys": [
                        key("gold", GOLD, json!({"priority": 10})),
                        key("bulk", BULK, json!({})),
                        key("metered", METERED, json!({"requestsPerMinute": 2})),
                    ],
                }},
            }),
        )
        .await?;
        bed.wait_serving(1).await?;
        let router = RunningRouter::start(c, "router-flow", &bed.namespace, &[]).await?;
        let model = format!("model=\"{MODEL}\"");

        // One bulk request holds the replica's only place; two more wait in band 0, and a
        // third finds the band full.
        let running = tokio::spawn({
            let router = router.url("");
            async move { send_to(&router, BULK, None, chat("Count to fifty.", 48)).await }
        });
        wait_series(&router, IN_FLIGHT, &[&model], 1.0).await?;
        let queued: Vec<_> = (0..2)
            .map(|i| {
                let router = router.url("");
                tokio::spawn(async move {
                    send_to(&router, BULK, None, chat(&format!("Name river {i}."), 4)).await
                })
            })
            .collect();
        wait_series(&router, QUEUED, &[&model, "priority=\"0\""], 2.0).await?;
        let full = send(&router, BULK, None, chat("One more?", 4)).await?;
        ensure!(full.status == 429, "a full band answers 429: {full:?}");
        ensure!(full.code.as_deref() == Some("queue_full"), "{full:?}");
        ensure!(full.retry_after.is_some_and(|s| s >= 1), "429 without Retry-After: {full:?}");

        // Gold's request, sent after them, is answered before either queued bulk request.
        let gold = send(&router, GOLD, None, chat("Say hello.", 4)).await?;
        let running = running.await??;
        let mut bulk = Vec::new();
        for request in queued {
            bulk.push(request.await??);
        }
        ensure!(gold.status == 200 && running.status == 200, "{gold:?} {running:?}");
        for answer in &bulk {
            ensure!(answer.status == 200, "a queued request failed: {answer:?}");
            ensure!(
                gold.first_token < answer.first_token,
                "the priority-10 request did not overtake the queued priority-0 ones: gold {gold:?}, bulk {bulk:?}"
            );
        }
        // A request may lower its priority, never raise it: bulk asking for 99 stays at 0.
        let asked = send(&router, BULK, Some(99), chat("Hi.", 2)).await?;
        ensure!(asked.status == 200, "{asked:?}");

        // A key over its requests per minute: 429 with Retry-After over HTTP and
        // RESOURCE_EXHAUSTED over gRPC, while another key is served.
        for i in 0..2 {
            let ok = send(&router, METERED, None, chat(&format!("Hi {i}."), 2)).await?;
            ensure!(ok.status == 200, "request {i} within the limit: {ok:?}");
        }
        let limited = send(&router, METERED, None, chat("Hi again.", 2)).await?;
        ensure!(limited.status == 429, "{limited:?}");
        ensure!(limited.code.as_deref() == Some("rate_limit_exceeded"), "{limited:?}");
        ensure!(limited.retry_after.is_some_and(|s| (1..=60).contains(&s)), "{limited:?}");
        let mut grpc = GrpcInferenceServiceClient::connect(format!("http://{}", router.grpc)).await?;
        let mut infer = tonic::Request::new(ModelInferRequest {
            model_name: MODEL.into(),
            parameters: [(
                "max_tokens".to_owned(),
                InferParameter {
                    parameter_choice: Some(infer_parameter::ParameterChoice::Int64Param(2)),
                },
            )]
            .into(),
            ..Default::default()
        });
        infer
            .metadata_mut()
            .insert("authorization", format!("Bearer {METERED}").parse()?);
        let refused = grpc.model_infer(infer).await.expect_err("over the limit");
        ensure!(refused.code() == tonic::Code::ResourceExhausted, "{refused:?}");
        ensure!(refused.message().contains("requestsPerMinute"), "{}", refused.message());
        let served = send(&router, GOLD, None, chat("Still there?", 2)).await?;
        ensure!(served.status == 200, "{served:?}");
        for (key, reason) in [("bulk", "queue_full"), ("metered", "requestsPerMinute")] {
            let counted = router_series(
                &router,
                "npufleet_router_flow_rejected_total",
                &[&format!("key=\"{key}\""), &format!("reason=\"{reason}\"")],
            )
            .await?;
            ensure!(counted >= 1.0, "no {reason} refusal of {key} counted");
        }

        // A request that waits longer than queueTtl is answered 429.
        bed.services()
            .patch(
                "chat",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"routing": {"flowControl": {"queueTtl": "300ms"}}}})),
            )
            .await?;
        let expired = wait::until("a queued request to expire", Duration::from_secs(60), || async {
            let running = tokio::spawn({
                let router = router.url("");
                async move { send_to(&router, BULK, None, chat("Count to a hundred.", 96)).await }
            });
            wait_series(&router, IN_FLIGHT, &[&model], 1.0).await?;
            let waited = send(&router, BULK, None, chat("Quick?", 2)).await?;
            running.await??;
            Ok((waited.status == 429).then_some(waited))
        })
        .await?;
        ensure!(expired.code.as_deref() == Some("queue_timeout"), "{expired:?}");
        ensure!(expired.retry_after.is_some(), "{expired:?}");

        // The router passes the priority it admitted a request at on to the replica, whose
        // scheduler runs it first: with three places and a batch of one, gold's request
        // preempts the bulk one running in the replica and overtakes the one queued there.
        bed.services()
            .patch(
                "chat",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"routing": {"flowControl": {
                    "maxConcurrencyPerReplica": 3, "queueTtl": "60s",
                }}}})),
            )
            .await?;
        let running = tokio::spawn({
            let router = router.url("");
            async move { send_to(&router, BULK, None, chat("Count to fifty.", 48)).await }
        });
        wait_series(&router, IN_FLIGHT, &[&model], 1.0).await?;
        let queued = tokio::spawn({
            let router = router.url("");
            async move { send_to(&router, BULK, None, chat("Name a river.", 4)).await }
        });
        wait_series(&router, IN_FLIGHT, &[&model], 2.0).await?;
        let gold = send(&router, GOLD, None, chat("Say hello.", 4)).await?;
        let (running, queued) = (running.await??, queued.await??);
        ensure!(
            [&gold, &running, &queued].iter().all(|a| a.status == 200),
            "{gold:?} {running:?} {queued:?}"
        );
        ensure!(
            gold.first_token.is_some()
                && gold.done < running.done
                && gold.first_token < queued.first_token,
            "the replica did not run the priority-10 request first: gold {gold:?}, running \
             {running:?}, queued {queued:?}"
        );
        Ok(())
    })
    .await
}

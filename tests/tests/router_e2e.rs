//! `npufleet-router` end to end on the real control plane: the router runs as its own process
//! and watches the cluster; the operator makes worker pods, the node agent runs them (SmolLM2
//! on CPU) on their own loopback addresses, and every request goes through the router.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Secret, SecretKeySelector};
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use npufleet_contract::annotations::WAKE_REQUESTED_AT;
use npufleet_contract::env as worker_env;
use npufleet_contract::headers;
use npufleet_contract::pods;
use npufleet_contract::proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
use npufleet_contract::proto::inference::infer_parameter::ParameterChoice;
use npufleet_contract::proto::inference::model_infer_request::InferInputTensor;
use npufleet_contract::proto::inference::{
    InferParameter, InferTensorContents, ModelInferRequest, ModelReadyRequest, ServerLiveRequest,
};
use npufleet_crds::InferenceService;
use npufleet_test_support::raw_http;
use npufleet_tests::fleet::{Load, RunningRouter, Testbed, sse_error, wait_serving};
use npufleet_tests::operator::set_replicas;
use npufleet_tests::process::Process;
use npufleet_tests::service::{self, chat};
use npufleet_tests::{cluster, paths, wait};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const MANAGER: &str = "router-e2e-test";
const MODEL: &str = npufleet_tests::service::SMOLLM2;

/// What the SmolLM2 service `chat` sets beside [`service::smollm2`]'s defaults: `replicas`,
/// and the workers' settings `extra_env`.
fn chat_spec(replicas: i32, extra_env: &[(&str, &str)]) -> Value {
    // Every answer runs to its max_tokens, so a long stream is still going when a test kills
    // its worker.
    let env: Vec<(&str, &str)> = [(worker_env::IGNORE_EOS, "true")]
        .into_iter()
        .chain(extra_env.iter().copied())
        .collect();
    json!({
        "replicas": replicas,
        "engine": {"drainSeconds": 30},
        "routing": {"policy": "least-load"},
        "template": {"env": service::worker_env(&env)},
    })
}

/// An Open Inference Protocol text request for `model`, greedy, at most `max_tokens`.
fn oip_text(model: &str, text: &str, max_tokens: i64) -> ModelInferRequest {
    let int = |v| InferParameter {
        parameter_choice: Some(ParameterChoice::Int64Param(v)),
    };
    ModelInferRequest {
        model_name: model.into(),
        inputs: vec![InferInputTensor {
            name: "text_input".into(),
            datatype: "BYTES".into(),
            shape: vec![1],
            contents: Some(InferTensorContents {
                bytes_contents: vec![text.as_bytes().to_vec()],
                ..Default::default()
            }),
            ..Default::default()
        }],
        parameters: [
            ("max_tokens".to_owned(), int(max_tokens)),
            ("temperature".to_owned(), int(0)),
        ]
        .into(),
        ..Default::default()
    }
}

/// A namespace with a node agent, the operator, and the router watching it.
struct Fleet {
    bed: Testbed,
    router: RunningRouter,
    operator: FleetOperator,
}

impl std::ops::Deref for Fleet {
    type Target = Testbed;

    fn deref(&self) -> &Testbed {
        &self.bed
    }
}

/// The fleet's operator: in this process, or its own binary for a test that measures it.
enum FleetOperator {
    InProcess {
        _tasks: npufleet_tests::operator::RunningOperator,
    },
    Binary {
        process: Process,
    },
}

impl Fleet {
    async fn start(test: &str, subnet: u8, router_args: &[&str]) -> Result<Fleet> {
        Self::start_with(test, subnet, router_args, false).await
    }

    async fn start_with(
        test: &str,
        subnet: u8,
        router_args: &[&str],
        operator_binary: bool,
    ) -> Result<Fleet> {
        let c = cluster::shared();
        let client = c.client().await?;
        let bed = Testbed::start(c, &client, test, subnet, MANAGER).await?;
        let namespace = &bed.namespace;
        let operator = if operator_binary {
            let identity = format!("operator-{test}");
            let process = npufleet_tests::operator::spawn_replica(c, namespace, &identity, None)?;
            npufleet_tests::operator::wait_leader(
                &client,
                namespace,
                &identity,
                Duration::from_secs(60),
            )
            .await?;
            FleetOperator::Binary { process }
        } else {
            FleetOperator::InProcess {
                _tasks: bed.start_operator()?,
            }
        };
        let router =
            RunningRouter::start(c, &format!("router-{test}"), namespace, router_args).await?;
        Ok(Fleet {
            bed,
            router,
            operator,
        })
    }

    /// [`Fleet::start`] with the service applied at `replicas`, once they all serve.
    async fn serving(test: &str, subnet: u8, replicas: i32) -> Result<Fleet> {
        let fleet = Self::start(test, subnet, &[]).await?;
        fleet.apply(replicas).await?;
        fleet.wait_serving(usize::try_from(replicas)?).await?;
        Ok(fleet)
    }

    async fn apply(&self, replicas: i32) -> Result<()> {
        self.apply_with_env(replicas, &[]).await
    }

    /// [`Fleet::apply`] with `extra_env` added to the worker template's environment.
    async fn apply_with_env(&self, replicas: i32, extra_env: &[(&str, &str)]) -> Result<()> {
        self.apply_smollm2("chat", chat_spec(replicas, extra_env))
            .await?;
        Ok(())
    }

    /// Waits until `replicas` worker pods serve and the router's own view lists the model
    /// (its watch may trail the pods' readiness).
    async fn wait_serving(&self, replicas: usize) -> Result<()> {
        wait_serving(&self.pods(), replicas, Duration::from_secs(120)).await?;
        let models = self.router.url("/v1/models");
        wait::until(
            "the router to list the model",
            Duration::from_secs(30),
            || async {
                let listed: Value = reqwest::get(&models).await?.json().await?;
                let ids = listed["data"].as_array().cloned().unwrap_or_default();
                Ok(ids.iter().any(|m| m["id"] == MODEL).then_some(()))
            },
        )
        .await
    }
}

async fn error_of(response: reqwest::Response) -> Result<(u16, String)> {
    let status = response.status().as_u16();
    let body: Value = response.json().await?;
    let message = match &body["error"] {
        Value::String(message) => message.clone(),
        error => error["message"]
            .as_str()
            .with_context(|| format!("no error message in {body}"))?
            .to_owned(),
    };
    Ok((status, message))
}

/// Bad input and the hold's bounds, with no worker running: an unknown model is 404 (and
/// NOT_FOUND over gRPC) naming it; a malformed body 400; an oversized body 413; a request for
/// a fleet at zero waits its time-to-live and gets 503 saying why; past the hold queue's bound,
/// 429 with Retry-After.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_and_a_full_or_expired_hold_get_clear_errors() -> Result<()> {
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let namespace = c.namespace(&client, "router-errors").await?;
        npufleet_tests::crd::install_inference_service(&client, MANAGER).await?;
        let services: Api<InferenceService> = Api::namespaced(client.clone(), &namespace);
        // No operator here: the service stays at zero replicas.
        let model_path = tokio::task::spawn_blocking(paths::smollm2_gguf).await??;
        let at_zero = service::smollm2(
            &namespace,
            "chat",
            &model_path,
            "nowhere",
            chat_spec(0, &[]),
        )?;
        npufleet_tests::operator::apply(&services, MANAGER, &at_zero).await?;
        let router = RunningRouter::start(
            c,
            "router-errors",
            &namespace,
            &[
                "--max-body-bytes",
                "2048",
                "--hold-queue",
                "1",
                "--hold-timeout-seconds",
                "3",
                "--hold-retry-after-seconds",
                "7",
            ],
        )
        .await?;
        let http = reqwest::Client::new();
        let post = |path: &str, body: String| {
            http.post(router.url(path))
                .header("content-type", "application/json")
                .body(body)
                .send()
        };

        let (status, message) = error_of(
            post(
                "/v1/chat/completions",
                json!({"model": "no-such-model", "messages": []}).to_string(),
            )
            .await?,
        )
        .await?;
        assert_eq!(status, 404);
        assert!(message.contains("'no-such-model'"), "{message}");
        let (status, message) =
            error_of(post("/v2/models/no-such-model/infer", "{}".to_owned()).await?).await?;
        assert_eq!(status, 404);
        assert!(message.contains("'no-such-model'"), "{message}");

        let (status, message) =
            error_of(post("/v1/completions", "{\"model\": ".to_owned()).await?).await?;
        assert_eq!(status, 400);
        assert!(message.contains("not valid JSON"), "{message}");
        let (status, message) =
            error_of(post("/v1/completions", json!({"prompt": "hi"}).to_string()).await?).await?;
        assert_eq!(status, 400);
        assert!(message.contains("`model`"), "{message}");

        let oversized = json!({"model": MODEL, "prompt": "x".repeat(4096)}).to_string();
        let (status, message) = error_of(post("/v1/completions", oversized).await?).await?;
        assert_eq!(status, 413);
        assert!(message.contains("2048 bytes"), "{message}");

        let mut grpc =
            GrpcInferenceServiceClient::connect(format!("http://{}", router.grpc)).await?;
        let unknown = grpc
            .model_infer(ModelInferRequest {
                model_name: "no-such-model".into(),
                ..Default::default()
            })
            .await
            .expect_err("an unknown model is an error");
        assert_eq!(unknown.code(), tonic::Code::NotFound);
        assert!(
            unknown.message().contains("'no-such-model'"),
            "{}",
            unknown.message()
        );
        let unknown = grpc
            .model_stream_infer(futures::stream::iter([oip_text("no-such-model", "Hi", 4)]))
            .await
            .expect_err("a stream for an unknown model is an error");
        assert_eq!(unknown.code(), tonic::Code::NotFound);
        assert!(
            unknown.message().contains("'no-such-model'"),
            "{}",
            unknown.message()
        );
        let ready = grpc
            .model_ready(ModelReadyRequest {
                name: MODEL.into(),
                version: String::new(),
            })
            .await?
            .into_inner();
        assert!(!ready.ready, "a fleet at zero is not ready");

        // One request fills the hold queue of one; the next is turned away at once.
        let held_started = Instant::now();
        let held = tokio::spawn(post("/v1/chat/completions", chat("Hello", 4).to_string()));
        wait::until("one request held", Duration::from_secs(10), || async {
            let metrics = router.metrics().await?;
            Ok(metrics
                .lines()
                .any(|l| l.starts_with("npufleet_router_held_requests{") && l.ends_with(" 1"))
                .then_some(()))
        })
        .await?;
        let refused = post("/v1/chat/completions", chat("Hello", 4).to_string()).await?;
        assert_eq!(refused.status(), 429);
        assert_eq!(refused.headers()["retry-after"], "7");
        let (_, message) = error_of(refused).await?;
        assert!(message.contains("no ready replica"), "{message}");

        let (status, message) = error_of(held.await??).await?;
        let waited = held_started.elapsed();
        assert_eq!(status, 503);
        assert!(message.contains("no ready replica within 3s"), "{message}");
        assert!(
            waited >= Duration::from_secs(3) && waited < Duration::from_secs(6),
            "held {waited:?}"
        );

        // The router asked for a wake-up while it held the request.
        let annotated = services.get("chat").await?;
        assert!(
            annotated.annotations().contains_key(WAKE_REQUESTED_AT),
            "{:?}",
            annotated.annotations()
        );
        Ok(())
    })
    .await
}

/// A fleet at zero answers 20 concurrent held requests once a replica is Ready, and the
/// router's wake-up annotation is what tells the scaler to start one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_at_zero_holds_twenty_requests_and_answers_them_all_once_woken() -> Result<()> {
    npufleet_tests::on_shared_cluster(|_, _| async move {
        let fleet = Fleet::start("router-zero", 72, &["--wake-interval-seconds", "1"]).await?;
        fleet.apply(0).await?;
        let services = fleet.services();
        // Requests sent before the router's watch has the service would be 404.
        let grpc = GrpcInferenceServiceClient::connect(format!("http://{}", fleet.router.grpc)).await?;
        wait::until("the router to know the model", Duration::from_secs(20), || {
            let mut grpc = grpc.clone();
            async move {
                let known = grpc
                    .model_ready(ModelReadyRequest { name: MODEL.into(), version: String::new() })
                    .await;
                Ok(known.is_ok().then_some(()))
            }
        })
        .await?;
        let http = reqwest::Client::builder().timeout(Duration::from_secs(90)).build()?;
        let started = Instant::now();
        let requests: Vec<_> = (0..20)
            .map(|i| {
                let (http, url) = (http.clone(), fleet.router.url("/v1/chat/completions"));
                tokio::spawn(async move {
                    let response = http.post(url).json(&chat(&format!("Count to {i}."), 4)).send().await?;
                    let status = response.status();
                    let text = response.text().await?;
                    anyhow::ensure!(status.is_success(), "HTTP {status}: {text}");
                    anyhow::Ok(started.elapsed())
                })
            })
            .collect();
        // Stand in for the autoscaler: wake the fleet when the router asks.
        let asked = wait::until("the router's wake-up request", Duration::from_secs(20), || async {
            let service = services.get("chat").await?;
            Ok(service.annotations().contains_key(WAKE_REQUESTED_AT).then(|| started.elapsed()))
        })
        .await?;
        set_replicas(&services, "chat", 1).await?;
        fleet.wait_serving(1).await?;
        let ready_after = started.elapsed();
        let mut answered = Vec::new();
        for request in requests {
            answered.push(request.await??);
        }
        let last = answered.iter().max().copied().unwrap_or_default();
        eprintln!(
            "wake-up asked {:.2} s after the first request; replica ready at {:.2} s; all 20 answered by {:.2} s",
            asked.as_secs_f64(),
            ready_after.as_secs_f64(),
            last.as_secs_f64()
        );
        assert!(asked < Duration::from_secs(2), "the wake-up came {asked:?} after the requests");
        let metrics = fleet.router.metrics().await?;
        assert!(
            metrics.lines().any(|l| l.starts_with("npufleet_router_hold_seconds_count{") && l.contains("outcome=\"replica\"") && l.ends_with(" 20")),
            "{metrics}"
        );
        Ok(())
    })
    .await
}

/// The router picks replicas up as they turn Ready, spreads load over them, stops sending to
/// a replica once it terminates, and a scale-down under load fails no request. Streams,
/// `/v1/models` and gRPC go through too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_join_as_they_turn_ready_and_leave_as_they_terminate_without_failures()
-> Result<()> {
    npufleet_tests::on_shared_cluster(|_, _| async move {
        let fleet = Fleet::serving("router-scale", 71, 1).await?;
        let http = reqwest::Client::new();

        let models: Value = http.get(fleet.router.url("/v1/models")).send().await?.json().await?;
        assert_eq!(models["data"][0]["id"], MODEL, "{models}");

        // A stream comes through as events, ending with [DONE].
        let response = http
            .post(fleet.router.url("/v1/chat/completions"))
            .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 16, "stream": true}))
            .send()
            .await?;
        assert!(response.status().is_success());
        assert!(response.headers()["content-type"].to_str()?.starts_with("text/event-stream"));
        let mut body = response.bytes_stream();
        let mut chunks = 0;
        let mut text = String::new();
        while let Some(bytes) = body.next().await {
            chunks += 1;
            text.push_str(std::str::from_utf8(&bytes?)?);
        }
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        assert!(chunks > 1, "the stream arrived in one piece: {text}");

        let mut grpc = GrpcInferenceServiceClient::connect(format!("http://{}", fleet.router.grpc)).await?;
        let answer = grpc.model_infer(oip_text(MODEL, "Hello", 8)).await?;
        assert!(answer.metadata().contains_key(headers::REPLICA));
        assert!(!answer.into_inner().outputs.is_empty());

        // ModelStreamInfer comes through response by response, the last one flagged final.
        let mut stream = grpc
            .model_stream_infer(futures::stream::iter([oip_text(MODEL, "Name three rivers.", 12)]))
            .await?
            .into_inner();
        let mut responses = 0;
        loop {
            let message = stream.message().await?.context("the stream ended before its final response")?;
            assert!(message.error_message.is_empty(), "{}", message.error_message);
            let response = message.infer_response.context("a response without an answer")?;
            responses += 1;
            let last = response.parameters.get("triton_final_response").and_then(|p| p.parameter_choice.clone());
            if last == Some(ParameterChoice::BoolParam(true)) {
                assert!(response.parameters.contains_key("finish_reason"), "{response:?}");
                break;
            }
        }
        assert!(responses >= 2, "the stream arrived as {responses} response");
        assert!(stream.message().await?.is_none(), "the stream goes on after its final response");

        let load = Load::through(&fleet.router);
        load.start(4, "/v1/chat/completions", chat("Name a river.", 8));
        let services = fleet.services();
        set_replicas(&services, "chat", 2).await?;
        let joined = wait::until("the second replica answering", Duration::from_secs(90), || async {
            let answered = load.answered_by().await;
            Ok((answered.len() == 2).then_some(answered))
        })
        .await?;
        eprintln!("answers per replica with two serving: {joined:?}");

        set_replicas(&services, "chat", 1).await?;
        let pods = fleet.pods();
        wait::until("one worker pod left", Duration::from_secs(90), || async {
            let live = pods.list(&ListParams::default()).await?.items.len();
            Ok((live == 1).then_some(()))
        })
        .await?;
        let remaining = pods.list(&ListParams::default()).await?.items.remove(0).name_any();
        let before = load.answered_by().await;
        load.wait_sent(8, "another round of answers").await?;
        load.stop().await?;
        let after = load.answered_by().await;
        let new_answers: HashSet<&String> = after
            .iter()
            .filter(|(pod, n)| before.get(*pod) != Some(n))
            .map(|(pod, _)| pod)
            .collect();
        eprintln!("sent {}, failed {}; answers per replica: {after:?}", load.sent(), load.failed());
        assert_eq!(load.failed(), 0, "failures: {:?}", load.failures().await);
        assert_eq!(new_answers, HashSet::from([&remaining]), "answers after the scale-down came from {new_answers:?}");
        Ok(())
    })
    .await
}

/// The value of each series `name{...}` in Prometheus `metrics` text whose labels include
/// `label`, by the value of its `replica` label.
fn per_replica(metrics: &str, name: &str, label: &str) -> std::collections::BTreeMap<String, f64> {
    metrics
        .lines()
        .filter(|line| line.starts_with(&format!("{name}{{")) && line.contains(label))
        .filter_map(|line| {
            let replica = line.split("replica=\"").nth(1)?.split('"').next()?;
            let value = line.rsplit(' ').next()?.parse().ok()?;
            Some((replica.to_owned(), value))
        })
        .collect()
}

/// One `ModelStreamInfer` stream kept open on three replicas: each request on it is routed on
/// its own, so twelve sent at once spread over the replicas by least-load, each counted in
/// flight only until its last response, while the stream stays open for more; every request
/// gets its responses in order, its final one last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_requests_of_one_open_grpc_stream_are_routed_and_counted_one_by_one() -> Result<()> {
    const REQUESTS: usize = 12;
    npufleet_tests::on_shared_cluster(|_, _| async move {
        let fleet = Fleet::serving("router-stream", 77, 3).await?;
        let mut grpc =
            GrpcInferenceServiceClient::connect(format!("http://{}", fleet.router.grpc)).await?;
        let (requests, outgoing) = tokio::sync::mpsc::channel(REQUESTS + 1);
        for i in 0..REQUESTS {
            let mut request = oip_text(MODEL, &format!("Write a long story about river {i}."), 48);
            request.id = format!("r{i}");
            requests.send(request).await?;
        }
        let mut responses = grpc
            .model_stream_infer(tokio_stream::wrappers::ReceiverStream::new(outgoing))
            .await?
            .into_inner();

        let in_flight = |metrics: &str| {
            per_replica(
                metrics,
                "npufleet_router_in_flight_requests",
                &format!("model=\"{MODEL}\""),
            )
        };
        let running = wait::until(
            "every request of the stream in flight",
            Duration::from_secs(30),
            || async {
                let counts = in_flight(&fleet.router.metrics().await?);
                Ok((counts.values().sum::<f64>() == REQUESTS as f64).then_some(counts))
            },
        )
        .await?;
        eprintln!("requests in flight per replica on one stream: {running:?}");

        let mut finished: HashSet<String> = HashSet::new();
        while finished.len() < REQUESTS {
            let message = responses
                .message()
                .await?
                .context("the stream ended early")?;
            ensure!(
                message.error_message.is_empty(),
                "{}",
                message.error_message
            );
            let response = message
                .infer_response
                .context("a response without an answer")?;
            ensure!(
                !finished.contains(&response.id),
                "a response for {} after its final one",
                response.id
            );
            let last = response
                .parameters
                .get("triton_final_response")
                .and_then(|p| p.parameter_choice.clone());
            if last == Some(ParameterChoice::BoolParam(true)) {
                finished.insert(response.id.clone());
            }
        }
        // The stream is still open; the finished requests no longer count anywhere.
        wait::until(
            "no request in flight with the stream open",
            Duration::from_secs(10),
            || async {
                let counts = in_flight(&fleet.router.metrics().await?);
                Ok(counts.values().all(|&n| n == 0.0).then_some(()))
            },
        )
        .await?;
        let answered = per_replica(
            &fleet.router.metrics().await?,
            "npufleet_router_requests_total",
            "code=\"Ok\"",
        );
        eprintln!("requests answered per replica: {answered:?}");
        ensure!(
            running.len() == 3,
            "the stream's requests went to {running:?}"
        );
        ensure!(
            running.values().all(|&n| (2.0..=6.0).contains(&n)),
            "least-load placed the stream's requests as {running:?}"
        );
        ensure!(
            answered.values().sum::<f64>() == REQUESTS as f64,
            "{answered:?}"
        );

        // The stream takes more requests after its first ones finished, and ends cleanly.
        let mut request = oip_text(MODEL, "Hello", 4);
        request.id = "after".into();
        requests.send(request).await?;
        drop(requests);
        let mut after = 0;
        while let Some(message) = responses.message().await? {
            ensure!(
                message.error_message.is_empty(),
                "{}",
                message.error_message
            );
            ensure!(message.infer_response.context("an answer")?.id == "after");
            after += 1;
        }
        ensure!(
            after >= 1,
            "no answer to the request sent after the others finished"
        );
        Ok(())
    })
    .await
}

/// The router's listeners bound their connections (no replica needed): a partial request head
/// and a silent connection are closed within `--header-read-timeout`, a kept-alive connection
/// after `--idle-timeout`; past `--max-connections`, a connection gets 503 (HTTP) or
/// UNAVAILABLE (gRPC) naming the limit, while the first ones are still served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_routers_listeners_bound_header_reads_idle_connections_and_their_number() -> Result<()>
{
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let namespace = c.namespace(&client, "router-connections").await?;
        npufleet_tests::crd::install_inference_service(&client, MANAGER).await?;
        let (timed, limited) = futures::try_join!(
            RunningRouter::start(c, "router-timed", &namespace, &["--header-read-timeout", "1.5", "--idle-timeout", "0.5"]),
            RunningRouter::start(c, "router-limited", &namespace, &["--max-connections", "2"]),
        )?;

        let mut partial = TcpStream::connect(timed.http).await?;
        partial.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n").await?;
        let mut silent = TcpStream::connect(timed.grpc).await?;
        let mut kept = TcpStream::connect(timed.http).await?;
        ensure!(raw_http::get(&mut kept, "/healthz").await?.0 == 200);
        let within = Duration::from_secs(10);
        let (kept, partial, silent) = tokio::join!(
            raw_http::wait_closed(&mut kept, within),
            raw_http::wait_closed(&mut partial, within),
            raw_http::wait_closed(&mut silent, within),
        );
        let (idle_for, partial_for, silent_for) = (kept?.1, partial?.1, silent?.1);
        eprintln!("closed after: idle {idle_for:?}, partial head {partial_for:?}, silent gRPC {silent_for:?}");
        let idle_bound = Duration::from_millis(400)..Duration::from_millis(1300);
        let header_bound = Duration::from_millis(1300)..Duration::from_secs(3);
        ensure!(idle_bound.contains(&idle_for), "the idle connection closed after {idle_for:?}");
        ensure!(header_bound.contains(&partial_for), "the partial head closed after {partial_for:?}");
        ensure!(header_bound.contains(&silent_for), "the silent gRPC connection closed after {silent_for:?}");

        // Until the readiness probe's connection is closed, it holds one of the two places.
        let served = || async {
            let mut connection = TcpStream::connect(limited.http).await?;
            Ok((raw_http::get(&mut connection, "/healthz").await?.0 == 200).then_some(connection))
        };
        let mut first = wait::until("a first connection served", within, served).await?;
        let mut second = wait::until("a second connection served", within, served).await?;
        let answer = raw_http::get_until_closed(limited.http, "/healthz", within).await?;
        ensure!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        ensure!(answer.contains("--max-connections"), "{answer}");
        for connection in [&mut first, &mut second] {
            ensure!(raw_http::get(connection, "/healthz").await?.0 == 200);
        }

        let grpc_url = format!("http://{}", limited.grpc);
        let mut channels = Vec::new();
        for _ in 0..2 {
            let mut channel = GrpcInferenceServiceClient::connect(grpc_url.clone()).await?;
            channel.server_live(ServerLiveRequest {}).await?;
            channels.push(channel);
        }
        let refused = GrpcInferenceServiceClient::connect(grpc_url)
            .await?
            .server_live(ServerLiveRequest {})
            .await
            .expect_err("a gRPC connection over the limit was served");
        ensure!(refused.code() == tonic::Code::Unavailable, "{refused:?}");
        ensure!(refused.message().contains("--max-connections"), "{refused:?}");
        for channel in &mut channels {
            channel.server_live(ServerLiveRequest {}).await?;
        }
        Ok(())
    })
    .await
}

/// A new template rolled out while clients stream through the router: every stream ends
/// cleanly, and under the default rollout (maxSurge 1, maxUnavailable 0) the replicas serving
/// never drop below the two asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_under_streaming_load_fails_no_request_and_keeps_every_replica_serving()
-> Result<()> {
    npufleet_tests::on_shared_cluster(|_, _| async move {
        let fleet = Fleet::serving("router-rollout", 75, 2).await?;
        let pods = fleet.pods();
        let old: HashSet<String> = pods
            .list(&ListParams::default())
            .await?
            .items
            .iter()
            .filter_map(|p| p.uid())
            .collect();
        let load = Load::through(&fleet.router);
        let mut body = chat("Name a river.", 12);
        body["stream"] = json!(true);
        load.start(4, "/v1/chat/completions", body);
        wait::until("both replicas answering", Duration::from_secs(60), || async {
            Ok((load.answered_by().await.len() == 2).then_some(()))
        })
        .await?;

        let changed = Instant::now();
        fleet.apply_with_env(2, &[("REVISION", "2")]).await?;

        // Polled rather than watched: the least seen is an upper bound of the true least.
        let least = std::sync::atomic::AtomicUsize::new(usize::MAX);
        let replaced_in = wait::until("the rollout to replace both pods", Duration::from_secs(180), || async {
            let list = pods.list(&ListParams::default()).await?.items;
            let serving = list.iter().filter(|p| pods::serves(p)).count();
            least.fetch_min(serving, std::sync::atomic::Ordering::Relaxed);
            let all_new = list.iter().all(|p| p.uid().is_none_or(|uid| !old.contains(&uid)));
            Ok((list.len() == 2 && serving == 2 && all_new).then(|| changed.elapsed()))
        })
        .await?;
        let least_serving = least.into_inner();
        load.wait_sent(8, "answers from the new pods").await?;
        load.stop().await?;
        eprintln!(
            "rollout of 2 replicas under 4 streaming clients: replaced in {:.1} s, serving never below {least_serving}; sent {}, failed {}",
            replaced_in.as_secs_f64(),
            load.sent(),
            load.failed()
        );
        assert_eq!(load.failed(), 0, "failures: {:?}", load.failures().await);
        assert!(least_serving >= 2, "only {least_serving} replicas served during the rollout");
        Ok(())
    })
    .await
}

/// A worker killed with SIGKILL under load: requests it had not answered go to the other
/// replica (the client sees no failure), streams it was sending end with an error event, and no
/// client waits past its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_under_load_leaves_no_client_hanging() -> Result<()> {
    npufleet_tests::on_shared_cluster(|_, _| async move {
        let fleet = Fleet::serving("router-kill", 73, 2).await?;
        let load = Load::through(&fleet.router);
        load.start(4, "/v1/chat/completions", chat("Name a river.", 16));
        let answered = wait::until("both replicas answering", Duration::from_secs(60), || async {
            let answered = load.answered_by().await;
            Ok((answered.len() == 2).then_some(answered))
        })
        .await?;
        // A stream on the replica about to die.
        let victim = answered.keys().next().context("an answering replica")?.clone();
        let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build()?;
        let stream = loop {
            let response = http
                .post(fleet.router.url("/v1/completions"))
                .json(&json!({"model": MODEL, "prompt": "Write a long story about the sea.", "max_tokens": 400, "stream": true}))
                .send()
                .await?;
            if response.headers()[headers::REPLICA] == victim.as_str() {
                break response;
            }
        };
        let mut stream = stream.bytes_stream();
        let first = stream.next().await.context("the stream's first bytes")??;
        assert!(!first.is_empty());

        let pid = fleet
            .agent
            .pid(&format!("{}/{victim}", fleet.namespace))
            .with_context(|| format!("no process for {victim}"))?;
        // SAFETY: a worker process this test's node agent started.
        assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
        let killed = Instant::now();

        let mut rest = String::new();
        while let Some(bytes) = stream.next().await {
            rest.push_str(std::str::from_utf8(&bytes?)?);
        }
        let stream_ended = killed.elapsed();
        assert!(sse_error(&rest).is_some(), "the stream ended without an error event: {rest}");
        assert!(rest.trim_end().ends_with("data: [DONE]"), "{rest}");

        load.wait_sent(8, "more answers after the kill").await?;
        load.stop().await?;
        eprintln!(
            "stream ended {:.2} s after SIGKILL; sent {}, failed {}",
            stream_ended.as_secs_f64(),
            load.sent(),
            load.failed()
        );
        assert!(stream_ended < Duration::from_secs(5), "the stream ended {stream_ended:?} after the kill");
        assert_eq!(load.failed(), 0, "failures: {:?}", load.failures().await);
        let metrics = fleet.router.metrics().await?;
        if !metrics.contains("npufleet_router_retries_total") {
            bail!("no retry recorded: {metrics}");
        }
        Ok(())
    })
    .await
}

/// A service whose workers require an API key (`spec.apiKeySecret`) behind the router, which
/// holds no key: a client's key reaches the worker over HTTP (`Authorization`) and gRPC
/// (`authorization` metadata); without it the worker's 401 / UNAUTHENTICATED comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_api_key_goes_through_the_router_to_the_workers_that_check_it() -> Result<()> {
    const KEY: &str = "router-e2e-key";
    npufleet_tests::on_shared_cluster(|_, _| async move {
        let fleet = Fleet::start("router-auth", 74, &[]).await?;
        let secret: Secret = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "chat-api-key", "namespace": fleet.namespace},
            "stringData": {"key": KEY},
        }))?;
        Api::<Secret>::namespaced(fleet.client.clone(), &fleet.namespace)
            .create(&PostParams::default(), &secret)
            .await?;
        let mut guarded = fleet.smollm2("chat", chat_spec(1, &[])).await?;
        guarded.spec.api_key_secret = Some(SecretKeySelector {
            name: "chat-api-key".into(),
            key: "key".into(),
            optional: None,
        });
        fleet.bed.apply(&guarded).await?;
        fleet.wait_serving(1).await?;

        let http = reqwest::Client::new();
        let url = fleet.router.url("/v1/chat/completions");
        let refused = http.post(&url).json(&chat("Hello", 4)).send().await?;
        let (status, message) = error_of(refused).await?;
        assert_eq!(status, 401, "{message}");
        let answered = http
            .post(&url)
            .bearer_auth(KEY)
            .json(&chat("Hello", 4))
            .send()
            .await?;
        assert_eq!(answered.status(), 200, "{}", answered.text().await?);

        let mut grpc =
            GrpcInferenceServiceClient::connect(format!("http://{}", fleet.router.grpc)).await?;
        let status = grpc
            .model_infer(oip_text(MODEL, "Hello", 4))
            .await
            .expect_err("a call without the key was answered");
        assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
        fn with_key<T>(message: T) -> tonic::Request<T> {
            let mut request = tonic::Request::new(message);
            request.metadata_mut().insert(
                npufleet_contract::auth::AUTHORIZATION,
                format!("Bearer {KEY}")
                    .parse()
                    .expect("an ASCII header value"),
            );
            request
        }
        let answer = grpc
            .model_infer(with_key(oip_text(MODEL, "Hello", 4)))
            .await?;
        assert!(!answer.into_inner().outputs.is_empty());
        let stream = grpc
            .model_stream_infer(with_key(futures::stream::iter([oip_text(
                MODEL, "Hello", 4,
            )])))
            .await?;
        let first = stream
            .into_inner()
            .message()
            .await?
            .context("the stream ended before its first response")?;
        assert!(first.error_message.is_empty(), "{}", first.error_message);
        Ok(())
    })
    .await
}

/// Resident memory of process `pid`, in KiB.
fn resident_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("no VmRSS for process {pid}"))
}

/// Memory samples of one process: the mean of the first minute after warm-up against the
/// mean of the last minute.
#[derive(Default)]
struct Resident {
    samples: Vec<(Instant, u64)>,
}

impl Resident {
    fn mean_kib(&self, from: Instant, to: Instant) -> Option<f64> {
        let window: Vec<u64> = self
            .samples
            .iter()
            .filter(|(at, _)| *at >= from && *at <= to)
            .map(|(_, kib)| *kib)
            .collect();
        (!window.is_empty()).then(|| window.iter().sum::<u64>() as f64 / window.len() as f64)
    }
}

/// A bounded soak (`make chaos`; `NPUFLEET_SOAK_SECONDS`, ten minutes by default): streaming
/// chat and plain completions through the router while the fleet scales between one and two
/// replicas every minute. After a warm-up of a fifth of the run, the operator, the router and
/// every worker process that lived through the run keep their resident memory within 5%, and
/// no request fails; 429s (none are expected at this load) would be counted apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "minutes: run by make chaos"]
async fn a_soak_of_mixed_traffic_and_scale_cycles_keeps_memory_flat_and_fails_nothing() -> Result<()>
{
    const SAMPLE_EVERY: Duration = Duration::from_secs(5);
    const SCALE_EVERY: Duration = Duration::from_secs(60);
    const WINDOW: Duration = Duration::from_secs(60);
    let soak = Duration::from_secs(
        std::env::var("NPUFLEET_SOAK_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(600),
    );
    let warm_up = soak / 5;
    npufleet_tests::on_shared_cluster(|_, _| async move {
        let fleet = Fleet::start_with("soak", 76, &[], true).await?;
        let FleetOperator::Binary { process: operator } = &fleet.operator else {
            bail!("the soak measures the operator binary");
        };
        // The KV cache is touched as blocks are first used and then kept, so a worker's
        // resident memory rises to its reserved size by design; sized small, the warm-up fills
        // it and what follows shows any leak.
        fleet.apply_with_env(1, &[(worker_env::KV_CACHE_BYTES, &(64u64 << 20).to_string())]).await?;
        fleet.wait_serving(1).await?;

        let streams = Load::through(&fleet.router);
        let mut streaming = chat("Name three rivers and a sea.", 24);
        streaming["stream"] = json!(true);
        streams.start(2, "/v1/chat/completions", streaming);
        let completions = Load::through(&fleet.router);
        completions.start(
            2,
            "/v1/completions",
            json!({"model": MODEL, "prompt": "The sea is", "max_tokens": 8}),
        );

        let services = fleet.services();
        let started = Instant::now();
        let mut processes: std::collections::BTreeMap<String, Resident> = Default::default();
        let mut record = |name: &str, pid: u32, at: Instant| {
            if let Ok(kib) = resident_kib(pid) {
                processes.entry(name.to_owned()).or_default().samples.push((at, kib));
            }
        };
        let mut replicas = 1;
        let mut next_scale = started + SCALE_EVERY;
        let mut cycles = 0;
        // A sampling cadence, not a wait for a condition: the soak runs for its set time.
        let mut samples = tokio::time::interval(SAMPLE_EVERY);
        while started.elapsed() < soak {
            samples.tick().await;
            let now = Instant::now();
            record("operator", operator.pid(), now);
            record("router", fleet.router.process.pid(), now);
            // By process: a pod scaled away and back comes again under the same name.
            for (pod, _) in fleet.agent.running() {
                if let Some(pid) = fleet.agent.pid(&pod) {
                    record(&format!("{pod} (pid {pid})"), pid, now);
                }
            }
            if now >= next_scale {
                replicas = 3 - replicas;
                set_replicas(&services, "chat", replicas).await?;
                cycles += 1;
                next_scale = now + SCALE_EVERY;
            }
        }
        let ended = Instant::now();
        futures::try_join!(streams.stop(), completions.stop())?;

        let baseline = (started + warm_up, started + warm_up + WINDOW);
        let last = (ended - WINDOW, ended);
        let mut grown = Vec::new();
        let mut measured = 0;
        for (name, resident) in &processes {
            let (Some(before), Some(after)) = (
                resident.mean_kib(baseline.0, baseline.1),
                resident.mean_kib(last.0, last.1),
            ) else {
                // A worker that came or went with a scale cycle did not live through the run.
                continue;
            };
            measured += 1;
            let growth = (after - before) / before * 100.0;
            eprintln!(
                "{name}: {:.1} MiB after warm-up, {:.1} MiB at the end ({growth:+.1}%)",
                before / 1024.0,
                after / 1024.0
            );
            if growth >= 5.0 {
                grown.push(format!("{name} grew {growth:.1}%"));
            }
        }
        let failures: Vec<String> =
            [streams.failures().await, completions.failures().await].concat();
        eprintln!(
            "soak of {:.0} s, {cycles} scale changes: {} streams and {} completions sent, {} failed, {} refused as overload",
            soak.as_secs_f64(),
            streams.sent(),
            completions.sent(),
            failures.len(),
            streams.rejected() + completions.rejected()
        );
        ensure!(measured >= 3, "only {measured} processes lived through the soak");
        ensure!(failures.is_empty(), "failed requests: {failures:#?}");
        ensure!(grown.is_empty(), "resident memory grew: {grown:?}");
        Ok(())
    })
    .await
}

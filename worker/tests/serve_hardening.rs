//! The real worker binary against hostile or careless clients: huge prompts do not stall the
//! probes, unimplemented OpenAI features are refused by name, streams end cleanly on
//! shutdown, a drain that gives up says so, a malformed priority is refused by name, oversized gRPC messages name their limit, the
//! latency metrics are observed as tokens are sent, and a prefix-cache hit does not change a
//! greedy answer.

mod model_support;
mod serve_support;

use std::time::{Duration, Instant};

use npufleet_contract::proto::inference::ModelInferRequest;
use npufleet_contract::proto::inference::ModelStreamInferResponse;
use npufleet_contract::proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
use npufleet_worker::server::oip;
use npufleet_worker_testkit::testmodel::{GenTestModelArgs, TestModelFormat, write_test_model};
use serde_json::{Value, json};
use serve_support::{MODEL_NAME, Worker, error_message, get_text, open_stream, poll_until, post};

fn text_request(id: &str, text: &[u8], max_tokens: i64) -> ModelInferRequest {
    let mut request = oip::text_request(
        MODEL_NAME,
        text,
        [
            ("max_tokens", oip::int_param(max_tokens)),
            ("temperature", oip::int_param(0)),
        ],
    );
    request.id = id.into();
    request
}

/// The value of the first sample of `name` whose line contains every one of `labels`.
fn metric(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|line| line.starts_with(name) && labels.iter().all(|l| line.contains(l)))
        .find_map(|line| line.rsplit(' ').next()?.parse().ok())
}

async fn scrape(client: &reqwest::Client, worker: &Worker) -> String {
    get_text(client, &format!("{}/metrics", worker.http)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_answers_while_huge_prompts_are_refused() {
    let worker = Worker::start(&["--max-body-bytes", "8388608"]).await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/completions", worker.http);
    // Eight concurrent 4 MB prompts, each far beyond the 2048-token context: one of many
    // words, one of a single long word.
    let prompts: Vec<String> = (0..8)
        .map(|i| {
            if i % 2 == 0 {
                "lorem ipsum ".repeat(4 << 20 >> 4)
            } else {
                "a".repeat(4 << 20)
            }
        })
        .collect();
    let refused: Vec<_> = prompts
        .into_iter()
        .map(|prompt| {
            let request = client
                .post(&url)
                .json(&json!({"prompt": prompt, "max_tokens": 4}))
                .send();
            tokio::spawn(async move {
                let response = request.await.unwrap();
                let status = response.status().as_u16();
                (status, response.json::<Value>().await.unwrap())
            })
        })
        .collect();
    let health_url = format!("{}/health", worker.http);
    let mut slowest = Duration::ZERO;
    let mut probes = 0;
    while probes < 20 || refused.iter().any(|task| !task.is_finished()) {
        let started = Instant::now();
        let response = client.get(&health_url).send().await.unwrap();
        assert_eq!(response.status(), 200);
        slowest = slowest.max(started.elapsed());
        probes += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for task in refused {
        let (status, body) = task.await.unwrap();
        assert_eq!(status, 400, "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("context length is 2048"), "{message}");
    }
    assert!(
        slowest < Duration::from_millis(100),
        "/health took {slowest:?} while large prompts were refused"
    );
}

#[tokio::test]
async fn unimplemented_features_are_refused_by_name_in_the_openai_shape() {
    let worker = Worker::start(&[]).await;
    let client = reqwest::Client::new();
    let chat = format!("{}/v1/chat/completions", worker.http);
    let messages = json!([{"role": "user", "content": "What is the weather?"}]);
    for (fields, param) in [
        (
            json!({
                "tools": [{"type": "function", "function": {"name": "weather", "parameters": {}}}],
                "tool_choice": "required",
            }),
            "tools",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {}}}}),
            "response_format",
        ),
        (json!({"logprobs": true, "top_logprobs": 2}), "logprobs"),
    ] {
        let mut body = json!({"messages": messages, "max_tokens": 4});
        body.as_object_mut()
            .unwrap()
            .extend(fields.as_object().unwrap().clone());
        let (status, body) = post(&client, &chat, body).await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(body["error"]["param"], param, "{body}");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert!(
            body["error"]["message"].as_str().unwrap().contains(param),
            "{body}"
        );
    }
    // The harmless spellings are served.
    let (status, body) = post(
        &client,
        &chat,
        json!({"messages": messages, "max_tokens": 2, "response_format": {"type": "text"},
               "tools": [], "tool_choice": "none"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");

    // max_tokens beyond what the context leaves is refused, not clamped.
    let (status, body) = post(
        &client,
        &format!("{}/v1/completions", worker.http),
        json!({"prompt": "hello", "max_tokens": 5000}),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("max_tokens is 5000") && message.contains("2048"),
        "{message}"
    );

    // Every error has the OpenAI shape, a wrong method included.
    let response = client
        .get(format!("{}/v1/completions", worker.http))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 405);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "method_not_allowed", "{body}");
    assert!(
        error_message(&body).contains("GET is not allowed on /v1/completions"),
        "{body}"
    );
}

#[tokio::test]
async fn a_priority_that_is_not_an_integer_is_refused_by_name() {
    use npufleet_contract::headers::FLOW_PRIORITY;
    let worker = Worker::start(&[]).await;
    let client = reqwest::Client::new();
    let body = json!({"prompt": "hello", "max_tokens": 2});
    let completions = format!("{}/v1/completions", worker.http);
    for (value, status) in [("high", 400), ("7", 200), (" -3 ", 200)] {
        let response = client
            .post(&completions)
            .header(FLOW_PRIORITY, value)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), status, "{value:?}");
        if status == 400 {
            let body: Value = response.json().await.unwrap();
            let message = error_message(&body);
            assert!(
                message.contains(FLOW_PRIORITY) && message.contains("high"),
                "{body}"
            );
        }
    }

    let mut grpc = worker.grpc_client().await;
    let mut request = tonic::Request::new(text_request("p", b"hello", 2));
    request
        .metadata_mut()
        .insert(FLOW_PRIORITY, "1.5".parse().unwrap());
    let status = grpc.model_infer(request).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains(FLOW_PRIORITY), "{status:?}");
    let mut request = tonic::Request::new(text_request("p", b"hello", 2));
    request
        .metadata_mut()
        .insert(FLOW_PRIORITY, "2".parse().unwrap());
    grpc.model_infer(request).await.unwrap();
}

#[tokio::test]
async fn an_idle_grpc_stream_does_not_hold_shutdown() {
    let mut worker = Worker::start(&["--drain-timeout", "30"]).await;
    let mut client = worker.grpc_client().await;
    let (requests, mut responses) =
        open_stream(&mut client, text_request("idle-1", b"hello", 3)).await;
    // Read the one request's responses to its final one; the stream then stays open, idle.
    loop {
        let response: ModelStreamInferResponse = responses.message().await.unwrap().unwrap();
        assert!(response.error_message.is_empty(), "{response:?}");
        let last = response
            .infer_response
            .unwrap()
            .parameters
            .get("triton_final_response")
            .and_then(|p| p.parameter_choice.clone())
            == Some(
                npufleet_contract::proto::inference::infer_parameter::ParameterChoice::BoolParam(
                    true,
                ),
            );
        if last {
            break;
        }
    }

    let signalled = Instant::now();
    worker.sigterm();
    // The server ends the stream with an OK status.
    let ended = tokio::time::timeout(Duration::from_secs(5), responses.message())
        .await
        .expect("the stream stayed open after SIGTERM");
    assert!(matches!(ended, Ok(None)), "{ended:?}");
    let status = worker.wait_exit(Duration::from_secs(10)).await;
    let took = signalled.elapsed();
    assert!(status.success(), "exit status {status:?}");
    assert!(
        took < Duration::from_secs(2),
        "the worker took {took:?} to exit with an idle stream open"
    );
    drop(requests);
}

#[tokio::test]
async fn a_drain_that_gives_up_tells_every_client_and_exits_non_zero() {
    let mut worker = Worker::start(&[
        "--ignore-eos",
        "--max-batch-size",
        "1",
        "--drain-timeout",
        "0.5",
    ])
    .await;
    let client = reqwest::Client::new();
    // Enough queued work that half a second cannot finish all of it.
    let streams: Vec<_> = (0..6)
        .map(|_| {
            let request = client
                .post(format!("{}/v1/completions", worker.http))
                .json(&json!({"prompt": "hello world", "max_tokens": 2000,
                              "temperature": 0, "stream": true}))
                .send();
            tokio::spawn(async move { request.await.unwrap().text().await.unwrap() })
        })
        .collect();
    let mut grpc = worker.grpc_client().await;
    let (requests, mut grpc_responses) =
        open_stream(&mut grpc, text_request("long", b"hello world", 2000)).await;
    let http = worker.http.clone();
    poll_until(
        Duration::from_secs(30),
        "every request to be queued",
        || {
            let (client, http) = (client.clone(), http.clone());
            async move {
                let text = client
                    .get(format!("{http}/metrics"))
                    .send()
                    .await
                    .ok()?
                    .text()
                    .await
                    .ok()?;
                let waiting = metric(&text, "vllm:num_requests_waiting", &[])?;
                let running = metric(&text, "vllm:num_requests_running", &[])?;
                (waiting + running >= 7.0).then_some(())
            }
        },
    )
    .await;
    worker.sigterm();

    // Whichever requests finish inside the half second are answered in full; every other one
    // is told the drain gave up on it. None is left without an answer.
    let (mut finished, mut told) = (0, 0);
    for stream in streams {
        let body = stream.await.unwrap();
        let events: Vec<&str> = body
            .split("\n\n")
            .filter_map(|e| e.trim().strip_prefix("data:").map(str::trim))
            .collect();
        assert_eq!(events.last(), Some(&"[DONE]"), "{body}");
        let last: Value = events
            .len()
            .checked_sub(2)
            .and_then(|at| serde_json::from_str(events[at]).ok())
            .unwrap_or_else(|| panic!("no event before [DONE]: {body}"));
        if last["choices"][0]["finish_reason"] == "length" {
            finished += 1;
            continue;
        }
        assert!(
            last["error"]["message"]
                .as_str()
                .is_some_and(|message| message.contains("drain timeout")),
            "{body}"
        );
        told += 1;
    }
    // The gRPC stream's request gets an in-stream error (or its final response), then the
    // stream ends with a status.
    let mut grpc_answered = false;
    loop {
        match grpc_responses.message().await {
            Ok(Some(response)) => {
                if !response.error_message.is_empty() {
                    assert!(
                        response.error_message.contains("drain timeout"),
                        "{response:?}"
                    );
                    grpc_answered = true;
                    told += 1;
                } else if response
                    .infer_response
                    .as_ref()
                    .is_some_and(|r| r.parameters.contains_key("finish_reason"))
                {
                    grpc_answered = true;
                    finished += 1;
                }
            }
            Ok(None) => break,
            Err(status) => {
                assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
                break;
            }
        }
    }
    assert!(
        grpc_answered,
        "the gRPC client got neither its answer nor an error"
    );
    assert_eq!(finished + told, 7);
    assert!(told >= 1, "every request finished inside the drain timeout");
    let status = worker.wait_exit(Duration::from_secs(10)).await;
    assert!(!status.success(), "exit status {status:?}");
    worker.assert_logged("requests unanswered");
    drop(requests);
}

#[tokio::test]
async fn an_oversized_grpc_message_names_the_limit() {
    let worker = Worker::start(&["--max-grpc-message-bytes", "1048576"]).await;
    let mut client = worker.grpc_client().await;
    let big = vec![b'a'; 2 << 20];
    let status = client
        .model_infer(text_request("big", &big, 4))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("--max-grpc-message-bytes"),
        "{status:?}"
    );

    let (_requests, mut responses) = open_stream(&mut client, text_request("big", &big, 4)).await;
    let status = responses.message().await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("--max-grpc-message-bytes"),
        "{status:?}"
    );
    // A message under the limit is served.
    client
        .model_infer(text_request("small", b"hello", 2))
        .await
        .unwrap();
}

#[tokio::test]
async fn time_to_first_token_is_observed_when_the_first_token_is_sent() {
    let dir = tempfile::tempdir().unwrap();
    let worker = Worker::spawn_model(&long_context_model(dir.path()), &["--ignore-eos"], &[]);
    worker.wait_ready().await;
    let client = reqwest::Client::new();
    let held = stalled_completion(&worker, "hello world", LONG_OUTPUT_TOKENS);
    // The request cannot finish while its client holds it, yet its time to first token is
    // already recorded.
    let text = poll_until(Duration::from_secs(10), "the first token's TTFT", || {
        let (client, worker) = (&client, &worker);
        async move {
            let text = scrape(client, worker).await;
            (metric(&text, "vllm:time_to_first_token_seconds_count", &[]) == Some(1.0))
                .then_some(text)
        }
    })
    .await;
    assert_eq!(
        metric(&text, "vllm:request_generation_tokens_count", &[]),
        Some(0.0),
        "{text}"
    );
    drop(held);

    // The rest of vLLM's names, and the ones a Gateway API Inference Extension endpoint
    // picker reads, move under load.
    let (status, _) = post(
        &client,
        &format!("{}/v1/completions", worker.http),
        json!({"prompt": "hello world", "max_tokens": 5, "temperature": 0}),
    )
    .await;
    assert_eq!(status, 200);
    let text = scrape(&client, &worker).await;
    assert_eq!(
        metric(&text, "vllm:request_generation_tokens_sum", &[]),
        Some(5.0),
        "{text}"
    );
    assert!(metric(&text, "vllm:request_prompt_tokens_sum", &[]).unwrap() >= 2.0);
    assert!(metric(&text, "vllm:time_per_output_token_seconds_count", &[]).unwrap() >= 4.0);
    assert!(metric(&text, "vllm:prefix_cache_queries_total", &[]).unwrap() >= 2.0);
    assert!(metric(&text, "vllm:prefix_cache_hits_total", &[]).is_some());
    assert!(metric(&text, "vllm:gpu_cache_usage_perc", &[]).is_some());
    assert!(metric(&text, "vllm:kv_cache_usage_perc", &[]).is_some());
    assert_eq!(
        metric(
            &text,
            "vllm:cache_config_info",
            &["block_size=\"16\"", "num_gpu_blocks=\""]
        ),
        Some(1.0),
        "{text}"
    );
}

/// Tokens asked of a request that must outlast its client's buffers: tens of thousands of
/// tokens are megabytes of stream, more than the socket buffers and the worker's own hold.
const LONG_OUTPUT_TOKENS: i64 = 30_000;

/// The test model with a context long enough for [`LONG_OUTPUT_TOKENS`].
fn long_context_model(dir: &std::path::Path) -> std::path::PathBuf {
    let mut spec = GenTestModelArgs::new(dir.join("long.gguf"), TestModelFormat::Gguf);
    spec.context = 32_768;
    write_test_model(&spec).expect("writing the test model")
}

/// Opens a streamed completion on a connection with a receive buffer of a few kilobytes,
/// reads up to its first event, then stops reading and holds the connection open.
fn stalled_completion(worker: &Worker, prompt: &str, max_tokens: i64) -> std::net::TcpStream {
    use std::io::{Read, Write};
    let addr: std::net::SocketAddr = worker.http.trim_start_matches("http://").parse().unwrap();
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.connect(&addr.into()).unwrap();
    let mut stream: std::net::TcpStream = socket.into();
    let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                      "stream": true})
    .to_string();
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let (mut seen, mut buf) = (Vec::new(), [0u8; 512]);
    while !seen.windows(5).any(|w| w == b"data:") {
        let n = stream.read(&mut buf).expect("reading the first event");
        assert!(
            n > 0,
            "the stream ended: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(
        seen.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&seen)
    );
    stream
}

/// While a reader holds a stalled stream: another request is served, and the stalled one is
/// cancelled once `--stalled-reader-timeout` passes without room for its next chunk.
async fn others_are_served_and_the_stalled_reader_is_cancelled(
    client: &reqwest::Client,
    worker: &Worker,
    opened: Instant,
) {
    poll_until(
        Duration::from_secs(10),
        "the held request running",
        || async {
            let text = scrape(client, worker).await;
            (metric(&text, "vllm:num_requests_running", &[]) == Some(1.0)).then_some(())
        },
    )
    .await;

    let (status, body) = post(
        client,
        &format!("{}/v1/completions", worker.http),
        json!({"prompt": "hello", "max_tokens": 5, "temperature": 0}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 5);

    let stalled = [r#"reason="stalled_reader""#];
    poll_until(
        Duration::from_secs(30),
        "the stalled reader cancelled",
        || async {
            let text = scrape(client, worker).await;
            (metric(&text, "npufleet_requests_rejected_total", &stalled) == Some(1.0)
                && metric(&text, "vllm:num_requests_running", &[]) == Some(0.0))
            .then_some(())
        },
    )
    .await;
    eprintln!(
        "the stalled reader was cancelled {:.2} s after it opened",
        opened.elapsed().as_secs_f64()
    );
}

/// A worker on the long-context model that cancels a reader stalled for a second.
async fn stalled_reader_worker(dir: &std::path::Path) -> Worker {
    let worker = Worker::spawn_model(
        &long_context_model(dir),
        &["--ignore-eos", "--stalled-reader-timeout", "1"],
        &[],
    );
    worker.wait_ready().await;
    worker
}

/// Finding 6 end to end over gRPC: a `ModelStreamInfer` client that stops reading.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_reader_that_stops_reading_is_cancelled_and_others_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let worker = stalled_reader_worker(dir.path()).await;
    let client = reqwest::Client::new();
    let opened = Instant::now();
    // A gRPC client that announces an 8 KiB window and never reads the responses.
    let channel = tonic::transport::Endpoint::from_shared(worker.grpc.clone())
        .unwrap()
        .initial_stream_window_size(Some(8192))
        .initial_connection_window_size(Some(8192))
        .connect()
        .await
        .unwrap();
    let mut grpc = GrpcInferenceServiceClient::new(channel);
    let (requests, queued) = tokio::sync::mpsc::channel(1);
    requests
        .send(text_request("stalled", b"hello world", LONG_OUTPUT_TOKENS))
        .await
        .unwrap();
    let responses = grpc
        .model_stream_infer(tokio_stream::wrappers::ReceiverStream::new(queued))
        .await
        .unwrap()
        .into_inner();
    others_are_served_and_the_stalled_reader_is_cancelled(&client, &worker, opened).await;
    drop((responses, requests));
}

/// Finding 6 end to end over HTTP/1 SSE: the worker bounds each connection's send buffer
/// (`--http-send-buffer-bytes`), so a reader that stops fills it within seconds rather than
/// after megabytes of tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sse_reader_that_stops_reading_is_cancelled_and_others_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let worker = stalled_reader_worker(dir.path()).await;
    let client = reqwest::Client::new();
    let opened = Instant::now();
    let held = stalled_completion(&worker, "hello world", LONG_OUTPUT_TOKENS);
    others_are_served_and_the_stalled_reader_is_cancelled(&client, &worker, opened).await;
    drop(held);
}

/// Finding 5: resident memory after a burst is the documented level — what the worker held
/// when ready, plus the KV cache it reserved (touched as used, then kept), plus a working set
/// — and repeated bursts do not add to it: nothing a finished request used stays behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_after_repeated_bursts_returns_to_a_bounded_level() {
    const KV_CACHE_BYTES: u64 = 8 << 20;
    const WORKING_SET_BYTES: u64 = 48 << 20;
    const STREAMS: usize = 16;
    let kv_cache_bytes = KV_CACHE_BYTES.to_string();
    let worker = Worker::start(&[
        "--ignore-eos",
        "--kv-cache-bytes",
        &kv_cache_bytes,
        "--max-batch-size",
        "16",
    ])
    .await;
    let client = reqwest::Client::new();
    let ready = worker.resident_bytes();
    let mut after = Vec::new();
    for _ in 0..3 {
        // Streams that together ask for more positions than the cache holds, so it is used
        // to the full and requests also wait for room.
        let burst = (0..STREAMS).map(|i| {
            let (client, url) = (client.clone(), format!("{}/v1/completions", worker.http));
            async move {
                let response = client
                    .post(url)
                    .json(&json!({"prompt": format!("burst {i}"), "max_tokens": 700,
                                  "temperature": 0, "stream": true}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(response.status(), 200);
                let body = response.text().await.unwrap();
                assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
            }
        });
        futures::future::join_all(burst).await;
        poll_until(Duration::from_secs(10), "the burst to finish", || async {
            let text = scrape(&client, &worker).await;
            (metric(&text, "vllm:num_requests_running", &[]) == Some(0.0)).then_some(())
        })
        .await;
        after.push(worker.resident_bytes());
    }
    let mib = |bytes: u64| bytes as f64 / f64::from(1 << 20);
    eprintln!(
        "resident: {:.1} MiB ready, after each of three bursts of {STREAMS} streams: {:?} MiB",
        mib(ready),
        after
            .iter()
            .map(|&b| format!("{:.1}", mib(b)))
            .collect::<Vec<_>>()
    );
    let level = ready + KV_CACHE_BYTES + WORKING_SET_BYTES;
    for &bytes in &after {
        assert!(
            bytes <= level,
            "{:.1} MiB resident after a burst, above the documented {:.1} MiB",
            mib(bytes),
            mib(level)
        );
    }
    assert!(
        after[2] <= after[0] + (4 << 20),
        "repeated bursts grew resident memory: {after:?}"
    );
}

/// The KV-cache block count the worker reports in `vllm:cache_config_info`.
async fn kv_blocks(client: &reqwest::Client, worker: &Worker) -> f64 {
    let text = scrape(client, worker).await;
    let line = text
        .lines()
        .find(|line| line.starts_with("vllm:cache_config_info{"))
        .unwrap_or_else(|| panic!("no vllm:cache_config_info in\n{text}"));
    line.split("num_gpu_blocks=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .and_then(|blocks| blocks.parse().ok())
        .unwrap_or_else(|| panic!("no block count in {line}"))
}

#[tokio::test]
async fn the_kv_cache_is_sized_from_the_memory_limit() {
    let client = reqwest::Client::new();
    let unlimited = Worker::start(&[]).await;
    // 1 GiB when no limit is known.
    let default_blocks = kv_blocks(&client, &unlimited).await;
    drop(unlimited);
    // A quarter of 256 MiB (less the test model's few hundred kilobytes of weights): just
    // under a sixteenth of the default.
    let limited = Worker::start(&[
        "--memory-limit-bytes",
        "268435456",
        "--kv-cache-memory-fraction",
        "0.25",
    ])
    .await;
    let blocks = kv_blocks(&client, &limited).await;
    assert!(
        blocks <= default_blocks / 16.0 && blocks > default_blocks / 16.0 * 0.9,
        "{blocks} blocks under the limit, {default_blocks} without"
    );

    // A limit the weights alone fill, or a cache too small for one block, is refused at
    // start, naming the figures.
    let dir = tempfile::tempdir().unwrap();
    let model = serve_support::test_model(dir.path());
    let refusal = |limit: [&str; 2]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_npufleet-worker"))
            .arg("serve")
            .arg("--model")
            .arg(&model)
            .args(limit)
            .args(["--accelerator", "cpu"])
            .args(["--http-addr", "127.0.0.1:0", "--grpc-addr", "127.0.0.1:0"])
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let stderr = refusal(["--memory-limit-bytes", "1000"]);
    assert!(
        stderr.contains("the model does not fit: its weights take")
            && stderr.contains("the memory limit is 1000 bytes"),
        "{stderr}"
    );
    let stderr = refusal(["--kv-cache-bytes", "100"]);
    assert!(
        stderr.contains("room for no block") && stderr.contains("the cache gets 100 bytes"),
        "{stderr}"
    );
}

/// The prefix-cache hits a worker reports.
async fn prefix_cache_hits(client: &reqwest::Client, worker: &Worker) -> f64 {
    let text = scrape(client, worker).await;
    metric(&text, "vllm:prefix_cache_hits_total", &[])
        .unwrap_or_else(|| panic!("no vllm:prefix_cache_hits_total in\n{text}"))
}

/// A greedy chat answer to `question` and the prefix-cache hits the request added.
async fn greedy_answer(client: &reqwest::Client, worker: &Worker, question: &str) -> (String, f64) {
    let before = prefix_cache_hits(client, worker).await;
    let (status, body) = post(
        client,
        &format!("{}/v1/chat/completions", worker.http),
        json!({"model": MODEL_NAME, "temperature": 0, "max_tokens": 48,
               "messages": [{"role": "user", "content": question}]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let text = body["choices"][0]["message"]["content"].as_str().unwrap();
    let hits = prefix_cache_hits(client, worker).await - before;
    (text.to_string(), hits)
}

/// At least one block of the prompt came from the prefix cache.
fn assert_hit(hits: f64, what: &str) {
    assert!(hits >= 16.0, "{what} hit only {hits} cached tokens");
}

/// Temperature 0 gives the same text whether the prompt's prefix came from the cache or was
/// computed, on the real model at the default precision policy: the same chat request twice
/// (the second a full hit), and two requests sharing only their first blocks, each checked
/// against a worker that computed it without a hit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_cache_hit_does_not_change_a_greedy_answer() {
    let model = model_support::smollm2_path();
    let (warm, fresh) = (
        Worker::spawn_model(&model, &[], &[]),
        Worker::spawn_model(&model, &[], &[]),
    );
    warm.wait_ready().await;
    fresh.wait_ready().await;
    let client = reqwest::Client::new();
    let long = "Quelle est la plus haute distinction honorifique française, qui l'a créée, \
                et quels en sont les grades ?";
    let short = "Quelle est la plus haute distinction honorifique française ?";

    let (computed, hits) = greedy_answer(&client, &warm, long).await;
    assert_eq!(hits, 0.0, "a fresh worker had {hits} cached tokens");
    let (cached, hits) = greedy_answer(&client, &warm, long).await;
    assert_hit(hits, "the repeat");
    assert_eq!(
        cached, computed,
        "a full prefix-cache hit changed the answer"
    );

    // `short` shares the chat template and the question's first words with `long`.
    let (partly_cached, hits) = greedy_answer(&client, &warm, short).await;
    assert_hit(hits, "the shared prefix");
    let (short_computed, hits) = greedy_answer(&client, &fresh, short).await;
    assert_eq!(hits, 0.0);
    assert_eq!(
        partly_cached, short_computed,
        "a partial hit changed the answer"
    );
    // And the other way round: `long` after `short` on the second worker.
    let (long_partly_cached, hits) = greedy_answer(&client, &fresh, long).await;
    assert_hit(hits, "the shared prefix");
    assert_eq!(
        long_partly_cached, computed,
        "a partial hit changed the answer"
    );
    assert_ne!(
        computed, short_computed,
        "the two questions got the same answer"
    );
}

//! Backpressure and drain: on the real worker binary, a full queue is refused at once with
//! 429 / RESOURCE_EXHAUSTED, and SIGTERM under load answers every accepted request, refuses
//! new ones, and exits 0; in process, in front of an echo engine that holds its answers, the
//! drain's order of events over both protocols and a drain that times out.

mod serve_support;

use std::time::Duration;

use npufleet_worker::server::oip;
use serde_json::{Value, json};
use serve_support::in_process::{EchoEngine, InProcessWorker, default_config};
use serve_support::{MODEL_NAME, Worker, error_message, get_text, poll_until, send_json, sse_data};

/// Flags that make every request generate exactly its `max_tokens`, one at a time.
const ONE_AT_A_TIME: &[&str] = &["--ignore-eos", "--max-batch-size", "1"];

fn long_request(max_tokens: u32) -> Value {
    json!({"model": MODEL_NAME, "prompt": "hello world", "max_tokens": max_tokens,
           "temperature": 0, "stream": true})
}

/// Reads an SSE response to its end and returns the finish reason of its last choice.
async fn finish_reason(response: reqwest::Response) -> Option<String> {
    let body = response.text().await.ok()?;
    let mut finish = None;
    let mut done = false;
    for event in body.split("\n\n") {
        let Some(data) = event.trim().strip_prefix("data:").map(str::trim) else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let chunk: Value = serde_json::from_str(data).ok()?;
        if let Some(reason) = chunk["choices"][0]["finish_reason"].as_str() {
            finish = Some(reason.to_string());
        }
    }
    finish.filter(|_| done)
}

#[tokio::test]
async fn a_full_queue_is_refused_at_once() {
    let worker = Worker::start(&[ONE_AT_A_TIME, &["--queue-limit", "1"]].concat()).await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/completions", worker.http);

    // One request runs, one waits; the queue is then full.
    let mut running = send_json(&client, &url, &long_request(1500)).await;
    assert_eq!(running.status(), 200);
    assert!(
        running.chunk().await.unwrap().is_some(),
        "the running request streams"
    );
    let waiting = send_json(&client, &url, &long_request(4)).await;
    assert_eq!(waiting.status(), 200);

    let refused = send_json(&client, &url, &long_request(4)).await;
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["retry-after"], "1");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["type"], "rate_limit_error");
    assert!(error_message(&body).contains("queue is full"));

    let mut grpc = worker.grpc_client().await;
    let status = grpc
        .model_infer(oip::text_request(MODEL_NAME, b"hi", []))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);

    // Both accepted requests still complete.
    let mut running_rest = Vec::new();
    while let Some(chunk) = running.chunk().await.unwrap() {
        running_rest.extend_from_slice(&chunk);
    }
    assert!(String::from_utf8_lossy(&running_rest).contains("[DONE]"));
    assert_eq!(finish_reason(waiting).await.as_deref(), Some("length"));
}

#[tokio::test]
async fn a_queued_chat_stream_sends_nothing_before_its_first_token() {
    let worker = Worker::start(ONE_AT_A_TIME).await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", worker.http);
    let chat = |max_tokens: u32| {
        json!({"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}],
               "max_tokens": max_tokens, "temperature": 0, "stream": true})
    };
    let mut running = send_json(&client, &url, &chat(1900)).await;
    assert_eq!(running.status(), 200);
    assert!(
        running.chunk().await.unwrap().is_some(),
        "the running request streams"
    );
    let mut waiting = send_json(&client, &url, &chat(4)).await;
    assert_eq!(waiting.status(), 200);

    // Queued behind a batch of one, the second request has no token yet, so its stream
    // stays silent: a role chunk sent on arrival would read as its first token to a client.
    let early = tokio::time::timeout(Duration::from_millis(50), waiting.chunk()).await;
    let metrics = get_text(&client, &format!("{}/metrics", worker.http)).await;
    let queued = format!("vllm:num_requests_waiting{{model_name=\"{MODEL_NAME}\"}} 1");
    assert!(
        metrics.contains(&queued),
        "the second request no longer waits: {metrics}"
    );
    assert!(
        early.is_err(),
        "the queued stream sent {early:?} before its first token"
    );

    // Once it runs, the role comes first, with its first token.
    drop(running);
    let mut body = Vec::new();
    while let Some(chunk) = waiting.chunk().await.unwrap() {
        body.extend_from_slice(&chunk);
    }
    let events = sse_data(&String::from_utf8_lossy(&body));
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(
        first["choices"][0]["delta"]["role"], "assistant",
        "{events:?}"
    );
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
}

#[tokio::test]
async fn sigterm_answers_every_accepted_request_then_exits_zero() {
    let mut worker = Worker::start(ONE_AT_A_TIME).await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/completions", worker.http);

    // Eight requests, run one after another, so work is left when the signal comes.
    let mut accepted = Vec::new();
    for _ in 0..8 {
        let response = send_json(&client, &url, &long_request(300)).await;
        assert_eq!(response.status(), 200);
        accepted.push(tokio::spawn(finish_reason(response)));
    }
    worker.sigterm();

    // Readiness turns false and new requests are refused while the accepted ones finish.
    let ready_url = format!("{}/v2/health/ready", worker.http);
    poll_until(Duration::from_secs(10), "readiness to turn false", || {
        let request = client.get(&ready_url).send();
        async move { request.await.ok().filter(|r| r.status() == 503) }
    })
    .await;
    let refused = send_json(&client, &url, &long_request(4)).await;
    assert_eq!(refused.status(), 503);
    let body: Value = refused.json().await.unwrap();
    assert!(error_message(&body).contains("draining"));
    let still_running = accepted.iter().filter(|task| !task.is_finished()).count();
    assert!(
        still_running > 0,
        "the drain ended before it could be observed"
    );

    for task in accepted {
        assert_eq!(task.await.unwrap().as_deref(), Some("length"));
    }
    let status = worker.wait_exit(Duration::from_secs(60)).await;
    assert!(status.success(), "exit status {status:?}");
    assert!(
        worker
            .log_lines()
            .iter()
            .any(|line| line.contains("every accepted request was answered")),
        "{:?}",
        worker.log_lines()
    );
}

async fn wait_not_ready(client: &reqwest::Client, http: &str) {
    let ready_url = format!("{http}/v2/health/ready");
    poll_until(Duration::from_secs(5), "readiness to turn false", || {
        let request = client.get(&ready_url).send();
        async move { request.await.ok().filter(|r| r.status() == 503) }
    })
    .await;
}

#[tokio::test]
async fn a_drain_answers_every_held_request_over_both_protocols() {
    let mut worker = InProcessWorker::start(default_config(), EchoEngine::new(8)).await;
    worker.engine.hold();
    let client = reqwest::Client::new();
    let url = format!("{}/v1/completions", worker.http);
    let http_answer = tokio::spawn(
        client
            .post(&url)
            .json(&json!({"model": MODEL_NAME, "prompt": "held over http"}))
            .send(),
    );
    let mut grpc = worker.grpc_client().await;
    let grpc_answer = tokio::spawn(async move {
        grpc.model_infer(oip::text_request(MODEL_NAME, b"held over grpc", []))
            .await
    });
    poll_until(Duration::from_secs(5), "both requests to be held", || {
        let running = worker.engine.running();
        async move { (running == 2).then_some(()) }
    })
    .await;

    worker.shut_down();
    wait_not_ready(&client, &worker.http).await;
    let refused = send_json(&client, &url, &json!({"prompt": "late"})).await;
    assert_eq!(refused.status(), 503);
    let mut late_grpc = worker.grpc_client().await;
    let status = late_grpc
        .model_infer(oip::text_request(MODEL_NAME, b"late", []))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(!http_answer.is_finished() && !grpc_answer.is_finished());

    worker.engine.release();
    let answered = http_answer.await.unwrap().unwrap();
    assert_eq!(answered.status(), 200);
    let body: Value = answered.json().await.unwrap();
    assert_eq!(body["choices"][0]["text"], "held over http");
    let answered = grpc_answer.await.unwrap().expect("the held gRPC request");
    let text = &answered.into_inner().outputs[0];
    assert_eq!(text.name, "text_output");
    assert_eq!(
        text.contents.as_ref().map(|c| c.bytes_contents.clone()),
        Some(vec![b"held over grpc".to_vec()])
    );
    worker
        .served(Duration::from_secs(5))
        .await
        .expect("a drain that answered everything ends serve without an error");
}

#[tokio::test]
async fn a_drain_that_times_out_tells_each_client() {
    let mut config = default_config();
    config.drain_timeout = Duration::from_millis(200);
    let mut worker = InProcessWorker::start(config, EchoEngine::new(8)).await;
    worker.engine.hold();
    let client = reqwest::Client::new();
    let stream = send_json(
        &client,
        &format!("{}/v1/completions", worker.http),
        &json!({"prompt": "never answered", "stream": true}),
    )
    .await;
    assert_eq!(stream.status(), 200);
    worker.shut_down();

    let body = tokio::time::timeout(Duration::from_secs(5), stream.text())
        .await
        .expect("the stream ends soon after the drain timeout")
        .unwrap();
    let events = sse_data(&body);
    let error: Value = events
        .iter()
        .rev()
        .find_map(|data| serde_json::from_str::<Value>(data).ok())
        .expect("an event before the stream ends");
    assert_eq!(error["error"]["type"], "server_error", "{events:?}");
    assert!(
        error_message(&error).contains("the drain timeout of 200ms passed"),
        "the client is told why: {events:?}"
    );
    let error = worker
        .served(Duration::from_secs(5))
        .await
        .expect_err("serve reports the unanswered request");
    assert!(
        error.to_string().contains("1 requests unanswered"),
        "{error:#}"
    );
}

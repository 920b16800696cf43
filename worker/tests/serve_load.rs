//! Backpressure and drain on the real worker binary: a full queue is refused at once with
//! 429 / RESOURCE_EXHAUSTED, and SIGTERM under load answers every accepted request, refuses
//! new ones, and exits 0.

mod serve_support;

use std::time::Duration;

use npufleet_contract::proto::inference::model_infer_request::InferInputTensor;
use npufleet_contract::proto::inference::{InferTensorContents, ModelInferRequest};
use npufleet_worker::server::oip;
use serde_json::{Value, json};
use serve_support::{MODEL_NAME, Worker, poll_until};

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
    let mut running = client
        .post(&url)
        .json(&long_request(1500))
        .send()
        .await
        .unwrap();
    assert_eq!(running.status(), 200);
    assert!(
        running.chunk().await.unwrap().is_some(),
        "the running request streams"
    );
    let waiting = client
        .post(&url)
        .json(&long_request(4))
        .send()
        .await
        .unwrap();
    assert_eq!(waiting.status(), 200);

    let refused = client
        .post(&url)
        .json(&long_request(4))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["retry-after"], "1");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["type"], "rate_limit_error");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("queue is full")
    );

    let mut grpc = worker.grpc_client().await;
    let status = grpc
        .model_infer(ModelInferRequest {
            model_name: MODEL_NAME.into(),
            inputs: vec![InferInputTensor {
                name: oip::TEXT_INPUT.into(),
                datatype: "BYTES".into(),
                shape: vec![1],
                contents: Some(InferTensorContents {
                    bytes_contents: vec![b"hi".to_vec()],
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        })
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
async fn sigterm_answers_every_accepted_request_then_exits_zero() {
    let mut worker = Worker::start(ONE_AT_A_TIME).await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/completions", worker.http);

    // Eight requests, run one after another, so work is left when the signal comes.
    let mut accepted = Vec::new();
    for _ in 0..8 {
        let response = client
            .post(&url)
            .json(&long_request(300))
            .send()
            .await
            .unwrap();
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
    let refused = client
        .post(&url)
        .json(&long_request(4))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 503);
    let body: Value = refused.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("draining")
    );
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

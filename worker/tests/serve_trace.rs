//! The W3C trace a request arrives with (the router passes one on for every request) names
//! the worker's log lines for it, over the OpenAI HTTP API and the Open Inference Protocol's
//! gRPC; a malformed `traceparent` is ignored, not refused.

mod serve_support;

use std::time::Duration;

use npufleet_contract::headers::TRACEPARENT;
use npufleet_contract::trace::TraceParent;
use npufleet_worker::server::oip;
use serde_json::{Value, json};
use serve_support::{MODEL_NAME, Worker, poll_until};

/// Waits for the line the worker logs when it answers a request to `endpoint`, in the trace
/// `trace_id` (`None`: in no trace).
async fn answered(worker: &Worker, endpoint: &str, trace_id: Option<&str>) -> Value {
    logged(worker, "answered", endpoint, trace_id).await
}

/// Waits for the line `message` about a request to `endpoint` in the trace `trace_id`.
async fn logged(worker: &Worker, message: &str, endpoint: &str, trace_id: Option<&str>) -> Value {
    poll_until(Duration::from_secs(10), "the request's log line", || {
        let line = worker
            .log_lines()
            .iter()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .find(|entry| {
                entry["message"] == message
                    && entry["span"]["endpoint"] == endpoint
                    && entry["span"]["trace_id"].as_str() == trace_id
            });
        async move { line }
    })
    .await
}

#[tokio::test]
async fn each_request_logs_its_answer_in_the_callers_trace() {
    let worker = Worker::start(&[]).await;
    let client = reqwest::Client::new();
    let completion = json!({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4});
    let post = |path: &str, traceparent: String, body: &Value| {
        client
            .post(format!("{}{path}", worker.http))
            .header(TRACEPARENT, traceparent)
            .json(body)
            .send()
    };

    let plain = TraceParent::start(
        0x4bf9_2f35_77b3_4da6_a3ce_929d_0e0e_4736,
        0x00f0_67aa_0ba9_02b7,
    );
    let response = post("/v1/completions", plain.to_string(), &completion)
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let line = answered(&worker, "/v1/completions", Some(&plain.trace_id_hex())).await;
    assert_eq!(line["status"], 200, "{line}");

    // A stream's answer is its headers; its body still arrives whole.
    let streamed = TraceParent::start(
        0x0af7_6519_16cd_43dd_8448_eb21_1c80_319c,
        0xb7ad_6b71_6920_3331,
    );
    let chat = json!({
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "stream": true,
    });
    let response = post("/v1/chat/completions", streamed.to_string(), &chat)
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert!(response.text().await.unwrap().ends_with("data: [DONE]\n\n"));
    answered(
        &worker,
        "/v1/chat/completions",
        Some(&streamed.trace_id_hex()),
    )
    .await;

    // The specification says to ignore a malformed value: the request is served, in no trace.
    let response = post("/v1/completions", "00-not-a-trace".into(), &completion)
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    answered(&worker, "/v1/completions", None).await;

    let traced = TraceParent::start(
        0x1234_5678_9abc_def0_1234_5678_9abc_def0,
        0x0102_0304_0506_0708,
    );
    let mut request = tonic::Request::new(oip::text_request(
        MODEL_NAME,
        b"hello",
        [("max_tokens", oip::int_param(4))],
    ));
    request
        .metadata_mut()
        .insert(TRACEPARENT, traced.to_string().parse().unwrap());
    worker
        .grpc_client()
        .await
        .model_infer(request)
        .await
        .unwrap();
    let line = answered(&worker, "ModelInfer", Some(&traced.trace_id_hex())).await;
    assert_eq!(line["code"], "Ok", "{line}");

    // A stream's requests are answered in the stream's trace.
    let stream_trace = TraceParent::start(
        0x0fed_cba9_8765_4321_0fed_cba9_8765_4321,
        0x0807_0605_0403_0201,
    );
    let one = oip::text_request(MODEL_NAME, b"hello", [("max_tokens", oip::int_param(4))]);
    let mut request = tonic::Request::new(futures::stream::iter([one]));
    request
        .metadata_mut()
        .insert(TRACEPARENT, stream_trace.to_string().parse().unwrap());
    let mut responses = worker
        .grpc_client()
        .await
        .model_stream_infer(request)
        .await
        .unwrap()
        .into_inner();
    while let Some(response) = responses.message().await.unwrap() {
        assert!(response.error_message.is_empty(), "{response:?}");
    }
    logged(
        &worker,
        "stream closed",
        "ModelStreamInfer",
        Some(&stream_trace.trace_id_hex()),
    )
    .await;
}

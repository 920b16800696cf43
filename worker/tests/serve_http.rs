//! The HTTP surface: OpenAI and REST endpoints and the metrics endpoint on the real worker
//! binary; the error paths and the REST protocol's framing in process, in front of an echo
//! engine.

mod serve_support;

use serde_json::{Value, json};
use serve_support::in_process::InProcessWorker;
use serve_support::{
    MODEL_NAME, Worker, error_message, get_json, get_text, post, post_raw, post_stream,
};

#[tokio::test]
async fn openai_endpoints_generate_and_stream() {
    let worker = Worker::start(&[]).await;
    let client = reqwest::Client::new();

    let (status, models) = get_json(&client, &format!("{}/v1/models", worker.http)).await;
    assert_eq!(status, 200);
    assert_eq!(models["data"][0]["id"], MODEL_NAME);

    let (status, completion) = post(
        &client,
        &format!("{}/v1/completions", worker.http),
        json!({"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 8, "temperature": 0}),
    )
    .await;
    assert_eq!(status, 200, "{completion}");
    assert_eq!(completion["object"], "text_completion");
    let usage = &completion["usage"];
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 0);
    let generated = usage["completion_tokens"].as_u64().unwrap();
    assert!((1..=8).contains(&generated), "{completion}");
    let finish = completion["choices"][0]["finish_reason"].as_str().unwrap();
    assert!(
        finish == "length" && generated == 8 || finish == "stop",
        "{completion}"
    );
    let text = completion["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();

    // Streaming the same greedy request gives the same text, chunk by chunk.
    let events = post_stream(
        &client,
        &format!("{}/v1/completions", worker.http),
        &json!({
            "model": MODEL_NAME, "prompt": "hello world", "max_tokens": 8, "temperature": 0,
            "stream": true, "stream_options": {"include_usage": true},
        }),
    )
    .await;
    let chunks: Vec<Value> = events
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, text);
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(
        usage_chunk["usage"]["completion_tokens"].as_u64(),
        Some(generated)
    );

    // Chat: the template is applied and the stream starts with the assistant role.
    let (status, chat) = post(
        &client,
        &format!("{}/v1/chat/completions", worker.http),
        json!({"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
               "max_tokens": 4, "temperature": 0}),
    )
    .await;
    assert_eq!(status, 200, "{chat}");
    assert_eq!(chat["object"], "chat.completion");
    assert_eq!(chat["choices"][0]["message"]["role"], "assistant");
    let events = post_stream(
        &client,
        &format!("{}/v1/chat/completions", worker.http),
        &json!({"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4, "temperature": 0, "stream": true}),
    )
    .await;
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = events
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(
        streamed,
        chat["choices"][0]["message"]["content"].as_str().unwrap()
    );
}

#[tokio::test]
async fn bad_requests_get_clear_errors() {
    let worker = InProcessWorker::with(|config| config.max_body_bytes = 65536).await;
    let client = reqwest::Client::new();
    let completions = format!("{}/v1/completions", worker.http);

    let (status, body) = post_raw(&client, &completions, "{\"prompt\": ").await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(error_message(&body).contains("not valid JSON"));

    let (status, body) = post_raw(
        &client,
        &completions,
        b"{\"prompt\": \"\xff\xfe\"}".to_vec(),
    )
    .await;
    assert_eq!(status, 400);
    assert!(error_message(&body).contains("invalid unicode"), "{body}");

    let (status, body) = post(
        &client,
        &completions,
        json!({"model": "gpt-4", "prompt": "x"}),
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["code"], "model_not_found");
    assert!(error_message(&body).contains("gpt-4"));

    let (status, body) = post(&client, &completions, json!({"prompt": "x", "n": 3})).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "n");

    let (status, body) = post(&client, &completions, json!({"prompt": {"a": 1}})).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "prompt");

    let huge = "a".repeat(100_000);
    let (status, body) = post(&client, &completions, json!({"prompt": huge})).await;
    assert_eq!(status, 413);
    assert!(error_message(&body).contains("65536-byte limit"));

    let (status, body) = post(
        &client,
        &format!("{}/v1/chat/completions", worker.http),
        json!({"messages": []}),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "messages");

    let (status, body) = get_json(&client, &format!("{}/v1/nothing", worker.http)).await;
    assert_eq!(status, 404);
    assert!(error_message(&body).contains("/v1/nothing"));
}

#[tokio::test]
async fn rest_protocol_serves_and_validates() {
    let worker = InProcessWorker::with(|_| {}).await;
    let client = reqwest::Client::new();
    let infer = format!("{}/v2/models/{MODEL_NAME}/infer", worker.http);

    for path in ["/v2/health/live", "/v2/health/ready", "/health"] {
        let (status, _) = get_json(&client, &format!("{}{path}", worker.http)).await;
        assert_eq!(status, 200, "{path}");
    }
    let (status, metadata) =
        get_json(&client, &format!("{}/v2/models/{MODEL_NAME}", worker.http)).await;
    assert_eq!(status, 200);
    assert_eq!(metadata["inputs"][0]["name"], "text_input");
    let (status, server) = get_json(&client, &format!("{}/v2", worker.http)).await;
    assert_eq!(status, 200);
    assert_eq!(server["name"], "npufleet-worker");

    let (status, body) = post(
        &client,
        &infer,
        json!({"id": "r1", "parameters": {"max_tokens": 3, "temperature": 0},
               "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["id"], "r1");
    let outputs = body["outputs"].as_array().unwrap();
    assert_eq!(outputs[0]["name"], "text_output");
    assert_eq!(outputs[1]["name"], "output_ids");
    let ids = outputs[1]["data"].as_array().unwrap().len() as u64;
    assert_eq!(body["parameters"]["completion_tokens"].as_u64(), Some(ids));

    let cases = [
        (
            json!({"inputs": [{"name": "text_input", "shape": [1], "datatype": "FP32", "data": [1.0]}]}),
            "datatype BYTES",
        ),
        (
            json!({"inputs": [{"name": "text_input", "shape": [3], "datatype": "BYTES", "data": ["a"]}]}),
            "(3 elements) but carries 1",
        ),
        (
            json!({"inputs": [{"name": "prompt", "shape": [1], "datatype": "BYTES", "data": ["a"]}]}),
            "unknown input 'prompt'",
        ),
        (json!({"inputs": []}), "missing input"),
        (json!({"outputs": []}), "not valid JSON"),
    ];
    for (request, needle) in cases {
        let (status, body) = post(&client, &infer, request).await;
        assert_eq!(status, 400, "{needle}: {body}");
        let message = body["error"].as_str().unwrap();
        assert!(message.contains(needle), "{needle}: {message}");
    }
    let (status, body) = post(
        &client,
        &format!("{}/v2/models/other/infer", worker.http),
        json!({"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["a"]}]}),
    )
    .await;
    assert_eq!(status, 404);
    assert!(body["error"].as_str().unwrap().contains("'other'"));
}

#[tokio::test]
async fn metrics_expose_the_standard_names() {
    let worker = Worker::start(&[]).await;
    let client = reqwest::Client::new();
    let (status, _) = post(
        &client,
        &format!("{}/v1/completions", worker.http),
        json!({"prompt": "hello", "max_tokens": 4}),
    )
    .await;
    assert_eq!(status, 200);
    let text = get_text(&client, &format!("{}/metrics", worker.http)).await;
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:num_preemptions_total",
        "npufleet_steps_interrupted_total",
        "npufleet_batch_size",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "npufleet_warmup_complete",
    ] {
        let line = text
            .lines()
            .find(|line| line.starts_with(name))
            .unwrap_or_else(|| panic!("{name} missing from\n{text}"));
        assert!(
            line.contains(&format!("model_name=\"{MODEL_NAME}\"")),
            "{line}"
        );
    }
    let generated = text
        .lines()
        .find(|l| l.starts_with("vllm:generation_tokens_total"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap();
    assert!(generated >= 1.0, "{text}");
    assert!(text.contains("npufleet_warmup_complete{model_name=\"tiny\"} 1"));
}

//! The gRPC surface: the Open Inference Protocol (unary and streaming, both tensor
//! encodings), health and the load service on the real worker binary; the error statuses
//! in process, in front of an echo engine.

mod serve_support;

use std::time::Duration;

use npufleet_contract::proto::inference::infer_parameter::ParameterChoice;
use npufleet_contract::proto::inference::*;
use npufleet_contract::proto::npufleet::v1::worker_load_client::WorkerLoadClient;
use npufleet_contract::proto::npufleet::v1::{GetLoadRequest, WatchLoadRequest, WorkerState};
use npufleet_worker::server::oip::{self, join_raw_bytes, split_raw_bytes};
use serve_support::in_process::InProcessWorker;
use serve_support::{MODEL_NAME, Worker, poll_until};
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

fn text_request(text: &[u8], max_tokens: i64) -> ModelInferRequest {
    let mut request = oip::text_request(
        MODEL_NAME,
        text,
        [
            ("max_tokens", oip::int_param(max_tokens)),
            ("temperature", oip::int_param(0)),
        ],
    );
    request.id = "req-1".into();
    request
}

fn output_index(response: &ModelInferResponse, name: &str) -> usize {
    response
        .outputs
        .iter()
        .position(|o| o.name == name)
        .unwrap_or_else(|| panic!("no output {name}"))
}

fn output<'a>(response: &'a ModelInferResponse, name: &str) -> (usize, &'a InferTensorContents) {
    let index = output_index(response, name);
    let contents = response.outputs[index].contents.as_ref();
    (
        index,
        contents.unwrap_or_else(|| panic!("output {name} has no contents")),
    )
}

#[tokio::test]
async fn infer_unary_and_streaming_agree() {
    let worker = Worker::start(&[]).await;
    let mut client = worker.grpc_client().await;

    assert!(
        client
            .server_live(ServerLiveRequest {})
            .await
            .unwrap()
            .get_ref()
            .live
    );
    assert!(
        client
            .server_ready(ServerReadyRequest {})
            .await
            .unwrap()
            .get_ref()
            .ready
    );
    let ready = client
        .model_ready(ModelReadyRequest {
            name: MODEL_NAME.into(),
            version: String::new(),
        })
        .await
        .unwrap();
    assert!(ready.get_ref().ready);
    let metadata = client
        .model_metadata(ModelMetadataRequest {
            name: MODEL_NAME.into(),
            version: "1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(metadata.inputs[0].name, "text_input");
    assert_eq!(metadata.outputs[0].datatype, "BYTES");
    let server = client
        .server_metadata(ServerMetadataRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(server.name, "npufleet-worker");

    let unary = client
        .model_infer(text_request(b"hello world", 12))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(unary.id, "req-1");
    let (_, text) = output(&unary, "text_output");
    let text = String::from_utf8(text.bytes_contents[0].clone()).unwrap();
    let (_, ids) = output(&unary, "output_ids");
    let ids = ids.int64_contents.clone();
    assert!(!ids.is_empty() && ids.len() <= 12);

    // The raw encoding gives the same answer, returned raw.
    let mut raw = text_request(b"", 12);
    raw.inputs[0].contents = None;
    raw.raw_input_contents = vec![join_raw_bytes([b"hello world".as_slice()])];
    let raw_response = client.model_infer(raw).await.unwrap().into_inner();
    assert!(raw_response.outputs.iter().all(|o| o.contents.is_none()));
    let index = output_index(&raw_response, "text_output");
    let raw_text = split_raw_bytes(&raw_response.raw_output_contents[index]).unwrap();
    assert_eq!(raw_text, vec![text.as_bytes()]);

    // Streaming: one response per chunk, then a final one flagged as such.
    let mut stream = client
        .model_stream_infer(tokio_stream::iter([text_request(b"hello world", 12)]))
        .await
        .unwrap()
        .into_inner();
    let mut streamed_text = String::new();
    let mut streamed_ids = Vec::new();
    let mut responses = 0;
    loop {
        let message = stream.message().await.unwrap().expect("a final response");
        assert!(
            message.error_message.is_empty(),
            "{}",
            message.error_message
        );
        let response = message.infer_response.unwrap();
        responses += 1;
        let (_, chunk) = output(&response, "text_output");
        streamed_text.push_str(std::str::from_utf8(&chunk.bytes_contents[0]).unwrap());
        streamed_ids.extend(
            output(&response, "output_ids")
                .1
                .int64_contents
                .iter()
                .copied(),
        );
        let final_flag = response.parameters.get("triton_final_response").cloned();
        if final_flag.and_then(|p| p.parameter_choice) == Some(ParameterChoice::BoolParam(true)) {
            assert!(response.parameters.contains_key("finish_reason"));
            break;
        }
    }
    assert_eq!(streamed_text, text);
    assert_eq!(streamed_ids, ids);
    assert!(
        responses >= 2,
        "expected chunked responses, got {responses}"
    );
}

#[tokio::test]
async fn bad_requests_get_the_right_status() {
    let worker = InProcessWorker::with(|_| {}).await;
    let mut client = worker.grpc_client().await;

    let mut mixed = text_request(b"hi", 2);
    mixed.raw_input_contents = vec![join_raw_bytes([b"hi".as_slice()])];
    let mut wrong_type = text_request(b"hi", 2);
    wrong_type.inputs[0].datatype = "INT32".into();
    let mut wrong_shape = text_request(b"hi", 2);
    wrong_shape.inputs[0].shape = vec![1, 2];
    let mut missing = text_request(b"hi", 2);
    missing.inputs.clear();
    let mut unknown_model = text_request(b"hi", 2);
    unknown_model.model_name = "missing-model".into();
    let cases = [
        (mixed, Code::InvalidArgument, "one encoding"),
        (wrong_type, Code::InvalidArgument, "datatype BYTES"),
        (wrong_shape, Code::InvalidArgument, "(2 elements)"),
        (missing, Code::InvalidArgument, "missing input"),
        (
            text_request(&[0xc3, 0x28], 2),
            Code::InvalidArgument,
            "not valid UTF-8",
        ),
        (unknown_model, Code::NotFound, "missing-model"),
    ];
    for (request, code, needle) in cases {
        let status = client.model_infer(request).await.unwrap_err();
        assert_eq!(status.code(), code, "{needle}: {status:?}");
        assert!(
            status.message().contains(needle),
            "{needle}: {}",
            status.message()
        );
    }

    // In a stream, errors arrive as messages and the stream carries on.
    let mut bad = text_request(b"hi", 2);
    bad.inputs[0].datatype = "FP32".into();
    let mut stream = client
        .model_stream_infer(tokio_stream::iter([bad]))
        .await
        .unwrap()
        .into_inner();
    let message = stream.message().await.unwrap().unwrap();
    assert!(
        message.error_message.starts_with("INVALID_ARGUMENT:"),
        "{}",
        message.error_message
    );
}

#[tokio::test]
async fn health_and_load_follow_the_engine() {
    let worker = Worker::start(&[
        "--max-batch-size",
        "7",
        "--queue-limit",
        "9",
        "--long-prefill-token-threshold",
        "48",
    ])
    .await;
    let channel = tonic::transport::Channel::from_shared(worker.grpc.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    // Health follows readiness on a short period, so it may trail it briefly.
    let health = HealthClient::new(channel.clone());
    for service in ["", "inference.GRPCInferenceService"] {
        poll_until(Duration::from_secs(5), "health SERVING", || {
            let mut health = health.clone();
            async move {
                let response = health
                    .check(HealthCheckRequest {
                        service: service.into(),
                    })
                    .await
                    .unwrap();
                (response.get_ref().status() == ServingStatus::Serving).then_some(())
            }
        })
        .await;
    }
    // Reflection lists every service, so tools like grpcurl need no proto files.
    let mut reflection = ServerReflectionClient::new(channel.clone());
    let mut replies = reflection
        .server_reflection_info(tokio_stream::iter([ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        }]))
        .await
        .unwrap()
        .into_inner();
    let reply = replies.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = reply.message_response else {
        panic!("unexpected reflection reply {reply:?}");
    };
    let names: Vec<&str> = list.service.iter().map(|s| s.name.as_str()).collect();
    for service in [
        "inference.GRPCInferenceService",
        "npufleet.v1.WorkerLoad",
        "grpc.health.v1.Health",
    ] {
        assert!(names.contains(&service), "{service} not in {names:?}");
    }

    let mut load = WorkerLoadClient::new(channel);
    let report = load.get_load(GetLoadRequest {}).await.unwrap().into_inner();
    assert_eq!(report.state(), WorkerState::Ready);
    assert_eq!(report.max_batch_size, 7);
    assert_eq!(report.prompt_chunk_tokens, 48);
    assert_eq!(report.queue_limit, 9);
    assert_eq!(report.model_name, MODEL_NAME);
    assert_eq!((report.warmup_done, report.warmup_total), (2, 2));
    let first_tokens = |r: &npufleet_contract::proto::npufleet::v1::LoadReport| {
        r.time_to_first_token.as_ref().map(|h| h.count)
    };
    assert_eq!(
        first_tokens(&report),
        Some(0),
        "warm-up counts no first token"
    );
    // A served request's first token reaches the report the autoscaler calibrates from.
    worker
        .grpc_client()
        .await
        .model_infer(text_request(b"Name a river.", 4))
        .await
        .unwrap();
    let report = load.get_load(GetLoadRequest {}).await.unwrap().into_inner();
    assert_eq!(first_tokens(&report), Some(1));

    let mut watch = load
        .watch_load(WatchLoadRequest { interval_ms: 100 })
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap();
    let second = watch.message().await.unwrap().unwrap();
    assert!(second.timestamp_unix_ms > first.timestamp_unix_ms);
}

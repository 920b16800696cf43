//! The optional API key on the real worker binary, set as the operator sets it (the
//! `NPUFLEET_API_KEY` environment variable): the OpenAI and inference endpoints over HTTP and
//! gRPC refuse a missing or wrong key and serve the right one; probes and metrics stay open;
//! neither the key nor prompts reach the log.

mod serve_support;

use npufleet_contract::auth::INVALID_API_KEY_CODE;
use npufleet_contract::env;
use npufleet_contract::proto::inference::*;
use npufleet_worker::server::oip;
use serde_json::{Value, json};
use serve_support::{MODEL_NAME, Worker, test_model};
use tonic::Code;
use tonic::metadata::MetadataValue;

const KEY: &str = "sk-test-4f9c2e";
/// A prompt no log line may contain.
const PROMPT: &str = "the quartz canary sings";

fn infer_request() -> ModelInferRequest {
    oip::text_request(
        MODEL_NAME,
        PROMPT.as_bytes(),
        [("max_tokens", oip::int_param(4))],
    )
}

fn with_authorization<T>(message: T, authorization: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(value) = authorization {
        let value: MetadataValue<_> = value.parse().unwrap();
        request.metadata_mut().insert("authorization", value);
    }
    request
}

#[tokio::test]
async fn the_api_key_guards_inference_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let model = test_model(dir.path());
    let worker = Worker::spawn_model(&model, &[], &[(env::API_KEY.into(), KEY.into())]);
    worker.wait_ready().await;
    let client = reqwest::Client::new();
    let right = format!("Bearer {KEY}");
    let wrong = format!("Bearer {KEY}x");

    let completion = json!({"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4});
    let chat = json!({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4});
    let rest = json!({"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [PROMPT]}]});
    let routes = [
        ("POST", "/v1/completions", completion),
        ("POST", "/v1/chat/completions", chat),
        ("GET", "/v1/models", Value::Null),
        ("POST", &format!("/v2/models/{MODEL_NAME}/infer"), rest),
    ];
    for (method, path, body) in &routes {
        for authorization in [None, Some(wrong.as_str()), Some(right.as_str())] {
            let url = format!("{}{path}", worker.http);
            let mut request = match *method {
                "POST" => client.post(&url).json(body),
                _ => client.get(&url),
            };
            if let Some(value) = authorization {
                request = request.header("authorization", value);
            }
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            let answer: Value = response.json().await.unwrap();
            if authorization == Some(right.as_str()) {
                assert_eq!(status, 200, "{method} {path} with the key: {answer}");
            } else {
                assert_eq!(
                    status, 401,
                    "{method} {path} with {authorization:?}: {answer}"
                );
                assert_eq!(answer["error"]["code"], INVALID_API_KEY_CODE, "{answer}");
                assert_eq!(answer["error"]["type"], "invalid_request_error");
                assert!(!answer.to_string().contains(KEY), "{answer}");
            }
        }
    }
    for open in [
        "/v2/health/ready",
        "/v2/health/live",
        "/health",
        "/metrics",
        "/v2",
    ] {
        let response = client
            .get(format!("{}{open}", worker.http))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 200, "{open} without a key");
    }

    let mut grpc = worker.grpc_client().await;
    for authorization in [None, Some(wrong.as_str())] {
        let status = grpc
            .model_infer(with_authorization(infer_request(), authorization))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
        let status = grpc
            .model_stream_infer(with_authorization(
                tokio_stream::iter([infer_request()]),
                authorization,
            ))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    }
    grpc.model_infer(with_authorization(infer_request(), Some(&right)))
        .await
        .expect("ModelInfer with the key");
    let ready = grpc
        .server_ready(ServerReadyRequest {})
        .await
        .expect("ServerReady needs no key");
    assert!(ready.into_inner().ready);

    let log = worker.log();
    assert!(!log.contains(KEY), "the key is in the log:\n{log}");
    assert!(!log.contains(PROMPT), "a prompt is in the log:\n{log}");
}

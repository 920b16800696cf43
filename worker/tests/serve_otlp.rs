//! With a collector named in OpenTelemetry's standard environment, each request's span is
//! exported over OTLP in the caller's trace: the trace id of its `traceparent`, the caller's
//! span as its parent, the worker as its service.

mod serve_support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use npufleet_contract::headers::TRACEPARENT;
use npufleet_contract::trace::TraceParent;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message;
use serde_json::json;
use serve_support::{MODEL_NAME, Worker, poll_until, test_model};

/// A span as the collector received it, with the name of the service that sent it.
#[derive(Clone, Debug)]
struct Received {
    service: String,
    name: String,
    trace_id: Vec<u8>,
    parent_span_id: Vec<u8>,
}

type Spans = Arc<Mutex<Vec<Received>>>;

/// OTLP/HTTP's trace endpoint: the body is an `ExportTraceServiceRequest` in protobuf, and an
/// empty protobuf message (no bytes) is its successful answer.
async fn receive(State(spans): State<Spans>, body: Bytes) -> &'static [u8] {
    let request = ExportTraceServiceRequest::decode(body).expect("an OTLP trace export");
    for resource_spans in request.resource_spans {
        let service = resource_spans
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|a| a.key == "service.name")
            .and_then(|a| match a.value.as_ref()?.value.as_ref()? {
                AnyValue::StringValue(name) => Some(name.clone()),
                _ => None,
            })
            .unwrap_or_default();
        for span in resource_spans.scope_spans.into_iter().flat_map(|s| s.spans) {
            spans.lock().unwrap().push(Received {
                service: service.clone(),
                name: span.name,
                trace_id: span.trace_id,
                parent_span_id: span.parent_span_id,
            });
        }
    }
    &[]
}

#[tokio::test]
async fn a_requests_span_is_exported_in_the_callers_trace() {
    let spans = Spans::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let collector = format!("http://{}", listener.local_addr().unwrap());
    let app = Router::new()
        .route("/v1/traces", post(receive))
        .with_state(spans.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });

    let dir = tempfile::tempdir().unwrap();
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", collector.as_str()),
        // Export within a tenth of a second instead of OpenTelemetry's default five.
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ]
    .map(|(k, v)| (k.to_string(), v.to_string()));
    let worker = Worker::spawn_model(&test_model(dir.path()), &[], &env);
    worker.wait_ready().await;

    let caller = TraceParent::start(
        0x4bf9_2f35_77b3_4da6_a3ce_929d_0e0e_4736,
        0x00f0_67aa_0ba9_02b7,
    );
    let response = reqwest::Client::new()
        .post(format!("{}/v1/completions", worker.http))
        .header(TRACEPARENT, caller.to_string())
        .json(&json!({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);

    let span = poll_until(
        Duration::from_secs(20),
        "the request's span at the collector",
        || {
            let found = spans
                .lock()
                .unwrap()
                .iter()
                .find(|s| s.trace_id == caller.trace_id.to_be_bytes())
                .cloned();
            async move { found }
        },
    )
    .await;
    assert_eq!(span.name, "request", "{span:?}");
    assert_eq!(
        span.parent_span_id,
        caller.parent_id.to_be_bytes(),
        "{span:?}"
    );
    assert_eq!(span.service, "npufleet-worker", "{span:?}");
}

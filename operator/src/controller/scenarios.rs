//! The reconcile's reads and writes against a mock apiserver, in the manner of kube-rs'
//! `controller-rs` fixtures: the client's HTTP service is a [`tower_test`] mock, and the test
//! answers each request and keeps it to assert on. The cache starts empty, so these are the
//! writes of a first reconcile; what the plan decides is unit-tested in `reconcile::tests`, and
//! the real apiserver tests run the whole controller.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use k8s_openapi::jiff::Timestamp;
use kube::client::Body;
use kube::runtime::controller::Action;
use kube::{Client, Resource};
use npufleet_crds::{InferenceService, InferenceServiceSpec};
use serde_json::{Value, json};

use super::{Context, Error, reconcile};
use crate::labels::FIELD_MANAGER;
use crate::metrics::Metrics;
use crate::reconcile::CREATING_GROUP;
use crate::settings::Settings;
use crate::status;

/// A request the reconcile made.
#[derive(Debug)]
struct Call {
    method: Method,
    path: String,
    query: String,
    content_type: String,
    body: Value,
}

impl Call {
    /// The field manager of a server-side apply, with `force` set (the operator owns its
    /// fields outright), or `None` for any other request.
    fn apply_manager(&self) -> Option<&str> {
        let forced = self.query.split('&').any(|p| p == "force=true");
        (self.method == Method::PATCH
            && self.content_type == "application/apply-patch+yaml"
            && forced)
            .then(|| {
                self.query
                    .split('&')
                    .find_map(|p| p.strip_prefix("fieldManager="))
            })
            .flatten()
    }

    fn kind(&self) -> &str {
        self.body["kind"].as_str().unwrap_or_default()
    }
}

/// The apiserver's answer to a request: `Ok` echoes the object as applied or created.
type Answer = Result<(), (StatusCode, &'static str)>;

/// A service named `llm` in namespace `ns` asking for `replicas` CPU replicas.
fn service(replicas: i32) -> InferenceService {
    let spec: InferenceServiceSpec = serde_json::from_value(json!({
        "model": {"name": "m", "source": {"imagePath": "/models/m.gguf"}},
        "replicas": replicas,
        "accelerator": {"type": "cpu"},
    }))
    .unwrap();
    let mut isvc = InferenceService::new("llm", spec);
    isvc.metadata.namespace = Some("ns".into());
    isvc.metadata.uid = Some("uid-1".into());
    isvc.metadata.generation = Some(1);
    isvc
}

/// Runs one reconcile of `isvc` against a mock apiserver that answers each request with
/// `answer`, and returns its result with the requests it made, in order.
async fn reconcile_once(
    isvc: InferenceService,
    settings: Settings,
    answer: impl Fn(&Call) -> Answer + Send + 'static,
) -> (Result<Action, Error>, Vec<Call>) {
    reconcile_rounds(isvc, settings, answer, 1)
        .await
        .pop()
        .expect("one round")
}

/// Runs `rounds` reconciles of `isvc` in a row with one context, against a mock apiserver that
/// answers each request with `answer` (a pod is answered with a UID, as created); returns each
/// round's result and requests. The cache is never started: the store never shows a write.
async fn reconcile_rounds(
    isvc: InferenceService,
    settings: Settings,
    answer: impl Fn(&Call) -> Answer + Send + 'static,
    rounds: usize,
) -> Vec<(Result<Action, Error>, Vec<Call>)> {
    let (mock, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let calls = Arc::new(Mutex::new(Vec::new()));
    let live = serde_json::to_value(&isvc).unwrap();
    let apiserver = {
        let calls = calls.clone();
        async move {
            while let Some((request, send)) = handle.next_request().await {
                let (parts, body) = request.into_parts();
                let bytes = body.collect_bytes().await.unwrap();
                let call = Call {
                    method: parts.method,
                    path: parts.uri.path().to_string(),
                    query: parts.uri.query().unwrap_or_default().to_string(),
                    content_type: parts
                        .headers
                        .get(http::header::CONTENT_TYPE)
                        .map(|v| v.to_str().unwrap().to_string())
                        .unwrap_or_default(),
                    body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
                };
                let (code, reply) = match answer(&call) {
                    // A status write answers with the whole service, as the apiserver does.
                    Ok(()) if call.path.ends_with("/status") => {
                        let mut reply = live.clone();
                        reply["status"] = call.body["status"].clone();
                        (StatusCode::OK, reply)
                    }
                    Ok(()) if call.kind() == "Pod" => {
                        let mut reply = call.body.clone();
                        let uid = format!("uid-{}", reply["metadata"]["name"].as_str().unwrap());
                        reply["metadata"]["uid"] = json!(uid);
                        (StatusCode::OK, reply)
                    }
                    Ok(()) => (StatusCode::OK, call.body.clone()),
                    Err((code, message)) => (
                        code,
                        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                               "message": message, "reason": "Forbidden", "code": code.as_u16()}),
                    ),
                };
                calls.lock().unwrap().push(call);
                let response = Response::builder()
                    .status(code)
                    .body(Body::from(serde_json::to_vec(&reply).unwrap()))
                    .unwrap();
                send.send_response(response);
            }
        }
    };
    let server = tokio::spawn(apiserver);
    let client = Client::new(mock, "default");
    let ctx = Arc::new(Context::new(
        client,
        settings,
        Metrics::new().unwrap(),
        None,
    ));
    let isvc = Arc::new(isvc);
    let mut done = Vec::new();
    for _ in 0..rounds {
        let result = tokio::time::timeout(
            Duration::from_secs(10),
            reconcile(isvc.clone(), ctx.clone()),
        )
        .await
        .expect("the reconcile finishes against the mock apiserver");
        done.push((result, std::mem::take(&mut *calls.lock().unwrap())));
    }
    server.abort();
    done
}

/// The status a reconcile wrote under the operator's field manager.
fn written_status(calls: &[Call]) -> &Value {
    let writes: Vec<&Call> = calls
        .iter()
        .filter(|c| {
            c.path == "/apis/npufleet.io/v1alpha1/namespaces/ns/inferenceservices/llm/status"
        })
        .collect();
    assert_eq!(writes.len(), 1, "one status write: {calls:#?}");
    assert_eq!(writes[0].apply_manager(), Some(FIELD_MANAGER));
    &writes[0].body["status"]
}

fn condition<'a>(status: &'a Value, type_: &str) -> &'a Value {
    status["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == type_)
        .unwrap_or_else(|| panic!("no {type_} condition in {status}"))
}

/// The events a reconcile recorded, as (type, reason, note).
fn events(calls: &[Call]) -> Vec<(&str, &str, &str)> {
    calls
        .iter()
        .filter(|c| {
            c.method == Method::POST && c.path == "/apis/events.k8s.io/v1/namespaces/ns/events"
        })
        .map(|c| {
            let field = |name: &str| c.body[name].as_str().unwrap_or_default();
            (field("type"), field("reason"), field("note"))
        })
        .collect()
}

#[tokio::test]
async fn a_new_service_is_applied_whole_then_its_status_and_events_written() {
    let (result, calls) = reconcile_once(service(2), Settings::default(), |_| Ok(())).await;
    result.unwrap();
    let applied: Vec<(&str, &str)> = calls
        .iter()
        .filter(|c| c.apply_manager() == Some(FIELD_MANAGER) && !c.path.ends_with("/status"))
        .map(|c| (c.kind(), c.body["metadata"]["name"].as_str().unwrap()))
        .collect();
    let kinds: Vec<&str> = applied.iter().map(|(kind, _)| *kind).collect();
    // The objects around the pods come first, so no pod runs without its Service or budget.
    let first_pod = kinds.iter().position(|k| *k == "Pod").unwrap();
    assert!(kinds[..first_pod].contains(&"Service"), "{applied:?}");
    assert!(
        kinds[..first_pod].contains(&"PodDisruptionBudget"),
        "{applied:?}"
    );
    assert!(
        kinds[first_pod..].iter().all(|k| *k == "Pod"),
        "{applied:?}"
    );
    assert_eq!(kinds.len() - first_pod, 2, "a pod per replica: {applied:?}");
    for call in calls.iter().filter(|c| c.kind() == "Pod") {
        assert_eq!(
            call.path,
            format!(
                "/api/v1/namespaces/ns/pods/{}",
                call.body["metadata"]["name"].as_str().unwrap()
            )
        );
        let owner = &call.body["metadata"]["ownerReferences"][0];
        assert_eq!(
            (owner["uid"].as_str(), owner["controller"].as_bool()),
            (Some("uid-1"), Some(true))
        );
    }
    let status = written_status(&calls);
    assert_eq!(status["observedGeneration"], 1);
    assert_eq!(condition(status, status::READY)["status"], "False");
    assert_eq!(condition(status, status::PROGRESSING)["status"], "True");
    let events = events(&calls);
    assert!(
        events
            .iter()
            .any(|(type_, reason, _)| *type_ == "Normal" && *reason == CREATING_GROUP),
        "{events:?}"
    );
    assert!(
        events.iter().all(|(type_, ..)| *type_ == "Normal"),
        "{events:?}"
    );
    // The status and the events follow every object write.
    let last_object = calls.iter().rposition(|c| c.kind() == "Pod").unwrap();
    assert!(
        calls[..last_object]
            .iter()
            .all(|c| !c.path.ends_with("/status") && c.method != Method::POST)
    );
}

#[tokio::test]
async fn a_service_beyond_the_pod_limit_warns_and_says_so_in_status() {
    let settings = Settings {
        max_pods_per_service: 3,
        ..Settings::default()
    };
    let (result, calls) = reconcile_once(service(5), settings, |_| Ok(())).await;
    result.unwrap();
    assert_eq!(
        calls.iter().filter(|c| c.kind() == "Pod").count(),
        3,
        "{calls:#?}"
    );
    let failure = condition(written_status(&calls), status::REPLICA_FAILURE);
    assert_eq!(
        (&failure["status"], &failure["reason"]),
        (&json!("True"), &json!(status::POD_LIMIT_EXCEEDED))
    );
    assert!(
        failure["message"]
            .as_str()
            .unwrap()
            .contains("--max-pods-per-service"),
        "{failure}"
    );
    let warnings: Vec<_> = events(&calls)
        .into_iter()
        .filter(|(type_, ..)| *type_ == "Warning")
        .collect();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert_eq!(warnings[0].1, status::POD_LIMIT_EXCEEDED);
    assert_eq!(warnings[0].2, failure["message"].as_str().unwrap());
}

#[tokio::test]
async fn a_refused_pod_is_a_warning_a_status_condition_and_a_failed_reconcile() {
    const QUOTA: &str = "exceeded quota: compute, requested: pods=1, used: pods=4, limited: pods=4";
    let (result, calls) = reconcile_once(service(1), Settings::default(), |call| {
        if call.kind() == "Pod" && call.method == Method::PATCH {
            Err((StatusCode::FORBIDDEN, QUOTA))
        } else {
            Ok(())
        }
    })
    .await;
    let Err(Error::Refused {
        count: 1,
        first,
        transient: false,
    }) = result
    else {
        panic!("a refused write fails the reconcile, to be retried: {result:?}");
    };
    assert!(first.contains(QUOTA), "{first}");
    let failure = condition(written_status(&calls), status::REPLICA_FAILURE);
    assert_eq!(
        (&failure["status"], &failure["reason"]),
        (&json!("True"), &json!("FailedCreate"))
    );
    assert!(
        failure["message"].as_str().unwrap().contains(QUOTA),
        "{failure}"
    );
    let events = events(&calls);
    // The refusal stands in for the note that the group is being created.
    assert!(
        events
            .iter()
            .all(|(_, reason, _)| *reason != CREATING_GROUP),
        "{events:?}"
    );
    let refusals: Vec<_> = events
        .iter()
        .filter(|(type_, ..)| *type_ == "Warning")
        .collect();
    assert_eq!(refusals.len(), 1, "{events:?}");
    assert_eq!(refusals[0].1, "FailedCreate");
    assert!(refusals[0].2.contains(QUOTA), "{events:?}");
}

#[tokio::test]
async fn a_service_being_deleted_is_left_to_garbage_collection() {
    let mut isvc = service(2);
    isvc.meta_mut().deletion_timestamp = Some(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::now()),
    );
    let (result, calls) = reconcile_once(isvc, Settings::default(), |_| Ok(())).await;
    result.unwrap();
    // No finalizer to remove and nothing to make: its children go with it by owner reference.
    assert!(calls.is_empty(), "{calls:#?}");
}

#[tokio::test]
async fn pods_created_count_as_there_before_the_watch_shows_them() {
    // A group's ranks are created one request after another and reach the store one watch
    // event after another: a reconcile in between must neither make the group again nor take
    // it for one that lost a rank (and delete it).
    let mut isvc = service(1);
    isvc.spec = serde_json::from_value(json!({
        "model": {"name": "m", "source": {"imagePath": "/models/m.gguf"}},
        "replicas": 1,
        "accelerator": {"type": "ascend910", "devicesPerPod": 1},
        "parallelism": {"tensor": 2},
    }))
    .unwrap();
    let rounds = reconcile_rounds(isvc, Settings::default(), |_| Ok(()), 2).await;
    let pod_writes = |calls: &[Call]| -> Vec<String> {
        calls
            .iter()
            .filter(|c| c.path.starts_with("/api/v1/namespaces/ns/pods"))
            .map(|c| format!("{} {}", c.method, c.path))
            .collect()
    };
    let (first, first_calls) = &rounds[0];
    assert!(first.is_ok(), "{first:?}");
    assert_eq!(
        pod_writes(first_calls).len(),
        2,
        "both ranks created: {first_calls:#?}"
    );
    let (second, second_calls) = &rounds[1];
    assert!(second.is_ok(), "{second:?}");
    assert_eq!(pod_writes(second_calls), Vec::<String>::new());
}

//! The operator's own `external.metrics.k8s.io/v1beta1` server, so that a standard
//! `autoscaling/v2` HorizontalPodAutoscaler can scale an `InferenceService` on the queue
//! depth the autoscaler reads from the workers, with no Prometheus in between. The chart
//! registers it with an `APIService`; kube-apiserver proxies HPA queries here over HTTPS,
//! and only kube-apiserver gets an answer ([`tls`]).

pub mod tls;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use axum::extract::{Path, Query, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Router};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::core::{Expression, Selector, SelectorExt};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use tls::{ClientAuth, Denied};

pub const GROUP: &str = "external.metrics.k8s.io";
pub const VERSION: &str = "v1beta1";
pub const GROUP_VERSION: &str = "external.metrics.k8s.io/v1beta1";

/// Waiting + running requests summed over a service's ready replica groups. An HPA with an
/// `AverageValue` target of `targetQueueDepth` asks for `ceil(sum / target)` groups.
pub const QUEUE_DEPTH: &str = "npufleet_queue_depth";
/// KV-cache use (0..=1 per group) summed over a service's ready replica groups.
pub const KV_CACHE_USAGE: &str = "npufleet_kv_cache_usage";
/// With `spec.autoscaling.objectives` and `mode: hpa`: the fewest replica groups predicted to
/// meet the objectives. An HPA with an `AverageValue` target of 1 asks for exactly that many.
pub const OBJECTIVE_REPLICAS: &str = "npufleet_objective_replicas";
pub const METRICS: [&str; 3] = [QUEUE_DEPTH, KV_CACHE_USAGE, OBJECTIVE_REPLICAS];

/// Every service's metric labels carry its name under this key, so an HPA can select one
/// service with `matchLabels`. It is also a valid Prometheus label name, so the same HPA
/// works unchanged when a prometheus-adapter serves the metric instead.
pub const SERVICE_LABEL: &str = "inference_service";

/// Readings older than this are refused: an HPA then holds its count instead of acting on
/// a fleet the autoscaler no longer sees.
pub const MAX_AGE: Duration = Duration::from_secs(15);

/// One service's latest load, as the autoscaler read it.
#[derive(Clone, Debug, PartialEq)]
pub struct ServiceLoad {
    pub queue_depth: u32,
    pub kv_cache_usage: f64,
    /// The replica groups the latency objectives ask for, or why there is no such count.
    pub objective_replicas: Result<u32, String>,
}

#[derive(Clone, Debug)]
struct Entry {
    labels: BTreeMap<String, String>,
    /// The load, or why it is not known.
    load: Result<ServiceLoad, String>,
    read_at: Instant,
    timestamp: Time,
}

/// The latest load per `InferenceService`, shared between the autoscaler (writer) and the
/// metrics server (reader).
#[derive(Clone, Debug, Default)]
pub struct MetricsStore {
    entries: Arc<RwLock<BTreeMap<(String, String), Entry>>>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum QueryError {
    #[error(
        "external metric {0:?} is not served here; known metrics: npufleet_queue_depth, npufleet_kv_cache_usage, npufleet_objective_replicas"
    )]
    UnknownMetric(String),
    #[error("invalid labelSelector {selector:?}: {problem}")]
    Selector { selector: String, problem: String },
    /// A selected service's load is not known. Answering without it would read as no load:
    /// an error makes an HPA hold its count and say why (`ScalingActive=False`,
    /// `FailedGetExternalMetric`), as it does for any metric it cannot get.
    #[error("the load of InferenceService {namespace}/{name} is not known: {why}")]
    Unknown {
        namespace: String,
        name: String,
        why: String,
    },
}

impl MetricsStore {
    /// Records a service's load; `labels` are the service's own labels.
    pub fn update(
        &self,
        namespace: &str,
        name: &str,
        labels: &BTreeMap<String, String>,
        load: ServiceLoad,
    ) {
        self.record(namespace, name, labels, Ok(load));
    }

    /// Records that a service's load is not known, and why: queries that select it fail
    /// with that reason until its load is read again.
    pub fn withhold(
        &self,
        namespace: &str,
        name: &str,
        labels: &BTreeMap<String, String>,
        why: String,
    ) {
        self.record(namespace, name, labels, Err(why));
    }

    fn record(
        &self,
        namespace: &str,
        name: &str,
        labels: &BTreeMap<String, String>,
        load: Result<ServiceLoad, String>,
    ) {
        let mut labels = labels.clone();
        labels.insert(SERVICE_LABEL.to_owned(), name.to_owned());
        let entry = Entry {
            labels,
            load,
            read_at: Instant::now(),
            timestamp: Time(k8s_openapi::jiff::Timestamp::now()),
        };
        self.write()
            .insert((namespace.to_owned(), name.to_owned()), entry);
    }

    /// Keeps only the services for which `keep(namespace, name)` holds.
    pub fn retain(&self, keep: impl Fn(&str, &str) -> bool) {
        self.write()
            .retain(|(namespace, name), _| keep(namespace, name));
    }

    /// The `ExternalMetricValueList` items for `metric` over the services in `namespace`
    /// that `selector` (Kubernetes label-selector syntax) matches.
    pub fn query(
        &self,
        namespace: &str,
        metric: &str,
        selector: &str,
    ) -> Result<Vec<Value>, QueryError> {
        let metric = metric.to_ascii_lowercase();
        if !METRICS.contains(&metric.as_str()) {
            return Err(QueryError::UnknownMetric(metric));
        }
        let parsed = parse_selector(selector).map_err(|problem| QueryError::Selector {
            selector: selector.to_owned(),
            problem,
        })?;
        let entries = self.entries.read().unwrap_or_else(|e| e.into_inner());
        entries
            .iter()
            .filter(|((ns, _), entry)| ns == namespace && parsed.matches(&entry.labels))
            .map(|((namespace, name), entry)| {
                let unknown = |why: String| QueryError::Unknown {
                    namespace: namespace.clone(),
                    name: name.clone(),
                    why,
                };
                let age = entry.read_at.elapsed();
                if age > MAX_AGE {
                    return Err(unknown(format!(
                        "last read {} s ago, more than {} s",
                        age.as_secs(),
                        MAX_AGE.as_secs()
                    )));
                }
                let load = entry.load.as_ref().map_err(|why| unknown(why.clone()))?;
                let value = match metric.as_str() {
                    QUEUE_DEPTH => f64::from(load.queue_depth),
                    KV_CACHE_USAGE => load.kv_cache_usage,
                    _ => f64::from(
                        *load
                            .objective_replicas
                            .as_ref()
                            .map_err(|why| unknown(why.clone()))?,
                    ),
                };
                Ok(json!({
                    "metricName": metric,
                    "metricLabels": entry.labels,
                    "timestamp": entry.timestamp,
                    "value": quantity(value),
                }))
            })
            .collect()
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<(String, String), Entry>> {
        self.entries.write().unwrap_or_else(|e| e.into_inner())
    }
}

/// A resource.Quantity string: whole numbers as they are, others in thousandths.
fn quantity(value: f64) -> String {
    let milli = (value.max(0.0) * 1000.0).round() as u64;
    if milli.is_multiple_of(1000) {
        (milli / 1000).to_string()
    } else {
        format!("{milli}m")
    }
}

/// Parses a label selector in the syntax `kubectl -l` and the HPA use:
/// `k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`, `k`, `!k`, joined by commas.
pub fn parse_selector(text: &str) -> Result<Selector, String> {
    let mut terms = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.checked_sub(1).ok_or("unbalanced ')'")?,
            ',' if depth == 0 => {
                terms.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("unbalanced '('".into());
    }
    terms.push(&text[start..]);

    let mut selector = Selector::default();
    for term in terms.into_iter().map(str::trim) {
        if term.is_empty() {
            if text.trim().is_empty() {
                continue;
            }
            return Err("empty requirement".into());
        }
        selector.extend(parse_requirement(term)?);
    }
    Ok(selector)
}

fn parse_requirement(term: &str) -> Result<Expression, String> {
    let key = |k: &str| -> Result<String, String> {
        let k = k.trim();
        let valid = !k.is_empty()
            && k.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c));
        if valid {
            Ok(k.to_owned())
        } else {
            Err(format!("invalid label key {k:?}"))
        }
    };
    let value = |v: &str| -> Result<String, String> {
        let v = v.trim();
        if v.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            Ok(v.to_owned())
        } else {
            Err(format!("invalid label value {v:?}"))
        }
    };
    let set = |rest: &str| -> Result<std::collections::BTreeSet<String>, String> {
        let inner = rest
            .trim()
            .strip_prefix('(')
            .and_then(|r| r.strip_suffix(')'))
            .ok_or_else(|| format!("expected a parenthesised set in {term:?}"))?;
        inner.split(',').map(value).collect()
    };

    if let Some(k) = term.strip_prefix('!') {
        return Ok(Expression::DoesNotExist(key(k)?));
    }
    if let Some((k, v)) = term.split_once("!=") {
        return Ok(Expression::NotEqual(key(k)?, value(v)?));
    }
    if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
        return Ok(Expression::Equal(key(k)?, value(v)?));
    }
    let mut words = term.splitn(2, char::is_whitespace);
    let k = words.next().unwrap_or_default();
    let rest = words.next().unwrap_or_default().trim_start();
    if rest.is_empty() {
        return Ok(Expression::Exists(key(k)?));
    }
    if let Some(s) = rest.strip_prefix("notin") {
        return Ok(Expression::NotIn(key(k)?, set(s)?));
    }
    if let Some(s) = rest.strip_prefix("in") {
        return Ok(Expression::In(key(k)?, set(s)?));
    }
    Err(format!("cannot parse requirement {term:?}"))
}

#[derive(Deserialize)]
struct MetricQuery {
    #[serde(rename = "labelSelector", default)]
    label_selector: String,
}

/// Whether the client of one connection may read metrics, decided from its certificate
/// when the connection is accepted.
#[derive(Clone, Debug)]
struct Access(Result<(), Denied>);

/// Refuses every API request of a client that is not kube-apiserver's aggregator.
async fn authenticate(
    Extension(access): Extension<Access>,
    request: Request,
    next: Next,
) -> Response {
    match access.0 {
        Ok(()) => next.run(request).await,
        Err(denied @ Denied::NameNotAllowed { .. }) => {
            status(StatusCode::FORBIDDEN, "Forbidden", &denied.to_string())
        }
        Err(denied) => status(
            StatusCode::UNAUTHORIZED,
            "Unauthorized",
            &denied.to_string(),
        ),
    }
}

/// The routes; every one but the health checks needs an [`Access`] granted per connection.
fn router(store: MetricsStore) -> Router {
    let health = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(|| async { "ok" }));
    Router::new()
        .route("/apis", get(api_group_list))
        .route(&format!("/apis/{GROUP}"), get(api_group))
        .route(&format!("/apis/{GROUP_VERSION}"), get(api_resources))
        .route(
            &format!("/apis/{GROUP_VERSION}/namespaces/{{namespace}}/{{metric}}"),
            get(metric_values),
        )
        .fallback(|| async {
            status(
                StatusCode::NOT_FOUND,
                "NotFound",
                "the server could not find the requested resource",
            )
        })
        .layer(middleware::from_fn(authenticate))
        .with_state(store)
        .merge(health)
}

fn group_json() -> Value {
    json!({
        "name": GROUP,
        "versions": [{"groupVersion": GROUP_VERSION, "version": VERSION}],
        "preferredVersion": {"groupVersion": GROUP_VERSION, "version": VERSION},
    })
}

async fn api_group_list() -> Response {
    let mut group = group_json();
    group["kind"] = json!("APIGroup");
    axum::Json(json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [group]}))
        .into_response()
}

async fn api_group() -> Response {
    let mut group = group_json();
    group["kind"] = json!("APIGroup");
    group["apiVersion"] = json!("v1");
    axum::Json(group).into_response()
}

async fn api_resources() -> Response {
    let resources: Vec<Value> = METRICS
        .iter()
        .map(|name| {
            json!({
                "name": name,
                "singularName": "",
                "namespaced": true,
                "kind": "ExternalMetricValueList",
                "verbs": ["get"],
            })
        })
        .collect();
    axum::Json(json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": GROUP_VERSION,
        "resources": resources,
    }))
    .into_response()
}

async fn metric_values(
    State(store): State<MetricsStore>,
    Path((namespace, metric)): Path<(String, String)>,
    Query(query): Query<MetricQuery>,
) -> Response {
    match store.query(&namespace, &metric, &query.label_selector) {
        Ok(items) => axum::Json(json!({
            "kind": "ExternalMetricValueList",
            "apiVersion": GROUP_VERSION,
            "metadata": {},
            "items": items,
        }))
        .into_response(),
        Err(error @ QueryError::UnknownMetric(_)) => {
            status(StatusCode::NOT_FOUND, "NotFound", &error.to_string())
        }
        Err(error @ QueryError::Selector { .. }) => {
            status(StatusCode::BAD_REQUEST, "BadRequest", &error.to_string())
        }
        Err(error @ QueryError::Unknown { .. }) => status(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            &error.to_string(),
        ),
    }
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response {
    let body = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    });
    (code, axum::Json(body)).into_response()
}

/// What the server presents and whom it lets in.
#[derive(Clone, Debug)]
pub struct TlsSettings {
    /// PEM certificate chain and key.
    pub cert_pem: String,
    pub key_pem: String,
    /// The aggregator's client CA; without one every metric request is refused.
    pub client_auth: Option<ClientAuth>,
}

/// A bound metrics server; `run` serves until the task is dropped.
pub struct MetricsServer {
    listener: TcpListener,
    acceptor: TlsAcceptor,
    client_auth: Option<ClientAuth>,
    app: Router,
}

impl MetricsServer {
    pub async fn bind(
        addr: SocketAddr,
        store: MetricsStore,
        tls: &TlsSettings,
    ) -> anyhow::Result<Self> {
        let config = tls::server_config(&tls.cert_pem, &tls.key_pem, tls.client_auth.as_ref())?;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| anyhow::anyhow!("binding the external metrics server to {addr}: {e}"))?;
        Ok(Self {
            listener,
            acceptor: TlsAcceptor::from(Arc::new(config)),
            client_auth: tls.client_auth.clone(),
            app: router(store),
        })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    pub async fn run(self) {
        loop {
            let (stream, peer) = match self.listener.accept().await {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "accepting an external metrics connection");
                    continue;
                }
            };
            let acceptor = self.acceptor.clone();
            let app = self.app.clone();
            let client_auth = self.client_auth.clone();
            tokio::spawn(async move {
                let handshake =
                    tokio::time::timeout(Duration::from_secs(10), acceptor.accept(stream));
                let tls = match handshake.await {
                    Ok(Ok(tls)) => tls,
                    Ok(Err(error)) => {
                        tracing::debug!(%peer, %error, "TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "TLS handshake timed out");
                        return;
                    }
                };
                // rustls verified any certificate offered against the client CA.
                let certificate = tls.get_ref().1.peer_certificates().and_then(|c| c.first());
                let access = match &client_auth {
                    Some(auth) => auth.admit(certificate),
                    None => Err(Denied::NoClientCa),
                };
                if let Err(denied) = &access {
                    tracing::debug!(%peer, %denied, "external metrics client refused");
                }
                let service = TowerToHyperService::new(app.layer(Extension(Access(access))));
                let builder = auto::Builder::new(TokioExecutor::new());
                if let Err(error) = builder.serve_connection(TokioIo::new(tls), service).await {
                    tracing::debug!(%peer, %error, "external metrics connection ended");
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|&(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }

    #[test]
    fn selectors_parse_like_kubectl() {
        let on = labels(&[("app", "chat"), ("tier", "gold"), (SERVICE_LABEL, "llm")]);
        for (text, expected) in [
            ("", true),
            ("app=chat", true),
            ("app==chat,tier=gold", true),
            ("app=chat,tier!=gold", false),
            ("tier in (gold, silver)", true),
            ("tier notin (gold)", false),
            ("app", true),
            ("!app", false),
            ("!missing,inference_service=llm", true),
        ] {
            let selector = parse_selector(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(selector.matches(&on), expected, "{text}");
        }
        for bad in [
            "app=(x",
            "tier in gold",
            "a b c",
            "app=chat,",
            "bad key=1",
            "x=y z",
        ] {
            assert!(parse_selector(bad).is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn quantities_are_whole_or_milli() {
        assert_eq!(quantity(12.0), "12");
        assert_eq!(quantity(1.5), "1500m");
        assert_eq!(quantity(0.0), "0");
        assert_eq!(quantity(-3.0), "0");
    }

    #[test]
    fn the_store_answers_per_namespace_and_selector() {
        let store = MetricsStore::default();
        let load = |q| ServiceLoad {
            queue_depth: q,
            kv_cache_usage: 0.25,
            objective_replicas: Err("no objectives".into()),
        };
        store.update("a", "llm", &labels(&[("team", "x")]), load(7));
        store.update("a", "other", &labels(&[("team", "y")]), load(3));
        store.update("b", "llm", &labels(&[("team", "x")]), load(100));

        let items = store
            .query("a", QUEUE_DEPTH, &format!("{SERVICE_LABEL}=llm"))
            .unwrap();
        assert_eq!(items.len(), 1);
        assert_eq!(items[0]["value"], "7");
        assert_eq!(items[0]["metricName"], QUEUE_DEPTH);
        assert_eq!(items[0]["metricLabels"]["team"], "x");
        assert_eq!(store.query("a", QUEUE_DEPTH, "").unwrap().len(), 2);
        let kv = store
            .query("a", "NPUFLEET_KV_CACHE_USAGE", "team=y")
            .unwrap();
        assert_eq!(kv[0]["value"], "250m");

        store.retain(|namespace, name| (namespace, name) != ("a", "llm"));
        assert!(store.query("a", QUEUE_DEPTH, "team=x").unwrap().is_empty());
        assert_eq!(store.query("b", QUEUE_DEPTH, "team=x").unwrap().len(), 1);
        assert_eq!(
            store.query("a", "cpu", ""),
            Err(QueryError::UnknownMetric("cpu".into()))
        );
        assert!(matches!(
            store.query("a", QUEUE_DEPTH, "team in x"),
            Err(QueryError::Selector { .. })
        ));
    }

    #[test]
    fn a_load_not_read_is_an_error_naming_why_never_a_zero() {
        let store = MetricsStore::default();
        let load = ServiceLoad {
            queue_depth: 7,
            kv_cache_usage: 0.25,
            objective_replicas: Ok(3),
        };
        store.update("a", "llm", &labels(&[("team", "x")]), load.clone());
        store.update("a", "other", &labels(&[("team", "y")]), load.clone());
        let why = "the load of 3 of 3 serving workers could not be read; first: connection refused";
        store.withhold("a", "llm", &labels(&[("team", "x")]), why.to_owned());
        let error = store
            .query("a", QUEUE_DEPTH, &format!("{SERVICE_LABEL}=llm"))
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            format!("the load of InferenceService a/llm is not known: {why}")
        );
        // A selector that spans it fails too: a sum without it would be too low.
        assert!(store.query("a", KV_CACHE_USAGE, "").is_err());
        assert_eq!(store.query("a", QUEUE_DEPTH, "team=y").unwrap().len(), 1);
        // Read again, it is served again.
        store.update("a", "llm", &labels(&[("team", "x")]), load);
        let items = store.query("a", QUEUE_DEPTH, "team=x").unwrap();
        assert_eq!(items[0]["value"], "7");
        let replicas = store.query("a", OBJECTIVE_REPLICAS, "team=x").unwrap();
        assert_eq!(replicas[0]["value"], "3");
        let none = ServiceLoad {
            objective_replicas: Err(
                "InferenceService a/other has no spec.autoscaling.objectives".into(),
            ),
            queue_depth: 0,
            kv_cache_usage: 0.0,
        };
        store.update("a", "other", &labels(&[("team", "y")]), none);
        let error = store.query("a", OBJECTIVE_REPLICAS, "team=y").unwrap_err();
        assert!(
            error
                .to_string()
                .ends_with("has no spec.autoscaling.objectives"),
            "{error}"
        );
    }

    /// A CA that signs client certificates, as kube-apiserver's front-proxy CA does.
    struct ClientCa {
        issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
        pem: String,
    }

    impl ClientCa {
        fn new() -> Self {
            use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            let pem = params.self_signed(&key).unwrap().pem();
            Self {
                issuer: Issuer::new(params, key),
                pem,
            }
        }

        /// A client certificate and its key in one PEM.
        fn client(&self, common_name: &str) -> String {
            let key = rcgen::KeyPair::generate().unwrap();
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, common_name);
            let cert = params.signed_by(&key, &self.issuer).unwrap();
            format!("{}{}", cert.pem(), key.serialize_pem())
        }
    }

    #[tokio::test]
    async fn only_the_aggregators_certificate_reads_metrics_over_verified_tls() {
        let store = MetricsStore::default();
        store.update(
            "ml",
            "chat",
            &labels(&[]),
            ServiceLoad {
                queue_depth: 12,
                kv_cache_usage: 1.5,
                objective_replicas: Err("no objectives".into()),
            },
        );
        let serving = tls::ServingCertificate::generate(&["localhost".into()]).unwrap();
        let front_proxy = ClientCa::new();
        let proxy_identity = front_proxy.client("front-proxy-client");
        let misnamed_identity = front_proxy.client("someone-else");
        let stranger_identity = ClientCa::new().client("front-proxy-client");
        let settings = TlsSettings {
            cert_pem: serving.cert_pem.clone(),
            key_pem: serving.key_pem.clone(),
            client_auth: Some(ClientAuth {
                ca_pem: front_proxy.pem.clone(),
                allowed_names: vec!["front-proxy-client".into()],
            }),
        };
        let server = MetricsServer::bind("127.0.0.1:0".parse().unwrap(), store, &settings)
            .await
            .unwrap();
        let addr = server.local_addr().unwrap();
        let serving_task = tokio::spawn(server.run());
        // The aggregator verifies the server against the APIService's caBundle.
        let http = |identity: Option<&str>| {
            let mut builder = reqwest::Client::builder()
                .add_root_certificate(
                    reqwest::Certificate::from_pem(serving.ca_pem.as_bytes()).unwrap(),
                )
                .resolve("localhost", addr);
            if let Some(pem) = identity {
                builder = builder.identity(reqwest::Identity::from_pem(pem.as_bytes()).unwrap());
            }
            builder.build().unwrap()
        };
        let base = format!("https://localhost:{}", addr.port());
        let get = |client: reqwest::Client, path: String| {
            let url = format!("{base}{path}");
            async move {
                let response = client.get(url).send().await?;
                let code = response.status().as_u16();
                Ok::<_, reqwest::Error>((code, response.json::<Value>().await?))
            }
        };
        let query = format!(
            "/apis/{GROUP_VERSION}/namespaces/ml/{QUEUE_DEPTH}?labelSelector={SERVICE_LABEL}%3Dchat"
        );
        let aggregator = http(Some(&proxy_identity));

        let (code, discovery) = get(aggregator.clone(), format!("/apis/{GROUP_VERSION}"))
            .await
            .unwrap();
        assert_eq!(code, 200);
        assert_eq!(discovery["kind"], "APIResourceList");
        assert_eq!(discovery["groupVersion"], GROUP_VERSION);
        assert_eq!(discovery["resources"][0]["name"], QUEUE_DEPTH);
        assert_eq!(discovery["resources"][0]["namespaced"], true);

        let (code, list) = get(aggregator.clone(), query.clone()).await.unwrap();
        assert_eq!(code, 200);
        assert_eq!(list["kind"], "ExternalMetricValueList");
        assert_eq!(list["items"][0]["value"], "12");
        assert_eq!(list["items"][0]["metricLabels"][SERVICE_LABEL], "chat");

        let (code, status) = get(
            aggregator.clone(),
            format!("/apis/{GROUP_VERSION}/namespaces/ml/cpu_usage"),
        )
        .await
        .unwrap();
        assert_eq!(code, 404);
        assert_eq!(status["kind"], "Status");
        assert!(status["message"].as_str().unwrap().contains("cpu_usage"));
        let (code, status) = get(
            aggregator,
            format!("/apis/{GROUP_VERSION}/namespaces/ml/{QUEUE_DEPTH}?labelSelector=a%20in%20b"),
        )
        .await
        .unwrap();
        assert_eq!(code, 400);
        assert!(
            status["message"]
                .as_str()
                .unwrap()
                .contains("labelSelector")
        );

        // No certificate: 401 saying what is missing, and no metric.
        let (code, status) = get(http(None), query.clone()).await.unwrap();
        assert_eq!(code, 401);
        assert_eq!(status["reason"], "Unauthorized");
        assert!(
            status["message"]
                .as_str()
                .unwrap()
                .contains("request-header CA"),
            "{status}"
        );
        assert!(status.get("items").is_none());
        // A certificate from another CA does not get through the handshake.
        assert!(
            get(http(Some(&stranger_identity)), query.clone())
                .await
                .is_err()
        );
        // The right CA but not an allowed name: 403 naming it.
        let (code, status) = get(http(Some(&misnamed_identity)), query).await.unwrap();
        assert_eq!(code, 403);
        assert!(
            status["message"].as_str().unwrap().contains("someone-else"),
            "{status}"
        );
        // Health checks stay open for the kubelet.
        let health = http(None)
            .get(format!("{base}/healthz"))
            .send()
            .await
            .unwrap();
        assert_eq!(health.status().as_u16(), 200);
        serving_task.abort();
    }
}

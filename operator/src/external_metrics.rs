//! The operator's own `external.metrics.k8s.io/v1beta1` server, so that a standard
//! `autoscaling/v2` HorizontalPodAutoscaler can scale an `InferenceService` on the queue
//! depth the autoscaler reads from the workers, with no Prometheus in between. The chart
//! registers it with an `APIService`; kube-apiserver proxies HPA queries here over HTTPS.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::core::{Expression, Selector, SelectorExt};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

pub const GROUP: &str = "external.metrics.k8s.io";
pub const VERSION: &str = "v1beta1";
pub const GROUP_VERSION: &str = "external.metrics.k8s.io/v1beta1";

/// Waiting + running requests summed over a service's ready replica groups. An HPA with an
/// `AverageValue` target of `targetQueueDepth` asks for `ceil(sum / target)` groups.
pub const QUEUE_DEPTH: &str = "npufleet_queue_depth";
/// KV-cache use (0..=1 per group) summed over a service's ready replica groups.
pub const KV_CACHE_USAGE: &str = "npufleet_kv_cache_usage";
pub const METRICS: [&str; 2] = [QUEUE_DEPTH, KV_CACHE_USAGE];

/// Every service's metric labels carry its name under this key, so an HPA can select one
/// service with `matchLabels`. It is also a valid Prometheus label name, so the same HPA
/// works unchanged when a prometheus-adapter serves the metric instead.
pub const SERVICE_LABEL: &str = "inference_service";

/// Readings older than this are withheld: an HPA then holds its count instead of acting on
/// a fleet the autoscaler no longer sees.
pub const MAX_AGE: Duration = Duration::from_secs(15);

/// One service's latest load, as the autoscaler read it.
#[derive(Clone, Debug, PartialEq)]
pub struct ServiceLoad {
    pub queue_depth: u32,
    pub kv_cache_usage: f64,
}

#[derive(Clone, Debug)]
struct Entry {
    labels: BTreeMap<String, String>,
    load: ServiceLoad,
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
        "external metric {0:?} is not served here; known metrics: npufleet_queue_depth, npufleet_kv_cache_usage"
    )]
    UnknownMetric(String),
    #[error("invalid labelSelector {selector:?}: {problem}")]
    Selector { selector: String, problem: String },
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

    pub fn remove(&self, namespace: &str, name: &str) {
        self.write()
            .remove(&(namespace.to_owned(), name.to_owned()));
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
        Ok(entries
            .iter()
            .filter(|((ns, _), entry)| {
                ns == namespace
                    && entry.read_at.elapsed() <= MAX_AGE
                    && parsed.matches(&entry.labels)
            })
            .map(|(_, entry)| {
                let value = if metric == QUEUE_DEPTH {
                    f64::from(entry.load.queue_depth)
                } else {
                    entry.load.kv_cache_usage
                };
                json!({
                    "metricName": metric,
                    "metricLabels": entry.labels,
                    "timestamp": entry.timestamp,
                    "value": quantity(value),
                })
            })
            .collect())
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

/// The API routes, without TLS (the tests and `serve` wrap them).
pub fn router(store: MetricsStore) -> Router {
    Router::new()
        .route("/apis", get(api_group_list))
        .route(&format!("/apis/{GROUP}"), get(api_group))
        .route(&format!("/apis/{GROUP_VERSION}"), get(api_resources))
        .route(
            &format!("/apis/{GROUP_VERSION}/namespaces/{{namespace}}/{{metric}}"),
            get(metric_values),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(|| async { "ok" }))
        .fallback(|| async {
            status(
                StatusCode::NOT_FOUND,
                "NotFound",
                "the server could not find the requested resource",
            )
        })
        .with_state(store)
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

/// Where the serving certificate comes from.
#[derive(Clone, Debug, Default)]
pub struct TlsSettings {
    /// PEM certificate chain and key (e.g. from a mounted Secret); a self-signed pair for
    /// `dns_names` is generated when absent.
    pub cert_and_key: Option<(PathBuf, PathBuf)>,
    /// Names the generated certificate is valid for.
    pub dns_names: Vec<String>,
    /// When set, only clients with a certificate from this CA (kube-apiserver's
    /// `--proxy-client-cert-file`, signed by `--requestheader-client-ca-file`) get in.
    pub client_ca: Option<PathBuf>,
}

impl TlsSettings {
    fn server_config(&self) -> anyhow::Result<rustls::ServerConfig> {
        use anyhow::Context;
        let (chain, key) = match &self.cert_and_key {
            Some((cert, key)) => {
                let chain = CertificateDer::pem_file_iter(cert)
                    .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                    .with_context(|| format!("reading certificates from {}", cert.display()))?;
                anyhow::ensure!(
                    !chain.is_empty(),
                    "{} holds no PEM certificate",
                    cert.display()
                );
                let key = PrivateKeyDer::from_pem_file(key)
                    .with_context(|| format!("reading a private key from {}", key.display()))?;
                (chain, key)
            }
            None => {
                let generated = rcgen::generate_simple_self_signed(self.dns_names.clone())
                    .context("generating a self-signed serving certificate")?;
                let key = PrivateKeyDer::try_from(generated.signing_key.serialize_der())
                    .map_err(|e| anyhow::anyhow!("encoding the generated key: {e}"))?;
                (vec![generated.cert.der().clone()], key)
            }
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .context("selecting TLS versions")?;
        let builder = match &self.client_ca {
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in CertificateDer::pem_file_iter(ca)
                    .with_context(|| format!("reading client CA {}", ca.display()))?
                {
                    roots
                        .add(cert.with_context(|| format!("parsing client CA {}", ca.display()))?)
                        .with_context(|| format!("adding client CA {}", ca.display()))?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .build()
                .context("building the client certificate verifier")?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder
            .with_single_cert(chain, key)
            .context("the serving certificate does not match its key")?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(config)
    }
}

/// A bound metrics server; `run` serves until the task is dropped.
pub struct MetricsServer {
    listener: TcpListener,
    acceptor: TlsAcceptor,
    app: Router,
}

impl MetricsServer {
    pub async fn bind(
        addr: SocketAddr,
        store: MetricsStore,
        tls: &TlsSettings,
    ) -> anyhow::Result<Self> {
        let config = tls.server_config()?;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| anyhow::anyhow!("binding the external metrics server to {addr}: {e}"))?;
        Ok(Self {
            listener,
            acceptor: TlsAcceptor::from(Arc::new(config)),
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
            let service = TowerToHyperService::new(self.app.clone());
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

        store.remove("a", "llm");
        assert!(store.query("a", QUEUE_DEPTH, "team=x").unwrap().is_empty());
        assert_eq!(
            store.query("a", "cpu", ""),
            Err(QueryError::UnknownMetric("cpu".into()))
        );
        assert!(matches!(
            store.query("a", QUEUE_DEPTH, "team in x"),
            Err(QueryError::Selector { .. })
        ));
    }

    #[tokio::test]
    async fn the_server_answers_discovery_and_queries_over_tls() {
        let store = MetricsStore::default();
        store.update(
            "ml",
            "chat",
            &labels(&[]),
            ServiceLoad {
                queue_depth: 12,
                kv_cache_usage: 1.5,
            },
        );
        let tls = TlsSettings {
            dns_names: vec!["localhost".into()],
            ..TlsSettings::default()
        };
        let server = MetricsServer::bind("127.0.0.1:0".parse().unwrap(), store, &tls)
            .await
            .unwrap();
        let base = format!("https://{}", server.local_addr().unwrap());
        let serving = tokio::spawn(server.run());
        // The APIService's insecureSkipTLSVerify, as kube-apiserver would connect.
        let http = reqwest::Client::builder()
            .danger_accept_invalid_certs(true)
            .build()
            .unwrap();
        let get = |path: String| {
            let http = http.clone();
            let url = format!("{base}{path}");
            async move {
                let response = http.get(url).send().await.unwrap();
                let code = response.status().as_u16();
                (code, response.json::<Value>().await.unwrap())
            }
        };

        let (code, discovery) = get(format!("/apis/{GROUP_VERSION}")).await;
        assert_eq!(code, 200);
        assert_eq!(discovery["kind"], "APIResourceList");
        assert_eq!(discovery["groupVersion"], GROUP_VERSION);
        assert_eq!(discovery["resources"][0]["name"], QUEUE_DEPTH);
        assert_eq!(discovery["resources"][0]["namespaced"], true);

        let (code, list) = get(format!(
            "/apis/{GROUP_VERSION}/namespaces/ml/{QUEUE_DEPTH}?labelSelector={SERVICE_LABEL}%3Dchat"
        ))
        .await;
        assert_eq!(code, 200);
        assert_eq!(list["kind"], "ExternalMetricValueList");
        assert_eq!(list["items"][0]["value"], "12");
        assert_eq!(list["items"][0]["metricLabels"][SERVICE_LABEL], "chat");

        let (code, status) = get(format!("/apis/{GROUP_VERSION}/namespaces/ml/cpu_usage")).await;
        assert_eq!(code, 404);
        assert_eq!(status["kind"], "Status");
        assert!(status["message"].as_str().unwrap().contains("cpu_usage"));
        let (code, status) = get(format!(
            "/apis/{GROUP_VERSION}/namespaces/ml/{QUEUE_DEPTH}?labelSelector=a%20in%20b"
        ))
        .await;
        assert_eq!(code, 400);
        assert!(
            status["message"]
                .as_str()
                .unwrap()
                .contains("labelSelector")
        );
        serving.abort();
    }
}

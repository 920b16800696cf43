//! A fleet's front door in tests: closed-loop clients that send their requests through the
//! product's router ([`RunningRouter`], from the local platform), and a direct picker of
//! worker pods for tests that bypass it.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Pod;
use kube::{Api, Client};
use npufleet_contract::headers;
use npufleet_crds::InferenceService;
use tokio::sync::{Mutex, Notify};

use crate::cluster::Cluster;
use crate::node_agent::{NodeAgent, NodeAgentConfig};

pub use npufleet_local::router::{RunningRouter, serving_addresses};

/// How long a fleet of SmolLM2 workers on this machine may take to reach a replica count.
const SCALING_TIMEOUT: Duration = Duration::from_secs(180);

/// A test's namespace of the shared cluster with the InferenceService CRD served and a node
/// agent, `agent-<test>`, that runs worker pods as processes on loopback subnet `subnet`.
pub struct Testbed {
    pub client: Client,
    pub namespace: String,
    pub agent: NodeAgent,
    manager: String,
}

impl Testbed {
    /// `manager` applies the CRD and the test's InferenceServices.
    pub async fn start(
        c: &Cluster,
        client: &Client,
        test: &str,
        subnet: u8,
        manager: &str,
    ) -> Result<Self> {
        Self::start_with_programs(c, client, test, subnet, manager, &[]).await
    }

    /// [`Testbed::start`], with the node agent also running `programs` (a name a container's
    /// command or image gives, and the binary).
    pub async fn start_with_programs(
        c: &Cluster,
        client: &Client,
        test: &str,
        subnet: u8,
        manager: &str,
        programs: &[(&str, std::path::PathBuf)],
    ) -> Result<Self> {
        let namespace = c.namespace(client, test).await?;
        crate::crd::install_inference_service(client, manager).await?;
        let mut config = NodeAgentConfig::new(
            &format!("agent-{test}"),
            crate::paths::workspace_bin("npufleet-worker")?,
            c.scratch().join(format!("agent-{test}")),
            subnet,
        );
        for (name, binary) in programs {
            config = config.with_program(name, binary.clone());
        }
        let agent = NodeAgent::start(client.clone(), config).await?;
        Ok(Self {
            client: client.clone(),
            namespace,
            agent,
            manager: manager.to_owned(),
        })
    }

    /// The controller and the built-in autoscaler for this namespace, in this process.
    pub fn start_operator(&self) -> Result<crate::operator::RunningOperator> {
        crate::operator::start_with_builtin_autoscaler(&self.client, &self.namespace)
    }

    pub fn services(&self) -> Api<InferenceService> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// [`crate::service::smollm2`] `name` on this test's node agent.
    pub async fn smollm2(&self, name: &str, spec: serde_json::Value) -> Result<InferenceService> {
        let model_path = tokio::task::spawn_blocking(crate::paths::smollm2_gguf).await??;
        crate::service::smollm2(
            &self.namespace,
            name,
            &model_path,
            self.agent.node_name(),
            spec,
        )
    }

    /// Applies [`Testbed::smollm2`] `name` with `spec`; what was applied.
    pub async fn apply_smollm2(
        &self,
        name: &str,
        spec: serde_json::Value,
    ) -> Result<InferenceService> {
        self.apply(&self.smollm2(name, spec).await?).await
    }

    /// Applies [`crate::service::on_node_agent`] `name` serving `model` (its name and file) on
    /// this test's node agent; what was applied.
    pub async fn apply_on_agent(
        &self,
        name: &str,
        model: (&str, &std::path::Path),
        spec: serde_json::Value,
    ) -> Result<InferenceService> {
        let service = crate::service::on_node_agent(
            &self.namespace,
            name,
            model,
            self.agent.node_name(),
            spec,
        )?;
        self.apply(&service).await
    }

    /// Waits (three minutes at most) until exactly `replicas` worker pods serve; their
    /// addresses.
    pub async fn wait_serving(&self, replicas: usize) -> Result<Vec<String>> {
        wait_serving(&self.pods(), replicas, SCALING_TIMEOUT).await
    }

    /// Waits (four minutes at most, told as `what`) until at least `replicas` worker pods
    /// serve, as a fleet scaling up under load gets there.
    pub async fn wait_serving_at_least(&self, replicas: usize, what: &str) -> Result<()> {
        let pods = self.pods();
        crate::wait::until(what, Duration::from_secs(240), || async {
            let serving = serving_addresses(&pods).await?.len();
            if serving >= replicas {
                Ok(Some(()))
            } else {
                anyhow::bail!("{serving} serving")
            }
        })
        .await
    }

    /// Waits (three minutes at most, told as `what`) until InferenceService `name` wants
    /// `replicas` and exactly `live_pods` pods are left, as after a scale-down.
    pub async fn wait_scaled_to(
        &self,
        name: &str,
        (replicas, live_pods): (i32, usize),
        what: &str,
    ) -> Result<()> {
        let (services, pods) = (self.services(), self.pods());
        crate::wait::until(what, SCALING_TIMEOUT, || async {
            let desired = services.get(name).await?.spec.replicas;
            let live = pods.list(&Default::default()).await?.items.len();
            if desired == replicas && live == live_pods {
                Ok(Some(()))
            } else {
                anyhow::bail!("desired {desired}, {live} pods")
            }
        })
        .await
    }

    /// Applies `service` as this test's field manager; `service` again.
    pub async fn apply(&self, service: &InferenceService) -> Result<InferenceService> {
        crate::operator::apply(&self.services(), &self.manager, service).await?;
        Ok(service.clone())
    }
}

/// Waits (at most `timeout`) until exactly `replicas` worker pods serve; their addresses.
pub async fn wait_serving(
    pods: &Api<Pod>,
    replicas: usize,
    timeout: Duration,
) -> Result<Vec<String>> {
    crate::wait::until(&format!("{replicas} replicas serving"), timeout, || async {
        let serving = serving_addresses(pods).await?;
        Ok((serving.len() == replicas).then_some(serving))
    })
    .await
}

/// The Prometheus text a worker at `address` exports.
pub async fn worker_metrics(http: &reqwest::Client, address: &str) -> Result<String> {
    let port = npufleet_contract::ports::HTTP_PORT;
    Ok(http
        .get(format!("http://{address}:{port}/metrics"))
        .send()
        .await?
        .text()
        .await?)
}

/// Picks worker addresses directly, fewest requests in flight first, for tests that exercise
/// the workers themselves without the router in between (the product's routing is
/// `npufleet-router`, [`RunningRouter`]).
#[derive(Default)]
pub struct Router {
    addresses: Mutex<Vec<String>>,
    in_flight: Mutex<HashMap<String, u32>>,
    changed: Notify,
}

impl Router {
    pub async fn set_addresses(&self, addresses: Vec<String>) {
        *self.addresses.lock().await = addresses;
        self.changed.notify_waiters();
    }

    async fn try_pick(&self) -> Option<String> {
        let addresses = self.addresses.lock().await.clone();
        let mut in_flight = self.in_flight.lock().await;
        let chosen = addresses
            .iter()
            .min_by_key(|a| in_flight.get(*a).copied().unwrap_or(0))?
            .clone();
        *in_flight.entry(chosen.clone()).or_default() += 1;
        Some(chosen)
    }

    /// An address to send the next request to; when none serves, waits (at most `wait`)
    /// for the address list to change. Pair every `Some` with [`Router::release`].
    pub async fn pick(&self, wait: Duration) -> Option<String> {
        let changed = self.changed.notified();
        if let Some(address) = self.try_pick().await {
            return Some(address);
        }
        let _ = tokio::time::timeout(wait, changed).await;
        self.try_pick().await
    }

    pub async fn release(&self, address: &str) {
        if let Some(n) = self.in_flight.lock().await.get_mut(address) {
            *n = n.saturating_sub(1);
        }
    }
}

/// Closed-loop clients: each posts one request to the router, reads the whole answer (or
/// stream), and repeats until stopped. Counts what was sent, what failed, what was refused as overload and which pod
/// answered.
pub struct Load {
    base_url: String,
    sent: AtomicU64,
    failed: AtomicU64,
    rejected: AtomicU64,
    failures: Mutex<Vec<String>>,
    answered_by: Mutex<HashMap<String, u64>>,
    stop: AtomicBool,
    clients: std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Load {
    /// Clients that send through the router at `router`.
    pub fn through(router: &RunningRouter) -> Arc<Self> {
        Self::at(router.url(""))
    }

    /// Clients that send to `base_url` (`http://host:port`), e.g. a router's Service.
    pub fn at(base_url: String) -> Arc<Self> {
        Arc::new(Load {
            base_url,
            sent: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            failures: Mutex::default(),
            answered_by: Mutex::default(),
            stop: AtomicBool::new(false),
            clients: std::sync::Mutex::default(),
        })
    }

    /// Starts `clients` loops posting `body` to `path`, until [`Load::stop`].
    pub fn start(self: &Arc<Self>, clients: u32, path: &'static str, body: serde_json::Value) {
        self.start_varied(clients, path, Arc::new(move |_| body.clone()));
    }

    /// [`Load::start`] with the body of the `n`th request sent being `body(n)`: prompts that
    /// differ, so that no worker serves them from its prefix cache.
    pub fn start_varied(
        self: &Arc<Self>,
        clients: u32,
        path: &'static str,
        body: Arc<dyn Fn(u64) -> serde_json::Value + Send + Sync>,
    ) {
        // A bound on each request, so that a hang fails the test instead of stalling it.
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(120))
            .build()
            .expect("HTTP client");
        let started = (0..clients)
            .map(|_| tokio::spawn(self.clone().client_loop(http.clone(), path, body.clone())));
        self.clients.lock().expect("client list").extend(started);
    }

    async fn client_loop(
        self: Arc<Self>,
        http: reqwest::Client,
        path: &str,
        body: Arc<dyn Fn(u64) -> serde_json::Value + Send + Sync>,
    ) {
        let url = format!("{}{path}", self.base_url);
        while !self.stop.load(Ordering::Relaxed) {
            let n = self.sent.fetch_add(1, Ordering::Relaxed);
            match request_once(&http, &url, &body(n)).await {
                Ok(replica) => *self.answered_by.lock().await.entry(replica).or_default() += 1,
                Err(failure) if failure.is::<Overloaded>() => {
                    self.rejected.fetch_add(1, Ordering::Relaxed);
                }
                Err(failure) => {
                    self.failed.fetch_add(1, Ordering::Relaxed);
                    self.failures.lock().await.push(format!("{failure:#}"));
                }
            }
        }
    }

    /// Ends the loops after their current request, and waits for them.
    pub async fn stop(&self) -> Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        let clients = std::mem::take(&mut *self.clients.lock().expect("client list"));
        for client in clients {
            client.await?;
        }
        Ok(())
    }

    /// Waits until `requests` more have been sent than when called, a minute at most.
    pub async fn wait_sent(&self, requests: u64, what: &str) -> Result<()> {
        let from = self.sent();
        crate::wait::until(what, Duration::from_secs(60), || async {
            Ok((self.sent() >= from + requests).then_some(()))
        })
        .await
    }

    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }

    /// Requests refused as overload (429), which a client retries later: not failures.
    pub fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }

    pub async fn failures(&self) -> Vec<String> {
        self.failures.lock().await.clone()
    }

    /// Answered requests per pod.
    pub async fn answered_by(&self) -> HashMap<String, u64> {
        self.answered_by.lock().await.clone()
    }
}

/// A 429: the fleet was full and said so.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Overloaded(String);

/// The `data:` payloads of a server-sent event stream, in order.
pub fn sse_data(text: &str) -> Vec<&str> {
    text.split("\n\n")
        .filter_map(|event| event.trim().strip_prefix("data:").map(str::trim))
        .collect()
}

/// The stream's error event, if it has one. Each event's JSON is read: the generated text
/// may well contain the word "error" itself.
pub fn sse_error(text: &str) -> Option<serde_json::Value> {
    sse_data(text)
        .into_iter()
        .filter_map(|data| serde_json::from_str::<serde_json::Value>(data).ok())
        .find(|event| event.get("error").is_some())
}

/// Whether an SSE stream so far carries generated text (a role chunk's empty content is
/// none): where a client's time to first token ends.
pub fn sse_has_text(events: &str) -> bool {
    const CONTENT: &str = "\"content\":\"";
    events
        .match_indices(CONTENT)
        .any(|(at, _)| !events[at + CONTENT.len()..].starts_with('"'))
}

/// One request through the router, read to the end (a stream to its `[DONE]`); the pod that
/// answered.
pub async fn request_once(
    http: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
) -> Result<String> {
    let response = http.post(url).json(body).send().await?;
    let status = response.status();
    let replica = response
        .headers()
        .get(headers::REPLICA)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let text = response.text().await.context("reading the answer")?;
    if status == reqwest::StatusCode::TOO_MANY_REQUESTS {
        return Err(Overloaded(format!("HTTP {status} from {replica:?}: {text}")).into());
    }
    if !status.is_success() {
        anyhow::bail!("HTTP {status} from {replica:?}: {text}");
    }
    if body["stream"] == true {
        // A stream that broke off midway still ends with [DONE], after an error event.
        anyhow::ensure!(
            sse_data(&text).last() == Some(&"[DONE]") && sse_error(&text).is_none(),
            "the stream from {replica} did not end cleanly: {text}"
        );
    } else {
        serde_json::from_str::<serde_json::Value>(&text)
            .with_context(|| format!("the answer from {replica} is not JSON: {text}"))?;
    }
    Ok(replica)
}

/// The label and taint key of the nodes [`unreachable_node`] makes.
pub const UNREACHABLE_NODE: &str = "npufleet.io/unreachable-node";

/// A KWOK node whose pods get addresses from `127.78.<subnet>.0/24`, where nothing listens:
/// workers that are Ready but that the autoscaler cannot reach, as behind a NetworkPolicy. A
/// taint keeps other tests' pods off it; [`unreachable_placement`] tolerates it.
pub async fn unreachable_node(client: &Client, name: &str, subnet: u8) -> Result<()> {
    let c = crate::cluster::shared();
    let mut node = crate::cluster::FakeNode::cpu(name);
    node.labels
        .insert(UNREACHABLE_NODE.to_owned(), name.to_owned());
    c.add_fake_node(client, &node).await?;
    let cidr = format!("127.78.{subnet}.0/24");
    let spec = serde_json::json!({"spec": {
        "podCIDR": cidr, "podCIDRs": [cidr],
        "taints": [{"key": UNREACHABLE_NODE, "value": name, "effect": "NoSchedule"}],
    }});
    Api::<k8s_openapi::api::core::v1::Node>::all(client.clone())
        .patch(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(spec),
        )
        .await?;
    Ok(())
}

/// `spec.scheduling` that puts a service's pods on the [`unreachable_node`] `node`.
pub fn unreachable_placement(node: &str) -> serde_json::Value {
    serde_json::json!({
        "nodeSelector": {UNREACHABLE_NODE: node},
        "tolerations": [{"key": UNREACHABLE_NODE, "operator": "Exists", "effect": "NoSchedule"}],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_role_chunk_is_not_generated_text() {
        let role =
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n";
        assert!(!sse_has_text(role));
        assert!(sse_has_text(&format!(
            "{role}data: {{\"choices\":[{{\"delta\":{{\"content\":\" a\"}}}}]}}\n\n"
        )));
    }

    #[test]
    fn a_stream_that_says_error_is_not_a_failed_stream() {
        let said = "data: {\"choices\":[{\"delta\":{\"content\":\"error\"}}]}\n\ndata: [DONE]\n\n";
        assert_eq!(sse_data(said).last(), Some(&"[DONE]"));
        assert!(sse_error(said).is_none());
        let failed = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n\
                      data: {\"error\":{\"message\":\"the worker went away\"}}\n\ndata: [DONE]\n\n";
        assert_eq!(
            sse_error(failed).unwrap()["error"]["message"],
            "the worker went away"
        );
    }
}

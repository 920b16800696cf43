//! Which models exist and which replicas serve them, from watches (kube-runtime reflectors) on
//! the InferenceServices and their rank-0 worker pods. Every change rebuilds an index by model
//! name and publishes it on a `watch` channel, which requests read without locking and held
//! requests wait on.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::net::IpAddr;
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use npufleet_contract::{labels, pods};
use npufleet_crds::{Engine, InferenceService, LoadSource, RoutingPolicy};
use tokio::sync::watch;

use crate::flow::FlowConfig;

/// One serving replica: the rank-0 pod of a replica group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub pod: String,
    pub ip: IpAddr,
}

/// A model as the router serves it.
#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    pub namespace: String,
    /// The InferenceService's name.
    pub service: String,
    pub policy: RoutingPolicy,
    /// The engine serving it: only this project's worker serves the Open Inference Protocol
    /// over gRPC.
    pub engine: Engine,
    /// The port of the engine's HTTP API on each replica.
    pub http_port: u16,
    /// How a replica's load is learned.
    pub load: LoadSource,
    /// `spec.replicas`: zero means the fleet is asleep and a request must wake it.
    pub desired_replicas: i32,
    /// Ready, non-terminating rank-0 pods with an IP, by pod name.
    pub endpoints: Vec<Endpoint>,
    /// `spec.routing.flowControl`, when set (and readable).
    pub flow: Option<Arc<FlowConfig>>,
}

impl Model {
    /// Whether requests are placed by their prompt's token blocks and the replicas' cache
    /// events: the cache-aware policy on an engine that publishes them.
    pub fn routes_on_cached_blocks(&self) -> bool {
        self.policy == RoutingPolicy::CacheAware && self.engine.publishes_cache_events()
    }

    /// The HTTP address of the model's first replica, if it has one.
    pub fn first_http_address(&self) -> Option<std::net::SocketAddr> {
        self.endpoints
            .first()
            .map(|e| std::net::SocketAddr::new(e.ip, self.http_port))
    }
}

/// The service's flow control; one the router cannot read (admitted before the CRD's rules)
/// is logged and left off, and requests go straight to the replicas.
fn flow_config(service: &InferenceService) -> Option<Arc<FlowConfig>> {
    let spec = service.spec.routing.flow_control.as_ref()?;
    let queue_target = service
        .spec
        .autoscaling
        .as_ref()
        .map_or(0, |a| a.target_queue_depth);
    let default_concurrency = service
        .spec
        .engine
        .max_batch_size
        .saturating_add(queue_target);
    match FlowConfig::from_spec(spec, u32::try_from(default_concurrency).unwrap_or(1)) {
        Ok(config) => Some(Arc::new(config)),
        Err(error) => {
            tracing::warn!(namespace = ?service.namespace(), service = %service.name_any(), %error, "spec.routing.flowControl ignored");
            None
        }
    }
}

/// Every model the router can route to, by the name clients use.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Fleet {
    pub models: HashMap<String, Model>,
}

impl Fleet {
    /// The index of `services` and their serving `pods`. When two InferenceServices serve
    /// the same model name, the older one wins (then the first by namespace and name), so that
    /// a newly created duplicate cannot take over a model's traffic.
    pub fn build(services: &[Arc<InferenceService>], pods: &[Arc<Pod>]) -> Fleet {
        let mut live: Vec<&InferenceService> = services
            .iter()
            .map(AsRef::as_ref)
            .filter(|s| s.metadata.deletion_timestamp.is_none())
            .collect();
        live.sort_by(|a, b| {
            let created = |s: &InferenceService| s.metadata.creation_timestamp.clone();
            created(a)
                .cmp(&created(b))
                .then_with(|| a.namespace().cmp(&b.namespace()))
                .then_with(|| a.name_any().cmp(&b.name_any()))
        });
        let mut by_service: HashMap<(String, String), Vec<Endpoint>> = HashMap::new();
        for pod in pods.iter().filter(|p| pods::serves(p)) {
            let Some(service) = pod.labels().get(labels::INFERENCE_SERVICE) else {
                continue;
            };
            let Some(ip) = pod_ip(pod) else { continue };
            by_service
                .entry((pod.namespace().unwrap_or_default(), service.clone()))
                .or_default()
                .push(Endpoint {
                    pod: pod.name_any(),
                    ip,
                });
        }
        let mut models = HashMap::new();
        for service in live {
            let namespace = service.namespace().unwrap_or_default();
            let name = service.name_any();
            if let Entry::Vacant(slot) = models.entry(service.spec.model.name.clone()) {
                let mut endpoints = by_service.remove(&(namespace.clone(), name.clone()));
                let endpoints = endpoints.get_or_insert_default();
                endpoints.sort_by(|a, b| a.pod.cmp(&b.pod));
                slot.insert(Model {
                    namespace,
                    service: name,
                    policy: service.spec.routing.policy,
                    engine: service.spec.runtime.engine,
                    http_port: service.spec.runtime.http_port(),
                    load: service.spec.runtime.load_source(),
                    desired_replicas: service.spec.replicas,
                    endpoints: std::mem::take(endpoints),
                    flow: flow_config(service),
                });
            }
        }
        Fleet { models }
    }

    /// Names of the models with at least one serving replica, sorted.
    pub fn ready_models(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .models
            .iter()
            .filter(|(_, m)| !m.endpoints.is_empty())
            .map(|(name, _)| name.as_str())
            .collect();
        names.sort_unstable();
        names
    }
}

fn pod_ip(pod: &Pod) -> Option<IpAddr> {
    pod.status.as_ref()?.pod_ip.as_deref()?.parse().ok()
}

#[derive(Clone, Copy)]
enum Listed {
    Services,
    Pods,
}

/// The published index and whether both watches have listed once.
#[derive(Clone)]
pub struct Discovery {
    pub fleet: watch::Receiver<Arc<Fleet>>,
    pub synced: watch::Receiver<bool>,
}

impl Discovery {
    /// Starts watching InferenceServices and rank-0 pods in `namespace` (every namespace when
    /// `None`). The returned future drives the watches and must be polled for as long as the
    /// router runs.
    pub fn start(
        client: Client,
        namespace: Option<&str>,
    ) -> (Discovery, impl Future<Output = ()> + Send + 'static) {
        let (services_api, pods_api): (Api<InferenceService>, Api<Pod>) = match namespace {
            Some(ns) => (
                Api::namespaced(client.clone(), ns),
                Api::namespaced(client, ns),
            ),
            None => (Api::all(client.clone()), Api::all(client)),
        };
        let (services, services_writer) = reflector::store();
        let (pods, pods_writer) = reflector::store();
        let service_events = reflector::reflector(
            services_writer,
            watcher(services_api, watcher::Config::default()),
        )
        .default_backoff()
        .map(|event| event.map(|e| (Listed::Services, matches!(e, watcher::Event::InitDone))))
        .boxed();
        let pod_events = reflector::reflector(
            pods_writer,
            watcher(
                pods_api,
                watcher::Config::default().labels(labels::SERVING_PODS),
            )
            .modify(|pod| pod.managed_fields_mut().clear()),
        )
        .default_backoff()
        .map(|event| event.map(|e| (Listed::Pods, matches!(e, watcher::Event::InitDone))))
        .boxed();
        let (fleet_tx, fleet) = watch::channel(Arc::new(Fleet::default()));
        let (synced_tx, synced) = watch::channel(false);
        let run = async move {
            let mut events = futures::stream::select(service_events, pod_events);
            let (mut services_listed, mut pods_listed) = (false, false);
            while let Some(event) = events.next().await {
                match event {
                    Ok((Listed::Services, listed)) => services_listed |= listed,
                    Ok((Listed::Pods, listed)) => pods_listed |= listed,
                    Err(error) => {
                        tracing::warn!(%error, "watch error; the watch retries with backoff");
                        continue;
                    }
                }
                // Until both have listed once, a partial index would answer 404 for models
                // that exist.
                if services_listed && pods_listed {
                    publish(&services, &pods, &fleet_tx, &synced_tx);
                }
            }
        };
        (Discovery { fleet, synced }, run)
    }
}

fn publish(
    services: &Store<InferenceService>,
    pods: &Store<Pod>,
    fleet_tx: &watch::Sender<Arc<Fleet>>,
    synced_tx: &watch::Sender<bool>,
) {
    let fleet = Fleet::build(&services.state(), &pods.state());
    fleet_tx.send_if_modified(|current| {
        let changed = **current != fleet;
        if changed {
            *current = Arc::new(fleet);
        }
        changed
    });
    synced_tx.send_if_modified(|current| !std::mem::replace(current, true));
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;
    use serde_json::json;

    use super::*;

    fn service(namespace: &str, name: &str, model: &str, created: i64) -> Arc<InferenceService> {
        let mut service: InferenceService = serde_json::from_value(json!({
            "apiVersion": "npufleet.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "model": {"name": model, "source": {"imagePath": "/m.gguf"}},
                "replicas": 2,
                "accelerator": {"type": "cpu"},
                "routing": {"policy": "prefix-affinity"},
            }
        }))
        .unwrap();
        service.metadata.creation_timestamp = Some(Time(Timestamp::from_second(created).unwrap()));
        Arc::new(service)
    }

    fn pod(namespace: &str, name: &str, service: &str, ip: &str, ready: bool) -> Arc<Pod> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": namespace,
                             "labels": {(labels::INFERENCE_SERVICE): service, (labels::RANK): labels::SERVING_RANK}},
                "status": {"phase": "Running", "podIP": ip, "conditions": [
                    {"type": "Ready", "status": if ready { "True" } else { "False" }}
                ]}
            }))
            .unwrap(),
        )
    }

    #[test]
    fn models_list_their_ready_pods_by_name() {
        let fleet = Fleet::build(
            &[service("a", "chat", "smollm2", 1)],
            &[
                pod("a", "chat-1-0", "chat", "10.0.0.2", true),
                pod("a", "chat-0-0", "chat", "10.0.0.1", true),
                pod("a", "chat-2-0", "chat", "10.0.0.3", false),
                pod("b", "chat-0-0", "chat", "10.0.1.1", true),
            ],
        );
        let model = &fleet.models["smollm2"];
        assert_eq!(
            (model.namespace.as_str(), model.service.as_str()),
            ("a", "chat")
        );
        assert_eq!(model.policy, RoutingPolicy::PrefixAffinity);
        let pods: Vec<_> = model.endpoints.iter().map(|e| e.pod.as_str()).collect();
        assert_eq!(pods, ["chat-0-0", "chat-1-0"]);
        assert_eq!(fleet.ready_models(), ["smollm2"]);
    }

    #[test]
    fn terminating_pods_do_not_serve() {
        let mut terminating = (*pod("a", "chat-0-0", "chat", "10.0.0.1", true)).clone();
        terminating.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
        let fleet = Fleet::build(&[service("a", "chat", "m", 1)], &[Arc::new(terminating)]);
        assert!(fleet.models["m"].endpoints.is_empty());
        assert!(fleet.ready_models().is_empty());
    }

    #[test]
    fn the_older_service_keeps_a_duplicated_model_name() {
        let fleet = Fleet::build(
            &[
                service("b", "late", "m", 20),
                service("a", "early", "m", 10),
            ],
            &[pod("b", "late-0-0", "late", "10.0.0.9", true)],
        );
        assert_eq!(fleet.models["m"].service, "early");
        assert!(fleet.models["m"].endpoints.is_empty());
    }
}

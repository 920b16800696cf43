//! Reading the workers' load and publishing each service's as the external metrics.
//!
//! This half of the autoscaler runs on every operator replica: an HPA's query reaches
//! whichever replica the metrics Service picks, so each must have the readings. Decisions
//! and writes built on them stay with the leader ([`super::Autoscaler`]).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use npufleet_contract::ports;
use npufleet_crds::{InferenceService, LoadSource};

use super::capacity::Capacity;
use super::load::{LoadReader, LoadTarget};
use super::objectives::{self, GroupSample, Tracker};
use super::policy::{GroupState, Observation};
use super::{GroupView, group_loads, group_samples, readings};
use crate::cache::{WatchScope, without_managed_fields};
use crate::external_metrics::{MetricsStore, ServiceLoad};
use crate::fleet;
use crate::labels::{self, FIELD_MANAGER};
use npufleet_crds::AutoscalingMode;

/// Reads the load of every service's workers and keeps the metrics store current.
pub struct Collector {
    reader: LoadReader,
    metrics: MetricsStore,
    /// Only services in this namespace, when set.
    namespace: Option<String>,
    services: Store<InferenceService>,
    pods: Store<Pod>,
    /// With objectives under `mode: hpa`, what each service's objectives learned, by
    /// namespace and name: every replica answers the HPA, so each keeps its own.
    trackers: Mutex<HashMap<(String, String), Tracker>>,
    started: Instant,
}

impl Collector {
    pub fn new(
        read_timeout: Duration,
        namespace: Option<&str>,
        services: Store<InferenceService>,
        pods: Store<Pod>,
        metrics: MetricsStore,
    ) -> Self {
        Self {
            reader: LoadReader::new(read_timeout),
            metrics,
            namespace: namespace.map(str::to_owned),
            services,
            pods,
            trackers: Mutex::new(HashMap::new()),
            started: Instant::now(),
        }
    }

    /// Reads every service's workers once, publishes each service's load and forgets the
    /// services that are gone; returns what it saw of each service, and of each of its
    /// groups what the latency objectives need.
    pub async fn collect(&self) -> Vec<(Arc<InferenceService>, Observation, Vec<GroupSample>)> {
        let namespace = self.namespace.as_deref();
        let services = self
            .services
            .state_filter(|s| namespace.is_none_or(|ns| s.namespace().as_deref() == Some(ns)));

        let pods = self.pods.state();
        let mut addresses = HashSet::new();
        let reads = services.iter().map(|service| {
            let workers = group_views(service, pods.iter().map(AsRef::as_ref));
            addresses.extend(workers.iter().filter_map(|(_, target)| match target {
                Some(LoadTarget::Worker(address)) => Some(address.clone()),
                _ => None,
            }));
            let reader = &self.reader;
            async move {
                let views = futures::future::join_all(workers.into_iter().map(
                    |(mut view, target)| async move {
                        if let Some(target) = target {
                            view.report = reader.read(&target).await.map_err(|error| {
                                tracing::debug!(%error, "reading worker load");
                                format!("{error:#}")
                            });
                        }
                        view
                    },
                ))
                .await;
                (service.clone(), views)
            }
        });
        let read = futures::future::join_all(reads).await;
        self.reader.retain(&addresses);

        let live: HashSet<(String, String)> = services
            .iter()
            .map(|s| (s.namespace().unwrap_or_default(), s.name_any()))
            .collect();
        self.metrics
            .retain(|namespace, name| live.contains(&(namespace.to_owned(), name.to_owned())));
        self.lock_trackers().retain(|key, _| live.contains(key));

        read.into_iter()
            .map(|(service, workers)| {
                let observation = Observation {
                    spec_replicas: u32::try_from(fleet::desired_groups(&service)).unwrap_or(0),
                    groups: group_loads(&workers),
                    wake_requested: false,
                    readings: readings(&workers),
                };
                let samples = group_samples(&workers);
                self.publish(&service, &observation, &samples);
                (service, observation, samples)
            })
            .collect()
    }

    /// Waits until the stores hold what the cluster had when their watches started, so that
    /// a first collection does not take every service for gone and withdraw its metrics.
    pub async fn wait_until_ready(&self) {
        self.services.wait_until_ready().await.ok();
        self.pods.wait_until_ready().await.ok();
    }

    /// Collects every `tick` until dropped: what a replica that does not lead runs.
    pub async fn run(self, tick: Duration) {
        self.wait_until_ready().await;
        let mut ticks = tokio::time::interval(tick);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            self.collect().await;
        }
    }

    /// Publishes the service's load, or that it is not known: a sum over the workers that
    /// answered would read as a fall in load.
    fn publish(
        &self,
        service: &InferenceService,
        observation: &Observation,
        samples: &[GroupSample],
    ) {
        let (namespace, name) = (service.namespace().unwrap_or_default(), service.name_any());
        if observation.readings.incomplete() {
            self.metrics.withhold(
                &namespace,
                &name,
                service.labels(),
                observation.readings.to_string(),
            );
            return;
        }
        self.metrics.update(
            &namespace,
            &name,
            service.labels(),
            ServiceLoad {
                queue_depth: observation.queue_depth(),
                kv_cache_usage: observation
                    .groups
                    .iter()
                    .filter(|g| g.state == GroupState::Ready)
                    .map(|g| g.kv_usage)
                    .sum(),
                objective_replicas: self.objective_replicas(service, observation, samples),
            },
        );
    }

    /// The count the objectives of an HPA-scaled service ask for, or why there is none (the
    /// built-in loop sizes its services itself).
    fn objective_replicas(
        &self,
        service: &InferenceService,
        observation: &Observation,
        samples: &[GroupSample],
    ) -> Result<u32, String> {
        let (namespace, name) = (service.namespace().unwrap_or_default(), service.name_any());
        let autoscaling = service.spec.autoscaling.as_ref();
        let spec = match autoscaling.and_then(|a| a.objectives.as_ref()) {
            Some(spec) if autoscaling.is_some_and(|a| a.mode == AutoscalingMode::Hpa) => spec,
            _ => {
                return Err(format!(
                    "InferenceService {namespace}/{name} is not scaled by an HPA on spec.autoscaling.objectives"
                ));
            }
        };
        let targets = super::targets(spec)?;
        let max_replicas = autoscaling.map_or(1, |a| u32::try_from(a.max_replicas).unwrap_or(1));
        let waiting = observation.waiting();
        let mut trackers = self.lock_trackers();
        let tracker = trackers.entry((namespace, name)).or_insert_with(|| {
            let status = service.status.as_ref().and_then(|s| s.autoscaling.as_ref());
            Tracker::new(
                status
                    .and_then(|a| a.capacity.as_ref())
                    .map(Capacity::from_status)
                    .unwrap_or_default(),
                None,
            )
        });
        match objectives::evaluate(
            tracker,
            self.started.elapsed(),
            samples,
            (waiting, observation.ready()),
            &targets,
            max_replicas,
        ) {
            Ok(evaluation) => Ok(evaluation.sizing.replicas),
            Err(objectives::Unknown::Starting) => {
                Err("the objectives have no readings to predict from yet".to_owned())
            }
            Err(objectives::Unknown::NoCounters(why)) => Err(why),
        }
    }

    /// What the objectives of an HPA-scaled service learned of its capacity, once they
    /// learned anything: the leader keeps it in the service's status, from which a restarted
    /// operator carries on.
    pub fn learned_capacity(&self, namespace: &str, name: &str) -> Option<Capacity> {
        let trackers = self.lock_trackers();
        let tracker = trackers.get(&(namespace.to_owned(), name.to_owned()))?;
        let capacity = *tracker.capacity();
        (capacity != Capacity::default()).then_some(capacity)
    }

    fn lock_trackers(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Tracker>> {
        self.trackers.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The replica groups of `service` among `pods`, as [`fleet::groups`] gathers them, with
/// where their serving pod's load is read.
pub fn group_views<'a>(
    service: &InferenceService,
    pods: impl IntoIterator<Item = &'a Pod>,
) -> Vec<(GroupView, Option<LoadTarget>)> {
    let ranks = service.pods_per_replica();
    let source = service.spec.runtime.load_source();
    fleet::groups(fleet::worker_pods(service, pods))
        .iter()
        .filter_map(|(&number, group)| {
            let view = GroupView::new(u32::try_from(number).ok()?, group, ranks);
            let target = group
                .serving_pod()
                .and_then(|pod| load_target(service, &source, pod));
            Some((view, target))
        })
        .collect()
}

fn load_target(service: &InferenceService, source: &LoadSource, pod: &Pod) -> Option<LoadTarget> {
    let ip = pod.status.as_ref()?.pod_ip.as_deref()?;
    Some(match source {
        LoadSource::WorkerStream => LoadTarget::Worker(format!("{ip}:{}", grpc_port(pod))),
        LoadSource::Scrape(metrics) => {
            let port = metrics
                .port
                .unwrap_or_else(|| service.spec.runtime.http_port());
            LoadTarget::Scrape {
                url: format!("http://{ip}:{port}{}", metrics.path),
                metrics: metrics.clone(),
            }
        }
        LoadSource::RouterCounts => LoadTarget::Silent(format!(
            "the {} engine publishes no load series (spec.runtime.metrics names none)",
            service.spec.runtime.engine.as_str()
        )),
    })
}

/// The InferenceServices in `scope` and their worker pods, watched for a replica that does not
/// lead: the operator's shared cache starts with the controller, on the leader only. The
/// stores fill while the returned future is polled.
pub fn standby_stores(
    client: &Client,
    scope: &WatchScope,
) -> (
    Store<InferenceService>,
    Store<Pod>,
    impl std::future::Future<Output = ()> + Send + 'static,
) {
    let (services, services_writer) = reflector::store();
    let (pods, pods_writer) = reflector::store();
    let services_watch = watcher(
        scope.api::<InferenceService>(client),
        watcher::Config::default(),
    )
    .modify(without_managed_fields)
    .default_backoff()
    .reflect(services_writer);
    let managed =
        watcher::Config::default().labels(&format!("{}={}", labels::MANAGED_BY, FIELD_MANAGER));
    let pods_watch = watcher(scope.api::<Pod>(client), managed)
        .modify(without_managed_fields)
        .default_backoff()
        .reflect(pods_writer);
    let watches = async move {
        futures::join!(
            services_watch.for_each(|_| std::future::ready(())),
            pods_watch.for_each(|_| std::future::ready(()))
        );
    };
    (services, pods, watches)
}

fn grpc_port(pod: &Pod) -> i32 {
    pod.spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some(ports::GRPC_PORT_NAME))
        .map_or(i32::from(ports::GRPC_PORT), |p| p.container_port)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autoscaler::policy::{GroupLoad, Readings};
    use crate::autoscaler::tests::service;
    use crate::external_metrics::QUEUE_DEPTH;

    #[test]
    fn a_service_with_workers_not_read_publishes_why_instead_of_a_lower_sum() {
        let metrics = MetricsStore::default();
        let collector = Collector::new(
            Duration::from_millis(100),
            None,
            reflector::store().0,
            reflector::store().0,
            metrics.clone(),
        );
        let service = service(serde_json::json!({}), serde_json::json!({}));
        let group = |group, state, running| GroupLoad {
            group,
            state,
            waiting: 0,
            running,
            kv_usage: 0.0,
        };
        let mut observation = Observation {
            spec_replicas: 3,
            groups: vec![
                group(0, GroupState::Ready, 4),
                group(1, GroupState::Ready, 2),
                group(2, GroupState::Unread, 0),
            ],
            wake_requested: false,
            readings: Readings {
                asked: 3,
                failed: 1,
                first_error: Some("no load report from 127.0.0.3:8001 within 100ms".into()),
            },
        };
        collector.publish(&service, &observation, &[]);
        let refused = metrics.query("ml", QUEUE_DEPTH, "").unwrap_err();
        assert_eq!(
            refused.to_string(),
            "the load of InferenceService ml/chat is not known: the load of 1 of 3 serving workers could not be read; first: no load report from 127.0.0.3:8001 within 100ms"
        );

        observation.groups[2] = group(2, GroupState::Ready, 1);
        observation.readings = Readings {
            asked: 3,
            ..Readings::default()
        };
        collector.publish(&service, &observation, &[]);
        let items = metrics.query("ml", QUEUE_DEPTH, "").unwrap();
        assert_eq!(items[0]["value"], "7");
    }
}

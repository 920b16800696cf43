//! Queue-depth autoscaling of `InferenceService`s.
//!
//! Every tick (500 ms by default) the loop reads each worker's load signal, feeds the
//! per-service [`policy::Policy`] and, for `mode: builtin`, records the decision in
//! `status.autoscaling.desiredReplicas`, with an event. For `mode: hpa` it only publishes the
//! load as the external metric and keeps the service's HPA in place. The loop runs on the
//! leader; the reading and publishing ([`collect`]) also runs on every other replica, so each
//! answers the external metrics API alike.
//!
//! One writer per count: with `mode: builtin` the reconcile follows
//! `status.autoscaling.desiredReplicas`, which only this loop writes (under its own field
//! manager), so a re-applied manifest's `spec.replicas` is the starting count and nothing
//! more. The loop also copies each decision into `spec.replicas` through the scale
//! subresource, so `kubectl get` and other readers of the scale subresource see the count;
//! it copies only when it decides, so a GitOps tool re-applying its manifest is not fought.
//! With `mode: hpa` the HorizontalPodAutoscaler owns `spec.replicas`, and a manifest should
//! leave `replicas` out, as for any HPA target. Either way the count is clamped to
//! `[minReplicas, maxReplicas]` before anything is created ([`desired_replicas`]).

pub mod collect;
pub mod hpa;
pub mod load;
pub mod policy;
pub mod sim;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::core::SelectorExt;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::{Client, Resource, ResourceExt};
use npufleet_contract::annotations::WAKE_REQUESTED_AT;
use npufleet_crds::{AutoscalingMode, AutoscalingSpec, InferenceService};
use serde_json::json;
use tokio::time::Instant;

use crate::cache::Stores;
use crate::external_metrics::{MetricsStore, parse_selector};
use crate::labels::GROUP as GROUP_LABEL;
use collect::Collector;
use npufleet_contract::proto::npufleet::v1::{LoadReport, WorkerState};
use policy::{Decision, GroupLoad, GroupState, Observation, Policy, PolicyConfig};

/// Field manager of everything the autoscaler writes.
pub const FIELD_MANAGER: &str = "npufleet-autoscaler";
/// Set on every pod of a group chosen for removal just before a scale-down is written, and
/// taken off the pods of groups not chosen; the reconcile removes marked groups first.
pub const SCALE_DOWN_ANNOTATION: &str = "npufleet.io/scale-down";

/// How the loop runs.
#[derive(Clone, Debug)]
pub struct Settings {
    pub tick: Duration,
    /// Longest wait for one worker's load report.
    pub read_timeout: Duration,
    /// Longest time between `status.autoscaling` writes while the count holds.
    pub status_interval: Duration,
    /// The policy's windows, delays and rates; bounds and target come from each service.
    pub policy: PolicyConfig,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            tick: Duration::from_millis(500),
            read_timeout: Duration::from_millis(400),
            status_interval: Duration::from_secs(5),
            policy: PolicyConfig::default(),
        }
    }
}

/// The replica groups the reconcile runs: `spec.replicas` by hand or under an HPA, the
/// built-in autoscaler's own count once it has one, always within the autoscaling bounds.
pub fn desired_replicas(service: &InferenceService) -> i32 {
    let spec = &service.spec;
    let Some(autoscaling) = spec.autoscaling.as_ref() else {
        return spec.replicas.max(0);
    };
    let decided = match autoscaling.mode {
        AutoscalingMode::Builtin => service
            .status
            .as_ref()
            .and_then(|s| s.autoscaling.as_ref())
            .and_then(|a| a.desired_replicas),
        AutoscalingMode::Hpa => None,
    };
    let min = autoscaling.min_replicas.max(0);
    decided
        .unwrap_or(spec.replicas)
        .clamp(min, autoscaling.max_replicas.max(min))
}

/// Whether a router asked to wake `service` since it went to zero: the wake annotation is
/// newer than the autoscaler's last scale (the scale to zero). `Err` names a bad annotation.
pub fn wake_requested(service: &InferenceService) -> Result<bool, String> {
    let Some(value) = service.annotations().get(WAKE_REQUESTED_AT) else {
        return Ok(false);
    };
    let requested: k8s_openapi::jiff::Timestamp = value.trim().parse().map_err(|error| {
        format!("annotation {WAKE_REQUESTED_AT}: {value:?} is not an RFC 3339 time: {error}")
    })?;
    let scaled_at = service
        .status
        .as_ref()
        .and_then(|s| s.autoscaling.as_ref())
        .and_then(|a| a.last_scale_time.as_ref());
    Ok(scaled_at.is_none_or(|at| requested > at.0))
}

/// The policy configuration for a service: the service's bounds and target on top of the
/// operator-wide windows and rates.
pub fn policy_config(base: &PolicyConfig, spec: &AutoscalingSpec) -> PolicyConfig {
    PolicyConfig {
        target_queue_per_replica: f64::from(spec.target_queue_depth),
        min_replicas: u32::try_from(spec.min_replicas).unwrap_or(0),
        max_replicas: u32::try_from(spec.max_replicas).unwrap_or(0),
        ..base.clone()
    }
}

/// One worker pod as the autoscaler sees it.
#[derive(Clone, Debug)]
pub struct WorkerView {
    pub group: u32,
    pub rank: u32,
    /// Terminating.
    pub leaving: bool,
    /// The pod's Ready condition.
    pub pod_ready: bool,
    /// `None` when the worker could not be read.
    pub report: Option<LoadReport>,
}

/// Folds the workers of one service into replica groups. A group serves only when every
/// rank's pod is ready and every reachable rank reports ready; its queue is the largest any
/// rank reports (the ranks of a group share one batch).
pub fn group_loads(workers: &[WorkerView]) -> Vec<GroupLoad> {
    let mut groups: BTreeMap<u32, Vec<&WorkerView>> = BTreeMap::new();
    for worker in workers {
        groups.entry(worker.group).or_default().push(worker);
    }
    groups
        .into_iter()
        .map(|(group, ranks)| {
            let reported = || ranks.iter().filter_map(|w| w.report.as_ref());
            let state = if ranks.iter().any(|w| w.leaving)
                || reported()
                    .any(|r| matches!(r.state(), WorkerState::Draining | WorkerState::Drained))
            {
                GroupState::Draining
            } else if ranks.iter().all(|w| {
                w.pod_ready
                    && w.report
                        .as_ref()
                        .is_some_and(|r| r.state() == WorkerState::Ready)
            }) {
                GroupState::Ready
            } else {
                GroupState::Warming
            };
            GroupLoad {
                group,
                state,
                waiting: reported().map(|r| r.waiting).max().unwrap_or(0),
                running: reported().map(|r| r.running).max().unwrap_or(0),
                kv_usage: reported().map(|r| r.kv_cache_usage).fold(0.0, f64::max),
            }
        })
        .collect()
}

struct ServiceState {
    policy: Policy,
    /// When `status.autoscaling` was last written, and the desired count it said.
    last_status: Option<(Instant, i32)>,
    last_scale_time: Option<Time>,
    /// A wake annotation already reported as unreadable.
    bad_wake_request: Option<String>,
}

#[derive(Debug, PartialEq)]
enum HpaState {
    /// Applied for this generation of the service.
    Applied(Option<i64>),
    /// Deleted or never made by this operator.
    Absent,
}

/// The autoscaling loop; runs until its task is dropped.
pub struct Autoscaler {
    client: Client,
    settings: Settings,
    collector: Collector,
    recorder: Recorder,
    stores: Stores,
    policies: HashMap<ObjectRef<InferenceService>, ServiceState>,
    /// What this loop knows of each service's HPA.
    hpas: HashMap<ObjectRef<InferenceService>, HpaState>,
    /// Services whose autoscaling settings were rejected, with those settings, so the
    /// warning is recorded once.
    invalid: HashMap<ObjectRef<InferenceService>, PolicyConfig>,
    started: Instant,
}

impl Autoscaler {
    /// The loop over the services in `namespace` (or everywhere), reading services and worker
    /// pods from the operator's shared cache; ready to [`Autoscaler::run`].
    pub fn new(
        client: Client,
        namespace: Option<&str>,
        stores: &Stores,
        settings: Settings,
        metrics: MetricsStore,
    ) -> anyhow::Result<Self> {
        settings.policy.validate()?;
        let reporter = Reporter {
            controller: FIELD_MANAGER.to_owned(),
            instance: std::env::var("POD_NAME").ok(),
        };
        Ok(Self {
            recorder: Recorder::new(client.clone(), reporter),
            collector: Collector::new(
                settings.read_timeout,
                namespace,
                stores.inference_services.clone(),
                stores.pods.clone(),
                metrics,
            ),
            client,
            settings,
            stores: stores.clone(),
            policies: HashMap::new(),
            hpas: HashMap::new(),
            invalid: HashMap::new(),
            started: Instant::now(),
        })
    }

    /// Ticks until dropped. The first waits for the shared cache to hold the cluster (the
    /// controller's watches fill it): a replica taking the lead starts that cache empty, and
    /// a tick on it would withdraw every service's external metrics.
    pub async fn run(mut self) {
        self.stores.synced().await;
        let mut ticks = tokio::time::interval(self.settings.tick);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            self.tick().await;
        }
    }

    async fn tick(&mut self) {
        let observed = self.collector.collect().await;
        let live: HashSet<ObjectRef<InferenceService>> = observed
            .iter()
            .map(|(s, _)| ObjectRef::from_obj(s.as_ref()))
            .collect();
        self.policies.retain(|k, _| live.contains(k));
        self.hpas.retain(|k, _| live.contains(k));
        self.invalid.retain(|k, _| live.contains(k));

        for (service, observation) in observed {
            if let Err(error) = self.handle(&service, observation).await {
                tracing::warn!(
                    service = %service.name_any(),
                    namespace = service.namespace().unwrap_or_default(),
                    error = format!("{error:#}"),
                    "autoscaling"
                );
            }
        }
    }

    async fn handle(
        &mut self,
        service: &InferenceService,
        mut observation: Observation,
    ) -> anyhow::Result<()> {
        let name = service.name_any();
        let namespace = service.namespace().unwrap_or_default();
        let key = ObjectRef::from_obj(service);
        let Some(autoscaling) = service.spec.autoscaling.as_ref() else {
            self.policies.remove(&key);
            return self.forget_hpa(service, &key).await;
        };
        match autoscaling.mode {
            AutoscalingMode::Hpa => {
                self.policies.remove(&key);
                let generation = service.metadata.generation;
                if self.hpas.get(&key) != Some(&HpaState::Applied(generation)) {
                    let hpa = match hpa::desired(service, autoscaling) {
                        Ok(hpa) => hpa,
                        Err(error) => {
                            let config = policy_config(&self.settings.policy, autoscaling);
                            if self.invalid.get(&key) != Some(&config) {
                                self.warn(service, "InvalidAutoscaling", &format!("{error:#}"))
                                    .await;
                                self.invalid.insert(key, config);
                            }
                            return Ok(());
                        }
                    };
                    self.invalid.remove(&key);
                    Api::<HorizontalPodAutoscaler>::namespaced(self.client.clone(), &namespace)
                        .patch(
                            &name,
                            &PatchParams::apply(FIELD_MANAGER).force(),
                            &Patch::Apply(&hpa),
                        )
                        .await?;
                    self.hpas.insert(key, HpaState::Applied(generation));
                }
                Ok(())
            }
            AutoscalingMode::Builtin => {
                self.forget_hpa(service, &key).await?;
                let config = policy_config(&self.settings.policy, autoscaling);
                let current = self.policies.get(&key).map(|s| s.policy.config());
                if current != Some(&config) {
                    match Policy::new(config.clone()) {
                        Ok(policy) => {
                            self.policies.insert(
                                key.clone(),
                                ServiceState {
                                    policy,
                                    last_status: None,
                                    last_scale_time: service
                                        .status
                                        .as_ref()
                                        .and_then(|s| s.autoscaling.as_ref())
                                        .and_then(|a| a.last_scale_time.clone()),
                                    bad_wake_request: None,
                                },
                            );
                        }
                        Err(error) => {
                            if self.invalid.get(&key) != Some(&config) {
                                self.warn(service, "InvalidAutoscaling", &error.to_string())
                                    .await;
                                self.invalid.insert(key, config);
                            }
                            return Ok(());
                        }
                    }
                }
                self.invalid.remove(&key);
                if observation.spec_replicas == 0 {
                    observation.wake_requested = match wake_requested(service) {
                        Ok(requested) => requested,
                        Err(problem) => {
                            let value = service.annotations().get(WAKE_REQUESTED_AT).cloned();
                            let state = self.policies.get_mut(&key).expect("inserted above");
                            if state.bad_wake_request != value {
                                state.bad_wake_request = value;
                                self.warn(service, "InvalidWakeRequest", &problem).await;
                            }
                            false
                        }
                    };
                }
                let now = self.started.elapsed();
                let state = self.policies.get_mut(&key).expect("inserted above");
                let decision = state.policy.decide(now, &observation);
                self.apply(service, &observation, &decision).await
            }
        }
    }

    /// Deletes the service's HPA if this operator made it (once per service and mode
    /// change: an HPA left from an earlier mode would fight the built-in loop).
    async fn forget_hpa(
        &mut self,
        service: &InferenceService,
        key: &ObjectRef<InferenceService>,
    ) -> anyhow::Result<()> {
        if self.hpas.get(key) == Some(&HpaState::Absent) {
            return Ok(());
        }
        self.remove_hpa(service).await?;
        self.hpas.insert(key.clone(), HpaState::Absent);
        Ok(())
    }

    async fn apply(
        &mut self,
        service: &InferenceService,
        observation: &Observation,
        decision: &Decision,
    ) -> anyhow::Result<()> {
        let name = service.name_any();
        let namespace = service.namespace().unwrap_or_default();
        let api: Api<InferenceService> = Api::namespaced(self.client.clone(), &namespace);
        let current = observation.spec_replicas;
        let desired = i32::try_from(decision.desired).unwrap_or(i32::MAX);
        let key = ObjectRef::from_obj(service);

        if decision.desired != current {
            if decision.desired < current {
                let victims = policy::scale_down_victims(
                    &observation.groups,
                    (current - decision.desired) as usize,
                );
                self.mark_for_removal(service, &victims).await?;
            }
            let state = self.policies.get_mut(&key).expect("present");
            state.last_scale_time = Some(Time(k8s_openapi::jiff::Timestamp::now()));
            state.last_status = None;
            // The count the reconcile follows first, then its copy for scale readers.
            self.write_status(service, decision).await?;
            api.patch_scale(
                &name,
                &Self::params(),
                &Patch::Merge(json!({"spec": {"replicas": desired}})),
            )
            .await?;
            let event = Event {
                type_: EventType::Normal,
                reason: decision.reason.as_str().to_owned(),
                note: Some(decision.message(current)),
                action: "Scale".to_owned(),
                secondary: None,
            };
            if let Err(error) = self
                .recorder
                .publish(&event, &service.object_ref(&()))
                .await
            {
                tracing::warn!(%error, service = %name, "recording a scale event");
            }
            tracing::info!(service = %name, namespace, "{}", decision.message(current));
        }

        let state = self.policies.get(&key).expect("present");
        let due = state.last_status.is_none_or(|(at, written)| {
            written != desired || at.elapsed() >= self.settings.status_interval
        });
        if due {
            self.write_status(service, decision).await?;
        }
        Ok(())
    }

    /// Applies `status.autoscaling` under the autoscaler's field manager.
    async fn write_status(
        &mut self,
        service: &InferenceService,
        decision: &Decision,
    ) -> anyhow::Result<()> {
        let key = ObjectRef::from_obj(service);
        let state = self.policies.get_mut(&key).expect("present");
        let desired = i32::try_from(decision.desired).unwrap_or(i32::MAX);
        let mut autoscaling = json!({
            "queueDepth": (decision.queue_per_replica * 100.0).round() / 100.0,
            "desiredReplicas": desired,
        });
        if let Some(at) = &state.last_scale_time {
            autoscaling["lastScaleTime"] = json!(at);
        }
        let status = json!({
            "apiVersion": InferenceService::api_version(&()),
            "kind": InferenceService::kind(&()),
            "status": {"autoscaling": autoscaling},
        });
        let api: Api<InferenceService> = Api::namespaced(
            self.client.clone(),
            &service.namespace().unwrap_or_default(),
        );
        api.patch_status(
            &service.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(status),
        )
        .await?;
        state.last_status = Some((Instant::now(), desired));
        Ok(())
    }

    /// Parameters of the autoscaler's merge patches: its own field manager.
    fn params() -> PatchParams {
        PatchParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PatchParams::default()
        }
    }

    /// Annotates every pod of the chosen groups so that the reconcile removes exactly those,
    /// and clears the mark from groups an earlier decision chose but that stayed.
    async fn mark_for_removal(
        &self,
        service: &InferenceService,
        groups: &[u32],
    ) -> anyhow::Result<()> {
        let namespace = service.namespace().unwrap_or_default();
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &namespace);
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let chosen: HashSet<String> = groups.iter().map(u32::to_string).collect();
        let selector = service
            .status
            .as_ref()
            .and_then(|s| s.selector.as_deref())
            .map(parse_selector)
            .transpose()
            .map_err(|e| anyhow::anyhow!("status.selector: {e}"))?
            .unwrap_or_default();
        let pods = self.stores.pods.state();
        let service_pods = pods.iter().filter(|pod| {
            pod.namespace().as_deref() == Some(namespace.as_str()) && selector.matches(pod.labels())
        });
        for pod in service_pods {
            let marked = pod.annotations().contains_key(SCALE_DOWN_ANNOTATION);
            let in_chosen = pod
                .labels()
                .get(GROUP_LABEL)
                .is_some_and(|g| chosen.contains(g));
            let value = match (in_chosen, marked) {
                (true, _) => json!(now),
                (false, true) => serde_json::Value::Null,
                (false, false) => continue,
            };
            let patch = json!({"metadata": {"annotations": {SCALE_DOWN_ANNOTATION: value}}});
            api.patch(&pod.name_any(), &Self::params(), &Patch::Merge(patch))
                .await?;
        }
        Ok(())
    }

    async fn remove_hpa(&self, service: &InferenceService) -> anyhow::Result<()> {
        let namespace = service.namespace().unwrap_or_default();
        let api: Api<HorizontalPodAutoscaler> = Api::namespaced(self.client.clone(), &namespace);
        let Some(existing) = api.get_opt(&service.name_any()).await? else {
            return Ok(());
        };
        let owned = existing
            .owner_references()
            .iter()
            .any(|o| Some(&o.uid) == service.uid().as_ref());
        if owned {
            api.delete(&existing.name_any(), &DeleteParams::default())
                .await?;
        }
        Ok(())
    }

    async fn warn(&self, service: &InferenceService, reason: &str, note: &str) {
        let event = Event {
            type_: EventType::Warning,
            reason: reason.to_owned(),
            note: Some(note.to_owned()),
            action: "Scale".to_owned(),
            secondary: None,
        };
        if let Err(error) = self
            .recorder
            .publish(&event, &service.object_ref(&()))
            .await
        {
            tracing::warn!(%error, "recording an autoscaling warning");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(
        group: u32,
        rank: u32,
        pod_ready: bool,
        report: Option<(WorkerState, u32, u32)>,
    ) -> WorkerView {
        WorkerView {
            group,
            rank,
            leaving: false,
            pod_ready,
            report: report.map(|(state, waiting, running)| LoadReport {
                state: state as i32,
                waiting,
                running,
                kv_cache_usage: 0.1 * f64::from(running),
                ..LoadReport::default()
            }),
        }
    }

    #[test]
    fn tensor_parallel_ranks_fold_into_whole_groups() {
        let workers = [
            // Group 0: both ranks ready; the batch is shared, so it counts once.
            worker(0, 0, true, Some((WorkerState::Ready, 3, 4))),
            worker(0, 1, true, Some((WorkerState::Ready, 3, 4))),
            // Group 1: rank 1 still loading.
            worker(1, 0, true, Some((WorkerState::Ready, 0, 0))),
            worker(1, 1, false, Some((WorkerState::WarmingUp, 0, 0))),
            // Group 2: rank 0 unreachable.
            worker(2, 0, true, None),
            worker(2, 1, true, Some((WorkerState::Ready, 0, 0))),
            // Group 3: draining after SIGTERM.
            worker(3, 0, false, Some((WorkerState::Draining, 1, 2))),
            worker(3, 1, false, Some((WorkerState::Draining, 1, 2))),
        ];
        let groups = group_loads(&workers);
        let states: Vec<(u32, GroupState)> = groups.iter().map(|g| (g.group, g.state)).collect();
        assert_eq!(
            states,
            vec![
                (0, GroupState::Ready),
                (1, GroupState::Warming),
                (2, GroupState::Warming),
                (3, GroupState::Draining),
            ]
        );
        assert_eq!((groups[0].waiting, groups[0].running), (3, 4));
        let observation = Observation {
            spec_replicas: 3,
            groups,
            wake_requested: false,
        };
        assert_eq!(observation.ready(), 1);
        assert_eq!(observation.warming(), 2);
        assert_eq!(observation.queue_depth(), 7);
    }

    #[test]
    fn a_service_sets_the_bounds_and_target_of_its_policy() {
        let spec: AutoscalingSpec = serde_json::from_value(serde_json::json!({
            "mode": "builtin", "minReplicas": 2, "maxReplicas": 7, "targetQueueDepth": 3
        }))
        .unwrap();
        let config = policy_config(&PolicyConfig::default(), &spec);
        assert_eq!(config.min_replicas, 2);
        assert_eq!(config.max_replicas, 7);
        assert_eq!(config.target_queue_per_replica, 3.0);
        assert_eq!(config.stable_window, PolicyConfig::default().stable_window);
        let zero: AutoscalingSpec = serde_json::from_value(serde_json::json!({
            "minReplicas": 0, "maxReplicas": 3
        }))
        .unwrap();
        let config = policy_config(&PolicyConfig::default(), &zero);
        assert_eq!(config.min_replicas, 0);
        Policy::new(config).expect("minReplicas 0 scales to zero");
    }

    fn service(spec: serde_json::Value, status: serde_json::Value) -> InferenceService {
        let mut object = serde_json::json!({
            "apiVersion": "npufleet.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "ml"},
            "spec": {
                "model": {"name": "smollm2", "source": {"imagePath": "/models/m.gguf"}},
                "accelerator": {"type": "cpu"},
            },
            "status": status,
        });
        for (key, value) in spec.as_object().unwrap() {
            object["spec"][key] = value.clone();
        }
        serde_json::from_value(object).unwrap()
    }

    #[test]
    fn the_count_is_the_autoscalers_and_always_within_bounds() {
        let builtin = json!({"mode": "builtin", "minReplicas": 1, "maxReplicas": 3});
        let decided = json!({"autoscaling": {"desiredReplicas": 2}});
        // A manifest's replicas above the maximum never creates more than the maximum.
        let fresh = service(json!({"replicas": 10, "autoscaling": builtin}), json!({}));
        assert_eq!(desired_replicas(&fresh), 3);
        // Once the autoscaler decided, a re-applied manifest's replicas changes nothing.
        let reapplied = service(
            json!({"replicas": 10, "autoscaling": builtin}),
            decided.clone(),
        );
        assert_eq!(desired_replicas(&reapplied), 2);
        let lowered = service(
            json!({"replicas": 1, "autoscaling": {"maxReplicas": 1}}),
            decided.clone(),
        );
        assert_eq!(
            desired_replicas(&lowered),
            1,
            "a lowered maximum cuts at once"
        );
        // Under an HPA, spec.replicas is the HPA's count, clamped too.
        let hpa = json!({"mode": "hpa", "minReplicas": 2, "maxReplicas": 4});
        let under_hpa = service(json!({"replicas": 9, "autoscaling": hpa}), decided);
        assert_eq!(desired_replicas(&under_hpa), 4);
        let by_hand = service(json!({"replicas": 9}), json!({}));
        assert_eq!(desired_replicas(&by_hand), 9);
        let zero = json!({"minReplicas": 0, "maxReplicas": 3});
        let at_zero = service(
            json!({"replicas": 1, "autoscaling": zero}),
            json!({"autoscaling": {"desiredReplicas": 0}}),
        );
        assert_eq!(desired_replicas(&at_zero), 0);
    }

    #[test]
    fn a_wake_request_counts_only_when_newer_than_the_scale_to_zero() {
        let at_zero = |annotation: Option<&str>| {
            let mut s = service(
                json!({"autoscaling": {"minReplicas": 0, "maxReplicas": 2}}),
                json!({"autoscaling": {"desiredReplicas": 0, "lastScaleTime": "2026-01-01T10:00:00Z"}}),
            );
            if let Some(value) = annotation {
                s.annotations_mut()
                    .insert(WAKE_REQUESTED_AT.to_owned(), value.to_owned());
            }
            s
        };
        assert_eq!(wake_requested(&at_zero(None)), Ok(false));
        assert_eq!(
            wake_requested(&at_zero(Some("2026-01-01T09:59:59Z"))),
            Ok(false)
        );
        assert_eq!(
            wake_requested(&at_zero(Some("2026-01-01T10:00:01.5Z"))),
            Ok(true)
        );
        let error = wake_requested(&at_zero(Some("soon"))).unwrap_err();
        assert!(
            error.contains(WAKE_REQUESTED_AT)
                && error.contains("\"soon\"")
                && error.contains("RFC 3339"),
            "{error}"
        );
    }
}

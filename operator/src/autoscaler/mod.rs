//! Queue-depth autoscaling of `InferenceService`s.
//!
//! Every tick (500 ms by default) the loop reads the load signal of each replica group's
//! serving pod (the groups as [`fleet::groups`] gathers them for the reconcile), feeds the
//! per-service [`policy::Policy`] and, for `mode: builtin`, records the decision in
//! `status.autoscaling.desiredReplicas`, with an event. For `mode: hpa` it only publishes the
//! load as the external metric and keeps the service's HPA in place. The loop runs on the
//! leader; the reading and publishing ([`collect`]) also runs on every other replica, so each
//! answers the external metrics API alike.
//!
//! One writer per count: with `mode: builtin` the reconcile follows
//! `status.autoscaling.desiredReplicas`, which only this loop writes (under its own field
//! manager), so a re-applied manifest's `spec.replicas` is the starting count and creates
//! nothing. The loop keeps `spec.replicas` (the scale subresource) equal to its count: it
//! writes each decision there, and a `spec.replicas` someone else set (`kubectl scale`, a
//! re-applied manifest) is put back at the next tick with a `ManualScaleReverted` warning,
//! as an HPA rescales a Deployment scaled by hand. With `mode: hpa` the
//! HorizontalPodAutoscaler owns `spec.replicas`, and a manifest should leave `replicas` out,
//! as for any HPA target. Either way the count is clamped to `[minReplicas, maxReplicas]`
//! before anything is created ([`fleet::desired_groups`]).
//!
//! A load that cannot be read is not a low one: the policy then never lowers the count, the
//! external metric is refused rather than summed without the missing workers, and the
//! `ScalingActive` condition in `status.autoscaling.conditions` turns `False` with reason
//! `MetricsUnavailable` (and a warning event) until every serving worker answers again.

pub mod capacity;
pub mod collect;
pub mod hpa;
pub mod load;
pub mod objectives;
pub mod policy;
pub mod sim;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::{Client, Resource, ResourceExt};
use npufleet_contract::annotations::WAKE_REQUESTED_AT;
use npufleet_crds::{
    AutoscalingMode, AutoscalingSpec, InferenceService, ObjectivePrediction, ObjectivesSpec,
    ObjectivesStatus,
};
use serde_json::json;
use tokio::time::Instant;

use crate::cache::Stores;
use crate::external_metrics::MetricsStore;
use crate::fleet::{self, SCALE_DOWN_ANNOTATION};
use crate::labels::GROUP as GROUP_LABEL;
use collect::Collector;
use npufleet_contract::proto::npufleet::v1::{LoadReport, WorkerState};
use objectives::{GroupSample, Prediction, Sizing, Target, Targets, Tracker};
use policy::{Decision, GroupLoad, GroupState, Observation, Policy, PolicyConfig, Readings};

/// Field manager of everything the autoscaler writes.
pub const FIELD_MANAGER: &str = "npufleet-autoscaler";
/// The condition in `status.autoscaling.conditions` saying whether the autoscaler reads the
/// load it scales on, named as on a HorizontalPodAutoscaler.
pub const SCALING_ACTIVE: &str = "ScalingActive";
/// `ScalingActive=False`: a serving worker's load could not be read (also the warning's reason).
pub const METRICS_UNAVAILABLE: &str = policy::Reason::MetricsUnavailable.as_str();
/// `ScalingActive=True` again: every serving worker's load is read.
pub const VALID_METRIC_FOUND: &str = "ValidMetricFound";
/// The warning when a `spec.replicas` set by someone else is put back to the autoscaler's count.
pub const MANUAL_SCALE_REVERTED: &str = "ManualScaleReverted";
/// The condition in `status.autoscaling.conditions` saying whether the ready replica groups
/// are predicted to meet `spec.autoscaling.objectives` (also the reason when they are).
pub const OBJECTIVES_MET: &str = "ObjectivesMet";
/// `ObjectivesMet=False`: an objective is predicted to be missed (also the warning's reason).
pub const OBJECTIVE_MISSED: &str = "ObjectiveMissed";

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

/// One replica group as the autoscaler sees it: its pods as [`fleet::groups`] gathers them,
/// and the load report of its serving pod (rank 0), whose batch every rank shares.
#[derive(Clone, Debug)]
pub struct GroupView {
    pub group: u32,
    /// A pod of the group is terminating.
    pub leaving: bool,
    /// [`fleet::ReplicaGroup::is_ready`]: every rank has a ready pod and none is leaving.
    pub ready: bool,
    /// The serving pod's load report, or why there is none.
    pub report: Result<LoadReport, String>,
}

impl GroupView {
    /// The view of group `number` of `ranks` ranks, before its load is read: the report says
    /// why it cannot be until it is.
    pub fn new(number: u32, group: &fleet::ReplicaGroup<'_>, ranks: i32) -> Self {
        let unread = match group.serving_pod() {
            Some(pod) => format!("pod {} has no IP", pod.name_any()),
            None => format!("replica group {number} has no serving pod"),
        };
        Self {
            group: number,
            leaving: group.terminating > 0,
            ready: group.is_ready(ranks),
            report: Err(unread),
        }
    }
}

/// Each group's state and load. A group serves only when all its pods are ready and its
/// serving pod reports ready; a group whose pods are all ready but whose load could not be
/// read is `Unread`.
pub fn group_loads(groups: &[GroupView]) -> Vec<GroupLoad> {
    groups
        .iter()
        .map(|view| {
            let report = view.report.as_ref().ok();
            let state = if view.leaving
                || report.is_some_and(|r| {
                    matches!(r.state(), WorkerState::Draining | WorkerState::Drained)
                }) {
                GroupState::Draining
            } else if !view.ready {
                GroupState::Warming
            } else if let Some(report) = report {
                if report.state() == WorkerState::Ready {
                    GroupState::Ready
                } else {
                    GroupState::Warming
                }
            } else {
                GroupState::Unread
            };
            GroupLoad {
                group: view.group,
                state,
                waiting: report.map_or(0, |r| r.waiting),
                running: report.map_or(0, |r| r.running),
                kv_usage: report.map_or(0.0, |r| r.kv_cache_usage),
            }
        })
        .collect()
}

/// Each group as the objectives' tracker needs it: whether it serves, and its serving
/// worker's counters.
pub fn group_samples(groups: &[GroupView]) -> Vec<GroupSample> {
    group_loads(groups)
        .iter()
        .zip(groups)
        .map(|(load, view)| {
            let report = view.report.as_ref().ok();
            GroupSample {
                group: view.group,
                ready: load.state == GroupState::Ready,
                warming: load.state == GroupState::Warming,
                counters: report.and_then(objectives::Counters::of),
                max_batch: report.map(|r| r.max_batch_size).filter(|&b| b > 0),
            }
        })
        .collect()
}

/// How the load reports of the ready groups' serving workers went, the first failure by
/// group.
pub fn readings(groups: &[GroupView]) -> Readings {
    let mut serving: Vec<&GroupView> = groups.iter().filter(|g| g.ready).collect();
    serving.sort_by_key(|g| g.group);
    let failures: Vec<&String> = serving
        .iter()
        .filter_map(|g| g.report.as_ref().err())
        .collect();
    let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    Readings {
        asked: count(serving.len()),
        failed: count(failures.len()),
        first_error: failures.first().map(|e| (*e).clone()),
    }
}

/// The `ScalingActive` condition after a tick with `readings`, given the one the service has;
/// `None` when that stays, or when there is none and every serving worker answered (a
/// service whose load was always read carries no condition).
fn scaling_active(
    previous: Option<&Condition>,
    mode: AutoscalingMode,
    readings: &Readings,
    generation: Option<i64>,
    now: &Time,
) -> Option<Condition> {
    let (status, reason, message) = if readings.incomplete() {
        let consequence = match mode {
            AutoscalingMode::Builtin => {
                "the replica count will not fall until every serving worker answers"
            }
            AutoscalingMode::Hpa => {
                "the external metric is refused, so the HorizontalPodAutoscaler holds its count"
            }
        };
        (
            "False",
            METRICS_UNAVAILABLE,
            format!("{readings}; {consequence}"),
        )
    } else {
        previous?;
        (
            "True",
            VALID_METRIC_FOUND,
            "the load of every serving worker is read".to_owned(),
        )
    };
    if let Some(p) = previous
        && (p.status.as_str(), p.reason.as_str(), p.message.as_str()) == (status, reason, &message)
    {
        return None;
    }
    let last_transition_time = match previous {
        Some(p) if p.status == status => p.last_transition_time.clone(),
        _ => now.clone(),
    };
    Some(Condition {
        type_: SCALING_ACTIVE.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message,
        observed_generation: generation,
        last_transition_time,
    })
}

struct ServiceState {
    policy: Policy,
    /// When `status.autoscaling` was last written, and the desired count it said.
    last_status: Option<(Instant, i32)>,
    last_scale_time: Option<Time>,
    /// A wake annotation already reported as unreadable.
    bad_wake_request: Option<String>,
    /// The generation of the service as it was when this loop last wrote `spec.replicas`:
    /// until the cache holds a later one, a `spec.replicas` that differs is the cache
    /// lagging the write, not someone else's.
    replicas_written_over: Option<i64>,
    /// The latency objectives' memory; kept while the service has objectives or learns
    /// its capacity.
    tracker: Tracker,
    /// The last evaluation of the objectives, for the status.
    objectives: Option<ObjectivesStatus>,
    /// The `ObjectivesMet` condition as last decided, and whether it turned since the event
    /// that says so was recorded.
    objectives_met: Option<(Condition, bool)>,
    /// Since when the predictions have said the other status than `objectives_met`'s.
    objectives_turning_since: Option<std::time::Duration>,
}

/// The objectives as fractions and seconds; `Err` names the field that is wrong.
pub fn targets(spec: &ObjectivesSpec) -> Result<Targets, String> {
    let target = |name: &str, objective: &Option<npufleet_crds::LatencyObjective>| {
        objective
            .as_ref()
            .map(|o| {
                let field = format!("spec.autoscaling.objectives.{name}");
                Ok::<Target, String>(Target {
                    quantile: o
                        .quantile()
                        .map_err(|e| format!("{field}.percentile: {e}"))?,
                    seconds: o
                        .target()
                        .map_err(|e| format!("{field}.target: {e}"))?
                        .as_secs_f64(),
                })
            })
            .transpose()
    };
    let targets = Targets {
        ttft: target("ttft", &spec.ttft)?,
        tpot: target("tpot", &spec.tpot)?,
    };
    if targets.ttft.is_none() && targets.tpot.is_none() {
        return Err("spec.autoscaling.objectives must set ttft, tpot or both".to_owned());
    }
    Ok(targets)
}

fn seconds(s: f64) -> String {
    if s < 1.0 {
        format!("{:.0}ms", s * 1000.0)
    } else {
        format!("{s:.2}s")
    }
}

/// The status of an evaluation of the objectives: the prediction with the `ready` groups
/// and with the count implied.
fn objectives_status(
    targets: &Targets,
    demand: &objectives::Demand,
    ready_seconds: f64,
    sizing: &Sizing,
    at_ready: &Prediction,
    (ttft_calibration, tpot_calibration): (
        Option<&objectives::Calibration>,
        Option<&objectives::Calibration>,
    ),
) -> ObjectivesStatus {
    let round = |x: f64, digits: i32| {
        let scale = 10f64.powi(digits);
        (x * scale).round() / scale
    };
    let entry = |target: Option<Target>, ready: Option<f64>, implied: Option<f64>| {
        target.map(|t| ObjectivePrediction {
            percentile: round(t.quantile * 100.0, 3),
            target_seconds: round(t.seconds, 4),
            predicted_seconds: ready.map(|p| round(p, 4)),
            predicted_seconds_at_implied: implied.map(|p| round(p, 4)),
            ..Default::default()
        })
    };
    let calibrated =
        |e: ObjectivePrediction, c: Option<&objectives::Calibration>| ObjectivePrediction {
            measured_seconds: c.map(|c| round(c.measured, 4)),
            calibration: c.map(|c| round(c.factor, 3)),
            ..e
        };
    let ttft = entry(targets.ttft, at_ready.ttft, sizing.at_replicas.ttft)
        .map(|e| calibrated(e, ttft_calibration));
    let tpot = entry(targets.tpot, at_ready.tpot, sizing.at_replicas.tpot)
        .map(|e| calibrated(e, tpot_calibration));
    ObjectivesStatus {
        arrival_rate: Some(round(demand.measured_rate, 3)),
        mean_prompt_tokens: Some(round(demand.mean_prompt, 1)),
        mean_output_tokens: Some(round(demand.mean_output, 1)),
        ready_seconds: Some(round(ready_seconds, 2)),
        replicas_implied: Some(i32::try_from(sizing.replicas).unwrap_or(i32::MAX)),
        ttft,
        tpot,
    }
}

/// How long the predictions must say the other status before `ObjectivesMet` turns: a
/// prediction near its target crosses it tick by tick (the short window's Poisson noise),
/// and a condition and event for each crossing bury the turns that last.
const OBJECTIVES_SETTLE: std::time::Duration = objectives::SHORT_WINDOW;

/// Whether this tick's `ObjectivesMet` is taken, and since when a turn has been pending: a
/// turn from the last condition taken (`turning`) is taken once it has held
/// [`OBJECTIVES_SETTLE`] from `since`, the tick it was first seen; anything else at once.
fn settled_turn(
    turning: bool,
    since: Option<std::time::Duration>,
    now: std::time::Duration,
) -> (bool, Option<std::time::Duration>) {
    if !turning {
        return (true, None);
    }
    let since = since.unwrap_or(now);
    if now.saturating_sub(since) >= OBJECTIVES_SETTLE {
        (true, None)
    } else {
        (false, Some(since))
    }
}

/// The `ObjectivesMet` condition for a prediction with the `ready` groups: which objective
/// is missed, by how much, and what count would meet it.
fn objectives_met(
    previous: Option<&Condition>,
    targets: &Targets,
    at_ready: &Prediction,
    ready: u32,
    sizing: &Sizing,
    generation: Option<i64>,
    now: &Time,
) -> Condition {
    let mut missed = Vec::new();
    let mut met = Vec::new();
    for (name, target, predicted) in [
        ("ttft", targets.ttft, at_ready.ttft),
        ("tpot", targets.tpot, at_ready.tpot),
    ] {
        let Some(target) = target else { continue };
        let p = target.quantile * 100.0;
        let target_text = seconds(target.seconds);
        match predicted {
            Some(value) if value <= target.seconds => met.push(format!(
                "{name} p{p} predicted {} (target {target_text})",
                seconds(value)
            )),
            Some(value) => missed.push(format!(
                "{name} p{p} predicted {} over the target {target_text}",
                seconds(value)
            )),
            None => missed.push(format!(
                "{name} p{p} unbounded (target {target_text}): the arrivals outrun them"
            )),
        }
    }
    let implied = if sizing.met {
        format!("{} replica groups meet every objective", sizing.replicas)
    } else {
        format!(
            "no count meets every objective; {} replica groups come closest",
            sizing.replicas
        )
    };
    let (status, reason, message) = if missed.is_empty() {
        (
            "True",
            OBJECTIVES_MET,
            format!(
                "with {ready} ready replica groups: {}; {implied}",
                met.join(", ")
            ),
        )
    } else {
        (
            "False",
            OBJECTIVE_MISSED,
            format!(
                "with {ready} ready replica groups: {}; {implied}",
                missed.into_iter().chain(met).collect::<Vec<_>>().join(", ")
            ),
        )
    };
    let last_transition_time = match previous {
        Some(p) if p.status == status => p.last_transition_time.clone(),
        _ => now.clone(),
    };
    Condition {
        type_: OBJECTIVES_MET.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message,
        observed_generation: generation,
        last_transition_time,
    }
}

/// Events of one service with one reason. A recorder folds an event into the series of an
/// earlier one with the same reason, keeping the earlier note, so a new note starts a series
/// of its own on a new recorder, and only a repeated note counts up.
struct EventSeries {
    note: String,
    recorder: Recorder,
}

/// The `ScalingActive` condition of one service as this loop last decided it.
struct ScalingActive {
    condition: Condition,
    /// Whether the status holds it.
    written: bool,
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
    reporter: Reporter,
    /// The event series of each service and reason.
    events: HashMap<(ObjectRef<InferenceService>, String), EventSeries>,
    stores: Stores,
    policies: HashMap<ObjectRef<InferenceService>, ServiceState>,
    /// What this loop knows of each service's HPA.
    hpas: HashMap<ObjectRef<InferenceService>, HpaState>,
    /// Services whose autoscaling settings were rejected, with those settings, so the
    /// warning is recorded once.
    invalid: HashMap<ObjectRef<InferenceService>, PolicyConfig>,
    /// Each service's `ScalingActive` condition, once its load has failed to read.
    scaling_active: HashMap<ObjectRef<InferenceService>, ScalingActive>,
    /// The capacity an HPA-scaled service's objectives learned, as last written to its
    /// status, and when.
    hpa_capacity: HashMap<ObjectRef<InferenceService>, (capacity::Capacity, Instant)>,
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
            reporter,
            events: HashMap::new(),
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
            scaling_active: HashMap::new(),
            hpa_capacity: HashMap::new(),
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
            .map(|(s, _, _)| ObjectRef::from_obj(s.as_ref()))
            .collect();
        self.policies.retain(|k, _| live.contains(k));
        self.hpas.retain(|k, _| live.contains(k));
        self.invalid.retain(|k, _| live.contains(k));
        self.scaling_active.retain(|k, _| live.contains(k));
        self.hpa_capacity.retain(|k, _| live.contains(k));
        self.events.retain(|(k, _), _| live.contains(k));

        for (service, observation, samples) in observed {
            if let Err(error) = self.handle(&service, observation, samples).await {
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
        observation: Observation,
        samples: Vec<GroupSample>,
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
                self.follow_readings(service, autoscaling.mode, &observation.readings)
                    .await;
                self.policies.remove(&key);
                let learned = self.collector.learned_capacity(&namespace, &name);
                let capacity_due = learned.is_some_and(|now| {
                    self.hpa_capacity.get(&key).is_none_or(|(written, at)| {
                        *written != now && at.elapsed() >= self.settings.status_interval
                    })
                });
                if capacity_due || self.scaling_active.get(&key).is_some_and(|s| !s.written) {
                    self.write_status(service, None).await?;
                }
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
                self.handle_builtin(service, autoscaling, observation, samples)
                    .await
            }
        }
    }

    /// The built-in loop's tick for one service: on its queue depth, or on its latency
    /// objectives when it has some.
    async fn handle_builtin(
        &mut self,
        service: &InferenceService,
        autoscaling: &AutoscalingSpec,
        mut observation: Observation,
        samples: Vec<GroupSample>,
    ) -> anyhow::Result<()> {
        let key = ObjectRef::from_obj(service);
        let objectives = autoscaling.objectives.as_ref();
        self.forget_hpa(service, &key).await?;
        let config = policy_config(&self.settings.policy, autoscaling);
        let current = self.policies.get(&key).map(|s| s.policy.config());
        if current != Some(&config) {
            match Policy::new(config.clone()) {
                Ok(policy) => {
                    let status = service.status.as_ref().and_then(|s| s.autoscaling.as_ref());
                    // The capacity learned so far outlives a change of bounds, and a
                    // restart through the status.
                    let (tracker, evaluated, objectives_met) = match self.policies.remove(&key) {
                        Some(old) => (old.tracker, old.objectives, old.objectives_met),
                        None => (
                            Tracker::new(
                                status
                                    .and_then(|a| a.capacity.as_ref())
                                    .map(capacity::Capacity::from_status)
                                    .unwrap_or_default(),
                                status
                                    .and_then(|a| a.objectives.as_ref())
                                    .and_then(|o| o.ready_seconds),
                            ),
                            status.and_then(|a| a.objectives.clone()),
                            status
                                .and_then(|a| {
                                    a.conditions.iter().find(|c| c.type_ == OBJECTIVES_MET)
                                })
                                .map(|c| (c.clone(), false)),
                        ),
                    };
                    self.policies.insert(
                        key.clone(),
                        ServiceState {
                            policy,
                            last_status: None,
                            last_scale_time: status.and_then(|a| a.last_scale_time.clone()),
                            bad_wake_request: None,
                            replicas_written_over: None,
                            tracker,
                            objectives: evaluated,
                            objectives_met,
                            objectives_turning_since: None,
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
        let demand = match objectives {
            None => {
                let state = self.policies.get_mut(&key).expect("inserted above");
                // The capacity is learned whatever the service scales on.
                state.tracker.observe(now, &samples);
                None
            }
            Some(spec) => match targets(spec) {
                Ok(targets) => {
                    let demand =
                        self.objective_demand(service, &targets, &mut observation, &samples, now);
                    Some(demand)
                }
                Err(error) => {
                    let config = policy_config(&self.settings.policy, autoscaling);
                    if self.invalid.get(&key) != Some(&config) {
                        self.warn(service, "InvalidAutoscaling", &error).await;
                        self.invalid.insert(key, config);
                    }
                    return Ok(());
                }
            },
        };
        self.follow_readings(service, AutoscalingMode::Builtin, &observation.readings)
            .await;
        self.follow_objectives(service).await;
        let state = self.policies.get_mut(&key).expect("inserted above");
        let decision = match demand {
            None => state.policy.decide(now, &observation),
            Some(demand) => state.policy.decide_on(now, &observation, demand),
        };
        self.apply(service, &observation, &decision).await
    }

    /// The replica groups the objectives ask for this tick, the status and `ObjectivesMet`
    /// condition that say why; `None` while the demand is not known. Workers that answer
    /// without the counters the objectives need count as unread, so the count holds and
    /// `ScalingActive` says why.
    fn objective_demand(
        &mut self,
        service: &InferenceService,
        targets: &Targets,
        observation: &mut Observation,
        samples: &[GroupSample],
        now: std::time::Duration,
    ) -> Option<f64> {
        let key = ObjectRef::from_obj(service);
        let max_replicas =
            u32::try_from(service.spec.autoscaling.as_ref()?.max_replicas).unwrap_or(1);
        let state = self.policies.get_mut(&key)?;
        let waiting = observation.waiting();
        let ready = observation.ready();
        let evaluation = match objectives::evaluate(
            &mut state.tracker,
            now,
            samples,
            (waiting, ready),
            targets,
            max_replicas,
        ) {
            Ok(evaluation) => evaluation,
            Err(objectives::Unknown::Starting) => return None,
            Err(objectives::Unknown::NoCounters(why)) => {
                let readings = &mut observation.readings;
                readings.failed = readings.asked.max(1);
                readings.asked = readings.failed;
                readings.first_error = Some(why);
                return None;
            }
        };
        let objectives::Evaluation {
            demand,
            sizing,
            at_ready,
            ttft_calibration,
            tpot_calibration,
        } = evaluation;
        let ready_seconds = state
            .tracker
            .ready_seconds()
            .unwrap_or(objectives::DEFAULT_READY_SECONDS);
        state.objectives = Some(objectives_status(
            targets,
            &demand,
            ready_seconds,
            &sizing,
            &at_ready,
            (ttft_calibration.as_ref(), tpot_calibration.as_ref()),
        ));
        // A fleet at zero with nothing arriving misses nothing.
        if ready > 0 || demand.measured_rate > 0.0 {
            let previous = state.objectives_met.as_ref().map(|(c, _)| c);
            let condition = objectives_met(
                previous,
                targets,
                &at_ready,
                ready,
                &sizing,
                service.metadata.generation,
                &Time(k8s_openapi::jiff::Timestamp::now()),
            );
            let turned = previous.is_none_or(|p| p.status != condition.status);
            let turning = previous.is_some() && turned;
            let (settled, since) = settled_turn(turning, state.objectives_turning_since, now);
            state.objectives_turning_since = since;
            if settled {
                let unannounced = state.objectives_met.as_ref().is_some_and(|(_, u)| *u);
                state.objectives_met = Some((condition, turned || unannounced));
            }
        }
        Some(sizing.groups)
    }

    /// Records an event when `ObjectivesMet` turns, and has the status written at once.
    async fn follow_objectives(&mut self, service: &InferenceService) {
        let key = ObjectRef::from_obj(service);
        let Some(state) = self.policies.get_mut(&key) else {
            return;
        };
        let Some((condition, true)) = state.objectives_met.clone() else {
            return;
        };
        state.objectives_met = Some((condition.clone(), false));
        state.last_status = None;
        self.publish_condition(service, &condition).await;
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
            self.write_status(service, Some(decision)).await?;
            self.write_replicas(service, desired).await?;
            let message = decision.message(current);
            self.publish(
                service,
                EventType::Normal,
                decision.reason.as_str(),
                &message,
            )
            .await;
            tracing::info!(service = %name, namespace, "{message}");
        } else if service.spec.replicas != desired {
            let state = self.policies.get(&key).expect("present");
            if state.replicas_written_over < service.metadata.generation {
                self.write_replicas(service, desired).await?;
                let message = format!(
                    "spec.replicas {} reverted to {desired}: with spec.autoscaling.mode builtin the autoscaler owns the replica count ({}); bound it with spec.autoscaling.minReplicas and maxReplicas, or remove spec.autoscaling to set replicas by hand",
                    service.spec.replicas,
                    decision.message(current)
                );
                self.publish(service, EventType::Warning, MANUAL_SCALE_REVERTED, &message)
                    .await;
                tracing::info!(service = %name, namespace, "{message}");
            }
        }

        let state = self.policies.get(&key).expect("present");
        let condition_unwritten = self.scaling_active.get(&key).is_some_and(|s| !s.written);
        let due = condition_unwritten
            || state.last_status.is_none_or(|(at, written)| {
                written != desired || at.elapsed() >= self.settings.status_interval
            });
        if due {
            self.write_status(service, Some(decision)).await?;
        }
        Ok(())
    }

    /// Writes the count into `spec.replicas` through the scale subresource.
    async fn write_replicas(
        &mut self,
        service: &InferenceService,
        replicas: i32,
    ) -> anyhow::Result<()> {
        let api: Api<InferenceService> = Api::namespaced(
            self.client.clone(),
            &service.namespace().unwrap_or_default(),
        );
        api.patch_scale(
            &service.name_any(),
            &Self::params(),
            &Patch::Merge(json!({"spec": {"replicas": replicas}})),
        )
        .await?;
        let key = ObjectRef::from_obj(service);
        if let Some(state) = self.policies.get_mut(&key) {
            state.replicas_written_over = service.metadata.generation;
        }
        Ok(())
    }

    /// Keeps the service's `ScalingActive` condition in step with this tick's readings, and
    /// records an event when it turns.
    async fn follow_readings(
        &mut self,
        service: &InferenceService,
        mode: AutoscalingMode,
        readings: &Readings,
    ) {
        let key = ObjectRef::from_obj(service);
        // After a restart (or a change of leader) the status says what was last decided.
        let previous = match self.scaling_active.get(&key) {
            Some(known) => Some(known.condition.clone()),
            None => {
                let written = service
                    .status
                    .as_ref()
                    .and_then(|s| s.autoscaling.as_ref())
                    .and_then(|a| a.conditions.iter().find(|c| c.type_ == SCALING_ACTIVE))
                    .cloned();
                if let Some(condition) = &written {
                    let known = ScalingActive {
                        condition: condition.clone(),
                        written: true,
                    };
                    self.scaling_active.insert(key.clone(), known);
                }
                written
            }
        };
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        let Some(condition) = scaling_active(
            previous.as_ref(),
            mode,
            readings,
            service.metadata.generation,
            &now,
        ) else {
            return;
        };
        if previous.is_none_or(|p| p.status != condition.status) {
            self.publish_condition(service, &condition).await;
        }
        let known = ScalingActive {
            condition,
            written: false,
        };
        self.scaling_active.insert(key, known);
    }

    /// Applies `status.autoscaling` under the autoscaler's field manager: the decision (with
    /// `mode: builtin`) and the `ScalingActive` condition, if the service has one.
    async fn write_status(
        &mut self,
        service: &InferenceService,
        decision: Option<&Decision>,
    ) -> anyhow::Result<()> {
        let key = ObjectRef::from_obj(service);
        let mut autoscaling = json!({});
        if let Some(decision) = decision {
            autoscaling["desiredReplicas"] =
                json!(i32::try_from(decision.desired).unwrap_or(i32::MAX));
            if let Some(queue) = decision.queue_per_replica {
                autoscaling["queueDepth"] = json!((queue * 100.0).round() / 100.0);
            }
            let state = self.policies.get(&key).expect("present");
            if let Some(at) = &state.last_scale_time {
                autoscaling["lastScaleTime"] = json!(at);
            }
        }
        let mut conditions = Vec::new();
        if let Some(scaling_active) = self.scaling_active.get(&key) {
            conditions.push(scaling_active.condition.clone());
        }
        if decision.is_some()
            && let Some(state) = self.policies.get(&key)
        {
            if service
                .spec
                .autoscaling
                .as_ref()
                .is_some_and(|a| a.objectives.is_some())
            {
                if let Some(objectives) = &state.objectives {
                    autoscaling["objectives"] = json!(objectives);
                }
                if let Some((condition, _)) = &state.objectives_met {
                    conditions.push(condition.clone());
                }
            }
            if state.tracker.capacity() != &capacity::Capacity::default() {
                autoscaling["capacity"] = json!(state.tracker.capacity().to_status());
            }
        }
        let hpa = service
            .spec
            .autoscaling
            .as_ref()
            .is_some_and(|a| a.mode == AutoscalingMode::Hpa);
        if hpa
            && let Some(learned) = self.collector.learned_capacity(
                &service.namespace().unwrap_or_default(),
                &service.name_any(),
            )
        {
            autoscaling["capacity"] = json!(learned.to_status());
            self.hpa_capacity
                .insert(key.clone(), (learned, Instant::now()));
        }
        if !conditions.is_empty() {
            autoscaling["conditions"] = json!(conditions);
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
        if let Some(scaling_active) = self.scaling_active.get_mut(&key) {
            scaling_active.written = true;
        }
        if let (Some(decision), Some(state)) = (decision, self.policies.get_mut(&key)) {
            let desired = i32::try_from(decision.desired).unwrap_or(i32::MAX);
            state.last_status = Some((Instant::now(), desired));
        }
        Ok(())
    }

    /// Parameters of the autoscaler's merge patches: its own field manager.
    fn params() -> PatchParams {
        PatchParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PatchParams::default()
        }
    }

    /// Annotates the serving pod of each chosen group so that the reconcile removes exactly those,
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
        let pods = self.stores.pods.state();
        for pod in fleet::serving_pods(service, pods.iter().map(AsRef::as_ref)) {
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

    async fn warn(&mut self, service: &InferenceService, reason: &str, note: &str) {
        self.publish(service, EventType::Warning, reason, note)
            .await;
    }

    /// A condition's turn as an event: a warning when it turns `False`.
    async fn publish_condition(&mut self, service: &InferenceService, condition: &Condition) {
        let type_ = if condition.status == "True" {
            EventType::Normal
        } else {
            EventType::Warning
        };
        self.publish(service, type_, &condition.reason, &condition.message)
            .await;
    }

    async fn publish(
        &mut self,
        service: &InferenceService,
        type_: EventType,
        reason: &str,
        note: &str,
    ) {
        let event = Event {
            type_,
            reason: reason.to_owned(),
            note: Some(note.to_owned()),
            action: "Scale".to_owned(),
            secondary: None,
        };
        let key = (ObjectRef::from_obj(service), reason.to_owned());
        if self
            .events
            .get(&key)
            .is_none_or(|series| series.note != note)
        {
            let series = EventSeries {
                note: note.to_owned(),
                recorder: Recorder::new(self.client.clone(), self.reporter.clone()),
            };
            self.events.insert(key.clone(), series);
        }
        let recorder = &self.events[&key].recorder;
        if let Err(error) = recorder.publish(&event, &service.object_ref(&())).await {
            tracing::warn!(%error, service = %service.name_any(), reason, "recording an autoscaling event");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::labels;

    fn report(state: WorkerState, waiting: u32, running: u32) -> Result<LoadReport, String> {
        Ok(LoadReport {
            state: state as i32,
            waiting,
            running,
            kv_cache_usage: 0.1 * f64::from(running),
            ..LoadReport::default()
        })
    }

    fn unread(group: u32) -> Result<LoadReport, String> {
        Err(format!(
            "no load report from 10.0.{group}.0:8001 within 400ms"
        ))
    }

    /// Rank `rank` of replica group `group` of `service`, Running and Ready or not.
    fn pod(service: &str, group: i32, rank: i32, ready: bool) -> Pod {
        serde_json::from_value(json!({
            "metadata": {
                "name": format!("{service}-{group}-{rank}"),
                "namespace": "ml",
                "labels": {
                    labels::INFERENCE_SERVICE: service,
                    labels::GROUP: group.to_string(),
                    labels::RANK: rank.to_string(),
                },
            },
            "status": {
                "phase": "Running",
                "podIP": format!("10.0.{group}.{rank}"),
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
            },
        }))
        .unwrap()
    }

    #[test]
    fn a_group_serves_only_when_every_rank_does_and_its_serving_pod_reports_ready() {
        let service = service(json!({"parallelism": {"tensor": 2}}), json!({}));
        let mut leaving = pod("chat", 3, 1, true);
        leaving.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::now()));
        let pods = [
            // Group 0: both ranks ready.
            pod("chat", 0, 0, true),
            pod("chat", 0, 1, true),
            // Group 1: rank 1 still loading, though rank 0 says it is ready.
            pod("chat", 1, 0, true),
            pod("chat", 1, 1, false),
            // Group 2: ready, its serving pod unreachable.
            pod("chat", 2, 0, true),
            pod("chat", 2, 1, true),
            // Group 3: a rank is leaving.
            pod("chat", 3, 0, true),
            leaving,
            // Group 4: rank 1 not made yet.
            pod("chat", 4, 0, true),
            // Another service's pod.
            pod("other", 5, 0, true),
        ];
        let mut views = collect::group_views(&service, &pods);
        let addresses: Vec<Option<&load::LoadTarget>> =
            views.iter().map(|(_, a)| a.as_ref()).collect();
        let port = npufleet_contract::ports::GRPC_PORT;
        assert_eq!(
            addresses[0],
            Some(&load::LoadTarget::Worker(format!("10.0.0.0:{port}")))
        );
        assert_eq!(addresses.len(), 5, "{addresses:?}");
        for (view, _) in &mut views {
            view.report = match view.group {
                2 => unread(2),
                group => report(WorkerState::Ready, group, group + 1),
            };
        }
        let views: Vec<GroupView> = views.into_iter().map(|(view, _)| view).collect();
        let groups = group_loads(&views);
        let states: Vec<(u32, GroupState)> = groups.iter().map(|g| (g.group, g.state)).collect();
        assert_eq!(
            states,
            vec![
                (0, GroupState::Ready),
                (1, GroupState::Warming),
                (2, GroupState::Unread),
                (3, GroupState::Draining),
                (4, GroupState::Warming),
            ]
        );
        assert_eq!((groups[0].waiting, groups[0].running), (0, 1));
        let observation = Observation {
            spec_replicas: 3,
            groups,
            wake_requested: false,
            readings: readings(&views),
        };
        assert_eq!(observation.ready(), 1);
        assert_eq!(
            observation.warming(),
            1,
            "an unread group is not on its way"
        );
        assert_eq!(observation.queue_depth(), 1, "the ready group's load alone");
        assert_eq!(
            observation.readings.to_string(),
            "the load of 1 of 2 serving workers could not be read; first: no load report from 10.0.2.0:8001 within 400ms"
        );
    }

    #[test]
    fn only_ready_groups_count_as_workers_whose_load_is_missing() {
        let view = |group, ready, report| GroupView {
            group,
            leaving: false,
            ready,
            report,
        };
        let views = [
            // Loading: no answer is expected yet.
            view(0, false, unread(0)),
            view(2, true, unread(2)),
            view(1, true, unread(1)),
            view(3, true, report(WorkerState::Ready, 0, 0)),
        ];
        let seen = readings(&views);
        assert_eq!((seen.failed, seen.asked), (2, 3));
        assert!(seen.incomplete() && !seen.none());
        assert_eq!(
            seen.first_error.as_deref(),
            Some("no load report from 10.0.1.0:8001 within 400ms"),
            "the first by group"
        );
        let all_down = readings(&views[1..3]);
        assert!(all_down.none());
        let loading = readings(&views[..1]);
        assert!(!loading.incomplete() && loading.asked == 0);
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

    pub(super) use crate::fleet::tests::service;

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

    #[test]
    fn objectives_become_fractions_and_seconds_and_a_bad_one_is_named() {
        let spec: ObjectivesSpec = serde_json::from_value(json!({
            "ttft": {"percentile": 95, "target": "1.5s"},
            "tpot": {"target": "80ms"},
        }))
        .unwrap();
        let t = targets(&spec).unwrap();
        assert_eq!(
            t.ttft,
            Some(Target {
                quantile: 0.95,
                seconds: 1.5
            })
        );
        assert_eq!(t.tpot.map(|t| (t.quantile, t.seconds)), Some((0.9, 0.08)));
        let bad: ObjectivesSpec =
            serde_json::from_value(json!({"tpot": {"target": "soon"}})).unwrap();
        let error = targets(&bad).unwrap_err();
        assert!(
            error.starts_with("spec.autoscaling.objectives.tpot.target: \"soon\""),
            "{error}"
        );
        assert!(targets(&ObjectivesSpec::default()).is_err());
    }

    #[test]
    fn objectives_met_turns_only_once_the_other_status_held_the_settling_time() {
        let s = std::time::Duration::from_secs_f64;
        // The first condition is taken at once, as is the same status again.
        assert_eq!(settled_turn(false, None, s(1.0)), (true, None));
        assert_eq!(settled_turn(false, Some(s(1.0)), s(2.0)), (true, None));
        // A turn waits, from the tick it was first seen, and a tick back resets it.
        assert_eq!(settled_turn(true, None, s(10.0)), (false, Some(s(10.0))));
        assert_eq!(
            settled_turn(true, Some(s(10.0)), s(14.5)),
            (false, Some(s(10.0)))
        );
        assert_eq!(settled_turn(true, Some(s(10.0)), s(15.0)), (true, None));
        assert_eq!(settled_turn(false, Some(s(10.0)), s(12.0)), (true, None));
    }

    #[test]
    fn objectives_met_names_the_objective_missed_and_the_count_that_would_meet_it() {
        let t = Targets {
            ttft: Some(Target {
                quantile: 0.9,
                seconds: 0.8,
            }),
            tpot: Some(Target {
                quantile: 0.9,
                seconds: 0.08,
            }),
        };
        let sizing = Sizing {
            replicas: 3,
            groups: 2.4,
            met: true,
            at_replicas: Prediction {
                ttft: Some(0.5),
                tpot: Some(0.04),
            },
        };
        let at = |s: &str| Time(s.parse().unwrap());
        let t0 = at("2026-01-01T10:00:00Z");
        let slow = Prediction {
            ttft: Some(1.42),
            tpot: Some(0.05),
        };
        let missed = objectives_met(None, &t, &slow, 1, &sizing, Some(3), &t0);
        assert_eq!(
            (missed.status.as_str(), missed.reason.as_str()),
            ("False", OBJECTIVE_MISSED)
        );
        assert_eq!(
            missed.message,
            "with 1 ready replica groups: ttft p90 predicted 1.42s over the target 800ms, tpot p90 predicted 50ms (target 80ms); 3 replica groups meet every objective"
        );
        let t1 = at("2026-01-01T10:00:30Z");
        let still = objectives_met(Some(&missed), &t, &slow, 1, &sizing, Some(3), &t1);
        assert_eq!(still.last_transition_time, t0);
        let met = objectives_met(
            Some(&still),
            &t,
            &sizing.at_replicas,
            3,
            &sizing,
            Some(3),
            &t1,
        );
        assert_eq!(
            (met.status.as_str(), met.reason.as_str()),
            ("True", OBJECTIVES_MET)
        );
        assert_eq!(met.last_transition_time, t1);
        let overrun = Prediction {
            ttft: None,
            tpot: None,
        };
        let message = objectives_met(None, &t, &overrun, 1, &sizing, None, &t0).message;
        assert!(
            message.contains("ttft p90 unbounded (target 800ms): the arrivals outrun them"),
            "{message}"
        );
    }

    #[test]
    fn scaling_active_turns_false_while_load_is_missing_and_back_when_it_is_read() {
        let at = |s: &str| Time(s.parse().unwrap());
        let read = Readings {
            asked: 3,
            failed: 0,
            first_error: None,
        };
        let partly = Readings {
            asked: 3,
            failed: 2,
            first_error: Some("load report from 127.0.0.5:8001: connection refused".into()),
        };
        let builtin = AutoscalingMode::Builtin;
        let t0 = at("2026-01-01T10:00:00Z");
        assert_eq!(
            scaling_active(None, builtin, &read, Some(1), &t0),
            None,
            "a service always read carries no condition"
        );
        let down = scaling_active(None, builtin, &partly, Some(1), &t0).unwrap();
        assert_eq!(
            (
                down.type_.as_str(),
                down.status.as_str(),
                down.reason.as_str()
            ),
            (SCALING_ACTIVE, "False", METRICS_UNAVAILABLE)
        );
        assert_eq!(
            down.message,
            "the load of 2 of 3 serving workers could not be read; first: load report from 127.0.0.5:8001: connection refused; the replica count will not fall until every serving worker answers"
        );
        let t1 = at("2026-01-01T10:00:05Z");
        assert_eq!(
            scaling_active(Some(&down), builtin, &partly, Some(1), &t1),
            None
        );
        // Every worker unread: the message changes, the transition time does not.
        let none = Readings {
            failed: 3,
            ..partly.clone()
        };
        let worse = scaling_active(Some(&down), builtin, &none, Some(1), &t1).unwrap();
        assert!(
            worse.message.starts_with("the load of 3 of 3"),
            "{}",
            worse.message
        );
        assert_eq!(worse.last_transition_time, t0);
        let t2 = at("2026-01-01T10:01:00Z");
        let back = scaling_active(Some(&worse), builtin, &read, Some(2), &t2).unwrap();
        assert_eq!(
            (back.status.as_str(), back.reason.as_str()),
            ("True", VALID_METRIC_FOUND)
        );
        assert_eq!(back.last_transition_time, t2);
        assert_eq!(back.observed_generation, Some(2));
        assert_eq!(
            scaling_active(Some(&back), builtin, &read, Some(2), &t2),
            None
        );
        let hpa = scaling_active(None, AutoscalingMode::Hpa, &partly, Some(1), &t0).unwrap();
        assert!(
            hpa.message
                .ends_with("the HorizontalPodAutoscaler holds its count"),
            "{}",
            hpa.message
        );
    }
}

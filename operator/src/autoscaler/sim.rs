//! A simulated fleet for comparing scaling policies on the same load: open-loop arrivals
//! from a trace, replica groups that take a warm-up delay before serving, continuous
//! batching up to a batch size with a fixed service time, join-the-shortest-queue routing,
//! and draining on scale-down. Time is simulated, so a ten-minute trace runs in
//! milliseconds and every run is reproducible.

pub mod tokens;

use std::collections::VecDeque;
use std::time::Duration;

use super::policy::{
    GroupLoad, GroupState, Observation, Policy, PolicyConfig, Readings, scale_down_victims,
};

/// Arrival rate over time, in requests per second.
#[derive(Clone, Debug)]
pub enum Trace {
    /// `base` until `start`, `peak` until `end`, `base` again after.
    Step {
        base: f64,
        peak: f64,
        start: f64,
        end: f64,
    },
    /// At its trough until `start`, then `mean - amplitude * cos(2π(t - start) / period)`.
    Sine {
        mean: f64,
        amplitude: f64,
        period: f64,
        start: f64,
    },
}

impl Trace {
    /// The highest rate the trace reaches.
    pub fn peak(&self) -> f64 {
        match *self {
            Trace::Step { base, peak, .. } => base.max(peak),
            Trace::Sine {
                mean, amplitude, ..
            } => mean + amplitude.abs(),
        }
    }

    pub fn rate(&self, t: f64) -> f64 {
        match *self {
            Trace::Step {
                base,
                peak,
                start,
                end,
            } => {
                if (start..end).contains(&t) {
                    peak
                } else {
                    base
                }
            }
            Trace::Sine {
                mean,
                amplitude,
                period,
                start,
            } => {
                let phase = std::f64::consts::TAU * (t - start).max(0.0) / period;
                (mean - amplitude * phase.cos()).max(0.0)
            }
        }
    }
}

/// The simulated hardware and service.
#[derive(Clone, Debug)]
pub struct FleetModel {
    /// Seconds from a group being asked for to it serving.
    pub warm_up: f64,
    /// Requests a group runs at once; more wait in its queue.
    pub batch: u32,
    /// Seconds one request takes once admitted to the batch.
    pub service_time: f64,
    /// A request slower than this, arrival to completion, misses the objective.
    pub latency_slo: f64,
    /// Groups at the start (all ready).
    pub initial_replicas: u32,
    /// Seconds simulated.
    pub duration: f64,
}

/// A scaling policy under test: it sees the fleet every `SAMPLE_INTERVAL` and may answer
/// with a new desired group count on its own cadence.
pub trait Scaler {
    fn name(&self) -> &str;
    fn observe(&mut self, now: f64, observation: &Observation) -> Option<u32>;
}

/// How often scalers are shown the fleet (the built-in autoscaler's own tick).
pub const SAMPLE_INTERVAL: f64 = 0.5;
const STEP: f64 = 0.01;

/// What one run measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// Seconds from the queue first building past what the initial fleet should hold to
    /// the first scale-up decision (negative if the policy scaled up before that).
    pub time_to_first_scale_up: Option<f64>,
    pub requests: u64,
    /// Completed later than the objective, or still unfinished and already past it.
    pub over_slo: u64,
    /// Integral of groups in existence (warming, ready or draining) over time.
    pub replica_seconds: f64,
    pub max_replicas: u32,
    pub p99_latency: f64,
}

struct SimGroup {
    id: u32,
    state: GroupState,
    ready_at: f64,
    waiting: VecDeque<f64>,
    /// (arrival, finish) of each request in the batch.
    running: Vec<(f64, f64)>,
}

impl SimGroup {
    fn depth(&self) -> usize {
        self.waiting.len() + self.running.len()
    }
}

/// Replays `trace` on `model` under `scaler`; the queue counts as building once more than
/// `building_at` requests are in the system.
pub fn run(
    model: &FleetModel,
    trace: &Trace,
    scaler: &mut dyn Scaler,
    building_at: usize,
) -> Outcome {
    let mut groups: Vec<SimGroup> = (0..model.initial_replicas)
        .map(|id| SimGroup {
            id,
            state: GroupState::Ready,
            ready_at: 0.0,
            waiting: VecDeque::new(),
            running: Vec::new(),
        })
        .collect();
    let mut next_id = model.initial_replicas;
    let mut spec = model.initial_replicas;
    let mut latencies: Vec<f64> = Vec::new();
    let mut requests = 0u64;
    let mut arrivals_due = 0.0;
    let mut held: VecDeque<f64> = VecDeque::new();
    let mut replica_seconds = 0.0;
    let mut max_replicas = spec;
    let mut building_since: Option<f64> = None;
    let mut first_scale_up: Option<f64> = None;
    let mut next_sample = 0.0;
    let steps = (model.duration / STEP).round() as u64;

    for step in 0..steps {
        let now = step as f64 * STEP;

        arrivals_due += trace.rate(now) * STEP;
        while arrivals_due >= 1.0 {
            arrivals_due -= 1.0;
            requests += 1;
            held.push_back(now);
        }
        // The router holds requests while no group is ready.
        while let Some(&arrival) = held.front() {
            let Some(target) = groups
                .iter_mut()
                .filter(|g| g.state == GroupState::Ready)
                .min_by_key(|g| g.depth())
            else {
                break;
            };
            target.waiting.push_back(arrival);
            held.pop_front();
        }

        serve(&mut groups, model, now, &mut latencies);
        let in_system = held.len() + groups.iter().map(SimGroup::depth).sum::<usize>();
        if building_since.is_none() && in_system > building_at {
            building_since = Some(now);
        }
        groups.retain(|g| g.state != GroupState::Draining || g.depth() > 0);
        replica_seconds += groups.len() as f64 * STEP;

        if now + 1e-9 >= next_sample {
            next_sample += SAMPLE_INTERVAL;
            let observation = observe(&groups, model, spec);
            if let Some(desired) = scaler.observe(now, &observation) {
                if desired > spec && first_scale_up.is_none() {
                    first_scale_up = Some(now);
                }
                let change = (spec, desired);
                rescale(&mut groups, &observation, change, model, now, &mut next_id);
                spec = desired;
                max_replicas = max_replicas.max(spec);
            }
        }
    }

    let end = model.duration;
    let unfinished_late = groups
        .iter()
        .flat_map(|g| {
            g.waiting
                .iter()
                .copied()
                .chain(g.running.iter().map(|&(a, _)| a))
        })
        .chain(held.iter().copied())
        .filter(|&arrival| end - arrival > model.latency_slo)
        .count() as u64;
    let over_slo =
        latencies.iter().filter(|&&l| l > model.latency_slo).count() as u64 + unfinished_late;
    latencies.sort_by(f64::total_cmp);
    let p99_latency = latencies
        .get(((latencies.len() as f64) * 0.99) as usize)
        .or(latencies.last())
        .copied()
        .unwrap_or(0.0);

    Outcome {
        time_to_first_scale_up: first_scale_up
            .zip(building_since)
            .map(|(up, wait)| up - wait),
        requests,
        over_slo,
        replica_seconds,
        max_replicas,
        p99_latency,
    }
}

/// One step of every group: warmed-up groups turn ready, finished requests leave with their
/// latency, and waiting ones fill the batch.
fn serve(groups: &mut [SimGroup], model: &FleetModel, now: f64, latencies: &mut Vec<f64>) {
    for group in groups.iter_mut() {
        if group.state == GroupState::Warming && group.ready_at <= now {
            group.state = GroupState::Ready;
        }
        group.running.retain(|&(arrival, finish)| {
            if finish <= now {
                latencies.push(finish - arrival);
                false
            } else {
                true
            }
        });
        while group.running.len() < model.batch as usize {
            let Some(arrival) = group.waiting.pop_front() else {
                break;
            };
            group.running.push((arrival, now + model.service_time));
        }
    }
}

/// What the autoscaler would read from `groups`.
fn observe(groups: &[SimGroup], model: &FleetModel, spec: u32) -> Observation {
    Observation {
        spec_replicas: spec,
        groups: groups
            .iter()
            .map(|g| GroupLoad {
                group: g.id,
                state: g.state,
                waiting: g.waiting.len() as u32,
                running: g.running.len() as u32,
                kv_usage: g.running.len() as f64 / f64::from(model.batch),
            })
            .collect(),
        wake_requested: false,
        readings: Readings::default(),
    }
}

/// Goes from `spec` to `desired` groups: new ones warm up, removed ones drain (or go at once
/// while still warming).
fn rescale(
    groups: &mut Vec<SimGroup>,
    observation: &Observation,
    (spec, desired): (u32, u32),
    model: &FleetModel,
    now: f64,
    next_id: &mut u32,
) {
    if desired > spec {
        for _ in spec..desired {
            groups.push(SimGroup {
                id: *next_id,
                state: GroupState::Warming,
                ready_at: now + model.warm_up,
                waiting: VecDeque::new(),
                running: Vec::new(),
            });
            *next_id += 1;
        }
    } else if desired < spec {
        let victims = scale_down_victims(&observation.groups, (spec - desired) as usize);
        groups.retain(|g| !(victims.contains(&g.id) && g.state == GroupState::Warming));
        // A draining group finishes its queue and batch, and takes nothing new.
        for group in groups.iter_mut().filter(|g| victims.contains(&g.id)) {
            group.state = GroupState::Draining;
        }
    }
}

/// The built-in queue-depth autoscaler, ticking at `SAMPLE_INTERVAL`.
pub struct BuiltIn {
    policy: Policy,
}

impl BuiltIn {
    pub fn new(config: PolicyConfig) -> Result<Self, super::policy::ConfigError> {
        Ok(Self {
            policy: Policy::new(config)?,
        })
    }
}

impl Scaler for BuiltIn {
    fn name(&self) -> &str {
        "built-in"
    }

    fn observe(&mut self, now: f64, observation: &Observation) -> Option<u32> {
        Some(
            self.policy
                .decide(Duration::from_secs_f64(now), observation)
                .desired,
        )
    }
}

/// The Kubernetes HPA on an `External` `AverageValue` metric scraped through Prometheus:
/// it syncs every 15 s on a value `metric_lag` old, keeps a tolerance of 0.1, scales up by
/// at most 100 % or 4 replicas per sync, and takes the highest recommendation of the last
/// 300 s on the way down.
pub struct HpaEquivalent {
    pub target: f64,
    pub min_replicas: u32,
    pub max_replicas: u32,
    pub sync_period: f64,
    pub metric_lag: f64,
    pub tolerance: f64,
    pub down_stabilisation: f64,
    samples: VecDeque<(f64, f64)>,
    recommendations: VecDeque<(f64, u32)>,
    next_sync: f64,
}

impl HpaEquivalent {
    pub fn new(target: f64, min_replicas: u32, max_replicas: u32) -> Self {
        Self {
            target,
            min_replicas,
            max_replicas,
            sync_period: 15.0,
            metric_lag: 30.0,
            tolerance: 0.1,
            down_stabilisation: 300.0,
            samples: VecDeque::new(),
            recommendations: VecDeque::new(),
            next_sync: 0.0,
        }
    }
}

impl Scaler for HpaEquivalent {
    fn name(&self) -> &str {
        "HPA-equivalent"
    }

    fn observe(&mut self, now: f64, observation: &Observation) -> Option<u32> {
        self.samples
            .push_back((now, f64::from(observation.queue_depth())));
        if now < self.next_sync {
            return None;
        }
        self.next_sync += self.sync_period;
        let seen_by = now - self.metric_lag;
        while self.samples.len() > 1 && self.samples[1].0 <= seen_by {
            self.samples.pop_front();
        }
        let &(at, metric) = self.samples.front()?;
        if at > seen_by {
            // Nothing has reached the metrics pipeline yet.
            return None;
        }
        let current = observation.spec_replicas;
        let ratio = metric / (self.target * f64::from(current.max(1)));
        let mut desired = if (ratio - 1.0).abs() <= self.tolerance {
            current
        } else {
            (metric / self.target - 1e-9).ceil().max(0.0) as u32
        };
        desired = desired.min((current * 2).max(current + 4));
        self.recommendations.push_back((now, desired));
        while self
            .recommendations
            .front()
            .is_some_and(|&(t, _)| now - t > self.down_stabilisation)
        {
            self.recommendations.pop_front();
        }
        if desired < current {
            let held = self.recommendations.iter().map(|&(_, r)| r).max();
            desired = held.unwrap_or(desired).min(current);
        }
        Some(desired.clamp(self.min_replicas, self.max_replicas))
    }
}

/// Knative's KPA with its defaults: a 2 s tick, a 60 s stable and 6 s panic window, panic
/// at 2× the ready pods, up by at most 1000× and down by at most 2× per tick, and no
/// knowledge of pods that are still starting.
pub struct KpaEquivalent {
    pub target: f64,
    pub min_replicas: u32,
    pub max_replicas: u32,
    pub tick: f64,
    pub stable_window: f64,
    pub panic_window: f64,
    pub panic_threshold: f64,
    pub max_scale_up_rate: f64,
    pub max_scale_down_rate: f64,
    samples: VecDeque<(f64, f64)>,
    /// Starts in panic, as a restarted KPA does.
    panic_last_over: Option<f64>,
    max_panic_pods: u32,
    next_tick: f64,
}

impl KpaEquivalent {
    pub fn new(target: f64, min_replicas: u32, max_replicas: u32) -> Self {
        Self {
            target,
            min_replicas,
            max_replicas,
            tick: 2.0,
            stable_window: 60.0,
            panic_window: 6.0,
            panic_threshold: 2.0,
            max_scale_up_rate: 1000.0,
            max_scale_down_rate: 2.0,
            samples: VecDeque::new(),
            panic_last_over: Some(0.0),
            max_panic_pods: 0,
            next_tick: 0.0,
        }
    }

    fn mean_over(&self, now: f64, window: f64) -> f64 {
        let (sum, n) = self
            .samples
            .iter()
            .filter(|&&(t, _)| now - t < window)
            .fold((0.0, 0.0), |(s, n), &(_, v)| (s + v, n + 1.0));
        if n == 0.0 { 0.0 } else { sum / n }
    }
}

impl Scaler for KpaEquivalent {
    fn name(&self) -> &str {
        "KPA-equivalent"
    }

    fn observe(&mut self, now: f64, observation: &Observation) -> Option<u32> {
        self.samples
            .push_back((now, f64::from(observation.queue_depth())));
        while self
            .samples
            .front()
            .is_some_and(|&(t, _)| now - t >= self.stable_window)
        {
            self.samples.pop_front();
        }
        if now < self.next_tick {
            return None;
        }
        self.next_tick += self.tick;
        let ready = f64::from(observation.ready().max(1));
        let stable = self.mean_over(now, self.stable_window) / self.target;
        let panic = self.mean_over(now, self.panic_window) / self.target;
        let up_limit = (self.max_scale_up_rate * ready).ceil();
        let down_limit = (ready / self.max_scale_down_rate).floor();
        let bound = |d: f64| d.ceil().clamp(down_limit, up_limit) as u32;

        if panic / ready >= self.panic_threshold {
            self.panic_last_over = Some(now);
        } else if self
            .panic_last_over
            .is_some_and(|t| now - t >= self.stable_window)
        {
            self.panic_last_over = None;
            self.max_panic_pods = 0;
        }
        let desired = if self.panic_last_over.is_some() {
            let want = bound(panic)
                .max(self.max_panic_pods)
                .max(observation.spec_replicas);
            self.max_panic_pods = want;
            want
        } else {
            bound(stable)
        };
        Some(desired.clamp(self.min_replicas, self.max_replicas))
    }
}

/// Runs the built-in autoscaler (with `config`), the HPA-equivalent and the
/// KPA-equivalent policy on the same fleet and trace, all aiming at the same queue depth
/// per replica.
pub fn compare(
    model: &FleetModel,
    trace: &Trace,
    config: &PolicyConfig,
) -> Result<Vec<(String, Outcome)>, super::policy::ConfigError> {
    let target = config.target_queue_per_replica;
    let (min, max) = (config.min_replicas, config.max_replicas);
    let building_at = (f64::from(model.initial_replicas) * target).floor() as usize;
    let mut scalers: Vec<Box<dyn Scaler>> = vec![
        Box::new(BuiltIn::new(config.clone())?),
        Box::new(HpaEquivalent::new(target, min, max)),
        Box::new(KpaEquivalent::new(target, min, max)),
    ];
    Ok(scalers
        .iter_mut()
        .map(|scaler| {
            let outcome = run(model, trace, scaler.as_mut(), building_at);
            (scaler.name().to_owned(), outcome)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> FleetModel {
        FleetModel {
            warm_up: 30.0,
            batch: 8,
            service_time: 2.0,
            latency_slo: 6.0,
            initial_replicas: 1,
            duration: 600.0,
        }
    }

    #[test]
    fn every_request_is_served_and_the_policies_differ_as_their_loops_do() {
        let trace = Trace::Step {
            base: 2.0,
            peak: 16.0,
            start: 120.0,
            end: 300.0,
        };
        let config = PolicyConfig {
            target_queue_per_replica: 6.0,
            max_replicas: 20,
            ..PolicyConfig::default()
        };
        let outcomes: std::collections::HashMap<String, Outcome> =
            compare(&model(), &trace, &config)
                .unwrap()
                .into_iter()
                .collect();
        let expected_requests = (120.0 * 2.0 + 180.0 * 16.0 + 300.0 * 2.0) as u64;
        for (name, outcome) in &outcomes {
            assert!(
                outcome.requests.abs_diff(expected_requests) <= 1,
                "{name}: {} requests",
                outcome.requests
            );
        }
        let first = |name: &str| outcomes[name].time_to_first_scale_up.unwrap();
        assert!(
            first("built-in") < 2.0,
            "built-in took {}",
            first("built-in")
        );
        assert!(first("KPA-equivalent") < first("HPA-equivalent"));
        // The HPA sees a value 30 s old and syncs every 15 s.
        assert!(first("HPA-equivalent") >= 30.0);
        assert!(outcomes["built-in"].over_slo < outcomes["HPA-equivalent"].over_slo);
        assert!(outcomes["built-in"].replica_seconds < outcomes["HPA-equivalent"].replica_seconds);
    }

    #[test]
    fn a_fleet_that_keeps_up_meets_the_objective() {
        let trace = Trace::Step {
            base: 2.0,
            peak: 2.0,
            start: 0.0,
            end: 0.0,
        };
        let mut scaler = BuiltIn::new(PolicyConfig {
            target_queue_per_replica: 6.0,
            ..PolicyConfig::default()
        })
        .unwrap();
        let outcome = run(&model(), &trace, &mut scaler, 6);
        assert_eq!(outcome.over_slo, 0);
        assert_eq!(outcome.max_replicas, 1);
        assert_eq!(outcome.time_to_first_scale_up, None);
        assert!((outcome.p99_latency - 2.0).abs() < 0.05);
    }
}

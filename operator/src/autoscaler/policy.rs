//! The queue-depth scaling decision, free of clocks and I/O so that it can be driven by
//! simulated time and load traces.
//!
//! The shape follows Knative's KPA: a stable window that decides in calm periods, a short
//! panic window that scales up at once in a burst and never lets the count fall while the
//! burst lasts, max step rates and a scale-down delay. On top of that it knows two things
//! about LLM fleets: a replica that is still loading its model is capacity on its way (so a
//! queue that keeps building while it loads does not buy yet more replicas), and the unit is
//! a whole replica group (every rank of a tensor-parallel group), never a single pod.
//!
//! With `min_replicas: 0` an idle fleet goes to zero after `idle_before_zero` with no
//! request, no warming group and no wake request, and comes back to one group when a wake
//! request arrives (a router holding requests for it).
//!
//! A load that could not be read is not an idle fleet. While any serving worker's load is
//! missing the count never falls (and never goes to zero): with some readings a burst among
//! them still scales up, as an HPA counts a pod without metrics as idle only when scaling up;
//! with none the count holds and nothing enters the averages.

use std::collections::VecDeque;
use std::fmt;
use std::time::Duration;

/// What a replica group is doing, as its load signal reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupState {
    /// Started but not yet serving (loading weights, joining its ring).
    Warming,
    /// Serving requests.
    Ready,
    /// Chosen for removal: finishing what it holds, taking nothing new.
    Draining,
    /// Its pods are ready, but its serving pod's load could not be read: it serves an unknown
    /// load.
    Unread,
}

/// One replica group's load at one tick.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupLoad {
    /// The group's ordinal within its service.
    pub group: u32,
    pub state: GroupState,
    /// Requests queued and not yet admitted to a batch.
    pub waiting: u32,
    /// Requests in the running batch.
    pub running: u32,
    /// Fraction of the KV cache in use, 0..=1.
    pub kv_usage: f64,
}

impl GroupLoad {
    pub fn queue_depth(&self) -> u32 {
        self.waiting + self.running
    }
}

/// What the autoscaler sees at one tick.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Observation {
    /// The replica-group count currently asked for (the scale subresource's spec).
    pub spec_replicas: u32,
    /// Every group the load signal reached. Groups that were asked for but not seen yet
    /// (not yet scheduled or started) count as warming.
    pub groups: Vec<GroupLoad>,
    /// Requests are waiting outside the fleet for it to wake (it is at zero groups).
    pub wake_requested: bool,
    /// How the serving workers' load reports went.
    pub readings: Readings,
}

/// The load reports asked of the serving workers (ready pods, not terminating) at one tick.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Readings {
    pub asked: u32,
    /// Workers that did not answer.
    pub failed: u32,
    /// Why the first of them did not.
    pub first_error: Option<String>,
}

impl Readings {
    /// Some serving worker's load is missing.
    pub fn incomplete(&self) -> bool {
        self.failed > 0
    }

    /// Workers were asked and none answered: nothing is known of the load.
    pub fn none(&self) -> bool {
        self.failed > 0 && self.failed >= self.asked
    }
}

/// Names how many serving workers' load is missing, and why the first is: what the
/// `ScalingActive` condition and a refused external metric say.
impl fmt::Display for Readings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&unread(self.failed, self.asked))?;
        if let Some(error) = &self.first_error {
            write!(f, "; first: {error}")?;
        }
        Ok(())
    }
}

fn unread(failed: u32, asked: u32) -> String {
    format!("the load of {failed} of {asked} serving workers could not be read")
}

impl Observation {
    pub fn ready(&self) -> u32 {
        self.count(GroupState::Ready)
    }

    /// Groups asked for that are not serving yet: capacity on its way. Unread groups serve
    /// already, at a load not known.
    pub fn warming(&self) -> u32 {
        self.spec_replicas
            .saturating_sub(self.ready())
            .saturating_sub(self.count(GroupState::Unread))
    }

    /// Waiting plus running requests over the ready groups.
    pub fn queue_depth(&self) -> u32 {
        self.serving().map(GroupLoad::queue_depth).sum()
    }

    /// Requests waiting (not yet in a running batch) over the ready groups.
    pub fn waiting(&self) -> u32 {
        self.serving().map(|g| g.waiting).sum()
    }

    fn kv_usage(&self) -> f64 {
        self.serving().map(|g| g.kv_usage.clamp(0.0, 1.0)).sum()
    }

    fn serving(&self) -> impl Iterator<Item = &GroupLoad> {
        self.groups.iter().filter(|g| g.state == GroupState::Ready)
    }

    fn count(&self, state: GroupState) -> u32 {
        let n = self.groups.iter().filter(|g| g.state == state).count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }
}

/// How long a `minReplicas: 0` fleet stays up with nothing to do. A model load is slow and an
/// accelerator is expensive; five minutes keeps a fleet through pauses between conversations.
pub const DEFAULT_IDLE_BEFORE_ZERO: Duration = Duration::from_secs(300);

/// The knobs of the built-in autoscaler.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyConfig {
    /// Waiting + running requests one replica group should hold.
    pub target_queue_per_replica: f64,
    /// KV-cache use one replica group should stay under (0..=1), if KV use should also drive
    /// scaling; the higher of the two demands wins.
    pub target_kv_usage: Option<f64>,
    /// Zero lets an idle fleet scale to zero after `idle_before_zero`.
    pub min_replicas: u32,
    pub max_replicas: u32,
    /// With `min_replicas: 0`, how long a fleet must see no request, no warming group and no
    /// wake request before it goes to zero.
    pub idle_before_zero: Duration,
    /// Averaging window for calm-period decisions.
    pub stable_window: Duration,
    /// Averaging window for burst detection.
    pub panic_window: Duration,
    /// Panic starts when the panic-window demand reaches this multiple of the ready groups.
    pub panic_threshold: f64,
    /// Relative band around the current count inside which nothing changes.
    pub tolerance: f64,
    /// At most this multiple of the current count per decision.
    pub max_scale_up_rate: f64,
    /// At most divide the ready count by this per decision.
    pub max_scale_down_rate: f64,
    /// A lower count must have been the recommendation for this long before it is applied.
    pub scale_down_delay: Duration,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            target_queue_per_replica: 4.0,
            target_kv_usage: None,
            min_replicas: 1,
            max_replicas: 10,
            idle_before_zero: DEFAULT_IDLE_BEFORE_ZERO,
            stable_window: Duration::from_secs(20),
            panic_window: Duration::from_secs(2),
            panic_threshold: 2.0,
            tolerance: 0.1,
            max_scale_up_rate: 10.0,
            max_scale_down_rate: 2.0,
            scale_down_delay: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    #[error("target queue depth per replica must be a positive number, got {0}")]
    Target(f64),
    #[error("target KV-cache use must be in (0, 1], got {0}")]
    KvTarget(f64),
    #[error("maxReplicas must be at least 1, got 0")]
    MaxZero,
    #[error("maxReplicas ({max}) is below minReplicas ({min})")]
    Bounds { min: u32, max: u32 },
    #[error(
        "the panic window ({panic:?}) must be non-zero and no longer than the stable window ({stable:?})"
    )]
    Windows { panic: Duration, stable: Duration },
    #[error("the panic threshold must be greater than 1, got {0}")]
    PanicThreshold(f64),
    #[error("the tolerance must be in [0, 1), got {0}")]
    Tolerance(f64),
    #[error("the {which} rate must be at least 1, got {value}")]
    Rate { which: &'static str, value: f64 },
}

impl PolicyConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let t = self.target_queue_per_replica;
        if !(t.is_finite() && t > 0.0) {
            return Err(ConfigError::Target(t));
        }
        if let Some(kv) = self.target_kv_usage
            && !(kv > 0.0 && kv <= 1.0)
        {
            return Err(ConfigError::KvTarget(kv));
        }
        if self.max_replicas == 0 {
            return Err(ConfigError::MaxZero);
        }
        if self.max_replicas < self.min_replicas {
            return Err(ConfigError::Bounds {
                min: self.min_replicas,
                max: self.max_replicas,
            });
        }
        if self.panic_window.is_zero() || self.panic_window > self.stable_window {
            return Err(ConfigError::Windows {
                panic: self.panic_window,
                stable: self.stable_window,
            });
        }
        if !(self.panic_threshold.is_finite() && self.panic_threshold > 1.0) {
            return Err(ConfigError::PanicThreshold(self.panic_threshold));
        }
        if !(0.0..1.0).contains(&self.tolerance) {
            return Err(ConfigError::Tolerance(self.tolerance));
        }
        for (which, value) in [
            ("max scale-up", self.max_scale_up_rate),
            ("max scale-down", self.max_scale_down_rate),
        ] {
            if !(value.is_finite() && value >= 1.0) {
                return Err(ConfigError::Rate { which, value });
            }
        }
        Ok(())
    }
}

/// Why the desired count is what it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The count already matches the demand (within tolerance).
    Steady,
    /// Calm-period demand above the current count.
    ScaleUp,
    /// A burst: the panic window asks for at least `panic_threshold` × the ready groups.
    Burst,
    /// Calm-period demand below the current count.
    ScaleDown,
    /// Demand fell, but a burst is still being handled.
    HoldWhilePanicking,
    /// Demand rose, but warming groups already cover it.
    HoldWhileWarming,
    /// Demand fell, but not for the whole scale-down delay yet.
    ScaleDownDelay,
    /// The change was cut to the max step rate.
    RateLimited,
    /// The count was clamped into [minReplicas, maxReplicas] (at least one while not idle).
    Bounds,
    /// No request for the whole idle window: scaled to zero.
    Idle,
    /// At zero, a request is waiting for the fleet: scaled to one group.
    Wake,
    /// A serving worker's load could not be read: the count may not fall.
    MetricsUnavailable,
}

impl Reason {
    /// The CamelCase word used for events and status.
    pub const fn as_str(self) -> &'static str {
        match self {
            Reason::Steady => "Steady",
            Reason::ScaleUp => "ScaleUp",
            Reason::Burst => "Burst",
            Reason::ScaleDown => "ScaleDown",
            Reason::HoldWhilePanicking => "HoldWhilePanicking",
            Reason::HoldWhileWarming => "HoldWhileWarming",
            Reason::ScaleDownDelay => "ScaleDownDelay",
            Reason::RateLimited => "RateLimited",
            Reason::Bounds => "Bounds",
            Reason::Idle => "ScaledToZero",
            Reason::Wake => "Wake",
            Reason::MetricsUnavailable => "MetricsUnavailable",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The outcome of one tick.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// Replica groups to ask for.
    pub desired: u32,
    pub reason: Reason,
    /// Replica groups the stable window asks for (fractional).
    pub stable_demand: f64,
    /// Replica groups the panic window asks for (fractional).
    pub panic_demand: f64,
    /// Waiting + running requests per ready group, this tick; `None` when no serving
    /// worker's load could be read.
    pub queue_per_replica: Option<f64>,
    pub panicking: bool,
    /// How long the fleet has had no request, warming group or wake request.
    pub idle_for: Duration,
    /// Serving workers whose load could not be read, and those asked, when any failed.
    pub unread: Option<(u32, u32)>,
}

impl Decision {
    /// A one-line account for events and logs.
    pub fn message(&self, from: u32) -> String {
        match self.reason {
            Reason::Idle => {
                return format!(
                    "{} {from} -> 0 replicas: no request for {} s",
                    self.reason,
                    self.idle_for.as_secs()
                );
            }
            Reason::Wake => {
                return format!(
                    "{} {from} -> {} replicas: requests are waiting for the fleet",
                    self.reason, self.desired
                );
            }
            _ => {}
        }
        let load = match self.queue_per_replica {
            Some(queue) => format!("{queue:.2} requests per ready replica"),
            None => "load unknown".to_owned(),
        };
        let unread = match self.unread {
            Some((failed, asked)) => format!("; {}", unread(failed, asked)),
            None => String::new(),
        };
        format!(
            "{} {from} -> {} replicas: {load}, replica groups demanded {:.2} over the stable window / {:.2} over the panic window{}{unread}",
            self.reason,
            self.desired,
            self.stable_demand,
            self.panic_demand,
            if self.panicking { " (panic mode)" } else { "" }
        )
    }
}

/// The autoscaler's memory between ticks.
#[derive(Clone, Debug)]
pub struct Policy {
    config: PolicyConfig,
    /// (time, demand in replica groups) over the stable window.
    demand: VecDeque<(Duration, f64)>,
    /// (time, recommendation) over the scale-down delay.
    recommendations: VecDeque<(Duration, u32)>,
    /// When the panic window last asked for a burst; `None` when calm.
    panic_last_over: Option<Duration>,
    /// When the scale-up that opened the current catch-up window happened; cleared once
    /// every group asked for is ready.
    scaled_up_at: Option<Duration>,
    /// The last tick with a request in the fleet, a warming group or a wake request; the
    /// first tick counts, so a restarted autoscaler waits a whole idle window.
    last_active: Option<Duration>,
}

impl Policy {
    pub fn new(config: PolicyConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Self {
            config,
            demand: VecDeque::new(),
            recommendations: VecDeque::new(),
            panic_last_over: None,
            scaled_up_at: None,
            last_active: None,
        })
    }

    pub fn config(&self) -> &PolicyConfig {
        &self.config
    }

    /// Decides the replica-group count for time `now` (monotonic, any origin) on the queue
    /// depth.
    pub fn decide(&mut self, now: Duration, observation: &Observation) -> Decision {
        let queue = f64::from(observation.queue_depth());
        let mut demand = queue / self.config.target_queue_per_replica;
        if let Some(kv_target) = self.config.target_kv_usage {
            demand = demand.max(observation.kv_usage() / kv_target);
        }
        self.decide_with(now, observation, Some(demand), Rounding::Tolerant)
    }

    /// Decides the count on a demand in replica groups the latency objectives measured;
    /// `None` when none could be measured this tick, which holds the count as a load not
    /// read does. Fewer groups than that demand are predicted to miss the objectives, so
    /// the tolerance only keeps a count above it.
    pub fn decide_on(
        &mut self,
        now: Duration,
        observation: &Observation,
        demand: Option<f64>,
    ) -> Decision {
        self.decide_with(now, observation, demand, Rounding::AtLeast)
    }

    fn decide_with(
        &mut self,
        now: Duration,
        observation: &Observation,
        demand: Option<f64>,
        rounding: Rounding,
    ) -> Decision {
        let config = self.config.clone();
        // With no history the autoscaler cannot know a burst is over, so it starts as if
        // one were under way: a restart never scales down on an empty window.
        if self.demand.is_empty() {
            self.panic_last_over = Some(now);
        }

        let queue = f64::from(observation.queue_depth());
        let readings = &observation.readings;
        let unknown = readings.none() || demand.is_none();
        if let (false, Some(demand)) = (readings.none(), demand) {
            self.demand.push_back((now, demand));
        }
        prune(&mut self.demand, now, config.stable_window);
        let stable_demand = mean_since(&self.demand, now, config.stable_window);
        let panic_demand = mean_since(&self.demand, now, config.panic_window);

        let ready = observation.ready();
        let current = observation.spec_replicas;
        let tolerance = config.tolerance;
        let round = |d: f64| {
            let below = matches!(rounding, Rounding::AtLeast) && d > f64::from(current);
            round_with_tolerance(d, current, if below { 0.0 } else { tolerance })
        };

        if panic_demand / f64::from(ready.max(1)) >= config.panic_threshold {
            self.panic_last_over = Some(now);
        } else if self
            .panic_last_over
            .is_some_and(|t| now.saturating_sub(t) >= config.stable_window)
        {
            self.panic_last_over = None;
        }
        let panicking = self.panic_last_over.is_some();

        let (mut desired, mut reason) = if panicking {
            let want = round(panic_demand).max(round(stable_demand));
            if want > current {
                (want, Reason::Burst)
            } else if want < current {
                (current, Reason::HoldWhilePanicking)
            } else {
                (current, Reason::Steady)
            }
        } else {
            let want = round(stable_demand);
            let reason = match want.cmp(&current) {
                std::cmp::Ordering::Greater => Reason::ScaleUp,
                std::cmp::Ordering::Less => Reason::ScaleDown,
                std::cmp::Ordering::Equal => Reason::Steady,
            };
            (want, reason)
        };

        // The queue keeps building while new groups load their model; that backlog is
        // what they are coming for. Only a demand that would swamp even the capacity on
        // its way (a second, larger burst) buys more before they are ready. The first
        // panic window after a scale-up is exempt: the averages are still catching up
        // with the step that caused it.
        let warming = observation.warming();
        if warming == 0 {
            self.scaled_up_at = None;
        }
        let catching_up = self
            .scaled_up_at
            .is_some_and(|t| now.saturating_sub(t) < config.panic_window);
        if desired > current
            && warming > 0
            && !catching_up
            && panic_demand < config.panic_threshold * f64::from(current)
        {
            desired = current;
            reason = Reason::HoldWhileWarming;
        }

        (desired, reason) = self.limit(now, observation, desired, reason, unknown);

        // Zero is never a load decision: only the idle window below takes a fleet there.
        let floor = config.min_replicas.max(1);
        let clamped = desired.clamp(floor, config.max_replicas);
        if clamped != desired {
            desired = clamped;
            reason = if desired == current {
                Reason::Steady
            } else {
                Reason::Bounds
            };
        }

        let (desired, reason, idle_for) = self.idle(now, observation, floor, (desired, reason));

        // A scale-up that got past the hold starts a new catch-up window.
        if desired > current && !catching_up {
            self.scaled_up_at = Some(now);
        }

        Decision {
            desired,
            reason,
            stable_demand,
            panic_demand,
            queue_per_replica: (!readings.none()).then(|| queue / f64::from(ready.max(1))),
            panicking,
            idle_for,
            unread: readings
                .incomplete()
                .then_some((readings.failed, readings.asked)),
        }
    }

    /// `desired` within the scale-up and scale-down rates, never lower on a load not read,
    /// and no lower than any recommendation within the scale-down delay.
    fn limit(
        &mut self,
        now: Duration,
        observation: &Observation,
        mut desired: u32,
        mut reason: Reason,
        unknown: bool,
    ) -> (u32, Reason) {
        let config = &self.config;
        let current = observation.spec_replicas;
        let ready = observation.ready();
        let readings = &observation.readings;
        let up_limit = (f64::from(current.max(1)) * config.max_scale_up_rate).ceil();
        if f64::from(desired) > up_limit {
            desired = to_count(up_limit);
            reason = Reason::RateLimited;
        }
        let down_limit = (f64::from(ready) / config.max_scale_down_rate).floor();
        if desired < current && f64::from(desired) < down_limit {
            desired = to_count(down_limit).min(current);
            reason = Reason::RateLimited;
        }

        // A load not read is not a low one. What the readable groups ask for is a floor of
        // the demand, so it may still scale up; it never scales down.
        if unknown || (readings.incomplete() && desired < current) {
            desired = current;
            reason = Reason::MetricsUnavailable;
        }

        self.recommendations.push_back((now, desired));
        prune(&mut self.recommendations, now, config.scale_down_delay);
        let held = self
            .recommendations
            .iter()
            .map(|&(_, r)| r)
            .max()
            .unwrap_or(desired);
        if held > desired && desired < current {
            desired = held.min(current);
            reason = if desired == current {
                Reason::ScaleDownDelay
            } else {
                reason
            };
        }

        (desired, reason)
    }

    /// Takes an idle fleet to zero, and wakes one at zero, where `minReplicas` is 0; returns
    /// the count, its reason, and how long the fleet has been idle.
    fn idle(
        &mut self,
        now: Duration,
        observation: &Observation,
        floor: u32,
        (mut desired, mut reason): (u32, Reason),
    ) -> (u32, Reason, Duration) {
        let config = &self.config;
        let current = observation.spec_replicas;
        let warming = observation.warming();
        let readings = &observation.readings;
        let active = observation.wake_requested
            || observation.queue_depth() > 0
            || (current > 0 && warming > 0)
            || readings.incomplete();
        if active || self.last_active.is_none() {
            self.last_active = Some(now);
        }
        let idle_for = now.saturating_sub(self.last_active.unwrap_or(now));
        if config.min_replicas == 0 {
            if current == 0 {
                (desired, reason) = if observation.wake_requested {
                    (floor, Reason::Wake)
                } else {
                    (0, Reason::Steady)
                };
            } else if idle_for >= config.idle_before_zero {
                (desired, reason) = (0, Reason::Idle);
            }
        }

        (desired, reason, idle_for)
    }
}

/// How a demand in groups becomes a count.
#[derive(Clone, Copy)]
enum Rounding {
    /// Within the tolerance of the current count either way, the count stays: a queue
    /// depth a little over its target is noise.
    Tolerant,
    /// The demand is the fewest groups that meet the objectives: the count stays within
    /// the tolerance only above it.
    AtLeast,
}

/// The whole groups a fractional demand needs, except that a demand within `tolerance`
/// of the current count keeps it.
fn round_with_tolerance(demand: f64, current: u32, tolerance: f64) -> u32 {
    if current > 0 {
        let current = f64::from(current);
        if (demand - current).abs() <= tolerance * current {
            return to_count(current);
        }
    }
    // A demand of exactly n groups must not round up to n + 1 through float noise.
    to_count((demand - 1e-9).ceil())
}

fn to_count(x: f64) -> u32 {
    if x.is_nan() || x <= 0.0 {
        0
    } else if x >= f64::from(u32::MAX) {
        u32::MAX
    } else {
        // Non-negative and in range: the cast is exact for the integral values passed here.
        x as u32
    }
}

fn prune<T>(samples: &mut VecDeque<(Duration, T)>, now: Duration, window: Duration) {
    while samples
        .front()
        .is_some_and(|&(t, _)| now.saturating_sub(t) >= window && t != now)
    {
        samples.pop_front();
    }
}

fn mean_since(samples: &VecDeque<(Duration, f64)>, now: Duration, window: Duration) -> f64 {
    let (sum, n) = samples
        .iter()
        .filter(|&&(t, _)| now.saturating_sub(t) < window || t == now)
        .fold((0.0, 0u32), |(s, n), &(_, d)| (s + d, n + 1));
    if n == 0 { 0.0 } else { sum / f64::from(n) }
}

/// The groups to remove when going down by `count`: groups that are not serving yet
/// first (nothing to lose), then the ready groups holding the fewest requests (the
/// highest ordinal on a tie, so that a service shrinks from its end when idle), and groups
/// whose load is unknown last.
pub fn scale_down_victims(groups: &[GroupLoad], count: usize) -> Vec<u32> {
    let mut candidates: Vec<&GroupLoad> = groups
        .iter()
        .filter(|g| g.state != GroupState::Draining)
        .collect();
    candidates.sort_by(|a, b| {
        let keep_order = |g: &GroupLoad| match g.state {
            GroupState::Warming | GroupState::Draining => 0,
            GroupState::Ready => 1,
            GroupState::Unread => 2,
        };
        keep_order(a)
            .cmp(&keep_order(b))
            .then(a.queue_depth().cmp(&b.queue_depth()))
            .then(
                a.kv_usage
                    .partial_cmp(&b.kv_usage)
                    .unwrap_or(std::cmp::Ordering::Equal),
            )
            .then(b.group.cmp(&a.group))
    });
    candidates
        .into_iter()
        .take(count)
        .map(|g| g.group)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TICK: Duration = Duration::from_millis(500);

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    /// A closed-loop fleet: the trace gives the requests in the system at each moment,
    /// spread evenly over the ready groups; a new group serves `warm_up` after it is asked
    /// for, and scale-down removes the newest groups first.
    struct Fleet {
        warm_up: Duration,
        ready_at: Vec<Duration>,
    }

    impl Fleet {
        fn new(replicas: usize, warm_up: Duration) -> Self {
            Self {
                warm_up,
                ready_at: vec![Duration::ZERO; replicas],
            }
        }

        fn observe(&self, now: Duration, queue: u32) -> Observation {
            let ready = self.ready_at.iter().filter(|&&t| t <= now).count() as u32;
            let mut left = queue;
            let groups = self
                .ready_at
                .iter()
                .enumerate()
                .map(|(i, &t)| {
                    let group = i as u32;
                    if t > now {
                        return GroupLoad {
                            group,
                            state: GroupState::Warming,
                            waiting: 0,
                            running: 0,
                            kv_usage: 0.0,
                        };
                    }
                    let share = left.div_ceil(ready - group.min(ready - 1));
                    left -= share.min(left);
                    GroupLoad {
                        group,
                        state: GroupState::Ready,
                        waiting: 0,
                        running: share,
                        kv_usage: 0.0,
                    }
                })
                .collect();
            Observation {
                spec_replicas: self.ready_at.len() as u32,
                groups,
                // A router holds requests while nothing serves, and asks for a wake-up.
                wake_requested: ready == 0 && queue > 0,
                readings: Readings::default(),
            }
        }

        fn apply(&mut self, now: Duration, desired: u32) {
            let desired = desired as usize;
            while self.ready_at.len() < desired {
                self.ready_at.push(now + self.warm_up);
            }
            self.ready_at.truncate(desired);
        }
    }

    /// Runs `policy` on `fleet` from 0 to `until` with the queue given by `trace`.
    fn replay(
        policy: &mut Policy,
        fleet: &mut Fleet,
        until: f64,
        trace: impl Fn(f64) -> u32,
    ) -> Vec<(Duration, Decision)> {
        let mut decisions = Vec::new();
        let mut now = Duration::ZERO;
        while now <= secs(until) {
            let observation = fleet.observe(now, trace(now.as_secs_f64()));
            let decision = policy.decide(now, &observation);
            fleet.apply(now, decision.desired);
            decisions.push((now, decision));
            now += TICK;
        }
        decisions
    }

    fn first_time(decisions: &[(Duration, Decision)], f: impl Fn(&Decision) -> bool) -> f64 {
        decisions
            .iter()
            .find(|(_, d)| f(d))
            .map(|(t, _)| t.as_secs_f64())
            .unwrap_or(f64::INFINITY)
    }

    fn max_desired(decisions: &[(Duration, Decision)], from: f64, to: f64) -> u32 {
        decisions
            .iter()
            .filter(|(t, _)| (from..to).contains(&t.as_secs_f64()))
            .map(|(_, d)| d.desired)
            .max()
            .unwrap_or(0)
    }

    fn config() -> PolicyConfig {
        PolicyConfig {
            max_replicas: 20,
            ..PolicyConfig::default()
        }
    }

    #[test]
    fn rejects_bad_configs_by_name() {
        let bad = [
            (
                PolicyConfig {
                    target_queue_per_replica: 0.0,
                    ..config()
                },
                ConfigError::Target(0.0),
            ),
            (
                PolicyConfig {
                    target_kv_usage: Some(1.5),
                    ..config()
                },
                ConfigError::KvTarget(1.5),
            ),
            (
                PolicyConfig {
                    min_replicas: 0,
                    max_replicas: 0,
                    ..config()
                },
                ConfigError::MaxZero,
            ),
            (
                PolicyConfig {
                    min_replicas: 5,
                    max_replicas: 2,
                    ..config()
                },
                ConfigError::Bounds { min: 5, max: 2 },
            ),
            (
                PolicyConfig {
                    panic_window: secs(30.0),
                    ..config()
                },
                ConfigError::Windows {
                    panic: secs(30.0),
                    stable: secs(20.0),
                },
            ),
            (
                PolicyConfig {
                    panic_threshold: 1.0,
                    ..config()
                },
                ConfigError::PanicThreshold(1.0),
            ),
            (
                PolicyConfig {
                    tolerance: 1.0,
                    ..config()
                },
                ConfigError::Tolerance(1.0),
            ),
            (
                PolicyConfig {
                    max_scale_down_rate: 0.5,
                    ..config()
                },
                ConfigError::Rate {
                    which: "max scale-down",
                    value: 0.5,
                },
            ),
        ];
        for (config, error) in bad {
            assert_eq!(Policy::new(config).unwrap_err(), error);
        }
        let message = ConfigError::Bounds { min: 5, max: 2 }.to_string();
        assert!(message.contains("maxReplicas (2)"), "{message}");
    }

    #[test]
    fn idle_service_stays_at_min() {
        let mut policy = Policy::new(config()).unwrap();
        let mut fleet = Fleet::new(1, secs(5.0));
        let decisions = replay(&mut policy, &mut fleet, 120.0, |_| 0);
        assert!(
            decisions.iter().all(|(_, d)| d.desired == 1),
            "{decisions:?}"
        );
    }

    #[test]
    fn a_step_burst_scales_up_at_once_to_what_the_load_needs() {
        let mut policy = Policy::new(config()).unwrap();
        let mut fleet = Fleet::new(1, secs(10.0));
        // The load steps up after the first stable window, so that the panic a fresh
        // autoscaler starts in is over.
        let decisions = replay(
            &mut policy,
            &mut fleet,
            60.0,
            |t| if t < 30.0 { 4 } else { 16 },
        );
        let first_up = first_time(&decisions, |d| d.desired > 1);
        assert!(
            (30.0..=30.5).contains(&first_up),
            "first scale-up at {first_up}"
        );
        let (_, at_first) = decisions
            .iter()
            .find(|(t, _)| t.as_secs_f64() == first_up)
            .unwrap();
        assert_eq!(at_first.reason, Reason::Burst);
        assert!(at_first.panicking);
        assert!(first_time(&decisions, |d| d.desired == 4) <= 32.0);
        assert_eq!(max_desired(&decisions, 0.0, 60.0), 4);
    }

    #[test]
    fn a_queue_that_builds_while_replicas_warm_up_does_not_cascade() {
        let mut policy = Policy::new(config()).unwrap();
        let warm_up = 20.0;
        let mut fleet = Fleet::new(1, secs(warm_up));
        // Open-loop arrivals beyond capacity: the backlog keeps growing until the new
        // replicas serve, by a request every two seconds (half as much again over the
        // warm-up).
        let decisions = replay(&mut policy, &mut fleet, 60.0, |t| {
            if t < 30.0 {
                4
            } else {
                16 + ((t - 30.0) / 2.0) as u32
            }
        });
        let first_up = first_time(&decisions, |d| d.desired > 1);
        let held = max_desired(&decisions, 0.0, first_up + warm_up);
        assert!(
            held <= 5,
            "asked for {held} replicas while 4-5 were warming"
        );
        assert!(
            decisions
                .iter()
                .any(|(_, d)| d.reason == Reason::HoldWhileWarming),
            "the warm-up hold never engaged"
        );
    }

    #[test]
    fn a_second_larger_burst_adds_replicas_even_while_others_warm() {
        let mut policy = Policy::new(config()).unwrap();
        let mut fleet = Fleet::new(1, secs(30.0));
        let decisions = replay(&mut policy, &mut fleet, 50.0, |t| match t {
            t if t < 30.0 => 4,
            t if t < 40.0 => 16,
            _ => 64,
        });
        assert_eq!(max_desired(&decisions, 0.0, 40.0), 4);
        let second = first_time(&decisions, |d| d.desired > 4);
        assert!(
            (40.0..=41.0).contains(&second),
            "second burst met at {second}"
        );
        assert_eq!(max_desired(&decisions, 40.0, 51.0), 16);
    }

    #[test]
    fn never_scales_down_while_panicking_then_waits_out_the_delay() {
        let cfg = config();
        let mut policy = Policy::new(cfg.clone()).unwrap();
        let mut fleet = Fleet::new(1, secs(2.0));
        let load_end = 35.0;
        let decisions = replay(&mut policy, &mut fleet, 170.0, |t| match t {
            t if t < 30.0 => 4,
            t if t < load_end => 32,
            _ => 0,
        });
        assert_eq!(max_desired(&decisions, 0.0, 170.0), 8);
        let panic_end = first_time(&decisions, |d| !d.panicking && d.desired == 8);
        assert!(
            decisions
                .iter()
                .filter(|(t, _)| t.as_secs_f64() < panic_end && t.as_secs_f64() > load_end)
                .all(|(_, d)| d.desired == 8),
            "scaled down while panicking"
        );
        assert!(
            decisions
                .iter()
                .any(|(_, d)| d.reason == Reason::HoldWhilePanicking)
        );
        // The last burst tick was just before the load ended; the count may only fall a
        // whole scale-down delay after it.
        let first_down = decisions
            .iter()
            .find(|(t, d)| t.as_secs_f64() > load_end && d.desired < 8)
            .map_or(f64::INFINITY, |(t, _)| t.as_secs_f64());
        assert!(
            first_down >= load_end + cfg.scale_down_delay.as_secs_f64() - 1.0,
            "first scale-down at {first_down}"
        );
        // No step larger than the max scale-down rate, and back to the minimum.
        let counts: Vec<u32> = decisions.iter().map(|(_, d)| d.desired).collect();
        for pair in counts.windows(2) {
            assert!(
                f64::from(pair[1]) >= (f64::from(pair[0]) / cfg.max_scale_down_rate).floor(),
                "{pair:?}"
            );
        }
        assert_eq!(*counts.last().unwrap(), 1);
    }

    #[test]
    fn a_restarted_autoscaler_does_not_scale_down_on_an_empty_history() {
        let mut policy = Policy::new(config()).unwrap();
        let mut fleet = Fleet::new(5, Duration::ZERO);
        let decisions = replay(&mut policy, &mut fleet, 19.0, |_| 0);
        assert!(decisions.iter().all(|(_, d)| d.desired == 5));
        assert!(decisions[0].1.panicking);
    }

    #[test]
    fn demand_within_tolerance_keeps_the_count() {
        let mut policy = Policy::new(config()).unwrap();
        let mut fleet = Fleet::new(4, Duration::ZERO);
        let decisions = replay(&mut policy, &mut fleet, 60.0, |t| {
            if (t as u32).is_multiple_of(2) { 17 } else { 15 }
        });
        assert!(decisions.iter().all(|(_, d)| d.desired == 4));
        assert_eq!(decisions.last().unwrap().1.reason, Reason::Steady);
    }

    #[test]
    fn an_objectives_demand_above_the_count_scales_up_within_the_tolerance() {
        // 4.2 groups against 4: within the tolerance of a queue depth, short of the
        // objectives'. Below the count the tolerance still holds it.
        for (demand, expected) in [(4.2, 5), (3.8, 4)] {
            let mut policy = Policy::new(config()).unwrap();
            let mut fleet = Fleet::new(4, Duration::ZERO);
            let mut now = Duration::ZERO;
            let mut last = None;
            while now <= secs(30.0) {
                let observation = fleet.observe(now, 0);
                let decision = policy.decide_on(now, &observation, Some(demand));
                fleet.apply(now, decision.desired);
                last = Some(decision.desired);
                now += TICK;
            }
            assert_eq!(last, Some(expected), "demand {demand}");
        }
    }

    #[test]
    fn a_sine_load_is_followed_without_flapping() {
        let mut policy = Policy::new(config()).unwrap();
        let mut fleet = Fleet::new(1, secs(5.0));
        let period = 120.0;
        let queue = |t: f64| (20.0 - 16.0 * (std::f64::consts::TAU * t / period).cos()) as u32;
        let decisions = replay(&mut policy, &mut fleet, 5.0 * period, queue);
        let counts: Vec<u32> = decisions.iter().map(|(_, d)| d.desired).collect();
        assert!(counts.iter().all(|&c| c <= 9), "above the peak's need");
        // Up and down once per period, not more.
        let mut reversals = 0;
        let mut direction = 0i64;
        for pair in counts.windows(2) {
            let step = i64::from(pair[1]) - i64::from(pair[0]);
            if step != 0 && step.signum() != direction {
                reversals += 1;
                direction = step.signum();
            }
        }
        assert!((8..=11).contains(&reversals), "{reversals} reversals");
        // At the top of every wave, within one replica of what the peak needs (the
        // stable window averages over the rise).
        for k in 0..5 {
            let peak = (k as f64 + 0.5) * period;
            let (_, at_peak) = decisions
                .iter()
                .find(|(t, _)| t.as_secs_f64() >= peak)
                .unwrap();
            assert!(
                at_peak.desired >= 8,
                "{} replicas at peak {k}",
                at_peak.desired
            );
        }
    }

    #[test]
    fn kv_cache_use_drives_scaling_when_it_is_the_tighter_limit() {
        let observation = Observation {
            spec_replicas: 1,
            groups: vec![GroupLoad {
                group: 0,
                state: GroupState::Ready,
                waiting: 0,
                running: 2,
                kv_usage: 0.9,
            }],
            wake_requested: false,
            readings: Readings::default(),
        };
        let mut with_kv = Policy::new(PolicyConfig {
            target_kv_usage: Some(0.5),
            ..config()
        })
        .unwrap();
        let mut queue_only = Policy::new(config()).unwrap();
        assert_eq!(with_kv.decide(Duration::ZERO, &observation).desired, 2);
        assert_eq!(queue_only.decide(Duration::ZERO, &observation).desired, 1);
    }

    #[test]
    fn the_count_stays_within_min_and_max() {
        let mut policy = Policy::new(PolicyConfig {
            max_replicas: 3,
            ..config()
        })
        .unwrap();
        let mut fleet = Fleet::new(1, Duration::ZERO);
        let decisions = replay(&mut policy, &mut fleet, 5.0, |_| 400);
        assert_eq!(decisions[0].1.desired, 3);
        assert_eq!(decisions[0].1.reason, Reason::Bounds);
        assert!(decisions.iter().all(|(_, d)| d.desired == 3));
    }

    #[test]
    fn a_scale_up_is_cut_to_the_max_rate() {
        let mut policy = Policy::new(PolicyConfig {
            max_scale_up_rate: 2.0,
            ..config()
        })
        .unwrap();
        let mut fleet = Fleet::new(1, Duration::ZERO);
        let decisions = replay(&mut policy, &mut fleet, 2.0, |_| 40);
        let counts: Vec<u32> = decisions.iter().map(|(_, d)| d.desired).collect();
        assert_eq!(counts, vec![2, 4, 8, 10, 10]);
        assert_eq!(decisions[0].1.reason, Reason::RateLimited);
    }

    #[test]
    fn scale_down_takes_warming_groups_then_the_least_loaded() {
        let group = |group, state, depth| GroupLoad {
            group,
            state,
            waiting: 0,
            running: depth,
            kv_usage: 0.0,
        };
        let groups = [
            group(0, GroupState::Ready, 3),
            group(1, GroupState::Ready, 1),
            group(2, GroupState::Draining, 0),
            group(3, GroupState::Warming, 0),
            group(4, GroupState::Ready, 1),
            group(5, GroupState::Ready, 0),
        ];
        assert_eq!(scale_down_victims(&groups, 1), vec![3]);
        assert_eq!(scale_down_victims(&groups, 3), vec![3, 5, 4]);
        assert_eq!(scale_down_victims(&groups, 10), vec![3, 5, 4, 1, 0]);
    }

    fn scale_to_zero_config() -> PolicyConfig {
        PolicyConfig {
            min_replicas: 0,
            idle_before_zero: secs(60.0),
            ..config()
        }
    }

    #[test]
    fn an_idle_fleet_goes_to_zero_after_the_idle_window_and_a_request_wakes_one_group() {
        let mut policy = Policy::new(scale_to_zero_config()).unwrap();
        let mut fleet = Fleet::new(2, secs(5.0));
        let decisions = replay(&mut policy, &mut fleet, 240.0, |t| match t {
            t if t < 30.0 => 8,
            t if t < 200.0 => 0,
            _ => 3,
        });
        // The last request left at 29.5 s: not a tick at zero before a whole idle window.
        let zero_at = first_time(&decisions, |d| d.desired == 0);
        assert!(
            (89.5..=90.5).contains(&zero_at),
            "went to zero at {zero_at}"
        );
        let (_, to_zero) = decisions
            .iter()
            .find(|(t, _)| t.as_secs_f64() == zero_at)
            .unwrap();
        assert_eq!(to_zero.reason, Reason::Idle);
        assert_eq!(
            to_zero.message(1),
            "ScaledToZero 1 -> 0 replicas: no request for 60 s"
        );
        assert_eq!(
            max_desired(&decisions, zero_at, 200.0),
            0,
            "woke with no request"
        );
        // The first held request wakes exactly one group, at once.
        let woke_at = first_time(&decisions, |d| d.reason == Reason::Wake);
        assert_eq!(woke_at, 200.0);
        assert_eq!(max_desired(&decisions, 200.0, 240.5), 1);
        assert!(
            decisions
                .iter()
                .filter(|(t, _)| t.as_secs_f64() >= 200.0)
                .all(|(_, d)| d.desired == 1)
        );
    }

    #[test]
    fn a_warming_group_is_never_taken_to_zero() {
        let mut policy = Policy::new(scale_to_zero_config()).unwrap();
        // A model load longer than the idle window.
        let mut fleet = Fleet::new(0, secs(100.0));
        let decisions = replay(&mut policy, &mut fleet, 150.0, |t| u32::from(t < 1.0));
        assert_eq!(decisions[0].1.reason, Reason::Wake);
        assert!(
            decisions.iter().all(|(_, d)| d.desired == 1),
            "went to zero while warming"
        );
    }

    #[test]
    fn a_fleet_at_zero_stays_there_until_a_wake_request() {
        let mut policy = Policy::new(scale_to_zero_config()).unwrap();
        let mut fleet = Fleet::new(0, secs(5.0));
        let decisions = replay(&mut policy, &mut fleet, 30.0, |_| 0);
        assert!(decisions.iter().all(|(_, d)| d.desired == 0));
        // With a floor of one group, zero is lifted to the minimum.
        let mut policy = Policy::new(config()).unwrap();
        let mut fleet = Fleet::new(0, secs(5.0));
        let decisions = replay(&mut policy, &mut fleet, 1.0, |_| 0);
        assert_eq!(decisions[0].1.desired, 1);
        assert_eq!(decisions[0].1.reason, Reason::Bounds);
    }

    #[test]
    fn the_event_message_names_the_reason_and_the_numbers() {
        let decision = Decision {
            desired: 4,
            reason: Reason::Burst,
            stable_demand: 1.5,
            panic_demand: 3.75,
            queue_per_replica: Some(15.0),
            panicking: true,
            idle_for: Duration::ZERO,
            unread: None,
        };
        assert_eq!(
            decision.message(1),
            "Burst 1 -> 4 replicas: 15.00 requests per ready replica, replica groups demanded 1.50 over the stable window / 3.75 over the panic window (panic mode)"
        );
    }

    /// `replicas` ready groups whose first `unread` could not be read; each read one holds
    /// `queue` requests.
    fn partly_read(replicas: u32, unread: u32, queue: u32) -> Observation {
        let groups = (0..replicas)
            .map(|group| {
                let read = group >= unread;
                GroupLoad {
                    group,
                    state: if read {
                        GroupState::Ready
                    } else {
                        GroupState::Unread
                    },
                    waiting: 0,
                    running: if read { queue } else { 0 },
                    kv_usage: 0.0,
                }
            })
            .collect();
        Observation {
            spec_replicas: replicas,
            groups,
            wake_requested: false,
            readings: Readings {
                asked: replicas,
                failed: unread,
                first_error: (unread > 0)
                    .then(|| "no load report from 127.0.0.9:8001 within 400ms".to_owned()),
            },
        }
    }

    /// Decisions every tick from `from` to `until` seconds for the same observation.
    fn hold_for(
        policy: &mut Policy,
        from: f64,
        until: f64,
        observation: &Observation,
    ) -> Vec<(Duration, Decision)> {
        let mut decisions = Vec::new();
        let mut now = secs(from);
        while now <= secs(until) {
            decisions.push((now, policy.decide(now, observation)));
            now += TICK;
        }
        decisions
    }

    #[test]
    fn a_fleet_whose_load_cannot_be_read_holds_and_never_goes_to_zero() {
        let mut policy = Policy::new(scale_to_zero_config()).unwrap();
        // Ten idle windows and many scale-down delays without a single reading.
        let decisions = hold_for(&mut policy, 0.0, 600.0, &partly_read(3, 3, 0));
        assert!(
            decisions.iter().all(|(_, d)| d.desired == 3),
            "{:?}",
            decisions.iter().find(|(_, d)| d.desired != 3)
        );
        let (_, last) = decisions.last().unwrap();
        assert_eq!(last.reason, Reason::MetricsUnavailable);
        assert_eq!(last.queue_per_replica, None);
        assert_eq!(last.unread, Some((3, 3)));
        assert!(
            last.message(3).contains("load unknown")
                && last
                    .message(3)
                    .ends_with("the load of 3 of 3 serving workers could not be read"),
            "{}",
            last.message(3)
        );
        // The same fleet read as idle goes down to one group, then to zero.
        let mut read = Policy::new(scale_to_zero_config()).unwrap();
        let decisions = hold_for(&mut read, 0.0, 600.0, &partly_read(3, 0, 0));
        assert!(decisions.iter().any(|(_, d)| d.desired < 3));
        assert!(decisions.iter().any(|(_, d)| d.reason == Reason::Idle));
    }

    #[test]
    fn with_some_workers_unread_the_count_rises_with_the_load_but_never_falls() {
        let mut policy = Policy::new(config()).unwrap();
        // The two readable groups are idle: before, that read as a fleet to shrink.
        let idle = hold_for(&mut policy, 0.0, 120.0, &partly_read(3, 1, 0));
        assert!(idle.iter().all(|(_, d)| d.desired == 3));
        assert_eq!(idle.last().unwrap().1.reason, Reason::MetricsUnavailable);
        assert_eq!(idle.last().unwrap().1.queue_per_replica, Some(0.0));
        assert_eq!(idle.last().unwrap().1.unread, Some((1, 3)));
        // A burst on the readable ones (a floor of the real load) still scales up at once.
        let burst = policy.decide(secs(120.5), &partly_read(3, 1, 40));
        assert!(burst.desired > 3, "{burst:?}");
        assert!(
            burst
                .message(3)
                .ends_with("1 of 3 serving workers could not be read")
        );
    }

    #[test]
    fn readings_that_come_back_resume_scaling_after_a_full_scale_down_delay() {
        let cfg = config();
        let mut policy = Policy::new(cfg.clone()).unwrap();
        hold_for(&mut policy, 0.0, 60.0, &partly_read(3, 3, 0));
        let back = hold_for(&mut policy, 60.5, 200.0, &partly_read(3, 0, 0));
        assert_eq!(back[0].1.unread, None);
        let first_down = first_time(&back, |d| d.desired < 3);
        assert!(
            first_down >= 60.5 + cfg.scale_down_delay.as_secs_f64(),
            "scaled down at {first_down}, readings back at 60.5"
        );
        assert!(first_down.is_finite(), "never scaled down once read");
    }
}

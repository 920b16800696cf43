//! Sizing a fleet by latency objectives (`spec.autoscaling.objectives`), free of clocks and
//! I/O like [`super::policy`].
//!
//! [`Tracker`] turns the workers' cumulative counters into the demand (arrival rate, prompt
//! and output lengths) over two windows and into the [`Capacity`] model, and measures how
//! long a new replica group takes to become ready. [`size`] then finds the fewest replica
//! groups whose predicted percentiles meet the targets, each taking at most [`UTILISATION`]
//! of the rate one group serves within them; that demand, in groups and fractional as a
//! queue depth over its target is, goes through the queue policy's machinery
//! ([`super::policy::Policy::decide_on`]) for bounds, rates, the scale-down delay and scale
//! to zero.
//!
//! # The queueing approximation
//!
//! Arrivals are split evenly over `n` groups (the router balances them), `λ` each. A request
//! with a prompt of `P` tokens costs a prefill `s = a + b·P` of device time; prefill takes
//! `ρ = λ·E[s]` of the device, decode steps the rest. Decoding `B` sequences at once, a step
//! takes `c + d·B` and, with prefill interleaved, a sequence waits `(c + d·B) / (1 - ρ)` per
//! token (TPOT). By Little's law `B = λ·O·TPOT` for `O` output tokens a request, so
//! `B = u·c / (1 - u·d)` with `u = λ·O / (1 - ρ)`; the group keeps up only while `u·d < 1`,
//! `ρ < 1` and `B` fits its batch.
//!
//! Time to first token is the prefill queue's wait, the request's own prefill and a step in
//! flight. The queue is M/G/1 (Pollaczek–Khinchine mean wait `λ·E[s²] / (2(1 - ρ))`) with the
//! exponential tail `P(W > t) = ρ·e^(-t·ρ/E[W])`, and the prefill's percentile is that of a
//! normal prompt length with the measured mean and spread (at least the mean). TPOT varies
//! little between requests (each averages over its own tokens), so its percentile is the
//! mean. The arrival rate planned for is the higher of the long window's and the short
//! window's less its Poisson noise (one standard deviation of its count), plus the queued
//! requests spread over the measured time a new group takes to become ready (at least the
//! short window): capacity asked for now serves only that much later, and must work off
//! what queued meanwhile. The prompt lengths are the short window's when its mean is the
//! higher: long prompts arriving at the rate short ones did are a burst of work that the
//! long window's mean dilutes.
//!
//! The queueing approximation's tail is a model; the workers measure the real one. Once a
//! long window holds [`MIN_MEASURED`] first tokens, the TTFT percentile they measured is
//! compared with the one predicted for the same arrivals on the same number of groups, and
//! every TTFT prediction is multiplied by the ratio (bounded to [`CALIBRATION_BOUNDS`]) until
//! the next such window: the correction an NVIDIA Dynamo planner applies too. TPOT is
//! corrected the same way, against the batch-weighted mean decode step the workers ran over
//! the window stretched by the share of time their prompt steps took: the fitted decode line
//! is a least-squares fit over every batch seen, and the batch the model solves for nears
//! its throughput limit long before the engine does.
//!
//! Until both step kinds have [`MIN_STEPS`] samples the model is the conservative default;
//! for the first long window after a start the count holds instead ([`Unknown::Starting`]),
//! as those steps come within a second under load.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use npufleet_contract::proto::npufleet::v1::{LatencyHistogram, LoadReport};

use super::capacity::{Capacity, Line, MIN_STEPS, Sums};

/// Demand is measured over a long window and a short one; the short one sees a burst first.
pub const LONG_WINDOW: Duration = Duration::from_secs(20);
pub const SHORT_WINDOW: Duration = Duration::from_secs(5);
/// A replica group's time to ready until one is measured: a model load of a mid-sized model.
pub const DEFAULT_READY_SECONDS: f64 = 30.0;
/// Batch a group runs when its workers do not say.
const DEFAULT_MAX_BATCH: f64 = 128.0;
/// First tokens a long window needs before its measured percentile calibrates the TTFT
/// predictions: fewer say little about a p90.
pub const MIN_MEASURED: f64 = 20.0;
/// Prompts the short window must have admitted for its mean prompt length to count.
const MIN_SHORT_ADMITTED: f64 = 4.0;
/// The share of the rate the model says one group serves within the objectives that a
/// group is sized to take. At the model's edge a fleet has nothing for the Poisson bursts
/// within a window nor for the rise while a new group becomes ready: sized to 1.0, the
/// simulator's fourfold step met the TTFT objective for 86.6 % of requests (1,659
/// replica-seconds); at 0.9, for 96.5 % (1,630).
pub const UTILISATION: f64 = 0.9;
/// How far the calibration may move a TTFT prediction, down and up.
pub const CALIBRATION_BOUNDS: (f64, f64) = (0.25, 4.0);

/// A latency histogram as a worker reports it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Latencies {
    /// Ascending upper bounds.
    pub bounds: Vec<f64>,
    /// Observations at or below each bound.
    pub cumulative: Vec<f64>,
    /// Every observation, those above the last bound too.
    pub count: f64,
}

impl Latencies {
    /// A report's histogram; empty when it is malformed (bounds not ascending, not one
    /// count per bound, or counts falling).
    fn of(h: &LatencyHistogram) -> Self {
        let ascending = h.upper_bounds.windows(2).all(|w| w[0] < w[1]);
        let counts = h.cumulative_counts.windows(2).all(|w| w[0] <= w[1])
            && h.cumulative_counts.last().is_none_or(|c| *c <= h.count);
        if !ascending || !counts || h.upper_bounds.len() != h.cumulative_counts.len() {
            return Self::default();
        }
        Self {
            bounds: h.upper_bounds.clone(),
            cumulative: h.cumulative_counts.iter().map(|c| *c as f64).collect(),
            count: h.count as f64,
        }
    }

    /// An empty histogram over `bounds` (ascending).
    pub fn over(bounds: &[f64]) -> Self {
        Self {
            bounds: bounds.to_vec(),
            cumulative: vec![0.0; bounds.len()],
            count: 0.0,
        }
    }

    /// Counts one observation of `seconds`.
    pub fn record(&mut self, seconds: f64) {
        for (bound, c) in self.bounds.iter().zip(&mut self.cumulative) {
            if seconds <= *bound {
                *c += 1.0;
            }
        }
        self.count += 1.0;
    }

    /// What was observed between two readings; empty when the bounds changed or a count
    /// went back (a restarted worker).
    fn between(old: &Self, new: &Self) -> Self {
        if old.bounds != new.bounds || new.count < old.count {
            return Self::default();
        }
        let cumulative: Vec<f64> = new
            .cumulative
            .iter()
            .zip(&old.cumulative)
            .map(|(n, o)| n - o)
            .collect();
        if cumulative.iter().any(|c| *c < 0.0) {
            return Self::default();
        }
        Self {
            bounds: new.bounds.clone(),
            cumulative,
            count: new.count - old.count,
        }
    }

    /// Adds `other`'s observations; those over other bounds than the first seen are left out.
    fn add(&mut self, other: &Self) {
        if other.count == 0.0 {
            return;
        }
        if self.count == 0.0 {
            *self = other.clone();
        } else if self.bounds == other.bounds {
            for (c, o) in self.cumulative.iter_mut().zip(&other.cumulative) {
                *c += o;
            }
            self.count += other.count;
        }
    }

    /// The `q` quantile, linear within its bucket (the first from zero); the last bound when
    /// it lies above it; `None` without observations.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count <= 0.0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * self.count;
        let (mut lower, mut below) = (0.0, 0.0);
        for (bound, c) in self.bounds.iter().zip(&self.cumulative) {
            if *c >= rank {
                let share = if *c > below {
                    (rank - below) / (c - below)
                } else {
                    1.0
                };
                return Some(lower + share * (bound - lower));
            }
            (lower, below) = (*bound, *c);
        }
        self.bounds.last().copied()
    }
}

/// One worker's cumulative counters, as its load report carries them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Counters {
    pub requests: f64,
    pub admitted: f64,
    pub finished: f64,
    pub prompt_tokens: f64,
    pub prompt_tokens_squared: f64,
    pub output_tokens: f64,
    pub prefill: Sums,
    pub decode: Sums,
    /// The worker's timed warm-up passes, measured once at its start (not in `prefill` and
    /// `decode`).
    pub warm_up: Capacity,
    pub time_to_first_token: Latencies,
}

impl Counters {
    /// The counters of a report; `None` for a report without step timings (an engine other
    /// than this project's worker, read from its metrics).
    pub fn of(report: &LoadReport) -> Option<Self> {
        if report.timestamp_unix_ms == 0 {
            return None;
        }
        // Prompt tokens found in the prefix cache are not computed: the prefill the model
        // predicts is of the rest. The squared lengths are only known whole, so they shrink
        // by the worker's overall share computed.
        let prompt = report.prompt_tokens_total as f64;
        let computed = (prompt - report.prefix_cache_hits_total as f64).max(0.0);
        let share = if prompt > 0.0 { computed / prompt } else { 1.0 };
        Some(Self {
            requests: report.requests_total as f64,
            admitted: report.requests_admitted_total as f64,
            finished: report.requests_finished_total as f64,
            prompt_tokens: computed,
            prompt_tokens_squared: report.prompt_tokens_squared_total * share * share,
            output_tokens: report.generation_tokens_total as f64,
            prefill: Sums {
                n: report.prefill_steps_total as f64,
                x: report.prefill_step_tokens_total as f64,
                y: report.prefill_step_seconds_total,
                xx: report.prefill_step_tokens_squared_total,
                xy: report.prefill_step_tokens_seconds_total,
            },
            decode: Sums {
                n: report.decode_steps_total as f64,
                x: report.decode_step_batch_total as f64,
                y: report.decode_step_seconds_total,
                xx: report.decode_step_batch_squared_total,
                xy: report.decode_step_batch_seconds_total,
            },
            warm_up: Capacity::of_warm_up(report),
            time_to_first_token: report
                .time_to_first_token
                .as_ref()
                .map(Latencies::of)
                .unwrap_or_default(),
        })
    }

    /// What happened between two readings of one worker; `None` when a counter went back.
    fn between(old: &Self, new: &Self) -> Option<Self> {
        let d = Self {
            requests: new.requests - old.requests,
            admitted: new.admitted - old.admitted,
            finished: new.finished - old.finished,
            prompt_tokens: new.prompt_tokens - old.prompt_tokens,
            prompt_tokens_squared: new.prompt_tokens_squared - old.prompt_tokens_squared,
            output_tokens: new.output_tokens - old.output_tokens,
            prefill: Sums::between(&old.prefill, &new.prefill)?,
            decode: Sums::between(&old.decode, &new.decode)?,
            warm_up: Capacity::default(),
            time_to_first_token: Latencies::between(
                &old.time_to_first_token,
                &new.time_to_first_token,
            ),
        };
        let counts = [
            d.requests,
            d.admitted,
            d.finished,
            d.prompt_tokens,
            d.prompt_tokens_squared,
            d.output_tokens,
        ];
        counts.iter().all(|v| *v >= 0.0).then_some(d)
    }

    fn add(&mut self, other: &Self) {
        self.requests += other.requests;
        self.admitted += other.admitted;
        self.finished += other.finished;
        self.prompt_tokens += other.prompt_tokens;
        self.prompt_tokens_squared += other.prompt_tokens_squared;
        self.output_tokens += other.output_tokens;
        self.prefill.add(&other.prefill);
        self.decode.add(&other.decode);
        self.time_to_first_token.add(&other.time_to_first_token);
    }
}

/// One group at one tick, as the tracker needs it.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupSample {
    pub group: u32,
    pub ready: bool,
    /// Started and not serving yet: loading weights beside the groups that serve.
    pub warming: bool,
    /// The serving worker's counters, when it answered with them.
    pub counters: Option<Counters>,
    /// The batch the worker runs (its `max_batch_size`), when it said.
    pub max_batch: Option<u32>,
}

/// The demand of one service.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Demand {
    /// Requests per second to plan for (the projection described in the module docs).
    pub rate: f64,
    /// Requests per second measured over the long window.
    pub measured_rate: f64,
    pub mean_prompt: f64,
    /// Mean of the squared prompt lengths.
    pub prompt_second_moment: f64,
    pub mean_output: f64,
    /// Prefill steps per request (at least 1): a prompt longer than a step's token budget
    /// is computed in chunks, each paying the step's fixed cost.
    pub prefill_steps: f64,
    /// The batch of one group.
    pub max_batch: f64,
}

impl Demand {
    /// Device seconds the prefill of a `prompt`-token prompt takes, its chunks counted in
    /// proportion to its length.
    fn prefill_seconds(&self, line: &Line, prompt: f64) -> f64 {
        let chunks = if self.mean_prompt > 0.0 {
            (self.prefill_steps * prompt / self.mean_prompt).max(1.0)
        } else {
            1.0
        };
        line.intercept * chunks + line.slope * prompt
    }
}

/// A latency objective as fractions: the quantile in (0, 1) and the target in seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Target {
    pub quantile: f64,
    pub seconds: f64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Targets {
    pub ttft: Option<Target>,
    pub tpot: Option<Target>,
}

/// Predicted percentiles; `None` where the groups cannot keep up at all.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prediction {
    pub ttft: Option<f64>,
    pub tpot: Option<f64>,
}

impl Prediction {
    /// The prediction with its TTFT and TPOT multiplied by their calibration factors.
    fn calibrated(self, factors: Factors) -> Self {
        Self {
            ttft: self.ttft.map(|t| t * factors.ttft),
            tpot: self.tpot.map(|t| t * factors.tpot),
        }
    }

    /// Whether every objective set is met.
    pub fn meets(&self, targets: &Targets) -> bool {
        let ok = |predicted: Option<f64>, target: Option<Target>| match target {
            None => true,
            Some(t) => predicted.is_some_and(|p| p <= t.seconds),
        };
        ok(self.ttft, targets.ttft) && ok(self.tpot, targets.tpot)
    }
}

/// The predicted percentiles with `replicas` groups sharing `demand`.
pub fn predict(
    capacity: &Capacity,
    demand: &Demand,
    targets: &Targets,
    replicas: u32,
) -> Prediction {
    let unstable = Prediction {
        ttft: None,
        tpot: None,
    };
    if replicas == 0 {
        return unstable;
    }
    let prefill: Line = capacity.prefill();
    let decode: Line = capacity.decode();
    let lambda = demand.rate.max(0.0) / f64::from(replicas);
    // Per request a·k + b·P with k = k̄·P/P̄ chunks: in proportion to P for a known mean.
    let mean_s = demand.prefill_seconds(&prefill, demand.mean_prompt);
    let second_s = if demand.mean_prompt > 0.0 {
        (mean_s / demand.mean_prompt).powi(2) * demand.prompt_second_moment
    } else {
        mean_s * mean_s
    };
    let rho = lambda * mean_s;
    if rho >= 1.0 {
        return unstable;
    }
    let u = lambda * demand.mean_output / (1.0 - rho);
    let (c, d) = (decode.intercept, decode.slope);
    if u * d >= 1.0 {
        return unstable;
    }
    let batch = u * c / (1.0 - u * d);
    if batch > demand.max_batch {
        return unstable;
    }
    let step = c + d * batch;
    let tpot = step / (1.0 - rho);

    let ttft = targets.ttft.map_or(0.5, |t| t.quantile);
    let mean_wait = lambda * second_s / (2.0 * (1.0 - rho));
    let wait = if rho > 0.0 && rho > 1.0 - ttft {
        mean_wait / rho * (rho / (1.0 - ttft)).ln()
    } else {
        0.0
    };
    let variance = (demand.prompt_second_moment - demand.mean_prompt.powi(2)).max(0.0);
    let prompt = demand.mean_prompt + normal_quantile(ttft).max(0.0) * variance.sqrt();
    Prediction {
        ttft: Some(wait + demand.prefill_seconds(&prefill, prompt) + step),
        tpot: Some(tpot),
    }
}

/// What the predictions are multiplied by: measured over predicted, per objective.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Factors {
    pub ttft: f64,
    pub tpot: f64,
}

impl Factors {
    pub const NONE: Factors = Factors {
        ttft: 1.0,
        tpot: 1.0,
    };
}

/// The replica-group count the objectives ask for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sizing {
    pub replicas: u32,
    /// The demand in replica groups, fractional: the planned arrival rate over
    /// [`UTILISATION`] of the highest rate one group is predicted to serve within every
    /// objective. `replicas` is its ceiling within the bounds. The built-in policy averages this, not the count: a mean
    /// of whole counts rounded up holds a group bought for one tick's blip for the whole
    /// stable window.
    pub groups: f64,
    /// Whether that many groups are predicted to meet every objective; when not, more would
    /// not help (see [`size`]).
    pub met: bool,
    pub at_replicas: Prediction,
}

/// The fewest groups, up to `max_replicas`, predicted to meet every objective. An objective
/// that no count can meet (the prefill of a long prompt alone outlasts the target) becomes a
/// budget for the delay that queueing adds to what an idle group would give: more groups
/// than that buy nothing the objective asks for. `met` says whether every objective as
/// written is met. Every prediction is multiplied by its calibration `factors`.
pub fn size(
    capacity: &Capacity,
    demand: &Demand,
    targets: &Targets,
    max_replicas: u32,
    factors: Factors,
) -> Sizing {
    let max_replicas = max_replicas.max(1);
    let predict = |demand: &Demand, n| predict(capacity, demand, targets, n).calibrated(factors);
    let idle = predict(
        &Demand {
            rate: 0.0,
            ..*demand
        },
        1,
    );
    let reachable = |target: Option<Target>, floor: Option<f64>| {
        target.map(|t| match floor {
            Some(floor) if floor > t.seconds => Target {
                seconds: floor + t.seconds,
                ..t
            },
            _ => t,
        })
    };
    let aimed = Targets {
        ttft: reachable(targets.ttft, idle.ttft),
        tpot: reachable(targets.tpot, idle.tpot),
    };
    let met = aimed == *targets;
    let planned = Demand {
        rate: demand.rate / UTILISATION,
        ..*demand
    };
    let groups = groups_demanded(&planned, |rate| {
        predict(&Demand { rate, ..*demand }, 1).meets(&aimed)
    });
    for n in 1..=max_replicas {
        if predict(&planned, n).meets(&aimed) {
            return Sizing {
                replicas: n,
                groups: groups.min(f64::from(n)),
                met,
                at_replicas: predict(demand, n),
            };
        }
    }
    Sizing {
        replicas: max_replicas,
        groups: groups.max(f64::from(max_replicas)),
        met: false,
        at_replicas: predict(demand, max_replicas),
    }
}

/// `demand.rate` over the highest rate one group serves while `one_meets(rate)`. The
/// predictions depend on the groups only through the rate each takes (arrivals split
/// evenly), so `n` groups meet the objectives exactly while `rate / n` is at most that rate,
/// and the quotient is the demand in groups. Bisection: meeting is monotone in the rate.
fn groups_demanded(demand: &Demand, one_meets: impl Fn(f64) -> bool) -> f64 {
    let rate = demand.rate.max(0.0);
    if rate == 0.0 {
        return 0.0;
    }
    if !one_meets(0.0) {
        return f64::INFINITY;
    }
    let mut low = 0.0;
    let mut high = rate.max(1e-3);
    while one_meets(high) {
        low = high;
        high *= 2.0;
        if high > 1e9 {
            return 0.0;
        }
    }
    for _ in 0..40 {
        let mid = 0.5 * (low + high);
        if one_meets(mid) {
            low = mid;
        } else {
            high = mid;
        }
    }
    if low > 0.0 { rate / low } else { f64::INFINITY }
}

/// How an objective's predictions compare with what the workers measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Calibration {
    /// What the workers measured over the long window it was taken from.
    pub measured: f64,
    /// `measured` over the prediction for that window's arrivals on its groups, within
    /// [`CALIBRATION_BOUNDS`]: what every prediction of the objective is multiplied by.
    pub factor: f64,
}

/// The calibration from a long window in which the workers measured `measured` (of the
/// objective `objective` picks from a prediction), with `demand` arriving at its measured
/// rate on `groups` groups on average; `None` when the model predicts those groups cannot
/// keep up.
fn calibrate(
    capacity: &Capacity,
    demand: &Demand,
    targets: &Targets,
    (measured, groups): (f64, f64),
    objective: fn(&Prediction) -> Option<f64>,
) -> Option<Calibration> {
    let groups = (groups.round() as u32).max(1);
    let window = Demand {
        rate: demand.measured_rate,
        ..*demand
    };
    let predicted = objective(&predict(capacity, &window, targets, groups))?;
    (predicted > 0.0).then(|| Calibration {
        measured,
        factor: (measured / predicted).clamp(CALIBRATION_BOUNDS.0, CALIBRATION_BOUNDS.1),
    })
}

/// One evaluation of the objectives.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Evaluation {
    pub demand: Demand,
    pub sizing: Sizing,
    /// The prediction with the groups serving now.
    pub at_ready: Prediction,
    /// The calibration the TTFT predictions above include, once there is one.
    pub ttft_calibration: Option<Calibration>,
    /// The calibration the TPOT predictions above include, once there is one.
    pub tpot_calibration: Option<Calibration>,
}

/// Takes in one tick (`groups` at `now`, `waiting` requests queued, `ready` groups serving)
/// and evaluates the objectives for at most `max_replicas` groups.
pub fn evaluate(
    tracker: &mut Tracker,
    now: Duration,
    groups: &[GroupSample],
    (waiting, ready): (u32, u32),
    targets: &Targets,
    max_replicas: u32,
) -> Result<Evaluation, Unknown> {
    tracker.observe(now, groups);
    let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    let serving = groups.iter().filter(|g| g.ready);
    let with_counters = serving.clone().filter(|g| g.counters.is_some()).count();
    let demand = tracker.demand(now, waiting, count(serving.count()), count(with_counters))?;
    let capacity = *tracker.capacity();
    if let Some(target) = targets.ttft
        && let Some(measured) = tracker.measured_ttft(target.quantile)
        && let Some(calibration) = calibrate(&capacity, &demand, targets, measured, |p| p.ttft)
    {
        tracker.ttft_calibration = Some(calibration);
    }
    if targets.tpot.is_some()
        && let Some(measured) = tracker.window_tpot
        && let Some(calibration) = calibrate(&capacity, &demand, targets, measured, |p| p.tpot)
    {
        tracker.tpot_calibration = Some(calibration);
    }
    let (ttft_calibration, tpot_calibration) = (tracker.ttft_calibration, tracker.tpot_calibration);
    let factors = Factors {
        ttft: ttft_calibration.map_or(1.0, |c| c.factor),
        tpot: tpot_calibration.map_or(1.0, |c| c.factor),
    };
    Ok(Evaluation {
        demand,
        sizing: size(&capacity, &demand, targets, max_replicas, factors),
        at_ready: predict(&capacity, &demand, targets, ready).calibrated(factors),
        ttft_calibration,
        tpot_calibration,
    })
}

/// The standard normal quantile (Acklam's rational approximation, relative error below
/// 1.2e-9), for `p` in (0, 1).
pub fn normal_quantile(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] = [
        7.784_695_709_041_462e-3,
        3.224_671_290_700_398e-1,
        2.445_134_137_142_996,
        3.754_408_661_907_416,
    ];
    let p = p.clamp(1e-12, 1.0 - 1e-12);
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < 0.02425 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.02425 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

/// Why the demand cannot be told this tick.
#[derive(Clone, Debug, PartialEq)]
pub enum Unknown {
    /// Not two readings of any worker yet: the first tick after a start.
    Starting,
    /// Serving workers answer without the counters the objectives need.
    NoCounters(String),
}

/// The autoscaler's memory of one service for its objectives.
#[derive(Clone, Debug)]
pub struct Tracker {
    capacity: Capacity,
    /// Each group's last counters, by group.
    last: HashMap<u32, Counters>,
    /// What the fleet did between consecutive ticks, over the long window.
    intervals: VecDeque<Interval>,
    /// The last tick seen.
    previous_tick: Option<Duration>,
    /// The first tick seen.
    first_tick: Option<Duration>,
    /// Means that the windows held last, for windows without an admitted or finished
    /// request.
    mean_prompt: Option<(f64, f64)>,
    mean_output: Option<f64>,
    prefill_steps: Option<f64>,
    /// Whether a group was warming at the last tick.
    warming_at_previous: bool,
    /// Groups not ready yet, and when they were first seen.
    warming_since: HashMap<u32, Duration>,
    /// Groups seen at all: a group seen at the first tick started before this tracker did,
    /// so its time to ready is unknown.
    seen: HashMap<u32, bool>,
    ready_seconds: Option<f64>,
    max_batch: Option<f64>,
    /// The first tokens of the last long window and the groups that served them on average.
    window_ttft: (Latencies, f64),
    /// The TTFT calibration, from the last long window with enough first tokens.
    ttft_calibration: Option<Calibration>,
    /// The time per output token the workers took over the last long window and the groups
    /// serving through it on average, once it holds [`MIN_MEASURED`] decode steps.
    window_tpot: Option<(f64, f64)>,
    /// The TPOT calibration, from the last long window with enough decode steps.
    tpot_calibration: Option<Calibration>,
}

/// What the fleet did between two ticks, and how many groups' counters it sums.
#[derive(Clone, Debug)]
struct Interval {
    start: Duration,
    end: Duration,
    counters: Counters,
    groups: f64,
}

impl Tracker {
    /// A tracker resuming from what a status kept.
    pub fn new(capacity: Capacity, ready_seconds: Option<f64>) -> Self {
        Self {
            capacity,
            last: HashMap::new(),
            intervals: VecDeque::new(),
            previous_tick: None,
            first_tick: None,
            mean_prompt: None,
            mean_output: None,
            prefill_steps: None,
            warming_at_previous: false,
            warming_since: HashMap::new(),
            seen: HashMap::new(),
            ready_seconds: ready_seconds.filter(|s| s.is_finite() && *s > 0.0),
            max_batch: None,
            window_ttft: (Latencies::default(), 0.0),
            ttft_calibration: None,
            window_tpot: None,
            tpot_calibration: None,
        }
    }

    /// The TTFT `quantile` the workers measured over the last long window and the groups
    /// serving through it on average, once it holds [`MIN_MEASURED`] first tokens.
    fn measured_ttft(&self, quantile: f64) -> Option<(f64, f64)> {
        let (latencies, groups) = &self.window_ttft;
        if latencies.count < MIN_MEASURED {
            return None;
        }
        Some((latencies.quantile(quantile)?, *groups))
    }

    pub fn capacity(&self) -> &Capacity {
        &self.capacity
    }

    /// Seconds a group took to become ready, as last measured.
    pub fn ready_seconds(&self) -> Option<f64> {
        self.ready_seconds
    }

    /// Takes in one tick's groups at time `now` (monotonic).
    pub fn observe(&mut self, now: Duration, groups: &[GroupSample]) {
        let first = self.previous_tick.is_none();
        self.first_tick.get_or_insert(now);
        for g in groups {
            if self.seen.insert(g.group, first).is_none() && !first && !g.ready {
                self.warming_since.insert(g.group, now);
            }
            if g.ready
                && let Some(since) = self.warming_since.remove(&g.group)
            {
                self.ready_seconds = Some(now.saturating_sub(since).as_secs_f64().max(0.001));
            }
        }
        let live: std::collections::HashSet<u32> = groups.iter().map(|g| g.group).collect();
        self.seen.retain(|g, _| live.contains(g));
        self.warming_since.retain(|g, _| live.contains(g));
        if let Some(batch) = groups.iter().filter_map(|g| g.max_batch).min() {
            self.max_batch = Some(f64::from(batch.max(1)));
        }

        let mut interval = Counters::default();
        let mut summed = 0.0;
        for g in groups {
            let Some(counters) = &g.counters else {
                continue;
            };
            match self.last.insert(g.group, counters.clone()) {
                Some(old) => {
                    if let Some(d) = Counters::between(&old, counters) {
                        interval.add(&d);
                        summed += 1.0;
                    }
                }
                None => self.capacity.seed(&counters.warm_up),
            }
        }
        self.last
            .retain(|g, _| groups.iter().any(|s| s.group == *g && s.counters.is_some()));
        // A group loading its weights shares its node's cores, memory bandwidth and bus
        // with the groups serving beside it. Their steps meanwhile are slower than the
        // fleet's will be once it is up, and a model that learned from them would ask for
        // more groups, whose loading would slow the steps again: such an interval counts
        // as demand, not as capacity.
        let warming = groups.iter().any(|g| g.warming);
        let contended = warming || self.warming_at_previous;
        self.warming_at_previous = warming;
        if let Some(previous) = self.previous_tick
            && summed > 0.0
        {
            if !contended {
                self.capacity.prefill.add(&interval.prefill);
                self.capacity.decode.add(&interval.decode);
            }
            self.intervals.push_back(Interval {
                start: previous,
                end: now,
                counters: interval,
                groups: summed,
            });
        }
        self.previous_tick = Some(now);
        while self
            .intervals
            .front()
            .is_some_and(|i| now.saturating_sub(i.start) > LONG_WINDOW)
        {
            self.intervals.pop_front();
        }
    }

    /// The demand at `now`, with `waiting` requests queued in the fleet; `serving` groups
    /// answered, `with_counters` of them with counters.
    pub fn demand(
        &mut self,
        now: Duration,
        waiting: u32,
        serving: u32,
        with_counters: u32,
    ) -> Result<Demand, Unknown> {
        if serving > 0 && with_counters == 0 {
            return Err(Unknown::NoCounters(format!(
                "{serving} serving workers report no request counters or step timings, which spec.autoscaling.objectives needs (this project's worker reports them)"
            )));
        }
        // The conservative default would take a fleet starting under load far up only to
        // come back down once the first steps are in; those come within a second under
        // load, so the count holds for them (a long window at most).
        let learned = self.capacity.prefill.n >= MIN_STEPS && self.capacity.decode.n >= MIN_STEPS;
        let young = self
            .first_tick
            .is_none_or(|t| now.saturating_sub(t) < LONG_WINDOW);
        if self.intervals.is_empty() || (!learned && young) {
            return Err(Unknown::Starting);
        }
        let window = |span: Duration| {
            let (mut sum, mut covered, mut group_seconds) = (Counters::default(), 0.0, 0.0);
            for i in &self.intervals {
                if now.saturating_sub(i.start) <= span {
                    sum.add(&i.counters);
                    let seconds = i.end.saturating_sub(i.start).as_secs_f64();
                    covered += seconds;
                    group_seconds += i.groups * seconds;
                }
            }
            (sum, covered, group_seconds)
        };
        let (long, long_span, group_seconds) = window(LONG_WINDOW);
        let (short, short_span, _) = window(SHORT_WINDOW);
        let groups = if long_span > 0.0 {
            group_seconds / long_span
        } else {
            0.0
        };
        self.window_ttft = (long.time_to_first_token.clone(), groups);
        // A decoding sequence waits one step for each token: the steps' mean weighted by
        // the sequences in them, stretched by the share of time prompt steps took, as the
        // model predicts it.
        if long.decode.n >= MIN_MEASURED && long.decode.x > 0.0 && group_seconds > 0.0 {
            let step = long.decode.xy / long.decode.x;
            let prefill_share = (long.prefill.y / group_seconds).min(0.9);
            self.window_tpot = Some((step / (1.0 - prefill_share), groups));
        }
        let rate = |c: &Counters, span: f64| if span > 0.0 { c.requests / span } else { 0.0 };
        let long_rate = rate(&long, long_span);
        // The short window sees a burst first, but over a few requests its rate is mostly
        // Poisson noise: it counts one standard deviation below what it saw. (Taken as
        // seen it bought 15 % more replica-seconds in the simulator for 0.3 points of
        // attainment, and a third replica for a burst one and a half served on real workers.)
        let short_rate = if short_span > 0.0 {
            (short.requests - short.requests.sqrt()).max(0.0) / short_span
        } else {
            long_rate
        };
        if long.admitted > 0.0 {
            self.prefill_steps = Some((long.prefill.n / long.admitted).max(1.0));
            let moments = |c: &Counters| {
                (
                    c.prompt_tokens / c.admitted,
                    c.prompt_tokens_squared / c.admitted,
                )
            };
            // Prompts that grow at a steady rate are a burst of work the long window's mean
            // dilutes for its length: the short window's mean counts when it is the higher.
            let mut prompt = moments(&long);
            if short.admitted >= MIN_SHORT_ADMITTED && moments(&short).0 > prompt.0 {
                prompt = moments(&short);
            }
            self.mean_prompt = Some(prompt);
        }
        if long.finished > 0.0 {
            self.mean_output = Some(long.output_tokens / long.finished);
        } else if self.mean_output.is_none() && long.admitted > 0.0 {
            // Nothing finished yet: the tokens so far per request, an underestimate that
            // the first finished request corrects.
            self.mean_output = Some((long.output_tokens / long.admitted).max(1.0));
        }
        // Capacity asked for now serves only once ready: the queue built meanwhile must be
        // worked off within that time on top of the arrivals. (Carrying the rise between
        // the windows on over the ready time as well bought replicas for Poisson noise in
        // the simulator, 13 % more replica-seconds for 0.6 points of attainment.) Over no
        // less than the short window: groups ready in half a second made two prompts
        // waiting their turn behind a third look like four more requests a second, and a
        // fleet at a third of its capacity read as overrun.
        let horizon = self
            .ready_seconds
            .unwrap_or(DEFAULT_READY_SECONDS)
            .max(SHORT_WINDOW.as_secs_f64());
        let planned = long_rate.max(short_rate) + f64::from(waiting) / horizon;
        let (mean_prompt, prompt_second_moment) = self.mean_prompt.unwrap_or((0.0, 0.0));
        Ok(Demand {
            rate: planned,
            measured_rate: long_rate,
            mean_prompt,
            prompt_second_moment,
            mean_output: self.mean_output.unwrap_or(1.0),
            prefill_steps: self.prefill_steps.unwrap_or(1.0),
            max_batch: self.max_batch.unwrap_or(DEFAULT_MAX_BATCH),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autoscaler::capacity::Sums;

    /// A capacity learned from exact lines: prefill 20 ms + 0.5 ms a token, decode 30 ms +
    /// 1 ms a sequence.
    fn capacity() -> Capacity {
        let line = |a: f64, b: f64, sizes: &[f64]| {
            let mut s = Sums::default();
            for &x in sizes {
                let y = a + b * x;
                s.add(&Sums {
                    n: 1.0,
                    x,
                    y,
                    xx: x * x,
                    xy: x * y,
                });
            }
            s
        };
        let sizes: Vec<f64> = (1..=40).map(|i| f64::from(i) * 50.0).collect();
        let batches: Vec<f64> = (1..=40).map(f64::from).collect();
        Capacity {
            prefill: line(0.02, 0.0005, &sizes),
            decode: line(0.03, 0.001, &batches),
        }
    }

    fn demand(rate: f64, prompt: f64, output: f64) -> Demand {
        Demand {
            rate,
            measured_rate: rate,
            mean_prompt: prompt,
            prompt_second_moment: prompt * prompt,
            mean_output: output,
            prefill_steps: 1.0,
            max_batch: 64.0,
        }
    }

    fn targets(ttft: f64, tpot: f64) -> Targets {
        Targets {
            ttft: Some(Target {
                quantile: 0.9,
                seconds: ttft,
            }),
            tpot: Some(Target {
                quantile: 0.9,
                seconds: tpot,
            }),
        }
    }

    #[test]
    fn the_normal_quantile_is_right_where_it_matters() {
        assert!(normal_quantile(0.5).abs() < 1e-9);
        assert!((normal_quantile(0.9) - 1.281_551_565_5).abs() < 1e-6);
        assert!((normal_quantile(0.99) - 2.326_347_874).abs() < 1e-6);
        assert!((normal_quantile(0.01) + 2.326_347_874).abs() < 1e-6);
    }

    #[test]
    fn predictions_fall_with_more_replicas_and_an_idle_fleet_costs_one_step() {
        let capacity = capacity();
        let t = targets(0.8, 0.08);
        let idle = predict(&capacity, &demand(0.0, 500.0, 100.0), &t, 1);
        // No queue, no batch: the prompt's prefill and one decode step.
        assert!(
            (idle.ttft.unwrap() - (0.02 + 0.25 + 0.03)).abs() < 1e-9,
            "{idle:?}"
        );
        assert!((idle.tpot.unwrap() - 0.03).abs() < 1e-9);
        let busy = demand(3.0, 500.0, 10.0);
        let mut last = f64::INFINITY;
        for n in 1..6 {
            let p = predict(&capacity, &busy, &t, n);
            let ttft = p.ttft.unwrap_or(f64::INFINITY);
            assert!(ttft <= last, "{n}: {p:?}");
            last = ttft;
        }
        // 3 rps of 500-token prompts use 0.81 of a group for prefill alone.
        assert!(predict(&capacity, &busy, &t, 1).ttft.is_some());
        assert_eq!(
            predict(&capacity, &demand(4.0, 500.0, 10.0), &t, 1).ttft,
            None
        );
    }

    #[test]
    fn the_fewest_replicas_that_meet_both_targets_and_long_prompts_need_more() {
        let capacity = capacity();
        let t = targets(0.8, 0.08);
        let short = size(&capacity, &demand(4.0, 200.0, 50.0), &t, 20, Factors::NONE);
        assert!(short.met);
        // Sized with headroom: one fewer misses at the planned rate.
        let planned = demand(4.0 / UTILISATION, 200.0, 50.0);
        assert!(predict(&capacity, &planned, &t, short.replicas).meets(&t));
        assert!(
            !predict(&capacity, &planned, &t, short.replicas - 1).meets(&t),
            "one fewer misses"
        );
        let long = size(&capacity, &demand(4.0, 1000.0, 50.0), &t, 20, Factors::NONE);
        assert!(
            long.met && long.replicas > short.replicas,
            "{short:?} {long:?}"
        );
    }

    #[test]
    fn an_objective_no_count_can_meet_bounds_the_delay_queueing_adds() {
        let capacity = capacity();
        let t = targets(0.8, 0.08);
        // A 4,000-token prefill alone takes 2 s: an idle group answers in 2.05 s.
        let long = demand(1.0, 4000.0, 10.0);
        let idle = predict(&capacity, &demand(0.0, 4000.0, 10.0), &t, 1)
            .ttft
            .unwrap();
        assert!((idle - 2.05).abs() < 1e-9, "{idle}");
        let sizing = size(&capacity, &long, &t, 50, Factors::NONE);
        assert!(!sizing.met);
        let budget = idle + 0.8;
        assert!(sizing.at_replicas.ttft.unwrap() <= budget, "{sizing:?}");
        let planned = demand(1.0 / UTILISATION, 4000.0, 10.0);
        let fewer = predict(&capacity, &planned, &t, sizing.replicas - 1).ttft;
        assert!(fewer.is_none_or(|p| p > budget), "{fewer:?}");
        assert!(sizing.replicas < 50);
    }

    #[test]
    fn the_demand_in_groups_is_fractional_and_its_ceiling_is_the_count() {
        let capacity = capacity();
        let t = targets(0.8, 0.08);
        let mut last = 0.0;
        for rate in [0.5, 1.0, 2.0, 4.0, 8.0, 16.0] {
            let sizing = size(
                &capacity,
                &demand(rate, 300.0, 50.0),
                &t,
                100,
                Factors::NONE,
            );
            assert!(sizing.met, "{rate}: {sizing:?}");
            assert_eq!(
                (sizing.groups - 1e-6).ceil().max(1.0),
                f64::from(sizing.replicas),
                "{rate}: {sizing:?}"
            );
            // Twice the rate, twice the groups: the model sees groups only through the
            // rate each takes.
            if last > 0.0 {
                assert!(
                    (sizing.groups / last - 2.0).abs() < 1e-6,
                    "{rate}: {sizing:?}"
                );
            }
            last = sizing.groups;
        }
        let idle = size(&capacity, &demand(0.0, 300.0, 50.0), &t, 100, Factors::NONE);
        assert_eq!((idle.groups, idle.replicas), (0.0, 1));
    }

    fn report(requests: u64, prompt: u64, finished: u64, output: u64, steps: u64) -> LoadReport {
        LoadReport {
            timestamp_unix_ms: 1,
            requests_total: requests,
            requests_admitted_total: requests,
            requests_finished_total: finished,
            prompt_tokens_total: prompt,
            prompt_tokens_squared_total: (prompt * prompt) as f64 / requests.max(1) as f64,
            generation_tokens_total: output,
            decode_steps_total: steps,
            decode_step_batch_total: steps * 4,
            decode_step_seconds_total: steps as f64 * 0.05,
            decode_step_batch_squared_total: (steps * 16) as f64,
            decode_step_batch_seconds_total: steps as f64 * 0.2,
            max_batch_size: 32,
            ..LoadReport::default()
        }
    }

    fn sample(group: u32, ready: bool, report: Option<LoadReport>) -> GroupSample {
        GroupSample {
            group,
            ready,
            warming: false,
            counters: report.as_ref().and_then(Counters::of),
            max_batch: report.map(|r| r.max_batch_size),
        }
    }

    #[test]
    fn demand_comes_from_counter_differences_and_a_restarted_worker_is_skipped() {
        let mut tracker = Tracker::new(capacity(), Some(10.0));
        let learned_steps = tracker.capacity().decode.n;
        let s = |t: f64| Duration::from_secs_f64(t);
        tracker.observe(s(0.0), &[sample(0, true, Some(report(0, 0, 0, 0, 0)))]);
        assert_eq!(tracker.demand(s(0.0), 0, 1, 1), Err(Unknown::Starting));
        // 10 requests of 100 tokens, 5 finished with 200 tokens, in 5 s.
        tracker.observe(
            s(5.0),
            &[sample(0, true, Some(report(10, 1000, 5, 200, 100)))],
        );
        let d = tracker.demand(s(5.0), 0, 1, 1).unwrap();
        assert!((d.measured_rate - 2.0).abs() < 1e-9, "{d:?}");
        assert_eq!(
            (d.mean_prompt, d.mean_output, d.max_batch),
            (100.0, 40.0, 32.0)
        );
        assert_eq!(tracker.capacity().decode.n, learned_steps + 100.0);
        // The worker restarted: its counters went back, the interval is dropped.
        tracker.observe(s(5.5), &[sample(0, true, Some(report(1, 100, 0, 0, 1)))]);
        assert_eq!(tracker.capacity().decode.n, learned_steps + 100.0);
        // A queue builds: planned for over the ready time.
        let queued = tracker.demand(s(5.5), 20, 1, 1).unwrap();
        assert!(
            (queued.rate - d.rate - 2.0).abs() < 1e-9,
            "{queued:?} {d:?}"
        );
        // Groups ready in half a second: the queue is spread over the short window.
        tracker.ready_seconds = Some(0.5);
        let fast = tracker.demand(s(5.5), 20, 1, 1).unwrap();
        assert!((fast.rate - d.rate - 4.0).abs() < 1e-9, "{fast:?} {d:?}");
        // Prompt tokens the prefix cache held are not prefill work.
        let cached = LoadReport {
            prefix_cache_hits_total: 750,
            ..report(10, 1000, 5, 200, 100)
        };
        let counters = Counters::of(&cached).unwrap();
        assert_eq!(counters.prompt_tokens, 250.0);
        assert!((counters.prompt_tokens_squared - 100_000.0 / 16.0).abs() < 1e-9);
        // Workers that answer without counters are named, not taken for idle.
        let mut blind = Tracker::new(Capacity::default(), None);
        blind.observe(s(0.0), &[sample(0, true, Some(LoadReport::default()))]);
        match blind.demand(s(0.0), 0, 1, 0) {
            Err(Unknown::NoCounters(why)) => assert!(why.contains("no request counters")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn steps_timed_while_a_group_warms_count_as_demand_not_as_capacity() {
        let mut tracker = Tracker::new(capacity(), Some(10.0));
        let learned = tracker.capacity().decode.n;
        let s = |t: f64| Duration::from_secs_f64(t);
        let warming = GroupSample {
            warming: true,
            ..sample(1, false, None)
        };
        tracker.observe(s(0.0), &[sample(0, true, Some(report(0, 0, 0, 0, 0)))]);
        tracker.observe(
            s(5.0),
            &[
                sample(0, true, Some(report(10, 1000, 5, 200, 100))),
                warming.clone(),
            ],
        );
        assert_eq!(tracker.capacity().decode.n, learned);
        assert!(
            (tracker.demand(s(5.0), 0, 1, 1).unwrap().measured_rate - 2.0).abs() < 1e-9,
            "the requests of the interval count"
        );
        // The interval that ends with the group ready began with it loading.
        tracker.observe(
            s(10.0),
            &[
                sample(0, true, Some(report(20, 2000, 10, 400, 200))),
                sample(1, true, Some(report(0, 0, 0, 0, 0))),
            ],
        );
        assert_eq!(tracker.capacity().decode.n, learned);
        tracker.observe(
            s(15.0),
            &[
                sample(0, true, Some(report(30, 3000, 15, 600, 300))),
                sample(1, true, Some(report(0, 0, 0, 0, 0))),
            ],
        );
        assert_eq!(tracker.capacity().decode.n, learned + 100.0);
    }

    #[test]
    fn longer_prompts_count_from_the_short_window_and_shorter_ones_wait_for_the_long() {
        let mut tracker = Tracker::new(capacity(), Some(10.0));
        let s = |t: f64| Duration::from_secs_f64(t);
        // 15 s of 100-token prompts at 2 req/s, then 5 s of 600-token ones at the same rate.
        let mut totals = (0, 0);
        let mut tick = |tracker: &mut Tracker, t: f64, prompt: u64| {
            totals = (totals.0 + 10, totals.1 + 10 * prompt);
            let mut r = report(totals.0, totals.1, totals.0, 20 * totals.0, totals.0);
            r.prompt_tokens_squared_total = 0.0;
            tracker.observe(s(t), &[sample(0, true, Some(r))]);
        };
        tick(&mut tracker, 0.0, 0);
        for t in [5.0, 10.0, 15.0] {
            tick(&mut tracker, t, 100);
        }
        assert_eq!(tracker.demand(s(15.0), 0, 1, 1).unwrap().mean_prompt, 100.0);
        tick(&mut tracker, 20.0, 600);
        // The long window's mean (225) dilutes the new prompts until they fill it.
        assert_eq!(tracker.demand(s(20.0), 0, 1, 1).unwrap().mean_prompt, 600.0);
        // Back to short prompts: the long window still holds the long ones.
        tick(&mut tracker, 25.0, 100);
        let d = tracker.demand(s(25.0), 0, 1, 1).unwrap();
        assert!((d.mean_prompt - 225.0).abs() < 1e-9, "{d:?}");
    }

    #[test]
    fn a_worker_seen_first_seeds_the_model_with_its_warm_up_once() {
        use npufleet_contract::proto::npufleet::v1::StepSums;
        let mut tracker = Tracker::new(Capacity::default(), None);
        let s = Duration::from_secs;
        let warmed = LoadReport {
            warmup_decode_steps: Some(StepSums {
                steps: 30,
                size: 75,
                seconds: 1.5,
                size_squared: 225.0,
                size_seconds: 3.9,
            }),
            ..report(0, 0, 0, 0, 0)
        };
        tracker.observe(s(0), &[sample(0, true, Some(warmed.clone()))]);
        assert_eq!(tracker.capacity().decode.n, 30.0);
        assert_eq!(tracker.capacity().prefill.n, 0.0);
        tracker.observe(s(1), &[sample(0, true, Some(warmed.clone()))]);
        assert_eq!(
            tracker.capacity().decode.n,
            30.0,
            "a worker's warm-up counts once"
        );
        // A second worker's warm-up adds nothing to a kind that has enough steps.
        tracker.observe(
            s(2),
            &[
                sample(0, true, Some(warmed.clone())),
                sample(1, true, Some(warmed)),
            ],
        );
        assert_eq!(tracker.capacity().decode.n, 30.0);
    }

    #[test]
    fn the_time_to_ready_is_measured_from_a_group_first_seen_warming() {
        let mut tracker = Tracker::new(Capacity::default(), None);
        let s = Duration::from_secs;
        // Warming already at the first tick: when it was asked for is unknown.
        tracker.observe(s(0), &[sample(0, false, None)]);
        tracker.observe(s(4), &[sample(0, true, None)]);
        assert_eq!(tracker.ready_seconds(), None);
        tracker.observe(s(10), &[sample(0, true, None), sample(1, false, None)]);
        tracker.observe(s(22), &[sample(0, true, None), sample(1, true, None)]);
        assert_eq!(tracker.ready_seconds(), Some(12.0));
    }

    #[test]
    fn a_histogram_gives_its_quantile_within_a_bucket_and_a_restart_gives_none() {
        let mut h = Latencies::over(&[0.5, 1.0, 2.5]);
        assert_eq!(h.quantile(0.9), None);
        for seconds in [0.2, 0.4, 0.6, 0.8, 0.9, 1.2, 1.5, 2.0, 2.2, 3.0] {
            h.record(seconds);
        }
        assert_eq!((h.cumulative.clone(), h.count), (vec![2.0, 5.0, 9.0], 10.0));
        assert_eq!(h.quantile(0.5), Some(1.0));
        assert_eq!(h.quantile(0.7), Some(1.75));
        assert_eq!(h.quantile(0.1), Some(0.25));
        // Above the last bound: the last bound, the most a histogram can tell.
        assert_eq!(h.quantile(0.95), Some(2.5));
        let earlier = h.clone();
        h.record(0.1);
        let d = Latencies::between(&earlier, &h);
        assert_eq!((d.cumulative, d.count), (vec![1.0, 1.0, 1.0], 1.0));
        assert_eq!(Latencies::between(&h, &earlier), Latencies::default());
        // A report whose counts fall between bounds is not read.
        let malformed = LatencyHistogram {
            upper_bounds: vec![0.5, 1.0],
            cumulative_counts: vec![3, 2],
            count: 3,
        };
        assert_eq!(Latencies::of(&malformed), Latencies::default());
    }

    /// Evaluates one group that served 40 requests of 500 tokens (10 out) in 20 s, with
    /// `first_tokens` (seconds, how many) measured.
    fn evaluate_measured(first_tokens: &[(f64, u64)]) -> Evaluation {
        evaluate_measured_for(first_tokens, &targets(0.8, 0.2))
    }

    fn evaluate_measured_for(first_tokens: &[(f64, u64)], t: &Targets) -> Evaluation {
        let mut h = Latencies::over(&npufleet_contract::proto::load_report_latency_bounds());
        for &(seconds, n) in first_tokens {
            for _ in 0..n {
                h.record(seconds);
            }
        }
        let histogram = |h: &Latencies| LatencyHistogram {
            upper_bounds: h.bounds.clone(),
            cumulative_counts: h.cumulative.iter().map(|c| *c as u64).collect(),
            count: h.count as u64,
        };
        let with = |mut r: LoadReport, h: &Latencies| {
            r.time_to_first_token = Some(histogram(h));
            r
        };
        let mut tracker = Tracker::new(capacity(), Some(10.0));
        let s = |t: u64| Duration::from_secs(t);
        let none = Latencies::over(&h.bounds);
        let first = [sample(0, true, Some(with(report(0, 0, 0, 0, 0), &none)))];
        evaluate(&mut tracker, s(0), &first, (0, 1), t, 10).unwrap_err();
        let busy = [sample(
            0,
            true,
            Some(with(report(40, 20_000, 40, 400, 400), &h)),
        )];
        evaluate(&mut tracker, s(20), &busy, (0, 1), t, 10).unwrap()
    }

    #[test]
    fn the_measured_decode_steps_calibrate_the_tpot_predictions() {
        // 400 decode steps of 4 sequences at 50 ms each and no prompt steps: each sequence
        // waited 50 ms a token.
        let e = evaluate_measured(&[]);
        let c = e.tpot_calibration.expect("400 decode steps are enough");
        assert!((c.measured - 0.05).abs() < 1e-9, "{c:?}");
        assert!(
            (CALIBRATION_BOUNDS.0..1.0).contains(&c.factor),
            "the model expects slower steps: {c:?}"
        );
        // The same window with no TPOT objective: the model alone.
        let ttft_only = Targets {
            tpot: None,
            ..targets(0.8, 0.2)
        };
        let model = evaluate_measured_for(&[], &ttft_only);
        assert_eq!(model.tpot_calibration, None);
        let (calibrated, alone) = (e.at_ready.tpot.unwrap(), model.at_ready.tpot.unwrap());
        assert!(
            (calibrated - alone * c.factor).abs() < 1e-9,
            "{calibrated} {alone}"
        );
    }

    #[test]
    fn the_measured_ttft_calibrates_the_predictions_both_ways_once_a_window_holds_enough() {
        let uncalibrated = evaluate_measured(&[]);
        assert_eq!(uncalibrated.ttft_calibration, None);
        let predicted = uncalibrated.at_ready.ttft.unwrap();
        // Too few first tokens for a p90: the model alone.
        assert_eq!(evaluate_measured(&[(0.05, 19)]).ttft_calibration, None);

        // All within 0.06 s: the predictions fall as far as the bound lets them.
        let fast = evaluate_measured(&[(0.05, 40)]);
        let c = fast.ttft_calibration.unwrap();
        assert!((0.04..=0.06).contains(&c.measured), "{c:?}");
        assert_eq!(c.factor, CALIBRATION_BOUNDS.0, "{c:?} {predicted}");
        assert!((fast.at_ready.ttft.unwrap() - predicted * c.factor).abs() < 1e-9);
        assert!(
            fast.sizing.replicas < uncalibrated.sizing.replicas,
            "{fast:?}"
        );

        // First tokens at 1.9 s where the model says 0.81: more groups for the same target.
        let slow = evaluate_measured(&[(1.9, 40)]);
        let c = slow.ttft_calibration.unwrap();
        assert!(
            (1.58..=2.0).contains(&c.measured),
            "within the bucket of 1.9 s: {c:?}"
        );
        assert!(
            (c.factor - c.measured / predicted).abs() < 1e-9,
            "{c:?} {predicted}"
        );
        assert!(slow.sizing.met, "{slow:?}");
        assert!(
            slow.sizing.replicas > uncalibrated.sizing.replicas,
            "{slow:?} {uncalibrated:?}"
        );
    }
}

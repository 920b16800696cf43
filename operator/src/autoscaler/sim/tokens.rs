//! A token-level simulated fleet for latency objectives: each request has a prompt and an
//! output length, and each replica group runs the worker's continuous batching step by step
//! (decodes first, then prompt chunks within the step's token budget, admitting queued
//! prompts while there is budget, as `worker/src/engine/core.rs` schedules), each step
//! taking the time a line in its size gives. Time to first token and time per output token come out per request, so a policy can
//! be judged on the share of requests meeting each objective, and the groups report the same
//! counters the worker's `LoadReport` carries, so the objectives mode learns its capacity
//! model as it would from real workers.
//!
//! The benchmark trace ([`mixed_prompts`]) is Poisson arrivals at a [`Trace`]'s rate (by
//! thinning) with prompt and output lengths from a [`Mix`]: for the simulated NPU fleet
//! ([`Mix::NPU`]) 80 % short prompts (uniform 64..=512 tokens) and 20 % long ones (uniform
//! 2,000..=4,000), outputs uniform 32..=256 tokens; all drawn from a seeded `StdRng` so that
//! every run replays the same requests. The benchmark on real workers draws its requests from
//! the same generator in phases a SmolLM2 worker on a CPU serves ([`CPU_PHASES`]), and
//! [`cpu_benchmark`] is that fleet simulated.

use std::collections::VecDeque;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::Trace;
use crate::autoscaler::capacity::{Line, Sums};
use npufleet_contract::proto::load_report_latency_bounds;

use crate::autoscaler::objectives::{self, Counters, GroupSample, Latencies, Targets, Tracker};
use crate::autoscaler::policy::{
    GroupLoad, GroupState, Observation, Policy, PolicyConfig, Readings, scale_down_victims,
};

/// One request of a trace.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Request {
    pub arrival: f64,
    pub prompt: u32,
    pub output: u32,
}

/// The seed of the benchmark trace.
pub const SEED: u64 = 20_261_204;

/// The lengths of a trace's requests: a share of long prompts, the rest short, each length
/// uniform in its inclusive range.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mix {
    pub long_share: f64,
    pub short_prompt: (u32, u32),
    pub long_prompt: (u32, u32),
    pub output: (u32, u32),
}

impl Mix {
    /// The simulated NPU fleet's trace.
    pub const NPU: Mix = Mix {
        long_share: 0.2,
        short_prompt: (64, 512),
        long_prompt: (2000, 4000),
        output: (32, 256),
    };
    /// Chat on a 135M-parameter model on a CPU: short prompts, answers several times longer
    /// (a one-thread worker decodes them in a batch of eight at about 16 ms a step).
    pub const CHAT_CPU: Mix = Mix {
        long_share: 0.0,
        short_prompt: (32, 128),
        long_prompt: (32, 128),
        output: (48, 96),
    };
    /// Documents on the same model: long prompts (a one-thread worker's prefill of 700
    /// tokens takes about a second), short answers.
    pub const DOCUMENTS_CPU: Mix = Mix {
        long_share: 1.0,
        short_prompt: (400, 700),
        long_prompt: (400, 700),
        output: (8, 24),
    };
}

/// One stretch of a phased trace: Poisson arrivals at `rate` for `seconds`, lengths from `mix`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Phase {
    pub seconds: f64,
    pub rate: f64,
    pub mix: Mix,
}

/// The CPU benchmark's traffic: a quiet start, then a long stretch of chat that keeps several
/// short requests in flight at once on one worker within the objectives (queue depth climbs,
/// latency does not), then a burst of documents that keeps few in flight but overloads one
/// worker with prefill (latency climbs, queue depth only slowly). No single queue-depth
/// target suits both: a low one over-buys for the chat, a high one under-buys for the
/// documents.
pub const CPU_PHASES: [Phase; 3] = [
    Phase {
        seconds: 20.0,
        rate: 0.5,
        mix: Mix::CHAT_CPU,
    },
    Phase {
        seconds: 150.0,
        rate: 2.5,
        mix: Mix::CHAT_CPU,
    },
    Phase {
        seconds: 40.0,
        rate: 1.4,
        mix: Mix::DOCUMENTS_CPU,
    },
];

/// The requests of `phases` one after another, each phase drawn from its own seed.
pub fn phased(phases: &[Phase], seed: u64) -> Vec<Request> {
    let mut requests = Vec::new();
    let mut start = 0.0;
    for (i, phase) in phases.iter().enumerate() {
        let trace = Trace::Step {
            base: phase.rate,
            peak: phase.rate,
            start: 0.0,
            end: 0.0,
        };
        let drawn = mixed_prompts(&trace, phase.seconds, seed + i as u64, &phase.mix);
        requests.extend(drawn.into_iter().map(|r| Request {
            arrival: start + r.arrival,
            ..r
        }));
        start += phase.seconds;
    }
    requests
}

/// The benchmark trace's requests over `duration` seconds (see the module docs).
pub fn mixed_prompts(trace: &Trace, duration: f64, seed: u64, mix: &Mix) -> Vec<Request> {
    let mut rng = StdRng::seed_from_u64(seed);
    let peak = trace.peak().max(1e-9);
    let mut requests = Vec::new();
    let mut t = 0.0;
    loop {
        // Exponential gaps at the peak rate, kept with probability rate(t) / peak.
        t += -(1.0_f64 - rng.random::<f64>()).ln() / peak;
        if t >= duration {
            return requests;
        }
        if rng.random::<f64>() * peak > trace.rate(t) {
            continue;
        }
        let (low, high) = if rng.random::<f64>() < mix.long_share {
            mix.long_prompt
        } else {
            mix.short_prompt
        };
        let prompt = rng.random_range(low..=high);
        let output = rng.random_range(mix.output.0..=mix.output.1);
        requests.push(Request {
            arrival: t,
            prompt,
            output,
        });
    }
}

/// The simulated hardware and service.
#[derive(Clone, Debug)]
pub struct Fleet {
    /// Seconds from a group being asked for to it serving.
    pub warm_up: f64,
    /// Seconds of a step that computes prompt positions, in the positions it computes.
    pub prefill: Line,
    /// Seconds a prompt position adds to its step for each position before it in its prompt:
    /// attention, which makes a long prompt's positions dearer than a short one's. The
    /// capacity model fits its line over every step, as it does on real workers.
    pub attention: f64,
    /// Seconds of a decode step, in its batch.
    pub decode: Line,
    /// Positions one step computes at most (the worker's `max_num_batched_tokens`).
    pub step_tokens: u32,
    pub max_batch: u32,
    /// Requests a group queues before it refuses more (the worker's `queueLimit`).
    pub queue_limit: usize,
    pub initial_replicas: u32,
    /// Seconds simulated after the last arrival, for the fleet to finish.
    pub drain: f64,
    pub targets: Targets,
    /// When the trace's burst starts: scale-up reaction is measured from it.
    pub burst_start: f64,
}

/// What one run measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub requests: usize,
    /// Share of requests whose time to first token met the objective.
    pub ttft_met: f64,
    /// Share of requests (of more than one output token) whose time per output token met it.
    pub tpot_met: f64,
    pub replica_seconds: f64,
    /// Seconds from the burst's start to the first scale-up after it.
    pub scale_up_reaction: Option<f64>,
    /// Refused by a full queue or never finished.
    pub failed: usize,
    pub max_replicas: u32,
}

impl Outcome {
    /// The lower of the two attainments.
    pub fn attainment(&self) -> f64 {
        self.ttft_met.min(self.tpot_met)
    }

    /// Both objectives met for at least [`ATTAINMENT`] of requests, and none failed: the
    /// bar a mode must clear before its replica-seconds are compared.
    pub fn meets_objectives(&self) -> bool {
        self.attainment() >= ATTAINMENT && self.failed == 0
    }
}

/// The share of requests within the objectives the benchmarks ask of every mode.
pub const ATTAINMENT: f64 = 0.95;

/// A scaling policy shown the fleet every [`super::SAMPLE_INTERVAL`].
pub trait Scaler {
    fn name(&self) -> String;
    fn observe(&mut self, now: f64, observation: &Observation, groups: &[GroupSample]) -> u32;
}

/// The built-in autoscaler on queue depth.
pub struct QueueDepth {
    policy: Policy,
}

impl QueueDepth {
    pub fn new(config: PolicyConfig) -> Result<Self, crate::autoscaler::policy::ConfigError> {
        Ok(Self {
            policy: Policy::new(config)?,
        })
    }
}

impl Scaler for QueueDepth {
    fn name(&self) -> String {
        format!(
            "queue depth (target {})",
            self.policy.config().target_queue_per_replica
        )
    }

    fn observe(&mut self, now: f64, observation: &Observation, _: &[GroupSample]) -> u32 {
        self.policy
            .decide(Duration::from_secs_f64(now), observation)
            .desired
    }
}

/// The built-in autoscaler on latency objectives, as the operator runs it: a tracker
/// learning from the groups' counters from a cold start, its count through the same policy.
pub struct Objectives {
    policy: Policy,
    tracker: Tracker,
    targets: Targets,
}

impl Objectives {
    pub fn new(
        config: PolicyConfig,
        targets: Targets,
    ) -> Result<Self, crate::autoscaler::policy::ConfigError> {
        Ok(Self {
            policy: Policy::new(config)?,
            tracker: Tracker::new(Default::default(), None),
            targets,
        })
    }
}

impl Scaler for Objectives {
    fn name(&self) -> String {
        "objectives".to_owned()
    }

    fn observe(&mut self, now: f64, observation: &Observation, groups: &[GroupSample]) -> u32 {
        let now = Duration::from_secs_f64(now);
        let waiting = observation.waiting();
        let evaluation = objectives::evaluate(
            &mut self.tracker,
            now,
            groups,
            (waiting, observation.ready()),
            &self.targets,
            self.policy.config().max_replicas,
        );
        let demand = evaluation.ok().map(|e| e.sizing.groups);
        self.policy.decide_on(now, observation, demand).desired
    }
}

#[derive(Clone, Copy)]
struct Sequence {
    request: usize,
    /// Prompt positions still to compute, or output tokens still to produce.
    remaining: u32,
    /// Prompt positions the step in flight computes.
    chunk: u32,
}

struct Group {
    id: u32,
    state: GroupState,
    ready_at: f64,
    queue: VecDeque<usize>,
    prefilling: Vec<Sequence>,
    decoding: Vec<Sequence>,
    /// When the step in flight ends.
    step_end: Option<f64>,
    counters: Counters,
}

impl Group {
    /// A new group's counters: none yet, its first tokens in the worker's buckets.
    fn counters() -> Counters {
        Counters {
            time_to_first_token: Latencies::over(&load_report_latency_bounds()),
            ..Counters::default()
        }
    }

    fn outstanding(&self) -> usize {
        self.queue.len() + self.prefilling.len() + self.decoding.len()
    }
}

/// Per request: (first token, finish) times.
type Times = Vec<(Option<f64>, Option<f64>)>;

const STEP: f64 = 0.01;

/// Replays `requests` on `fleet` under `scaler`.
pub fn run(fleet: &Fleet, requests: &[Request], scaler: &mut dyn Scaler) -> Outcome {
    let new_group = |id, state, ready_at| Group {
        id,
        state,
        ready_at,
        queue: VecDeque::new(),
        prefilling: Vec::new(),
        decoding: Vec::new(),
        step_end: None,
        counters: Group::counters(),
    };
    let mut groups: Vec<Group> = (0..fleet.initial_replicas)
        .map(|id| new_group(id, GroupState::Ready, 0.0))
        .collect();
    let mut next_id = fleet.initial_replicas;
    let mut spec = fleet.initial_replicas;
    let mut max_replicas = spec;
    let mut times: Times = vec![(None, None); requests.len()];
    let mut held: VecDeque<usize> = VecDeque::new();
    let mut next_request = 0;
    let mut replica_seconds = 0.0;
    let mut reaction = None;
    let mut next_sample = 0.0;
    let end = requests.last().map_or(0.0, |r| r.arrival) + fleet.drain;
    let steps = (end / STEP).ceil() as u64;

    for tick in 0..steps {
        let now = tick as f64 * STEP;
        while next_request < requests.len() && requests[next_request].arrival <= now {
            held.push_back(next_request);
            next_request += 1;
        }
        // The router holds requests while no group is ready.
        while let Some(&index) = held.front() {
            let Some(target) = groups
                .iter_mut()
                .filter(|g| g.state == GroupState::Ready)
                .min_by_key(|g| g.outstanding())
            else {
                break;
            };
            held.pop_front();
            target.counters.requests += 1.0;
            // A full queue refuses the request: it never finishes, and counts as failed.
            if target.queue.len() < fleet.queue_limit {
                target.queue.push_back(index);
            }
        }
        for group in &mut groups {
            if group.state == GroupState::Warming && group.ready_at <= now {
                group.state = GroupState::Ready;
            }
            advance(group, fleet, requests, now, &mut times);
        }
        groups.retain(|g| g.state != GroupState::Draining || g.outstanding() > 0);
        replica_seconds += groups.len() as f64 * STEP;

        if now + 1e-9 >= next_sample {
            next_sample += super::SAMPLE_INTERVAL;
            let (observation, samples) = observe(&groups, fleet, spec);
            let desired = scaler.observe(now, &observation, &samples);
            if desired > spec && reaction.is_none() && now >= fleet.burst_start {
                reaction = Some(now - fleet.burst_start);
            }
            rescale(
                &mut groups,
                &observation,
                (spec, desired),
                fleet,
                now,
                &mut next_id,
            );
            spec = desired;
            max_replicas = max_replicas.max(spec);
        }
    }

    let (mut ttft_ok, mut tpot_ok, mut tpot_counted, mut unfinished) = (0usize, 0usize, 0, 0);
    for (request, &(first, finish)) in requests.iter().zip(&times) {
        let Some(finish) = finish else {
            unfinished += 1;
            continue;
        };
        let first = first.unwrap_or(finish);
        if fleet
            .targets
            .ttft
            .is_none_or(|t| first - request.arrival <= t.seconds)
        {
            ttft_ok += 1;
        }
        if request.output > 1 {
            tpot_counted += 1;
            let tpot = (finish - first) / f64::from(request.output - 1);
            if fleet.targets.tpot.is_none_or(|t| tpot <= t.seconds) {
                tpot_ok += 1;
            }
        }
    }
    let share = |n: usize, of: usize| if of == 0 { 1.0 } else { n as f64 / of as f64 };
    Outcome {
        requests: requests.len(),
        ttft_met: share(ttft_ok, requests.len()),
        tpot_met: share(tpot_ok, tpot_counted.max(1)),
        replica_seconds,
        scale_up_reaction: reaction,
        failed: unfinished,
        max_replicas,
    }
}

/// Runs `group`'s steps up to `now`: each step starts when the last ended (or when work is
/// there), decodes every running sequence, then computes prompt chunks in what is left of
/// the token budget, first of prompts already begun, then of queued ones it admits while the
/// batch has room, and takes the time its line gives.
fn advance(group: &mut Group, fleet: &Fleet, requests: &[Request], now: f64, times: &mut Times) {
    let mut start = now;
    loop {
        if let Some(end) = group.step_end {
            if end > now {
                return;
            }
            finish_step(group, requests, end, times);
            group.step_end = None;
            start = end;
        }
        let batch = u32::try_from(group.decoding.len()).unwrap_or(u32::MAX);
        let mut budget = fleet.step_tokens.saturating_sub(batch);
        for sequence in &mut group.prefilling {
            sequence.chunk = sequence.remaining.min(budget);
            budget -= sequence.chunk;
        }
        while budget > 0
            && group.decoding.len() + group.prefilling.len() < fleet.max_batch as usize
            && let Some(request) = group.queue.pop_front()
        {
            let prompt = requests[request].prompt;
            group.counters.admitted += 1.0;
            group.counters.prompt_tokens += f64::from(prompt);
            group.counters.prompt_tokens_squared += f64::from(prompt).powi(2);
            let chunk = prompt.min(budget);
            budget -= chunk;
            group.prefilling.push(Sequence {
                request,
                remaining: prompt,
                chunk,
            });
        }
        let chunks: u32 = group.prefilling.iter().map(|s| s.chunk).sum();
        if batch == 0 && chunks == 0 {
            return;
        }
        // Positions `done..done + chunk` of a prompt attend to about `done + chunk / 2` each.
        let attention: f64 = group
            .prefilling
            .iter()
            .map(|s| {
                let done = f64::from(requests[s.request].prompt - s.remaining);
                let chunk = f64::from(s.chunk);
                fleet.attention * chunk * (done + chunk / 2.0)
            })
            .sum();
        let (sums, line, size) = if chunks > 0 {
            (&mut group.counters.prefill, fleet.prefill, batch + chunks)
        } else {
            (&mut group.counters.decode, fleet.decode, batch)
        };
        let x = f64::from(size);
        let seconds = line.at(x) + attention;
        sums.add(&Sums {
            n: 1.0,
            x,
            y: seconds,
            xx: x * x,
            xy: x * seconds,
        });
        group.step_end = Some(start + seconds);
    }
}

fn finish_step(group: &mut Group, requests: &[Request], end: f64, times: &mut Times) {
    let mut produced = 0.0;
    group.decoding.retain_mut(|s| {
        produced += 1.0;
        s.remaining -= 1;
        if s.remaining == 0 {
            times[s.request].1 = Some(end);
            group.counters.finished += 1.0;
            false
        } else {
            true
        }
    });
    let mut prefilled = Vec::new();
    group.prefilling.retain_mut(|s| {
        s.remaining -= s.chunk;
        s.chunk = 0;
        if s.remaining > 0 {
            return true;
        }
        prefilled.push(s.request);
        false
    });
    for request in prefilled {
        // The last chunk's step samples the first output token.
        produced += 1.0;
        times[request].0 = Some(end);
        group
            .counters
            .time_to_first_token
            .record(end - requests[request].arrival);
        let output = requests[request].output;
        if output <= 1 {
            times[request].1 = Some(end);
            group.counters.finished += 1.0;
        } else {
            group.decoding.push(Sequence {
                request,
                remaining: output - 1,
                chunk: 0,
            });
        }
    }
    group.counters.output_tokens += produced;
}

/// What the autoscaler would read: each group's load, and its counters as a `LoadReport`
/// carries them.
fn observe(groups: &[Group], fleet: &Fleet, spec: u32) -> (Observation, Vec<GroupSample>) {
    let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    let observation = Observation {
        spec_replicas: spec,
        groups: groups
            .iter()
            .map(|g| GroupLoad {
                group: g.id,
                state: g.state,
                waiting: count(g.queue.len()),
                running: count(g.decoding.len() + g.prefilling.len()),
                kv_usage: 0.0,
            })
            .collect(),
        wake_requested: false,
        readings: Readings::default(),
    };
    let samples = groups
        .iter()
        .map(|g| GroupSample {
            group: g.id,
            ready: g.state == GroupState::Ready,
            warming: g.state == GroupState::Warming,
            counters: (g.state != GroupState::Warming).then(|| g.counters.clone()),
            max_batch: Some(fleet.max_batch),
        })
        .collect();
    (observation, samples)
}

/// Goes from `spec` to `desired` groups: new ones warm up, removed ones drain (or go at once
/// while still warming).
fn rescale(
    groups: &mut Vec<Group>,
    observation: &Observation,
    (spec, desired): (u32, u32),
    fleet: &Fleet,
    now: f64,
    next_id: &mut u32,
) {
    if desired > spec {
        for _ in spec..desired {
            groups.push(Group {
                id: *next_id,
                state: GroupState::Warming,
                ready_at: now + fleet.warm_up,
                queue: VecDeque::new(),
                prefilling: Vec::new(),
                decoding: Vec::new(),
                step_end: None,
                counters: Group::counters(),
            });
            *next_id += 1;
        }
    } else if desired < spec {
        let victims = scale_down_victims(&observation.groups, (spec - desired) as usize);
        groups.retain(|g| !(victims.contains(&g.id) && g.state == GroupState::Warming));
        for group in groups.iter_mut().filter(|g| victims.contains(&g.id)) {
            group.state = GroupState::Draining;
        }
    }
}

/// The benchmark: a fleet of NPU-like groups (prefill 15 ms a step + 0.12 ms a position,
/// decode 20 ms + 0.4 ms a sequence, 512 positions a step, batch 64, 30 s warm-up), objectives
/// TTFT p90 800 ms and TPOT p90 80 ms, and a trace of 2 req/s with a burst to 8 req/s from
/// 120 s to 360 s, 600 s in all.
pub fn benchmark() -> (Fleet, Trace, f64) {
    let targets = p90(0.8, 0.08);
    let fleet = Fleet {
        warm_up: 30.0,
        prefill: Line {
            intercept: 0.015,
            slope: 0.000_12,
        },
        attention: 0.0,
        decode: Line {
            intercept: 0.02,
            slope: 0.000_4,
        },
        step_tokens: 512,
        max_batch: 64,
        queue_limit: 1024,
        initial_replicas: 1,
        drain: 120.0,
        targets,
        burst_start: 120.0,
    };
    let trace = Trace::Step {
        base: 2.0,
        peak: 8.0,
        start: 120.0,
        end: 360.0,
    };
    (fleet, trace, 600.0)
}

/// Queue-depth targets the comparison tries, to find the cheapest that meets the objectives
/// as often as the objectives mode; the default target among them.
pub const QUEUE_TARGETS: [f64; 8] = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0];

/// Every mode on the benchmark: the objectives mode, then queue depth at each of
/// [`QUEUE_TARGETS`].
pub fn compare(max_replicas: u32) -> Vec<(String, Outcome)> {
    let (fleet, trace, duration) = benchmark();
    compare_on(
        &fleet,
        &mixed_prompts(&trace, duration, SEED, &Mix::NPU),
        max_replicas,
    )
}

/// Every mode on `requests` and `fleet`: the objectives mode, then queue depth at each of
/// [`QUEUE_TARGETS`].
pub fn compare_on(
    fleet: &Fleet,
    requests: &[Request],
    max_replicas: u32,
) -> Vec<(String, Outcome)> {
    let config = PolicyConfig {
        max_replicas,
        ..PolicyConfig::default()
    };
    let mut scalers: Vec<Box<dyn Scaler>> = vec![Box::new(
        Objectives::new(config.clone(), fleet.targets).expect("a valid configuration"),
    )];
    for target in QUEUE_TARGETS {
        let config = PolicyConfig {
            target_queue_per_replica: target,
            ..config.clone()
        };
        scalers.push(Box::new(
            QueueDepth::new(config).expect("a valid configuration"),
        ));
    }
    scalers
        .iter_mut()
        .map(|s| (s.name(), run(fleet, requests, s.as_mut())))
        .collect()
}

/// The benchmark on real workers, simulated: one-thread SmolLM2 workers with the lines the
/// objectives mode fitted to them on a two-core AMD EPYC VM during the benchmark's chat
/// (prefill 5.5 ms + 1.05 ms a position, decode 8 ms + 2.2 ms a sequence) and attention
/// of 2.4 µs a position per earlier position, which the documents' line needs (fitted
/// during them: 1.7 ms a position), 512 positions a step, batch 256, 10 s from asking for a
/// worker to it serving, objectives TTFT p90 2 s and TPOT p90 150 ms, on [`CPU_PHASES`], 1
/// to [`CPU_MAX_REPLICAS`] groups.
pub fn cpu_benchmark() -> (Fleet, Vec<Request>) {
    let fleet = Fleet {
        warm_up: 10.0,
        prefill: Line {
            intercept: 0.005_5,
            slope: 0.001_05,
        },
        attention: 2.4e-6,
        decode: Line {
            intercept: 0.008,
            slope: 0.002_2,
        },
        step_tokens: 512,
        max_batch: 256,
        queue_limit: 1024,
        initial_replicas: 1,
        // The benchmark on real workers counts replica-seconds this long after the trace.
        drain: TAIL_SECONDS,
        targets: p90(2.0, 0.15),
        burst_start: CPU_PHASES[0].seconds,
    };
    (fleet, phased(&CPU_PHASES, SEED))
}

/// The CPU benchmark's largest fleet: one one-thread worker per core of a two-core machine.
/// The capacity model takes replica groups to have their own devices, as accelerator groups
/// on real nodes do; a third worker would share a core and slow the other two.
pub const CPU_MAX_REPLICAS: u32 = 2;

/// Seconds after the CPU benchmark's last arrival that its replica-seconds still count.
pub const TAIL_SECONDS: f64 = 30.0;

/// `fleet` with the decode line and prefill slope the objectives mode fitted to one-thread
/// SmolLM2 workers in the fifth real run: faster than [`cpu_benchmark`]'s, fitted in an
/// earlier run on the same machine type.
pub fn fifth_run_lines(fleet: &Fleet) -> Fleet {
    Fleet {
        prefill: Line {
            slope: 0.000_58,
            ..fleet.prefill
        },
        decode: Line {
            intercept: 0.004_1,
            slope: 0.001_55,
        },
        ..fleet.clone()
    }
}

/// One trace of [`cpu_search`]: the objectives against queue depth on it.
#[derive(Clone, Debug)]
pub struct SearchRow {
    /// The chat phase's rate (req/s) and answer lengths (tokens), and the documents' rate.
    pub chat_rate: f64,
    pub chat_output: (u32, u32),
    pub documents_rate: f64,
    pub objectives: Outcome,
    /// The cheapest queue-depth target that [`Outcome::meets_objectives`], and its outcome;
    /// none when no target does.
    pub cheapest_queue: Option<(f64, Outcome)>,
}

impl SearchRow {
    /// The objectives' replica-seconds over the cheapest queue depth's, when both
    /// [`Outcome::meets_objectives`].
    pub fn ratio(&self) -> Option<f64> {
        let (_, queue) = self.cheapest_queue.as_ref()?;
        self.objectives
            .meets_objectives()
            .then(|| self.objectives.replica_seconds / queue.replica_seconds)
    }
}

/// [`CPU_PHASES`] with the chat's rate and answer lengths and the documents' rate varied
/// over a grid (chat 1.5 to 5 req/s with answers of 48..=96, 96..=192 or 150..=300 tokens,
/// documents 1.4 to 2.6 req/s), each trace run on `fleet` with 1 to `max_groups` groups
/// under the objectives and under queue depth at each of [`QUEUE_TARGETS`]. It asks whether
/// any such trace lets the objectives spend a quarter fewer replica-seconds than queue
/// depth on workers whose decode step grows this steeply with its batch.
pub fn cpu_search(fleet: &Fleet, max_groups: u32) -> Vec<SearchRow> {
    let mut rows = Vec::new();
    for chat_output in [(48, 96), (96, 192), (150, 300)] {
        for chat_rate in [1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0] {
            for documents_rate in [1.4, 1.8, 2.2, 2.6] {
                let chat = Mix {
                    output: chat_output,
                    ..Mix::CHAT_CPU
                };
                let phases = [
                    Phase {
                        rate: 0.5,
                        mix: chat,
                        ..CPU_PHASES[0]
                    },
                    Phase {
                        rate: chat_rate,
                        mix: chat,
                        ..CPU_PHASES[1]
                    },
                    Phase {
                        rate: documents_rate,
                        ..CPU_PHASES[2]
                    },
                ];
                let mut outcomes =
                    compare_on(fleet, &phased(&phases, SEED), max_groups).into_iter();
                let (_, objectives) = outcomes.next().expect("the objectives run first");
                let cheapest_queue = outcomes
                    .zip(QUEUE_TARGETS)
                    .filter(|((_, o), _)| o.meets_objectives())
                    .map(|((_, o), target)| (target, o))
                    .min_by(|a, b| a.1.replica_seconds.total_cmp(&b.1.replica_seconds));
                rows.push(SearchRow {
                    chat_rate,
                    chat_output,
                    documents_rate,
                    objectives,
                    cheapest_queue,
                });
            }
        }
    }
    rows
}

/// Objectives at the 90th percentile: TTFT and TPOT in seconds.
fn p90(ttft: f64, tpot: f64) -> Targets {
    let at = |seconds| {
        Some(objectives::Target {
            quantile: 0.9,
            seconds,
        })
    };
    Targets {
        ttft: at(ttft),
        tpot: at(tpot),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trace_is_the_same_every_run_and_mixes_short_and_long_prompts() {
        let (_, trace, duration) = benchmark();
        let a = mixed_prompts(&trace, duration, SEED, &Mix::NPU);
        assert_eq!(a, mixed_prompts(&trace, duration, SEED, &Mix::NPU));
        let expected = 2.0 * 360.0 + 8.0 * 240.0;
        assert!(
            (a.len() as f64 - expected).abs() < 0.1 * expected,
            "{}",
            a.len()
        );
        let long = a.iter().filter(|r| r.prompt >= 2000).count() as f64 / a.len() as f64;
        assert!((0.15..0.25).contains(&long), "{long}");
    }

    #[test]
    fn objectives_mode_meets_them_with_a_quarter_fewer_replica_seconds_than_queue_depth() {
        let outcomes = compare(20);
        for (name, o) in &outcomes {
            eprintln!("{name}: {o:?}");
        }
        let (_, objectives) = &outcomes[0];
        assert!(objectives.attainment() >= 0.95, "{objectives:?}");
        assert_eq!(objectives.failed, 0);
        let cheapest_queue = outcomes[1..]
            .iter()
            .filter(|(_, o)| o.attainment() >= 0.95 && o.failed == 0)
            .map(|(_, o)| o.replica_seconds)
            .min_by(f64::total_cmp)
            .expect("some queue-depth target meets the objectives");
        assert!(
            objectives.replica_seconds <= 0.75 * cheapest_queue,
            "objectives {} replica-seconds against {cheapest_queue}",
            objectives.replica_seconds
        );
    }

    #[test]
    fn a_phased_trace_runs_its_phases_in_turn_each_at_its_rate_and_lengths() {
        let requests = phased(&CPU_PHASES, SEED);
        assert_eq!(requests, phased(&CPU_PHASES, SEED));
        assert!(requests.windows(2).all(|w| w[0].arrival <= w[1].arrival));
        let mut start = 0.0;
        for phase in CPU_PHASES {
            let end = start + phase.seconds;
            let within: Vec<_> = requests
                .iter()
                .filter(|r| (start..end).contains(&r.arrival))
                .collect();
            let expected = phase.rate * phase.seconds;
            assert!(
                (within.len() as f64 - expected).abs() <= 3.0 * expected.sqrt(),
                "{} requests from {start} s, expected about {expected}",
                within.len()
            );
            let (low, high) = phase.mix.short_prompt;
            assert!(within.iter().all(|r| (low..=high).contains(&r.prompt)));
            start = end;
        }
    }

    #[test]
    fn a_search_row_compares_only_modes_that_meet_the_objectives() {
        let outcome = |replica_seconds, met, failed| Outcome {
            requests: 100,
            ttft_met: met,
            tpot_met: 1.0,
            replica_seconds,
            scale_up_reaction: None,
            failed,
            max_replicas: 2,
        };
        let row = |objectives, cheapest_queue| SearchRow {
            chat_rate: 2.0,
            chat_output: (48, 96),
            documents_rate: 1.4,
            objectives,
            cheapest_queue,
        };
        let queue = Some((5.0, outcome(400.0, 0.96, 0)));
        assert_eq!(
            row(outcome(300.0, 0.97, 0), queue.clone()).ratio(),
            Some(0.75)
        );
        assert_eq!(row(outcome(300.0, 0.94, 0), queue.clone()).ratio(), None);
        assert_eq!(row(outcome(300.0, 0.97, 1), queue).ratio(), None);
        assert_eq!(row(outcome(300.0, 0.97, 0), None).ratio(), None);
    }

    #[test]
    fn the_comparison_includes_the_default_queue_depth() {
        let default = f64::from(npufleet_crds::DEFAULT_TARGET_QUEUE_DEPTH);
        assert!(QUEUE_TARGETS.contains(&default));
    }

    #[test]
    fn on_chat_then_documents_objectives_meet_them_cheaper_than_any_queue_depth_that_does() {
        // Only about a tenth cheaper, not the quarter of the NPU-like trace: a one-thread
        // worker's decode step grows 2.2 ms a sequence over an 8 ms base, so batching buys
        // little, the requests in flight follow the load, and a queue-depth target is nearly
        // a utilisation target.
        let (fleet, requests) = cpu_benchmark();
        let outcomes = compare_on(&fleet, &requests, CPU_MAX_REPLICAS);
        for (name, o) in &outcomes {
            eprintln!("{name}: {o:?}");
        }
        let (_, objectives) = &outcomes[0];
        assert!(objectives.attainment() >= 0.95, "{objectives:?}");
        assert_eq!(objectives.failed, 0);
        assert!(objectives.max_replicas <= CPU_MAX_REPLICAS);
        for (name, o) in &outcomes[1..] {
            if o.attainment() >= 0.95 {
                assert!(
                    objectives.replica_seconds < o.replica_seconds,
                    "{name}: {o:?} against {objectives:?}"
                );
            }
        }
    }
}

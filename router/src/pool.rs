//! What the router tracks per replica between requests: its requests in flight and the last
//! load report its worker streamed, and the pick of a replica for one request.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use npufleet_crds::RoutingPolicy;
use prometheus::IntGauge;

use crate::cache_index::{CachedBlocks, Gap, Lookup};
use crate::discovery::{Endpoint, Model};
use crate::flow::Flow;
use crate::policy::{self, Candidate, PrefillEstimate, ReportedLoad};
use crate::prefill::{PrefillTimes, Prefills};
use crate::prompt::Affinity;
use npufleet_contract::proto::npufleet::v1::KvEventBatch;

/// A worker's last report and when it arrived.
#[derive(Clone, Copy, Debug)]
pub struct Report {
    pub load: ReportedLoad,
    /// The worker said it is shutting down: it refuses new requests.
    pub draining: bool,
    /// Most prompt positions one request computes in a step, where the worker says.
    pub prompt_chunk: Option<u32>,
    pub received: Instant,
}

#[derive(Default, Debug)]
pub struct ReplicaState {
    in_flight: AtomicU32,
    /// The most of this router's requests in flight at once since the last report came.
    in_flight_peak: AtomicU32,
    /// This router's requests in flight whose first token has not come back yet.
    prefills: Mutex<Prefills>,
    report: Mutex<Option<Report>>,
    /// Tokens per prefix-cache block, as the worker publishes it; 0 until read.
    block_size: AtomicUsize,
    /// What the replica's prefix cache holds, from its cache events.
    cached: Mutex<CachedBlocks>,
}

impl ReplicaState {
    pub fn set_block_size(&self, tokens: usize) {
        self.block_size.store(tokens, Ordering::Relaxed);
    }

    /// Applies a batch of the worker's cache events.
    pub fn apply_kv_events(&self, batch: &KvEventBatch) -> Result<(), Gap> {
        if batch.block_size > 0 {
            self.set_block_size(batch.block_size as usize);
        }
        self.cached.lock().expect("cache lock").apply(batch)
    }

    /// Forgets what the replica's cache holds: its events can no longer be followed.
    pub fn forget_cached(&self) {
        self.cached.lock().expect("cache lock").clear();
    }

    /// Keeps the worker's report, stamped with the most of this router's requests in flight
    /// there since the previous one. The worker counted at some moment in between: a
    /// request of this router's that finished after that moment is in its count, and
    /// taken for another router's it would keep a just-freed replica looking busy until the
    /// next report, steering requests away from the one replica that has room. The peak
    /// errs the other way, towards fewer of the others' requests, which the next report
    /// corrects.
    pub fn set_report(&self, mut report: Report) {
        let now = self.in_flight.load(Ordering::Relaxed);
        report.load.own_in_flight = self.in_flight_peak.swap(now, Ordering::Relaxed).max(now);
        *self.report.lock().expect("report lock") = Some(report);
    }

    fn prefills(&self) -> std::sync::MutexGuard<'_, Prefills> {
        self.prefills.lock().expect("prefills lock")
    }

    fn fresh_report(&self, max_age: Duration) -> Option<Report> {
        self.report
            .lock()
            .expect("report lock")
            .filter(|r| r.received.elapsed() <= max_age)
    }
}

/// A request's hold on a replica: counts as in flight there until dropped.
#[derive(Debug)]
pub struct Lease {
    pub pod: String,
    pub ip: IpAddr,
    /// The replica's HTTP API port.
    pub http_port: u16,
    /// For a prompt named by its token blocks, how much of it the replica holds.
    pub cache_match: Option<CacheMatch>,
    /// The flow-control priority the request was admitted at, passed on for the replica's
    /// scheduler to run higher priorities first; none without flow control.
    pub priority: Option<i32>,
    /// Idle replicas to compute the prompt's shared prefix now ([`policy::prefix_copies`]).
    pub prefix_copy: Option<PrefixCopy>,
    /// The request's place among the replica's prompts in their prefill, until its first
    /// token.
    prefill: Option<u64>,
    /// The model's prefill timings, taught this request's when it ran alone.
    times: SharedTimes,
    state: Arc<ReplicaState>,
    shown: Option<IntGauge>,
    /// The model's flow-control queue, told when this lease frees a place.
    released: Option<Arc<Flow>>,
}

impl Lease {
    /// Counts the lease in `gauge` too, while it lasts.
    pub fn show_in(&mut self, gauge: IntGauge) {
        gauge.inc();
        self.shown = Some(gauge);
    }

    /// Wakes `flow`'s waiting requests when the lease ends.
    pub fn on_release(&mut self, flow: Arc<Flow>) {
        self.released = Some(flow);
    }

    /// The replica's streamed answer has begun: the request's prompt is no longer ahead of
    /// the next one's there, and if it ran alone its time teaches the model's timings.
    pub fn first_token(&mut self) {
        let Some(id) = self.prefill.take() else {
            return;
        };
        // The replica's lock is let go before the model's is taken: a pick takes them the
        // other way round.
        let timed = self.state.prefills().first_token(id, Instant::now());
        if let Some((tokens, ms)) = timed {
            self.times.lock().expect("times lock").observe(tokens, ms);
        }
    }

    /// A whole answer has begun to come back (not streamed): the prompt is no longer ahead
    /// of the next one, but when its prefill ended is unknown, so it teaches no timing.
    pub fn answer_began(&mut self) {
        if let Some(id) = self.prefill.take() {
            self.state.prefills().abandon(id);
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.answer_began();
        self.state.in_flight.fetch_sub(1, Ordering::Relaxed);
        if let Some(gauge) = &self.shown {
            gauge.dec();
        }
        if let Some(flow) = &self.released {
            flow.wake_all();
        }
    }
}

/// A shared prefix to compute at idle replicas, each with its place taken.
pub struct PrefixCopy {
    /// The prefix's tokens, whole blocks of them.
    pub prompt: Vec<u32>,
    pub to: Vec<Lease>,
}

/// Where to, and how long: a prompt's tokens have no place in a log line.
impl std::fmt::Debug for PrefixCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixCopy")
            .field("tokens", &self.prompt.len())
            .field("to", &self.to.iter().map(|l| &l.pod).collect::<Vec<_>>())
            .finish()
    }
}

/// How prefix-affinity bounds a replica's share.
#[derive(Clone, Copy, Debug)]
pub struct PickSettings {
    /// A replica takes a key only while its outstanding requests stay within this factor
    /// of the mean.
    pub load_factor: f64,
    /// Cache-aware placement keeps a prompt on the replica holding most of it while that
    /// replica has at most this many requests outstanding beyond the least loaded one's.
    pub cache_slack: u32,
    /// Reports older than this are ignored (the worker or its stream is gone).
    pub report_max_age: Duration,
    /// Cache-aware routing has idle replicas compute the prefixes that prompts share
    /// ([`policy::prefix_copies`]).
    pub copy_shared_prefixes: bool,
}

/// The pick's share of the prompt: how many of its leading blocks the chosen replica holds,
/// of how many it has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheMatch {
    pub cached: usize,
    pub blocks: usize,
}

/// The prompt's tokens the replica would have to compute: all but its cached blocks.
fn uncached_tokens(prompt_tokens: u32, cached_blocks: usize, state: &ReplicaState) -> u32 {
    let cached = cached_blocks.saturating_mul(state.block_size.load(Ordering::Relaxed));
    prompt_tokens.saturating_sub(u32::try_from(cached).unwrap_or(u32::MAX))
}

type SharedTimes = Arc<Mutex<PrefillTimes>>;

/// Per-replica state by IP address (a pod's IP is its replica's identity while it lives).
#[derive(Default)]
pub struct Pool {
    replicas: Mutex<HashMap<IpAddr, Arc<ReplicaState>>>,
    /// Each model's prefill timings, by namespace and Service name; kept while the router
    /// runs, so a fleet scaled to zero and back starts timed.
    times: Mutex<HashMap<(String, String), SharedTimes>>,
    turns: AtomicUsize,
}

impl Pool {
    /// The state of the replica at `ip`, created on first use.
    pub fn replica(&self, ip: IpAddr) -> Arc<ReplicaState> {
        self.replicas
            .lock()
            .expect("pool lock")
            .entry(ip)
            .or_default()
            .clone()
    }

    /// Forgets replicas no longer in `live` (leases still out keep their own reference).
    pub fn retain(&self, live: &[IpAddr]) {
        self.replicas
            .lock()
            .expect("pool lock")
            .retain(|ip, _| live.contains(ip));
    }

    /// Tokens per prefix-cache block of `model`'s workers: the first a replica has published.
    pub fn block_size(&self, model: &Model) -> Option<usize> {
        let replicas = self.replicas.lock().expect("pool lock");
        model
            .endpoints
            .iter()
            .filter_map(|e| replicas.get(&e.ip))
            .map(|state| state.block_size.load(Ordering::Relaxed))
            .find(|&tokens| tokens > 0)
    }

    /// A replica of `model` for one request, by the model's policy, skipping the pods in
    /// `exclude` (already tried), any whose worker reports it is draining and any with
    /// `places` of this router's requests outstanding (flow control's bound; `u32::MAX`
    /// without it). `prompt_tokens` (estimated) tells how long its prefill will be where
    /// none of it is cached. `None` when no replica is left.
    pub fn pick(
        &self,
        model: &Model,
        affinity: &Affinity,
        prompt_tokens: u32,
        exclude: &[String],
        settings: PickSettings,
        places: u32,
    ) -> Option<Lease> {
        let now = Instant::now();
        let times = self
            .times
            .lock()
            .expect("timings lock")
            .entry((model.namespace.clone(), model.service.clone()))
            .or_default()
            .clone();
        let timings = times.lock().expect("times lock");
        let mut endpoints: Vec<(&Endpoint, Arc<ReplicaState>, Candidate, u32)> = Vec::new();
        for endpoint in &model.endpoints {
            if exclude.contains(&endpoint.pod) {
                continue;
            }
            let state = self.replica(endpoint.ip);
            let report = state.fresh_report(settings.report_max_age);
            if report.is_some_and(|r| r.draining) {
                continue;
            }
            let found = match affinity {
                Affinity::Blocks(blocks) => state
                    .cached
                    .lock()
                    .expect("cache lock")
                    .leading(&blocks.names),
                _ => Lookup::default(),
            };
            let in_flight = state.in_flight.load(Ordering::Relaxed);
            if in_flight >= places {
                continue;
            }
            let uncached = uncached_tokens(prompt_tokens, found.blocks, &state);
            let chunk = report.and_then(|r| r.prompt_chunk);
            let ahead = state.prefills().ahead(now, &timings, uncached, chunk);
            let own_ms = timings.expected_ms(uncached);
            let candidate = Candidate {
                id: endpoint.pod.clone(),
                in_flight,
                prefill_left: ahead.prompts,
                reported: report.map(|r| r.load),
                cached_blocks: found.blocks,
                forks: found.forks,
                prefill: ahead
                    .wait_ms
                    .zip(own_ms)
                    .map(|(wait_ms, own_ms)| PrefillEstimate { wait_ms, own_ms }),
            };
            endpoints.push((endpoint, state, candidate, uncached));
        }
        drop(timings);
        let candidates: Vec<Candidate> = endpoints.iter().map(|(_, _, c, _)| c.clone()).collect();
        let turn = self.turns.fetch_add(1, Ordering::Relaxed);
        let chosen = match (model.policy, affinity) {
            (RoutingPolicy::RoundRobin, _) => policy::round_robin(&candidates, turn),
            (RoutingPolicy::CacheAware, Affinity::Blocks(_)) => {
                policy::cache_aware(&candidates, settings.cache_slack, turn)
            }
            (RoutingPolicy::PrefixAffinity | RoutingPolicy::CacheAware, &Affinity::Key(key)) => {
                policy::bounded_load_consistent_hash(&candidates, key, settings.load_factor)
            }
            _ => policy::least_load(&candidates, turn),
        }?;
        tracing::debug!(
            replica = %candidates[chosen].id,
            candidates = ?candidates
                .iter()
                .map(|c| (
                    c.id.as_str(),
                    c.load_score(),
                    c.prefill_left,
                    c.cached_blocks,
                    c.prefill
                ))
                .collect::<Vec<_>>(),
            "picked (replica, load score, prompts ahead, cached blocks, prefill estimate)"
        );
        let copies = match (model.policy, affinity) {
            (RoutingPolicy::CacheAware, Affinity::Blocks(blocks))
                if settings.copy_shared_prefixes =>
            {
                policy::prefix_copies(&candidates, chosen).map(|copy| (copy, blocks))
            }
            _ => None,
        };
        let mut endpoints: Vec<_> = endpoints.into_iter().map(Some).collect();
        let (endpoint, state, candidate, uncached) = endpoints[chosen].take()?;
        let mut lease = self.lease(model, endpoint, state, uncached, places, now, &times)?;
        if let Affinity::Blocks(blocks) = affinity {
            lease.cache_match = Some(CacheMatch {
                cached: candidate.cached_blocks,
                blocks: blocks.names.len(),
            });
        }
        if let Some(((shared, to), blocks)) = copies {
            let prompt = blocks.leading_tokens(shared);
            let to: Vec<Lease> = to
                .into_iter()
                .filter_map(|i| {
                    let (endpoint, state, candidate, _) = endpoints[i].take()?;
                    let cached = candidate.cached_blocks * blocks.block_size;
                    let uncached = u32::try_from(prompt.len() - cached.min(prompt.len())).ok()?;
                    // Only while it is still idle.
                    self.lease(model, endpoint, state, uncached, 1, now, &times)
                })
                .collect();
            if !to.is_empty() {
                lease.prefix_copy = Some(PrefixCopy {
                    prompt: prompt.to_vec(),
                    to,
                });
            }
        }
        Some(lease)
    }

    /// Takes a place at the replica for a prompt of `uncached` tokens to compute, unless it
    /// has `places` of this router's requests outstanding by now.
    #[allow(clippy::too_many_arguments)]
    fn lease(
        &self,
        model: &Model,
        endpoint: &Endpoint,
        state: Arc<ReplicaState>,
        uncached: u32,
        places: u32,
        now: Instant,
        times: &SharedTimes,
    ) -> Option<Lease> {
        // Another request may have taken the last place since it was counted.
        let before = state
            .in_flight
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < places).then_some(n + 1)
            })
            .ok()?;
        state
            .in_flight_peak
            .fetch_max(before + 1, Ordering::Relaxed);
        let prefill = Some(state.prefills().start(uncached, now));
        Some(Lease {
            pod: endpoint.pod.clone(),
            ip: endpoint.ip,
            http_port: model.http_port,
            cache_match: None,
            priority: None,
            prefix_copy: None,
            prefill,
            times: times.clone(),
            state,
            shown: None,
            released: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(policy: RoutingPolicy) -> Model {
        Model {
            namespace: "ns".into(),
            service: "chat".into(),
            policy,
            engine: npufleet_crds::Engine::Npufleet,
            http_port: npufleet_contract::ports::HTTP_PORT,
            load: npufleet_crds::LoadSource::WorkerStream,
            desired_replicas: 2,
            endpoints: vec![
                Endpoint {
                    pod: "chat-0-0".into(),
                    ip: "127.0.0.2".parse().unwrap(),
                },
                Endpoint {
                    pod: "chat-1-0".into(),
                    ip: "127.0.0.3".parse().unwrap(),
                },
            ],
            flow: None,
        }
    }

    const SETTINGS: PickSettings = PickSettings {
        load_factor: 1.25,
        cache_slack: 2,
        report_max_age: Duration::from_secs(2),
        copy_shared_prefixes: true,
    };

    #[test]
    fn leases_count_in_flight_until_dropped() {
        let pool = Pool::default();
        let model = model(RoutingPolicy::LeastLoad);
        let first = pool
            .pick(&model, &Affinity::None, 0, &[], SETTINGS, u32::MAX)
            .unwrap();
        let second = pool
            .pick(&model, &Affinity::None, 0, &[], SETTINGS, u32::MAX)
            .unwrap();
        assert_ne!(first.pod, second.pod, "least-load spreads two requests");
        drop(first);
        let third = pool
            .pick(&model, &Affinity::None, 0, &[], SETTINGS, u32::MAX)
            .unwrap();
        assert_ne!(
            third.pod, second.pod,
            "the freed replica is the least loaded"
        );
    }

    #[test]
    fn a_replica_with_its_places_taken_is_skipped() {
        let pool = Pool::default();
        let model = model(RoutingPolicy::RoundRobin);
        let leases: Vec<_> = (0..2)
            .map(|_| {
                pool.pick(&model, &Affinity::None, 0, &[], SETTINGS, 1)
                    .unwrap()
            })
            .collect();
        assert_ne!(leases[0].pod, leases[1].pod);
        assert!(
            pool.pick(&model, &Affinity::None, 0, &[], SETTINGS, 1)
                .is_none()
        );
        let more = pool.pick(&model, &Affinity::None, 0, &[], SETTINGS, 2);
        assert!(more.is_some(), "a request with more places still finds one");
    }

    #[test]
    fn tried_and_draining_replicas_are_skipped() {
        let pool = Pool::default();
        let model = model(RoutingPolicy::RoundRobin);
        let only = pool
            .pick(
                &model,
                &Affinity::None,
                0,
                &["chat-0-0".to_owned()],
                SETTINGS,
                u32::MAX,
            )
            .unwrap();
        assert_eq!(only.pod, "chat-1-0");
        pool.replica(model.endpoints[1].ip).set_report(Report {
            load: ReportedLoad::new(0, 0, 0.0),
            draining: true,
            prompt_chunk: None,
            received: Instant::now(),
        });
        assert!(
            pool.pick(
                &model,
                &Affinity::None,
                0,
                &["chat-0-0".to_owned()],
                SETTINGS,
                u32::MAX
            )
            .is_none()
        );
    }

    #[test]
    fn a_report_counts_this_routers_requests_only_while_they_last() {
        let pool = Pool::default();
        let model = model(RoutingPolicy::LeastLoad);
        let busy = |running| Report {
            load: ReportedLoad::new(0, running, 0.0),
            draining: false,
            prompt_chunk: None,
            received: Instant::now(),
        };
        let mine = pool
            .pick(&model, &Affinity::None, 0, &[], SETTINGS, u32::MAX)
            .unwrap();
        let (own, other) = match model.endpoints.iter().position(|e| e.pod == mine.pod) {
            Some(0) => (&model.endpoints[0], &model.endpoints[1]),
            _ => (&model.endpoints[1], &model.endpoints[0]),
        };
        // Each replica reports one request: this router's on one, another's on the other.
        pool.replica(own.ip).set_report(busy(1));
        pool.replica(other.ip).set_report(busy(1));
        drop(mine);
        for _ in 0..2 {
            let next = pool
                .pick(&model, &Affinity::None, 0, &[], SETTINGS, u32::MAX)
                .unwrap();
            assert_eq!(next.pod, own.pod, "its own request has finished there");
        }
    }

    #[test]
    fn a_request_that_finished_since_the_workers_count_is_not_taken_for_another_routers() {
        let pool = Pool::default();
        let model = model(RoutingPolicy::LeastLoad);
        let report = |running, kv| Report {
            load: ReportedLoad::new(0, running, kv),
            draining: false,
            prompt_chunk: None,
            received: Instant::now(),
        };
        let mut leases: Vec<Lease> = (0..4)
            .map(|_| {
                pool.pick(&model, &Affinity::None, 0, &[], SETTINGS, u32::MAX)
                    .unwrap()
            })
            .collect();
        let a = &model.endpoints[0];
        assert_eq!(leases.iter().filter(|l| l.pod == a.pod).count(), 2);
        // One of this router's two requests on "a" finishes; the worker's report, counted
        // just before, still holds both. Two of this router's are in flight on "b".
        let finished = leases.iter().position(|l| l.pod == a.pod).unwrap();
        drop(leases.swap_remove(finished));
        pool.replica(a.ip).set_report(report(2, 0.5));
        let next = pool
            .pick(&model, &Affinity::None, 0, &[], SETTINGS, u32::MAX)
            .unwrap();
        assert_eq!(next.pod, a.pod, "one in flight on a against two on b");
        // From the next report on, a request of another router's there counts.
        pool.replica(a.ip).set_report(report(2, 0.5));
        pool.replica(a.ip).set_report(report(4, 0.5));
        let last = pool
            .pick(&model, &Affinity::None, 0, &[], SETTINGS, u32::MAX)
            .unwrap();
        assert_eq!(last.pod, model.endpoints[1].pod, "two others' on a");
    }

    #[test]
    fn a_lease_counts_as_prefilling_until_its_first_token_or_its_end() {
        let pool = Pool::default();
        let model = model(RoutingPolicy::LeastLoad);
        let prefilling = |ip| pool.replica(ip).prefills().in_prefill();
        let mut first = pool
            .pick(&model, &Affinity::None, 0, &[], SETTINGS, u32::MAX)
            .unwrap();
        assert_eq!(prefilling(first.ip), 1);
        first.first_token();
        first.first_token();
        assert_eq!(prefilling(first.ip), 0, "counted down once");
        let second = pool
            .pick(&model, &Affinity::None, 0, &[], SETTINGS, u32::MAX)
            .unwrap();
        let ip = second.ip;
        drop(second);
        assert_eq!(
            prefilling(ip),
            0,
            "a request that ends before its first token leaves the count too"
        );
    }

    #[test]
    fn streamed_first_tokens_of_lone_prompts_time_the_model() {
        let pool = Pool::default();
        let model = model(RoutingPolicy::LeastLoad);
        let timed = |pool: &Pool| {
            let times = pool.times.lock().unwrap();
            let times = times.get(&("ns".to_owned(), "chat".to_owned())).unwrap();
            times.lock().unwrap().expected_ms(400)
        };
        for _ in 0..3 {
            let mut whole = pool
                .pick(&model, &Affinity::None, 400, &[], SETTINGS, u32::MAX)
                .unwrap();
            whole.answer_began();
        }
        assert_eq!(
            timed(&pool),
            None,
            "a whole answer's time is not its prefill's"
        );
        for _ in 0..3 {
            let mut streamed = pool
                .pick(&model, &Affinity::None, 400, &[], SETTINGS, u32::MAX)
                .unwrap();
            streamed.first_token();
        }
        assert!(timed(&pool).is_some());
    }

    #[test]
    fn stale_reports_are_ignored() {
        let pool = Pool::default();
        let model = model(RoutingPolicy::LeastLoad);
        let Some(long_ago) = Instant::now().checked_sub(Duration::from_secs(10)) else {
            return;
        };
        pool.replica(model.endpoints[0].ip).set_report(Report {
            load: ReportedLoad::new(0, 0, 0.0),
            draining: true,
            prompt_chunk: None,
            received: long_ago,
        });
        let leases: Vec<_> = (0..2)
            .map(|_| {
                pool.pick(&model, &Affinity::None, 0, &[], SETTINGS, u32::MAX)
                    .unwrap()
            })
            .collect();
        assert!(leases.iter().any(|l| l.pod == "chat-0-0"));
    }
}

//! The routing policies as pure functions over plain data: which of a model's replicas takes
//! the next request.

/// What the router knows about one replica when it picks.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    /// A name every router replica sees the same way (the pod's name), so that hashing onto
    /// replicas agrees across routers with no shared state.
    pub id: String,
    /// Requests this router has sent to the replica and not yet seen finish.
    pub in_flight: u32,
    /// Of those, the ones whose first token has not come back yet, each counted by the share
    /// of its prefill still to run ([`crate::prefill::Prefills::ahead`]).
    pub prefill_left: f64,
    /// The replica's own report, when a fresh one is at hand.
    pub reported: Option<ReportedLoad>,
    /// How many of the request's leading prompt blocks the replica's prefix cache holds, as
    /// its cache events tell (0 when unknown).
    pub cached_blocks: usize,
    /// Other prompts the replica holds that share those blocks and go on differently
    /// ([`crate::cache_index::Lookup::forks`]).
    pub forks: u32,
    /// How long the request's prefill would take at the replica; unknown until the router
    /// has timed enough of the model's prompts.
    pub prefill: Option<PrefillEstimate>,
}

/// A request's prefill at one replica, as the router's timings estimate it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillEstimate {
    /// Until the prompts it waits for are through theirs, in the order the worker takes
    /// them (the shortest first).
    pub wait_ms: f64,
    /// Its own uncached tokens.
    pub own_ms: f64,
}

impl PrefillEstimate {
    /// What placing the prompt here costs: its wait, and its own compute twice, for the
    /// compute also delays every prompt that comes after it. Counted once, a holder of the
    /// prompt's prefix with one prompt ahead looked no better than an idle replica that would
    /// compute it all, and chats left the replicas holding them.
    pub fn cost_ms(self) -> f64 {
        self.wait_ms + 2.0 * self.own_ms
    }
}

/// A replica's load as its worker last reported it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReportedLoad {
    pub waiting: u32,
    pub running: u32,
    /// Fraction of KV-cache blocks in use, 0..=1.
    pub kv_cache_usage: f64,
    /// This router's requests in flight at the replica when the report arrived: the rest of
    /// the report's count is other routers' and clients'.
    pub own_in_flight: u32,
}

impl ReportedLoad {
    /// The worker's figures, before the router stamps its own count on them.
    pub fn new(waiting: u32, running: u32, kv_cache_usage: f64) -> Self {
        Self {
            waiting,
            running,
            kv_cache_usage,
            own_in_flight: 0,
        }
    }

    /// Requests at the replica that are not this router's, as of the report.
    fn others(&self) -> u32 {
        self.waiting
            .saturating_add(self.running)
            .saturating_sub(self.own_in_flight)
    }
}

impl Candidate {
    /// Requests outstanding at the replica: this router's own, counted exactly, and the
    /// others' as of the last report. The report is up to one interval old, so its count of
    /// this router's requests is not used: after a burst finishes it would keep the replica
    /// looking busy for the rest of the interval.
    pub fn outstanding(&self) -> u32 {
        let others = self.reported.map_or(0, |r| r.others());
        self.in_flight.saturating_add(others)
    }

    /// Least-load score: outstanding requests, with the others' queued ones and this
    /// router's still in their prefill (each by the share of it still to run) counted
    /// [`PREFILL_WEIGHT`] more times (a new request's first token waits behind the prompts
    /// ahead of it, while a decoding sequence costs it a share of a step), and KV-cache use
    /// (0..1) breaking ties between equally busy replicas.
    pub fn load_score(&self) -> f64 {
        let queued = self.reported.map_or(0, |r| r.waiting.min(r.others()));
        let prefills = f64::from(queued) + self.prefill_left.min(f64::from(self.in_flight));
        let kv = self
            .reported
            .map_or(0.0, |r| r.kv_cache_usage.clamp(0.0, 1.0));
        f64::from(self.outstanding()) + PREFILL_WEIGHT * prefills + kv
    }
}

/// How many more times a request still before its first token counts in the load score
/// than one decoding. Counted once, like a decoding one, a replica just freed and handed
/// one prompt looked as good as one whose two requests were finishing their decodes: in a
/// closed loop two clients whose requests ended together were sent to the same replica
/// and their prompts queued behind each other, round after round.
const PREFILL_WEIGHT: f64 = 2.0;

/// The candidate with the lowest [`Candidate::load_score`]. Ties go to the first at or after
/// `rotation` (mod the count), so equal replicas take turns instead of the first one taking
/// every request.
pub fn least_load(candidates: &[Candidate], rotation: usize) -> Option<usize> {
    in_turn(candidates.len(), rotation).min_by(|&a, &b| {
        candidates[a]
            .load_score()
            .total_cmp(&candidates[b].load_score())
    })
}

/// The indices `0..n`, starting at `rotation` (mod `n`): ties among them go to the first in
/// turn, so equal replicas take turns.
fn in_turn(n: usize, rotation: usize) -> impl Iterator<Item = usize> {
    (0..n).map(move |i| rotation.wrapping_add(i) % n)
}

/// Cache-aware placement among the replicas with at most `slack` requests outstanding beyond
/// the [`least_load`] pick's: where the prefill costs least ([`PrefillEstimate::cost_ms`]), a
/// longer cached prefix weighed against the prompts ahead of it, with costs within
/// [`COST_TOLERANCE`] of the least placed by load. Until every such replica's prefill can be
/// estimated, the one holding most of the prompt's leading blocks (ties by load), where one
/// holds more than the pick. A prompt stays where its prefix is until that
/// replica runs ahead of the others, then spills to the next best (which then holds it too,
/// and the two share it by load). With nothing cached anywhere it places as least-load does
/// but for a replica whose prompts ahead finish sooner. The bound is a gap rather than a
/// factor of the mean: a factor of the mean never excludes anything on two replicas, where
/// one would keep a hot prompt however far ahead it ran.
pub fn cache_aware(candidates: &[Candidate], slack: u32, rotation: usize) -> Option<usize> {
    let least = least_load(candidates, rotation)?;
    let bound = candidates[least].outstanding().saturating_add(slack);
    let within =
        || in_turn(candidates.len(), rotation).filter(|&i| candidates[i].outstanding() <= bound);
    let by_load = |&a: &usize, &b: &usize| {
        candidates[a]
            .load_score()
            .total_cmp(&candidates[b].load_score())
    };
    let costs: Option<Vec<(usize, f64)>> = within()
        .map(|i| candidates[i].prefill.map(|p| (i, p.cost_ms())))
        .collect();
    if let Some(costs) = costs {
        let least_cost = costs
            .iter()
            .map(|&(_, ms)| ms)
            .fold(f64::INFINITY, f64::min);
        let near = least_cost * (1.0 + COST_TOLERANCE);
        return costs
            .iter()
            .filter(|&&(_, ms)| ms <= near)
            .map(|&(i, _)| i)
            .min_by(by_load);
    }
    let most = within().map(|i| candidates[i].cached_blocks).max()?;
    if most <= candidates[least].cached_blocks {
        return Some(least);
    }
    within()
        .filter(|&i| candidates[i].cached_blocks == most)
        .min_by(by_load)
}

/// Idle replicas to copy a shared prefix to, and how many of the prompt's leading blocks make
/// it: the longest cached run, at any replica, that at least [`SHARED_FORKS`] held prompts go
/// on from differently. Placement alone keeps such a prefix where it was first computed: with
/// every replica idle, the holder is always the cheapest place for each prompt that shares it,
/// so every conversation that starts from it piles onto that replica and they evict each
/// other, while the others' caches hold nothing of use. A copy computed while a replica is
/// idle delays no prompt, and from then on the prompts that share the prefix split by load.
/// Only idle replicas take one, so under load, where spilling spreads the prefix anyway,
/// nothing is copied. A conversation's own history is never copied: only its earlier answer
/// goes on from it differently.
pub fn prefix_copies(candidates: &[Candidate], chosen: usize) -> Option<(usize, Vec<usize>)> {
    let shared = candidates
        .iter()
        .filter(|c| c.forks >= SHARED_FORKS)
        .map(|c| c.cached_blocks)
        .max()
        .filter(|&blocks| blocks >= MIN_COPY_BLOCKS)?;
    let to: Vec<usize> = (0..candidates.len())
        .filter(|&i| i != chosen)
        .filter(|&i| {
            let c = &candidates[i];
            c.cached_blocks < shared && c.outstanding() == 0 && c.prefill_left == 0.0
        })
        .collect();
    (!to.is_empty()).then_some((shared, to))
}

/// Held continuations that make a prefix shared: two, for one of them may be the prompt's own
/// earlier answer (the blocks an answer fills are cached too).
const SHARED_FORKS: u32 = 2;

/// The shortest prefix worth a copy: shorter ones cost little to compute with the prompt.
const MIN_COPY_BLOCKS: usize = 4;

/// Prefill costs this close to the least (a fraction of it) count as equal, and load decides
/// between them: estimates from timings are noisy, and the noise must not outweigh a real
/// difference in load.
const COST_TOLERANCE: f64 = 0.1;

/// `ceil(load_factor × mean)` outstanding requests, the mean counting the one being placed:
/// a replica below it may take one more. At least one replica is always below it.
fn load_bound(candidates: &[Candidate], load_factor: f64) -> Option<u64> {
    if candidates.is_empty() {
        return None;
    }
    let total: u64 = candidates.iter().map(|c| u64::from(c.outstanding())).sum();
    let mean_with_this = (total + 1) as f64 / candidates.len() as f64;
    Some((load_factor.max(1.0) * mean_with_this).ceil() as u64)
}

/// The next candidate in turn.
pub fn round_robin(candidates: &[Candidate], counter: usize) -> Option<usize> {
    (!candidates.is_empty()).then(|| counter % candidates.len())
}

/// Points each replica takes on the hash ring; more points spread keys more evenly.
const RING_POINTS_PER_REPLICA: u32 = 64;

/// Consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, 2016): the key
/// goes to the first replica clockwise from its hash on the ring whose outstanding requests,
/// with this one added, stay within `ceil(load_factor × mean)`. Keys keep their replica while
/// it has room, move minimally when replicas come and go, and no replica goes past the bound.
/// At least one replica is always under the bound, so a pick always exists.
pub fn bounded_load_consistent_hash(
    candidates: &[Candidate],
    key: u64,
    load_factor: f64,
) -> Option<usize> {
    let bound = load_bound(candidates, load_factor)?;
    let mut ring: Vec<(u64, usize)> = candidates
        .iter()
        .enumerate()
        .flat_map(|(index, c)| {
            (0..RING_POINTS_PER_REPLICA).map(move |point| (ring_point(&c.id, point), index))
        })
        .collect();
    ring.sort_unstable();
    let start = ring.partition_point(|&(point, _)| point < key);
    (0..ring.len())
        .map(|i| ring[(start + i) % ring.len()].1)
        .find(|&index| u64::from(candidates[index].outstanding()) < bound)
}

fn ring_point(id: &str, point: u32) -> u64 {
    let mut hash = Fnv1a::default();
    hash.write(id.as_bytes());
    hash.write(&point.to_le_bytes());
    mix(hash.finish())
}

/// 64-bit FNV-1a: stable across processes, builds and platforms, which every router replica
/// needs to place keys the same way.
#[derive(Clone, Copy, Debug)]
pub struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    pub fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    pub fn finish(self) -> u64 {
        self.0
    }
}

/// A finaliser (from SplitMix64) that spreads FNV's output over the whole ring; FNV alone
/// leaves short, similar inputs close together.
pub fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idle(id: &str) -> Candidate {
        Candidate {
            id: id.to_owned(),
            in_flight: 0,
            prefill_left: 0.0,
            reported: None,
            cached_blocks: 0,
            forks: 0,
            prefill: None,
        }
    }

    fn with_load(id: &str, in_flight: u32, waiting: u32, running: u32, kv: f64) -> Candidate {
        Candidate {
            id: id.to_owned(),
            in_flight,
            prefill_left: 0.0,
            reported: Some(ReportedLoad::new(waiting, running, kv)),
            cached_blocks: 0,
            forks: 0,
            prefill: None,
        }
    }

    fn holding(id: &str, in_flight: u32, cached_blocks: usize) -> Candidate {
        Candidate {
            cached_blocks,
            in_flight,
            ..idle(id)
        }
    }

    #[test]
    fn a_prompt_still_in_its_prefill_weighs_more_than_a_decoding_sequence() {
        let prefilling = |id, in_flight, prefilling: u32| Candidate {
            in_flight,
            prefill_left: f64::from(prefilling),
            ..idle(id)
        };
        // One prompt ahead on "a"; two sequences decoding on "b".
        let candidates = [prefilling("a", 1, 1), prefilling("b", 2, 0)];
        for turn in 0..2 {
            assert_eq!(least_load(&candidates, turn), Some(1));
            assert_eq!(cache_aware(&candidates, 2, turn), Some(1));
        }
        // Two prompts ahead on "b": "a" again.
        let candidates = [prefilling("a", 1, 1), prefilling("b", 2, 2)];
        assert_eq!(least_load(&candidates, 1), Some(0));
    }

    #[test]
    fn a_prompt_nearly_through_its_prefill_weighs_less_than_one_just_started() {
        // "a"'s lone prompt has just arrived; "b"'s is a few steps from its first token,
        // beside a decoding sequence. Counted whole, "b"'s prompt made "a" the pick, and the
        // next prompt waited behind all of "a"'s prefill.
        let a = Candidate {
            in_flight: 1,
            prefill_left: 1.0,
            ..idle("a")
        };
        let b = Candidate {
            in_flight: 2,
            prefill_left: 0.2,
            ..idle("b")
        };
        for turn in 0..2 {
            assert_eq!(least_load(&[a.clone(), b.clone()], turn), Some(1));
        }
        let b_whole = Candidate {
            prefill_left: 1.0,
            ..b
        };
        assert_eq!(least_load(&[a, b_whole], 1), Some(0));
    }

    #[test]
    fn cache_aware_goes_where_most_of_the_prompt_is_cached() {
        let candidates = [holding("a", 1, 2), holding("b", 1, 5), holding("c", 0, 0)];
        assert_eq!(cache_aware(&candidates, 2, 0), Some(1));
        // Nothing cached anywhere: least load.
        let cold = [holding("a", 2, 0), holding("b", 1, 0), holding("c", 2, 0)];
        assert_eq!(cache_aware(&cold, 2, 0), Some(1));
    }

    #[test]
    fn with_nothing_cached_cache_aware_places_as_least_load() {
        // "b" has the fewest outstanding, but its own prompt and another router's queued one
        // are both still ahead of a new one; "a" only decodes. A gap of 2 from "b" would have
        // left "a" out.
        let mut b = Candidate {
            in_flight: 1,
            prefill_left: 1.0,
            ..idle("b")
        };
        b.reported = Some(ReportedLoad {
            own_in_flight: 1,
            ..ReportedLoad::new(1, 1, 0.0)
        });
        let a = Candidate {
            in_flight: 5,
            ..idle("a")
        };
        let candidates = [a, b, holding("c", 6, 0)];
        for turn in 0..3 {
            assert_eq!(least_load(&candidates, turn), Some(0));
            assert_eq!(cache_aware(&candidates, 2, turn), Some(0));
        }
    }

    #[test]
    fn with_timings_cache_aware_weighs_a_cached_prefix_against_the_prompts_ahead() {
        let timed = |id, in_flight, cached_blocks, wait_ms, own_ms| Candidate {
            prefill: Some(PrefillEstimate { wait_ms, own_ms }),
            ..holding(id, in_flight, cached_blocks)
        };
        // "b" holds more, but the prompts ahead there cost more than its cache saves.
        let candidates = [timed("a", 1, 2, 0.0, 200.0), timed("b", 1, 5, 450.0, 50.0)];
        assert_eq!(cache_aware(&candidates, 2, 1), Some(0));
        // With one prompt ahead, it saves more than it waits.
        let candidates = [timed("a", 1, 2, 0.0, 200.0), timed("b", 2, 5, 250.0, 50.0)];
        assert_eq!(cache_aware(&candidates, 2, 0), Some(1));
        // Near costs go by load; past the slack a replica is not considered.
        let candidates = [timed("a", 2, 0, 0.0, 300.0), timed("b", 0, 0, 20.0, 300.0)];
        assert_eq!(cache_aware(&candidates, 2, 0), Some(1));
        let candidates = [timed("a", 3, 9, 0.0, 40.0), timed("b", 0, 0, 0.0, 300.0)];
        assert_eq!(cache_aware(&candidates, 2, 0), Some(1));
        // One replica not yet timed: by cached blocks.
        let candidates = [timed("a", 1, 2, 0.0, 250.0), holding("b", 1, 5)];
        assert_eq!(cache_aware(&candidates, 2, 0), Some(1));
    }

    #[test]
    fn cache_aware_spills_to_the_next_best_once_the_holder_runs_ahead() {
        // "b" is three requests ahead of the least loaded: past a slack of 2.
        let candidates = [holding("a", 1, 3), holding("b", 3, 8), holding("c", 0, 0)];
        assert_eq!(cache_aware(&candidates, 2, 0), Some(0));
        assert_eq!(cache_aware(&candidates, 3, 0), Some(1));
        // On two replicas a hot prompt's holder spills too, once it runs ahead.
        let pair = [holding("a", 3, 8), holding("b", 0, 0)];
        assert_eq!(cache_aware(&pair, 2, 0), Some(1));
        // Equal holdings split by load, and equal loads take turns.
        let even = [holding("a", 1, 4), holding("b", 1, 4)];
        let picks: Vec<_> = (0..2).map(|turn| cache_aware(&even, 2, turn)).collect();
        assert_eq!(picks, vec![Some(0), Some(1)]);
        assert_eq!(cache_aware(&[], 2, 0), None);
    }

    #[test]
    fn a_prefix_other_prompts_fork_from_is_copied_to_idle_replicas_without_it() {
        let shared = |id, in_flight, cached_blocks, forks| Candidate {
            forks,
            ..holding(id, in_flight, cached_blocks)
        };
        // "a" holds 20 blocks three held prompts go on from; "b" is idle with none of them,
        // "c" is busy, "d" holds them already.
        let fleet = [
            shared("a", 0, 20, 3),
            holding("b", 0, 0),
            holding("c", 1, 0),
            holding("d", 0, 20),
        ];
        assert_eq!(prefix_copies(&fleet, 0), Some((20, vec![1])));
        // The chosen replica computes the prefix with the prompt itself.
        assert_eq!(prefix_copies(&fleet, 1), None);
        // A run only the prompt's own earlier answer goes on from is its conversation's.
        let own = [shared("a", 0, 20, 1), holding("b", 0, 0)];
        assert_eq!(prefix_copies(&own, 0), None);
        // A short prefix costs little to compute with the prompt.
        let short = [shared("a", 0, 3, 5), holding("b", 0, 0)];
        assert_eq!(prefix_copies(&short, 0), None);
        // A replica still computing a prompt of its own is not idle.
        let mut computing = holding("b", 0, 0);
        computing.prefill_left = 0.5;
        assert_eq!(prefix_copies(&[shared("a", 0, 20, 2), computing], 0), None);
    }

    #[test]
    fn least_load_prefers_the_replica_with_the_shortest_queue() {
        let candidates = [
            with_load("a", 1, 3, 4, 0.1),
            with_load("b", 1, 0, 4, 0.9),
            with_load("c", 2, 2, 4, 0.0),
        ];
        assert_eq!(least_load(&candidates, 0), Some(1));
    }

    #[test]
    fn least_load_counts_its_own_requests_when_the_report_lags() {
        // The report says "b" is idle, but this router has just sent it five requests.
        let candidates = [with_load("a", 1, 0, 1, 0.0), with_load("b", 5, 0, 0, 0.0)];
        assert_eq!(least_load(&candidates, 1), Some(0));
    }

    #[test]
    fn least_load_does_not_count_its_own_finished_requests_from_a_lagging_report() {
        // Both reports counted two of this router's requests, and "a"'s have since finished;
        // "b" also serves another router's three.
        let mut a = with_load("a", 0, 0, 2, 0.0);
        let mut b = with_load("b", 1, 1, 4, 0.0);
        for c in [&mut a, &mut b] {
            c.reported.as_mut().unwrap().own_in_flight = 2;
        }
        assert_eq!((a.outstanding(), b.outstanding()), (0, 4));
        assert_eq!(least_load(&[b, a], 0), Some(1));
    }

    #[test]
    fn least_load_breaks_ties_by_kv_cache_use_then_in_turn() {
        let candidates = [with_load("a", 2, 0, 2, 0.6), with_load("b", 2, 0, 2, 0.2)];
        assert_eq!(least_load(&candidates, 0), Some(1));
        let equal = [idle("a"), idle("b"), idle("c")];
        let picks: Vec<_> = (0..3).map(|r| least_load(&equal, r).unwrap()).collect();
        assert_eq!(picks, [0, 1, 2]);
    }

    #[test]
    fn no_candidates_no_pick() {
        assert_eq!(least_load(&[], 0), None);
        assert_eq!(round_robin(&[], 7), None);
        assert_eq!(bounded_load_consistent_hash(&[], 7, 1.25), None);
    }

    #[test]
    fn round_robin_takes_turns() {
        let candidates = [idle("a"), idle("b"), idle("c")];
        let picks: Vec<_> = (0..6)
            .map(|i| round_robin(&candidates, i).unwrap())
            .collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
    }

    fn key(text: &str) -> u64 {
        let mut h = Fnv1a::default();
        h.write(text.as_bytes());
        mix(h.finish())
    }

    #[test]
    fn the_same_key_goes_to_the_same_replica_in_any_candidate_order() {
        let forward = [idle("pod-a"), idle("pod-b"), idle("pod-c")];
        let backward = [idle("pod-c"), idle("pod-b"), idle("pod-a")];
        for k in 0..50 {
            let key = key(&format!("system prompt {k}"));
            let a = bounded_load_consistent_hash(&forward, key, 1.25).unwrap();
            let b = bounded_load_consistent_hash(&backward, key, 1.25).unwrap();
            assert_eq!(forward[a].id, backward[b].id);
        }
    }

    #[test]
    fn keys_spread_over_idle_replicas() {
        let candidates = [idle("pod-a"), idle("pod-b"), idle("pod-c")];
        let mut counts = [0; 3];
        for k in 0..3000 {
            counts
                [bounded_load_consistent_hash(&candidates, key(&k.to_string()), 1.25).unwrap()] +=
                1;
        }
        for count in counts {
            assert!((700..=1300).contains(&count), "uneven spread {counts:?}");
        }
    }

    #[test]
    fn a_removed_replica_moves_only_its_own_keys() {
        let three = [idle("pod-a"), idle("pod-b"), idle("pod-c")];
        let two = [idle("pod-a"), idle("pod-c")];
        for k in 0..500 {
            let key = key(&k.to_string());
            let before = &three[bounded_load_consistent_hash(&three, key, 1.25).unwrap()].id;
            let after = &two[bounded_load_consistent_hash(&two, key, 1.25).unwrap()].id;
            if before != "pod-b" {
                assert_eq!(before, after, "key {k} moved although its replica stayed");
            }
        }
    }

    #[test]
    fn a_hot_key_spills_once_its_replica_reaches_the_bound() {
        let key = key("one very popular system prompt");
        let idle_fleet = [idle("pod-a"), idle("pod-b"), idle("pod-c")];
        let home = bounded_load_consistent_hash(&idle_fleet, key, 1.25).unwrap();
        // Send the hot key's requests one at a time, counting each on the replica it lands
        // on; no replica may ever pass ceil(1.25 × mean).
        let mut fleet = idle_fleet.clone();
        let mut landed = [0u32; 3];
        for sent in 1..=30u32 {
            let pick = bounded_load_consistent_hash(&fleet, key, 1.25).unwrap();
            fleet[pick].in_flight += 1;
            landed[pick] += 1;
            let bound = (1.25 * f64::from(sent) / 3.0).ceil() as u32;
            assert!(
                fleet.iter().all(|c| c.in_flight <= bound.max(1)),
                "after {sent}: {landed:?} over bound {bound}"
            );
        }
        assert!(landed[home] >= landed.iter().copied().max().unwrap());
        assert!(landed.iter().all(|&n| n > 0), "no spill: {landed:?}");
    }

    #[test]
    fn the_bound_uses_reported_load_from_other_routers() {
        let key = key("shared prompt");
        let idle_fleet = [idle("pod-a"), idle("pod-b")];
        let home = bounded_load_consistent_hash(&idle_fleet, key, 1.25).unwrap();
        let mut busy = idle_fleet.clone();
        busy[home].reported = Some(ReportedLoad::new(6, 4, 0.5));
        assert_eq!(
            bounded_load_consistent_hash(&busy, key, 1.25),
            Some(1 - home)
        );
    }

    #[test]
    fn fnv1a_matches_the_reference_values() {
        let hash = |s: &str| {
            let mut h = Fnv1a::default();
            h.write(s.as_bytes());
            h.finish()
        };
        assert_eq!(hash(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(hash("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(hash("foobar"), 0x8594_4171_f739_67e8);
    }
}

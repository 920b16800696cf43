//! Flow control for an InferenceService with `spec.routing.flowControl`: which key a request
//! comes from, its priority, the key's rate limits, and the queue requests wait in while every
//! replica has `maxConcurrencyPerReplica` requests of this router outstanding.
//!
//! The queue serves the highest priority first; within a priority, the key that has been
//! served the fewest tokens (prompt and requested output) goes next, and a key's requests go
//! in the order they came. A key that starts waiting is lifted to the least count of the keys
//! already waiting, so idle time is not banked into a burst that shuts the others out (the
//! virtual token counter of Sheng et al., "Fairness in Serving Large Language Models").
//! Everything here is plain data and decisions; [`crate::route`] does the waiting.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Mutex;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use npufleet_crds::{FlowControl, KeyPolicy};
use sha2::{Digest, Sha256};
use tokio::sync::Notify;

/// The name of requests whose API key is not listed (or that carry none).
pub const DEFAULT_KEY: &str = "default";

/// An InferenceService's flow control, as the router applies it.
#[derive(Clone, Debug, PartialEq)]
pub struct FlowConfig {
    /// Requests this router sends one replica at once.
    pub max_concurrency_per_replica: u32,
    /// Requests that may wait in one priority band.
    pub max_queued: usize,
    /// How long a request may wait in the queue.
    pub queue_ttl: Duration,
    /// Places per replica that only [`FlowConfig::top_priority`] may take.
    reserved_per_replica: u32,
    /// The highest priority of the default and the listed keys.
    top_priority: i32,
    default: KeyPolicy,
    /// Listed keys by the SHA-256 of the key: their name and policy.
    keys: HashMap<[u8; 32], (String, KeyPolicy)>,
}

/// Who a request comes from, as flow control sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Admission {
    /// The key's name ([`DEFAULT_KEY`] when unlisted).
    pub key: String,
    pub priority: i32,
    /// What the request is charged: its prompt and requested output tokens.
    pub tokens: u32,
    pub policy: KeyPolicy,
}

impl FlowConfig {
    /// The flow control of a service; `default_concurrency` stands in for an unset
    /// `maxConcurrencyPerReplica`.
    pub fn from_spec(spec: &FlowControl, default_concurrency: u32) -> Result<Self, String> {
        let mut keys = HashMap::new();
        for key in &spec.keys {
            let digest = decode_sha256(&key.api_key_sha256)
                .ok_or_else(|| format!("key {:?}: apiKeySha256 is not 64 hex digits", key.name))?;
            keys.insert(digest, (key.name.clone(), key.policy.clone()));
        }
        let top_priority = spec
            .keys
            .iter()
            .map(|k| k.policy.priority)
            .fold(spec.default.priority, i32::max);
        Ok(FlowConfig {
            reserved_per_replica: spec.reserved_per_replica,
            top_priority,
            max_concurrency_per_replica: spec
                .max_concurrency_per_replica
                .unwrap_or(default_concurrency)
                .max(1),
            max_queued: spec.max_queued.max(1) as usize,
            queue_ttl: spec.queue_ttl()?,
            default: spec.default.clone(),
            keys,
        })
    }

    /// The places on one replica a request of `priority` may take: all of them for the top
    /// priority, the unreserved ones (at least one) for the others.
    pub fn places(&self, priority: i32) -> u32 {
        if priority >= self.top_priority {
            self.max_concurrency_per_replica
        } else {
            self.max_concurrency_per_replica
                .saturating_sub(self.reserved_per_replica)
                .max(1)
        }
    }

    /// The request's key, from the SHA-256 of the API key it presents ([`key_sha256`]), and
    /// its priority: the key's, or the lower one the request asked for.
    pub fn admit(
        &self,
        key_sha256: Option<&[u8; 32]>,
        asked: Option<i32>,
        tokens: u32,
    ) -> Admission {
        let listed = key_sha256.and_then(|digest| self.keys.get(digest));
        let (key, policy) = match listed {
            Some((name, policy)) => (name.clone(), policy.clone()),
            None => (DEFAULT_KEY.to_owned(), self.default.clone()),
        };
        let priority = asked.map_or(policy.priority, |asked| asked.min(policy.priority));
        Admission {
            key,
            priority,
            tokens,
            policy,
        }
    }
}

/// The SHA-256 of the key in an `Authorization: Bearer <key>` value.
pub fn key_sha256(authorization: &[u8]) -> Option<[u8; 32]> {
    let (scheme, key) = authorization.split_at_checked(7)?;
    (scheme.eq_ignore_ascii_case(b"bearer ") && !key.is_empty()).then(|| Sha256::digest(key).into())
}

fn decode_sha256(hex: &str) -> Option<[u8; 32]> {
    let bytes = hex.as_bytes();
    if bytes.len() != 64 {
        return None;
    }
    let mut digest = [0u8; 32];
    for (i, pair) in bytes.chunks(2).enumerate() {
        let text = std::str::from_utf8(pair).ok()?;
        digest[i] = u8::from_str_radix(text, 16).ok()?;
    }
    Some(digest)
}

/// Which of a key's limits refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    RequestsPerMinute,
    TokensPerMinute,
}

impl Limit {
    pub fn as_str(self) -> &'static str {
        match self {
            Limit::RequestsPerMinute => "requestsPerMinute",
            Limit::TokensPerMinute => "tokensPerMinute",
        }
    }
}

/// A refusal by a key's limit, and when the request would pass (`None`: never, it asks more
/// tokens than a minute's budget).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limited {
    pub limit: Limit,
    pub retry_after: Option<Duration>,
}

/// One key's rate limiters, built for the limits they enforce.
struct Limiters {
    policy: (Option<u32>, Option<u32>),
    requests: Option<DefaultDirectRateLimiter>,
    tokens: Option<DefaultDirectRateLimiter>,
}

impl std::fmt::Debug for Limiters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiters")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl Limiters {
    fn new(policy: &KeyPolicy) -> Self {
        let per_minute = |n: Option<u32>| {
            n.and_then(NonZeroU32::new)
                .map(|n| RateLimiter::direct(Quota::per_minute(n)))
        };
        Limiters {
            policy: (policy.requests_per_minute, policy.tokens_per_minute),
            requests: per_minute(policy.requests_per_minute),
            tokens: per_minute(policy.tokens_per_minute),
        }
    }

    fn check(&self, tokens: u32) -> Result<(), Limited> {
        let clock = DefaultClock::default();
        if let Some(requests) = &self.requests
            && let Err(not_until) = requests.check()
        {
            return Err(Limited {
                limit: Limit::RequestsPerMinute,
                retry_after: Some(not_until.wait_time_from(clock.now())),
            });
        }
        if let (Some(limiter), Some(n)) = (&self.tokens, NonZeroU32::new(tokens)) {
            let refused = |retry_after| Limited {
                limit: Limit::TokensPerMinute,
                retry_after,
            };
            match limiter.check_n(n) {
                Ok(Ok(())) => {}
                Ok(Err(not_until)) => {
                    return Err(refused(Some(not_until.wait_time_from(clock.now()))));
                }
                Err(_) => return Err(refused(None)),
            }
        }
        Ok(())
    }
}

/// A request waiting in the queue.
#[derive(Clone, Debug, PartialEq)]
struct Waiter {
    ticket: u64,
    priority: i32,
    key: String,
    tokens: u32,
}

/// A band of the queue is full.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueFull;

/// The queue of one model and its keys' counters: plain data, decided under [`Flow`]'s lock.
#[derive(Default, Debug)]
pub struct Queue {
    next_ticket: u64,
    waiting: Vec<Waiter>,
    /// Tokens served per key: the fairness counter.
    served: HashMap<String, u64>,
    limiters: HashMap<String, Limiters>,
}

impl Queue {
    /// Charges the request to its key's rate limits.
    pub fn charge(&mut self, admission: &Admission) -> Result<(), Limited> {
        let policy = &admission.policy;
        let wanted = (policy.requests_per_minute, policy.tokens_per_minute);
        if wanted == (None, None) {
            self.limiters.remove(&admission.key);
            return Ok(());
        }
        let limiters = self
            .limiters
            .entry(admission.key.clone())
            .or_insert_with(|| Limiters::new(policy));
        if limiters.policy != wanted {
            *limiters = Limiters::new(policy);
        }
        limiters.check(admission.tokens)
    }

    /// Whether any request waits.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Requests waiting at `priority`.
    pub fn queued(&self, priority: i32) -> usize {
        self.waiting
            .iter()
            .filter(|w| w.priority == priority)
            .count()
    }

    /// Puts the request in its band; its ticket, or [`QueueFull`].
    pub fn enqueue(&mut self, admission: &Admission, max_queued: usize) -> Result<u64, QueueFull> {
        if self.queued(admission.priority) >= max_queued {
            return Err(QueueFull);
        }
        let key = &admission.key;
        let band = |w: &&Waiter| w.priority == admission.priority;
        if !self.waiting.iter().filter(band).any(|w| &w.key == key) {
            let floor = self
                .waiting
                .iter()
                .filter(band)
                .map(|w| self.served.get(&w.key).copied().unwrap_or(0))
                .min();
            if let Some(floor) = floor {
                let served = self.served.entry(key.clone()).or_default();
                *served = (*served).max(floor);
            }
        }
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.waiting.push(Waiter {
            ticket,
            priority: admission.priority,
            key: key.clone(),
            tokens: admission.tokens,
        });
        Ok(ticket)
    }

    /// The request to send next: the highest band's least served key's oldest request.
    pub fn head(&self) -> Option<u64> {
        let top = self.waiting.iter().map(|w| w.priority).max()?;
        let served = |w: &Waiter| self.served.get(&w.key).copied().unwrap_or(0);
        self.waiting
            .iter()
            .filter(|w| w.priority == top)
            .min_by_key(|w| (served(w), w.ticket))
            .map(|w| w.ticket)
    }

    /// The request left the queue for a replica: its key is charged its tokens.
    pub fn dispatched(&mut self, ticket: u64) {
        if let Some(waiter) = self.remove(ticket) {
            *self.served.entry(waiter.key).or_default() += u64::from(waiter.tokens);
        }
    }

    /// The request left the queue without a replica (timed out, cancelled).
    pub fn leave(&mut self, ticket: u64) {
        self.remove(ticket);
    }

    fn remove(&mut self, ticket: u64) -> Option<Waiter> {
        let at = self.waiting.iter().position(|w| w.ticket == ticket)?;
        Some(self.waiting.remove(at))
    }

    /// The tokens served to `key` so far.
    #[cfg(test)]
    fn served(&self, key: &str) -> u64 {
        self.served.get(key).copied().unwrap_or(0)
    }
}

/// One model's queue, and the signal that a slot may have freed or the head changed.
#[derive(Default, Debug)]
pub struct Flow {
    pub queue: Mutex<Queue>,
    pub changed: Notify,
}

impl Flow {
    /// Wakes the waiting requests to look again.
    pub fn wake_all(&self) {
        self.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use npufleet_crds::FlowKey;

    const GOLD_KEY: &str = "gold-secret";
    /// `printf %s gold-secret | sha256sum`
    const GOLD_SHA256: &str = "1ada8a8b1137fbec532fa0d1c86a850b9c2ab5fdcf7b9ee1512f578cae4f5af4";

    fn config(keys: Vec<FlowKey>) -> FlowConfig {
        FlowConfig::from_spec(
            &FlowControl {
                max_concurrency_per_replica: Some(2),
                reserved_per_replica: 1,
                max_queued: 2,
                queue_ttl: "5s".into(),
                default: KeyPolicy::default(),
                keys,
            },
            8,
        )
        .unwrap()
    }

    fn gold() -> FlowKey {
        FlowKey {
            name: "gold".into(),
            api_key_sha256: GOLD_SHA256.into(),
            policy: KeyPolicy {
                priority: 10,
                ..KeyPolicy::default()
            },
        }
    }

    fn admission(key: &str, priority: i32, tokens: u32) -> Admission {
        Admission {
            key: key.into(),
            priority,
            tokens,
            policy: KeyPolicy::default(),
        }
    }

    #[test]
    fn a_listed_key_is_known_by_its_digest_and_caps_the_asked_priority() {
        let config = config(vec![gold()]);
        let presented = key_sha256(format!("Bearer {GOLD_KEY}").as_bytes());
        let gold = config.admit(presented.as_ref(), None, 5);
        assert_eq!(
            (gold.key.as_str(), gold.priority, gold.tokens),
            ("gold", 10, 5)
        );
        let lowered = config.admit(key_sha256(b"bearer gold-secret").as_ref(), Some(3), 5);
        assert_eq!(lowered.priority, 3, "a request may lower its priority");
        let raised = config.admit(presented.as_ref(), Some(99), 5);
        assert_eq!(raised.priority, 10, "but not raise it above its key's");
        for other in [&b"Bearer other"[..], b"gold-secret", b"Bearer "] {
            let admitted = config.admit(key_sha256(other).as_ref(), Some(99), 5);
            assert_eq!(
                (admitted.key.as_str(), admitted.priority),
                (DEFAULT_KEY, 0),
                "{other:?}"
            );
        }
        assert_eq!(config.admit(None, Some(-3), 5).priority, -3);
        assert_eq!(config.places(10), 2, "the top priority takes every place");
        assert_eq!(config.places(0), 1, "the others leave the reserved one");
    }

    #[test]
    fn a_malformed_digest_is_named() {
        let mut key = gold();
        key.api_key_sha256 = "zz".into();
        let error = FlowControl {
            max_concurrency_per_replica: None,
            reserved_per_replica: 0,
            max_queued: 1,
            queue_ttl: "1s".into(),
            default: KeyPolicy::default(),
            keys: vec![key],
        };
        assert!(
            FlowConfig::from_spec(&error, 8)
                .unwrap_err()
                .contains("gold")
        );
    }

    #[test]
    fn the_highest_band_goes_first_then_the_least_served_key() {
        let mut queue = Queue::default();
        let low = queue.enqueue(&admission("bulk", 0, 100), 10).unwrap();
        let low2 = queue.enqueue(&admission("bulk", 0, 100), 10).unwrap();
        let other = queue.enqueue(&admission("chat", 0, 10), 10).unwrap();
        let high = queue.enqueue(&admission("gold", 5, 10), 10).unwrap();
        assert_eq!(queue.head(), Some(high));
        queue.dispatched(high);
        assert_eq!(queue.head(), Some(low), "equal counters: the oldest");
        queue.dispatched(low);
        assert_eq!(queue.served("bulk"), 100);
        assert_eq!(queue.head(), Some(other), "bulk was served more than chat");
        queue.dispatched(other);
        assert_eq!(queue.head(), Some(low2));
        queue.leave(low2);
        assert_eq!(queue.head(), None);
        assert!(queue.is_empty());
    }

    #[test]
    fn a_key_that_was_idle_does_not_bank_its_credit() {
        let mut queue = Queue::default();
        for _ in 0..3 {
            let t = queue.enqueue(&admission("bulk", 0, 100), 10).unwrap();
            queue.dispatched(t);
        }
        let bulk = queue.enqueue(&admission("bulk", 0, 100), 10).unwrap();
        // chat never waited: it starts at bulk's count, not at zero, so bulk still has its
        // turn by age.
        let chat = queue.enqueue(&admission("chat", 0, 100), 10).unwrap();
        assert_eq!(queue.served("chat"), 300);
        assert_eq!(queue.head(), Some(bulk));
        queue.dispatched(bulk);
        assert_eq!(queue.head(), Some(chat));
    }

    #[test]
    fn each_band_is_bounded_on_its_own() {
        let mut queue = Queue::default();
        queue.enqueue(&admission("a", 0, 1), 2).unwrap();
        queue.enqueue(&admission("b", 0, 1), 2).unwrap();
        assert_eq!(queue.enqueue(&admission("c", 0, 1), 2), Err(QueueFull));
        assert!(queue.enqueue(&admission("c", 1, 1), 2).is_ok());
    }

    #[test]
    fn rate_limits_refuse_with_a_time_to_retry() {
        let mut queue = Queue::default();
        let mut limited = admission("bulk", 0, 40);
        limited.policy.requests_per_minute = Some(2);
        limited.policy.tokens_per_minute = Some(100);
        assert!(queue.charge(&limited).is_ok());
        assert!(queue.charge(&limited).is_ok());
        let refused = queue.charge(&limited).unwrap_err();
        assert_eq!(refused.limit, Limit::RequestsPerMinute);
        let wait = refused.retry_after.unwrap();
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_secs(30),
            "{wait:?}"
        );

        // A changed policy starts afresh; the token budget refuses what it cannot hold.
        limited.policy.requests_per_minute = Some(100);
        assert!(queue.charge(&limited).is_ok());
        assert!(queue.charge(&limited).is_ok());
        let refused = queue.charge(&limited).unwrap_err();
        assert_eq!(refused.limit, Limit::TokensPerMinute);
        assert!(refused.retry_after.is_some());
        limited.tokens = 101;
        let never = queue.charge(&limited).unwrap_err();
        assert_eq!(
            never.retry_after, None,
            "more than a minute's tokens never pass"
        );

        // Another key has its own budget; a key without limits is never refused.
        assert!(queue.charge(&admission("chat", 0, 10_000)).is_ok());
    }
}

//! The router's Prometheus metrics, served on its HTTP port at `/metrics`.

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Replica label for answers the router gave itself (unknown model, hold timed out, ...).
pub const NO_REPLICA: &str = "";

#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// Requests answered, by model, replica (pod) and HTTP status or gRPC code name.
    pub requests: IntCounterVec,
    /// Attempts sent to another replica after one failed before its first byte, by reason.
    pub retries: IntCounterVec,
    /// Requests whose last attempt was refused with no retry left (budget spent or every
    /// replica tried), by the last refusal's reason.
    pub retries_exhausted: IntCounterVec,
    /// Requests waiting for a model's first ready replica now.
    pub held: IntGaugeVec,
    /// How long held requests waited, by how the wait ended (`replica`, `timeout`, `gone`).
    pub hold_seconds: HistogramVec,
    /// Held requests turned away because the model's hold queue was full.
    pub hold_rejected: IntCounterVec,
    /// Wake-up signals written to InferenceServices at zero replicas.
    pub wake_signals: IntCounterVec,
    /// Replica picks by model and policy.
    pub picks: IntCounterVec,
    /// Requests sent to each replica and not yet finished: what least-load counts.
    pub in_flight: IntGaugeVec,
    /// From sending a request upstream to its first response byte (HTTP) or message (gRPC).
    pub upstream_ttft_seconds: HistogramVec,
    /// Full token blocks of cache-aware routed prompts, by whether the chosen replica's
    /// cache held them (`cached`: `true` or `false`).
    pub prompt_blocks: IntCounterVec,
    /// Shared prefixes the router had idle replicas compute, by outcome (`done`, `failed`).
    pub prefix_copies: IntCounterVec,
    /// Requests waiting in a model's flow-control queue, by priority.
    pub flow_queued: IntGaugeVec,
    /// How long requests waited in the flow-control queue, by outcome (`replica`, `timeout`,
    /// `cancelled`).
    pub flow_wait_seconds: HistogramVec,
    /// Requests flow control refused, by model, API key name and reason (`queue_full`,
    /// `queue_timeout`, `requestsPerMinute`, `tokensPerMinute`).
    pub flow_rejected: IntCounterVec,
}

impl Metrics {
    pub fn new() -> prometheus::Result<Self> {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                "npufleet_router_requests_total",
                "Requests answered, by model, replica and status code",
            ),
            &["model", "replica", "code"],
        )?;
        let retries = IntCounterVec::new(
            Opts::new(
                "npufleet_router_retries_total",
                "Requests sent to another replica after a failure before the first byte",
            ),
            &["model", "reason"],
        )?;
        let retries_exhausted = IntCounterVec::new(
            Opts::new(
                "npufleet_router_retries_exhausted_total",
                "Requests refused by every replica they could be sent to, by the last reason",
            ),
            &["model", "reason"],
        )?;
        let held = IntGaugeVec::new(
            Opts::new(
                "npufleet_router_held_requests",
                "Requests waiting for the model's first ready replica",
            ),
            &["model"],
        )?;
        let hold_seconds = HistogramVec::new(
            HistogramOpts::new(
                "npufleet_router_hold_seconds",
                "Time requests were held waiting for a ready replica, by outcome",
            )
            .buckets(vec![
                0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
            ]),
            &["model", "outcome"],
        )?;
        let hold_rejected = IntCounterVec::new(
            Opts::new(
                "npufleet_router_hold_rejected_total",
                "Requests turned away because the model's hold queue was full",
            ),
            &["model"],
        )?;
        let wake_signals = IntCounterVec::new(
            Opts::new(
                "npufleet_router_wake_signals_total",
                "Wake-up requests written to InferenceServices scaled to zero",
            ),
            &["model"],
        )?;
        let picks = IntCounterVec::new(
            Opts::new(
                "npufleet_router_picks_total",
                "Replica picks, by model and routing policy",
            ),
            &["model", "policy"],
        )?;
        let in_flight = IntGaugeVec::new(
            Opts::new(
                "npufleet_router_in_flight_requests",
                "Requests sent to a replica and not yet finished, by model and replica",
            ),
            &["model", "replica"],
        )?;
        let upstream_ttft_seconds = HistogramVec::new(
            HistogramOpts::new(
                "npufleet_router_upstream_ttft_seconds",
                "Time from sending a request to a replica to its first response byte or message",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            ]),
            &["model"],
        )?;
        let prompt_blocks = IntCounterVec::new(
            Opts::new(
                "npufleet_router_prompt_blocks_total",
                "Full token blocks of cache-aware routed prompts, by whether the chosen replica held them",
            ),
            &["model", "cached"],
        )?;
        let prefix_copies = IntCounterVec::new(
            Opts::new(
                "npufleet_router_prefix_copies_total",
                "Shared prompt prefixes the router had idle replicas compute, by outcome",
            ),
            &["model", "outcome"],
        )?;
        let flow_queued = IntGaugeVec::new(
            Opts::new(
                "npufleet_router_flow_queued_requests",
                "Requests waiting in the model's flow-control queue for a replica with room, by priority",
            ),
            &["model", "priority"],
        )?;
        let flow_wait_seconds = HistogramVec::new(
            HistogramOpts::new(
                "npufleet_router_flow_wait_seconds",
                "Time requests waited in the flow-control queue, by outcome",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
            ]),
            &["model", "outcome"],
        )?;
        let flow_rejected = IntCounterVec::new(
            Opts::new(
                "npufleet_router_flow_rejected_total",
                "Requests flow control answered 429, by model, API key name and reason",
            ),
            &["model", "key", "reason"],
        )?;
        registry.register(Box::new(flow_queued.clone()))?;
        registry.register(Box::new(flow_wait_seconds.clone()))?;
        registry.register(Box::new(flow_rejected.clone()))?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(prompt_blocks.clone()))?;
        registry.register(Box::new(prefix_copies.clone()))?;
        registry.register(Box::new(retries.clone()))?;
        registry.register(Box::new(retries_exhausted.clone()))?;
        registry.register(Box::new(held.clone()))?;
        registry.register(Box::new(hold_seconds.clone()))?;
        registry.register(Box::new(hold_rejected.clone()))?;
        registry.register(Box::new(wake_signals.clone()))?;
        registry.register(Box::new(picks.clone()))?;
        registry.register(Box::new(in_flight.clone()))?;
        registry.register(Box::new(upstream_ttft_seconds.clone()))?;
        Ok(Metrics {
            registry,
            requests,
            retries,
            retries_exhausted,
            held,
            hold_seconds,
            hold_rejected,
            wake_signals,
            picks,
            in_flight,
            upstream_ttft_seconds,
            prompt_blocks,
            prefix_copies,
            flow_queued,
            flow_wait_seconds,
            flow_rejected,
        })
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("the text encoder writes to memory");
        String::from_utf8(out).expect("the text format is UTF-8")
    }
}

//! From a model name to a leased replica: the lookup, the pick, flow control (a key's rate
//! limits, and the queue a request waits in while every replica of a model with
//! `spec.routing.flowControl` has its fill), and, when the model has no ready replica, the
//! bounded hold that wakes a fleet scaled to zero and waits for it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use npufleet_contract::annotations::WAKE_REQUESTED_AT;
use npufleet_contract::auth::AUTHORIZATION;
use npufleet_crds::{InferenceService, RoutingPolicy};
use serde_json::json;

use crate::discovery::{Discovery, Model};
use crate::error::RouteError;
use crate::flow::{Admission, Flow, FlowConfig, Limit, QueueFull};
use crate::metrics::Metrics;
use crate::pool::{Lease, PickSettings, Pool, PrefixCopy};
use crate::prompt::{Affinity, ExactPrompt, PrefixBlocks, Prompt, Recipes, TokenBlocks};
use crate::request::RoutedRequest;
use crate::retry::RetryPolicy;

/// How long a prefix copy may take before the router lets the replica's place go.
const PREFIX_COPY_TIMEOUT: Duration = Duration::from_secs(60);

/// The field manager of the router's writes (only the wake-up annotation).
pub const FIELD_MANAGER: &str = "npufleet-router";

#[derive(Clone, Debug)]
pub struct Settings {
    /// When a request is tried again on another replica.
    pub retry: RetryPolicy,
    /// Requests per model that may wait for a ready replica at once.
    pub hold_queue: usize,
    /// How long a request waits for a ready replica before it is answered 503.
    pub hold_timeout: Duration,
    /// The `Retry-After` of a 429 when a model's hold queue is full.
    pub hold_retry_after: Duration,
    /// The least time between two wake-up signals for one InferenceService: concurrent held
    /// requests share one, and a long wait renews it.
    pub wake_interval: Duration,
    pub pick: PickSettings,
    pub prefix: PrefixBlocks,
    pub max_body_bytes: usize,
}

pub struct Router {
    pub settings: Settings,
    pub discovery: Discovery,
    pub pool: Arc<Pool>,
    pub metrics: Metrics,
    pub recipes: Arc<Recipes>,
    client: Client,
    /// For the requests the router makes of replicas itself (prefix copies).
    upstream: reqwest::Client,
    held: Mutex<HashMap<String, usize>>,
    last_wake: Mutex<HashMap<(String, String), Instant>>,
    /// Each flow-controlled model's queue and its keys' counters and limits.
    flows: Mutex<HashMap<String, Arc<Flow>>>,
}

/// A place in a model's hold queue, given back on drop.
struct HoldSlot<'a> {
    router: &'a Router,
    model: String,
}

impl Drop for HoldSlot<'_> {
    fn drop(&mut self) {
        let mut held = self.router.held.lock().expect("hold lock");
        if let Some(count) = held.get_mut(&self.model) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.model);
            }
        }
        self.router
            .metrics
            .held
            .with_label_values(&[&self.model])
            .dec();
    }
}

/// A request's place in a flow-control queue: it leaves the queue when dropped, and the
/// others look again (the head may have changed).
struct Waiting<'a> {
    router: &'a Router,
    model: &'a str,
    flow: &'a Flow,
    ticket: u64,
    priority: String,
    started: Instant,
    /// How the wait ended, for the metrics: `replica`, `timeout`, else `cancelled`.
    outcome: &'static str,
}

impl<'a> Waiting<'a> {
    fn new(router: &'a Router, model: &'a str, flow: &'a Flow, ticket: u64, priority: i32) -> Self {
        let priority = priority.to_string();
        router
            .metrics
            .flow_queued
            .with_label_values(&[model, &priority])
            .inc();
        Waiting {
            router,
            model,
            flow,
            ticket,
            priority,
            started: Instant::now(),
            outcome: "cancelled",
        }
    }

    /// The request leaves the queue for a replica; its key is charged its tokens.
    fn dispatched(&mut self) {
        self.flow
            .queue
            .lock()
            .expect("flow lock")
            .dispatched(self.ticket);
        self.outcome = "replica";
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        // A no-op once dispatched.
        self.flow
            .queue
            .lock()
            .expect("flow lock")
            .leave(self.ticket);
        self.flow.wake_all();
        let metrics = &self.router.metrics;
        metrics
            .flow_queued
            .with_label_values(&[self.model, &self.priority])
            .dec();
        metrics
            .flow_wait_seconds
            .with_label_values(&[self.model, self.outcome])
            .observe(self.started.elapsed().as_secs_f64());
    }
}

impl Router {
    pub fn new(
        settings: Settings,
        discovery: Discovery,
        pool: Arc<Pool>,
        metrics: Metrics,
        recipes: Arc<Recipes>,
        client: Client,
        upstream: reqwest::Client,
    ) -> Self {
        Router {
            settings,
            discovery,
            pool,
            metrics,
            recipes,
            client,
            upstream,
            held: Mutex::default(),
            last_wake: Mutex::default(),
            flows: Mutex::default(),
        }
    }

    /// The model's current view, or 404 naming it.
    pub fn model(&self, name: &str) -> Result<Model, RouteError> {
        self.discovery
            .fleet
            .borrow()
            .models
            .get(name)
            .cloned()
            .ok_or_else(|| RouteError::ModelNotFound(name.to_owned()))
    }

    /// Where `prompt` would like to go among `model_name`'s replicas. With the cache-aware
    /// policy, an engine that publishes its cache events and its tokenisation known: the
    /// names of the prompt's token blocks. Otherwise, with cache-aware or prefix-affinity, the
    /// approximate key of its leading bytes, cut at the workers' cache block size; none for
    /// an unknown model or before any replica published its block size (placed by load).
    pub fn affinity(&self, model_name: &str, prompt: &Prompt) -> Affinity {
        let Ok(model) = self.model(model_name) else {
            return Affinity::None;
        };
        if !matches!(
            model.policy,
            RoutingPolicy::CacheAware | RoutingPolicy::PrefixAffinity
        ) {
            return Affinity::None;
        }
        if model.routes_on_cached_blocks()
            && let Some(blocks) = self.token_blocks(model_name, &model, prompt)
        {
            return Affinity::Blocks(blocks);
        }
        self.pool
            .block_size(&model)
            .and_then(|block_tokens| self.settings.prefix.key(&prompt.flat, block_tokens))
            .map_or(Affinity::None, Affinity::Key)
    }

    /// The prompt's block names as the model's workers name them, when its tokenisation is
    /// known (the first request of a model starts fetching it and goes without).
    fn token_blocks(
        &self,
        model_name: &str,
        model: &Model,
        prompt: &Prompt,
    ) -> Option<TokenBlocks> {
        let exact = prompt.exact.as_ref()?;
        let tokenizer = self.recipes.get(model_name, model.first_http_address())?;
        let tokens = match exact {
            ExactPrompt::Text(text) => tokenizer.text_tokens(text),
            ExactPrompt::Chat(messages) => tokenizer.chat_tokens(messages),
        };
        match tokens {
            Ok(tokens) => Some(TokenBlocks::new(tokens, tokenizer.block_size())),
            Err(error) => {
                tracing::debug!(model = model_name, %error, "prompt not tokenised; placing it by its bytes");
                None
            }
        }
    }

    /// A replica of the request's model for one attempt, skipping the pods in `tried`. Under
    /// flow control the first attempt is charged to its key's limits, and an attempt that
    /// finds every replica full (or others already waiting) waits in the queue. With nothing
    /// tried yet and no replica ready, holds the request until one is (or the hold ends); with
    /// every replica tried, fails at once, as retrying the same replicas would.
    pub async fn lease(
        &self,
        request: &RoutedRequest,
        tried: &[String],
    ) -> Result<Lease, RouteError> {
        let model_name = request.model.as_str();
        let model = self.model(model_name)?;
        let flow = match &model.flow {
            Some(config) => {
                let admission = config.admit(
                    request.caller.key_sha256.as_ref(),
                    request.caller.priority,
                    request.tokens,
                );
                let flow = self.flow(model_name);
                if tried.is_empty() {
                    self.charge(model_name, &flow, &admission)?;
                }
                Some((config.clone(), flow, admission))
            }
            None => None,
        };
        let others_wait = flow
            .as_ref()
            .is_some_and(|(_, flow, _)| !flow.queue.lock().expect("flow lock").is_empty());
        let priority = flow.as_ref().map(|(_, _, admission)| admission.priority);
        if !others_wait && let Some(lease) = self.pick(request, &model, tried, priority) {
            return Ok(lease);
        }
        let untried = model.endpoints.iter().any(|e| !tried.contains(&e.pod));
        if let Some((config, flow, admission)) = &flow
            && untried
        {
            return self
                .queue(model_name, request, tried, config, flow, admission)
                .await;
        }
        if !tried.is_empty() {
            return Err(RouteError::ReplicasFailed {
                model: model_name.to_owned(),
                last: "no replica left to try".to_owned(),
            });
        }
        self.hold(request, model, priority).await
    }

    fn flow(&self, model_name: &str) -> Arc<Flow> {
        self.flows
            .lock()
            .expect("flows lock")
            .entry(model_name.to_owned())
            .or_default()
            .clone()
    }

    /// Charges a request to its key's rate limits; a refusal is counted and names the limit.
    fn charge(
        &self,
        model_name: &str,
        flow: &Flow,
        admission: &Admission,
    ) -> Result<(), RouteError> {
        let limited = flow.queue.lock().expect("flow lock").charge(admission);
        let Err(limited) = limited else { return Ok(()) };
        self.metrics
            .flow_rejected
            .with_label_values(&[model_name, &admission.key, limited.limit.as_str()])
            .inc();
        let (model, key) = (model_name.to_owned(), admission.key.clone());
        Err(match (limited.limit, limited.retry_after) {
            (limit, Some(retry_after)) => RouteError::RateLimited {
                model,
                key,
                limit: limit.as_str(),
                retry_after,
            },
            (Limit::TokensPerMinute | Limit::RequestsPerMinute, None) => {
                RouteError::OverTokenBudget {
                    model,
                    key,
                    tokens: admission.tokens,
                    per_minute: admission.policy.tokens_per_minute.unwrap_or(0),
                }
            }
        })
    }

    /// Waits in the model's flow-control queue until the request is at its head and a replica
    /// has room, or its time to live ends.
    async fn queue(
        &self,
        model_name: &str,
        request: &RoutedRequest,
        tried: &[String],
        config: &FlowConfig,
        flow: &Arc<Flow>,
        admission: &Admission,
    ) -> Result<Lease, RouteError> {
        let enqueued = flow
            .queue
            .lock()
            .expect("flow lock")
            .enqueue(admission, config.max_queued);
        let ticket = enqueued.map_err(|QueueFull| {
            self.metrics
                .flow_rejected
                .with_label_values(&[model_name, &admission.key, "queue_full"])
                .inc();
            RouteError::FlowQueueFull {
                model: model_name.to_owned(),
                priority: admission.priority,
                limit: config.max_queued,
            }
        })?;
        let mut waiting = Waiting::new(self, model_name, flow, ticket, admission.priority);
        let deadline = tokio::time::Instant::now() + config.queue_ttl;
        let mut fleet = self.discovery.fleet.clone();
        loop {
            let notified = flow.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            fleet.borrow_and_update();
            let model = self.model(model_name)?;
            let head = flow.queue.lock().expect("flow lock").head();
            if head == Some(ticket)
                && let Some(lease) = self.pick(request, &model, tried, Some(admission.priority))
            {
                waiting.dispatched();
                return Ok(lease);
            }
            tokio::select! {
                () = &mut notified => {}
                changed = fleet.changed() => {
                    if changed.is_err() {
                        return Err(RouteError::ModelNotFound(model_name.to_owned()));
                    }
                }
                () = tokio::time::sleep_until(deadline) => {
                    waiting.outcome = "timeout";
                    self.metrics
                        .flow_rejected
                        .with_label_values(&[model_name, &admission.key, "queue_timeout"])
                        .inc();
                    return Err(RouteError::FlowQueueTimedOut {
                        model: model_name.to_owned(),
                        waited: config.queue_ttl,
                    });
                }
            }
        }
    }

    /// A replica for a request admitted at `priority` (none without flow control). The
    /// model's flow control as it is now, changed since the request arrived or not, bounds
    /// the replicas' places and decides whether the replica is told the priority.
    fn pick(
        &self,
        request: &RoutedRequest,
        model: &Model,
        tried: &[String],
        priority: Option<i32>,
    ) -> Option<Lease> {
        let model_name = request.model.as_str();
        let admitted = model.flow.as_ref().zip(priority);
        let places = admitted.map_or(u32::MAX, |(config, priority)| config.places(priority));
        let mut lease = self.pool.pick(
            model,
            &request.affinity,
            request.prompt_tokens,
            tried,
            self.settings.pick,
            places,
        )?;
        if let Some(copy) = lease.prefix_copy.take() {
            self.copy_prefix(request, copy);
        }
        lease.priority = admitted.map(|(_, priority)| priority);
        if model.flow.is_some() {
            lease.on_release(self.flow(model_name));
        }
        self.metrics
            .picks
            .with_label_values(&[model_name, model.policy.as_str()])
            .inc();
        if let Some(found) = lease.cache_match {
            let blocks = &self.metrics.prompt_blocks;
            blocks
                .with_label_values(&[model_name, "true"])
                .inc_by(found.cached as u64);
            blocks
                .with_label_values(&[model_name, "false"])
                .inc_by((found.blocks - found.cached) as u64);
        }
        lease.show_in(
            self.metrics
                .in_flight
                .with_label_values(&[model_name, &lease.pod]),
        );
        Some(lease)
    }

    /// Has each idle replica of `copy` compute the shared prefix, as a one-token completion
    /// of its token ids (what the replica will name its blocks by), holding its place there
    /// meanwhile so no request is placed as if it were idle.
    fn copy_prefix(&self, request: &RoutedRequest, copy: PrefixCopy) {
        let body = json!({"model": request.model, "prompt": copy.prompt, "max_tokens": 1});
        for mut lease in copy.to {
            let mut send = self
                .upstream
                .post(format!(
                    "http://{}/v1/completions",
                    std::net::SocketAddr::new(lease.ip, lease.http_port)
                ))
                .timeout(PREFIX_COPY_TIMEOUT)
                .json(&body);
            if let Some(credentials) = &request.caller.credentials {
                send = send.header(AUTHORIZATION, credentials.0.as_slice());
            }
            let copies = self.metrics.prefix_copies.clone();
            let model = request.model.clone();
            tokio::spawn(async move {
                let answer = match send.send().await.and_then(|r| r.error_for_status()) {
                    Ok(response) => response.bytes().await,
                    Err(error) => Err(error),
                };
                let outcome = match answer {
                    Ok(_) => {
                        // One token: the answer came when the prefill ended.
                        lease.first_token();
                        "done"
                    }
                    Err(error) => {
                        tracing::debug!(replica = %lease.pod, %error, "prefix copy failed");
                        "failed"
                    }
                };
                copies.with_label_values(&[&model, outcome]).inc();
            });
        }
    }

    fn take_hold_slot(&self, model_name: &str) -> Result<HoldSlot<'_>, RouteError> {
        let mut held = self.held.lock().expect("hold lock");
        let count = held.entry(model_name.to_owned()).or_default();
        if *count >= self.settings.hold_queue {
            self.metrics
                .hold_rejected
                .with_label_values(&[model_name])
                .inc();
            return Err(RouteError::HoldQueueFull {
                model: model_name.to_owned(),
                limit: self.settings.hold_queue,
                retry_after: self.settings.hold_retry_after,
            });
        }
        *count += 1;
        self.metrics.held.with_label_values(&[model_name]).inc();
        Ok(HoldSlot {
            router: self,
            model: model_name.to_owned(),
        })
    }

    async fn hold(
        &self,
        request: &RoutedRequest,
        mut model: Model,
        priority: Option<i32>,
    ) -> Result<Lease, RouteError> {
        let model_name = request.model.as_str();
        let _slot = self.take_hold_slot(model_name)?;
        let started = Instant::now();
        let deadline = started + self.settings.hold_timeout;
        let mut fleet = self.discovery.fleet.clone();
        fleet.mark_unchanged();
        let outcome = loop {
            self.wake(model_name, &model).await;
            let next_check = deadline.min(Instant::now() + self.settings.wake_interval);
            // A changed fleet, or time to renew the wake-up (or to give up).
            let _ = tokio::time::timeout_at(next_check.into(), fleet.changed()).await;
            let current = fleet.borrow_and_update().models.get(model_name).cloned();
            let Some(current) = current else {
                break Err(("gone", RouteError::ModelNotFound(model_name.to_owned())));
            };
            model = current;
            if let Some(lease) = self.pick(request, &model, &[], priority) {
                break Ok(lease);
            }
            if Instant::now() >= deadline {
                break Err((
                    "timeout",
                    RouteError::HoldTimedOut {
                        model: model_name.to_owned(),
                        waited: self.settings.hold_timeout,
                    },
                ));
            }
        };
        let label = match &outcome {
            Ok(_) => "replica",
            Err((label, _)) => label,
        };
        self.metrics
            .hold_seconds
            .with_label_values(&[model_name, label])
            .observe(started.elapsed().as_secs_f64());
        outcome.map_err(|(_, error)| error)
    }

    /// Tells the operator a request is waiting for a fleet scaled to zero, by stamping the
    /// InferenceService's wake-up annotation; at most once per `wake_interval` per service.
    async fn wake(&self, model_name: &str, model: &Model) {
        if model.desired_replicas > 0 {
            return;
        }
        let key = (model.namespace.clone(), model.service.clone());
        {
            let mut last_wake = self.last_wake.lock().expect("wake lock");
            let now = Instant::now();
            if last_wake
                .get(&key)
                .is_some_and(|at| now.duration_since(*at) < self.settings.wake_interval)
            {
                return;
            }
            last_wake.insert(key, now);
        }
        let services: Api<InferenceService> =
            Api::namespaced(self.client.clone(), &model.namespace);
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let patch = json!({"metadata": {"annotations": {WAKE_REQUESTED_AT: now}}});
        match services
            .patch(
                &model.service,
                &PatchParams::apply(FIELD_MANAGER),
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(_) => {
                tracing::info!(model = model_name, namespace = %model.namespace, service = %model.service, "asked the operator to wake the fleet");
                self.metrics
                    .wake_signals
                    .with_label_values(&[model_name])
                    .inc();
            }
            Err(error) => {
                tracing::warn!(model = model_name, %error, "writing the wake-up annotation failed")
            }
        }
    }
}

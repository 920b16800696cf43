//! From a model name to a leased replica: the lookup, the pick, and, when the model has no
//! ready replica, the bounded hold that wakes a fleet scaled to zero and waits for it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use npufleet_contract::annotations::WAKE_REQUESTED_AT;
use npufleet_crds::{InferenceService, RoutingPolicy};
use serde_json::json;

use crate::discovery::{Discovery, Model};
use crate::error::RouteError;
use crate::metrics::Metrics;
use crate::pool::{Lease, PickSettings, Pool};
use crate::prompt::{Affinity, ExactPrompt, PrefixBlocks, Prompt, Recipes};
use crate::request::RoutedRequest;
use crate::retry::RetryPolicy;

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
    held: Mutex<HashMap<String, usize>>,
    last_wake: Mutex<HashMap<(String, String), Instant>>,
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

impl Router {
    pub fn new(
        settings: Settings,
        discovery: Discovery,
        pool: Arc<Pool>,
        metrics: Metrics,
        recipes: Arc<Recipes>,
        client: Client,
    ) -> Self {
        Router {
            settings,
            discovery,
            pool,
            metrics,
            recipes,
            client,
            held: Mutex::default(),
            last_wake: Mutex::default(),
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
    fn token_blocks(&self, model_name: &str, model: &Model, prompt: &Prompt) -> Option<Vec<u64>> {
        let exact = prompt.exact.as_ref()?;
        let tokenizer = self.recipes.get(model_name, model.first_http_address())?;
        let tokens = match exact {
            ExactPrompt::Text(text) => tokenizer.text_tokens(text),
            ExactPrompt::Chat(messages) => tokenizer.chat_tokens(messages),
        };
        match tokens {
            Ok(tokens) => Some(npufleet_contract::kv::block_hashes(
                &tokens,
                tokenizer.block_size(),
            )),
            Err(error) => {
                tracing::debug!(model = model_name, %error, "prompt not tokenised; placing it by its bytes");
                None
            }
        }
    }

    /// A replica of the request's model for one attempt, skipping the pods in `tried`. With
    /// nothing tried yet and no replica ready, holds the request until one is (or the hold
    /// ends); with every replica tried, fails at once, as retrying the same replicas would.
    pub async fn lease(
        &self,
        request: &RoutedRequest,
        tried: &[String],
    ) -> Result<Lease, RouteError> {
        let (model_name, affinity) = (request.model.as_str(), &request.affinity);
        let model = self.model(model_name)?;
        if let Some(lease) = self.pick(model_name, &model, affinity, tried) {
            return Ok(lease);
        }
        if !tried.is_empty() {
            return Err(RouteError::ReplicasFailed {
                model: model_name.to_owned(),
                last: "no replica left to try".to_owned(),
            });
        }
        self.hold(model_name, model, affinity).await
    }

    fn pick(
        &self,
        model_name: &str,
        model: &Model,
        affinity: &Affinity,
        tried: &[String],
    ) -> Option<Lease> {
        let mut lease = self.pool.pick(model, affinity, tried, self.settings.pick)?;
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
        model_name: &str,
        mut model: Model,
        affinity: &Affinity,
    ) -> Result<Lease, RouteError> {
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
            if let Some(lease) = self.pick(model_name, &model, affinity, &[]) {
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

//! From a model name to a leased replica: the lookup, the pick, and, when the model has no
//! ready replica, the bounded hold that wakes a fleet scaled to zero and waits for it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use npufleet_contract::annotations::WAKE_REQUESTED_AT;
use npufleet_crds::InferenceService;
use serde_json::json;

use crate::discovery::{Discovery, Model};
use crate::error::RouteError;
use crate::metrics::Metrics;
use crate::pool::{Lease, PickSettings, Pool};
use crate::prompt::PrefixBlocks;
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
        client: Client,
    ) -> Self {
        Router {
            settings,
            discovery,
            pool,
            metrics,
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

    /// The prefix-affinity key of `prompt` for `model_name`, cut at its workers' cache block
    /// size. `None` for an unknown model, or one no replica has published its block size for
    /// yet (the request is then placed by load).
    pub fn prefix_key(&self, model_name: &str, prompt: &[u8]) -> Option<u64> {
        let model = self.model(model_name).ok()?;
        let block_tokens = self.pool.block_size(&model)?;
        self.settings.prefix.key(prompt, block_tokens)
    }

    /// A replica of the request's model for one attempt, skipping the pods in `tried`. With
    /// nothing tried yet and no replica ready, holds the request until one is (or the hold
    /// ends); with every replica tried, fails at once, as retrying the same replicas would.
    pub async fn lease(
        &self,
        request: &RoutedRequest,
        tried: &[String],
    ) -> Result<Lease, RouteError> {
        let (model_name, prefix_key) = (request.model.as_str(), request.prefix_key);
        let model = self.model(model_name)?;
        if let Some(lease) = self.pick(model_name, &model, prefix_key, tried) {
            return Ok(lease);
        }
        if !tried.is_empty() {
            return Err(RouteError::ReplicasFailed {
                model: model_name.to_owned(),
                last: "no replica left to try".to_owned(),
            });
        }
        self.hold(model_name, model, prefix_key).await
    }

    fn pick(
        &self,
        model_name: &str,
        model: &Model,
        prefix_key: Option<u64>,
        tried: &[String],
    ) -> Option<Lease> {
        let mut lease = self
            .pool
            .pick(model, prefix_key, tried, self.settings.pick)?;
        self.metrics
            .picks
            .with_label_values(&[model_name, model.policy.as_str()])
            .inc();
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
        prefix_key: Option<u64>,
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
            if let Some(lease) = self.pick(model_name, &model, prefix_key, &[]) {
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

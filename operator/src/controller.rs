//! The controller: watches InferenceServices and what they own, reads the cluster, hands it to
//! the pure [`reconcile::plan`], and applies the result with server-side apply under one field
//! manager. Children carry controller owner references, so garbage collection removes them with
//! their InferenceService and no finalizer is needed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource, ResourceExt};
use npufleet_crds::InferenceService;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::cache::{self, Cache, WatchScope};
use crate::labels::{self, FIELD_MANAGER};
use crate::metrics::Metrics;
use crate::reconcile::{self, Note, Observed, Related};
use crate::resources::{inference_pool, pod_group};
use crate::settings::Settings;
use crate::status;

const CONTROLLER: &str = "inferenceservice";
/// How often Volcano's API is looked for again, so installing Volcano later is noticed.
const DISCOVERY_INTERVAL: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("{0} has no namespace")]
    NoNamespace(String),
    #[error("{count} write(s) refused, first: {first}")]
    Refused {
        count: usize,
        first: String,
        transient: bool,
    },
}

impl Error {
    fn kind(&self) -> &'static str {
        match self {
            Self::Kube(kube::Error::Api(_)) => "api",
            Self::Kube(_) => "client",
            Self::NoNamespace(_) => "no_namespace",
            Self::Refused {
                transient: true, ..
            } => "client",
            Self::Refused { .. } => "refused",
        }
    }
}

/// State shared by the reconciles (and by any other loop the operator runs).
pub struct Context {
    pub client: Client,
    pub settings: Settings,
    pub metrics: Metrics,
    pub recorder: Recorder,
    /// Whether `scheduling.volcano.sh/v1beta1` PodGroups are served; refreshed periodically.
    pub volcano_served: AtomicBool,
    /// Whether `inference.networking.k8s.io/v1` InferencePools are served; refreshed likewise.
    pub inference_pools_served: AtomicBool,
    /// The informer cache the reconcile and the autoscaler read.
    pub cache: Cache,
    /// What the cache and the controller's own watches cover.
    pub scope: WatchScope,
    /// Reconciles of each InferenceService (namespace, name) that failed in a row.
    failures: std::sync::Mutex<std::collections::HashMap<(String, String), u32>>,
}

impl Context {
    pub fn new(
        client: Client,
        settings: Settings,
        metrics: Metrics,
        instance: Option<String>,
    ) -> Self {
        let reporter = Reporter {
            controller: FIELD_MANAGER.to_string(),
            instance,
        };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            settings,
            metrics,
            volcano_served: AtomicBool::new(false),
            inference_pools_served: AtomicBool::new(false),
            cache: Cache::new(),
            scope: WatchScope::default(),
            failures: Default::default(),
        }
    }

    /// Counts a failed reconcile of `isvc` (or forgets its failures after a success) and
    /// returns how many failed in a row.
    fn failures_in_a_row(&self, isvc: &InferenceService, failed: bool) -> u32 {
        let key = (isvc.namespace().unwrap_or_default(), isvc.name_any());
        let Ok(mut failures) = self.failures.lock() else {
            return 1;
        };
        if failed {
            let count = failures.entry(key).or_default();
            *count = count.saturating_add(1);
            *count
        } else {
            failures.remove(&key);
            0
        }
    }

    /// The same, watching only `scope` (every namespace unless set).
    #[must_use]
    pub fn watching(mut self, scope: WatchScope) -> Self {
        self.scope = scope;
        self
    }
}

/// Whether the cluster serves `resource` (a Volcano PodGroup, an InferencePool: APIs that
/// exist only where their project is installed).
pub async fn api_served(client: &Client, resource: &ApiResource) -> bool {
    match client.list_api_group_resources(&resource.api_version).await {
        Ok(list) => list.resources.iter().any(|r| r.name == resource.plural),
        Err(_) => false,
    }
}

/// Runs the InferenceService controller, and the watches of the shared cache, until they end.
pub async fn run(ctx: Arc<Context>) {
    let client = ctx.client.clone();
    let Some(started) = ctx.cache.start(&client, &ctx.scope) else {
        tracing::error!("the operator's cache was already started");
        return;
    };
    let stores = ctx.cache.stores.clone();
    let mut pod_group_watch = Some(started.pod_group_watch);
    let discovery = {
        let ctx = ctx.clone();
        async move {
            let mut pod_groups = futures::future::OptionFuture::from(None);
            loop {
                let served = api_served(&ctx.client, &pod_group::api_resource()).await;
                if ctx.volcano_served.swap(served, Ordering::Relaxed) != served {
                    tracing::info!(served, "Volcano PodGroup API availability changed");
                }
                let pools = api_served(&ctx.client, &inference_pool::api_resource()).await;
                if ctx.inference_pools_served.swap(pools, Ordering::Relaxed) != pools {
                    tracing::info!(served = pools, "InferencePool API availability changed");
                }
                if served && let Some(watch) = pod_group_watch.take() {
                    pod_groups = Some(watch).into();
                }
                tokio::select! {
                    () = tokio::time::sleep(DISCOVERY_INTERVAL) => {}
                    Some(()) = &mut pod_groups => tracing::warn!("the PodGroup watch ended"),
                }
            }
        }
    };
    let controller = async move {
        // A reconcile must see every pod and rank table that exists, or it would create them
        // again; nor would it know what it applied before without the Services and budgets.
        stores.synced().await;
        Controller::for_shared_stream(
            started.inference_services,
            stores.inference_services.clone(),
        )
        .owns_shared_stream(started.pods)
        .owns_shared_stream(started.services)
        .owns_shared_stream(started.disruption_budgets)
        .owns_shared_stream(started.rank_tables)
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!(error = %e, "reconcile did not complete");
            }
        })
        .await;
    };
    tokio::select! {
        () = controller => {}
        () = started.watches => tracing::warn!("the cache's watches ended"),
        () = discovery => {}
    }
}

/// The first retry of a failed reconcile; each failure in a row doubles it.
const RETRY_FIRST: Duration = Duration::from_secs(5);
/// The longest wait between retries: a refusal a user must fix (a missing PriorityClass, a
/// quota) is still noticed within minutes of the fix, without a request every few seconds.
const RETRY_MAX: Duration = Duration::from_secs(300);

/// The wait before retry number `failures` (1 after the first failure).
pub fn retry_after(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    RETRY_FIRST.saturating_mul(1 << doublings).min(RETRY_MAX)
}

fn error_policy(isvc: Arc<InferenceService>, error: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics.reconcile_failed(CONTROLLER, error.kind());
    let failures = ctx.failures_in_a_row(&isvc, true);
    let after = retry_after(failures);
    tracing::warn!(name = %isvc.name_any(), namespace = ?isvc.namespace(), %error, failures, retry_in_seconds = after.as_secs(), "reconcile failed");
    Action::requeue(after)
}

/// A write the apiserver refused, with its own words.
#[derive(Debug)]
struct Failure {
    /// `create` (server-side apply) or `delete`.
    verb: &'static str,
    kind: String,
    name: String,
    message: String,
    /// The request never got an answer (transport, client): worth a retry, not a user's fix.
    transient: bool,
}

impl Failure {
    fn new(verb: &'static str, kind: &str, name: &str, error: kube::Error) -> Self {
        let (message, transient) = match error {
            kube::Error::Api(status) => (status.message.clone(), false),
            other => (other.to_string(), true),
        };
        Self {
            verb,
            kind: kind.to_string(),
            name: name.to_string(),
            message,
            transient,
        }
    }

    fn describe(&self) -> String {
        let verb = match self.verb {
            "delete" => "deleting",
            "label" => "labelling",
            _ => "creating",
        };
        format!("{verb} {} {}: {}", self.kind, self.name, self.message)
    }

    fn reason(&self) -> &'static str {
        match self.verb {
            "delete" => "FailedDelete",
            "label" => "FailedUpdate",
            _ => "FailedCreate",
        }
    }
}

/// The writes of one reconcile: each one is tried, and every refusal is kept for status and
/// events instead of ending the reconcile.
struct Writer<'a> {
    client: &'a Client,
    namespace: &'a str,
    failures: Vec<Failure>,
}

impl Writer<'_> {
    async fn apply<K>(&mut self, object: &K) -> Option<K>
    where
        K: Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>
            + Clone
            + DeserializeOwned
            + Serialize
            + std::fmt::Debug,
    {
        let api = Api::<K>::namespaced(self.client.clone(), self.namespace);
        self.apply_with(&api, &K::kind(&()), object).await
    }

    /// Applies `object`; returns it as the apiserver answered, or `None` when refused.
    #[tracing::instrument(skip(self, api, object), fields(name = %object.name_any()))]
    async fn apply_with<K>(&mut self, api: &Api<K>, kind: &str, object: &K) -> Option<K>
    where
        K: Resource + Clone + DeserializeOwned + Serialize + std::fmt::Debug,
    {
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let name = object.name_any();
        match api.patch(&name, &params, &Patch::Apply(object)).await {
            Ok(applied) => Some(applied),
            Err(error) => {
                self.failures
                    .push(Failure::new("create", kind, &name, error));
                None
            }
        }
    }

    /// Sets `label` on pod `name` (gone already: nothing to label).
    #[tracing::instrument(skip(self, api))]
    async fn label(&mut self, api: &Api<Pod>, name: &str, label: &str) {
        let patch = serde_json::json!({"metadata": {"labels": {label: "true"}}});
        match api
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(error) => self
                .failures
                .push(Failure::new("label", "Pod", name, error)),
        }
    }

    /// Deletes `name`, treating "already gone" as done.
    async fn delete<K>(&mut self, api: &Api<K>, kind: &str, name: &str)
    where
        K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
    {
        self.delete_with(api, kind, name, &DeleteParams::background())
            .await;
    }

    #[tracing::instrument(skip(self, api, params))]
    async fn delete_with<K>(&mut self, api: &Api<K>, kind: &str, name: &str, params: &DeleteParams)
    where
        K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
    {
        match api.delete(name, params).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(error) => self
                .failures
                .push(Failure::new("delete", kind, name, error)),
        }
    }
}

/// What the cache holds for `isvc`: no request to the apiserver.
fn observe(isvc: &InferenceService, ctx: &Context, namespace: &str) -> Observed {
    let stores = &ctx.cache.stores;
    let volcano_served = ctx.volcano_served.load(Ordering::Relaxed);
    let pod_groups = if volcano_served {
        cache::owned_by(&stores.pod_groups, namespace, isvc)
            .iter()
            .map(|o| o.name_any())
            .collect()
    } else {
        Vec::new()
    };
    let held = cache::owned_by(&stores.pods, namespace, isvc)
        .iter()
        .map(|p| Pod::clone(p))
        .collect();
    let owner = isvc.meta().uid.as_deref().unwrap_or_default();
    Observed {
        pods: stores.creations.with_unseen(namespace, owner, held),
        rank_tables: cache::owned_by(&stores.rank_tables, namespace, isvc)
            .iter()
            .map(|o| o.name_any())
            .collect(),
        pod_groups,
        volcano_served,
        inference_pools_served: ctx.inference_pools_served.load(Ordering::Relaxed),
        applied: applied_digests(isvc, ctx, namespace, volcano_served),
        evictions: stores.evictions.of(namespace, &isvc.name_any()),
    }
}

/// The [`labels::APPLIED_DIGEST`] of every object the cache holds for `isvc`, by kind and name.
fn applied_digests(
    isvc: &InferenceService,
    ctx: &Context,
    namespace: &str,
    volcano_served: bool,
) -> BTreeMap<(String, String), String> {
    fn digests<K>(
        store: &kube::runtime::reflector::Store<K>,
        kind: &str,
        namespace: &str,
        isvc: &InferenceService,
    ) -> Vec<((String, String), String)>
    where
        K: Resource + Clone + DeserializeOwned + Send + Sync + 'static,
        K::DynamicType: std::hash::Hash + Eq + Clone,
    {
        cache::owned_by(store, namespace, isvc)
            .iter()
            .filter_map(|o| {
                let digest = o.meta().annotations.as_ref()?.get(labels::APPLIED_DIGEST)?;
                Some(((kind.to_string(), o.name_any()), digest.clone()))
            })
            .collect()
    }
    let stores = &ctx.cache.stores;
    let mut applied = digests(&stores.services, "Service", namespace, isvc);
    applied.extend(digests(
        &stores.disruption_budgets,
        "PodDisruptionBudget",
        namespace,
        isvc,
    ));
    applied.extend(digests(&stores.rank_tables, "ConfigMap", namespace, isvc));
    if volcano_served {
        applied.extend(digests(&stores.pod_groups, "PodGroup", namespace, isvc));
    }
    applied.into_iter().collect()
}

/// Longest event note the Events API accepts.
const MAX_EVENT_NOTE: usize = 1024;
/// The longest a reconcile waits before looking again when nothing changes.
const RESYNC: Duration = Duration::from_secs(300);

#[tracing::instrument(skip(ctx, isvc, namespace, note), fields(reason = note.reason))]
async fn publish(ctx: &Context, isvc: &InferenceService, namespace: &str, note: &Note) {
    let related = note.related.as_ref().map(|r| ObjectReference {
        api_version: Some(related_api_version(&r.kind).to_string()),
        kind: Some(r.kind.clone()),
        name: Some(r.name.clone()),
        namespace: Some(namespace.to_string()),
        ..Default::default()
    });
    let event = Event {
        type_: if note.warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: note.reason.to_string(),
        note: Some(status::truncate(&note.message, MAX_EVENT_NOTE)),
        action: "Reconcile".to_string(),
        secondary: related,
    };
    if let Err(e) = ctx.recorder.publish(&event, &isvc.object_ref(&())).await {
        tracing::warn!(error = %e, reason = note.reason, "could not record an event");
    }
}

/// Whether the status the operator writes is what `isvc` already shows: the fields other
/// writers own (`lastFailure`, the autoscaler's `autoscaling`) aside.
fn status_is_current(
    isvc: &InferenceService,
    status: &npufleet_crds::InferenceServiceStatus,
) -> bool {
    isvc.status.as_ref().is_some_and(|live| {
        let mut live = live.clone();
        live.last_failure = None;
        live.autoscaling = None;
        &live == status
    })
}

fn related_api_version(kind: &str) -> &'static str {
    match kind {
        "PodDisruptionBudget" => "policy/v1",
        "PodGroup" => "scheduling.volcano.sh/v1beta1",
        "InferencePool" => inference_pool::API_VERSION,
        _ => "v1",
    }
}

/// One reconcile: read the cache, plan, then write the plan's objects, the status and the
/// events.
#[tracing::instrument(skip_all, fields(
    name = %isvc.name_any(),
    namespace = %isvc.namespace().unwrap_or_default(),
    generation = isvc.metadata.generation.unwrap_or_default(),
))]
async fn reconcile(isvc: Arc<InferenceService>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started(CONTROLLER);
    let namespace = isvc
        .namespace()
        .ok_or_else(|| Error::NoNamespace(isvc.name_any()))?;
    if isvc.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let observed = observe(&isvc, &ctx, &namespace);
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let plan = reconcile::plan(&isvc, &observed, &ctx.settings, &now);
    let failures = write_objects(&ctx, &namespace, &plan).await;
    let status_written = write_status(&ctx, &isvc, &plan, &failures, &now).await;
    publish_notes(&ctx, &isvc, &namespace, &plan.notes, &failures).await;
    status_written?;
    tracing::debug!(
        created = plan.create_pods.len(),
        deleted = plan.delete_pods.len(),
        failed = failures.len(),
        "reconciled"
    );
    if let Some(failure) = failures.first() {
        return Err(Error::Refused {
            count: failures.len(),
            first: failure.describe(),
            transient: failures.iter().all(|f| f.transient),
        });
    }
    ctx.failures_in_a_row(&isvc, false);
    // One second past a progress deadline, so the group is seen on the other side of it.
    let next = plan
        .recheck_after
        .map_or(RESYNC, |after| (after + Duration::from_secs(1)).min(RESYNC));
    Ok(Action::requeue(next))
}

/// Applies and deletes what `plan` says, in order: the objects around the pods, then the pods.
/// Returns the writes the apiserver refused.
async fn write_objects(ctx: &Context, namespace: &str, plan: &reconcile::Plan) -> Vec<Failure> {
    let client = &ctx.client;
    let mut writer = Writer {
        client,
        namespace,
        failures: Vec::new(),
    };
    for service in &plan.services {
        writer.apply(service).await;
    }
    if let Some(budget) = &plan.disruption_budget {
        writer.apply(budget).await;
    }
    for table in &plan.rank_tables {
        writer.apply(table).await;
    }
    let config_maps = Api::<ConfigMap>::namespaced(client.clone(), namespace);
    for name in &plan.delete_rank_tables {
        writer.delete(&config_maps, "ConfigMap", name).await;
    }
    let pod_groups = Api::<DynamicObject>::namespaced_with(
        client.clone(),
        namespace,
        &pod_group::api_resource(),
    );
    for group in &plan.pod_groups {
        writer.apply_with(&pod_groups, "PodGroup", group).await;
    }
    for name in &plan.delete_pod_groups {
        writer.delete(&pod_groups, "PodGroup", name).await;
    }
    let inference_pools = Api::<DynamicObject>::namespaced_with(
        client.clone(),
        namespace,
        &inference_pool::api_resource(),
    );
    if let Some(pool) = &plan.inference_pool {
        writer
            .apply_with(&inference_pools, "InferencePool", pool)
            .await;
    }
    if let Some(name) = &plan.delete_inference_pool {
        writer.delete(&inference_pools, "InferencePool", name).await;
    }
    write_pods(&mut writer, plan, &ctx.cache.stores.creations).await;
    writer.failures
}

/// The pods' writes; each pod created is remembered until the pod store shows it.
async fn write_pods(writer: &mut Writer<'_>, plan: &reconcile::Plan, creations: &cache::Creations) {
    let pods = Api::<Pod>::namespaced(writer.client.clone(), writer.namespace);
    for name in &plan.make_evictable {
        writer.label(&pods, name, labels::EVICTABLE).await;
    }
    for name in &plan.delete_pods {
        writer.delete(&pods, "Pod", name).await;
    }
    for name in &plan.force_delete_pods {
        let now = DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::background()
        };
        writer.delete_with(&pods, "Pod", name, &now).await;
    }
    for pod in &plan.create_pods {
        if let Some(created) = writer.apply(pod).await {
            creations.note(created);
        }
    }
}

/// Writes the status, rebuilt with the refused writes if any, unless the service shows it
/// already; then a new `lastFailure` under its own field manager.
#[tracing::instrument(skip_all, fields(refused = failures.len()))]
async fn write_status(
    ctx: &Context,
    isvc: &InferenceService,
    plan: &reconcile::Plan,
    failures: &[Failure],
    now: &Time,
) -> Result<(), kube::Error> {
    let status = if failures.is_empty() {
        plan.status.clone()
    } else {
        let mut seen = plan.observation.clone();
        seen.apply_failures = failures.iter().map(Failure::describe).collect();
        status::build(isvc, &ctx.settings, &seen, now)
    };
    let services = Api::<InferenceService>::namespaced(
        ctx.client.clone(),
        &isvc.namespace().unwrap_or_default(),
    );
    if !status_is_current(isvc, &status) {
        patch_status(&services, isvc, FIELD_MANAGER, serde_json::json!(status)).await?;
    }
    let last_failure = isvc.status.as_ref().and_then(|s| s.last_failure.as_ref());
    let new_failure = plan
        .observation
        .failure
        .as_ref()
        .filter(|f| Some(*f) != last_failure);
    if let Some(failure) = new_failure {
        let status = serde_json::json!({"lastFailure": failure});
        patch_status(&services, isvc, labels::LAST_FAILURE_MANAGER, status).await?;
    }
    Ok(())
}

/// Server-side applies `status` to `isvc`'s status under `manager`.
#[tracing::instrument(skip(services, isvc, status))]
async fn patch_status(
    services: &Api<InferenceService>,
    isvc: &InferenceService,
    manager: &str,
    status: serde_json::Value,
) -> Result<(), kube::Error> {
    let patch = serde_json::json!({
        "apiVersion": InferenceService::api_version(&()),
        "kind": InferenceService::kind(&()),
        "status": status,
    });
    let params = PatchParams::apply(manager).force();
    services
        .patch_status(&isvc.name_any(), &params, &Patch::Apply(&patch))
        .await
        .map(drop)
}

/// The plan's events, and one per refused write in place of a refused group's creation.
async fn publish_notes(
    ctx: &Context,
    isvc: &InferenceService,
    namespace: &str,
    notes: &[Note],
    failures: &[Failure],
) {
    let refusals = failures.iter().map(|f| Note {
        warning: true,
        reason: f.reason(),
        message: f.describe(),
        related: Some(Related {
            kind: f.kind.clone(),
            name: f.name.clone(),
        }),
    });
    // A group whose first pod was refused was not created: its refusal says so alone.
    let refused = |note: &&Note| {
        note.reason == reconcile::CREATING_GROUP
            && failures
                .iter()
                .any(|f| f.kind == "Pod" && note.related.as_ref().is_some_and(|r| r.name == f.name))
    };
    let notes = notes.iter().filter(|note| !refused(note)).cloned();
    for note in notes.chain(refusals) {
        publish(ctx, isvc, namespace, &note).await;
    }
}

#[cfg(test)]
mod scenarios;

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::retry_after;

    #[test]
    fn refused_writes_are_retried_ever_later_up_to_five_minutes() {
        let waits: Vec<u64> = (1..=9).map(|n| retry_after(n).as_secs()).collect();
        assert_eq!(waits, [5, 10, 20, 40, 80, 160, 300, 300, 300]);
        assert_eq!(retry_after(u32::MAX), Duration::from_secs(300));
    }
}

//! The controller: watches InferenceServices and what they own, reads the cluster, hands it to
//! the pure [`reconcile::plan`], and applies the result with server-side apply under one field
//! manager. Children carry controller owner references, so garbage collection removes them with
//! their InferenceService and no finalizer is needed.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use npufleet_crds::InferenceService;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::labels::{self, FIELD_MANAGER};
use crate::metrics::Metrics;
use crate::reconcile::{self, Observed};
use crate::resources::pod_group;
use crate::settings::Settings;

const CONTROLLER: &str = "inferenceservice";
/// How often Volcano's API is looked for again, so installing Volcano later is noticed.
const DISCOVERY_INTERVAL: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("{0} has no namespace")]
    NoNamespace(String),
}

impl Error {
    fn kind(&self) -> &'static str {
        match self {
            Self::Kube(kube::Error::Api(_)) => "api",
            Self::Kube(_) => "client",
            Self::NoNamespace(_) => "no_namespace",
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
        }
    }
}

/// Whether the cluster serves Volcano PodGroups.
pub async fn discover_volcano(client: &Client) -> bool {
    match client
        .list_api_group_resources("scheduling.volcano.sh/v1beta1")
        .await
    {
        Ok(list) => list.resources.iter().any(|r| r.name == "podgroups"),
        Err(_) => false,
    }
}

/// Runs the InferenceService controller until its watches end.
pub async fn run(ctx: Arc<Context>) {
    let client = ctx.client.clone();
    let managed =
        watcher::Config::default().labels(&format!("{}={}", labels::MANAGED_BY, FIELD_MANAGER));
    let discovery = {
        let ctx = ctx.clone();
        async move {
            loop {
                let served = discover_volcano(&ctx.client).await;
                if ctx.volcano_served.swap(served, Ordering::Relaxed) != served {
                    tracing::info!(served, "Volcano PodGroup API availability changed");
                }
                tokio::time::sleep(DISCOVERY_INTERVAL).await;
            }
        }
    };
    ctx.volcano_served
        .store(discover_volcano(&client).await, Ordering::Relaxed);
    let controller = Controller::new(
        Api::<InferenceService>::all(client.clone()),
        watcher::Config::default(),
    )
    .owns(Api::<Pod>::all(client.clone()), managed.clone())
    .owns(Api::<Service>::all(client.clone()), managed.clone())
    .owns(Api::<ConfigMap>::all(client.clone()), managed.clone())
    .owns(Api::<PodDisruptionBudget>::all(client.clone()), managed)
    .shutdown_on_signal()
    .run(reconcile, error_policy, ctx)
    .for_each(|result| async move {
        if let Err(e) = result {
            tracing::debug!(error = %e, "reconcile did not complete");
        }
    });
    tokio::select! {
        () = controller => {}
        () = discovery => {}
    }
}

fn error_policy(isvc: Arc<InferenceService>, error: &Error, ctx: Arc<Context>) -> Action {
    tracing::warn!(name = %isvc.name_any(), namespace = ?isvc.namespace(), %error, "reconcile failed");
    ctx.metrics.reconcile_failed(CONTROLLER, error.kind());
    Action::requeue(Duration::from_secs(5))
}

async fn apply<K>(api: &Api<K>, object: &K) -> Result<(), Error>
where
    K: Resource + Clone + DeserializeOwned + Serialize + std::fmt::Debug,
{
    let params = PatchParams::apply(FIELD_MANAGER).force();
    api.patch(&object.name_any(), &params, &Patch::Apply(object))
        .await?;
    Ok(())
}

/// Deletes `name`, treating "already gone" as done.
async fn delete<K>(api: &Api<K>, name: &str) -> Result<(), Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Only objects this InferenceService controls: a same-named object of an earlier
/// incarnation, or someone else's with the same label, is not ours to count or delete.
fn owned_by(meta: &kube::api::ObjectMeta, isvc: &InferenceService) -> bool {
    let uid = isvc.uid();
    meta.owner_references.as_ref().is_some_and(|refs| {
        refs.iter()
            .any(|r| Some(&r.uid) == uid.as_ref() && r.controller == Some(true))
    })
}

async fn observe(
    isvc: &InferenceService,
    ctx: &Context,
    namespace: &str,
) -> Result<Observed, Error> {
    let client = ctx.client.clone();
    let selector = ListParams::default().labels(&format!(
        "{}={}",
        labels::INFERENCE_SERVICE,
        isvc.name_any()
    ));
    let pods = Api::<Pod>::namespaced(client.clone(), namespace)
        .list(&selector)
        .await?;
    let rank_tables = Api::<ConfigMap>::namespaced(client.clone(), namespace)
        .list_metadata(&selector)
        .await?;
    let volcano_served = ctx.volcano_served.load(Ordering::Relaxed);
    let pod_groups = if volcano_served {
        let api =
            Api::<DynamicObject>::namespaced_with(client, namespace, &pod_group::api_resource());
        api.list_metadata(&selector)
            .await?
            .items
            .into_iter()
            .filter(|o| owned_by(&o.metadata, isvc))
            .map(|o| o.name_any())
            .collect()
    } else {
        Vec::new()
    };
    Ok(Observed {
        pods: pods
            .items
            .into_iter()
            .filter(|p| owned_by(&p.metadata, isvc))
            .collect(),
        rank_tables: rank_tables
            .items
            .into_iter()
            .filter(|o| owned_by(&o.metadata, isvc))
            .map(|o| o.name_any())
            .collect(),
        pod_groups,
        volcano_served,
    })
}

async fn reconcile(isvc: Arc<InferenceService>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started(CONTROLLER);
    let namespace = isvc
        .namespace()
        .ok_or_else(|| Error::NoNamespace(isvc.name_any()))?;
    if isvc.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let observed = observe(&isvc, &ctx, &namespace).await?;
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let plan = reconcile::plan(&isvc, &observed, &ctx.settings, &now);
    let client = ctx.client.clone();

    let services = Api::<Service>::namespaced(client.clone(), &namespace);
    for service in &plan.services {
        apply(&services, service).await?;
    }
    apply(
        &Api::<PodDisruptionBudget>::namespaced(client.clone(), &namespace),
        &plan.disruption_budget,
    )
    .await?;
    let config_maps = Api::<ConfigMap>::namespaced(client.clone(), &namespace);
    for table in &plan.rank_tables {
        apply(&config_maps, table).await?;
    }
    for name in &plan.delete_rank_tables {
        delete(&config_maps, name).await?;
    }
    let pod_groups = Api::<DynamicObject>::namespaced_with(
        client.clone(),
        &namespace,
        &pod_group::api_resource(),
    );
    for group in &plan.pod_groups {
        let params = PatchParams::apply(FIELD_MANAGER).force();
        pod_groups
            .patch(&group.name_any(), &params, &Patch::Apply(group))
            .await?;
    }
    for name in &plan.delete_pod_groups {
        delete(&pod_groups, name).await?;
    }
    let pods = Api::<Pod>::namespaced(client.clone(), &namespace);
    for name in &plan.delete_pods {
        delete(&pods, name).await?;
    }
    for pod in &plan.create_pods {
        apply(&pods, pod).await?;
    }

    let status = serde_json::json!({
        "apiVersion": InferenceService::api_version(&()),
        "kind": InferenceService::kind(&()),
        "status": plan.status,
    });
    Api::<InferenceService>::namespaced(client, &namespace)
        .patch_status(
            &isvc.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&status),
        )
        .await?;

    let reference = isvc.object_ref(&());
    for note in &plan.notes {
        let event = Event {
            type_: if note.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: note.reason.to_string(),
            note: Some(note.message.clone()),
            action: "Reconcile".to_string(),
            secondary: None,
        };
        if let Err(e) = ctx.recorder.publish(&event, &reference).await {
            tracing::warn!(error = %e, reason = note.reason, "could not record an event");
        }
    }
    tracing::debug!(name = %isvc.name_any(), %namespace, created = plan.create_pods.len(), deleted = plan.delete_pods.len(), "reconciled");
    Ok(Action::requeue(Duration::from_secs(300)))
}

//! The operator's one informer cache: a reflector per kind it reads (InferenceServices, their
//! worker pods, the metadata of their Services, PodDisruptionBudgets and rank-table
//! ConfigMaps, Volcano PodGroups), shared by the
//! controller, which is triggered from the same watches, and by the autoscaler. A reconcile
//! reads these stores and never LISTs. Every watch covers the operator's [`WatchScope`].

use std::sync::Mutex;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, DynamicObject, PartialObjectMeta};
use kube::core::{DynamicResourceScope, NamespaceResourceScope};
use kube::runtime::reflector::{self, ReflectHandle, Store, store::Writer};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource};
use npufleet_crds::InferenceService;
use serde::de::DeserializeOwned;
use tokio::sync::watch;

use crate::labels::{self, FIELD_MANAGER};
use crate::resources::pod_group;

/// Events a slow subscriber may fall behind before the reflector waits for it.
const SUBSCRIBER_BUFFER: usize = 1024;

/// The namespaces the operator watches and writes in: every one, or one for a namespaced
/// install, where RBAC grants a Role in that namespace only and any cluster-wide list or watch
/// would be refused.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WatchScope(Option<String>);

impl WatchScope {
    /// The one namespace, if the scope is not the whole cluster.
    pub fn namespace(&self) -> Option<&str> {
        self.0.as_deref()
    }

    /// An API over the scope's objects of kind `K`.
    pub fn api<K>(&self, client: &Client) -> Api<K>
    where
        K: Resource<Scope = NamespaceResourceScope>,
        K::DynamicType: Default,
    {
        match self.namespace() {
            Some(namespace) => Api::namespaced(client.clone(), namespace),
            None => Api::all(client.clone()),
        }
    }

    /// [`WatchScope::api`] for a kind known only at run time.
    pub fn api_with<K>(&self, client: &Client, dyntype: &K::DynamicType) -> Api<K>
    where
        K: Resource<Scope = DynamicResourceScope>,
    {
        match self.namespace() {
            Some(namespace) => Api::namespaced_with(client.clone(), namespace, dyntype),
            None => Api::all_with(client.clone(), dyntype),
        }
    }
}

/// A namespace name; empty (or blank) means every namespace.
impl std::str::FromStr for WatchScope {
    type Err = std::convert::Infallible;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let text = text.trim();
        Ok(Self((!text.is_empty()).then(|| text.to_string())))
    }
}

/// Readers of every store. Cloning a [`Store`] shares it.
#[derive(Clone)]
pub struct Stores {
    pub inference_services: Store<InferenceService>,
    pub pods: Store<Pod>,
    pub services: Store<PartialObjectMeta<Service>>,
    pub disruption_budgets: Store<PartialObjectMeta<PodDisruptionBudget>>,
    pub rank_tables: Store<PartialObjectMeta<ConfigMap>>,
    /// Empty until the PodGroup API is found to be served.
    pub pod_groups: Store<DynamicObject>,
    /// Turns true once every store but the PodGroups' holds what the cluster had when its
    /// watch started.
    synced: watch::Receiver<bool>,
}

impl Stores {
    /// Resolves once every store but the PodGroups' holds what the cluster had when its watch
    /// started: until then an absent object may only not have arrived yet. Any number of
    /// tasks may wait here; a store's own `wait_until_ready` wakes only the last task that
    /// polled it, so the cache's watches are its one caller.
    pub async fn synced(&self) {
        // An error means the cache was dropped, and with it anything to wait for.
        let _ = self.synced.clone().wait_for(|synced| *synced).await;
    }
}

struct Writers {
    inference_services: Writer<InferenceService>,
    pods: Writer<Pod>,
    services: Writer<PartialObjectMeta<Service>>,
    disruption_budgets: Writer<PartialObjectMeta<PodDisruptionBudget>>,
    rank_tables: Writer<PartialObjectMeta<ConfigMap>>,
    pod_groups: Writer<DynamicObject>,
    synced: watch::Sender<bool>,
}

pub struct Cache {
    pub stores: Stores,
    /// Taken once by [`Cache::start`].
    writers: Mutex<Option<Writers>>,
}

/// The change streams of the shared stores that trigger reconciles, and the futures that keep
/// the stores filled (they must be polled for anything to arrive).
pub struct Started {
    pub inference_services: ReflectHandle<InferenceService>,
    pub pods: ReflectHandle<Pod>,
    pub services: ReflectHandle<PartialObjectMeta<Service>>,
    pub disruption_budgets: ReflectHandle<PartialObjectMeta<PodDisruptionBudget>>,
    pub rank_tables: ReflectHandle<PartialObjectMeta<ConfigMap>>,
    pub watches: futures::future::BoxFuture<'static, ()>,
    /// Fills the PodGroup store; run once the PodGroup API is served.
    pub pod_group_watch: futures::future::BoxFuture<'static, ()>,
}

/// Nothing the operator decides reads `managedFields`, and on pods and InferenceServices,
/// which several writers update, they are the larger part of each cached object.
pub(crate) fn without_managed_fields<K: Resource>(object: &mut K) {
    object.meta_mut().managed_fields = None;
}

fn drive<S, E>(stream: S) -> impl std::future::Future<Output = ()> + Send + 'static
where
    S: Stream<Item = Result<E, watcher::Error>> + Send + 'static,
    E: Send + 'static,
{
    stream.for_each(|event| {
        if let Err(error) = event {
            tracing::debug!(%error, "watch interrupted; retrying with backoff");
        }
        std::future::ready(())
    })
}

impl Default for Cache {
    fn default() -> Self {
        Self::new()
    }
}

impl Cache {
    pub fn new() -> Self {
        let (inference_services, inference_services_writer) =
            reflector::store_shared(SUBSCRIBER_BUFFER);
        let (pods, pods_writer) = reflector::store_shared(SUBSCRIBER_BUFFER);
        let (services, services_writer) = reflector::store_shared(SUBSCRIBER_BUFFER);
        let (disruption_budgets, disruption_budgets_writer) =
            reflector::store_shared(SUBSCRIBER_BUFFER);
        let (rank_tables, rank_tables_writer) = reflector::store_shared(SUBSCRIBER_BUFFER);
        let pod_groups_writer = Writer::new(pod_group::api_resource());
        let pod_groups = pod_groups_writer.as_reader();
        let (synced_writer, synced) = watch::channel(false);
        Self {
            stores: Stores {
                inference_services,
                pods,
                services,
                disruption_budgets,
                rank_tables,
                pod_groups,
                synced,
            },
            writers: Mutex::new(Some(Writers {
                inference_services: inference_services_writer,
                pods: pods_writer,
                services: services_writer,
                disruption_budgets: disruption_budgets_writer,
                rank_tables: rank_tables_writer,
                pod_groups: pod_groups_writer,
                synced: synced_writer,
            })),
        }
    }

    /// The watches behind the stores, over `scope`; `None` when already started.
    pub fn start(&self, client: &Client, scope: &WatchScope) -> Option<Started> {
        let writers = self.writers.lock().ok()?.take()?;
        let managed =
            watcher::Config::default().labels(&format!("{}={}", labels::MANAGED_BY, FIELD_MANAGER));
        let inference_services_handle = writers.inference_services.subscribe()?;
        let pods_handle = writers.pods.subscribe()?;
        let services_handle = writers.services.subscribe()?;
        let disruption_budgets_handle = writers.disruption_budgets.subscribe()?;
        let rank_tables_handle = writers.rank_tables.subscribe()?;
        let inference_services = watcher(
            scope.api::<InferenceService>(client),
            watcher::Config::default(),
        )
        .modify(without_managed_fields)
        .default_backoff()
        .reflect_shared(writers.inference_services);
        let pods = watcher(scope.api::<Pod>(client), managed.clone())
            .modify(without_managed_fields)
            .default_backoff()
            .reflect_shared(writers.pods);
        let services = watcher(
            scope.api::<PartialObjectMeta<Service>>(client),
            managed.clone(),
        )
        .modify(without_managed_fields)
        .default_backoff()
        .reflect_shared(writers.services);
        let disruption_budgets = watcher(
            scope.api::<PartialObjectMeta<PodDisruptionBudget>>(client),
            managed.clone(),
        )
        .modify(without_managed_fields)
        .default_backoff()
        .reflect_shared(writers.disruption_budgets);
        let rank_tables = watcher(
            scope.api::<PartialObjectMeta<ConfigMap>>(client),
            managed.clone(),
        )
        .modify(without_managed_fields)
        .default_backoff()
        .reflect_shared(writers.rank_tables);
        let pod_group_api = scope.api_with::<DynamicObject>(client, &pod_group::api_resource());
        let pod_groups = watcher(pod_group_api, managed)
            .modify(without_managed_fields)
            .default_backoff()
            .reflect(writers.pod_groups);
        let stores = self.stores.clone();
        let synced = async move {
            stores.inference_services.wait_until_ready().await.ok();
            stores.pods.wait_until_ready().await.ok();
            stores.services.wait_until_ready().await.ok();
            stores.disruption_budgets.wait_until_ready().await.ok();
            stores.rank_tables.wait_until_ready().await.ok();
            writers.synced.send_replace(true);
        };
        let watches = async move {
            futures::join!(
                drive(inference_services),
                drive(pods),
                drive(services),
                drive(disruption_budgets),
                drive(rank_tables),
                synced
            );
        };
        Some(Started {
            inference_services: inference_services_handle,
            pods: pods_handle,
            services: services_handle,
            disruption_budgets: disruption_budgets_handle,
            rank_tables: rank_tables_handle,
            watches: Box::pin(watches),
            pod_group_watch: Box::pin(drive(pod_groups)),
        })
    }
}

/// The objects of `store` in `namespace` that `isvc` controls (by owner UID, so a same-named
/// object of an earlier incarnation is not counted).
pub fn owned_by<K>(
    store: &Store<K>,
    namespace: &str,
    isvc: &InferenceService,
) -> Vec<std::sync::Arc<K>>
where
    K: Resource + Clone + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    let Some(uid) = isvc.meta().uid.as_deref() else {
        return Vec::new();
    };
    store.state_filter(|object| {
        let meta = object.meta();
        meta.namespace.as_deref() == Some(namespace)
            && meta
                .owner_references
                .iter()
                .flatten()
                .any(|r| r.uid == uid && r.controller == Some(true))
    })
}

#[cfg(test)]
mod tests {
    use super::WatchScope;

    #[test]
    fn an_empty_watch_namespace_means_every_namespace() {
        let parse = |text: &str| text.parse::<WatchScope>().expect("infallible");
        assert_eq!(parse("").namespace(), None);
        assert_eq!(parse("  ").namespace(), None);
        assert_eq!(parse(" team-a ").namespace(), Some("team-a"));
        assert_eq!(parse(""), WatchScope::default());
    }
}

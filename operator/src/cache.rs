//! The operator's one informer cache: a reflector per kind it reads (InferenceServices, their
//! worker pods, the metadata of their Services, PodDisruptionBudgets and rank-table
//! ConfigMaps, Volcano PodGroups), shared by the
//! controller, which is triggered from the same watches, and by the autoscaler. A reconcile
//! reads these stores and never LISTs. Every watch covers the operator's [`WatchScope`].
//!
//! Each store announces what changed on a [`Changes`] stream of its own rather than through
//! kube-runtime's shared reflector: that one makes the store wait for its slowest subscriber,
//! and its subscriber looks each announced object up in the store and, when the object has
//! been deleted since, yields `Pending` without arranging to be woken. After a burst in which
//! pods came and went faster than the controller read (a large service deleted), the store
//! waited forever on a subscriber nothing would wake: every store went stale until a restart.
//! Here a store never waits, and an announcement carries the object itself.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use futures::channel::mpsc;
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, DynamicObject, PartialObjectMeta};
use kube::core::{DynamicResourceScope, NamespaceResourceScope};
use kube::runtime::reflector::{self, Lookup, ObjectRef, Store, store::Writer};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use npufleet_crds::InferenceService;
use serde::de::DeserializeOwned;
use tokio::sync::watch;

use crate::fleet;
use crate::labels::{self, FIELD_MANAGER};
use crate::resources::pod_group;

/// Every object a store's watch applied or deleted, in order, carried whole. Unbounded so
/// that the store never waits for its reader: the controller drains its triggers as they come
/// (its scheduler keeps one entry per object), so what queues here is at most one burst of
/// pointers.
pub type Changes<K> = mpsc::UnboundedReceiver<Arc<K>>;

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

/// How long an eviction is remembered: past [`crate::reconcile::EVICTED_PEER_GRACE`], the
/// longest the reconcile asks about one.
const EVICTION_MEMORY: std::time::Duration = std::time::Duration::from_secs(120);

/// Which replica groups lost a pod to the Eviction API, and when. A pod that a drain evicts
/// may be gone from the pod store before a reconcile looks, so the watch remembers it.
#[derive(Clone, Default)]
pub struct Evictions(Arc<Mutex<HashMap<EvictedGroup, Time>>>);

/// A replica group by namespace, InferenceService name and group number.
type EvictedGroup = (String, String, i32);

impl Evictions {
    fn note(&self, pod: &Pod) {
        let (Some(when), Some((group, _)), Some(service), Some(namespace)) = (
            fleet::evicted_at(pod),
            fleet::group_and_rank(pod),
            pod.labels().get(labels::INFERENCE_SERVICE),
            ResourceExt::namespace(pod),
        ) else {
            return;
        };
        let Ok(mut evictions) = self.0.lock() else {
            return;
        };
        let horizon = when.0 - EVICTION_MEMORY;
        evictions.retain(|_, at| at.0 > horizon);
        evictions.insert((namespace, service.clone(), group), when);
    }

    /// The replica groups of the InferenceService `service` evicted from, by group number.
    pub fn of(&self, namespace: &str, service: &str) -> BTreeMap<i32, Time> {
        let Ok(evictions) = self.0.lock() else {
            return BTreeMap::new();
        };
        evictions
            .iter()
            .filter(|((ns, name, _), _)| ns == namespace && name == service)
            .map(|((_, _, group), at)| (*group, at.clone()))
            .collect()
    }
}

/// How long a created pod the pod watch has not shown is taken to exist regardless. The watch
/// shows a create within milliseconds; past this the store is trusted again, so a pod created
/// and deleted while the watch was away (never shown) is not waited for longer than this.
const CREATION_MEMORY: std::time::Duration = std::time::Duration::from_secs(60);

/// Pods the operator created that the pod store may not show yet. A reconcile reads the store,
/// which trails the operator's own writes: a group's ranks are created one request after
/// another, and a reconcile that ran after the first rank's watch event but before the
/// second's would see a group missing a rank and delete it as broken. Each created pod stands
/// in for itself until the store shows its name, the watch reports it deleted, or
/// [`CREATION_MEMORY`] passes.
#[derive(Clone, Default)]
pub struct Creations(Arc<Mutex<HashMap<NamedPod, (Pod, std::time::Instant)>>>);

/// A pod by namespace and name.
type NamedPod = (String, String);

impl Creations {
    /// Remembers `pod`, as the apiserver answered its create.
    pub fn note(&self, pod: Pod) {
        let (Some(namespace), Ok(mut created)) = (ResourceExt::namespace(&pod), self.0.lock())
        else {
            return;
        };
        created.insert(
            (namespace, pod.name_any()),
            (pod, std::time::Instant::now()),
        );
    }

    /// Forgets `pod`, which the watch reported deleted, if it is the incarnation remembered.
    fn deleted(&self, pod: &Pod) {
        let (Some(namespace), Ok(mut created)) = (ResourceExt::namespace(pod), self.0.lock())
        else {
            return;
        };
        let key = (namespace, pod.name_any());
        if created
            .get(&key)
            .is_some_and(|(p, _)| ResourceExt::uid(p) == ResourceExt::uid(pod))
        {
            created.remove(&key);
        }
    }

    /// `held`, the pods the store holds for the InferenceService with UID `owner` in
    /// `namespace`, and the pods created for it that the store does not show yet. A created pod
    /// whose name the store shows is forgotten: the store holds that incarnation or a later one.
    pub fn with_unseen(&self, namespace: &str, owner: &str, mut held: Vec<Pod>) -> Vec<Pod> {
        let Ok(mut created) = self.0.lock() else {
            return held;
        };
        created.retain(|_, (_, at)| at.elapsed() < CREATION_MEMORY);
        let owned_here = |pod: &Pod| {
            ResourceExt::namespace(pod).as_deref() == Some(namespace)
                && pod
                    .owner_references()
                    .iter()
                    .any(|r| r.uid == owner && r.controller == Some(true))
        };
        let shown: Vec<String> = held.iter().map(|p| p.name_any()).collect();
        created.retain(|(_, name), (pod, _)| !(owned_here(pod) && shown.contains(name)));
        held.extend(
            created
                .values()
                .filter(|(pod, _)| owned_here(pod))
                .map(|(pod, _)| pod.clone()),
        );
        held
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
    pub evictions: Evictions,
    pub creations: Creations,
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
    pub inference_services: Changes<InferenceService>,
    pub pods: Changes<Pod>,
    pub services: Changes<PartialObjectMeta<Service>>,
    pub disruption_budgets: Changes<PartialObjectMeta<PodDisruptionBudget>>,
    pub rank_tables: Changes<PartialObjectMeta<ConfigMap>>,
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

/// The watch of `api` (retried with backoff, `managedFields` dropped) keeping `writer`'s
/// store filled, and its changes; `see` looks at every object the watch applies or deletes.
fn watch<K>(
    api: Api<K>,
    config: watcher::Config,
    writer: Writer<K>,
    mut see: impl FnMut(&watcher::Event<K>) + Send + 'static,
) -> (
    impl std::future::Future<Output = ()> + Send + 'static,
    Changes<K>,
)
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Eq + Hash + Clone + Default + Send + Sync,
{
    let events = watcher(api, config)
        .modify(without_managed_fields)
        .default_backoff()
        .inspect(move |event| {
            if let Ok(event) = event {
                see(event);
            }
        });
    reflect(events, writer)
}

/// Keeps `writer`'s store filled from `events`, and the changes: each announced once the
/// store holds it.
fn reflect<K, S>(
    events: S,
    mut writer: Writer<K>,
) -> (
    impl std::future::Future<Output = ()> + Send + 'static,
    Changes<K>,
)
where
    K: Lookup + Clone + Send + Sync + 'static,
    K::DynamicType: Eq + Hash + Clone + Default + Send + Sync,
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
{
    let store = writer.as_reader();
    let (changes, announced) = mpsc::unbounded();
    let filling = drive(events.map(move |event| {
        let event = event?;
        let before = matches!(event, watcher::Event::InitDone).then(|| store.state());
        writer.apply_watcher_event(&event);
        for object in changed(&event, before, &store) {
            // Only a dropped controller stops reading, and then nothing needs telling.
            let _ = changes.unbounded_send(object);
        }
        Ok::<_, watcher::Error>(())
    }));
    (filling, announced)
}

/// What `event`, just applied to `store`, changed. A completed (re)list changed everything the
/// store holds and everything it held `before` that the list no longer has: those were deleted
/// while the watch was away, and their owners must hear of it as of any deletion.
fn changed<K>(
    event: &watcher::Event<K>,
    before: Option<Vec<Arc<K>>>,
    store: &Store<K>,
) -> Vec<Arc<K>>
where
    K: Lookup + Clone + 'static,
    K::DynamicType: Eq + Hash + Clone + Default,
{
    match event {
        watcher::Event::Apply(object) | watcher::Event::Delete(object) => {
            vec![Arc::new(object.clone())]
        }
        watcher::Event::InitDone => {
            let now = store.state();
            let gone = before.into_iter().flatten().filter(|object| {
                store
                    .get(&ObjectRef::from_obj_with(
                        object.as_ref(),
                        Default::default(),
                    ))
                    .is_none()
            });
            let mut all: Vec<_> = gone.collect();
            all.extend(now);
            all
        }
        watcher::Event::Init | watcher::Event::InitApply(_) => Vec::new(),
    }
}

impl Default for Cache {
    fn default() -> Self {
        Self::new()
    }
}

impl Cache {
    pub fn new() -> Self {
        let (inference_services, inference_services_writer) = reflector::store();
        let (pods, pods_writer) = reflector::store();
        let (services, services_writer) = reflector::store();
        let (disruption_budgets, disruption_budgets_writer) = reflector::store();
        let (rank_tables, rank_tables_writer) = reflector::store();
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
                evictions: Evictions::default(),
                creations: Creations::default(),
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
        let (inference_services, inference_services_changes) = watch(
            scope.api::<InferenceService>(client),
            watcher::Config::default(),
            writers.inference_services,
            |_| {},
        );
        let evictions = self.stores.evictions.clone();
        let creations = self.stores.creations.clone();
        let (pods, pods_changes) = watch(
            scope.api::<Pod>(client),
            managed.clone(),
            writers.pods,
            move |event| match event {
                watcher::Event::Apply(pod) | watcher::Event::InitApply(pod) => {
                    evictions.note(pod);
                }
                watcher::Event::Delete(pod) => creations.deleted(pod),
                watcher::Event::Init | watcher::Event::InitDone => {}
            },
        );
        let (services, services_changes) = watch(
            scope.api::<PartialObjectMeta<Service>>(client),
            managed.clone(),
            writers.services,
            |_| {},
        );
        let (disruption_budgets, disruption_budgets_changes) = watch(
            scope.api::<PartialObjectMeta<PodDisruptionBudget>>(client),
            managed.clone(),
            writers.disruption_budgets,
            |_| {},
        );
        let (rank_tables, rank_tables_changes) = watch(
            scope.api::<PartialObjectMeta<ConfigMap>>(client),
            managed.clone(),
            writers.rank_tables,
            |_| {},
        );
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
                inference_services,
                pods,
                services,
                disruption_budgets,
                rank_tables,
                synced
            );
        };
        Some(Started {
            inference_services: inference_services_changes,
            pods: pods_changes,
            services: services_changes,
            disruption_budgets: disruption_budgets_changes,
            rank_tables: rank_tables_changes,
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
    use std::time::Duration;

    use futures::StreamExt;
    use k8s_openapi::api::core::v1::Pod;
    use kube::ResourceExt;
    use kube::runtime::{reflector, watcher::Event};

    use super::{Creations, WatchScope, reflect};

    fn pod(name: &str) -> Pod {
        let mut pod = Pod::default();
        pod.metadata.name = Some(name.to_string());
        pod.metadata.namespace = Some("team-a".to_string());
        pod
    }

    /// Runs `events` through a store whose changes nobody reads until the watch has ended, and
    /// returns the names the store holds and the names it announced, in order.
    async fn reflect_unread(events: Vec<Event<Pod>>) -> (Vec<String>, Vec<String>) {
        let (store, writer) = reflector::store();
        let (watch, changes) = reflect(futures::stream::iter(events.into_iter().map(Ok)), writer);
        tokio::time::timeout(Duration::from_secs(30), watch)
            .await
            .expect("the store never waits for its reader");
        let mut held: Vec<_> = store.state().iter().map(|p| p.name_any()).collect();
        held.sort();
        let announced = changes.map(|p| p.name_any()).collect().await;
        (held, announced)
    }

    #[tokio::test]
    async fn a_burst_of_pods_that_come_and_go_is_all_announced_and_never_stalls_the_store() {
        // More short-lived pods than any buffer, none read until the end: each is deleted
        // before its reader could look at it, which is what stalled the shared reflector.
        let mut events = vec![Event::Init, Event::InitDone];
        for i in 0..3000 {
            let name = format!("burst-{i}");
            events.push(Event::Apply(pod(&name)));
            events.push(Event::Delete(pod(&name)));
        }
        events.push(Event::Apply(pod("survivor")));
        let (held, announced) = reflect_unread(events).await;
        assert_eq!(held, ["survivor"]);
        assert_eq!(announced.len(), 6001);
        assert_eq!(announced[0], "burst-0");
        assert_eq!(announced[1], "burst-0", "a deletion is announced too");
        assert_eq!(announced.last().map(String::as_str), Some("survivor"));
    }

    #[tokio::test]
    async fn a_relist_announces_what_was_deleted_while_the_watch_was_away() {
        let events = vec![
            Event::Init,
            Event::InitApply(pod("a")),
            Event::InitApply(pod("b")),
            Event::InitDone,
            // The watch broke and listed again; `a` went in the meantime.
            Event::Init,
            Event::InitApply(pod("b")),
            Event::InitApply(pod("c")),
            Event::InitDone,
        ];
        let (held, announced) = reflect_unread(events).await;
        assert_eq!(held, ["b", "c"]);
        let (first, second) = announced.split_at(2);
        let sorted = |names: &[String]| {
            let mut names = names.to_vec();
            names.sort();
            names
        };
        assert_eq!(sorted(first), ["a", "b"]);
        assert_eq!(
            sorted(second),
            ["a", "b", "c"],
            "the vanished pod is announced"
        );
    }

    #[test]
    fn an_empty_watch_namespace_means_every_namespace() {
        let parse = |text: &str| text.parse::<WatchScope>().expect("infallible");
        assert_eq!(parse("").namespace(), None);
        assert_eq!(parse("  ").namespace(), None);
        assert_eq!(parse(" team-a ").namespace(), Some("team-a"));
        assert_eq!(parse(""), WatchScope::default());
    }

    fn created(name: &str, uid: &str, owner: &str) -> Pod {
        let mut pod = pod(name);
        pod.metadata.uid = Some(uid.to_string());
        pod.metadata.owner_references = Some(vec![
            k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                uid: owner.to_string(),
                controller: Some(true),
                ..Default::default()
            },
        ]);
        pod
    }

    #[test]
    fn a_created_pod_stands_in_for_itself_until_the_store_or_a_deletion_shows_it() {
        let creations = Creations::default();
        creations.note(created("tp-0-0", "a", "isvc"));
        creations.note(created("tp-0-1", "b", "isvc"));
        creations.note(created("other-0-0", "c", "other"));
        let names = |pods: Vec<Pod>| -> Vec<String> {
            let mut names: Vec<String> = pods.iter().map(|p| p.name_any()).collect();
            names.sort();
            names
        };
        // The store shows rank 0 only: rank 1 is added, the other service's pod is not.
        let held = vec![created("tp-0-0", "a", "isvc")];
        assert_eq!(
            names(creations.with_unseen("team-a", "isvc", held.clone())),
            ["tp-0-0", "tp-0-1"]
        );
        assert_eq!(
            names(creations.with_unseen("team-b", "isvc", Vec::new())),
            Vec::<String>::new()
        );
        // A deletion of another incarnation of the name leaves the one created.
        creations.deleted(&created("tp-0-1", "older", "isvc"));
        assert_eq!(
            names(creations.with_unseen("team-a", "isvc", held.clone())),
            ["tp-0-0", "tp-0-1"]
        );
        creations.deleted(&created("tp-0-1", "b", "isvc"));
        assert_eq!(
            names(creations.with_unseen("team-a", "isvc", held)),
            ["tp-0-0"]
        );
        // Rank 0 was forgotten once the store showed it: an empty store now means gone.
        assert_eq!(
            names(creations.with_unseen("team-a", "isvc", Vec::new())),
            Vec::<String>::new()
        );
    }
}

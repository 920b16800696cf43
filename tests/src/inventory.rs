//! What the operator made for one InferenceService, read back from the apiserver, against what
//! it should have made for the service's spec: a fault test's check that a fleet converged
//! with nothing duplicated, orphaned or left behind.

use std::collections::BTreeSet;

use anyhow::Result;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DynamicObject, ListParams};
use kube::{Client, Resource};
use npufleet_crds::InferenceService;
use npufleet_operator::labels;
use npufleet_operator::resources::{names, pod_group};

/// Object names, in order.
pub type Names = BTreeSet<String>;

/// The names of the objects of each kind that carry a service's label.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Inventory {
    pub pods: Names,
    pub config_maps: Names,
    pub pod_groups: Names,
    pub services: Names,
    pub disruption_budgets: Names,
    /// Objects among these whose controller is not the service of that name as it is now
    /// (an earlier incarnation's leftovers, or no controller at all), as `kind/name`.
    pub foreign: Names,
}

impl Inventory {
    /// Everything in `namespace` labelled as made for the InferenceService `name`;
    /// `pod_groups` only when the PodGroup API is served. `uid` is the live service's, if any.
    pub async fn read(
        client: &Client,
        namespace: &str,
        name: &str,
        uid: Option<&str>,
        pod_groups: bool,
    ) -> Result<Self> {
        let params = ListParams::default().labels(&format!("{}={name}", labels::INFERENCE_SERVICE));
        let mut inventory = Self::default();
        let mut take = |kind: &str, meta: &ObjectMeta, into: fn(&mut Self) -> &mut Names| {
            let object = meta.name.clone().unwrap_or_default();
            let owned = meta.owner_references.iter().flatten().any(|owner| {
                owner.controller == Some(true)
                    && owner.kind == "InferenceService"
                    && Some(owner.uid.as_str()) == uid
            });
            if !owned {
                inventory.foreign.insert(format!("{kind}/{object}"));
            }
            into(&mut inventory).insert(object);
        };
        for pod in Api::<Pod>::namespaced(client.clone(), namespace)
            .list(&params)
            .await?
        {
            // A pod on its way out is not a duplicate; its replacement is counted.
            if pod.metadata.deletion_timestamp.is_none() {
                take("Pod", pod.meta(), |i| &mut i.pods);
            }
        }
        for map in Api::<ConfigMap>::namespaced(client.clone(), namespace)
            .list(&params)
            .await?
        {
            take("ConfigMap", map.meta(), |i| &mut i.config_maps);
        }
        for service in Api::<Service>::namespaced(client.clone(), namespace)
            .list(&params)
            .await?
        {
            take("Service", service.meta(), |i| &mut i.services);
        }
        for budget in Api::<PodDisruptionBudget>::namespaced(client.clone(), namespace)
            .list(&params)
            .await?
        {
            take("PodDisruptionBudget", budget.meta(), |i| {
                &mut i.disruption_budgets
            });
        }
        if pod_groups {
            let api: Api<DynamicObject> =
                Api::namespaced_with(client.clone(), namespace, &pod_group::api_resource());
            for group in api.list(&params).await? {
                take("PodGroup", group.meta(), |i| &mut i.pod_groups);
            }
        }
        Ok(inventory)
    }

    /// What the operator makes for `service` at `spec.replicas` groups numbered from 0 (no
    /// autoscaling, no rollout in flight): every rank's pod, a rank table per group when the
    /// pods need one, a PodGroup per group when gang-scheduled, the two Services and the
    /// budget, all controlled by the service.
    pub fn expected(service: &InferenceService, rank_tables: bool, pod_groups: bool) -> Self {
        let groups = 0..service.spec.replicas.max(0);
        let ranks = service.pods_per_replica();
        Self {
            pods: groups
                .clone()
                .flat_map(|g| (0..ranks).map(move |r| names::pod(service, g, r)))
                .collect(),
            config_maps: groups
                .clone()
                .filter(|_| rank_tables)
                .map(|g| names::rank_table(service, g))
                .collect(),
            pod_groups: groups
                .filter(|_| pod_groups)
                .map(|g| names::group(service, g))
                .collect(),
            services: [
                names::headless_service(service),
                names::client_service(service),
            ]
            .into_iter()
            .collect(),
            disruption_budgets: [names::disruption_budget(service)].into_iter().collect(),
            foreign: Names::new(),
        }
    }

    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

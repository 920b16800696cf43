//! The control plane restarting under a running operator: kube-apiserver, then etcd, are
//! killed and started again while the operator binary (leader election on) manages an
//! InferenceService. The operator must carry on without a restart of its own; the figure is
//! the time from the control plane serving again to the operator's next applied change.
//!
//! Its own test binary, because it takes down the cluster every test of a binary shares.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use kube::api::{Api, DynamicObject, ListParams};
use kube::core::ApiResource;
use kube::{Client, ResourceExt};
use npufleet_crds::InferenceService;
use npufleet_operator::labels;
use npufleet_operator::resources::names;
use npufleet_tests::{cluster, service, wait};
use serde_json::json;

const MANAGER: &str = "faults-control-plane-test";
const IDENTITY: &str = "operator-under-restarts";
/// The operator must apply a change within this of the control plane serving again.
const RECOVERY_PROMISE: Duration = Duration::from_secs(15);

/// Waits until a fresh client gets `/readyz` from kube-apiserver; returns how long it took.
async fn wait_apiserver_ready(c: &cluster::Cluster, since: Instant) -> Result<Duration> {
    wait::until(
        "kube-apiserver ready again",
        Duration::from_secs(90),
        || async {
            c.ensure_running().map_err(wait::fatal)?;
            let readyz = http::Request::get("/readyz").body(Vec::new())?;
            c.client().await?.request_text(readyz).await?;
            Ok(Some(since.elapsed()))
        },
    )
    .await
}

/// Sets `chat`'s replicas and returns how long until the operator has made that many pods.
async fn scale_and_time(client: &Client, namespace: &str, replicas: i32) -> Result<Duration> {
    let services: Api<InferenceService> = Api::namespaced(client.clone(), namespace);
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let asked = Instant::now();
    // The admin's own write may meet an apiserver still finishing its start: retry it.
    wait::until(
        "the scale request accepted",
        Duration::from_secs(30),
        || async {
            npufleet_tests::operator::scale(&services, "chat", replicas).await?;
            Ok(Some(()))
        },
    )
    .await?;
    wait::until(
        &format!("{replicas} worker pods"),
        Duration::from_secs(90),
        || async {
            let count = pods.list(&ListParams::default()).await?.items.len();
            Ok((count == replicas as usize).then(|| asked.elapsed()))
        },
    )
    .await
}

/// Exactly the objects `replicas` single-pod groups of `service` need, by the operator's own
/// names: no duplicates, nothing left over.
async fn assert_converged(
    client: &Client,
    service: &InferenceService,
    replicas: i32,
) -> Result<()> {
    let namespace = service.namespace().context("namespace")?;
    let names_of =
        |items: Vec<Option<String>>| -> BTreeSet<String> { items.into_iter().flatten().collect() };
    let owned = ListParams::default().labels(&format!(
        "{}={}",
        labels::INFERENCE_SERVICE,
        service.name_any()
    ));
    // The names of the objects of `kind` labelled as the service's.
    let labelled = async |kind: ApiResource| -> Result<BTreeSet<String>> {
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &namespace, &kind);
        let listed = api.list(&owned).await?.items;
        Ok(names_of(
            listed.into_iter().map(|o| o.metadata.name).collect(),
        ))
    };

    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let listed = pods.list(&ListParams::default()).await?.items;
    let pod_count = listed.len();
    let pod_names = names_of(listed.into_iter().map(|p| p.metadata.name).collect());
    let expected: BTreeSet<String> = (0..replicas).map(|g| names::pod(service, g, 0)).collect();
    assert_eq!(pod_names, expected, "worker pods after the restarts");
    assert_eq!(pod_count, expected.len(), "duplicate worker pods");

    let tables = labelled(ApiResource::erase::<ConfigMap>(&())).await?;
    let allowed: BTreeSet<String> = (0..replicas)
        .map(|g| names::rank_table(service, g))
        .collect();
    assert!(
        tables.is_subset(&allowed),
        "ConfigMaps {tables:?}, groups' rank tables {allowed:?}"
    );

    let found = labelled(ApiResource::erase::<Service>(&())).await?;
    let allowed: BTreeSet<String> = [
        names::headless_service(service),
        names::client_service(service),
    ]
    .into_iter()
    .collect();
    assert!(
        found.is_subset(&allowed),
        "Services {found:?}, expected within {allowed:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_recovers_from_apiserver_and_etcd_restarts_without_restarting() -> Result<()> {
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let namespace = c.namespace(&client, "faults-control-plane").await?;
        npufleet_tests::crd::install_inference_service(&client, MANAGER).await?;
        let mut operator =
            npufleet_tests::operator::spawn_binary(c, c.kubeconfig(), &namespace, IDENTITY)?;
        npufleet_tests::operator::wait_leader(
            &client,
            &namespace,
            IDENTITY,
            Duration::from_secs(60),
        )
        .await?;

        let services: Api<InferenceService> = Api::namespaced(client.clone(), &namespace);
        let service = service::unread_smollm2(&namespace, "chat", json!({"replicas": 1}))?;
        npufleet_tests::operator::apply(&services, MANAGER, &service).await?;
        let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
        wait::until("the first worker pod", Duration::from_secs(60), || async {
            Ok((!pods.list(&ListParams::default()).await?.items.is_empty()).then_some(()))
        })
        .await?;
        let baseline = scale_and_time(&client, &namespace, 2).await?;
        eprintln!(
            "baseline: a scale change applied in {:.2} s",
            baseline.as_secs_f64()
        );

        let mut replicas = 2;
        for component in ["kube-apiserver", "etcd"] {
            let killed = Instant::now();
            c.restart(component)?;
            let down = wait_apiserver_ready(c, killed).await?;
            // A client from before the restart: its connections died with the server.
            let client = c.client().await?;
            replicas += 1;
            let applied = scale_and_time(&client, &namespace, replicas).await?;
            eprintln!(
                "{component} restart: the API served again {:.2} s after the kill; the operator \
                 applied the next change {:.2} s after that",
                down.as_secs_f64(),
                applied.as_secs_f64()
            );
            operator.ensure_running()?;
            assert!(
                applied < RECOVERY_PROMISE,
                "after the {component} restart the operator took {applied:?}"
            );
        }
        let client = c.client().await?;
        let service = Api::<InferenceService>::namespaced(client.clone(), &namespace)
            .get("chat")
            .await?;
        assert_converged(&client, &service, replicas).await?;
        let holder = npufleet_tests::operator::leader(&client, &namespace).await?;
        assert_eq!(holder.as_deref(), Some(IDENTITY));
        operator.ensure_running().context("the operator exited")?;
        Ok(())
    })
    .await
}

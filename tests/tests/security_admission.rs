//! Security as the apiserver enforces it, not as the manifests read: the chart installed as
//! shipped into a namespace enforcing the `restricted` Pod Security Standard gets its operator
//! and router pods admitted, and so do the worker pods the operator makes there (CPU and
//! Ascend); SubjectAccessReviews over every resource the apiserver serves show that the
//! operator's and the router's ServiceAccounts read no Secret and write nothing beyond their
//! own kinds.

use std::collections::BTreeSet;
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail, ensure};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::Client;
use kube::api::{Api, ListParams, Patch, PatchParams};
use npufleet_crds::InferenceService;
use npufleet_tests::access::{self, Access, ServiceAccount};
use npufleet_tests::{cluster, operator, paths, process, runtime, wait};
use serde::Deserialize;
use serde_json::json;

const RELEASE: &str = "npufleet";
const ROUTER: &str = "npufleet-router";
const MANAGER: &str = "security-admission-test";
const TIMEOUT: Duration = Duration::from_secs(60);
const RBAC: &str = <k8s_openapi::api::rbac::v1::ClusterRole as k8s_openapi::Resource>::GROUP;
/// The verbs that change state, as discovery lists them.
const WRITE_VERBS: [&str; 5] = ["create", "update", "patch", "delete", "deletecollection"];

/// The chart installed once for this binary's tests, with its defaults (two operator and two
/// router replicas, external metrics off), into a namespace enforcing `restricted`; its name.
fn release_namespace() -> &'static str {
    static NAMESPACE: OnceLock<String> = OnceLock::new();
    NAMESPACE.get_or_init(|| {
        runtime::block_on_own_thread(install_into_restricted_namespace())
            .unwrap_or_else(|e| panic!("installing the chart: {e:#}"))
    })
}

async fn install_into_restricted_namespace() -> Result<String> {
    let c = cluster::shared();
    let client = c.client().await?;
    let namespace = c.namespace(&client, "restricted").await?;
    enforce_restricted(&client, &namespace).await?;
    let mut helm = c.helm();
    helm.args(["install", RELEASE])
        .arg(paths::repo_root().join("charts/npufleet"))
        .args(["--namespace", &namespace]);
    process::stdout_of(helm).context("helm install")?;
    Ok(namespace)
}

async fn enforce_restricted(client: &Client, namespace: &str) -> Result<()> {
    let label = json!({"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "latest",
    }}});
    Api::<Namespace>::all(client.clone())
        .patch(namespace, &PatchParams::default(), &Patch::Merge(label))
        .await?;
    Ok(())
}

/// The apiserver's refusal of a pod, where a controller recorded one as a `ReplicaFailure`.
fn replica_failure(conditions: &[(String, String, String)]) -> Option<String> {
    conditions
        .iter()
        .find(|(kind, status, _)| kind == "ReplicaFailure" && status == "True")
        .map(|(_, _, message)| message.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_and_the_worker_pods_are_admitted_where_restricted_is_enforced() -> Result<()> {
    npufleet_tests::on_shared_cluster(|_, client| async move {
        let namespace = release_namespace();

        // Each Deployment's ReplicaSet creates all its pods; a refusal by admission would
        // leave it short, with the apiserver's words in a ReplicaFailure condition.
        let deployments = Api::<Deployment>::namespaced(client.clone(), namespace)
            .list(&ListParams::default())
            .await?
            .items;
        let names: BTreeSet<String> = deployments
            .iter()
            .filter_map(|d| d.metadata.name.clone())
            .collect();
        ensure!(
            names == BTreeSet::from([RELEASE.to_owned(), ROUTER.to_owned()]),
            "the chart made the Deployments {names:?}"
        );
        let wanted: i32 = deployments
            .iter()
            .filter_map(|d| d.spec.as_ref()?.replicas)
            .sum();
        let replica_sets: Api<ReplicaSet> = Api::namespaced(client.clone(), namespace);
        let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
        wait::until("every pod of the chart created", TIMEOUT, || async {
            for set in replica_sets.list(&ListParams::default()).await?.items {
                let conditions: Vec<_> = set
                    .status
                    .iter()
                    .flat_map(|s| s.conditions.iter().flatten())
                    .map(|c| {
                        (
                            c.type_.clone(),
                            c.status.clone(),
                            c.message.clone().unwrap_or_default(),
                        )
                    })
                    .collect();
                if let Some(refusal) = replica_failure(&conditions) {
                    let name = set.metadata.name.unwrap_or_default();
                    return Err(wait::fatal(anyhow!("ReplicaSet {name}: {refusal}")));
                }
            }
            let created = pods.list(&ListParams::default()).await?.items.len();
            Ok((created == wanted as usize).then_some(()))
        })
        .await?;

        // The worker pods the operator makes in that namespace, on CPU and on an Ascend 910.
        // Helm applied the CRD with the chart; the operator needs it served.
        npufleet_tests::crd::wait_established(&client, "inferenceservices.npufleet.io").await?;
        let _operator = operator::start_with_builtin_autoscaler(&client, namespace)?;
        let services: Api<InferenceService> = Api::namespaced(client.clone(), namespace);
        for (name, accelerator) in [
            ("cpu", json!({"type": "cpu"})),
            ("npu", json!({"type": "ascend910", "devicesPerPod": 1})),
        ] {
            let service = npufleet_tests::service::unread(
                namespace,
                name,
                json!({"accelerator": accelerator}),
            )?;
            operator::apply(&services, MANAGER, &service).await?;
        }
        for name in ["cpu", "npu"] {
            let selector = format!("npufleet.io/inference-service={name}");
            wait::until(&format!("the worker pod of {name}"), TIMEOUT, || async {
                let status = services.get(name).await?.status.unwrap_or_default();
                let conditions: Vec<_> = status
                    .conditions
                    .iter()
                    .map(|c| (c.type_.clone(), c.status.clone(), c.message.clone()))
                    .collect();
                if let Some(refusal) = replica_failure(&conditions) {
                    return Err(wait::fatal(anyhow!("InferenceService {name}: {refusal}")));
                }
                let made = pods
                    .list(&ListParams::default().labels(&selector))
                    .await?
                    .items;
                Ok((!made.is_empty()).then_some(()))
            })
            .await?;
        }
        Ok(())
    })
    .await
}

/// Every shipped sample (`deploy/samples/*.yaml`) is an InferenceService the apiserver accepts
/// (server-side dry run: schema and CEL rules), and every worker pod the operator renders from
/// it is admitted where `restricted` is enforced (dry run: Pod Security admission), for each
/// engine the samples run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sample_is_accepted_and_its_pods_are_admitted_where_restricted_is_enforced()
-> Result<()> {
    npufleet_tests::on_shared_cluster(|_, client| async move {
        let namespace = release_namespace();
        npufleet_tests::crd::wait_established(&client, "inferenceservices.npufleet.io").await?;
        let services: Api<InferenceService> = Api::namespaced(client.clone(), namespace);
        let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
        let dry_run = kube::api::PostParams {
            dry_run: true,
            field_manager: Some(MANAGER.to_owned()),
        };
        let settings = npufleet_operator::settings::Settings::default();
        let dir = paths::repo_root().join("deploy/samples");
        let mut engines = BTreeSet::new();
        let mut files: Vec<_> = std::fs::read_dir(&dir)?.collect::<Result<_, _>>()?;
        files.sort_by_key(std::fs::DirEntry::path);
        for file in files {
            let path = file.path();
            let text = std::fs::read_to_string(&path)?;
            for document in serde_yaml::Deserializer::from_str(&text) {
                let value = serde_json::Value::deserialize(document)?;
                if value["kind"] != "InferenceService" {
                    continue;
                }
                let mut service: InferenceService =
                    serde_json::from_value(value).with_context(|| format!("{}", path.display()))?;
                service.metadata.namespace = Some(namespace.to_owned());
                let accepted = services
                    .create(&dry_run, &service)
                    .await
                    .with_context(|| format!("{} refused", path.display()))?;
                engines.insert(accepted.spec.runtime.engine.as_str());
                for rank in 0..accepted.pods_per_replica() {
                    let pod = npufleet_operator::resources::pod::build(
                        &accepted, &settings, 0, rank, "sample",
                    );
                    pods.create(&dry_run, &pod).await.with_context(|| {
                        format!("rank {rank} of {} not admitted", path.display())
                    })?;
                }
            }
        }
        ensure!(
            engines.len() >= 2,
            "the samples run only the engines {engines:?}"
        );
        Ok(())
    })
    .await
}

/// What each account may write, and where; the promise the chart's RBAC keeps.
fn promised_writes(namespace: &str) -> Vec<(&'static str, Access)> {
    let mut promised = Vec::new();
    let everywhere = |verb, group, resource| Access::new(verb, group, resource, None);
    for resource in ["pods", "services", "configmaps"] {
        for verb in ["create", "patch", "delete"] {
            promised.push((RELEASE, everywhere(verb, "", resource)));
        }
    }
    for (group, resource) in [
        ("policy", "poddisruptionbudgets"),
        ("autoscaling", "horizontalpodautoscalers"),
    ] {
        for verb in ["create", "patch", "delete"] {
            promised.push((RELEASE, everywhere(verb, group, resource)));
        }
    }
    for verb in ["create", "patch"] {
        promised.push((RELEASE, everywhere(verb, "events.k8s.io", "events")));
        promised.push((
            RELEASE,
            Access::new(verb, "coordination.k8s.io", "leases", Some(namespace)),
        ));
    }
    for resource in ["inferenceservices/status", "inferenceservices/scale"] {
        for verb in ["patch", "update"] {
            promised.push((RELEASE, everywhere(verb, "npufleet.io", resource)));
        }
    }
    // The wake-up annotation on a service scaled to zero.
    promised.push((
        ROUTER,
        everywhere("patch", "npufleet.io", "inferenceservices"),
    ));
    // Kubernetes' own `system:basic-user`, bound to every authenticated user.
    for account in [RELEASE, ROUTER] {
        for (group, resource) in [
            ("authorization.k8s.io", "selfsubjectaccessreviews"),
            ("authorization.k8s.io", "selfsubjectrulesreviews"),
            ("authentication.k8s.io", "selfsubjectreviews"),
        ] {
            promised.push((account, everywhere("create", group, resource)));
        }
    }
    promised
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_accounts_read_no_secret_and_write_only_their_own_kinds() -> Result<()> {
    npufleet_tests::on_shared_cluster(|_, client| async move {
        let namespace = release_namespace();
        let accounts = [
            ServiceAccount::new(namespace, RELEASE),
            ServiceAccount::new(namespace, ROUTER),
        ];

        // Every write the apiserver could be asked for, in the release namespace and across
        // all of them. The operator's own external metrics API is not served here (its pods do
        // not run) and is read-only.
        let served = access::served_resources(&client, &["external.metrics.k8s.io"]).await?;
        let mut asked = Vec::new();
        for resource in &served {
            let scopes = if resource.namespaced {
                vec![Some(namespace), None]
            } else {
                vec![None]
            };
            for verb in WRITE_VERBS
                .iter()
                .filter(|v| resource.verbs.iter().any(|s| s == *v))
            {
                for scope in &scopes {
                    for account in &accounts {
                        let access = Access::new(verb, &resource.group, &resource.resource, *scope);
                        asked.push((account.clone(), access));
                    }
                }
            }
        }
        // Secrets, read, anywhere; and the verbs that hand out more than the account holds.
        for account in &accounts {
            for verb in ["get", "list", "watch"] {
                for scope in [Some(namespace), None] {
                    asked.push((account.clone(), Access::new(verb, "", "secrets", scope)));
                }
            }
            for (verb, group, resource) in [
                ("impersonate", "", "serviceaccounts"),
                ("impersonate", "", "users"),
                ("escalate", RBAC, "clusterroles"),
                ("bind", RBAC, "clusterroles"),
                ("create", "", "serviceaccounts/token"),
                ("create", "", "pods/exec"),
            ] {
                asked.push((
                    account.clone(),
                    Access::new(verb, group, resource, Some(namespace)),
                ));
            }
        }

        let decided: Vec<(ServiceAccount, Access, bool)> = futures::stream::iter(asked)
            .map(|(account, access)| {
                let client = client.clone();
                async move {
                    let allowed = access::allowed(&client, &account, &access).await?;
                    anyhow::Ok((account, access, allowed))
                }
            })
            .buffer_unordered(16)
            .try_collect()
            .await?;

        let promised = promised_writes(namespace);
        let is_promised = |account: &ServiceAccount, access: &Access| {
            promised
                .iter()
                .any(|(name, granted)| *name == account.name && granted == access)
                // What holds across all namespaces holds in the release namespace too.
                || access.namespace.is_some()
                    && promised.iter().any(|(name, granted)| {
                        *name == account.name
                            && granted.namespace.is_none()
                            && *granted == Access { namespace: None, ..access.clone() }
                    })
        };
        let mut beyond = Vec::new();
        let mut granted = Vec::new();
        for (account, access, allowed) in &decided {
            match (allowed, is_promised(account, access)) {
                (true, false) => beyond.push(format!("{}: {access}", account.name)),
                (true, true) => granted.push((account.name.clone(), access.clone())),
                _ => {}
            }
        }
        let missing: Vec<String> = promised
            .iter()
            .filter(|(name, access)| !granted.iter().any(|(n, a)| n == name && a == access))
            .map(|(name, access)| format!("{name}: {access}"))
            .collect();
        eprintln!(
            "{} access reviews over {} served resources: {} allowed, all of them promised",
            decided.len(),
            served.len(),
            granted.len()
        );
        if !beyond.is_empty() {
            bail!("allowed beyond the promise: {beyond:#?}");
        }
        ensure!(
            missing.is_empty(),
            "promised but refused (the product needs these): {missing:#?}"
        );
        Ok(())
    })
    .await
}

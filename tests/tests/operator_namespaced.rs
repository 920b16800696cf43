//! The namespaced install: the chart installed with `watchNamespace`, the operator and router
//! binaries running with nothing but the chart's ServiceAccount tokens, confined to the watched
//! namespace. RBAC is a Role there for each, so neither may list or watch cluster-wide, an
//! InferenceService elsewhere is neither seen nor touched, and the release makes nothing
//! cluster-scoped: a second release of the same name in another namespace installs beside it.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use npufleet_crds::InferenceService;
use npufleet_tests::access::{self, Access, ServiceAccount};
use npufleet_tests::fleet::RunningRouter;
use npufleet_tests::net::free_port;
use npufleet_tests::process::Process;
use npufleet_tests::{cluster, operator, paths, process, wait};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(90);
const RELEASE: &str = "npufleet";
const RELEASE_NAMESPACE: &str = "npufleet-system";
/// The chart's router ServiceAccount: the release's name and `-router`.
const ROUTER_ACCOUNT: &str = "npufleet-router";
const IDENTITY: &str = "namespaced-operator";
const MANAGER: &str = "operator-namespaced-test";
/// Resources only the operator's own Role may grant it.
const WORKLOAD_RESOURCES: [&str; 3] = ["pods", "services", "configmaps"];

/// Whether the apiserver lets ServiceAccount `account` of the release list pods in
/// `namespace` (or in every namespace when `None`).
async fn may_list_pods(client: &Client, account: &str, namespace: Option<&str>) -> Result<bool> {
    access::allowed(
        client,
        &ServiceAccount::new(RELEASE_NAMESPACE, account),
        &Access::new("list", "", "pods", namespace),
    )
    .await
}

/// `helm install` of the chart as release [`RELEASE`] in `release_namespace`, confined to
/// `watched`, with its defaults otherwise (the router included).
fn install_namespaced(c: &cluster::Cluster, release_namespace: &str, watched: &str) -> Result<()> {
    let mut helm = c.helm();
    helm.args(["install", RELEASE])
        .arg(paths::repo_root().join("charts/npufleet"))
        .args(["--namespace", release_namespace, "--create-namespace"])
        .args(["--set", &format!("watchNamespace={watched}")]);
    process::stdout_of(helm)
        .with_context(|| format!("helm install in {release_namespace} watching {watched}"))?;
    Ok(())
}

fn service(namespace: &str) -> Result<InferenceService> {
    npufleet_tests::service::unread_smollm2(namespace, "chat", json!({"replicas": 1}))
}

fn is_ready(service: &InferenceService) -> bool {
    service.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
    })
}

#[tokio::test]
async fn a_namespaced_install_reconciles_only_its_namespace() -> Result<()> {
    let c = cluster::shared();
    let result = namespaced_install(c).await;
    c.diagnose(result)
}

async fn namespaced_install(c: &cluster::Cluster) -> Result<()> {
    let client = c.client().await?;
    let watched = c.namespace(&client, "watched").await?;
    let outside = c.namespace(&client, "outside").await?;

    let chart = paths::repo_root().join("charts/npufleet");
    process::stdout_of({
        let mut lint = c.helm();
        lint.args(["lint", "--strict"])
            .arg(&chart)
            .args(["--set", &format!("watchNamespace={watched}")]);
        lint
    })?;
    install_namespaced(c, RELEASE_NAMESPACE, &watched)?;
    // A second team's release of the same name, in its own namespace, beside the first: it
    // would collide on any cluster-scoped object both made.
    let second_release_namespace = c.namespace(&client, "second-release").await?;
    let second_watched = c.namespace(&client, "second-watched").await?;
    install_namespaced(c, &second_release_namespace, &second_watched)?;

    // (a) The operator's workload rules are a Role in the watched namespace; no cluster-wide
    // binding of its ServiceAccount grants any of them.
    let role = Api::<Role>::namespaced(client.clone(), &watched)
        .get(RELEASE)
        .await?;
    let granted: Vec<String> = role
        .rules
        .unwrap_or_default()
        .into_iter()
        .flat_map(|r| r.resources.unwrap_or_default())
        .collect();
    for resource in WORKLOAD_RESOURCES {
        assert!(granted.iter().any(|g| g == resource), "{granted:?}");
    }
    let binding = Api::<RoleBinding>::namespaced(client.clone(), &watched)
        .get(RELEASE)
        .await?;
    assert_eq!(
        (
            binding.role_ref.kind.as_str(),
            binding.role_ref.name.as_str()
        ),
        ("Role", RELEASE)
    );
    let cluster_roles = Api::<ClusterRole>::all(client.clone());
    let bindings = Api::<ClusterRoleBinding>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    for binding in bindings.items {
        let binds = |account: &str| {
            binding.subjects.iter().flatten().any(|s| {
                s.kind == "ServiceAccount"
                    && s.name == account
                    && s.namespace.as_deref() == Some(RELEASE_NAMESPACE)
            })
        };
        assert!(
            !binds(ROUTER_ACCOUNT),
            "ClusterRoleBinding {} binds the router",
            binding.name_any()
        );
        if !binds(RELEASE) {
            continue;
        }
        let role = cluster_roles.get(&binding.role_ref.name).await?;
        for rule in role.rules.unwrap_or_default() {
            let resources = rule.resources.unwrap_or_default();
            assert!(
                !resources
                    .iter()
                    .any(|r| r == "*" || WORKLOAD_RESOURCES.contains(&r.as_str())),
                "ClusterRole {} bound to the operator grants {resources:?}",
                binding.role_ref.name
            );
        }
    }

    // (b) The apiserver agrees, by review and by a real request under the token.
    for account in [RELEASE, ROUTER_ACCOUNT] {
        assert!(!may_list_pods(&client, account, None).await?, "{account}");
        assert!(
            !may_list_pods(&client, account, Some(&outside)).await?,
            "{account}"
        );
        assert!(
            may_list_pods(&client, account, Some(&watched)).await?,
            "{account}"
        );
    }
    let token = cluster::service_account_token(&client, RELEASE_NAMESPACE, RELEASE).await?;
    let as_operator = c.client_with_token(&token).await?;
    match Api::<Pod>::all(as_operator.clone())
        .list(&ListParams::default())
        .await
    {
        Err(kube::Error::Api(status)) if status.code == 403 => {}
        other => bail!("a cluster-wide pod list under the operator's token: {other:?}"),
    }
    Api::<Pod>::namespaced(as_operator, &watched)
        .list(&ListParams::default())
        .await
        .context("listing pods of the watched namespace under the operator's token")?;

    // Outside the watched namespace before the operator starts, so its first list would have
    // found it.
    let outside_services: Api<InferenceService> = Api::namespaced(client.clone(), &outside);
    operator::apply(&outside_services, MANAGER, &service(&outside)?).await?;

    let kubeconfig = c.kubeconfig_with_token(&token, "namespaced-operator-kubeconfig.yaml")?;
    let log = c.scratch().join(format!("{IDENTITY}.log"));
    let mut cmd = Command::new(paths::workspace_bin("npufleet-operator")?);
    cmd.args(["--external-metrics-addr=", "--metrics-addr"])
        .arg(format!("127.0.0.1:{}", free_port()?))
        .args([
            "--lease-namespace",
            RELEASE_NAMESPACE,
            "--identity",
            IDENTITY,
        ])
        .args(["--watch-namespace", &watched, "--log-format", "json"])
        .env("KUBECONFIG", &kubeconfig)
        .env("RUST_LOG", "info,npufleet_operator=debug");
    let _operator = Process::start(IDENTITY, cmd, &log)?;
    operator::wait_leader(&client, RELEASE_NAMESPACE, IDENTITY, TIMEOUT).await?;

    // (c) The watched namespace's service gets its pod and goes Ready.
    let watched_services: Api<InferenceService> = Api::namespaced(client.clone(), &watched);
    let created = Instant::now();
    operator::apply(&watched_services, MANAGER, &service(&watched)?).await?;
    let operator_log = || std::fs::read_to_string(&log).unwrap_or_default();
    wait::until("the watched service Ready", TIMEOUT, || async {
        Ok(is_ready(&watched_services.get("chat").await?).then_some(()))
    })
    .await
    .with_context(operator_log)?;
    println!(
        "watched InferenceService Ready {:.1} s after it was applied",
        created.elapsed().as_secs_f64()
    );
    let watched_pods = Api::<Pod>::namespaced(client.clone(), &watched)
        .list(&ListParams::default().labels("npufleet.io/inference-service=chat"))
        .await?;
    assert_eq!(watched_pods.items.len(), 1);

    // (c') The router runs as the chart runs it, under its own token and confined the same way
    // (the flag the chart passes), and routes to the watched service's replica.
    let router_token =
        cluster::service_account_token(&client, RELEASE_NAMESPACE, ROUTER_ACCOUNT).await?;
    let router_kubeconfig =
        c.kubeconfig_with_token(&router_token, "namespaced-router-kubeconfig.yaml")?;
    let router = RunningRouter::start_binary(
        &paths::workspace_bin("npufleet-router")?,
        c,
        &router_kubeconfig,
        "namespaced-router",
        &watched,
        &[],
    )
    .await?;
    let models_url = router.url("/v1/models");
    wait::until("the router serving the watched model", TIMEOUT, || async {
        let models: serde_json::Value = reqwest::get(&models_url).await?.json().await?;
        Ok((models["data"][0]["id"] == "smollm2").then_some(()))
    })
    .await
    .with_context(|| router.process.log_tail(20))?;

    // (d) The identical service outside was never reconciled, and never tried: a scope that
    // leaked would show up as a refused list or watch in the log.
    let untouched = outside_services.get("chat").await?;
    assert!(untouched.status.is_none(), "{:?}", untouched.status);
    let outside_pods = Api::<Pod>::namespaced(client.clone(), &outside)
        .list(&ListParams::default())
        .await?;
    assert!(outside_pods.items.is_empty(), "{:?}", outside_pods.items);
    let text = operator_log();
    assert!(
        text.contains("reconciled"),
        "the log holds the reconciles: {text}"
    );
    let router_log = std::fs::read_to_string(router.process.log_path())?;
    for (name, text) in [("operator", text), ("router", router_log)] {
        let refusals: Vec<&str> = text
            .lines()
            .filter(|l| l.to_ascii_lowercase().contains("forbidden"))
            .collect();
        assert!(refusals.is_empty(), "{name}: {refusals:#?}");
    }
    Ok(())
}

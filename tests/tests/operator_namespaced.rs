//! The namespaced install: the chart installed with `watchNamespace`, the operator binary
//! running with nothing but the chart's ServiceAccount token and `--watch-namespace`. RBAC is
//! a Role in the watched namespace, so the operator must never list or watch cluster-wide,
//! and an InferenceService elsewhere is neither seen nor touched.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::Client;
use kube::api::{Api, ListParams};
use npufleet_crds::InferenceService;
use npufleet_tests::access::{self, Access, ServiceAccount};
use npufleet_tests::net::free_port;
use npufleet_tests::process::Process;
use npufleet_tests::{cluster, operator, paths, process, wait};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(90);
const RELEASE: &str = "npufleet";
const RELEASE_NAMESPACE: &str = "npufleet-system";
const IDENTITY: &str = "namespaced-operator";
const MANAGER: &str = "operator-namespaced-test";
/// Resources only the operator's own Role may grant it.
const WORKLOAD_RESOURCES: [&str; 3] = ["pods", "services", "configmaps"];

/// Whether the apiserver lets the operator's ServiceAccount list pods in `namespace` (or in
/// every namespace when `None`).
async fn may_list_pods(client: &Client, namespace: Option<&str>) -> Result<bool> {
    let operator = ServiceAccount::new(RELEASE_NAMESPACE, RELEASE);
    access::allowed(
        client,
        &operator,
        &Access::new("list", "", "pods", namespace),
    )
    .await
}

fn service(namespace: &str) -> Result<InferenceService> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "npufleet.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": namespace},
        "spec": {
            "model": {"name": "smollm2", "source": {"imagePath": "/models/smollm2.gguf"}},
            "replicas": 1,
            "accelerator": {"type": "cpu"},
        }
    }))?)
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
    process::stdout_of({
        let mut helm = c.helm();
        helm.args(["install", RELEASE])
            .arg(&chart)
            .args(["--namespace", RELEASE_NAMESPACE, "--create-namespace"])
            .args(["--set", &format!("watchNamespace={watched}")])
            .args(["--set", "router.enabled=false"]);
        helm
    })
    .context("helm install")?;

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
        let binds_operator = binding.subjects.iter().flatten().any(|s| {
            s.kind == "ServiceAccount"
                && s.name == RELEASE
                && s.namespace.as_deref() == Some(RELEASE_NAMESPACE)
        });
        if !binds_operator {
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
    assert!(!may_list_pods(&client, None).await?);
    assert!(!may_list_pods(&client, Some(&outside)).await?);
    assert!(may_list_pods(&client, Some(&watched)).await?);
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
    let refusals: Vec<&str> = text
        .lines()
        .filter(|l| l.to_ascii_lowercase().contains("forbidden"))
        .collect();
    assert!(refusals.is_empty(), "{refusals:#?}");
    Ok(())
}

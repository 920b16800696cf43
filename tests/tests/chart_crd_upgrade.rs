//! The chart as a user runs it: `helm template` renders offline with no `--kube-version` and,
//! when asked for, a verified external metrics API; installed with its defaults it registers
//! no aggregated API, so a stopped operator cannot block namespace deletion; and the
//! documented CRD upgrade step (Helm never upgrades `crds/`) brings an installed older CRD to
//! the chart's schema.

use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
use kube::api::{Api, DeleteParams, PostParams};
use npufleet_tests::{cluster, paths, process, wait};

const CRD: &str = "inferenceservices.npufleet.io";
const EXTERNAL_METRICS_API_SERVICE: &str = "v1beta1.external.metrics.k8s.io";

fn chart() -> std::path::PathBuf {
    paths::repo_root().join("charts/npufleet")
}

/// Whether the stored CRD's schema has `spec.autoscaling`.
async fn has_autoscaling(crds: &Api<CustomResourceDefinition>) -> Result<bool> {
    let crd = crds.get(CRD).await?;
    let spec = serde_json::to_value(&crd.spec.versions[0].schema)?;
    Ok(!spec["openAPIV3Schema"]["properties"]["spec"]["properties"]["autoscaling"].is_null())
}

/// `helm template` of the chart with `values` (`key=value` for `--set`).
async fn render(c: &cluster::Cluster, values: &[&str]) -> Result<String> {
    let mut helm = c.helm();
    helm.arg("template").arg("npufleet").arg(chart());
    for value in values {
        helm.args(["--set", value]);
    }
    tokio::task::spawn_blocking(move || process::stdout_of(helm)).await?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_template_renders_offline_with_a_verified_metrics_api() -> Result<()> {
    let c = cluster::shared();
    let defaults = render(c, &[]).await?;
    assert!(
        !defaults.contains("kind: APIService"),
        "an APIService by default"
    );
    assert!(defaults.contains("- --external-metrics-addr=\n"));
    let rendered = render(c, &["externalMetrics.enabled=true"]).await?;
    assert!(
        rendered.contains("kind: APIService"),
        "no APIService rendered"
    );
    assert!(
        !rendered.contains("insecureSkipTLSVerify: true"),
        "the APIService skips verifying the server"
    );
    assert!(rendered.contains("name: extension-apiserver-authentication-reader"));
    assert!(rendered.contains("--external-metrics-secret=npufleet-external-metrics-tls"));
    Ok(())
}

/// The operator's pods never run here (KWOK fakes them), as when it is stopped: had the chart
/// registered its external metrics APIService, discovery of that API would fail and the
/// namespace controller would leave every deleted namespace Terminating.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_default_values_and_no_operator_namespaces_still_delete() -> Result<()> {
    npufleet_tests::on_shared_cluster(|c, client| async move {
        let release_ns = c.namespace(&client, "chart-defaults").await?;
        let mut helm = c.helm();
        // Named apart from the other test's cluster-wide release, whose ClusterRole is named
        // after its release; the CRD is that test's to create.
        helm.args(["install", "defaults"])
            .arg(chart())
            .args(["-n", &release_ns, "--skip-crds"]);
        tokio::task::spawn_blocking(move || process::stdout_of(helm)).await??;
        let api_services: Api<APIService> = Api::all(client.clone());
        assert!(
            api_services
                .get_opt(EXTERNAL_METRICS_API_SERVICE)
                .await?
                .is_none(),
            "the chart's defaults register the external metrics API"
        );

        let doomed = c.namespace(&client, "deleted-beside-chart").await?;
        let namespaces: Api<Namespace> = Api::all(client.clone());
        namespaces.delete(&doomed, &DeleteParams::default()).await?;
        wait::until(
            "the deleted namespace gone",
            Duration::from_secs(60),
            || async {
                match namespaces.get_opt(&doomed).await? {
                    None => Ok(Some(())),
                    Some(ns) => anyhow::bail!("still there: {:?}", ns.status),
                }
            },
        )
        .await?;
        Ok(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_crd_upgrade_step_upgrades_what_helm_leaves_alone() -> Result<()> {
    npufleet_tests::on_shared_cluster(|c, client| async move {
        // An older release's CRD: the same, without spec.autoscaling.
        let text = std::fs::read_to_string(chart().join("crds").join(format!("{CRD}.yaml")))?;
        let mut old: CustomResourceDefinition = serde_yaml::from_str(&text)?;
        let schema = old.spec.versions[0].schema.as_mut().context("schema")?;
        let spec = schema
            .open_api_v3_schema
            .as_mut()
            .and_then(|s| s.properties.as_mut())
            .and_then(|p| p.get_mut("spec"))
            .and_then(|s| s.properties.as_mut())
            .context("spec properties")?;
        spec.remove("autoscaling");
        let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
        crds.create(&PostParams::default(), &old).await?;
        npufleet_tests::crd::wait_established(&client, CRD).await?;
        assert!(!has_autoscaling(&crds).await?);

        let ns = c.namespace(&client, "chart-crd-upgrade").await?;
        let mut helm = c.helm();
        helm.args(["install", "npufleet"]).arg(chart()).args([
            "-n",
            &ns,
            "--set",
            "externalMetrics.enabled=false",
            "--set",
            "router.enabled=false",
        ]);
        tokio::task::spawn_blocking(move || process::stdout_of(helm)).await??;
        assert!(
            !has_autoscaling(&crds).await?,
            "helm changed an existing CRD"
        );

        // The step the chart's README documents.
        let mut kubectl = c.kubectl();
        kubectl
            .args(["apply", "--server-side", "--force-conflicts", "-f"])
            .arg(chart().join("crds"));
        tokio::task::spawn_blocking(move || process::stdout_of(kubectl)).await??;
        wait::until(
            "the upgraded CRD schema",
            Duration::from_secs(30),
            || async { Ok(has_autoscaling(&crds).await?.then_some(())) },
        )
        .await?;
        Ok(())
    })
    .await
}

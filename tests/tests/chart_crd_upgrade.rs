//! The chart as a user runs it: `helm template` renders offline with no `--kube-version` and
//! a verified external metrics API, and the documented CRD upgrade step (Helm never upgrades
//! `crds/`) brings an installed older CRD to the chart's schema.

use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, PostParams};
use npufleet_tests::{cluster, paths, process, wait};

const CRD: &str = "inferenceservices.npufleet.io";

fn chart() -> std::path::PathBuf {
    paths::repo_root().join("charts/npufleet")
}

/// Whether the stored CRD's schema has `spec.autoscaling`.
async fn has_autoscaling(crds: &Api<CustomResourceDefinition>) -> Result<bool> {
    let crd = crds.get(CRD).await?;
    let spec = serde_json::to_value(&crd.spec.versions[0].schema)?;
    Ok(!spec["openAPIV3Schema"]["properties"]["spec"]["properties"]["autoscaling"].is_null())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_template_renders_offline_with_a_verified_metrics_api() -> Result<()> {
    let c = cluster::shared();
    let mut helm = c.helm();
    helm.arg("template").arg("npufleet").arg(chart());
    let rendered = tokio::task::spawn_blocking(move || process::stdout_of(helm)).await??;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_crd_upgrade_step_upgrades_what_helm_leaves_alone() -> Result<()> {
    let c = cluster::shared();
    let client = c.client().await?;
    let result = async {
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
    }
    .await;
    c.diagnose(result)
}

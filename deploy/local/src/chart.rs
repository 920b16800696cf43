//! The product as a user installs it, on the real node: this build's images from the repo's own
//! Dockerfiles (`tests/setup/images.sh`, no daemon, no registry), imported into the node's
//! containerd, and `helm install` of `charts/npufleet` as shipped with only the image
//! repositories set to them.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, ListParams};

use crate::cluster::Cluster;
use crate::paths::{self, ImageArchive};
use crate::wait;

/// The release name `make run` and the tests install under.
pub const RELEASE: &str = "npufleet";
/// The chart's router Service (and Deployment) under [`RELEASE`].
pub const ROUTER: &str = "npufleet-router";
/// The operator's and router's pods start in seconds; the timeout covers a loaded machine.
const READY_TIMEOUT: Duration = Duration::from_secs(180);

/// This build's images, as `tests/setup/images.sh` built them.
pub struct LocalImages {
    pub operator: ImageArchive,
    pub router: ImageArchive,
    pub worker: ImageArchive,
    /// The worker with SmolLM2 baked in, as the sample names it.
    pub worker_smollm2: ImageArchive,
}

impl LocalImages {
    /// Builds the images of the binaries in `binaries` (or finds them built, by content).
    pub fn build(binaries: &Path) -> Result<LocalImages> {
        let script = paths::repo_root().join("tests/setup/images.sh");
        let out = Command::new("bash")
            .arg(&script)
            .env("NPUFLEET_BINARIES", binaries)
            .stderr(Stdio::inherit())
            .output()
            .with_context(|| format!("running {}", script.display()))?;
        ensure!(
            out.status.success(),
            "{} failed ({})",
            script.display(),
            out.status
        );
        let images = paths::parse_image_lines(&String::from_utf8(out.stdout)?)?;
        let find = |name: &str, smollm2: bool| -> Result<ImageArchive> {
            images
                .iter()
                .find(|i| {
                    i.name.ends_with(&format!("/{name}")) && i.tag.ends_with("-smollm2") == smollm2
                })
                .cloned()
                .with_context(|| format!("{} built no {name} image", script.display()))
        };
        Ok(LocalImages {
            operator: find("npufleet-operator", false)?,
            router: find("npufleet-router", false)?,
            worker: find("npufleet-worker", false)?,
            worker_smollm2: find("npufleet-worker", true)?,
        })
    }

    pub fn all(&self) -> [&ImageArchive; 4] {
        [
            &self.operator,
            &self.router,
            &self.worker,
            &self.worker_smollm2,
        ]
    }

    pub fn archives(&self) -> Vec<PathBuf> {
        self.all().map(|i| i.path.clone()).to_vec()
    }
}

/// `repository:tag` of an image.
pub fn reference(image: &ImageArchive) -> String {
    format!("{}:{}", image.name, image.tag)
}

/// `helm install` of the chart into `namespace` with `images`; returns once the operator's and
/// the router's Deployments have every replica available (Ready by their probes).
pub async fn install(cluster: &Cluster, namespace: &str, images: &LocalImages) -> Result<()> {
    let mut helm = cluster.helm();
    helm.args(["install", RELEASE])
        .arg(paths::repo_root().join("charts/npufleet"))
        .args(["--namespace", namespace]);
    for (value, image) in [
        ("image", &images.operator),
        ("router.image", &images.router),
        ("workerImage", &images.worker),
    ] {
        helm.args(["--set", &format!("{value}.repository={}", image.name)])
            .args(["--set", &format!("{value}.tag={}", image.tag)]);
    }
    tokio::task::spawn_blocking(move || crate::process::stdout_of(helm))
        .await?
        .context("helm install")?;
    let deployments: Api<Deployment> = Api::namespaced(cluster.client().await?, namespace);
    cluster.diagnose(
        wait::until(
            "the chart's operator and router pods Ready by their probes",
            READY_TIMEOUT,
            || async {
                let list = deployments.list(&ListParams::default()).await?.items;
                let available = list.len() == 2
                    && list.iter().all(|d| {
                        let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
                        d.status.as_ref().and_then(|s| s.available_replicas) == Some(want)
                    });
                Ok(available.then_some(()))
            },
        )
        .await,
    )
}

/// The router Service's address, `http://<ClusterIP>:<port>`, reachable from the node.
pub async fn router_url(cluster: &Cluster, namespace: &str) -> Result<String> {
    let service: k8s_openapi::api::core::v1::Service =
        Api::namespaced(cluster.client().await?, namespace)
            .get(ROUTER)
            .await?;
    let ip = service
        .spec
        .and_then(|s| s.cluster_ip)
        .context("the router's Service has no ClusterIP")?;
    Ok(format!(
        "http://{ip}:{}",
        npufleet_contract::ports::HTTP_PORT
    ))
}

//! The sample InferenceService (`deploy/samples/cpu-smollm2.yaml`) on the real node: the
//! operator makes its worker pod from the project's own `smollm2` worker image (imported into
//! the node's containerd from `tests/setup/images.sh`'s archive), kubelet's probes make it
//! Ready, and it answers an OpenAI streaming request at its pod address.
//!
//! Its own test binary: it needs its own real node (one per machine) and the images of this
//! build.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use npufleet_contract::ports::HTTP_PORT;
use npufleet_crds::InferenceService;
use npufleet_tests::cluster::{Cluster, ClusterOptions};
use npufleet_tests::fleet::request_once;
use npufleet_tests::real_node;
use npufleet_tests::{crd, operator, paths, wait};
use serde_json::json;

const SAMPLE: &str = "deploy/samples/cpu-smollm2.yaml";
const MANAGER: &str = "node-real-worker-test";
/// Pulling nothing, but starting the engine and warming it up on 2 shared cores.
const TIMEOUT: Duration = Duration::from_secs(180);

/// The archive of `image` (`repository:tag`) among the images of this build.
fn image_archive(image: &str) -> Result<std::path::PathBuf> {
    let script = paths::repo_root().join("tests/setup/images.sh");
    let out = Command::new("bash")
        .arg(&script)
        .env("NPUFLEET_BINARIES", paths::target_bin_dir())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    ensure!(
        out.status.success(),
        "{} failed ({})",
        script.display(),
        out.status
    );
    // `<repository> <tag> <archive>` lines, the shape of node.sh's image lines.
    let images = paths::parse_image_lines(&String::from_utf8(out.stdout)?)?;
    let found = images
        .into_iter()
        .find(|i| format!("{}:{}", i.name, i.tag) == image)
        .with_context(|| format!("images.sh built no {image}"))?;
    Ok(found.path)
}

fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

#[tokio::test]
async fn the_sample_serves_a_stream_from_a_container_made_ready_by_kubelets_probes() -> Result<()> {
    if let Some(why) = real_node::unavailable() {
        println!("skipping the real-node test: {why}");
        return Ok(());
    }
    let mut sample: InferenceService =
        serde_yaml::from_str(&std::fs::read_to_string(paths::repo_root().join(SAMPLE))?)?;
    // The sample names the published image; the same image of this build, by its local name.
    let published = sample
        .spec
        .template
        .image
        .clone()
        .context("the sample names no image")?;
    let (_, name_and_tag) = published
        .rsplit_once('/')
        .context("the sample's image has no repository path")?;
    let image = format!("localhost/npufleet/{name_and_tag}");
    sample.spec.template.image = Some(image.clone());
    let archive = tokio::task::spawn_blocking(move || image_archive(&image)).await??;

    let c = Cluster::start(ClusterOptions::real_node()).await?;
    let node = c.real_node().context("the cluster has a real node")?;
    let imported = Instant::now();
    node.import(&[archive])?;
    println!(
        "worker image imported in {:.1} s",
        imported.elapsed().as_secs_f64()
    );
    let client = c.client().await?;
    crd::install_inference_service(&client, MANAGER).await?;
    let ns = c.namespace(&client, "real-node-worker").await?;
    let _operator = operator::start_with_builtin_autoscaler(&client, &ns)?;
    let services: Api<InferenceService> = Api::namespaced(client.clone(), &ns);
    let name = sample
        .metadata
        .name
        .clone()
        .context("the sample has a name")?;
    sample.metadata.namespace = Some(ns.clone());

    let created = Instant::now();
    operator::apply(&services, MANAGER, &sample).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let pod = c.diagnose(
        wait::until(
            "a worker pod Ready by kubelet's probes",
            TIMEOUT,
            || async {
                let list = pods.list(&ListParams::default()).await?;
                Ok(list.items.into_iter().find(is_ready))
            },
        )
        .await,
    )?;
    println!(
        "InferenceService applied -> worker pod Ready on the real node: {:.1} s",
        created.elapsed().as_secs_f64()
    );
    let ip = pod
        .status
        .and_then(|s| s.pod_ip)
        .context("the Ready pod has no address")?;

    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()?;
    let body = json!({
        "model": sample.spec.model.name,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "stream": true,
    });
    let url = format!("http://{ip}:{HTTP_PORT}/v1/chat/completions");
    let asked = Instant::now();
    request_once(&http, &url, &body)
        .await
        .with_context(|| format!("streaming from {url} ({name})"))?;
    println!(
        "a streamed answer of 8 tokens from the pod in {:.2} s",
        asked.elapsed().as_secs_f64()
    );
    Ok(())
}

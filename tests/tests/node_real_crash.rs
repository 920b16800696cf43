//! A real node whose test binary was killed leaves its containers' shims, mounts, bridge,
//! cgroups and kube-proxy's rules behind; the next real node removes them before it starts,
//! runs pods, and leaves nothing once dropped.
//!
//! Its own test binary: it starts two real nodes one after the other (one per machine), which
//! the shared node of `node_real` would block.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, PostParams};
use npufleet_tests::cluster::{Cluster, ClusterOptions};
use npufleet_tests::real_node::{self, REAL_NODE_LABEL};
use npufleet_tests::{paths, wait};
use serde_json::json;

/// Set for the child run of [`crashing_node`]: the test that gets killed.
const CHILD_ENV: &str = "NPUFLEET_REAL_NODE_CRASH_CHILD";
const READY_LINE: &str = "real node serving a pod";
const TIMEOUT: Duration = Duration::from_secs(120);

/// Starts a pod of the pause image on the real node and waits until it runs.
async fn running_pod(c: &Cluster, client: &Client, name: &str) -> Result<()> {
    let node = c.real_node().context("the cluster has a real node")?;
    let pause = paths::image_tag(node.images(), "pause")
        .context("tests/setup/node.sh lists the pause image")?;
    let ns = c.namespace(client, name).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {REAL_NODE_LABEL: "true"},
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "pause", "image": pause, "imagePullPolicy": "Never"}],
        },
    }))?;
    pods.create(&PostParams::default(), &pod).await?;
    c.diagnose(
        wait::until(&format!("pod {name} Running"), TIMEOUT, || async {
            let phase = pods.get(name).await?.status.and_then(|s| s.phase);
            Ok((phase.as_deref() == Some("Running")).then_some(()))
        })
        .await,
    )
}

/// The run the parent kills: a real node with a running pod, then waiting to be killed.
#[tokio::test]
#[ignore = "run only as the child of a_node_after_a_crashed_one_removes_its_leftovers"]
async fn crashing_node() -> Result<()> {
    if std::env::var_os(CHILD_ENV).is_none() {
        return Ok(());
    }
    let c = Cluster::start(ClusterOptions::real_node()).await?;
    let client = c.client().await?;
    running_pod(&c, &client, "crashed").await?;
    println!("{READY_LINE}");
    std::future::pending::<()>().await;
    unreachable!("a pending future never completes")
}

#[tokio::test]
async fn a_node_after_a_crashed_one_removes_its_leftovers() -> Result<()> {
    if let Some(why) = real_node::unavailable() {
        println!("skipping the real-node test: {why}");
        return Ok(());
    }
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--exact", "crashing_node", "--ignored", "--nocapture"])
        .env(CHILD_ENV, "1")
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the crashing run")?;
    let stdout = child.stdout.take().context("the child's stdout")?;
    let (ready_tx, ready_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let ready = BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line.contains(READY_LINE));
        let _ = ready_tx.send(ready);
    });
    let ready = ready_rx.recv_timeout(TIMEOUT + Duration::from_secs(60));
    // SIGKILL: no destructor or exit clean-up of the child runs, as in a crash.
    child.kill()?;
    child.wait()?;
    if ready != Ok(true) {
        bail!("the crashing run never reported its pod running ({ready:?})");
    }
    // Its daemons die with it (parent-death signal); its containers' shims live on.
    let left = real_node::leftovers();
    ensure!(
        left.iter().any(|l| l.starts_with("containerd shims")),
        "the killed node left no shims to clean up: {left:?}"
    );
    println!("the killed node left: {left:?}");

    let started = Instant::now();
    let c = Cluster::start(ClusterOptions::real_node()).await?;
    println!(
        "real-node cluster after a crash started in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let client = c.client().await?;
    running_pod(&c, &client, "after-crash").await?;
    drop(c);
    let left = real_node::leftovers();
    ensure!(left.is_empty(), "a dropped real node left {left:?}");
    Ok(())
}

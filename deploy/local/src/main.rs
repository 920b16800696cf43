//! `make run`: a throw-away local control plane with the operator managing a SmolLM2 fleet
//! on CPU, made visible. The worker pods run as real local processes on loopback addresses
//! (the node agent plays the kubelet), `npufleet-router` runs as its own process in front of
//! them, a burst of streaming chat clients loads them through it, and a
//! line a second shows the fleet scaling up under the burst and back down after it.
//! `--real-node` (`make run-real-node`) runs the same demo as a user's cluster would: this
//! build's images on a real node, the operator and the router installed by the chart.
//!
//! Everything it starts belongs to this process and stops with it (Ctrl-C).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use npufleet_contract::env as worker_env;
use npufleet_crds::InferenceService;
use npufleet_local::chart::{self, LocalImages};
use npufleet_local::cluster::{Cluster, ClusterOptions};
use npufleet_local::net::free_port;
use npufleet_local::node_agent::{self, NodeAgent, NodeAgentConfig};
use npufleet_local::process::{Process, Supervisor};
use npufleet_local::router::{RunningRouter, serving_addresses};
use npufleet_local::{paths, wait};
use serde_json::{Value, json};
use tokio::sync::Mutex;

const MANAGER: &str = "npufleet-local";
const SERVICE: &str = "smollm2";
const NODE: &str = "local-node-0";
const TARGET_QUEUE: u32 = 2;
const MAX_REPLICAS: u32 = 3;
const SAMPLE: &str = "deploy/samples/cpu-smollm2.yaml";
/// How often the operator or the router is started again after exiting before the platform
/// gives up on it.
const RESTARTS: u32 = 5;

/// A local control plane with the operator managing a SmolLM2 fleet, a load burst to watch
/// it scale, and the fleet left serving until Ctrl-C.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// The npufleet checkout whose set-up scripts and sample the platform uses (default: the
    /// checkout holding this binary, else the one holding the current directory).
    #[arg(long, env = "NPUFLEET_REPO")]
    repo: Option<PathBuf>,
    /// Where the release binaries (npufleet-operator, npufleet-router, npufleet-worker) were
    /// built (default: this binary's directory, where cargo builds them too).
    #[arg(long)]
    target_dir: Option<PathBuf>,
    /// Concurrent streaming clients in the burst.
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u32).range(1..=16))]
    clients: u32,
    /// How long the burst lasts, in seconds.
    #[arg(long, default_value_t = 40, value_parser = clap::value_parser!(u64).range(5..=300))]
    burst_seconds: u64,
    /// Exit after the summary instead of serving until Ctrl-C.
    #[arg(long)]
    exit_after_demo: bool,
    /// Run the fleet as a user's cluster would: a real node (containerd, kubelet, kube-proxy,
    /// CoreDNS; needs root) running this build's images, with the operator and the router
    /// installed by `helm install` of the chart. Default: processes, which start in seconds.
    #[arg(long)]
    real_node: bool,
}

/// The product's binaries the platform runs.
struct Binaries {
    operator: PathBuf,
    router: PathBuf,
    worker: PathBuf,
}

impl Binaries {
    /// Checked before anything starts, so that a missing one is the first thing said.
    fn find(target_dir: Option<&Path>) -> Result<Self> {
        let dir = match target_dir {
            Some(dir) => dir.to_path_buf(),
            None => std::env::current_exe()
                .context("finding this binary")?
                .parent()
                .context("this binary has no directory")?
                .to_path_buf(),
        };
        let binary = |name: &str| {
            let path = dir.join(name);
            if !path.is_file() {
                bail!(
                    "{} is missing; build the release binaries first (cargo build --release --workspace --bins) or name their directory with --target-dir",
                    path.display()
                );
            }
            std::path::absolute(&path).with_context(|| format!("resolving {}", path.display()))
        };
        Ok(Self {
            operator: binary("npufleet-operator")?,
            router: binary("npufleet-router")?,
            worker: binary("npufleet-worker")?,
        })
    }
}

/// What runs a worker pod.
enum Worker<'a> {
    /// The node agent's process, reading this model file.
    Process(&'a Path),
    /// This build's smollm2 worker image, on the real node.
    Image(&'a LocalImages),
}

/// The shipped sample with built-in autoscaling and one engine thread per worker, so that
/// three replicas fit two cores: pointed at the cached model and the node agent, or at this
/// build's image on the real node.
fn service_from_sample(namespace: &str, worker: Worker) -> Result<InferenceService> {
    let sample_path = paths::repo_root().join(SAMPLE);
    let text = std::fs::read_to_string(&sample_path)
        .with_context(|| format!("reading {}", sample_path.display()))?;
    let mut sample: Value =
        serde_yaml::from_str(&text).with_context(|| format!("parsing {SAMPLE}"))?;
    sample["metadata"] = json!({"name": SERVICE, "namespace": namespace});
    let spec = sample
        .get_mut("spec")
        .and_then(Value::as_object_mut)
        .with_context(|| format!("{SAMPLE} has no spec"))?;
    spec.insert(
        "engine".into(),
        json!({"maxBatchSize": 32, "warmupIterations": 1, "drainSeconds": 60}),
    );
    spec.insert(
        "autoscaling".into(),
        json!({"mode": "builtin", "minReplicas": 1, "maxReplicas": MAX_REPLICAS, "targetQueueDepth": TARGET_QUEUE}),
    );
    match worker {
        Worker::Process(model) => {
            spec.insert(
                "model".into(),
                json!({"name": SERVICE, "format": "gguf", "source": {"imagePath": model.display().to_string()}}),
            );
            spec.insert("scheduling".into(), node_agent::scheduling(NODE));
        }
        Worker::Image(images) => {
            // The model baked into the image, under the name the demo's clients ask for.
            spec.get_mut("model")
                .and_then(Value::as_object_mut)
                .with_context(|| format!("{SAMPLE} has no spec.model"))?
                .insert("name".into(), json!(SERVICE));
            let template = spec
                .get_mut("template")
                .and_then(Value::as_object_mut)
                .with_context(|| format!("{SAMPLE} has no spec.template"))?;
            template.insert(
                "image".into(),
                json!(chart::reference(&images.worker_smollm2)),
            );
            // Three replicas and the chart's pods on a node of two cores.
            template["resources"]["requests"]["cpu"] = json!("500m");
        }
    }
    spec.get_mut("template")
        .and_then(Value::as_object_mut)
        .with_context(|| format!("{SAMPLE} has no spec.template"))?
        .insert(
            "env".into(),
            json!([{"name": worker_env::THREADS, "value": "1"}]),
        );
    serde_json::from_value(sample).with_context(|| format!("{SAMPLE} is not an InferenceService"))
}

/// The burst's shared counters.
#[derive(Default)]
struct Load {
    done: AtomicU64,
    failed: AtomicU64,
    tokens: AtomicU64,
    last_failure: Mutex<Option<String>>,
    stop: AtomicBool,
}

/// One streamed chat completion; counts the tokens as their chunks arrive.
async fn stream_one(http: &reqwest::Client, router: &str, load: &Load) -> Result<()> {
    let response = http
        .post(format!("{router}/v1/chat/completions"))
        .json(&json!({
            "model": SERVICE,
            "messages": [{"role": "user", "content": "Name three rivers in Europe."}],
            "max_tokens": 32,
            "stream": true,
        }))
        .send()
        .await?;
    let status = response.status();
    if !status.is_success() {
        bail!(
            "HTTP {status}: {}",
            response.text().await.unwrap_or_default()
        );
    }
    let mut body = response.bytes_stream();
    let mut pending = Vec::new();
    let mut finished = false;
    while let Some(bytes) = body.next().await {
        pending.extend_from_slice(&bytes?);
        while let Some(end) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let Some(data) = std::str::from_utf8(&line)?.trim().strip_prefix("data:") else {
                continue;
            };
            let data = data.trim();
            if data == "[DONE]" {
                finished = true;
                continue;
            }
            let chunk: Value = serde_json::from_str(data).context("malformed stream chunk")?;
            if let Some(error) = chunk.get("error") {
                bail!("the stream failed: {error}");
            }
            let has_content = chunk["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|s| !s.is_empty());
            if has_content {
                load.tokens.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    if !finished {
        bail!("stream ended without [DONE]");
    }
    Ok(())
}

/// One closed-loop client: a streamed chat completion, read to the end, repeat.
async fn client_loop(load: Arc<Load>, http: reqwest::Client, router: String) {
    while !load.stop.load(Ordering::Relaxed) {
        match stream_one(&http, &router, &load).await {
            Ok(()) => load.done.fetch_add(1, Ordering::Relaxed),
            Err(e) => {
                *load.last_failure.lock().await = Some(format!("{e:#}"));
                load.failed.fetch_add(1, Ordering::Relaxed)
            }
        };
    }
}

/// A worker pod the node agent reported Failed: its name and why (the worker's last log line).
#[derive(Debug, Clone, PartialEq)]
struct PodFailure {
    /// Told apart by uid: a group the operator recreates gets pods of the same names.
    uid: String,
    pod: String,
    message: String,
}

impl PodFailure {
    fn of(pod: &Pod) -> Option<Self> {
        let status = pod.status.as_ref()?;
        (status.phase.as_deref() == Some("Failed")).then(|| PodFailure {
            uid: pod.uid().unwrap_or_default(),
            pod: pod.name_any(),
            message: npufleet_contract::pods::failure(pod),
        })
    }
}

/// Records each worker pod that fails, once, and says so as it happens: the operator replaces
/// a failed pod at once, so the failure would otherwise show only as a fleet that never grows.
async fn record_failures(pods: Api<Pod>, failures: Arc<std::sync::Mutex<Vec<PodFailure>>>) {
    let mut events = watcher(pods, watcher::Config::default())
        .default_backoff()
        .applied_objects()
        .boxed();
    while let Some(event) = events.next().await {
        let Some(failure) = event.ok().as_ref().and_then(PodFailure::of) else {
            continue;
        };
        let mut failures = failures.lock().expect("failures");
        if failures.iter().all(|f| f.uid != failure.uid) {
            println!("  pod {} failed: {}", failure.pod, failure.message);
            failures.push(failure);
        }
    }
}

/// The summary's lines on failed pods: how many, and the latest few reasons.
fn failed_pods_summary(failures: &[PodFailure], pod_logs: &str) -> String {
    const SHOWN: usize = 3;
    if failures.is_empty() {
        return "  failed pods:      none\n".to_owned();
    }
    let mut text = format!(
        "  failed pods:      {} (worker logs: {pod_logs})\n",
        failures.len(),
    );
    for failure in &failures[failures.len().saturating_sub(SHOWN)..] {
        text.push_str(&format!("    {}: {}\n", failure.pod, failure.message));
    }
    text
}

/// A task that ends with its owner.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The once-a-second line, and what the summary needs from it.
struct Ticker {
    started: Instant,
    services: Api<InferenceService>,
    load: Arc<Load>,
    ticks: tokio::time::Interval,
    last_tokens: u64,
    peak_desired: i32,
    first_scale_up: Option<Duration>,
}

impl Ticker {
    fn new(services: Api<InferenceService>, load: Arc<Load>) -> Self {
        Ticker {
            started: Instant::now(),
            services,
            load,
            ticks: tokio::time::interval(Duration::from_secs(1)),
            last_tokens: 0,
            peak_desired: 1,
            first_scale_up: None,
        }
    }

    /// Waits for the next second, checks the fleet still runs, and prints a line; returns the
    /// desired replicas when the InferenceService could be read.
    async fn tick(&mut self, fleet: &mut Fleet, phase: &str) -> Result<Option<i32>> {
        self.ticks.tick().await;
        fleet.keep_running()?;
        let (desired, ready, queue) = match self.services.get(SERVICE).await {
            Ok(s) => {
                let status = s.status.unwrap_or_default();
                let queue = status
                    .autoscaling
                    .and_then(|a| a.queue_depth)
                    .map_or_else(|| "-".to_owned(), |q| format!("{q:.1}"));
                (s.spec.replicas, status.ready_replicas, queue)
            }
            Err(e) => {
                println!("  (reading the InferenceService failed: {e})");
                return Ok(None);
            }
        };
        self.peak_desired = self.peak_desired.max(desired);
        if desired > 1 && self.first_scale_up.is_none() {
            self.first_scale_up = Some(self.started.elapsed());
        }
        let tokens = self.load.tokens.load(Ordering::Relaxed);
        println!(
            "{:>6.1}s  {phase:<10} replicas desired {desired} ready {ready}  queue/replica {queue:>4}  requests done {:>4} failed {}  {:>5} tok/s",
            self.started.elapsed().as_secs_f64(),
            self.load.done.load(Ordering::Relaxed),
            self.load.failed.load(Ordering::Relaxed),
            tokens - self.last_tokens,
        );
        self.last_tokens = tokens;
        Ok(Some(desired))
    }

    /// The burst's and the scale-down's figures.
    async fn print_summary(&self, args: &Args, back_to_one: Duration) {
        let load = &self.load;
        println!();
        println!("summary");
        println!(
            "  burst:            {} streaming clients for {} s, {} requests answered, {} failed, {} tokens streamed",
            args.clients,
            args.burst_seconds,
            load.done.load(Ordering::Relaxed),
            load.failed.load(Ordering::Relaxed),
            load.tokens.load(Ordering::Relaxed)
        );
        println!("  peak replicas:    {}", self.peak_desired);
        match self.first_scale_up {
            Some(t) => println!(
                "  first scale-up:   {:.1} s after the burst began",
                t.as_secs_f64()
            ),
            None => println!("  first scale-up:   none (the load never exceeded one replica)"),
        }
        println!(
            "  back to 1:        {:.1} s after the burst began",
            back_to_one.as_secs_f64()
        );
        if let Some(failure) = load.last_failure.lock().await.as_ref() {
            println!("  last failure:     {failure}");
        }
    }
}

/// Where the demo's fleet runs.
enum Fleet {
    /// Worker pods as the node agent's processes; the operator and the router as processes.
    Processes {
        operator: Process,
        operator_log: PathBuf,
        router: Box<RunningRouter>,
        pod_logs: PathBuf,
        supervisor: Supervisor,
        _agent: NodeAgent,
    },
    /// The chart's operator and router pods and the worker containers, on the real node.
    RealNode {
        router: String,
        release_namespace: String,
        images: LocalImages,
    },
}

impl Fleet {
    async fn processes(cluster: &Cluster, namespace: &str, binaries: Binaries) -> Result<Fleet> {
        let pod_logs = cluster.scratch().join("pods");
        let agent = NodeAgent::start(
            cluster.client().await?,
            NodeAgentConfig::new(NODE, binaries.worker, pod_logs.clone(), 60),
        )
        .await?;
        agent.wait_schedulable(Duration::from_secs(60)).await?;
        let operator_log = cluster.scratch().join("npufleet-operator.log");
        let mut cmd = Command::new(&binaries.operator);
        cmd.args([
            "--metrics-addr",
            &format!("127.0.0.1:{}", free_port()?),
            "--leader-election=false",
            // HPA mode is not part of the demo; the built-in autoscaler runs in the operator.
            "--external-metrics-addr=",
        ])
        .env("KUBECONFIG", cluster.kubeconfig())
        .env("RUST_LOG", "info");
        let operator = Process::start("npufleet-operator", cmd, &operator_log)?;
        // The product's front door: every client request goes through it.
        let router = RunningRouter::start_binary(
            &binaries.router,
            cluster,
            cluster.kubeconfig(),
            "npufleet-router",
            namespace,
            &[],
        )
        .await?;
        println!(
            "npufleet-router serving http://{} (OpenAI, KServe v2 REST) and {} (gRPC)",
            router.http, router.grpc
        );
        Ok(Fleet::Processes {
            operator,
            operator_log,
            router: Box::new(router),
            pod_logs,
            supervisor: Supervisor::new(RESTARTS),
            _agent: agent,
        })
    }

    async fn real_node(cluster: &Cluster, binaries: &Binaries) -> Result<Fleet> {
        let node = cluster
            .real_node()
            .context("the cluster has no real node")?;
        let dir = binaries
            .worker
            .parent()
            .context("the worker binary has no directory")?
            .to_path_buf();
        println!("building this build's images (tests/setup/images.sh)");
        let images = tokio::task::spawn_blocking(move || LocalImages::build(&dir)).await??;
        node.import(&images.archives())?;
        let client = cluster.client().await?;
        let release_namespace = cluster.namespace(&client, "npufleet-system").await?;
        let installed = Instant::now();
        chart::install(cluster, &release_namespace, &images).await?;
        let router = chart::router_url(cluster, &release_namespace).await?;
        println!(
            "helm install: operator and router pods Ready in {:.1} s; npufleet-router Service at {router}",
            installed.elapsed().as_secs_f64()
        );
        Ok(Fleet::RealNode {
            router,
            release_namespace,
            images,
        })
    }

    /// The router's base URL, `http://host:port`.
    fn router_url(&self) -> String {
        match self {
            Fleet::Processes { router, .. } => router.url(""),
            Fleet::RealNode { router, .. } => router.clone(),
        }
    }

    /// Starts the operator or the router again when its process exited, as their
    /// Deployments' pods are (kubelet restarts them on the real node); fails once one
    /// exhausted its restarts.
    fn keep_running(&mut self) -> Result<()> {
        if let Fleet::Processes {
            operator,
            router,
            supervisor,
            ..
        } = self
        {
            for line in supervisor.restart_exited(&mut [operator, &mut router.process])? {
                println!("{line}");
            }
        }
        Ok(())
    }

    /// Where the worker pods' logs are.
    fn pod_logs(&self) -> String {
        match self {
            Fleet::Processes { pod_logs, .. } => pod_logs.display().to_string(),
            Fleet::RealNode { .. } => "kubectl logs".to_owned(),
        }
    }

    fn print_logs(&self, cluster: &Cluster, namespace: &str) {
        match self {
            Fleet::Processes {
                operator_log,
                router,
                pod_logs,
                ..
            } => {
                println!("  operator log: {}", operator_log.display());
                println!("  router log:   {}", router.process.log_path().display());
                println!("  pod logs:     {}", pod_logs.display());
            }
            Fleet::RealNode {
                release_namespace, ..
            } => {
                let kubectl = format!(
                    "KUBECONFIG={} {}",
                    cluster.kubeconfig().display(),
                    cluster.tool("kubectl").display()
                );
                println!(
                    "  operator log: {kubectl} -n {release_namespace} logs deploy/{}",
                    chart::RELEASE
                );
                println!(
                    "  router log:   {kubectl} -n {release_namespace} logs deploy/{}",
                    chart::ROUTER
                );
                println!("  pods:         {kubectl} -n {namespace} get pods -o wide");
            }
        }
    }
}

async fn demo(cluster: &Cluster, args: &Args, binaries: Binaries) -> Result<()> {
    let client = cluster.client().await?;
    let ns = cluster.namespace(&client, "npufleet-local").await?;
    let mut fleet = if args.real_node {
        Fleet::real_node(cluster, &binaries).await?
    } else {
        npufleet_local::crd::install_inference_service(&client, MANAGER).await?;
        Fleet::processes(cluster, &ns, binaries).await?
    };

    // Watched from before the first pod exists, so that no failure goes unseen.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let failures = Arc::new(std::sync::Mutex::new(Vec::new()));
    let _failure_watch = AbortOnDrop(tokio::spawn(record_failures(
        pods.clone(),
        failures.clone(),
    )));
    let services: Api<InferenceService> = Api::namespaced(client.clone(), &ns);
    let service = match &fleet {
        Fleet::RealNode { images, .. } => service_from_sample(&ns, Worker::Image(images))?,
        Fleet::Processes { .. } => {
            let model = tokio::task::spawn_blocking(paths::smollm2_gguf).await??;
            service_from_sample(&ns, Worker::Process(&model))?
        }
    };
    services
        .patch(
            SERVICE,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&service),
        )
        .await
        .context("applying the InferenceService")?;
    println!(
        "InferenceService {ns}/{SERVICE} applied (from {SAMPLE}, builtin autoscaling 1..{MAX_REPLICAS}, target queue {TARGET_QUEUE} per replica)"
    );

    let started = Instant::now();
    wait::until(
        "the first replica serving",
        Duration::from_secs(180),
        || async { Ok((!serving_addresses(&pods).await?.is_empty()).then_some(())) },
    )
    .await
    .with_context(|| failed_pods_summary(&failures.lock().expect("failures"), &fleet.pod_logs()))?;
    fleet.keep_running()?;
    println!(
        "first replica serving after {:.1} s; starting {} streaming clients for {} s",
        started.elapsed().as_secs_f64(),
        args.clients,
        args.burst_seconds
    );

    let load = Arc::new(Load::default());
    let mut ticker = Ticker::new(services.clone(), load.clone());
    burst(&mut ticker, &mut fleet, args).await?;
    println!("burst over; waiting for the fleet to scale back to 1");
    let back_to_one = scale_back_to_one(&mut ticker, &mut fleet, &pods).await?;
    ticker.print_summary(args, back_to_one).await;
    print!(
        "{}",
        failed_pods_summary(&failures.lock().expect("failures"), &fleet.pod_logs())
    );
    let address = fleet.router_url();
    println!();
    println!(
        "client endpoint (npufleet-router): {address} (OpenAI-compatible and Open Inference Protocol REST)"
    );
    println!(
        "  curl {address}/v1/chat/completions -H 'content-type: application/json' -d '{{\"model\":\"{}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello\"}}]}}'",
        service.spec.model.name
    );
    println!("  KUBECONFIG={}", cluster.kubeconfig().display());
    fleet.print_logs(cluster, &ns);

    if !args.exit_after_demo {
        println!("\nserving until Ctrl-C");
        loop {
            ticker.ticks.tick().await;
            fleet.keep_running()?;
        }
    }
    Ok(())
}

/// Streaming clients through the router for `--burst-seconds`, a line a second.
async fn burst(ticker: &mut Ticker, fleet: &mut Fleet, args: &Args) -> Result<()> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()?;
    ticker.started = Instant::now();
    let clients: Vec<_> = (0..args.clients)
        .map(|_| {
            tokio::spawn(client_loop(
                ticker.load.clone(),
                http.clone(),
                fleet.router_url(),
            ))
        })
        .collect();
    let burst = Duration::from_secs(args.burst_seconds);
    while ticker.started.elapsed() < burst {
        ticker.tick(fleet, "burst").await?;
    }
    ticker.load.stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.await?;
    }
    Ok(())
}

/// Waits for the autoscaler to bring the idle fleet back to one pod; returns when, from the
/// burst's start.
async fn scale_back_to_one(
    ticker: &mut Ticker,
    fleet: &mut Fleet,
    pods: &Api<Pod>,
) -> Result<Duration> {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let desired = ticker.tick(fleet, "idle").await?;
        let live = pods.list(&ListParams::default()).await?.items.len();
        if desired == Some(1) && live == 1 {
            return Ok(ticker.started.elapsed());
        }
        if Instant::now() > deadline {
            bail!("no scale-down within 180 s of the burst (desired {desired:?}, {live} pods)");
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args = Args::parse();
    paths::locate_repo_root(args.repo.as_deref())?;
    let binaries = Binaries::find(args.target_dir.as_deref())?;
    let cluster = if args.real_node {
        println!(
            "starting a local control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler) and a real node (containerd, kubelet, kube-proxy, CoreDNS)"
        );
        Cluster::start(ClusterOptions::real_node()).await?
    } else {
        println!(
            "starting a local control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, KWOK)"
        );
        Cluster::start(ClusterOptions::full()).await?
    };
    println!(
        "control plane ready in {:.1} s at {}",
        cluster.started_in().as_secs_f64(),
        cluster.server_url()
    );
    let outcome = tokio::select! {
        result = demo(&cluster, &args, binaries) => result,
        interrupted = tokio::signal::ctrl_c() => {
            interrupted.context("listening for Ctrl-C")?;
            println!("\nCtrl-C: stopping the fleet, the operator and the control plane");
            Ok(())
        }
    };
    // The demo's processes stop as its future is dropped; the control plane stops here.
    drop(cluster);
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, phase: &str, log: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "uid": format!("uid-{name}")},
            "status": {"phase": phase, "containerStatuses": [{
                "name": "worker", "image": "", "imageID": "", "ready": false, "restartCount": 0,
                "state": {"terminated": {"exitCode": 2, "reason": "Error", "message": log}},
            }]},
        }))
        .expect("pod")
    }

    /// A worker that could not start (its address taken by another platform's worker) is
    /// named in the summary with the reason the node agent read from its log.
    #[test]
    fn the_summary_names_a_pod_that_failed_to_start() {
        let log = "error: cannot listen for gRPC on 127.77.60.2:8001: Address already in use (os error 98)";
        let why = format!("failed (Failed); container worker exited with code 2 (Error): {log}");
        let failures: Vec<PodFailure> = [
            pod("smollm2-0-0", "Running", ""),
            pod("smollm2-1-0", "Failed", log),
        ]
        .iter()
        .filter_map(PodFailure::of)
        .collect();
        let summary = failed_pods_summary(&failures, "/logs");
        assert_eq!(
            summary,
            format!("  failed pods:      1 (worker logs: /logs)\n    smollm2-1-0: {why}\n")
        );
        assert_eq!(
            failed_pods_summary(&[], "/logs"),
            "  failed pods:      none\n"
        );
    }
}

//! Starts the real `npufleet-worker serve` binary on loopback ports with a small
//! random-weight model, and talks to it; or, for protocol tests, the serving surfaces in
//! this process ([`in_process`]).

// Each test binary uses a different part of this module.
#![allow(dead_code)]

pub mod in_process;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use npufleet_contract::proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
use npufleet_contract::proto::inference::{ModelInferRequest, ModelStreamInferResponse};
use npufleet_test_support::wait;
use npufleet_worker_testkit::testmodel::{GenTestModelArgs, TestModelFormat, write_test_model};
use serde_json::Value;

pub const MODEL_NAME: &str = "tiny";

/// Writes a small deterministic model whose context allows long generations.
pub fn test_model(dir: &Path) -> PathBuf {
    let mut spec = GenTestModelArgs::new(dir.join("tiny.gguf"), TestModelFormat::Gguf);
    spec.context = 2048;
    write_test_model(&spec).expect("writing the test model")
}

pub struct Worker {
    child: Child,
    pub http: String,
    pub grpc: String,
    log: Arc<Mutex<Vec<String>>>,
    _dir: Option<tempfile::TempDir>,
}

/// Polls `check` until it returns `Some`, failing with `what` after `timeout`.
pub async fn poll_until<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let checked = wait::until(what, timeout, || {
        let check = check();
        async move { Ok(check.await) }
    });
    checked.await.unwrap_or_else(|error| panic!("{error:#}"))
}

impl Worker {
    /// Starts a worker with `extra` flags and waits until it is ready.
    pub async fn start(extra: &[&str]) -> Worker {
        let worker = Worker::spawn(extra);
        worker.wait_ready().await;
        worker
    }

    /// Starts a worker and returns once it listens, without waiting for readiness.
    pub fn spawn(extra: &[&str]) -> Worker {
        let dir = tempfile::tempdir().expect("temporary directory");
        let model = test_model(dir.path());
        let mut worker = Worker::spawn_model(&model, extra, &[]);
        worker._dir = Some(dir);
        worker
    }

    /// Starts `serve` on `model` with `extra` flags and `env`, and returns once it logs its
    /// HTTP address. Both output streams go to the log. A pod that only follows rank 0
    /// serves health over HTTP and has no gRPC address.
    pub fn spawn_model(model: &Path, extra: &[&str], env: &[(String, String)]) -> Worker {
        let mut child = Command::new(env!("CARGO_BIN_EXE_npufleet-worker"))
            .arg("serve")
            .arg("--model")
            .arg(model)
            .args([
                "--served-model-name",
                MODEL_NAME,
                "--grpc-addr",
                "127.0.0.1:0",
                "--http-addr",
                "127.0.0.1:0",
                "--warmup-iterations",
                "2",
                "--threads",
                "1",
                "--accelerator",
                "cpu",
                "--log-format",
                "json",
            ])
            .args(extra)
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting npufleet-worker");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (addrs_tx, addrs_rx) = mpsc::channel();
        for stream in [
            Box::new(child.stdout.take().expect("piped stdout")) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().expect("piped stderr")),
        ] {
            let (log, addrs_tx) = (log.clone(), addrs_tx.clone());
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if let Ok(entry) = serde_json::from_str::<serde_json::Value>(&line)
                        && let Some(http) = entry["http"].as_str()
                    {
                        let grpc = entry["grpc"].as_str().unwrap_or_default();
                        let _ = addrs_tx.send((http.to_string(), grpc.to_string()));
                    }
                    log.lock().unwrap().push(line);
                }
            });
        }
        // A tensor-parallel rank logs its address only once the whole ring is up.
        let (http, grpc) = addrs_rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| {
                panic!(
                    "the worker never logged its addresses: {:?}",
                    log.lock().unwrap()
                )
            });
        Worker {
            child,
            http: format!("http://{http}"),
            grpc: format!("http://{grpc}"),
            log,
            _dir: None,
        }
    }

    pub async fn wait_ready(&self) {
        let client = reqwest::Client::new();
        let url = format!("{}/v2/health/ready", self.http);
        poll_until(Duration::from_secs(60), "readiness", || {
            let request = client.get(&url).send();
            async move { request.await.ok().filter(|r| r.status().is_success()) }
        })
        .await;
    }

    pub async fn grpc_client(&self) -> GrpcInferenceServiceClient<tonic::transport::Channel> {
        GrpcInferenceServiceClient::connect(self.grpc.clone())
            .await
            .expect("connecting over gRPC")
    }

    /// The worker's resident memory (`VmRSS`), in bytes.
    pub fn resident_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("reading the worker's /proc status");
        let kib: u64 = status
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("no VmRSS in {status}"));
        kib * 1024
    }

    pub fn sigterm(&self) {
        self.signal("-TERM");
    }

    /// Sends `signal` (as `kill` spells it, for example `-KILL`).
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("running kill");
        assert!(status.success(), "kill {signal} failed");
    }

    /// Waits for the process to exit.
    pub async fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let child = &mut self.child;
        poll_until(timeout, "the worker to exit", || {
            let status = child.try_wait().expect("polling the worker");
            async move { status }
        })
        .await
    }

    pub fn log_lines(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    /// Fails the test, showing the log, unless the log contains `needle`.
    pub fn assert_logged(&self, needle: &str) {
        let log = self.log();
        assert!(log.contains(needle), "{needle:?} is not in the log:\n{log}");
    }

    pub fn log(&self) -> String {
        self.log_lines().join("\n")
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Splits an SSE body into its `data:` payloads.
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|event| event.trim().strip_prefix("data:"))
        .map(|data| data.trim().to_string())
        .collect()
}

/// Posts `body` as JSON to `url` and returns the response unread.
pub async fn send_json(client: &reqwest::Client, url: &str, body: &Value) -> reqwest::Response {
    client.post(url).json(body).send().await.unwrap()
}

/// Posts `body` as JSON; the status and the JSON answer.
pub async fn post(client: &reqwest::Client, url: &str, body: Value) -> (u16, Value) {
    let response = send_json(client, url, &body).await;
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

/// Gets `url`; the status and the JSON answer (`Null` when the body is not JSON).
pub async fn get_json(client: &reqwest::Client, url: &str) -> (u16, Value) {
    let response = client.get(url).send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// Gets `url` and returns its body.
pub async fn get_text(client: &reqwest::Client, url: &str) -> String {
    client.get(url).send().await.unwrap().text().await.unwrap()
}

/// Posts a streaming request and returns its `data:` payloads before the closing `[DONE]`,
/// which it checks is there.
pub async fn post_stream(client: &reqwest::Client, url: &str, body: &Value) -> Vec<String> {
    let body = send_json(client, url, body).await.text().await.unwrap();
    let mut events = sse_data(&body);
    assert_eq!(events.pop().as_deref(), Some("[DONE]"), "{body}");
    events
}

/// The message of an OpenAI-shaped error answer.
pub fn error_message(body: &Value) -> &str {
    body["error"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("no error message in {body}"))
}

/// Opens an Open Inference Protocol stream with `first` on it; later requests go in through
/// the sender.
pub async fn open_stream(
    client: &mut GrpcInferenceServiceClient<tonic::transport::Channel>,
    first: ModelInferRequest,
) -> (
    tokio::sync::mpsc::Sender<ModelInferRequest>,
    tonic::Streaming<ModelStreamInferResponse>,
) {
    let (requests, outgoing) = tokio::sync::mpsc::channel(4);
    let responses = client
        .model_stream_infer(tokio_stream::wrappers::ReceiverStream::new(outgoing))
        .await
        .unwrap()
        .into_inner();
    requests.send(first).await.unwrap();
    (requests, responses)
}

/// Posts `body` as it is, labelled JSON; the status and the JSON answer.
pub async fn post_raw(
    client: &reqwest::Client,
    url: &str,
    body: impl Into<reqwest::Body>,
) -> (u16, Value) {
    let response = client
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

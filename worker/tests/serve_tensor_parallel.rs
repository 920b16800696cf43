//! `npufleet-worker serve` as a tensor-parallel group wired by a real `hccl.json`: rank 0 serves
//! and leads, the other ranks follow (in other processes over the TCP ring, or as threads of
//! one process). Answers equal the unsharded worker's, and a lost rank stops the group.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use npufleet_worker::collective::bench::{free_port, loopback_rank_env, loopback_rank_table};
use npufleet_worker::model::testmodel::{GenTestModelArgs, TestModelFormat, write_into};
use serde_json::{Value, json};

const PROMPT: &str = "the quick brown fox jumps over the lazy dog";

/// 8 heads and 4 KV heads, so the model splits over 2 ranks.
fn model(dir: &Path) -> PathBuf {
    let mut spec = GenTestModelArgs::new(PathBuf::new(), TestModelFormat::Gguf);
    spec.layers = 2;
    spec.dim = 128;
    spec.heads = 8;
    spec.kv_heads = 4;
    spec.seed = 11;
    write_into(dir, spec).unwrap()
}

struct Process {
    child: Child,
    http: String,
    log: Arc<Mutex<Vec<String>>>,
}

impl Process {
    /// Starts `serve` with `env` and returns once it logs its HTTP address.
    fn start(model: &Path, env: &[(String, String)]) -> Process {
        let mut child = Command::new(env!("CARGO_BIN_EXE_npufleet-worker"))
            .arg("serve")
            .arg("--model")
            .arg(model)
            .args([
                "--served-model-name",
                "tiny",
                "--grpc-addr",
                "127.0.0.1:0",
                "--http-addr",
                "127.0.0.1:0",
                "--warmup-iterations",
                "2",
                "--threads",
                "1",
                "--precision",
                "fp32",
                "--accelerator",
                "cpu",
                "--log-format",
                "json",
            ])
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting npufleet-worker");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (addr_tx, addr_rx) = mpsc::channel();
        for stream in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let (log, addr_tx) = (log.clone(), addr_tx.clone());
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if let Ok(entry) = serde_json::from_str::<Value>(&line)
                        && let Some(http) = entry["fields"]["http"].as_str()
                    {
                        let _ = addr_tx.send(format!("http://{http}"));
                    }
                    log.lock().unwrap().push(line);
                }
            });
        }
        let http = addr_rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("no HTTP address logged: {:?}", log.lock().unwrap()));
        Process { child, http, log }
    }

    fn wait_ready(&self) {
        let url = format!("{}/v2/health/ready", self.http);
        poll(Duration::from_secs(120), "readiness", || {
            let response = reqwest::blocking::get(&url).ok()?;
            response.status().is_success().then_some(())
        });
    }

    fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let child = &mut self.child;
        poll(timeout, "the process to exit", || child.try_wait().unwrap())
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn poll<T>(timeout: Duration, what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn complete(worker: &Process) -> String {
    let response = reqwest::blocking::Client::new()
        .post(format!("{}/v1/completions", worker.http))
        .json(&json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}))
        .send()
        .unwrap();
    assert!(
        response.status().is_success(),
        "{}",
        response.text().unwrap()
    );
    let body: Value = response.json().unwrap();
    body["choices"][0]["text"].as_str().unwrap().to_string()
}

fn unsharded_text(model: &Path) -> String {
    let worker = Process::start(model, &[]);
    worker.wait_ready();
    let text = complete(&worker);
    assert!(!text.is_empty());
    text
}

/// Two processes on 127.0.0.2 and 127.0.0.3, wired by a two-server rank table.
fn two_process_group(dir: &Path, model: &Path) -> (Process, Process) {
    let table = dir.join("hccl.json");
    std::fs::write(&table, loopback_rank_table(2)).unwrap();
    let port = free_port().unwrap();
    // Neither rank logs its address before the ring is up, so they start side by side.
    std::thread::scope(|scope| {
        let follower =
            scope.spawn(|| Process::start(model, &loopback_rank_env(&table, 1, port, 30)));
        let leader = Process::start(model, &loopback_rank_env(&table, 0, port, 30));
        (leader, follower.join().unwrap())
    })
}

#[test]
fn a_two_pod_group_answers_like_one_worker_and_stops_together() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(dir.path());
    let expected = unsharded_text(&model);
    let (mut leader, mut follower) = two_process_group(dir.path(), &model);
    leader.wait_ready();
    follower.wait_ready();
    assert_eq!(complete(&leader), expected);
    assert!(
        leader.log().contains("\"world_size\":2"),
        "{}",
        leader.log()
    );

    let refused = reqwest::blocking::Client::new()
        .post(format!("{}/v1/completions", follower.http))
        .json(&json!({"model": "tiny", "prompt": PROMPT}))
        .send()
        .unwrap();
    assert_eq!(refused.status(), 404);
    assert!(refused.text().unwrap().contains("rank-0 pod"));

    // A follower outlives its own termination signal: the leader may still need it.
    follower.signal("-TERM");
    assert_eq!(complete(&leader), expected);
    leader.signal("-TERM");
    assert!(leader.wait_exit(Duration::from_secs(60)).success());
    let status = follower.wait_exit(Duration::from_secs(60));
    assert!(status.success(), "{status}: {}", follower.log());
    assert!(follower.log().contains("rank 0 stopped the group"));
}

#[test]
fn losing_a_rank_stops_the_leader_with_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(dir.path());
    let (mut leader, follower) = two_process_group(dir.path(), &model);
    leader.wait_ready();
    follower.signal("-KILL");
    let status = leader.wait_exit(Duration::from_secs(30));
    assert!(!status.success());
    assert!(
        leader.log().contains("lost tensor-parallel rank 1"),
        "{}",
        leader.log()
    );
}

#[test]
fn a_one_pod_group_runs_its_ranks_as_threads() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(dir.path());
    let expected = unsharded_text(&model);
    let table = dir.path().join("hccl.json");
    let server = json!({
        "server_id": "127.0.0.2", "host_ip": "127.0.0.2", "container_ip": "127.0.0.2",
        "device": [
            {"device_id": "0", "device_ip": "192.0.2.1", "rank_id": "0"},
            {"device_id": "1", "device_ip": "192.0.2.2", "rank_id": "1"},
        ],
    });
    let text = json!({
        "status": "completed", "version": "1.0", "server_count": "1", "server_list": [server],
    });
    std::fs::write(&table, text.to_string()).unwrap();
    let env = [
        ("RANK_TABLE_FILE".to_string(), table.display().to_string()),
        ("POD_IP".to_string(), "127.0.0.2".to_string()),
    ];
    let mut worker = Process::start(&model, &env);
    worker.wait_ready();
    assert_eq!(complete(&worker), expected);
    assert!(
        worker.log().contains("\"local_followers\":\"[1]\""),
        "{}",
        worker.log()
    );
    worker.signal("-TERM");
    let status = worker.wait_exit(Duration::from_secs(60));
    assert!(status.success(), "{status}: {}", worker.log());
}

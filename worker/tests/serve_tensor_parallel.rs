//! `npufleet-worker serve` as a tensor-parallel group wired by a real `hccl.json`: rank 0 serves
//! and leads, the other ranks follow (in other processes over the TCP ring, or as threads of
//! one process). Answers equal the unsharded worker's, and a lost rank stops the group.

mod serve_support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use npufleet_test_support::net::free_port;
use npufleet_worker::tools::collective_bench::{loopback_rank_env, loopback_rank_table};
use npufleet_worker_testkit::testmodel::{GenTestModelArgs, write_into};
use serde_json::{Value, json};
use serve_support::{MODEL_NAME, Worker};

const PROMPT: &str = "the quick brown fox jumps over the lazy dog";

/// 8 heads and 4 KV heads, so the model splits over 2 ranks.
fn model(dir: &Path) -> PathBuf {
    write_into(dir, GenTestModelArgs::splittable(2, 11)).unwrap()
}

/// Starts `serve` on `model` with `env`, at full precision so every split agrees exactly.
fn start(model: &Path, env: &[(String, String)]) -> Worker {
    Worker::spawn_model(model, &["--precision", "fp32"], env)
}

async fn complete(worker: &Worker) -> String {
    let response = reqwest::Client::new()
        .post(format!("{}/v1/completions", worker.http))
        .json(&json!({"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}))
        .send()
        .await
        .unwrap();
    assert!(
        response.status().is_success(),
        "{}",
        response.text().await.unwrap()
    );
    let body: Value = response.json().await.unwrap();
    body["choices"][0]["text"].as_str().unwrap().to_string()
}

async fn unsharded_text(model: &Path) -> String {
    let worker = start(model, &[]);
    worker.wait_ready().await;
    let text = complete(&worker).await;
    assert!(!text.is_empty());
    text
}

/// Two processes on 127.0.0.2 and 127.0.0.3, wired by a two-server rank table, whose
/// collectives wait `timeout_secs` for a peer (`HCCL_EXEC_TIMEOUT`).
fn two_process_group(dir: &Path, model: &Path, timeout_secs: u64) -> (Worker, Worker) {
    let table = dir.join("hccl.json");
    std::fs::write(&table, loopback_rank_table(2)).unwrap();
    let port = free_port().unwrap();
    // Neither rank logs its address before the ring is up, so they start side by side.
    std::thread::scope(|scope| {
        let follower =
            scope.spawn(|| start(model, &loopback_rank_env(&table, 1, port, timeout_secs)));
        let leader = start(model, &loopback_rank_env(&table, 0, port, timeout_secs));
        (leader, follower.join().unwrap())
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn a_two_pod_group_answers_like_one_worker_and_stops_together() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(dir.path());
    let expected = unsharded_text(&model).await;
    let (mut leader, mut follower) = two_process_group(dir.path(), &model, 30);
    leader.wait_ready().await;
    follower.wait_ready().await;
    assert_eq!(complete(&leader).await, expected);
    leader.assert_logged("\"world_size\":2");

    let refused = reqwest::Client::new()
        .post(format!("{}/v1/completions", follower.http))
        .json(&json!({"model": MODEL_NAME, "prompt": PROMPT}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 404);
    assert!(refused.text().await.unwrap().contains("rank-0 pod"));

    // A follower outlives its own termination signal: the leader may still need it.
    follower.signal("-TERM");
    assert_eq!(complete(&leader).await, expected);
    leader.signal("-TERM");
    assert!(leader.wait_exit(Duration::from_secs(60)).await.success());
    let status = follower.wait_exit(Duration::from_secs(60)).await;
    assert!(status.success(), "{status}: {}", follower.log());
    assert!(follower.log().contains("rank 0 stopped the group"));
}

#[tokio::test(flavor = "multi_thread")]
async fn losing_a_rank_stops_the_leader_with_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(dir.path());
    let (mut leader, follower) = two_process_group(dir.path(), &model, 30);
    leader.wait_ready().await;
    follower.signal("-KILL");
    let status = leader.wait_exit(Duration::from_secs(30)).await;
    assert!(!status.success());
    leader.assert_logged("lost tensor-parallel rank 1");
}

/// A rank that hangs rather than dies (SIGSTOP): the next collective gives up after the
/// execution timeout naming it, the client gets an error instead of waiting, and the leader
/// exits so that the operator makes the group again.
#[tokio::test(flavor = "multi_thread")]
async fn a_hung_rank_stops_the_group_within_the_execution_timeout_naming_it() {
    const EXEC_TIMEOUT: Duration = Duration::from_secs(3);
    let dir = tempfile::tempdir().unwrap();
    let model = model(dir.path());
    let (mut leader, follower) = two_process_group(dir.path(), &model, EXEC_TIMEOUT.as_secs());
    leader.wait_ready().await;
    follower.wait_ready().await;
    follower.signal("-STOP");
    let hung = Instant::now();
    let answer = reqwest::Client::new()
        .post(format!("{}/v1/completions", leader.http))
        .json(&json!({"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 16}))
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}: {}", leader.log()));
    let answered_in = hung.elapsed();
    let status = answer.status();
    let body = answer.text().await.unwrap();
    let exit = leader.wait_exit(Duration::from_secs(30)).await;
    let exited_in = hung.elapsed();
    follower.signal("-KILL");
    eprintln!(
        "one rank of two SIGSTOPped, execution timeout {EXEC_TIMEOUT:?}: the client had its error after {:.2} s, the leader exited after {:.2} s",
        answered_in.as_secs_f64(),
        exited_in.as_secs_f64()
    );
    assert!(status.is_server_error(), "{status}: {body}");
    assert!(body.contains("waiting for rank 1"), "{body}");
    assert!(!exit.success());
    leader.assert_logged("waiting for rank 1");
    assert!(
        answered_in >= EXEC_TIMEOUT && answered_in < EXEC_TIMEOUT * 4,
        "the client waited {answered_in:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_one_pod_group_runs_its_ranks_as_threads() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(dir.path());
    let expected = unsharded_text(&model).await;
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
    let mut worker = start(&model, &env);
    worker.wait_ready().await;
    assert_eq!(complete(&worker).await, expected);
    worker.assert_logged("\"local_followers\":\"[1]\"");
    worker.signal("-TERM");
    let status = worker.wait_exit(Duration::from_secs(60)).await;
    assert!(status.success(), "{status}: {}", worker.log());
}

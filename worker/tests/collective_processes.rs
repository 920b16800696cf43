//! Separate `npufleet-worker` processes joined into a TCP ring by a real hccl.json rank table
//! on 127.0.0.x addresses, each finding its rank from POD_IP.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use npufleet_test_support::net::free_port;
use npufleet_worker::tools::collective_bench::{JoinEvent, loopback_rank_env, loopback_rank_table};

const WORKER: &str = env!("CARGO_BIN_EXE_npufleet-worker");

fn spawn_rank(
    table: &Path,
    rank: usize,
    port_base: u16,
    timeout_secs: u64,
    args: &[&str],
) -> Child {
    Command::new(WORKER)
        .args(["collective-bench", "--join"])
        .args(args)
        .envs(loopback_rank_env(table, rank, port_base, timeout_secs))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for a child to exit, killing it if it takes longer than `limit`.
fn finish(mut child: Child, limit: Duration) -> (bool, String, String) {
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("a rank did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn write_table(dir: &Path, text: &str) -> std::path::PathBuf {
    let path = dir.join("hccl.json");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn separate_processes_all_reduce_and_broadcast_correctly() {
    let dir = tempfile::tempdir().unwrap();
    let table = write_table(dir.path(), &loopback_rank_table(3));
    let port = free_port().unwrap();
    let children: Vec<Child> = (0..3)
        .map(|rank| {
            spawn_rank(
                &table,
                rank,
                port,
                20,
                &["--sizes", "4,12,4096,1048580", "--repeat", "200"],
            )
        })
        .collect();
    for (rank, child) in children.into_iter().enumerate() {
        let (ok, stdout, stderr) = finish(child, Duration::from_secs(60));
        assert!(ok, "rank {rank} failed: {stderr}");
        let events: Vec<JoinEvent> = stdout
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(
            events.first(),
            Some(&JoinEvent::Ready {
                rank,
                world_size: 3
            })
        );
        assert_eq!(events.last(), Some(&JoinEvent::Done { rank, checked: 204 }));
    }
}

#[test]
fn killing_one_process_makes_the_others_fail_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let table = write_table(dir.path(), &loopback_rank_table(4));
    let port = free_port().unwrap();
    let timeout_secs = 10;
    let mut children: Vec<Child> = (0..4)
        .map(|rank| {
            spawn_rank(
                &table,
                rank,
                port,
                timeout_secs,
                &["--sizes", "65536", "--repeat", "100000000"],
            )
        })
        .collect();
    // Every rank says it joined the ring before one of them is killed.
    let (ready_tx, ready_rx) = mpsc::channel();
    for child in &mut children {
        let stdout = child.stdout.take().unwrap();
        let ready_tx = ready_tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Ok(JoinEvent::Ready { rank, .. }) = serde_json::from_str(&line) {
                    let _ = ready_tx.send(rank);
                }
            }
        });
    }
    for _ in 0..4 {
        ready_rx
            .recv_timeout(Duration::from_secs(30))
            .expect("every rank joins the ring");
    }
    let lost = 2;
    children[lost].kill().unwrap();
    children[lost].wait().unwrap();
    let killed_at = Instant::now();
    for (rank, child) in children.into_iter().enumerate().filter(|(r, _)| *r != lost) {
        let (ok, _, stderr) = finish(child, Duration::from_secs(timeout_secs));
        assert!(!ok, "rank {rank} kept running after rank {lost} was killed");
        assert!(
            stderr.contains(&format!("lost tensor-parallel rank {lost}")),
            "rank {rank}: {stderr}"
        );
    }
    assert!(
        killed_at.elapsed() < Duration::from_secs(timeout_secs),
        "took {:?}",
        killed_at.elapsed()
    );
}

#[test]
fn a_rank_table_stuck_initializing_fails_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let table = write_table(
        dir.path(),
        r#"{"status": "initializing", "version": "1.0", "server_count": "0", "server_list": []}"#,
    );
    let started = Instant::now();
    let (ok, _, stderr) = finish(
        spawn_rank(&table, 0, free_port().unwrap(), 1, &[]),
        Duration::from_secs(20),
    );
    assert!(!ok);
    assert!(
        stderr.contains("still says \"initializing\" after 1 s"),
        "{stderr}"
    );
    assert!(started.elapsed() >= Duration::from_secs(1));
}

#[test]
fn bad_settings_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let table = write_table(dir.path(), &loopback_rank_table(2));
    let cases: &[(&str, &str, &str)] = &[
        (
            "HCCL_ALGO",
            "level0:NA;level1:H-D_R",
            "level1:H-D_R is not implemented by the CPU ring; use level1:ring",
        ),
        (
            "HCCL_CONNECT_TIMEOUT",
            "abc",
            "HCCL_CONNECT_TIMEOUT must be an integer",
        ),
        ("HCCL_SOCKET_IFNAME", "=nosuchif0", "matches no interface"),
        (
            "POD_IP",
            "10.1.2.3",
            "POD_IP 10.1.2.3 is not the container_ip",
        ),
    ];
    for (name, value, expected) in cases {
        let child = Command::new(WORKER)
            .args(["collective-bench", "--join"])
            .envs(loopback_rank_env(&table, 0, free_port().unwrap(), 2))
            .env(name, value)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (ok, _, stderr) = finish(child, Duration::from_secs(20));
        assert!(!ok && stderr.contains(expected), "{name}={value}: {stderr}");
    }
    let version_two = write_table(
        dir.path(),
        &loopback_rank_table(2).replace(r#""version":"1.0""#, r#""version":"2.0""#),
    );
    let (ok, _, stderr) = finish(
        spawn_rank(&version_two, 0, free_port().unwrap(), 2, &[]),
        Duration::from_secs(20),
    );
    assert!(
        !ok && stderr.contains("version \"2.0\" is not supported; supported versions: 1.0"),
        "{stderr}"
    );
}

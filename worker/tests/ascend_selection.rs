//! The worker binary on a host without CANN: asking for Ascend fails at start with the reason
//! (which libraries, every directory searched, how to install CANN); `auto` serves on the CPU.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use npufleet_test_support::net::free_addr;
use npufleet_worker_testkit::testmodel::{GenTestModelArgs, TestModelFormat, write_test_model};

const WORKER: &str = env!("CARGO_BIN_EXE_npufleet-worker");
const DEFAULT_CANN_LIB64: &str = "/usr/local/Ascend/ascend-toolkit/latest/lib64";

/// A worker command whose CANN search path is made of empty temporary directories.
fn worker(dir: &Path) -> Command {
    let home = dir.join("cann");
    let extra = dir.join("extra-libs");
    std::fs::create_dir_all(&extra).unwrap();
    let mut cmd = Command::new(WORKER);
    cmd.env("ASCEND_HOME_PATH", &home)
        .env("LD_LIBRARY_PATH", &extra)
        .env_remove("NPUFLEET_ACCELERATOR")
        .env_remove("RANK_TABLE_FILE");
    cmd
}

fn assert_names_cann_and_search_path(dir: &Path, text: &str) {
    for library in ["libascendcl.so", "libacl_cblas.so", "libhccl.so"] {
        assert!(text.contains(library), "{library} not named in:\n{text}");
    }
    for searched in [
        dir.join("cann/lib64"),
        dir.join("extra-libs"),
        PathBuf::from(DEFAULT_CANN_LIB64),
    ] {
        let searched = searched.display().to_string();
        assert!(text.contains(&searched), "{searched} not named in:\n{text}");
    }
    assert!(text.contains("Install the CANN toolkit"), "{text}");
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn test_model(dir: &Path) -> PathBuf {
    write_test_model(&GenTestModelArgs::new(
        dir.join("tiny.gguf"),
        TestModelFormat::Gguf,
    ))
    .expect("writing the test model")
}

#[test]
fn serve_with_ascend_fails_at_start_naming_libraries_and_paths() {
    let dir = tempfile::tempdir().unwrap();
    let model = test_model(dir.path());
    let out = worker(dir.path())
        .args(["serve", "--accelerator", "ascend", "--model"])
        .arg(&model)
        .args(["--http-addr", &free_addr().unwrap().to_string()])
        .args(["--grpc-addr", &free_addr().unwrap().to_string()])
        .stdin(Stdio::null())
        .output()
        .expect("running serve");
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert_names_cann_and_search_path(dir.path(), &text(&out));
}

#[test]
fn hccl_selftest_fails_before_waiting_for_peers() {
    let dir = tempfile::tempdir().unwrap();
    let table = dir.path().join("hccl.json");
    std::fs::write(&table, r#"{"status": "initializing", "version": "1.0"}"#).unwrap();
    let started = Instant::now();
    let out = worker(dir.path())
        .arg("hccl-selftest")
        .env("RANK_TABLE_FILE", &table)
        .stdin(Stdio::null())
        .output()
        .expect("running hccl-selftest");
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert_names_cann_and_search_path(dir.path(), &text(&out));
    // The rank table never completes; the missing libraries are reported without waiting.
    assert!(started.elapsed() < Duration::from_secs(30));
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One HTTP/1.1 exchange; returns the status code and body.
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

#[test]
fn serve_with_auto_falls_back_to_the_cpu_and_answers() {
    let dir = tempfile::tempdir().unwrap();
    let model = test_model(dir.path());
    let http_addr = free_addr().unwrap();
    let log_path = dir.path().join("worker.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let child = worker(dir.path())
        .args(["serve", "--accelerator", "auto", "--model"])
        .arg(&model)
        .args(["--served-model-name", "tiny"])
        .args(["--http-addr", &http_addr.to_string()])
        .args(["--grpc-addr", &free_addr().unwrap().to_string()])
        .args(["--warmup-iterations", "1", "--threads", "1"])
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("starting serve");
    let mut server = Server(child);

    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(status) = server.0.try_wait().unwrap() {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            panic!("worker exited with {status} before becoming ready:\n{log}");
        }
        if matches!(http(http_addr, "GET", "/v2/health/ready", ""), Ok((200, _))) {
            break;
        }
        assert!(Instant::now() < deadline, "worker not ready within 120 s");
        std::thread::sleep(Duration::from_millis(100));
    }

    let (status, body) = http(
        http_addr,
        "POST",
        "/v1/completions",
        r#"{"model": "tiny", "prompt": "hello", "max_tokens": 3}"#,
    )
    .expect("completion request");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"choices\""), "{body}");

    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(log.contains("no usable NPU; computing on the CPU"), "{log}");
    assert!(log.contains("libascendcl.so"), "{log}");
}

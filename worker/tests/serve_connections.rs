//! How the worker's listeners treat connections: every accepted socket has TCP_NODELAY; a
//! connection over `--max-connections` gets 503 (HTTP) or UNAVAILABLE (gRPC) naming the limit
//! while the first ones are still served; and, on the real binary with its flags, a partial
//! request head, a silent connection and an idle kept-alive one are closed within their
//! bounds.

mod serve_support;

use std::net::SocketAddr;
use std::os::fd::{BorrowedFd, RawFd};
use std::time::Duration;

use npufleet_contract::listener::ConnectionLimits;
use npufleet_contract::proto::inference::ServerLiveRequest;
use npufleet_contract::proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
use npufleet_test_support::raw_http;
use serve_support::Worker;
use serve_support::in_process::InProcessWorker;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

fn address(url: &str) -> SocketAddr {
    url.trim_start_matches("http://").parse().unwrap()
}

/// Whether this process's side of the connection from `peer` to `local` has TCP_NODELAY set,
/// found among the process's descriptors (the server runs in this process).
fn server_side_nodelay(local: SocketAddr, peer: SocketAddr) -> Option<bool> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<RawFd>().ok())
        .find_map(|fd| {
            // SAFETY: the descriptor is only queried; one closed meanwhile makes the query fail.
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            let socket = socket2::SockRef::from(&fd);
            let addresses = (socket.local_addr().ok()?, socket.peer_addr().ok()?);
            (addresses.0.as_socket()? == local && addresses.1.as_socket()? == peer)
                .then(|| socket.tcp_nodelay().unwrap())
        })
}

#[tokio::test]
async fn accepted_connections_have_tcp_nodelay() {
    let worker = InProcessWorker::with(|_| {}).await;
    for url in [&worker.http, &worker.grpc] {
        let server = address(url);
        let client = TcpStream::connect(server).await.unwrap();
        let peer = client.local_addr().unwrap();
        let nodelay = serve_support::poll_until(
            Duration::from_secs(5),
            "the server's side of the connection",
            || std::future::ready(server_side_nodelay(server, peer)),
        )
        .await;
        assert!(nodelay, "{url}: an accepted connection without TCP_NODELAY");
    }
}

#[tokio::test]
async fn connections_over_the_limit_are_refused_by_name_while_the_first_are_served() {
    let worker = InProcessWorker::with(|config| {
        config.connections = ConnectionLimits {
            max_connections: 2,
            ..ConnectionLimits::default()
        }
    })
    .await;

    let http = address(&worker.http);
    let mut first = TcpStream::connect(http).await.unwrap();
    let mut second = TcpStream::connect(http).await.unwrap();
    for connection in [&mut first, &mut second] {
        assert_eq!(raw_http::get(connection, "/health").await.unwrap().0, 200);
    }
    let answer = raw_http::get_until_closed(http, "/health", Duration::from_secs(5))
        .await
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("2 connections open"), "{answer}");
    assert!(answer.contains("--max-connections"), "{answer}");
    for connection in [&mut first, &mut second] {
        assert_eq!(raw_http::get(connection, "/health").await.unwrap().0, 200);
    }

    // A gRPC channel is one connection.
    let mut channels = Vec::new();
    for _ in 0..2 {
        let mut client = worker.grpc_client().await;
        client.server_live(ServerLiveRequest {}).await.unwrap();
        channels.push(client);
    }
    let mut over = GrpcInferenceServiceClient::connect(worker.grpc.clone())
        .await
        .unwrap();
    let refused = over
        .server_live(ServerLiveRequest {})
        .await
        .expect_err("a connection over the limit was served");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(
        refused.message().contains("--max-connections"),
        "{refused:?}"
    );
    for client in &mut channels {
        assert!(
            client
                .server_live(ServerLiveRequest {})
                .await
                .unwrap()
                .into_inner()
                .live
        );
    }
}

/// The flags reach both listeners: a connection must open its first request within
/// `--header-read-timeout` (1.5 s here) and a kept-alive one is closed after
/// `--idle-timeout` (0.5 s) without one.
#[tokio::test]
async fn the_binary_closes_partial_silent_and_idle_connections_within_its_flags() {
    let worker = Worker::start(&["--header-read-timeout", "1.5", "--idle-timeout", "0.5"]).await;
    let (http, grpc) = (address(&worker.http), address(&worker.grpc));

    let mut partial = TcpStream::connect(http).await.unwrap();
    partial
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n")
        .await
        .unwrap();
    let mut silent = TcpStream::connect(grpc).await.unwrap();
    let mut kept = TcpStream::connect(http).await.unwrap();
    assert_eq!(raw_http::get(&mut kept, "/health").await.unwrap().0, 200);

    let within = Duration::from_secs(10);
    let (kept, partial, silent) = tokio::join!(
        raw_http::wait_closed(&mut kept, within),
        raw_http::wait_closed(&mut partial, within),
        raw_http::wait_closed(&mut silent, within),
    );
    let (idle_for, partial_for, silent_for) =
        (kept.unwrap().1, partial.unwrap().1, silent.unwrap().1);
    let idle_bound = Duration::from_millis(400)..Duration::from_millis(1300);
    let header_bound = Duration::from_millis(1300)..Duration::from_secs(3);
    assert!(
        idle_bound.contains(&idle_for),
        "the idle connection closed after {idle_for:?}"
    );
    assert!(
        header_bound.contains(&partial_for),
        "the partial head closed after {partial_for:?}"
    );
    assert!(
        header_bound.contains(&silent_for),
        "the silent gRPC connection closed after {silent_for:?}"
    );
}

//! Clients that hold a TCP connection themselves, for tests of how a server treats its
//! connections: one that sends part of a request and stops, one kept alive between requests,
//! and the moment the server closes it.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Reads `stream` until the server closes it (end of stream or reset), for at most `within`;
/// returns what the server sent and how long it took. Fails if the connection is still open.
pub async fn wait_closed(stream: &mut TcpStream, within: Duration) -> Result<(Vec<u8>, Duration)> {
    let started = Instant::now();
    let mut received = Vec::new();
    let read = tokio::time::timeout(within, async {
        let mut chunk = [0u8; 4096];
        loop {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => received.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await;
    if read.is_err() {
        bail!(
            "the connection was still open after {within:?}; the server sent {:?}",
            String::from_utf8_lossy(&received)
        );
    }
    Ok((received, started.elapsed()))
}

/// Sends `GET path` on a new connection to `address` and reads until the server closes it, for
/// at most `within`: all it sent, as text.
pub async fn get_until_closed(address: SocketAddr, path: &str, within: Duration) -> Result<String> {
    let mut stream = TcpStream::connect(address).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: test\r\n\r\n").as_bytes())
        .await?;
    let (sent, _) = wait_closed(&mut stream, within).await?;
    Ok(String::from_utf8(sent)?)
}

/// Sends `GET path` on `stream`, kept alive, and reads the response: its status and body.
pub async fn get(stream: &mut TcpStream, path: &str) -> Result<(u16, String)> {
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: test\r\n\r\n").as_bytes())
        .await?;
    read_response(stream).await
}

/// One HTTP/1.1 response with a `Content-Length`: its status and body.
pub async fn read_response(stream: &mut TcpStream) -> Result<(u16, String)> {
    let mut received = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(at) = received.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            bail!(
                "the connection closed before a response: {:?}",
                String::from_utf8_lossy(&received)
            );
        }
        received.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&received[..head_end]).into_owned();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("no status in {head:?}"))?;
    let length: usize = head
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .with_context(|| format!("no Content-Length in {head:?}"))?;
    while received.len() < head_end + length {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            bail!("the connection closed within the body of {head:?}");
        }
        received.extend_from_slice(&chunk[..n]);
    }
    let body = String::from_utf8_lossy(&received[head_end..head_end + length]).into_owned();
    Ok((status, body))
}

//! Loopback addresses for servers a test starts.

use std::net::{SocketAddr, TcpListener};

use anyhow::{Context, Result};

/// A 127.0.0.1 address whose port nobody listens on right now.
pub fn free_addr() -> Result<SocketAddr> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .context("binding a free loopback port")
}

/// A TCP port nobody listens on right now, on 127.0.0.1.
pub fn free_port() -> Result<u16> {
    Ok(free_addr()?.port())
}

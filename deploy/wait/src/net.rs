//! Loopback addresses for the servers the platform or a test starts.
//!
//! A port handed out here is one the kernel never picks as the source port of an outgoing
//! connection: a port taken from the ephemeral range and released can be reused by any
//! `connect()` before the server that was meant to have it binds it (kube-apiserver then
//! fails with "address already in use"). Ports below that range are only ever bound on
//! purpose, and this process never hands out the same one twice.

use std::collections::HashSet;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::sync::{Mutex, OnceLock};

use anyhow::{Result, bail};
use rand::Rng;

/// The lowest port handed out: above the registered services most machines run.
const LOWEST_PORT: u16 = 10_000;

/// A 127.0.0.1 address whose port nobody listens on right now.
pub fn free_addr() -> Result<SocketAddr> {
    Ok(SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()?)))
}

/// A TCP port on 127.0.0.1 that nobody listens on right now, outside the kernel's ephemeral
/// range, and not handed out before by this process.
pub fn free_port() -> Result<u16> {
    static HANDED_OUT: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    let mut handed_out = HANDED_OUT
        .get_or_init(Default::default)
        .lock()
        .expect("handed-out ports");
    let ceiling = ephemeral_range_start().max(LOWEST_PORT + 1_000);
    let mut rng = rand::rng();
    for _ in 0..1_000 {
        let port = rng.random_range(LOWEST_PORT..ceiling);
        if handed_out.contains(&port) {
            continue;
        }
        if TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
            handed_out.insert(port);
            return Ok(port);
        }
    }
    bail!("no free loopback port between {LOWEST_PORT} and {ceiling} after 1000 tries")
}

/// The first port of the kernel's ephemeral range (Linux's default where it cannot be read).
fn ephemeral_range_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

//! The loopback /24 a node agent gives its node and pods.
//!
//! Every 127.0.0.0/8 address reaches this machine, so an agent needs no network set-up: its
//! node is `127.77.<n>.1` and its pods `127.77.<n>.2 ..= .254`. Two local platforms on one
//! machine (`make run` beside a test binary, or two of either) must never use the same `<n>`:
//! the second one's workers would fail to bind their ports, and its router would send requests
//! to the first one's workers. So an agent holds its /24 for as long as it runs by binding an
//! abstract Unix socket named after it. The kernel lets one socket hold a name, releases it
//! when the holder exits however it exits (no stale lock after a crash), and keeps one set of
//! names per network namespace, as it keeps one loopback interface.

use std::io::ErrorKind;
use std::net::Ipv4Addr;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener};

use anyhow::{Context, Result, bail};

/// The first two octets of every agent's /24.
const PREFIX: [u8; 2] = [127, 77];

/// A /24 of 127.77.0.0/16 that this process holds until it is dropped.
#[derive(Debug)]
pub struct PodSubnet {
    third_octet: u8,
    _claim: UnixListener,
}

impl PodSubnet {
    /// The first /24 no other holder has, trying `127.77.<preferred>.0/24` first and then the
    /// next ones, wrapping around.
    pub fn claim(preferred: u8) -> Result<Self> {
        for third_octet in (0..=u8::MAX).map(|step| preferred.wrapping_add(step)) {
            let [a, b] = PREFIX;
            let name = format!("npufleet-local/pod-subnet/{a}.{b}.{third_octet}.0/24");
            let address = SocketAddr::from_abstract_name(name.as_bytes())
                .with_context(|| format!("abstract socket name {name}"))?;
            match UnixListener::bind_addr(&address) {
                Ok(claim) => {
                    return Ok(Self {
                        third_octet,
                        _claim: claim,
                    });
                }
                Err(e) if e.kind() == ErrorKind::AddrInUse => {}
                Err(e) => return Err(e).with_context(|| format!("claiming {name}")),
            }
        }
        let [a, b] = PREFIX;
        bail!(
            "every /24 of {a}.{b}.0.0/16 is held by another local platform on this machine; stop one"
        )
    }

    /// The node's own address, `.1`.
    pub fn node_address(&self) -> Ipv4Addr {
        self.address(1)
    }

    /// The addresses pods get, `.2 ..= .254`.
    pub fn pod_addresses(&self) -> impl DoubleEndedIterator<Item = Ipv4Addr> + '_ {
        (2..=254).map(|host| self.address(host))
    }

    fn address(&self, host: u8) -> Ipv4Addr {
        let [a, b] = PREFIX;
        Ipv4Addr::new(a, b, self.third_octet, host)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    /// Two platforms asking for the same /24 (as every `make run` asks for one) get two.
    #[test]
    fn two_claims_of_the_same_subnet_get_disjoint_addresses() {
        let first = PodSubnet::claim(60).expect("first claim");
        let second = PodSubnet::claim(60).expect("second claim");
        let taken: HashSet<Ipv4Addr> = first
            .pod_addresses()
            .chain([first.node_address()])
            .collect();
        let overlap: Vec<Ipv4Addr> = second
            .pod_addresses()
            .chain([second.node_address()])
            .filter(|address| taken.contains(address))
            .collect();
        assert!(overlap.is_empty(), "both platforms hold {overlap:?}");
    }

    /// A claim ends with its holder: a platform that stopped leaves its /24 to the next one.
    #[test]
    fn a_dropped_claim_is_free_again() {
        let held = PodSubnet::claim(200).expect("claim");
        let third_octet = held.third_octet;
        drop(held);
        let again = PodSubnet::claim(third_octet).expect("claim again");
        assert_eq!(again.third_octet, third_octet);
    }
}

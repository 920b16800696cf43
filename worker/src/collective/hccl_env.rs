//! The HCCL environment variables the CPU ring honours, read the way HCCL reads them.

use std::net::IpAddr;
use std::time::Duration;

pub const DEFAULT_CONNECT_TIMEOUT_SECS: u64 = 120;
pub const CONNECT_TIMEOUT_RANGE_SECS: std::ops::RangeInclusive<u64> = 120..=7200;
pub const DEFAULT_EXEC_TIMEOUT_SECS: u64 = 1836;
/// Set to `1` to allow `HCCL_CONNECT_TIMEOUT` below HCCL's 120 s minimum. Meant for tests,
/// which must see a missing peer fail within seconds.
pub const ALLOW_SHORT_TIMEOUTS_ENV: &str = "NPUFLEET_ALLOW_SHORT_TIMEOUTS";

/// `HCCL_CONNECT_TIMEOUT`: integer seconds in 120..=7200, default 120; smaller values only
/// when `allow_short` (from [`ALLOW_SHORT_TIMEOUTS_ENV`]).
pub fn connect_timeout(value: Option<&str>, allow_short: bool) -> Result<Duration, String> {
    let Some(value) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(Duration::from_secs(DEFAULT_CONNECT_TIMEOUT_SECS));
    };
    let secs: u64 = value.parse().map_err(|_| {
        format!("HCCL_CONNECT_TIMEOUT must be an integer number of seconds, got {value:?}")
    })?;
    let range = CONNECT_TIMEOUT_RANGE_SECS;
    if secs > *range.end() || (secs < *range.start() && !(allow_short && secs > 0)) {
        return Err(format!(
            "HCCL_CONNECT_TIMEOUT must be between {} and {} seconds, got {secs} \
             (set {ALLOW_SHORT_TIMEOUTS_ENV}=1 to allow shorter values in tests)",
            range.start(),
            range.end()
        ));
    }
    Ok(Duration::from_secs(secs))
}

/// `HCCL_EXEC_TIMEOUT`: how long a collective waits for a peer to make progress, integer
/// seconds ≥ 1, default 1836 as in HCCL.
pub fn exec_timeout(value: Option<&str>) -> Result<Duration, String> {
    let Some(value) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(Duration::from_secs(DEFAULT_EXEC_TIMEOUT_SECS));
    };
    match value.parse::<u64>() {
        Ok(secs) if secs > 0 => Ok(Duration::from_secs(secs)),
        _ => Err(format!(
            "HCCL_EXEC_TIMEOUT must be a positive integer number of seconds, got {value:?}"
        )),
    }
}

/// `HCCL_ALGO`: only the ring is implemented, so accept it (or no choice) and refuse the rest
/// by name.
pub fn check_algo(value: Option<&str>) -> Result<(), String> {
    let Some(value) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(());
    };
    for part in value.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((level, algo)) = part.split_once(':') else {
            return Err(format!(
                "HCCL_ALGO entry {part:?} is not of the form level<N>:<algorithm>"
            ));
        };
        match (level.trim(), algo.trim()) {
            ("level0", "NA") | ("level1", "ring") => {}
            ("level0", other) => {
                return Err(format!("HCCL_ALGO level0 accepts only NA, got {other:?}"));
            }
            ("level1", algo @ ("H-D_R" | "NHR" | "NB" | "pipeline" | "pairwise")) => {
                return Err(format!(
                    "HCCL_ALGO level1:{algo} is not implemented by the CPU ring; use level1:ring \
                     (or leave HCCL_ALGO unset)"
                ));
            }
            ("level1", other) => {
                return Err(format!(
                    "HCCL_ALGO level1 algorithm {other:?} is unknown; the CPU ring implements only ring"
                ));
            }
            (other, _) => {
                return Err(format!(
                    "HCCL_ALGO level {other:?} is unknown; expected level0 or level1"
                ));
            }
        }
    }
    Ok(())
}

/// Which interfaces `HCCL_SOCKET_IFNAME` allows: a comma-separated list of name prefixes,
/// `=` for exact names, `^` to exclude instead of include.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IfnameFilter {
    pub exclude: bool,
    pub exact: bool,
    pub names: Vec<String>,
}

impl IfnameFilter {
    pub fn parse(spec: &str) -> Result<Self, String> {
        let (exclude, rest) = match spec.trim().strip_prefix('^') {
            Some(rest) => (true, rest),
            None => (false, spec.trim()),
        };
        let (exact, rest) = match rest.strip_prefix('=') {
            Some(rest) => (true, rest),
            None => (false, rest),
        };
        let names: Vec<String> = rest
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(String::from)
            .collect();
        if names.is_empty() {
            return Err(format!("HCCL_SOCKET_IFNAME {spec:?} names no interface"));
        }
        Ok(IfnameFilter {
            exclude,
            exact,
            names,
        })
    }

    fn names_match(&self, interface: &str) -> bool {
        self.names.iter().any(|n| {
            if self.exact {
                interface == n
            } else {
                interface.starts_with(n.as_str())
            }
        })
    }

    /// Whether `interface` may carry the ring. Loopback is only used when named explicitly.
    pub fn allows(&self, interface: &str, is_loopback: bool) -> bool {
        if self.exclude {
            !is_loopback && !self.names_match(interface)
        } else {
            self.names_match(interface)
        }
    }
}

/// A network interface address, as listed by the system.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InterfaceAddr {
    pub name: String,
    pub ip: IpAddr,
}

/// Picks the address the ring listens on: `HCCL_IF_IP` if set (it must be one of this host's
/// addresses), else the first address of the first interface `HCCL_SOCKET_IFNAME` allows
/// (IPv4 before IPv6, interfaces in system order). `None` when neither is set, in which case
/// the rank listens on its own rank-table address.
pub fn select_bind_ip(
    interfaces: &[InterfaceAddr],
    if_ip: Option<&str>,
    socket_ifname: Option<&str>,
) -> Result<Option<IpAddr>, String> {
    if let Some(value) = if_ip.map(str::trim).filter(|v| !v.is_empty()) {
        let ip: IpAddr = value
            .parse()
            .map_err(|_| format!("HCCL_IF_IP {value:?} is not an IP address"))?;
        if !interfaces.iter().any(|i| i.ip == ip) {
            return Err(format!(
                "HCCL_IF_IP {ip} is not an address of this host ({})",
                describe(interfaces)
            ));
        }
        return Ok(Some(ip));
    }
    let Some(spec) = socket_ifname.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    let filter = IfnameFilter::parse(spec)?;
    let allowed: Vec<&InterfaceAddr> = interfaces
        .iter()
        .filter(|i| filter.allows(&i.name, i.ip.is_loopback()))
        .collect();
    allowed
        .iter()
        .find(|i| i.ip.is_ipv4())
        .or_else(|| allowed.first())
        .map(|i| Some(i.ip))
        .ok_or_else(|| {
            format!(
                "HCCL_SOCKET_IFNAME {spec:?} matches no interface of this host ({})",
                describe(interfaces)
            )
        })
}

fn describe(interfaces: &[InterfaceAddr]) -> String {
    interfaces
        .iter()
        .map(|i| format!("{} {}", i.name, i.ip))
        .collect::<Vec<_>>()
        .join(", ")
}

/// This host's interface addresses, in system order.
pub fn local_interfaces() -> Result<Vec<InterfaceAddr>, String> {
    let interfaces =
        if_addrs::get_if_addrs().map_err(|e| format!("cannot list network interfaces: {e}"))?;
    Ok(interfaces
        .into_iter()
        .map(|i| InterfaceAddr {
            ip: i.ip(),
            name: i.name,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host() -> Vec<InterfaceAddr> {
        [
            ("lo", "127.0.0.1"),
            ("eth0", "10.0.0.2"),
            ("eth0", "fd00::2"),
            ("eth1", "10.1.0.2"),
            ("enp3s0", "10.2.0.2"),
        ]
        .iter()
        .map(|(name, ip)| InterfaceAddr {
            name: name.to_string(),
            ip: ip.parse().unwrap(),
        })
        .collect()
    }

    fn pick(if_ip: Option<&str>, ifname: Option<&str>) -> Result<Option<String>, String> {
        select_bind_ip(&host(), if_ip, ifname).map(|ip| ip.map(|ip| ip.to_string()))
    }

    #[test]
    fn socket_ifname_prefix_exact_and_exclude() {
        assert_eq!(pick(None, None), Ok(None));
        assert_eq!(pick(None, Some("=eth1")), Ok(Some("10.1.0.2".into())));
        assert_eq!(pick(None, Some("eth,enp")), Ok(Some("10.0.0.2".into())));
        assert_eq!(pick(None, Some("enp")), Ok(Some("10.2.0.2".into())));
        assert_eq!(pick(None, Some("^eth")), Ok(Some("10.2.0.2".into())));
        assert_eq!(pick(None, Some("^=eth0")), Ok(Some("10.1.0.2".into())));
        assert_eq!(pick(None, Some("lo")), Ok(Some("127.0.0.1".into())));
        let no_exact_prefix = pick(None, Some("=eth")).unwrap_err();
        assert!(
            no_exact_prefix.contains("matches no interface"),
            "{no_exact_prefix}"
        );
        assert!(
            pick(None, Some("^"))
                .unwrap_err()
                .contains("names no interface")
        );
    }

    #[test]
    fn if_ip_wins_and_must_be_local() {
        assert_eq!(
            pick(Some("10.2.0.2"), Some("=eth0")),
            Ok(Some("10.2.0.2".into()))
        );
        assert!(
            pick(Some("10.9.9.9"), None)
                .unwrap_err()
                .contains("not an address of this host")
        );
        assert!(
            pick(Some("eth0"), None)
                .unwrap_err()
                .contains("not an IP address")
        );
    }

    #[test]
    fn connect_timeout_range() {
        assert_eq!(connect_timeout(None, false), Ok(Duration::from_secs(120)));
        assert_eq!(
            connect_timeout(Some("7200"), false),
            Ok(Duration::from_secs(7200))
        );
        assert!(
            connect_timeout(Some("30"), false)
                .unwrap_err()
                .contains("between 120 and 7200")
        );
        assert_eq!(connect_timeout(Some("3"), true), Ok(Duration::from_secs(3)));
        assert!(connect_timeout(Some("0"), true).is_err());
        assert!(connect_timeout(Some("7201"), true).is_err());
        assert!(
            connect_timeout(Some("2m"), false)
                .unwrap_err()
                .contains("integer")
        );
        assert_eq!(exec_timeout(None), Ok(Duration::from_secs(1836)));
        assert!(exec_timeout(Some("0")).is_err());
    }

    #[test]
    fn only_the_ring_algorithm_is_accepted() {
        for ok in [
            None,
            Some(""),
            Some("level0:NA;level1:ring"),
            Some("level1:ring"),
            Some(" level0:NA ; level1:ring "),
        ] {
            assert_eq!(check_algo(ok), Ok(()), "{ok:?}");
        }
        for algo in ["H-D_R", "NHR", "NB", "pipeline", "pairwise"] {
            let err = check_algo(Some(&format!("level0:NA;level1:{algo}"))).unwrap_err();
            assert!(
                err.contains("not implemented") && err.contains("use level1:ring"),
                "{err}"
            );
        }
        assert!(
            check_algo(Some("level0:ring"))
                .unwrap_err()
                .contains("only NA")
        );
        assert!(check_algo(Some("ring")).unwrap_err().contains("level<N>"));
        assert!(
            check_algo(Some("level2:ring"))
                .unwrap_err()
                .contains("unknown")
        );
    }
}

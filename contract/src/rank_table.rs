//! The HCCL rank table (`hccl.json`, version 1.0) in ascend-operator's format: every value is a
//! string, and `status` stays `"initializing"` until every pod is known. The operator writes a
//! [`Document`]; a worker reads it back with [`parse`] into a checked [`RankTable`] and finds its
//! own ranks in it.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};

/// The file's name in its mounted directory.
pub const FILE_NAME: &str = "hccl.json";
/// Where ascend-operator (and so HCCL's tooling) mounts the rank table.
pub const MOUNT_DIR: &str = "/user/serverid/devindex/config";
/// The version written.
pub const VERSION: &str = "1.0";
pub const SUPPORTED_VERSIONS: &[&str] = &[VERSION];
pub const STATUS_INITIALIZING: &str = "initializing";
pub const STATUS_COMPLETED: &str = "completed";

/// The document as it is written to `hccl.json`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Document {
    pub status: String,
    pub version: String,
    pub server_count: String,
    pub server_list: Vec<ServerEntry>,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ServerEntry {
    pub server_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_ip: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_ip: Option<String>,
    pub device: Vec<DeviceEntry>,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct DeviceEntry {
    pub device_id: String,
    pub device_ip: String,
    pub rank_id: String,
}

impl Document {
    /// A version-1.0 document over `server_list`, completed when every one of `expected_servers`
    /// is known.
    pub fn new(server_list: Vec<ServerEntry>, expected_servers: usize) -> Self {
        let status = if server_list.len() == expected_servers {
            STATUS_COMPLETED
        } else {
            STATUS_INITIALIZING
        };
        Document {
            status: status.to_string(),
            version: VERSION.to_string(),
            server_count: server_list.len().to_string(),
            server_list,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RankTableError {
    #[error("rank table is not valid JSON: {0}")]
    Malformed(String),
    #[error("rank table: {0}")]
    Invalid(String),
    #[error("rank table version {found:?} is not supported; supported versions: {}", SUPPORTED_VERSIONS.join(", "))]
    UnsupportedVersion { found: String },
    #[error(
        "rank table {path} still says \"initializing\" after {seconds} s; not every pod of the ring has been scheduled"
    )]
    StillInitializing { path: String, seconds: u64 },
    #[error("cannot read rank table {path}: {reason}")]
    Unreadable { path: String, reason: String },
    #[error("{0}")]
    Identity(String),
}

/// A completed rank table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankTable {
    pub servers: Vec<Server>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Server {
    pub server_id: String,
    pub host_ip: Option<String>,
    pub container_ip: Option<String>,
    /// Sorted by `rank_id`; a device's position here is its local index on the server.
    pub devices: Vec<Device>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    pub device_id: u32,
    pub device_ip: String,
    pub rank_id: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableStatus {
    Initializing,
    Completed(RankTable),
}

fn number<N: std::str::FromStr>(field: &str, value: &str) -> Result<N, RankTableError> {
    value.trim().parse().map_err(|_| {
        RankTableError::Invalid(format!(
            "{field} must be a decimal integer string, got {value:?}"
        ))
    })
}

/// Parses a rank table. An `"initializing"` table is only checked for its version.
pub fn parse(text: &str) -> Result<TableStatus, RankTableError> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| RankTableError::Malformed(e.to_string()))?;
    let object = value
        .as_object()
        .ok_or_else(|| RankTableError::Invalid("the top level must be an object".into()))?;
    let string_field = |name: &str| match object.get(name) {
        Some(serde_json::Value::String(s)) => Ok(s.as_str()),
        Some(other) => Err(RankTableError::Invalid(format!(
            "{name} must be a string, got {other}"
        ))),
        None => Err(RankTableError::Invalid(format!("missing field {name}"))),
    };
    let version = string_field("version")?;
    if !SUPPORTED_VERSIONS.contains(&version) {
        return Err(RankTableError::UnsupportedVersion {
            found: version.to_string(),
        });
    }
    match string_field("status")? {
        STATUS_INITIALIZING => return Ok(TableStatus::Initializing),
        STATUS_COMPLETED => {}
        other => {
            return Err(RankTableError::Invalid(format!(
                "status must be \"initializing\" or \"completed\", got {other:?}"
            )));
        }
    }
    let raw: Document = serde_path_to_error::deserialize(&value)
        .map_err(|e| RankTableError::Invalid(format!("{}: {}", e.path(), e.inner())))?;
    let server_count: usize = number("server_count", &raw.server_count)?;
    if server_count != raw.server_list.len() {
        return Err(RankTableError::Invalid(format!(
            "server_count says {server_count} but server_list has {} entries",
            raw.server_list.len()
        )));
    }
    if raw.server_list.is_empty() {
        return Err(RankTableError::Invalid("server_list is empty".into()));
    }
    let mut seen: HashMap<usize, String> = HashMap::new();
    let mut servers = Vec::with_capacity(raw.server_list.len());
    for (s, raw_server) in raw.server_list.into_iter().enumerate() {
        if raw_server.device.is_empty() {
            return Err(RankTableError::Invalid(format!(
                "server_list[{s}].device is empty"
            )));
        }
        let mut devices = Vec::with_capacity(raw_server.device.len());
        for (d, raw_device) in raw_server.device.into_iter().enumerate() {
            let at = format!("server_list[{s}].device[{d}]");
            let rank_id: usize = number(&format!("{at}.rank_id"), &raw_device.rank_id)?;
            if let Some(first) = seen.insert(rank_id, at.clone()) {
                return Err(RankTableError::Invalid(format!(
                    "rank_id {rank_id} appears twice: {first} and {at}"
                )));
            }
            devices.push(Device {
                device_id: number(&format!("{at}.device_id"), &raw_device.device_id)?,
                device_ip: raw_device.device_ip,
                rank_id,
            });
        }
        devices.sort_by_key(|d| d.rank_id);
        servers.push(Server {
            server_id: raw_server.server_id,
            host_ip: raw_server.host_ip,
            container_ip: raw_server.container_ip,
            devices,
        });
    }
    if let Some(missing) = (0..seen.len()).find(|r| !seen.contains_key(r)) {
        return Err(RankTableError::Invalid(format!(
            "rank_ids must run from 0 to {} without gaps; {missing} is missing",
            seen.len() - 1
        )));
    }
    Ok(TableStatus::Completed(RankTable { servers }))
}

/// Who this process is, from its environment.
#[derive(Debug, Clone, Default)]
pub struct PodIdentity {
    /// `NPUFLEET_RANK`: the rank_id to take, when set.
    pub rank_override: Option<usize>,
    /// `POD_IP`: matched against each server's `container_ip` (then `server_id`, `host_ip`).
    pub pod_ip: Option<String>,
    /// `LOCAL_RANK`: which one of the matched server's devices this process drives; `None`
    /// runs them all.
    pub local_index: Option<usize>,
}

impl RankTable {
    pub fn world_size(&self) -> usize {
        self.servers.iter().map(|s| s.devices.len()).sum()
    }

    /// The rank_id this process takes; see [`RankTable::local_ranks`].
    pub fn find_rank(&self, identity: &PodIdentity) -> Result<usize, RankTableError> {
        let index = identity.local_index.unwrap_or(0);
        if let Some(rank) = identity.rank_override {
            return self.checked_rank(rank);
        }
        let server = self.server_of(identity)?;
        server.devices.get(index).map(|d| d.rank_id).ok_or_else(|| {
            RankTableError::Identity(format!(
                "LOCAL_RANK={index} but server {} has {} devices",
                server.server_id,
                server.devices.len()
            ))
        })
    }

    /// Every rank_id this process runs, ascending. An explicit override wins because a process
    /// outside Kubernetes (or several ranks sharing one pod IP) has no other unambiguous
    /// identity; otherwise the pod IP picks the server, as ascend-operator writes the pod IP
    /// into `container_ip`, and the process runs all of that server's devices unless
    /// `LOCAL_RANK` picks one.
    pub fn local_ranks(&self, identity: &PodIdentity) -> Result<Vec<usize>, RankTableError> {
        if identity.rank_override.is_some() || identity.local_index.is_some() {
            return Ok(vec![self.find_rank(identity)?]);
        }
        let mut ranks: Vec<usize> = self
            .server_of(identity)?
            .devices
            .iter()
            .map(|d| d.rank_id)
            .collect();
        ranks.sort_unstable();
        Ok(ranks)
    }

    fn checked_rank(&self, rank: usize) -> Result<usize, RankTableError> {
        if rank >= self.world_size() {
            return Err(RankTableError::Identity(format!(
                "NPUFLEET_RANK={rank} but the rank table has ranks 0..{}",
                self.world_size() - 1
            )));
        }
        Ok(rank)
    }

    fn server_of(&self, identity: &PodIdentity) -> Result<&Server, RankTableError> {
        let Some(pod_ip) = identity.pod_ip.as_deref() else {
            return Err(RankTableError::Identity(
                "cannot tell which rank this is: set POD_IP (from the downward API) or NPUFLEET_RANK".into(),
            ));
        };
        let fields: [fn(&Server) -> Option<&str>; 3] = [
            |s| s.container_ip.as_deref(),
            |s| Some(s.server_id.as_str()),
            |s| s.host_ip.as_deref(),
        ];
        for field in fields {
            let matches: Vec<&Server> = self
                .servers
                .iter()
                .filter(|s| field(s) == Some(pod_ip))
                .collect();
            match matches.as_slice() {
                [] => continue,
                [server] => return Ok(server),
                _ => {
                    return Err(RankTableError::Identity(format!(
                        "POD_IP {pod_ip} matches {} servers of the rank table; set NPUFLEET_RANK",
                        matches.len()
                    )));
                }
            }
        }
        Err(RankTableError::Identity(format!(
            "POD_IP {pod_ip} is not the container_ip, server_id or host_ip of any server in the rank table"
        )))
    }

    /// The CPU ring's listening address of every rank, in rank order: the server's
    /// `container_ip` (else `host_ip`, else `server_id`) and `port_base` plus the device's
    /// local index.
    pub fn ring_endpoints(&self, port_base: u16) -> Result<Vec<SocketAddr>, RankTableError> {
        let mut endpoints = vec![None; self.world_size()];
        for server in &self.servers {
            let host = server
                .container_ip
                .as_deref()
                .or(server.host_ip.as_deref())
                .unwrap_or(server.server_id.as_str());
            let ip: IpAddr = host.parse().map_err(|_| {
                RankTableError::Invalid(format!(
                    "server {} has no IP address to reach it by (container_ip, host_ip and server_id are not IPs)",
                    server.server_id
                ))
            })?;
            for (local, device) in server.devices.iter().enumerate() {
                let port = u16::try_from(local)
                    .ok()
                    .and_then(|l| port_base.checked_add(l))
                    .ok_or_else(|| {
                        RankTableError::Invalid(format!(
                            "ring port {port_base} + {local} is out of range"
                        ))
                    })?;
                endpoints[device.rank_id] = Some(SocketAddr::new(ip, port));
            }
        }
        Ok(endpoints
            .into_iter()
            .map(|e| e.expect("rank_ids cover 0..world_size"))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO_SERVERS: &str = r#"{"status": "completed", "version": "1.0", "server_count": "2",
      "server_list": [
        {"server_id": "10.0.0.11", "host_ip": "10.0.0.11", "container_ip": "172.16.0.5", "hardware_type": "800I-A2-32G",
         "device": [{"device_id": "0", "device_ip": "192.168.101.1", "rank_id": "1"},
                    {"device_id": "1", "device_ip": "192.168.101.2", "rank_id": "0", "device_port": "16666"}]},
        {"server_id": "10.0.0.12", "host_ip": "10.0.0.12",
         "device": [{"device_id": "0", "device_ip": "192.168.102.1", "rank_id": "2"}]}]}"#;

    fn completed(text: &str) -> RankTable {
        match parse(text).unwrap() {
            TableStatus::Completed(table) => table,
            TableStatus::Initializing => panic!("expected a completed table"),
        }
    }

    fn error(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }

    #[test]
    fn what_the_writer_writes_the_reader_reads() {
        let server = |ip: &str, first_rank: usize| ServerEntry {
            server_id: ip.to_string(),
            host_ip: Some(ip.to_string()),
            container_ip: Some(format!("172.16.0.{first_rank}")),
            device: (0..2)
                .map(|d| DeviceEntry {
                    device_id: d.to_string(),
                    device_ip: format!("192.168.0.{}", first_rank + d),
                    rank_id: (first_rank + d).to_string(),
                })
                .collect(),
        };
        let partial = Document::new(vec![server("10.0.0.1", 0)], 2);
        let text = serde_json::to_string(&partial).unwrap();
        assert_eq!(parse(&text).unwrap(), TableStatus::Initializing);

        let full = Document::new(vec![server("10.0.0.1", 0), server("10.0.0.2", 2)], 2);
        let table = completed(&serde_json::to_string(&full).unwrap());
        assert_eq!(table.world_size(), 4);
        let identity = PodIdentity {
            pod_ip: Some("172.16.0.2".into()),
            ..Default::default()
        };
        assert_eq!(table.local_ranks(&identity).unwrap(), vec![2, 3]);
    }

    #[test]
    fn parses_the_documented_format() {
        let table = completed(TWO_SERVERS);
        assert_eq!(table.world_size(), 3);
        assert_eq!(table.servers[0].devices[0].rank_id, 0);
        assert_eq!(table.servers[0].devices[0].device_id, 1);
        let endpoints = table.ring_endpoints(29650).unwrap();
        let endpoints: Vec<String> = endpoints.iter().map(|e| e.to_string()).collect();
        assert_eq!(
            endpoints,
            ["172.16.0.5:29650", "172.16.0.5:29651", "10.0.0.12:29650"]
        );
    }

    #[test]
    fn finds_the_rank_from_pod_identity() {
        let table = completed(TWO_SERVERS);
        let who = |pod_ip: &str, local_index| PodIdentity {
            rank_override: None,
            pod_ip: Some(pod_ip.into()),
            local_index,
        };
        assert_eq!(table.find_rank(&who("172.16.0.5", Some(0))), Ok(0));
        assert_eq!(table.find_rank(&who("172.16.0.5", Some(1))), Ok(1));
        assert_eq!(table.find_rank(&who("10.0.0.12", Some(0))), Ok(2));
        assert_eq!(table.local_ranks(&who("172.16.0.5", None)), Ok(vec![0, 1]));
        assert_eq!(table.local_ranks(&who("172.16.0.5", Some(1))), Ok(vec![1]));
        assert_eq!(table.local_ranks(&who("10.0.0.12", None)), Ok(vec![2]));
        assert!(
            table
                .find_rank(&who("172.16.0.5", Some(2)))
                .unwrap_err()
                .to_string()
                .contains("LOCAL_RANK=2")
        );
        assert!(
            table
                .local_ranks(&who("1.2.3.4", None))
                .unwrap_err()
                .to_string()
                .contains("POD_IP 1.2.3.4")
        );
        let explicit = PodIdentity {
            rank_override: Some(2),
            pod_ip: Some("172.16.0.5".into()),
            local_index: None,
        };
        assert_eq!(table.find_rank(&explicit), Ok(2));
        assert_eq!(table.local_ranks(&explicit), Ok(vec![2]));
        let out_of_range = PodIdentity {
            rank_override: Some(3),
            ..Default::default()
        };
        assert!(
            table
                .find_rank(&out_of_range)
                .unwrap_err()
                .to_string()
                .contains("NPUFLEET_RANK=3")
        );
        assert!(
            table
                .find_rank(&PodIdentity::default())
                .unwrap_err()
                .to_string()
                .contains("set POD_IP")
        );
    }

    #[test]
    fn initializing_tables_only_need_a_version() {
        assert_eq!(
            parse(r#"{"status": "initializing", "version": "1.0"}"#),
            Ok(TableStatus::Initializing)
        );
    }

    #[test]
    fn rejects_unsupported_versions_by_name() {
        for version in ["1.2", "2.0"] {
            let text =
                TWO_SERVERS.replace(r#""version": "1.0""#, &format!(r#""version": "{version}""#));
            let err = error(&text);
            assert!(
                err.contains(&format!("version \"{version}\" is not supported"))
                    && err.contains("supported versions: 1.0"),
                "{err}"
            );
        }
        assert!(
            error(&TWO_SERVERS.replace(r#""version": "1.0""#, r#""version": 1.0"#))
                .contains("version must be a string")
        );
    }

    #[test]
    fn rejects_malformed_tables() {
        let cases: &[(&str, &str, &str)] = &[
            (
                r#""server_count": "2""#,
                r#""server_count": "2"#,
                "not valid JSON",
            ),
            (r#""status": "completed", "#, "", "missing field status"),
            (
                r#""server_count": "2""#,
                r#""server_count": 2"#,
                "server_count: invalid type: integer",
            ),
            (
                r#""server_count": "2""#,
                r#""server_count": "two""#,
                "server_count must be a decimal integer string",
            ),
            (
                r#""server_count": "2""#,
                r#""server_count": "3""#,
                "server_count says 3 but server_list has 2",
            ),
            (
                r#""rank_id": "2""#,
                r#""rank_id": "1""#,
                "rank_id 1 appears twice",
            ),
            (r#""rank_id": "2""#, r#""rank_id": "5""#, "2 is missing"),
            (
                r#""rank_id": "2""#,
                r#""rank_id": "x2""#,
                "server_list[1].device[0].rank_id must be a decimal integer string",
            ),
            (
                r#""device_id": "0", "device_ip": "192.168.102.1", "#,
                r#""device_ip": "192.168.102.1", "#,
                "server_list[1].device[0]: missing field `device_id`",
            ),
            (
                r#""device_id": "1""#,
                r#""device_id": "-1""#,
                "device_id must be a decimal integer string",
            ),
            (
                r#""status": "completed""#,
                r#""status": "done""#,
                "status must be",
            ),
        ];
        for (from, to, expected) in cases {
            assert!(TWO_SERVERS.contains(from), "{from}");
            let err = error(&TWO_SERVERS.replacen(from, to, 1));
            assert!(err.contains(expected), "replacing {from} with {to}: {err}");
        }
        assert!(error("[]").contains("top level must be an object"));
    }
}

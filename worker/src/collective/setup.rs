//! Builds a ready [`Collective`] from the pod's environment and the mounted rank table.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use npufleet_contract::env;
use npufleet_contract::rank_table::PodIdentity;

use super::Collective;
use super::hccl_env;
use super::rank_table;
use super::ring::RingCollective;
use super::transport::{inproc, tcp};

pub const RING_PORT_ENV: &str = "NPUFLEET_RING_PORT";
pub const DEFAULT_RING_PORT: u16 = 29650;

/// Everything needed to join the ring, read from environment variables.
#[derive(Debug, Clone)]
pub struct RingSettings {
    /// `RANK_TABLE_FILE`.
    pub rank_table: PathBuf,
    /// `NPUFLEET_RANK`, `POD_IP` and `LOCAL_RANK`.
    pub identity: PodIdentity,
    /// `NPUFLEET_RING_PORT`: rank `i` on a server listens on this port + its local index.
    pub port_base: u16,
    /// `HCCL_CONNECT_TIMEOUT`; also bounds the wait for the rank table to complete.
    pub connect_timeout: Duration,
    /// `HCCL_EXEC_TIMEOUT`.
    pub op_timeout: Duration,
    /// From `HCCL_IF_IP` / `HCCL_SOCKET_IFNAME`; `None` listens on the rank-table address.
    pub bind_ip: Option<IpAddr>,
}

impl RingSettings {
    /// Reads the settings through `lookup` (normally `std::env::var`), checking every value.
    pub fn from_env(lookup: impl Fn(&str) -> Option<String>) -> anyhow::Result<Self> {
        let rank_table = lookup(env::RANK_TABLE_FILE)
            .filter(|v| !v.is_empty())
            .with_context(|| {
                format!(
                    "{} is not set; tensor parallelism needs the hccl.json rank table",
                    env::RANK_TABLE_FILE
                )
            })?;
        let rank_override = lookup(env::RANK)
            .filter(|v| !v.trim().is_empty())
            .map(|v| {
                v.trim()
                    .parse::<usize>()
                    .with_context(|| format!("{} must be a rank number, got {v:?}", env::RANK))
            })
            .transpose()?;
        let local_index = lookup(env::LOCAL_RANK)
            .filter(|v| !v.trim().is_empty())
            .map(|v| {
                v.trim()
                    .parse::<usize>()
                    .with_context(|| format!("LOCAL_RANK must be a number, got {v:?}"))
            })
            .transpose()?;
        let port_base = lookup(RING_PORT_ENV)
            .filter(|v| !v.trim().is_empty())
            .map(|v| {
                v.trim()
                    .parse::<u16>()
                    .with_context(|| format!("{RING_PORT_ENV} must be a TCP port, got {v:?}"))
            })
            .transpose()?
            .unwrap_or(DEFAULT_RING_PORT);
        let allow_short =
            lookup(hccl_env::ALLOW_SHORT_TIMEOUTS_ENV).is_some_and(|v| v.trim() == "1");
        let connect_timeout =
            hccl_env::connect_timeout(lookup(env::HCCL_CONNECT_TIMEOUT).as_deref(), allow_short)
                .map_err(anyhow::Error::msg)?;
        let op_timeout = hccl_env::exec_timeout(lookup(env::HCCL_EXEC_TIMEOUT).as_deref())
            .map_err(anyhow::Error::msg)?;
        hccl_env::check_algo(lookup(env::HCCL_ALGO).as_deref()).map_err(anyhow::Error::msg)?;
        let if_ip = lookup(env::HCCL_IF_IP);
        let socket_ifname = lookup(env::HCCL_SOCKET_IFNAME);
        let bind_ip = if if_ip.is_some() || socket_ifname.is_some() {
            let interfaces = hccl_env::local_interfaces().map_err(anyhow::Error::msg)?;
            hccl_env::select_bind_ip(&interfaces, if_ip.as_deref(), socket_ifname.as_deref())
                .map_err(anyhow::Error::msg)?
        } else {
            None
        };
        Ok(RingSettings {
            rank_table: rank_table.into(),
            identity: PodIdentity {
                rank_override,
                pod_ip: lookup(env::POD_IP).filter(|v| !v.is_empty()),
                local_index,
            },
            port_base,
            connect_timeout,
            op_timeout,
            bind_ip,
        })
    }
}

/// Waits for the rank table to complete, finds this rank, and connects the TCP ring.
pub fn connect_ring(settings: &RingSettings) -> anyhow::Result<Arc<dyn Collective>> {
    let table = rank_table::wait_for_completed(&settings.rank_table, settings.connect_timeout)?;
    let rank = table.find_rank(&settings.identity)?;
    let endpoints = table.ring_endpoints(settings.port_base)?;
    if endpoints.len() == 1 {
        let transport = inproc::ring(1, settings.op_timeout)
            .pop()
            .expect("one rank");
        return Ok(Arc::new(RingCollective::new(transport)));
    }
    tracing::info!(
        rank,
        world_size = endpoints.len(),
        "joining the tensor-parallel ring"
    );
    join_tcp(settings, rank, endpoints)
}

/// Listens on `rank`'s endpoint and connects it to its ring neighbours over TCP.
fn join_tcp(
    settings: &RingSettings,
    rank: usize,
    endpoints: Vec<SocketAddr>,
) -> anyhow::Result<Arc<dyn Collective>> {
    let own = endpoints[rank];
    let bind = SocketAddr::new(settings.bind_ip.unwrap_or(own.ip()), own.port());
    let listener =
        tcp::listen(bind).with_context(|| format!("rank {rank} cannot listen on {bind}"))?;
    let transport = tcp::TcpTransport::establish(
        listener,
        &tcp::TcpRingSetup {
            rank,
            endpoints,
            connect_timeout: settings.connect_timeout,
            op_timeout: settings.op_timeout,
        },
    )?;
    Ok(Arc::new(RingCollective::new(transport)))
}

/// Joins the ring with every rank this process runs (see [`RankTable::local_ranks`]): all
/// of a one-server group talk through shared memory, the ranks of a group spanning servers
/// each over TCP. Returns one collective per local rank, in rank order.
///
/// [`RankTable::local_ranks`]: npufleet_contract::rank_table::RankTable::local_ranks
pub fn join_local_ranks(settings: &RingSettings) -> anyhow::Result<Vec<Arc<dyn Collective>>> {
    let table = rank_table::wait_for_completed(&settings.rank_table, settings.connect_timeout)?;
    let ranks = table.local_ranks(&settings.identity)?;
    let world_size = table.world_size();
    if ranks.len() == world_size {
        return Ok(inproc::ring(world_size, settings.op_timeout)
            .into_iter()
            .map(|transport| Arc::new(RingCollective::new(transport)) as Arc<dyn Collective>)
            .collect());
    }
    let endpoints = table.ring_endpoints(settings.port_base)?;
    tracing::info!(
        ?ranks,
        world_size,
        "joining the tensor-parallel ring over TCP"
    );
    // Every rank's set-up waits for its neighbours.
    join_concurrently(ranks, "ring", |rank| {
        join_tcp(settings, rank, endpoints.clone())
    })
}

/// Runs `join` for every item on a thread of its own and returns the results in order.
/// A rank's set-up returns only once its peers have joined too, so the ranks one process
/// runs cannot join one after another.
pub fn join_concurrently<I: Send, T: Send>(
    items: impl IntoIterator<Item = I>,
    what: &str,
    join: impl Fn(I) -> anyhow::Result<T> + Sync,
) -> anyhow::Result<Vec<T>> {
    let join = &join;
    std::thread::scope(|scope| {
        let joining: Vec<_> = items
            .into_iter()
            .map(|item| scope.spawn(move || join(item)))
            .collect();
        joining
            .into_iter()
            .map(|handle| {
                handle
                    .join()
                    .unwrap_or_else(|_| anyhow::bail!("{what} set-up thread panicked"))
            })
            .collect()
    })
}

/// [`connect_ring`] with settings from this process's environment.
pub fn collective_from_env() -> anyhow::Result<Arc<dyn Collective>> {
    connect_ring(&RingSettings::from_env(|name| std::env::var(name).ok())?)
}

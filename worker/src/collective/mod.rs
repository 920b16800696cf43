//! Collectives for tensor parallelism: ring all-reduce, all-gather and broadcast over a
//! pluggable transport (in-process, TCP, HCCL on Ascend).

pub mod hccl_env;
pub mod rank_table;
pub mod ring;
pub mod setup;
pub mod step;
pub mod transport;

pub use ring::RingCollective;
pub use setup::{RingSettings, collective_from_env, connect_ring, join_local_ranks};

/// Why a collective failed. Always names the rank that could not be reached.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CollectiveError {
    #[error("lost tensor-parallel rank {rank}: {reason}")]
    LostRank { rank: usize, reason: String },
    #[error("collective timed out after {seconds} s waiting for rank {rank}")]
    Timeout { rank: usize, seconds: u64 },
    #[error("{0}")]
    Invalid(String),
}

/// The operations the sharded model needs. Every rank calls them in the same order.
pub trait Collective: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Element-wise sum across ranks, result on every rank.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CollectiveError>;
    /// `out` holds `world_size` chunks of `local.len()`, in rank order.
    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<(), CollectiveError>;
    /// Replaces `buf` on every rank with root's bytes (lengths may differ before the call).
    fn broadcast_bytes(&self, buf: &mut Vec<u8>, root: usize) -> Result<(), CollectiveError>;
}

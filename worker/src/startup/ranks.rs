//! The ranks this worker process runs.
//!
//! Without a rank table, or with a group of one, the process holds the whole model. In a
//! tensor-parallel group every rank loads only its shard: rank 0 serves clients and leads, the
//! other ranks follow its steps. A process runs every rank of its server (all ranks of a
//! one-pod group, or one server's devices), each on its own thread, unless `LOCAL_RANK` or
//! `NPUFLEET_RANK` picks one.

use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::Context;

use crate::ascend::Selected;
use crate::backend::Backend;
use crate::backend::cpu::CpuBackend;
use crate::collective::Collective;
use crate::collective::setup::{RingSettings, join_local_ranks};
use crate::engine::{EngineConfig, kv_cache_blocks};
use crate::model::{LoadOptions, Model, PrecisionPolicy};
use npufleet_contract::env;

/// What this process does in its group.
pub enum Role {
    /// Serves clients with rank 0 (or the whole model); `followers` are this process's other
    /// ranks.
    Leader {
        model: Box<Model>,
        followers: Followers,
    },
    /// Runs only followers; rank 0 lives in another pod.
    Follower(Followers),
}

/// Follower ranks running on their own threads until the leader stops the group.
pub struct Followers {
    ranks: Vec<(usize, JoinHandle<anyhow::Result<()>>)>,
}

impl Followers {
    fn none() -> Followers {
        Followers { ranks: Vec::new() }
    }

    pub fn ranks(&self) -> Vec<usize> {
        self.ranks.iter().map(|(rank, _)| *rank).collect()
    }

    /// Whether every follower has ended (stopped by the leader, or failed).
    pub fn finished(&self) -> bool {
        self.ranks.iter().all(|(_, thread)| thread.is_finished())
    }

    /// Waits for every follower; the first failure names its rank.
    pub fn join(self) -> anyhow::Result<()> {
        let mut outcome = Ok(());
        for (rank, thread) in self.ranks {
            let result = thread
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("the thread panicked")))
                .with_context(|| format!("tensor-parallel rank {rank}"));
            if outcome.is_ok() {
                outcome = result;
            }
        }
        outcome
    }
}

/// One rank to load: its place in the group and where its kernels run.
struct RankSlot {
    collective: Option<Arc<dyn Collective>>,
    npu_device: Option<i32>,
}

/// Loads this process's ranks and starts the followers. `threads` (0 = every core) is shared
/// evenly by the local ranks.
pub fn start(
    model_path: &Path,
    selected: &Selected,
    policy: PrecisionPolicy,
    threads: usize,
    engine: &EngineConfig,
) -> anyhow::Result<Role> {
    let slots = local_slots(selected)?;
    let threads = threads_per_rank(threads, slots.len());
    let mut models = std::thread::scope(|scope| {
        let loading: Vec<_> = slots
            .into_iter()
            .map(|slot| scope.spawn(move || load_rank(model_path, slot, policy, threads)))
            .collect();
        loading
            .into_iter()
            .map(|handle| {
                handle
                    .join()
                    .unwrap_or_else(|_| anyhow::bail!("loading a rank panicked"))
            })
            .collect::<anyhow::Result<Vec<Model>>>()
    })?;
    let leader = match models.first() {
        Some(model) if model.shard().rank == 0 => Some(models.remove(0)),
        _ => None,
    };
    let mut followers = Followers::none();
    for model in models {
        let rank = model.shard().rank;
        let mut kv = model.new_kv_cache(
            kv_cache_blocks(&model, engine),
            engine.block_size,
            engine.kv_dtype,
        );
        let thread = std::thread::Builder::new()
            .name(format!("rank-{rank}"))
            .spawn(move || -> anyhow::Result<()> {
                tracing::info!(rank, "following rank 0");
                model.follow(&mut kv)?;
                tracing::info!(rank, "rank 0 stopped the group");
                Ok(())
            })
            .context("cannot start a follower thread")?;
        followers.ranks.push((rank, thread));
    }
    Ok(match leader {
        Some(model) if model.shard().world > 1 => Role::Leader {
            model: Box::new(model.leading()?),
            followers,
        },
        Some(model) => Role::Leader {
            model: Box::new(model),
            followers,
        },
        None => Role::Follower(followers),
    })
}

/// The ranks of this process, joined to their group.
fn local_slots(selected: &Selected) -> anyhow::Result<Vec<RankSlot>> {
    let in_group = std::env::var_os(env::RANK_TABLE_FILE).is_some_and(|v| !v.is_empty());
    let npu = matches!(selected, Selected::Ascend(_));
    if !in_group {
        return Ok(vec![RankSlot {
            collective: None,
            npu_device: npu.then_some(0),
        }]);
    }
    if npu {
        return Ok(crate::ascend::hccl::join_local_ranks()?
            .into_iter()
            .map(|rank| RankSlot {
                collective: Some(rank.collective),
                npu_device: Some(rank.device),
            })
            .collect());
    }
    let settings = RingSettings::from_env(|name| std::env::var(name).ok())?;
    Ok(join_local_ranks(&settings)?
        .into_iter()
        .map(|collective| RankSlot {
            collective: Some(collective),
            npu_device: None,
        })
        .collect())
}

fn threads_per_rank(threads: usize, ranks: usize) -> usize {
    let total = if threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        threads
    };
    (total / ranks.max(1)).max(1)
}

fn load_rank(
    path: &Path,
    slot: RankSlot,
    policy: PrecisionPolicy,
    threads: usize,
) -> anyhow::Result<Model> {
    let rank = slot.collective.as_ref().map_or(0, |c| c.rank());
    let backend: Box<dyn Backend> = match slot.npu_device {
        Some(device) => Box::new(
            crate::ascend::backend::AclBackend::new(device, threads)
                .with_context(|| format!("rank {rank} cannot open NPU {device}"))?,
        ),
        None => Box::new(CpuBackend::new(threads)?),
    };
    let collective = slot.collective.filter(|c| c.world_size() > 1);
    Model::load(
        path,
        LoadOptions {
            policy,
            threads,
            collective,
            backend: Some(backend),
        },
    )
    .with_context(|| format!("rank {rank} cannot load its shard of '{}'", path.display()))
}

#[cfg(test)]
mod tests {
    use super::threads_per_rank;

    #[test]
    fn local_ranks_share_the_threads() {
        assert_eq!(threads_per_rank(4, 2), 2);
        assert_eq!(threads_per_rank(2, 4), 1);
        assert_eq!(threads_per_rank(3, 1), 3);
        assert!(threads_per_rank(0, 1) >= 1);
    }
}

//! `npufleet-worker hccl-selftest`: checks HCCL across the ranks of the operator's rank table on
//! real NPUs, then times all-reduce. Every rank of the table runs it at the same time.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;

use crate::ascend::device::Acl;
use crate::ascend::hccl::{HcclCollective, HcclSettings};
use crate::collective::Collective;
use crate::tools::collective_bench::{contribution, expected_sum};
use npufleet_contract::env::{RANK as RANK_ENV, RANK_TABLE_FILE as RANK_TABLE_FILE_ENV};

#[derive(clap::Args, Debug)]
pub struct SelftestArgs {
    /// The HCCL rank table (hccl.json) the operator mounts.
    #[arg(long, env = RANK_TABLE_FILE_ENV)]
    pub rank_table: Option<PathBuf>,
    /// This process's rank; by default found in the table from POD_IP and LOCAL_RANK.
    #[arg(long, env = RANK_ENV)]
    pub rank: Option<usize>,
    /// f32 values per all-reduce in the timed runs.
    #[arg(long, default_value_t = 1 << 22)]
    pub elements: usize,
    /// Timed all-reduces (after one untimed warm-up).
    #[arg(long, default_value_t = 20)]
    pub iterations: usize,
}

/// Checks an all-reduced buffer against the exact sum of every rank's contribution (the values
/// the ring's conformance tests use).
pub fn check_all_reduce(buf: &[f32], world_size: usize) -> Result<(), String> {
    for (i, v) in buf.iter().enumerate() {
        let expected = expected_sum(world_size, i);
        if *v != expected {
            return Err(format!("all-reduce value {i} is {v}, expected {expected}"));
        }
    }
    Ok(())
}

/// Checks an all-gathered buffer: chunk `r` holds rank `r`'s contribution.
pub fn check_all_gather(out: &[f32], chunk: usize) -> Result<(), String> {
    for (r, values) in out.chunks(chunk.max(1)).enumerate() {
        for (i, v) in values.iter().enumerate() {
            let expected = contribution(r, i);
            if *v != expected {
                return Err(format!(
                    "all-gather value {i} of rank {r} is {v}, expected {expected}"
                ));
            }
        }
    }
    Ok(())
}

fn broadcast_payload(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 % 251) as u8).collect()
}

/// Bus bandwidth of an all-reduce: the bytes each rank moves in a ring, 2(p−1)/p of the buffer.
pub fn bus_bandwidth(bytes: usize, seconds: f64, world_size: usize) -> f64 {
    let p = world_size as f64;
    bytes as f64 / seconds * 2.0 * (p - 1.0) / p
}

pub fn run(args: SelftestArgs) -> anyhow::Result<()> {
    // Fail on missing libraries before waiting for peers.
    let acl = Acl::get()?;
    println!("CANN libraries: {:?}", acl.cann.paths);
    println!("visible NPUs: {}", acl.device_count()?);

    let rank_table = args.rank_table.map(|p| p.display().to_string());
    let rank = args.rank.map(|r| r.to_string());
    let settings = HcclSettings::from_env(|name| match name {
        RANK_TABLE_FILE_ENV if rank_table.is_some() => rank_table.clone(),
        RANK_ENV if rank.is_some() => rank.clone(),
        _ => std::env::var(name).ok(),
    })?;
    let plan = settings.plan()?;
    let device = plan.device;
    println!(
        "rank {} of {} on NPU {} (rank table {})",
        plan.rank,
        plan.world_size,
        device,
        plan.rank_table.display()
    );
    let started = Instant::now();
    let hccl = HcclCollective::new(plan, settings.exec_timeout)?;
    println!(
        "communicator ready in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    let (rank, world) = (hccl.rank(), hccl.world_size());

    let chunk = 1000;
    let mut reduced: Vec<f32> = (0..chunk).map(|i| contribution(rank, i)).collect();
    hccl.all_reduce_sum(&mut reduced)?;
    check_all_reduce(&reduced, world).map_err(anyhow::Error::msg)?;
    println!("all_reduce_sum: correct");

    let local: Vec<f32> = (0..chunk).map(|i| contribution(rank, i)).collect();
    let mut gathered = vec![0f32; chunk * world];
    hccl.all_gather(&local, &mut gathered)?;
    check_all_gather(&gathered, chunk).map_err(anyhow::Error::msg)?;
    println!("all_gather: correct");

    let expected = broadcast_payload(4097);
    let mut received = if rank == 0 {
        expected.clone()
    } else {
        Vec::new()
    };
    hccl.broadcast_bytes(&mut received, 0)?;
    anyhow::ensure!(
        received == expected,
        "broadcast_bytes: rank {rank} received other bytes"
    );
    println!("broadcast_bytes: correct");

    let mut buf: Vec<f32> = (0..args.elements).map(|i| contribution(rank, i)).collect();
    hccl.all_reduce_sum(&mut buf)
        .context("warm-up all-reduce")?;
    let started = Instant::now();
    for _ in 0..args.iterations {
        hccl.all_reduce_sum(&mut buf)?;
    }
    let seconds = started.elapsed().as_secs_f64() / args.iterations.max(1) as f64;
    let bytes = args.elements * size_of::<f32>();
    println!(
        "all_reduce_sum of {bytes} bytes: {:.3} ms per call including host copies, \
         bus bandwidth {:.2} GB/s",
        seconds * 1e3,
        bus_bandwidth(bytes, seconds, world) / 1e9
    );

    drop(hccl);
    acl.finalize(device)?;
    println!("hccl-selftest passed on rank {rank}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reduce(world: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (0..world).map(|r| contribution(r, i)).sum())
            .collect()
    }

    #[test]
    fn the_all_reduce_check_accepts_the_sum_and_rejects_anything_else() {
        for world in [1, 2, 8, 16] {
            let mut sum = reduce(world, 100);
            assert_eq!(check_all_reduce(&sum, world), Ok(()));
            sum[42] += 1.0;
            let err = check_all_reduce(&sum, world).unwrap_err();
            assert!(err.contains("value 42"), "{err}");
        }
        assert!(check_all_reduce(&reduce(3, 10), 4).is_err());
    }

    #[test]
    fn the_all_gather_check_expects_rank_order() {
        let mut out: Vec<f32> = (0..3)
            .flat_map(|r| (0..5).map(move |i| contribution(r, i)))
            .collect();
        assert_eq!(check_all_gather(&out, 5), Ok(()));
        out.swap(0, 5);
        assert!(check_all_gather(&out, 5).is_err());
    }

    #[test]
    fn bus_bandwidth_follows_the_ring_formula() {
        assert_eq!(bus_bandwidth(1000, 1.0, 1), 0.0);
        assert_eq!(bus_bandwidth(1000, 1.0, 2), 1000.0);
        assert_eq!(bus_bandwidth(1000, 0.5, 4), 3000.0);
    }
}

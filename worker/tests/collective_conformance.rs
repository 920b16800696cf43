//! The same conformance checks against every transport: in-process threads and TCP over
//! loopback (127.0.0.1 and 127.0.0.x addresses).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use npufleet_worker::collective::transport::{inproc, tcp};
use npufleet_worker::collective::{Collective, CollectiveError, RingCollective};
use npufleet_worker::tools::collective_bench::{contribution, expected_sum};

#[derive(Clone, Copy, Debug)]
enum Kind {
    InProc,
    Tcp,
    TcpSpreadAddresses,
}

const KINDS: [Kind; 3] = [Kind::InProc, Kind::Tcp, Kind::TcpSpreadAddresses];

fn ring(kind: Kind, world_size: usize, op_timeout: Duration) -> Vec<Arc<dyn Collective>> {
    match kind {
        Kind::InProc => inproc::ring(world_size, op_timeout)
            .into_iter()
            .map(|t| Arc::new(RingCollective::new(t)) as Arc<dyn Collective>)
            .collect(),
        Kind::Tcp | Kind::TcpSpreadAddresses => {
            let listeners: Vec<_> = (0..world_size)
                .map(|rank| {
                    let ip = match kind {
                        Kind::TcpSpreadAddresses => format!("127.0.0.{}", rank + 2),
                        _ => "127.0.0.1".to_string(),
                    };
                    tcp::listen(format!("{ip}:0").parse().unwrap()).unwrap()
                })
                .collect();
            let endpoints: Vec<SocketAddr> =
                listeners.iter().map(|l| l.local_addr().unwrap()).collect();
            let handles: Vec<_> = listeners
                .into_iter()
                .enumerate()
                .map(|(rank, listener)| {
                    let setup = tcp::TcpRingSetup {
                        rank,
                        endpoints: endpoints.clone(),
                        connect_timeout: Duration::from_secs(10),
                        op_timeout,
                    };
                    std::thread::spawn(move || {
                        tcp::TcpTransport::establish(listener, &setup).unwrap()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| Arc::new(RingCollective::new(h.join().unwrap())) as Arc<dyn Collective>)
                .collect()
        }
    }
}

/// Runs `f` on every rank at once and returns the results in rank order.
fn on_every_rank<R: Send + 'static>(
    ranks: &[Arc<dyn Collective>],
    f: impl Fn(&dyn Collective) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let f = Arc::new(f);
    let handles: Vec<_> = ranks
        .iter()
        .map(|c| {
            let (c, f) = (c.clone(), f.clone());
            std::thread::spawn(move || f(c.as_ref()))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Values in the slice a long all-reduce is cut into (4 MiB of f32).
const ALL_REDUCE_SLICE_VALUES: usize = 1 << 20;

fn lengths(p: usize) -> Vec<usize> {
    vec![
        0,
        1,
        p.saturating_sub(1),
        p + 1,
        3 * p + 2,
        1000,
        1_000_003,
        ALL_REDUCE_SLICE_VALUES,
        // Two full slices and a last one too short to give every rank a value.
        2 * ALL_REDUCE_SLICE_VALUES + p.saturating_sub(1),
        ALL_REDUCE_SLICE_VALUES + 4 * p + 3,
    ]
}

#[test]
fn all_reduce_equals_the_serial_sum() {
    for kind in KINDS {
        for p in 1..=4 {
            let ranks = ring(kind, p, Duration::from_secs(30));
            let results = on_every_rank(&ranks, move |c| {
                lengths(c.world_size())
                    .into_iter()
                    .map(|len| {
                        let mut buf: Vec<f32> =
                            (0..len).map(|i| contribution(c.rank(), i)).collect();
                        c.all_reduce_sum(&mut buf).map(|()| buf)
                    })
                    .collect::<Vec<_>>()
            });
            for (rank, per_len) in results.into_iter().enumerate() {
                for (len, buf) in lengths(p).into_iter().zip(per_len) {
                    let buf =
                        buf.unwrap_or_else(|e| panic!("{kind:?} p={p} rank {rank} len {len}: {e}"));
                    assert_eq!(buf.len(), len);
                    let wrong = (0..len).find(|&i| buf[i] != expected_sum(p, i));
                    assert_eq!(wrong, None, "{kind:?} p={p} rank {rank} len {len}");
                }
            }
        }
    }
}

#[test]
fn all_gather_collects_every_rank_in_order() {
    for kind in KINDS {
        for p in 1..=4 {
            let ranks = ring(kind, p, Duration::from_secs(30));
            for n in [0, 1, 7, 100_003] {
                let outs = on_every_rank(&ranks, move |c| {
                    let local: Vec<f32> = (0..n).map(|i| contribution(c.rank(), i)).collect();
                    let mut out = vec![-1.0; n * c.world_size()];
                    c.all_gather(&local, &mut out).map(|()| out)
                });
                let expected: Vec<f32> = (0..p)
                    .flat_map(|r| (0..n).map(move |i| contribution(r, i)))
                    .collect();
                for out in outs {
                    assert!(out.unwrap() == expected, "{kind:?} p={p} n={n}");
                }
            }
            let err = ranks[0].all_gather(&[1.0; 3], &mut [0.0; 5]).unwrap_err();
            assert!(
                err.to_string().contains("all_gather output holds 5 values"),
                "{err}"
            );
        }
    }
}

#[test]
fn broadcast_delivers_variable_length_bytes_from_any_root() {
    for kind in KINDS {
        for p in 1..=4 {
            let ranks = ring(kind, p, Duration::from_secs(30));
            for len in [0usize, 1, 4088, 4089, 3 * 1024 * 1024 + 5] {
                for root in 0..p {
                    let outs = on_every_rank(&ranks, move |c| {
                        let mut buf = if c.rank() == root {
                            (0..len).map(|i| (i * 31 + root) as u8).collect()
                        } else {
                            vec![0xEE; c.rank() * 10]
                        };
                        c.broadcast_bytes(&mut buf, root).map(|()| buf)
                    });
                    let expected: Vec<u8> = (0..len).map(|i| (i * 31 + root) as u8).collect();
                    for (rank, out) in outs.into_iter().enumerate() {
                        assert!(
                            out.unwrap() == expected,
                            "{kind:?} p={p} len={len} root={root} rank={rank}"
                        );
                    }
                }
            }
            let err = ranks[0].broadcast_bytes(&mut vec![], p).unwrap_err();
            assert!(err.to_string().contains("is not a rank"), "{err}");
        }
    }
}

#[test]
fn many_consecutive_mixed_calls_stay_in_step() {
    for kind in KINDS {
        let ranks = ring(kind, 3, Duration::from_secs(30));
        let results = on_every_rank(&ranks, |c| -> Result<u32, CollectiveError> {
            let mut checked = 0;
            for call in 0..1500usize {
                let len = 1 + call % 37;
                let mut buf: Vec<f32> =
                    (0..len).map(|i| contribution(c.rank(), i + call)).collect();
                c.all_reduce_sum(&mut buf)?;
                assert!(
                    (0..len).all(|i| buf[i] == expected_sum(3, i + call)),
                    "call {call}"
                );
                if call.is_multiple_of(10) {
                    let mut plan = if c.rank() == 0 {
                        call.to_le_bytes().to_vec()
                    } else {
                        Vec::new()
                    };
                    c.broadcast_bytes(&mut plan, 0)?;
                    assert_eq!(plan, call.to_le_bytes());
                }
                checked += 1;
            }
            Ok(checked)
        });
        for result in results {
            assert_eq!(result.unwrap(), 1500, "{kind:?}");
        }
    }
}

#[test]
fn a_dropped_rank_makes_every_other_rank_fail_naming_it() {
    for kind in KINDS {
        for (p, lost) in [(2, 1), (3, 1), (4, 2), (4, 0)] {
            let timeout = Duration::from_secs(10);
            let mut ranks = ring(kind, p, timeout);
            // A first call proves the ring works before the rank goes away.
            let warmed = on_every_rank(&ranks, |c| c.all_reduce_sum(&mut [1.0; 64]));
            assert!(warmed.iter().all(Result::is_ok));
            drop(ranks.remove(lost));
            let started = Instant::now();
            let errors = on_every_rank(&ranks, |c| {
                let mut buf = vec![1.0f32; 3_000_000];
                c.all_reduce_sum(&mut buf).unwrap_err()
            });
            assert!(
                started.elapsed() < timeout,
                "{kind:?}: failing took {:?}",
                started.elapsed()
            );
            for error in &errors {
                assert!(
                    matches!(error, CollectiveError::LostRank { rank, .. } if *rank == lost),
                    "{kind:?} p={p}: expected lost rank {lost}, got {error}"
                );
            }
            // Later calls fail at once with the same error instead of hanging.
            for c in &ranks {
                let again = c.broadcast_bytes(&mut vec![1], 0).unwrap_err();
                assert!(
                    matches!(again, CollectiveError::LostRank { rank, .. } if rank == lost),
                    "{again}"
                );
            }
        }
    }
}

#[test]
fn a_rank_dropped_during_a_call_is_named_without_waiting_for_the_timeout() {
    for kind in KINDS {
        for (p, lost) in [(2, 1), (3, 0), (4, 3)] {
            let timeout = Duration::from_secs(20);
            let mut ranks = ring(kind, p, timeout);
            let lost_rank = ranks.remove(lost);
            let started = Instant::now();
            // The survivors start a long all-reduce (they offer their chunks and wait) while
            // the lost rank goes away, in whichever order the threads happen to run.
            let calls: Vec<_> = ranks
                .iter()
                .map(|c| {
                    let c = c.clone();
                    std::thread::spawn(move || {
                        let mut buf = vec![1.0f32; 2 * ALL_REDUCE_SLICE_VALUES + 5];
                        c.all_reduce_sum(&mut buf).unwrap_err()
                    })
                })
                .collect();
            drop(lost_rank);
            for call in calls {
                let error = call.join().unwrap();
                assert!(
                    matches!(&error, CollectiveError::LostRank { rank, .. } if *rank == lost),
                    "{kind:?} p={p}: expected lost rank {lost}, got {error}"
                );
                assert!(
                    error.to_string().contains(&format!("rank {lost}")),
                    "{error}"
                );
            }
            assert!(
                started.elapsed() < timeout,
                "{kind:?}: failing took {:?}",
                started.elapsed()
            );
        }
    }
}

#[test]
fn a_silent_rank_times_out_naming_it() {
    for kind in KINDS {
        let ranks = ring(kind, 2, Duration::from_secs(1));
        let started = Instant::now();
        // Rank 1 is alive but never joins the call.
        let error = ranks[0].all_reduce_sum(&mut [1.0; 10]).unwrap_err();
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_secs(1) && waited < Duration::from_secs(5),
            "{kind:?}: {waited:?}"
        );
        assert!(
            matches!(
                error,
                CollectiveError::Timeout {
                    rank: 1,
                    seconds: 1
                }
            ),
            "{kind:?}: {error}"
        );
        assert!(error.to_string().contains("waiting for rank 1"), "{error}");
        drop(ranks);
    }
}

#[test]
fn ranks_calling_with_different_lengths_get_a_clear_error() {
    for kind in KINDS {
        let ranks = ring(kind, 2, Duration::from_secs(5));
        let errors = on_every_rank(&ranks, |c| {
            let mut buf = vec![1.0f32; if c.rank() == 0 { 10 } else { 14 }];
            c.all_reduce_sum(&mut buf).unwrap_err().to_string()
        });
        assert!(
            errors.iter().any(|e| e.contains("different lengths")),
            "{kind:?}: {errors:?}"
        );
    }
}

//! `npufleet-worker collective-bench`: ring all-reduce bus bandwidth against message size for
//! the in-process and TCP transports, beside the machine's ceilings.
//!
//! TCP ranks are separate processes: the benchmark writes a loopback rank table and starts
//! this binary once per rank with `--join`, which joins the ring described by the environment
//! exactly as a serving worker does. `--join` doubles as a self-test: every all-reduce it
//! runs is checked against the exact sum.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use super::join_ranks;
use super::tp_bench::{self, Generation};
use crate::collective::transport::{inproc, tcp};
use crate::collective::{Collective, RingCollective, collective_from_env, hccl_env, setup};
use crate::model::PrecisionPolicy;
use npufleet_contract::precision::{AUTO_INT8_MAX_PROMPT_TOKENS, Precision};

#[derive(clap::Args, Debug, Clone)]
pub struct CollectiveBenchArgs {
    /// Message sizes in bytes; K and M mean KiB and MiB.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1K,4K,16K,64K,256K,1M,4M,16M,64M"
    )]
    pub sizes: Vec<String>,
    /// Ring sizes to measure.
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    pub ranks: Vec<usize>,
    /// Transports to measure.
    #[arg(long, value_delimiter = ',', default_value = "inproc,tcp")]
    pub transports: Vec<TransportKind>,
    /// Time spent measuring each size.
    #[arg(long, default_value_t = 0.3)]
    pub seconds: f64,
    /// Instead of bandwidth, measure tensor-parallel greedy decoding of this model (GGUF file
    /// or Hugging Face directory) at each --ranks degree against TP 1: time per token, the
    /// share of it spent in collectives, and whether the tokens match TP 1.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// With --model: the prompt.
    #[arg(
        long,
        default_value = "The quick brown fox jumps over the lazy dog. Once upon a time"
    )]
    pub prompt: String,
    /// With --model: tokens to generate.
    #[arg(long, default_value_t = 32)]
    pub decode_tokens: usize,
    /// With --model: weight precision policy (int8, fp32, fp16, auto).
    #[arg(long, default_value_t = Precision::Fp32)]
    pub policy: Precision,
    /// Run as one rank of the ring given by RANK_TABLE_FILE and the HCCL_* / NPUFLEET_*
    /// variables, checking each all-reduce against the exact sum.
    #[arg(long, hide = true)]
    pub join: bool,
    /// With --join: also time each size (rank 0 prints the results).
    #[arg(long, hide = true)]
    pub measure: bool,
    /// With --join: after the sizes, keep all-reducing the first size this many times.
    #[arg(long, hide = true, default_value_t = 0)]
    pub repeat: u64,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportKind {
    Inproc,
    Tcp,
}

/// One line of a `--join` rank's standard output.
#[derive(serde::Serialize, serde::Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum JoinEvent {
    Ready { rank: usize, world_size: usize },
    Result { bytes: usize, seconds_per_op: f64 },
    Done { rank: usize, checked: u64 },
    Generated { generation: Generation },
}

pub fn run(args: CollectiveBenchArgs) -> anyhow::Result<()> {
    let sizes = args
        .sizes
        .iter()
        .map(|s| parse_size(s))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if let Some(bad) = args.ranks.iter().find(|&&p| p == 0) {
        bail!("--ranks must be at least 1, got {bad}");
    }
    if let Some(model) = &args.model {
        let policy = PrecisionPolicy::new(args.policy, AUTO_INT8_MAX_PROMPT_TOKENS);
        return if args.join {
            join_generation(model, policy, &args)
        } else {
            bench_generation(model, policy, &args)
        };
    }
    if args.join {
        return join(&args, &sizes);
    }
    let largest = *sizes.iter().max().context("--sizes is empty")?;
    let mut columns = Vec::new();
    for &kind in &args.transports {
        for &p in &args.ranks {
            eprintln!("measuring {kind:?} p={p} ...");
            let times = match kind {
                TransportKind::Inproc => bench_inproc(p, &sizes, args.seconds)?,
                TransportKind::Tcp => bench_tcp_processes(p, &sizes, args.seconds)?,
            };
            let (ceiling, cached_pair) = match kind {
                TransportKind::Inproc => (memcpy_bandwidth(p, largest), None),
                TransportKind::Tcp => (
                    loopback_tcp_bandwidth(p, largest)?,
                    Some(loopback_tcp_bandwidth(p, CACHED_PAIR_BUFFER_BYTES)?),
                ),
            };
            columns.push(Column {
                name: format!("{} p={p}", kind_name(kind)),
                world_size: p,
                ceiling,
                cached_pair,
                seconds_per_op: times,
            });
        }
    }
    println!(
        "Ring all-reduce bus bandwidth, GB/s (busbw = 2(p-1)/p x bytes / time per all-reduce)"
    );
    print!("{:>10}", "size");
    for column in &columns {
        print!("{:>14}", column.name);
    }
    println!();
    for (i, &bytes) in sizes.iter().enumerate() {
        print!("{:>10}", format_size(bytes));
        for column in &columns {
            let busbw = bus_bandwidth(bytes, column.world_size, column.seconds_per_op[i]);
            print!("{:>14.3}", busbw / 1e9);
        }
        println!();
    }
    print!("{:>10}", "ceiling");
    for column in &columns {
        print!("{:>14.3}", column.ceiling / 1e9);
    }
    println!();
    let at = sizes.iter().position(|&s| s == largest).expect("present");
    print!("{:>10}", "% ceiling");
    for column in &columns {
        let busbw = bus_bandwidth(largest, column.world_size, column.seconds_per_op[at]);
        print!("{:>13.0}%", 100.0 * busbw / column.ceiling);
    }
    println!("   (at {})", format_size(largest));
    if columns.iter().any(|c| c.cached_pair.is_some()) {
        print!("{:>10}", "pair, 1MiB");
        for column in &columns {
            match column.cached_pair {
                Some(bandwidth) => print!("{:>14.3}", bandwidth / 1e9),
                None => print!("{:>14}", "-"),
            }
        }
        println!();
        print!("{:>10}", "% of that");
        for column in &columns {
            let busbw = bus_bandwidth(largest, column.world_size, column.seconds_per_op[at]);
            match column.cached_pair {
                Some(bandwidth) => print!("{:>13.0}%", 100.0 * busbw / bandwidth),
                None => print!("{:>14}", "-"),
            }
        }
        println!("   (at {})", format_size(largest));
    }
    println!(
        "Ceilings, per rank with p ranks at once, measured in this run with buffers of the \
         largest message ({}): in-process, memcpy bandwidth of one of p threads copying \
         together; TCP, the throughput of one of p plain loopback socket pairs streaming \
         together (all ring links share the loopback and the cores). \"pair, 1MiB\", for \
         reference: the same pairs sending and receiving one cache-resident 1 MiB buffer over \
         and over. Ring and ceilings alike: fastest of {ROUNDS} rounds.",
        format_size(largest)
    );
    Ok(())
}

/// Per-rank buffer of the informational cache-resident socket-pair figure.
const CACHED_PAIR_BUFFER_BYTES: usize = 1 << 20;

/// One ring size on one transport.
struct Column {
    name: String,
    world_size: usize,
    /// Bytes per second of the matching plain data movement.
    ceiling: f64,
    /// TCP only: the plain pairs' throughput with a cache-resident buffer.
    cached_pair: Option<f64>,
    seconds_per_op: Vec<f64>,
}

fn kind_name(kind: TransportKind) -> &'static str {
    match kind {
        TransportKind::Inproc => "inproc",
        TransportKind::Tcp => "tcp",
    }
}

pub fn bus_bandwidth(bytes: usize, world_size: usize, seconds_per_op: f64) -> f64 {
    2.0 * (world_size as f64 - 1.0) / world_size as f64 * bytes as f64 / seconds_per_op
}

fn parse_size(text: &str) -> anyhow::Result<usize> {
    let text = text.trim();
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => text.split_at(i),
        None => (text, ""),
    };
    let value: usize = digits
        .parse()
        .with_context(|| format!("size {text:?} must be a number with an optional K or M"))?;
    let bytes = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => value,
        "K" | "KIB" => value << 10,
        "M" | "MIB" => value << 20,
        _ => bail!("size {text:?} has an unknown unit; use K or M"),
    };
    if bytes == 0 || !bytes.is_multiple_of(4) {
        bail!("size {text:?} must be a positive multiple of 4 bytes (f32 values)");
    }
    Ok(bytes)
}

fn format_size(bytes: usize) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes.is_multiple_of(1 << 10) {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}

/// The value rank `rank` contributes at index `i`: small integers, so sums are exact in f32
/// whatever order the ring adds them in.
pub fn contribution(rank: usize, i: usize) -> f32 {
    ((rank * 7 + i * 13) % 101) as f32
}

pub fn expected_sum(world_size: usize, i: usize) -> f32 {
    (0..world_size).map(|r| contribution(r, i)).sum()
}

/// All-reduces `bytes` of rank-specific values once and checks the result on this rank.
fn checked_all_reduce(collective: &dyn Collective, bytes: usize) -> anyhow::Result<Vec<f32>> {
    let (p, r) = (collective.world_size(), collective.rank());
    let mut buf: Vec<f32> = (0..bytes / 4).map(|i| contribution(r, i)).collect();
    collective.all_reduce_sum(&mut buf)?;
    if let Some(i) = (0..buf.len()).find(|&i| buf[i] != expected_sum(p, i)) {
        bail!(
            "rank {r}: all-reduce of {bytes} bytes is wrong at element {i}: {} instead of {}",
            buf[i],
            expected_sum(p, i)
        );
    }
    Ok(buf)
}

/// Timed rounds per measurement; the fastest counts, for the ring and the ceilings alike,
/// because other work on a shared machine only ever slows a round down.
const ROUNDS: u64 = 3;

/// Checks then times all-reduce of `bytes` on every rank; rank 0 picks the iteration count so
/// all ranks run the same number of calls. Returns seconds per all-reduce in the fastest of
/// [`ROUNDS`] rounds.
fn measure(collective: &dyn Collective, bytes: usize, seconds: f64) -> anyhow::Result<f64> {
    let mut buf = checked_all_reduce(collective, bytes)?;
    let started = Instant::now();
    collective.all_reduce_sum(&mut buf)?;
    let one = started.elapsed().as_secs_f64().max(1e-7);
    let mut count = ((seconds / ROUNDS as f64 / one) as u64)
        .clamp(2, 10_000)
        .to_le_bytes()
        .to_vec();
    collective.broadcast_bytes(&mut count, 0)?;
    let count = u64::from_le_bytes(count.as_slice().try_into().context("iteration count")?);
    let mut fastest = f64::INFINITY;
    for _ in 0..ROUNDS {
        // A one-value all-reduce lines the ranks up before the clock starts and after the
        // last call, so the round times whole all-reduces on every rank.
        collective.all_reduce_sum(&mut [0.0])?;
        // Values grow by a factor p per call; that does not change the timing.
        let started = Instant::now();
        for _ in 0..count {
            collective.all_reduce_sum(&mut buf)?;
        }
        collective.all_reduce_sum(&mut [0.0])?;
        fastest = fastest.min(started.elapsed().as_secs_f64() / count as f64);
    }
    Ok(fastest)
}

fn bench_inproc(world_size: usize, sizes: &[usize], seconds: f64) -> anyhow::Result<Vec<f64>> {
    let rings: Vec<_> = inproc::ring(world_size, Duration::from_secs(120))
        .into_iter()
        .map(RingCollective::new)
        .collect();
    let per_rank: Vec<anyhow::Result<Vec<f64>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = rings
            .iter()
            .map(|ring| {
                scope.spawn(move || sizes.iter().map(|&b| measure(ring, b, seconds)).collect())
            })
            .collect();
        join_ranks(handles)
    });
    per_rank.into_iter().next().expect("at least one rank")
}

/// A rank table for `world_size` single-device servers on 127.0.0.2, 127.0.0.3, …
pub fn loopback_rank_table(world_size: usize) -> String {
    let servers: Vec<serde_json::Value> = (0..world_size)
        .map(|rank| {
            let ip = format!("127.0.0.{}", rank + 2);
            serde_json::json!({
                "server_id": ip, "host_ip": ip, "container_ip": ip,
                "device": [{"device_id": "0", "device_ip": format!("192.0.2.{}", rank + 1), "rank_id": rank.to_string()}],
            })
        })
        .collect();
    serde_json::json!({
        "status": "completed", "version": "1.0", "server_count": world_size.to_string(), "server_list": servers,
    })
    .to_string()
}

/// A port that was free a moment ago, to use as the ring's base port.
fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The environment a `--join` rank of a loopback ring needs.
pub fn loopback_rank_env(
    rank_table: &Path,
    rank: usize,
    port_base: u16,
    timeout_secs: u64,
) -> Vec<(String, String)> {
    [
        (
            npufleet_contract::env::RANK_TABLE_FILE,
            rank_table.display().to_string(),
        ),
        ("POD_IP", format!("127.0.0.{}", rank + 2)),
        (setup::RING_PORT_ENV, port_base.to_string()),
        ("HCCL_CONNECT_TIMEOUT", timeout_secs.to_string()),
        ("HCCL_EXEC_TIMEOUT", timeout_secs.to_string()),
        (hccl_env::ALLOW_SHORT_TIMEOUTS_ENV, "1".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

fn bench_tcp_processes(
    world_size: usize,
    sizes: &[usize],
    seconds: f64,
) -> anyhow::Result<Vec<f64>> {
    let dir = tempfile::tempdir()?;
    let table = dir.path().join("hccl.json");
    std::fs::write(&table, loopback_rank_table(world_size))?;
    let port_base = free_port()?;
    let exe = std::env::current_exe().context("cannot find this program to start the ranks")?;
    let size_list = sizes
        .iter()
        .map(|s| s.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let mut children = Vec::new();
    for rank in 0..world_size {
        let child = Command::new(&exe)
            .args([
                "collective-bench",
                "--join",
                "--measure",
                "--sizes",
                &size_list,
                "--seconds",
                &seconds.to_string(),
            ])
            .envs(loopback_rank_env(&table, rank, port_base, 60))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("cannot start rank {rank}"))?;
        children.push(child);
    }
    let mut results = Vec::new();
    let stdout = children[0].stdout.take().expect("piped");
    for line in BufReader::new(stdout).lines() {
        if let Ok(JoinEvent::Result { seconds_per_op, .. }) = serde_json::from_str(&line?) {
            results.push(seconds_per_op);
        }
    }
    for (rank, mut child) in children.into_iter().enumerate() {
        let status = child.wait()?;
        if !status.success() {
            bail!("TCP rank {rank} failed ({status})");
        }
    }
    if results.len() != sizes.len() {
        bail!(
            "rank 0 reported {} results for {} sizes",
            results.len(),
            sizes.len()
        );
    }
    Ok(results)
}

fn join(args: &CollectiveBenchArgs, sizes: &[usize]) -> anyhow::Result<()> {
    let collective = collective_from_env()?;
    let (rank, world_size) = (collective.rank(), collective.world_size());
    let emit = |event: &JoinEvent| -> anyhow::Result<()> {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{}", serde_json::to_string(event)?)?;
        out.flush()?;
        Ok(())
    };
    emit(&JoinEvent::Ready { rank, world_size })?;
    let mut checked = 0;
    for &bytes in sizes {
        if args.measure {
            let seconds_per_op = measure(collective.as_ref(), bytes, args.seconds)?;
            if rank == 0 {
                emit(&JoinEvent::Result {
                    bytes,
                    seconds_per_op,
                })?;
            }
        } else {
            checked_all_reduce(collective.as_ref(), bytes)?;
        }
        checked += 1;
    }
    let mut plan = format!("broadcast from rank 0 to {world_size} ranks").into_bytes();
    let expected = plan.clone();
    if rank != 0 {
        plan.clear();
    }
    collective.broadcast_bytes(&mut plan, 0)?;
    if plan != expected {
        bail!(
            "rank {rank}: broadcast delivered {:?}",
            String::from_utf8_lossy(&plan)
        );
    }
    let first = sizes.first().copied().unwrap_or(4);
    for _ in 0..args.repeat {
        checked_all_reduce(collective.as_ref(), first)?;
        checked += 1;
    }
    emit(&JoinEvent::Done { rank, checked })
}

fn join_generation(
    model: &Path,
    policy: PrecisionPolicy,
    args: &CollectiveBenchArgs,
) -> anyhow::Result<()> {
    let collective = collective_from_env()?;
    let threads = tp_bench::threads_per_rank(collective.world_size());
    if let Some(generation) = tp_bench::generate(
        model,
        Some(collective),
        policy,
        threads,
        &args.prompt,
        args.decode_tokens,
    )? {
        println!(
            "{}",
            serde_json::to_string(&JoinEvent::Generated { generation })?
        );
    }
    Ok(())
}

/// Generates with `world_size` separate processes of the worker program `exe` joined by a
/// loopback rank table.
pub fn generate_in_processes(
    exe: &Path,
    model: &Path,
    world_size: usize,
    policy: &str,
    prompt: &str,
    decode_tokens: usize,
) -> anyhow::Result<Generation> {
    let dir = tempfile::tempdir()?;
    let table = dir.path().join("hccl.json");
    std::fs::write(&table, loopback_rank_table(world_size))?;
    let port_base = free_port()?;
    let children = (0..world_size)
        .map(|rank| {
            Command::new(exe)
                .args([
                    "collective-bench",
                    "--join",
                    "--policy",
                    policy,
                    "--prompt",
                    prompt,
                ])
                .arg("--decode-tokens")
                .arg(decode_tokens.to_string())
                .arg("--model")
                .arg(model)
                .envs(loopback_rank_env(&table, rank, port_base, 120))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .with_context(|| format!("cannot start rank {rank}"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut generation = None;
    for (rank, child) in children.into_iter().enumerate() {
        let output = child.wait_with_output()?;
        if !output.status.success() {
            bail!(
                "rank {rank} failed: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        for line in String::from_utf8_lossy(&output.stdout).lines() {
            if let Ok(JoinEvent::Generated { generation: g }) = serde_json::from_str(line) {
                generation = Some(g);
            }
        }
    }
    generation.context("rank 0 reported no generation")
}

fn bench_generation(
    model: &Path,
    policy: PrecisionPolicy,
    args: &CollectiveBenchArgs,
) -> anyhow::Result<()> {
    let baseline =
        tp_bench::generate_in_process(model, 1, policy, &args.prompt, args.decode_tokens)?;
    let per_token =
        |g: &Generation| 1e3 * g.decode_seconds / g.tokens.len().saturating_sub(1).max(1) as f64;
    println!(
        "Tensor-parallel greedy decoding of {} ({} tokens, policy {})",
        model.display(),
        args.decode_tokens,
        args.policy
    );
    println!(
        "{:>4} {:>8} {:>8} {:>10} {:>12} {:>14} {:>12}",
        "TP", "ranks as", "threads", "ms/token", "in collect.", "transfer only", "same tokens"
    );
    println!(
        "{:>4} {:>8} {:>8} {:>10.2} {:>12} {:>14} {:>12}",
        1,
        "-",
        tp_bench::threads_per_rank(1),
        per_token(&baseline),
        "-",
        "-",
        "baseline"
    );
    for &kind in &args.transports {
        for &p in args.ranks.iter().filter(|&&p| p > 1) {
            let generation = match kind {
                TransportKind::Inproc => tp_bench::generate_in_process(
                    model,
                    p,
                    policy,
                    &args.prompt,
                    args.decode_tokens,
                )?,
                TransportKind::Tcp => {
                    let exe = std::env::current_exe()
                        .context("cannot find this program to start the ranks")?;
                    generate_in_processes(
                        &exe,
                        model,
                        p,
                        args.policy.as_str(),
                        &args.prompt,
                        args.decode_tokens,
                    )?
                }
            };
            let decode_seconds = generation.decode_seconds.max(1e-9);
            let share = 100.0 * generation.decode_comm_seconds / decode_seconds;
            let transfer_share = 100.0 * generation.decode_transfer_seconds / decode_seconds;
            let same = if generation.tokens == baseline.tokens {
                "yes"
            } else {
                "NO"
            };
            let ranks_as = match kind {
                TransportKind::Inproc => "threads",
                TransportKind::Tcp => "procs",
            };
            println!(
                "{p:>4} {ranks_as:>8} {:>8} {:>10.2} {:>11.1}% {:>13.1}% {same:>12}",
                tp_bench::threads_per_rank(p),
                per_token(&generation),
                share,
                transfer_share
            );
        }
    }
    println!(
        "Shares of decode time. \"in collect.\": rank 0's time inside collectives, including \
         waiting for slower ranks to finish computing (with more ranks than cores, or other \
         work on the machine, that wait dominates). \"transfer only\": the same collectives \
         replayed back to back after the decode, the cost of the communication itself."
    );
    Ok(())
}

/// The in-process ceiling: memcpy bandwidth of one thread while `threads` threads each copy a
/// buffer of `bytes` at once, as the ranks of an in-process ring all move data at once (on a
/// machine with fewer cores than ranks they share the cores the same way), bytes per second.
/// Fastest of [`ROUNDS`] rounds.
fn memcpy_bandwidth(threads: usize, bytes: usize) -> f64 {
    let mut buffers: Vec<(Vec<u8>, Vec<u8>)> = (0..threads)
        .map(|_| (vec![1u8; bytes], vec![0u8; bytes]))
        .collect();
    let mut fastest = 0.0f64;
    for _ in 0..ROUNDS {
        let start = std::sync::Barrier::new(threads);
        let per_thread: Vec<f64> = std::thread::scope(|scope| {
            let handles: Vec<_> = buffers
                .iter_mut()
                .map(|(src, dst)| {
                    let start = &start;
                    scope.spawn(move || {
                        start.wait();
                        let started = Instant::now();
                        let mut copies = 0;
                        while started.elapsed() < Duration::from_millis(200) {
                            dst.copy_from_slice(std::hint::black_box(src));
                            copies += 1;
                        }
                        std::hint::black_box(&dst);
                        (copies * bytes) as f64 / started.elapsed().as_secs_f64()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("copy thread"))
                .collect()
        });
        fastest = fastest.max(per_thread.iter().sum::<f64>() / threads as f64);
    }
    fastest
}

/// The TCP ceiling: throughput of one plain loopback socket pair (a writer thread sending a
/// `message_bytes` buffer with one `write_all`, a reader thread reading it into its own buffer
/// of that size, over and over, nothing else) while `links` such pairs stream at once, bytes
/// per second.
///
/// Every rank of a TCP ring sends to its successor at the same time, and on one host all `p`
/// links share the loopback device and the cores that do its copying, so the fair comparison
/// for one ring link is one of `p` concurrent plain pairs, not a pair running alone; and like
/// the ring, the pair reads its message from memory and lands it in memory. The pairs start
/// together and the figure is their total bytes over the time until the last finishes,
/// divided by `links`. Both the kernel's default socket settings and the ring's (larger
/// buffers, no Nagle) are tried and the faster counts, fastest of [`ROUNDS`] rounds.
fn loopback_tcp_bandwidth(links: usize, message_bytes: usize) -> anyhow::Result<f64> {
    let mut buffers: Vec<(Vec<u8>, Vec<u8>)> = (0..links)
        .map(|_| (vec![7u8; message_bytes], vec![0u8; message_bytes]))
        .collect();
    let mut fastest = 0.0f64;
    for _ in 0..ROUNDS {
        for ring_settings in [false, true] {
            fastest = fastest.max(loopback_pairs_once(&mut buffers, ring_settings)?);
        }
    }
    Ok(fastest)
}

fn loopback_pairs_once(
    buffers: &mut [(Vec<u8>, Vec<u8>)],
    ring_settings: bool,
) -> anyhow::Result<f64> {
    const MIN_BYTES_PER_LINK: usize = 256 << 20;
    let links = buffers.len();
    let message_bytes = buffers[0].0.len();
    let messages = MIN_BYTES_PER_LINK.div_ceil(message_bytes);
    let pairs = (0..links)
        .map(|_| {
            let addr = "127.0.0.1:0".parse()?;
            let listener = if ring_settings {
                tcp::listen(addr)?
            } else {
                std::net::TcpListener::bind(addr)?
            };
            let writer = TcpStream::connect(listener.local_addr()?)?;
            let (reader, _) = listener.accept()?;
            if ring_settings {
                for stream in [&writer, &reader] {
                    stream.set_nodelay(true)?;
                    let socket = socket2::SockRef::from(stream);
                    socket.set_send_buffer_size(4 << 20)?;
                    socket.set_recv_buffer_size(4 << 20)?;
                }
            }
            Ok((writer, reader))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let start = std::sync::Barrier::new(2 * links + 1);
    let started = std::thread::scope(|scope| -> anyhow::Result<Instant> {
        let mut handles = Vec::new();
        for ((mut writer, mut reader), (src, dst)) in pairs.into_iter().zip(buffers.iter_mut()) {
            let start = &start;
            handles.push(scope.spawn(move || -> anyhow::Result<()> {
                start.wait();
                for _ in 0..messages {
                    writer.write_all(src)?;
                }
                Ok(())
            }));
            handles.push(scope.spawn(move || -> anyhow::Result<()> {
                start.wait();
                for _ in 0..messages {
                    reader.read_exact(dst)?;
                }
                Ok(())
            }));
        }
        start.wait();
        let started = Instant::now();
        for handle in handles {
            handle
                .join()
                .map_err(|_| anyhow::anyhow!("a loopback thread panicked"))??;
        }
        Ok(started)
    })?;
    Ok((messages * message_bytes) as f64 / started.elapsed().as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("1K").unwrap(), 1024);
        assert_eq!(parse_size("64M").unwrap(), 64 << 20);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("3").is_err());
        assert!(parse_size("1G").is_err());
        assert_eq!(format_size(64 << 20), "64 MiB");
        assert_eq!(format_size(1024), "1 KiB");
    }
}

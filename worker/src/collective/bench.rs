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

use super::tp_bench::{self, Generation};
use super::transport::{inproc, tcp};
use super::{Collective, RingCollective, collective_from_env, hccl_env, setup};
use crate::model::PrecisionPolicy;

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
    #[arg(long, default_value = "fp32")]
    pub policy: String,
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
        let policy = PrecisionPolicy::parse(&args.policy).map_err(anyhow::Error::msg)?;
        return if args.join {
            join_generation(model, policy, &args)
        } else {
            bench_generation(model, policy, &args)
        };
    }
    if args.join {
        return join(&args, &sizes);
    }
    let mut columns = Vec::new();
    for &kind in &args.transports {
        for &p in &args.ranks {
            eprintln!("measuring {kind:?} p={p} ...");
            let times = match kind {
                TransportKind::Inproc => bench_inproc(p, &sizes, args.seconds)?,
                TransportKind::Tcp => bench_tcp_processes(p, &sizes, args.seconds)?,
            };
            let ceiling = match kind {
                TransportKind::Inproc => memcpy_bandwidth(p),
                TransportKind::Tcp => loopback_tcp_bandwidth(p)?,
            };
            columns.push((format!("{} p={p}", kind_name(kind)), p, ceiling, times));
        }
    }
    println!(
        "Ring all-reduce bus bandwidth, GB/s (busbw = 2(p-1)/p x bytes / time per all-reduce)"
    );
    print!("{:>10}", "size");
    for (name, ..) in &columns {
        print!("{name:>14}");
    }
    println!();
    for (i, &bytes) in sizes.iter().enumerate() {
        print!("{:>10}", format_size(bytes));
        for (_, p, _, times) in &columns {
            print!("{:>14.3}", bus_bandwidth(bytes, *p, times[i]) / 1e9);
        }
        println!();
    }
    print!("{:>10}", "ceiling");
    for (_, _, ceiling, _) in &columns {
        print!("{:>14.3}", ceiling / 1e9);
    }
    println!();
    if let Some(&largest) = sizes.iter().max() {
        let at = sizes.iter().position(|&s| s == largest).expect("present");
        print!("{:>10}", "% ceiling");
        for (_, p, ceiling, times) in &columns {
            print!(
                "{:>13.0}%",
                100.0 * bus_bandwidth(largest, *p, times[at]) / ceiling
            );
        }
        println!("   (at {})", format_size(largest));
    }
    println!(
        "Ceilings, per rank with p ranks at once: in-process, memcpy bandwidth of one of p threads \
         copying together; TCP, one of p plain loopback socket pairs streaming together."
    );
    Ok(())
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

/// Checks then times all-reduce of `bytes` on every rank; rank 0 picks the iteration count so
/// all ranks run the same number of calls. Returns seconds per all-reduce.
fn measure(collective: &dyn Collective, bytes: usize, seconds: f64) -> anyhow::Result<f64> {
    let mut buf = checked_all_reduce(collective, bytes)?;
    let started = Instant::now();
    collective.all_reduce_sum(&mut buf)?;
    let one = started.elapsed().as_secs_f64().max(1e-7);
    let mut count = ((seconds / one) as u64)
        .clamp(3, 20_000)
        .to_le_bytes()
        .to_vec();
    collective.broadcast_bytes(&mut count, 0)?;
    let count = u64::from_le_bytes(count.as_slice().try_into().context("iteration count")?);
    collective.all_reduce_sum(&mut [0.0])?;
    // Values grow by a factor p per call; that does not change the timing.
    let started = Instant::now();
    for _ in 0..count {
        collective.all_reduce_sum(&mut buf)?;
    }
    collective.all_reduce_sum(&mut [0.0])?;
    Ok(started.elapsed().as_secs_f64() / count as f64)
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
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a rank thread panicked")))
            })
            .collect()
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
pub fn free_port() -> anyhow::Result<u16> {
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
        (setup::RANK_TABLE_FILE_ENV, rank_table.display().to_string()),
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
    if let Some(generation) = tp_bench::generate(
        model,
        Some(collective),
        policy,
        1,
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
        "{:>4} {:>8} {:>12} {:>14} {:>14}",
        "TP", "ranks as", "ms/token", "comm share", "same tokens"
    );
    println!(
        "{:>4} {:>8} {:>12.2} {:>14} {:>14}",
        1,
        "-",
        per_token(&baseline),
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
                        &args.policy,
                        &args.prompt,
                        args.decode_tokens,
                    )?
                }
            };
            let share =
                100.0 * generation.decode_comm_seconds / generation.decode_seconds.max(1e-9);
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
                "{p:>4} {ranks_as:>8} {:>12.2} {:>13.1}% {same:>14}",
                per_token(&generation),
                share
            );
        }
    }
    Ok(())
}

/// Memcpy bandwidth of one thread while `threads` threads copy at once (the in-process
/// ring's pattern: every rank copies at the same time), bytes per second.
fn memcpy_bandwidth(threads: usize) -> f64 {
    let per_thread: Vec<f64> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let src = vec![1u8; 64 << 20];
                    let mut dst = vec![0u8; 64 << 20];
                    dst.copy_from_slice(&src);
                    let started = Instant::now();
                    let mut copies = 0;
                    while started.elapsed() < Duration::from_millis(500) {
                        dst.copy_from_slice(std::hint::black_box(&src));
                        copies += 1;
                    }
                    std::hint::black_box(&dst);
                    (copies * src.len()) as f64 / started.elapsed().as_secs_f64()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("copy thread"))
            .collect()
    });
    per_thread.iter().sum::<f64>() / threads as f64
}

/// Bandwidth of one plain loopback TCP stream while `links` streams run at once (the TCP
/// ring's pattern: every rank sends to its successor at the same time), with the ring's
/// socket settings, bytes per second.
fn loopback_tcp_bandwidth(links: usize) -> anyhow::Result<f64> {
    const PER_LINK: usize = 512 << 20;
    let listeners = (0..links)
        .map(|_| tcp::listen("127.0.0.1:0".parse()?).map_err(anyhow::Error::from))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let per_link: Vec<anyhow::Result<f64>> = std::thread::scope(|scope| {
        let handles: Vec<_> = listeners
            .iter()
            .map(|listener| {
                let addr = listener.local_addr();
                let writer = scope.spawn(move || -> anyhow::Result<()> {
                    let mut stream = TcpStream::connect(addr?)?;
                    stream.set_nodelay(true)?;
                    let block = vec![7u8; 1 << 20];
                    for _ in 0..PER_LINK / block.len() {
                        stream.write_all(&block)?;
                    }
                    Ok(())
                });
                scope.spawn(move || -> anyhow::Result<f64> {
                    let (mut stream, _) = listener.accept()?;
                    let mut buf = vec![0u8; 1 << 20];
                    let started = Instant::now();
                    let mut received = 0;
                    while received < PER_LINK {
                        match stream.read(&mut buf)? {
                            0 => bail!("the loopback writer closed early"),
                            n => received += n,
                        }
                    }
                    let elapsed = started.elapsed().as_secs_f64();
                    writer
                        .join()
                        .map_err(|_| anyhow::anyhow!("the loopback writer panicked"))??;
                    Ok(received as f64 / elapsed)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a reader panicked")))
            })
            .collect()
    });
    let per_link = per_link.into_iter().collect::<anyhow::Result<Vec<f64>>>()?;
    Ok(per_link.iter().sum::<f64>() / links as f64)
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

//! `npufleet-worker bench`: the engine's prefill, decode and batched-decode throughput on
//! this machine, side by side with llama.cpp on the same file, prompts and thread count.
//!
//! Every figure goes through the real engine (engine core, sampling, streaming), not just the
//! forward pass. Decode figures count only steps where every sequence decodes: for N
//! concurrent requests the window runs from the last request's first token to the first
//! request's last token.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rayon::prelude::*;
use serde::Deserialize;

use crate::api::{
    Engine, EngineState, GenerateRequest, GenerationEvent, GenerationStream, Prompt,
    RequestTimings, SamplingParams,
};
use crate::engine::{self, EngineConfig, EngineHandle, KvCacheSize};
use crate::model::{LoadOptions, Model};
use crate::startup::{KvCacheDtypeArgs, PrecisionArgs};

const DEFAULT_REFERENCE_SCRIPT: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/bench/llama_cpp_bench.py");

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Reference {
    /// llama.cpp through llama-cpp-python.
    LlamaCpp,
}

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// The model: a GGUF file or a Hugging Face directory.
    #[arg(long)]
    pub model: PathBuf,
    /// Compute threads, for the worker and the reference alike.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// The same precision policy and thresholds `serve` runs by default.
    #[command(flatten)]
    pub precision: PrecisionArgs,
    /// The KV cache's element type `serve` stores by default.
    #[command(flatten)]
    pub kv_cache: KvCacheDtypeArgs,
    /// Also measure this engine on the same file and print the ratios.
    #[arg(long, value_enum)]
    pub reference: Option<Reference>,
    /// A Python with llama-cpp-python installed
    /// (`tests/setup/python-env.sh tests/setup/requirements-bench.txt` prints one).
    #[arg(long, env = "NPUFLEET_BENCH_PYTHON", default_value = "python3")]
    pub python: PathBuf,
    /// The reference's side of the benchmark.
    #[arg(long, default_value = DEFAULT_REFERENCE_SCRIPT)]
    pub reference_script: PathBuf,
    /// Prompt length for the prefill and time-to-first-token figures.
    #[arg(long, default_value_t = 500)]
    pub prompt_tokens: usize,
    /// Prompt length of each request in the decode figures.
    #[arg(long, default_value_t = 16)]
    pub short_prompt_tokens: usize,
    /// Tokens generated per request in the decode figures.
    #[arg(long, default_value_t = 64)]
    pub decode_tokens: usize,
    /// Concurrent sequences for the aggregate decode figures.
    #[arg(long, value_delimiter = ',', default_values_t = [8, 32, 128])]
    pub batch_sizes: Vec<usize>,
    /// Timed runs of each figure (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// The engine's per-step token budget.
    #[arg(long, default_value_t = 512)]
    pub max_num_batched_tokens: usize,
}

/// One engine's figures.
#[derive(Debug, Clone, Default, Deserialize)]
struct Figures {
    /// Seconds from opening the file to a model ready to run (llama.cpp maps the file and
    /// reads pages as the first requests touch them; so does this worker for GGUF files).
    load_s: f64,
    prefill_tok_s: f64,
    ttft_ms: f64,
    decode_tok_s: f64,
    /// Concurrent sequences → aggregate decode tok/s.
    aggregate_tok_s: std::collections::BTreeMap<String, f64>,
    /// Concurrent sequences the engine could not run → why.
    #[serde(default)]
    skipped: std::collections::BTreeMap<String, String>,
    peak_rss_bytes: u64,
    /// Concurrent sequences → peak RSS once the runs up to that many had finished (this
    /// engine's cache is sized for the largest run up front but only touched pages count).
    #[serde(default)]
    peak_rss_bytes_by_sequences: std::collections::BTreeMap<String, u64>,
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    check_args(&args)?;
    let file_bytes = std::fs::metadata(&args.model)
        .with_context(|| format!("reading {}", args.model.display()))?
        .len();

    eprintln!("loading {} ...", args.model.display());
    let loaded = Instant::now();
    let model = Model::load(
        &args.model,
        LoadOptions {
            policy: args.precision.policy(),
            threads: args.threads,
            collective: None,
            backend: None,
        },
    )?;
    let load_time = loaded.elapsed();
    let resident_weight_bytes = model.weight_bytes();
    let decode_bytes = model.decode_weight_bytes() as u64;
    let backend = model.backend_name();
    let prompts = Prompts::new(&model, &args)?;

    let cache = CacheSizing::for_runs(&args);
    let config = cache.engine_config(&args);
    let kv_bytes = engine::kv_block_bytes(&model, &config) * cache.blocks;
    let engine = engine::start(model, config)?;
    wait_ready(&engine)?;
    let mut worker = measure(&engine, &args, &prompts)?;
    worker.load_s = load_time.as_secs_f64();
    let load = engine.load();
    drop(engine);
    worker.peak_rss_bytes = peak_rss_bytes()?;

    // Measured after the peak RSS was read: the probe's buffer would dominate it.
    eprintln!("measuring memory bandwidth ...");
    let bandwidth = memory_bandwidth(args.threads)?;
    let reference = run_reference(&args, &prompts);

    println!(
        "model {} ({:.1} MiB file, {:.1} MiB resident weights, policy {}), {} threads, backend {backend}, loaded in {:.2} s",
        args.model.display(),
        mib(file_bytes),
        mib(resident_weight_bytes as u64),
        args.precision.precision,
        args.threads,
        load_time.as_secs_f64()
    );
    println!(
        "engine: {} steps, {} preemptions, last batch {}; KV cache {:.1} MiB ({}, {} blocks of {} positions, sized for {} sequences)",
        load.steps_total,
        load.preemptions_total,
        load.last_batch_size,
        mib(kv_bytes as u64),
        args.kv_cache.dtype().name(),
        cache.blocks,
        cache.block_size,
        cache.max_batch
    );
    print_table(&args, &worker, reference.as_ref(), bandwidth, decode_bytes);
    Ok(())
}

fn check_args(args: &BenchArgs) -> anyhow::Result<()> {
    if args.prompt_tokens == 0 || args.short_prompt_tokens == 0 || args.decode_tokens < 2 {
        bail!("prompt lengths must be positive and --decode-tokens at least 2");
    }
    if args.repeats == 0 || args.batch_sizes.contains(&0) {
        bail!("--repeats and every batch size must be at least 1");
    }
    Ok(())
}

/// Enough KV cache for the largest run and no more, so peak RSS is comparable.
struct CacheSizing {
    max_batch: usize,
    block_size: usize,
    blocks: usize,
}

impl CacheSizing {
    fn for_runs(args: &BenchArgs) -> Self {
        let max_batch = args.batch_sizes.iter().copied().max().unwrap_or(1).max(1);
        let block_size = 16;
        let per_sequence = args.short_prompt_tokens + args.decode_tokens + block_size;
        let kv_tokens = (max_batch * per_sequence)
            .max(args.short_prompt_tokens + args.decode_tokens * 2 + block_size)
            .max(args.prompt_tokens + block_size);
        CacheSizing {
            max_batch,
            block_size,
            blocks: kv_tokens.div_ceil(block_size) + max_batch,
        }
    }

    fn engine_config(&self, args: &BenchArgs) -> EngineConfig {
        EngineConfig {
            model_name: "bench".into(),
            max_batch_size: self.max_batch,
            queue_limit: self.max_batch,
            max_num_batched_tokens: args.max_num_batched_tokens,
            block_size: self.block_size,
            kv_cache: KvCacheSize::Blocks(self.blocks),
            kv_dtype: args.kv_cache.dtype(),
            warmup_iterations: 10,
            ignore_eos: true,
            ..EngineConfig::default()
        }
    }
}

/// This engine's speed figures; load time and overall peak RSS are the caller's to fill in.
fn measure(
    engine: &Arc<EngineHandle>,
    args: &BenchArgs,
    prompts: &Prompts,
) -> anyhow::Result<Figures> {
    eprintln!("npufleet: prefill ...");
    // The first long prompt pages in the prefill path's weights; it is not timed.
    finish(engine, Prompt::Tokens(prompts.warmup.clone()), 1)?;
    let mut prefill_prompts = prompts.prefill.iter();
    let ttft_s = median_of(prompts.prefill.len(), || {
        let prompt = prefill_prompts.next().expect("one prompt per run");
        let timings = finish(engine, Prompt::Tokens(prompt.clone()), 1)?;
        Ok(timings.first_token.as_secs_f64())
    })?;

    eprintln!("npufleet: decode at batch 1 ...");
    let decode_tok_s = median_of(args.repeats, || {
        let times = run_concurrent(engine, &prompts.short[..1], args.decode_tokens * 2)?;
        let tokens = &times[0];
        let span = tokens[tokens.len() - 1].duration_since(tokens[0]);
        Ok((tokens.len() - 1) as f64 / span.as_secs_f64())
    })?;

    let mut figures = Figures {
        prefill_tok_s: args.prompt_tokens as f64 / ttft_s,
        ttft_ms: ttft_s * 1000.0,
        decode_tok_s,
        ..Figures::default()
    };
    let mut batch_sizes = args.batch_sizes.clone();
    batch_sizes.sort_unstable();
    for n in batch_sizes {
        eprintln!("npufleet: aggregate decode with {n} sequences ...");
        let rate = median_of(args.repeats, || {
            let times = run_concurrent(engine, &prompts.short[..n], args.decode_tokens)?;
            Ok(steady_rate(&times))
        })?;
        figures.aggregate_tok_s.insert(n.to_string(), rate);
        figures
            .peak_rss_bytes_by_sequences
            .insert(n.to_string(), peak_rss_bytes()?);
    }
    Ok(figures)
}

/// The reference engine's figures, or `None` (said on stderr) when none was asked for or it
/// failed.
fn run_reference(args: &BenchArgs, prompts: &Prompts) -> Option<Figures> {
    match args.reference? {
        Reference::LlamaCpp => {
            eprintln!("llama.cpp: running {} ...", args.reference_script.display());
            run_llama_cpp(args, prompts)
                .inspect_err(|err| eprintln!("llama.cpp reference failed: {err:#}"))
                .ok()
        }
    }
}

/// Token ids shared by both engines, cut from one long text at different offsets so no two
/// prompts share a first block (nothing is served from the prefix cache).
struct Prompts {
    warmup: Vec<u32>,
    prefill: Vec<Vec<u32>>,
    short: Vec<Vec<u32>>,
}

impl Prompts {
    fn new(model: &Model, args: &BenchArgs) -> anyhow::Result<Self> {
        let max_batch = args.batch_sizes.iter().copied().max().unwrap_or(1);
        let subjects = [
            "river",
            "mountain",
            "library",
            "harbour",
            "orchard",
            "observatory",
        ];
        let verbs = [
            "crossed",
            "described",
            "measured",
            "painted",
            "visited",
            "mapped",
        ];
        let mut text = String::new();
        let mut tokens = Vec::new();
        let needed = args.prompt_tokens + (args.repeats + 1) * 17 + max_batch * 7 + 64;
        let mut sentence = 0usize;
        while tokens.len() < needed + args.short_prompt_tokens {
            for _ in 0..64 {
                text.push_str(&format!(
                    "In year {}, traveller {} {} the {} near town {}. ",
                    1700 + sentence,
                    sentence * 7 % 101,
                    verbs[sentence % verbs.len()],
                    subjects[sentence * 5 % subjects.len()],
                    sentence * 13 % 97
                ));
                sentence += 1;
            }
            tokens = model.tokenizer().encode(&text);
        }
        let window = |offset: usize, len: usize| tokens[offset..offset + len].to_vec();
        let prefill_offset = |r: usize| (r + 1) * 17;
        let short_base = prefill_offset(args.repeats + 1) + args.prompt_tokens;
        Ok(Self {
            warmup: window(0, args.prompt_tokens),
            prefill: (0..args.repeats)
                .map(|r| window(prefill_offset(r), args.prompt_tokens))
                .collect(),
            short: (0..max_batch)
                .map(|i| window(short_base + i * 7, args.short_prompt_tokens))
                .collect(),
        })
    }
}

fn wait_ready(engine: &EngineHandle) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        match engine.state() {
            EngineState::Ready => return Ok(()),
            EngineState::WarmingUp { .. } if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            state => bail!("the engine did not become ready: {state:?}"),
        }
    }
}

fn bench_request(id: String, prompt: Prompt, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        id,
        prompt,
        params: SamplingParams {
            max_tokens: Some(max_tokens as u32),
            ..SamplingParams::default()
        },
    }
}

/// Runs one request to the end and returns its timings.
fn finish(
    engine: &EngineHandle,
    prompt: Prompt,
    max_tokens: usize,
) -> anyhow::Result<RequestTimings> {
    let mut stream = engine.submit(bench_request("prefill".into(), prompt, max_tokens))?;
    while let Some(event) = stream.blocking_recv() {
        match event {
            GenerationEvent::Token { .. } => {}
            GenerationEvent::Finished { timings, .. } => return Ok(timings),
            GenerationEvent::Failed { message } => bail!("request failed: {message}"),
        }
    }
    bail!("the stream ended without a final event")
}

/// Submits one request per prompt at once and returns each one's token arrival times.
fn run_concurrent(
    engine: &Arc<EngineHandle>,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> anyhow::Result<Vec<Vec<Instant>>> {
    let streams = prompts
        .iter()
        .enumerate()
        .map(|(i, prompt)| {
            engine
                .submit(bench_request(
                    format!("decode-{i}"),
                    Prompt::Tokens(prompt.clone()),
                    max_tokens,
                ))
                .map_err(anyhow::Error::from)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let runtime = tokio::runtime::Builder::new_current_thread().build()?;
    runtime.block_on(async {
        let tasks: Vec<_> = streams
            .into_iter()
            .map(|s| tokio::spawn(token_times(s)))
            .collect();
        let mut all = Vec::with_capacity(tasks.len());
        for task in tasks {
            all.push(task.await??);
        }
        Ok(all)
    })
}

async fn token_times(mut stream: GenerationStream) -> anyhow::Result<Vec<Instant>> {
    let mut times = Vec::new();
    while let Some(event) = stream.recv().await {
        match event {
            GenerationEvent::Token { .. } => times.push(Instant::now()),
            GenerationEvent::Finished { .. } => {
                if times.len() < 2 {
                    bail!("a request generated fewer than two tokens");
                }
                return Ok(times);
            }
            GenerationEvent::Failed { message } => bail!("request failed: {message}"),
        }
    }
    bail!("the stream ended without a final event")
}

/// The median of `repeats` measurements (rates or times): a shared machine's bursts of
/// contention move a single short run by tens of percent.
fn median_of(
    repeats: usize,
    mut measure: impl FnMut() -> anyhow::Result<f64>,
) -> anyhow::Result<f64> {
    let mut rates = (0..repeats)
        .map(|_| measure())
        .collect::<anyhow::Result<Vec<f64>>>()?;
    rates.sort_by(f64::total_cmp);
    Ok(rates[rates.len() / 2])
}

/// Tokens per second while every request was decoding: from the last first token to the
/// first last token.
fn steady_rate(times: &[Vec<Instant>]) -> f64 {
    let start = times
        .iter()
        .map(|t| t[0])
        .max()
        .expect("at least one request");
    let end = times
        .iter()
        .map(|t| t[t.len() - 1])
        .min()
        .expect("at least one request");
    if end <= start {
        // Prefill never finished before the first request ended: count everything.
        let first = times.iter().map(|t| t[0]).min().expect("non-empty");
        let last = times
            .iter()
            .map(|t| t[t.len() - 1])
            .max()
            .expect("non-empty");
        let total: usize = times.iter().map(Vec::len).sum();
        return total as f64 / last.duration_since(first).as_secs_f64();
    }
    let counted: usize = times
        .iter()
        .map(|t| t.iter().filter(|&&at| at > start && at <= end).count())
        .sum();
    counted as f64 / end.duration_since(start).as_secs_f64()
}

fn run_llama_cpp(args: &BenchArgs, prompts: &Prompts) -> anyhow::Result<Figures> {
    let spec = serde_json::json!({
        "prefill": prompts.prefill,
        "short": prompts.short,
        "batch_sizes": args.batch_sizes,
        "decode_tokens": args.decode_tokens,
        "repeats": args.repeats,
    });
    let spec_path = std::env::temp_dir().join(format!(
        "npufleet-bench-prompts-{}.json",
        std::process::id()
    ));
    std::fs::write(&spec_path, serde_json::to_vec(&spec)?)
        .with_context(|| format!("writing {}", spec_path.display()))?;
    let output = Command::new(&args.python)
        .arg(&args.reference_script)
        .arg("--model")
        .arg(&args.model)
        .arg("--threads")
        .arg(args.threads.to_string())
        .arg("--prompts")
        .arg(&spec_path)
        .output()
        .with_context(|| format!("running {}", args.python.display()));
    let _ = std::fs::remove_file(&spec_path);
    let output = output?;
    if !output.status.success() {
        bail!(
            "{} exited with {}:\n{}",
            args.reference_script.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let stdout = String::from_utf8(output.stdout).context("reference printed non-UTF-8")?;
    let line = stdout
        .lines()
        .last()
        .context("the reference printed nothing")?;
    serde_json::from_str(line).with_context(|| format!("parsing the reference's output {line:?}"))
}

/// Peak resident set size of this process (VmHWM).
fn peak_rss_bytes() -> anyhow::Result<u64> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let kib = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .context("no VmHWM in /proc/self/status")?;
    Ok(kib * 1024)
}

/// Read bandwidth in bytes per second: vectorised sums over a buffer far larger than the
/// caches, split over `threads` threads, best of several passes.
fn memory_bandwidth(threads: usize) -> anyhow::Result<f64> {
    const BUFFER_BYTES: usize = 1 << 30;
    let words = vec![1u64; BUFFER_BYTES / 8];
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()?;
    let chunk = words.len().div_ceil(threads.max(1));
    let mut best = 0.0f64;
    for _ in 0..5 {
        let started = Instant::now();
        let sum: u64 = pool.install(|| words.par_chunks(chunk).map(sum_words).sum());
        let elapsed = started.elapsed().as_secs_f64();
        if sum != words.len() as u64 {
            bail!("bandwidth probe summed {sum}, expected {}", words.len());
        }
        best = best.max(BUFFER_BYTES as f64 / elapsed);
    }
    Ok(best)
}

fn sum_words(words: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is available on this CPU.
        return unsafe { sum_words_avx2(words) };
    }
    words.iter().copied().fold(0u64, u64::wrapping_add)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_words_avx2(words: &[u64]) -> u64 {
    use std::arch::x86_64::*;
    let mut accumulators = [_mm256_setzero_si256(); 4];
    let blocks = words.chunks_exact(16);
    let rest = blocks.remainder();
    for block in blocks {
        let pointer = block.as_ptr().cast::<__m256i>();
        for (lane, accumulator) in accumulators.iter_mut().enumerate() {
            // SAFETY: each block holds 16 words, four 256-bit loads.
            let loaded = unsafe { _mm256_loadu_si256(pointer.add(lane)) };
            *accumulator = _mm256_add_epi64(*accumulator, loaded);
        }
    }
    let mut lanes = [0u64; 4];
    let total = accumulators
        .iter()
        .fold(_mm256_setzero_si256(), |a, &b| _mm256_add_epi64(a, b));
    // SAFETY: `lanes` holds exactly one 256-bit value.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast::<__m256i>(), total) };
    lanes
        .iter()
        .chain(rest)
        .copied()
        .fold(0u64, u64::wrapping_add)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn print_table(
    args: &BenchArgs,
    worker: &Figures,
    reference: Option<&Figures>,
    bandwidth: f64,
    decode_bytes: u64,
) {
    let reference_name = match args.reference {
        Some(Reference::LlamaCpp) => "llama.cpp",
        None => "-",
    };
    let table = Table { reference };
    table.header(reference_name);
    table.speed_rows(args, worker);
    table.memory_rows(worker);
    for (n, reason) in reference.map(|f| &f.skipped).into_iter().flatten() {
        println!("{reference_name} at {n} sequences: not measured ({reason})");
    }
    println!();
    print_roofline(args, worker, reference, bandwidth, decode_bytes);
}

/// The comparison table: one row a figure, the reference's beside ours when it ran.
struct Table<'a> {
    reference: Option<&'a Figures>,
}

impl Table<'_> {
    fn header(&self, reference_name: &str) {
        println!();
        // The advantage column is above 1 where npufleet does better: ours ÷ theirs for
        // throughput, theirs ÷ ours for latency and memory.
        println!(
            "| {:<44} | {:>10} | {:>10} | {:>9} | {:<20} |",
            "metric", "npufleet", reference_name, "advantage", "target"
        );
        println!(
            "|{:-<46}|{:->12}|{:->12}|{:->11}|{:-<22}|",
            "", "", "", "", ""
        );
    }

    fn row(&self, name: &str, ours: f64, theirs: Option<f64>, lower_is_better: bool, target: &str) {
        let (theirs_text, advantage_text) = match theirs {
            Some(value) if value > 0.0 && ours > 0.0 => {
                let advantage = if lower_is_better {
                    value / ours
                } else {
                    ours / value
                };
                (format!("{value:.1}"), format!("{advantage:.2}×"))
            }
            _ => ("-".to_owned(), "-".to_owned()),
        };
        println!(
            "| {name:<44} | {ours:>10.1} | {theirs_text:>10} | {advantage_text:>9} | {target:<20} |"
        );
    }

    fn theirs(&self, pick: impl Fn(&Figures) -> f64) -> Option<f64> {
        self.reference.map(pick)
    }

    fn speed_rows(&self, args: &BenchArgs, worker: &Figures) {
        self.row("load s", worker.load_s, self.theirs(|f| f.load_s), true, "");
        self.row(
            &format!("prefill tok/s ({}-token prompt)", args.prompt_tokens),
            worker.prefill_tok_s,
            self.theirs(|f| f.prefill_tok_s),
            false,
            "≥ 2× llama.cpp",
        );
        self.row(
            &format!("TTFT ms ({}-token prompt)", args.prompt_tokens),
            worker.ttft_ms,
            self.theirs(|f| f.ttft_ms),
            true,
            "",
        );
        self.row(
            "decode tok/s, batch 1",
            worker.decode_tok_s,
            self.theirs(|f| f.decode_tok_s),
            false,
            "≥ 1× llama.cpp",
        );
        for n in &args.batch_sizes {
            let key = n.to_string();
            self.row(
                &format!("aggregate decode tok/s, {n} sequences"),
                worker.aggregate_tok_s.get(&key).copied().unwrap_or(0.0),
                self.reference
                    .and_then(|f| f.aggregate_tok_s.get(&key).copied()),
                false,
                "",
            );
        }
        if let Some(at_32) = worker.aggregate_tok_s.get("32") {
            let scaling =
                |f: &Figures| f.aggregate_tok_s.get("32").copied().unwrap_or(0.0) / f.decode_tok_s;
            self.row(
                "aggregate at 32 ÷ own batch 1",
                at_32 / worker.decode_tok_s,
                self.theirs(scaling),
                false,
                "≥ 4",
            );
        }
    }

    fn memory_rows(&self, worker: &Figures) {
        // Compared where both engines ran the same sequences: the reference's largest run.
        let compared = self
            .reference
            .and_then(|f| {
                f.aggregate_tok_s
                    .keys()
                    .filter_map(|n| n.parse::<usize>().ok())
                    .max()
            })
            .and_then(|n| Some((n, *worker.peak_rss_bytes_by_sequences.get(&n.to_string())?)));
        let Some((n, ours)) = compared else {
            self.row(
                "peak RSS MiB (VmHWM)",
                mib(worker.peak_rss_bytes),
                self.theirs(|f| mib(f.peak_rss_bytes)),
                true,
                "",
            );
            return;
        };
        self.row(
            &format!("peak RSS MiB (VmHWM), up to {n} sequences"),
            mib(ours),
            self.theirs(|f| mib(f.peak_rss_bytes)),
            true,
            "≤ 1.5× llama.cpp",
        );
        self.row(
            "peak RSS MiB (VmHWM), every run",
            mib(worker.peak_rss_bytes),
            None,
            true,
            "",
        );
    }
}

fn print_roofline(
    args: &BenchArgs,
    worker: &Figures,
    reference: Option<&Figures>,
    bandwidth: f64,
    decode_bytes: u64,
) {
    println!(
        "memory bandwidth (vectorised read of 1 GiB, {} threads): {:.2} GB/s",
        args.threads,
        bandwidth / 1e9
    );
    // A decode step reads every layer's matrices and the output head once, in the storage
    // decode uses (a quantised file's own blocks); the embedding table gives one row.
    let roofline = bandwidth / decode_bytes as f64;
    println!(
        "decode roofline at batch 1: {roofline:.1} tok/s ({:.1} MiB of weights read per token); npufleet reaches {:.0}%{}",
        mib(decode_bytes),
        100.0 * worker.decode_tok_s / roofline,
        reference
            .map(|f| format!(", llama.cpp {:.0}%", 100.0 * f.decode_tok_s / roofline))
            .unwrap_or_default()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectorised_sum_matches_a_plain_sum() {
        let words: Vec<u64> = (0..1003u64).map(|i| i * 3 + 1).collect();
        let plain = words.iter().copied().fold(0u64, u64::wrapping_add);
        assert_eq!(sum_words(&words), plain);
        assert_eq!(sum_words(&words[..5]), words[..5].iter().sum::<u64>());
    }

    #[test]
    fn steady_rate_counts_only_the_fully_concurrent_window() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // Request a starts at 0 ms, b at 100 ms; a ends at 1000 ms, b at 1100 ms. Each
        // emits one token per 100 ms; between 100 and 1000 ms there are 9 + 9 tokens.
        let a: Vec<Instant> = (0..=10).map(|i| at(i * 100)).collect();
        let b: Vec<Instant> = (1..=11).map(|i| at(i * 100)).collect();
        let rate = steady_rate(&[a, b]);
        assert!((rate - 20.0).abs() < 0.5, "{rate}");
    }
}

//! `npufleet-worker bench`: the engine's prefill, decode and batched-decode throughput on
//! this machine, side by side with llama.cpp on the same file, prompts and thread count.
//!
//! Every figure goes through the real engine (engine core, sampling, streaming), not just the
//! forward pass. Decode figures count only steps where every sequence decodes: for N
//! concurrent requests the window runs from the last request's first token to the first
//! request's last token.
//!
//! The two engines run side by side, both loaded, and each figure's runs alternate between
//! them (npufleet, llama.cpp, npufleet, …): a shared machine's slow spells then fall on both
//! rather than on whichever engine happened to run during them. Both get the same prompts,
//! the same warm-up and the same token counts, and the table prints every figure's median
//! with its spread (the slowest and fastest run).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};
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
    /// Also measure this engine on the same file, interleaved run by run, and print the
    /// ratios. If it fails, so does the command.
    #[arg(long, value_enum)]
    pub reference: Option<Reference>,
    /// A Python with llama-cpp-python installed
    /// (`tests/setup/python-env.sh tests/setup/requirements-bench.txt` prints one).
    #[arg(long, env = "NPUFLEET_BENCH_PYTHON", default_value = "python3")]
    pub python: PathBuf,
    /// The reference's side of the benchmark.
    #[arg(long, default_value = DEFAULT_REFERENCE_SCRIPT)]
    pub reference_script: PathBuf,
    /// Prompt lengths for the prefill and time-to-first-token figures, one figure each; the
    /// shortest is also both engines' untimed warm-up prompt.
    #[arg(long, value_delimiter = ',', default_values_t = [500])]
    pub prompt_tokens: Vec<usize>,
    /// Prompt length of each request in the decode figures.
    #[arg(long, default_value_t = 16)]
    pub short_prompt_tokens: usize,
    /// Decode steps timed per request in the decode figures.
    #[arg(long, default_value_t = 64)]
    pub decode_tokens: usize,
    /// Concurrent sequences for the aggregate decode figures.
    #[arg(long, value_delimiter = ',', default_values_t = [8, 32, 128])]
    pub batch_sizes: Vec<usize>,
    /// Timed runs of each figure per engine (the median is reported, with the spread).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// The engine's per-step token budget.
    #[arg(long, default_value_t = 512)]
    pub max_num_batched_tokens: usize,
}

/// Repeated measurements of one figure (also the serving benchmark's,
/// `tests/tests/serve_bench.rs`).
#[derive(Debug, Clone, Default)]
pub struct Samples(Vec<f64>);

impl Samples {
    pub fn push(&mut self, value: f64) {
        self.0.push(value);
    }

    fn sorted(&self) -> Vec<f64> {
        let mut values = self.0.clone();
        values.sort_by(f64::total_cmp);
        values
    }

    /// The median: a shared machine's bursts of contention move a single short run by tens
    /// of percent. Even counts take the upper middle value.
    pub fn median(&self) -> f64 {
        let values = self.sorted();
        values.get(values.len() / 2).copied().unwrap_or(0.0)
    }

    /// The slowest and the fastest run.
    pub fn spread(&self) -> (f64, f64) {
        let values = self.sorted();
        (
            values.first().copied().unwrap_or(0.0),
            values.last().copied().unwrap_or(0.0),
        )
    }

    fn map(&self, f: impl Fn(f64) -> f64) -> Samples {
        Samples(self.0.iter().map(|&v| f(v)).collect())
    }
}

/// One engine's figures.
#[derive(Debug, Clone, Default)]
struct Figures {
    /// Seconds from opening the file to an engine ready to take requests.
    load_s: f64,
    /// Seconds from opening the file to the first token of the first (short) prompt: the
    /// whole start-up, whatever either engine defers to its first request.
    first_token_s: f64,
    /// Prompt length → time to first token, in seconds.
    ttft_s: BTreeMap<usize, Samples>,
    decode_tok_s: Samples,
    /// Concurrent sequences → aggregate decode tok/s.
    aggregate_tok_s: BTreeMap<usize, Samples>,
    /// Concurrent sequences the engine refused to hold → what was tried and its answer.
    rejected: BTreeMap<usize, String>,
    peak_rss_bytes: u64,
    /// Concurrent sequences → peak RSS once the runs up to that many had finished (this
    /// engine's cache is sized for the largest run up front but only touched pages count).
    peak_rss_bytes_by_sequences: BTreeMap<usize, u64>,
}

/// What the reference says about itself at load.
#[derive(Debug, Clone, Deserialize)]
struct ReferenceLoad {
    version: String,
    system_info: String,
    buffers: Vec<String>,
    load_s: f64,
    first_token_s: f64,
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    check_args(&args)?;
    let load_average_before = load_average();
    let file_bytes = read_through(&args.model)?;

    eprintln!("loading {} ...", args.model.display());
    let started = Instant::now();
    let model = Model::load(
        &args.model,
        LoadOptions {
            policy: args.precision.policy(),
            threads: args.threads,
            collective: None,
            backend: None,
        },
    )?;
    let model_load = started.elapsed();
    let resident_weight_bytes = model.weight_bytes();
    let decode_bytes = model.decode_weight_bytes() as u64;
    let backend = model.backend_name();
    // Tokenising the benchmark's text is the benchmark's work, not the engine's start-up.
    let prompts = Prompts::new(&model, &args)?;

    let cache = CacheSizing::for_runs(&args);
    let config = cache.engine_config(&args);
    let kv_bytes = engine::kv_block_bytes(&model, &config) * cache.blocks;
    let engine_started = Instant::now();
    let engine = engine::start(model, config)?;
    wait_ready(&engine)?;
    let load_time = model_load + engine_started.elapsed();
    let first_request = Instant::now();
    finish(&engine, Prompt::Tokens(prompts.short[0].clone()), 1)?;
    let mut worker = Figures {
        load_s: load_time.as_secs_f64(),
        first_token_s: (load_time + first_request.elapsed()).as_secs_f64(),
        ..Figures::default()
    };

    let mut reference = match args.reference {
        Some(Reference::LlamaCpp) => Some(start_llama_cpp(&args, &prompts)?),
        None => None,
    };
    let mut theirs = reference.as_ref().map(|r| Figures {
        load_s: r.load.load_s,
        first_token_s: r.load.first_token_s,
        ..Figures::default()
    });
    measure(
        &engine,
        &args,
        &prompts,
        &mut worker,
        reference.as_mut().zip(theirs.as_mut()),
    )?;
    let load = engine.load();
    drop(engine);
    worker.peak_rss_bytes = peak_rss_bytes()?;
    let reference_load = match reference {
        Some(process) => Some(process.finish()?),
        None => None,
    };

    // Measured after the peak RSS was read: the probe's buffer would dominate it.
    eprintln!("measuring memory bandwidth ...");
    let bandwidth = memory_bandwidth(args.threads)?;

    println!(
        "model {} ({:.1} MiB file, {:.1} MiB resident weights, policy {}), {} threads, backend {backend}",
        args.model.display(),
        mib(file_bytes),
        mib(resident_weight_bytes as u64),
        args.precision.precision,
        args.threads,
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
    if let Some(info) = &reference_load {
        print_reference_info(info);
    }
    // Other work on the machine moves every figure, and an OpenMP build of the reference far
    // more than a rayon one: its threads spin at barriers for cores that are not free.
    println!(
        "load average (1, 5, 15 min) before the run: {load_average_before}; after: {}",
        load_average()
    );
    print_table(&args, &worker, theirs.as_ref());
    print_roofline(&args, &worker, theirs.as_ref(), bandwidth, decode_bytes);
    Ok(())
}

fn check_args(args: &BenchArgs) -> anyhow::Result<()> {
    if args.prompt_tokens.is_empty()
        || args.prompt_tokens.contains(&0)
        || args.short_prompt_tokens == 0
        || args.decode_tokens < 2
    {
        bail!("prompt lengths must be positive and --decode-tokens at least 2");
    }
    if args.repeats == 0 || args.batch_sizes.is_empty() || args.batch_sizes.contains(&0) {
        bail!("--repeats and every batch size must be at least 1");
    }
    Ok(())
}

/// The kernel's load averages, as /proc/loadavg gives them.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|text| {
            text.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|err| format!("unknown ({err})"))
}

/// Reads the whole file once so both engines load it from the page cache (whichever loads
/// first would otherwise pay for the disk). Returns its length.
fn read_through(path: &Path) -> anyhow::Result<u64> {
    let mut file =
        std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut buffer = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let read = file
            .read(&mut buffer)
            .with_context(|| format!("reading {}", path.display()))?;
        if read == 0 {
            return Ok(total);
        }
        total += read as u64;
    }
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
        let per_sequence = args.short_prompt_tokens + args.decode_tokens + 1 + block_size;
        let longest_prompt = args.prompt_tokens.iter().copied().max().unwrap_or(0);
        let kv_tokens = (max_batch * per_sequence).max(longest_prompt + block_size);
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
            // The warm-up is the benchmark's prompt, the same one the reference gets.
            warmup_iterations: 0,
            ignore_eos: true,
            ..EngineConfig::default()
        }
    }
}

/// Every speed figure, each run of ours followed by one of the reference's when there is
/// one.
fn measure(
    engine: &Arc<EngineHandle>,
    args: &BenchArgs,
    prompts: &Prompts,
    ours: &mut Figures,
    mut reference: Option<(&mut LlamaCpp, &mut Figures)>,
) -> anyhow::Result<()> {
    eprintln!("warm-up ({}-token prompt each) ...", prompts.warmup.len());
    // The first long prompt pages in the prefill path's weights; it is not timed.
    finish(engine, Prompt::Tokens(prompts.warmup.clone()), 1)?;
    if let Some((process, _)) = reference.as_mut() {
        process.call(serde_json::json!({"op": "warmup", "prompt": prompts.warmup}))?;
    }

    for (&len, runs) in &prompts.prefill {
        eprintln!("prefill, {len}-token prompts ...");
        for prompt in runs {
            let timings = finish(engine, Prompt::Tokens(prompt.clone()), 1)?;
            push(&mut ours.ttft_s, len, timings.first_token.as_secs_f64());
            if let Some((process, theirs)) = reference.as_mut() {
                let s = process.call_f64(serde_json::json!({"op": "ttft", "prompt": prompt}))?;
                push(&mut theirs.ttft_s, len, s);
            }
        }
    }

    eprintln!("decode at batch 1 ...");
    for _ in 0..args.repeats {
        // One more token than steps: the first comes from the prompt's prefill.
        let times = run_concurrent(engine, &prompts.short[..1], args.decode_tokens + 1)?;
        let tokens = &times[0];
        let span = tokens[tokens.len() - 1].duration_since(tokens[0]);
        ours.decode_tok_s
            .push((tokens.len() - 1) as f64 / span.as_secs_f64());
        if let Some((process, theirs)) = reference.as_mut() {
            let rate = process.call_f64(serde_json::json!({
                "op": "decode", "prompt": prompts.short[0], "tokens": args.decode_tokens,
            }))?;
            theirs.decode_tok_s.push(rate);
        }
    }

    let mut batch_sizes = args.batch_sizes.clone();
    batch_sizes.sort_unstable();
    batch_sizes.dedup();
    for n in batch_sizes {
        eprintln!("aggregate decode with {n} sequences ...");
        let batch = &prompts.short[..n];
        let mut held = false;
        if let Some((process, theirs)) = reference.as_mut() {
            let per_sequence = args.short_prompt_tokens + args.decode_tokens + 1;
            let opened = process.call(serde_json::json!({
                "op": "open", "sequences": n, "context": n * per_sequence,
            }))?;
            match opened.get("rejected").and_then(|r| r.as_str()) {
                Some(reason) => {
                    theirs.rejected.insert(n, reason.to_owned());
                }
                None => held = true,
            }
        }
        for _ in 0..args.repeats {
            let times = run_concurrent(engine, batch, args.decode_tokens + 1)?;
            push(&mut ours.aggregate_tok_s, n, steady_rate(&times));
            if let Some((process, theirs)) = reference.as_mut().filter(|_| held) {
                let rate = process.call_f64(serde_json::json!({
                    "op": "aggregate", "prompts": batch, "tokens": args.decode_tokens,
                }))?;
                push(&mut theirs.aggregate_tok_s, n, rate);
            }
        }
        ours.peak_rss_bytes_by_sequences
            .insert(n, peak_rss_bytes()?);
    }
    if let Some((process, theirs)) = reference {
        theirs.peak_rss_bytes = process
            .call(serde_json::json!({"op": "rss"}))?
            .as_u64()
            .context("the reference's peak RSS is not a byte count")?;
    }
    Ok(())
}

fn push(figure: &mut BTreeMap<usize, Samples>, key: usize, value: f64) {
    figure.entry(key).or_default().push(value);
}

/// The llama.cpp side, a Python process answering one request a line.
struct LlamaCpp {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// Everything the process wrote to stderr, for the error when it fails.
    stderr: Arc<Mutex<String>>,
    load: ReferenceLoad,
}

fn start_llama_cpp(args: &BenchArgs, prompts: &Prompts) -> anyhow::Result<LlamaCpp> {
    eprintln!(
        "llama.cpp: starting {} ...",
        args.reference_script.display()
    );
    let mut child = Command::new(&args.python)
        .arg(&args.reference_script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {}", args.python.display()))?;
    let (Some(stdin), Some(stdout), Some(mut stderr_pipe)) =
        (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        bail!("the reference's pipes were not set up");
    };
    let stderr = Arc::new(Mutex::new(String::new()));
    let collected = Arc::clone(&stderr);
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr_pipe.read_to_string(&mut text);
        collected
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push_str(&text);
    });
    let mut process = LlamaCpp {
        child,
        stdin,
        stdout: BufReader::new(stdout),
        stderr,
        load: ReferenceLoad {
            version: String::new(),
            system_info: String::new(),
            buffers: Vec::new(),
            load_s: 0.0,
            first_token_s: 0.0,
        },
    };
    let longest = args.prompt_tokens.iter().copied().max().unwrap_or(0);
    let loaded = process.call(serde_json::json!({
        "op": "load",
        "model": args.model,
        "threads": args.threads,
        "first_prompt": prompts.short[0],
        "context": (longest + 16).max(1024),
    }))?;
    process.load = serde_json::from_value(loaded).context("parsing the reference's load report")?;
    Ok(process)
}

impl LlamaCpp {
    /// Sends one request and returns its reply's value; a failed request, a malformed reply
    /// or an exited process is an error naming what the process said.
    fn call(&mut self, request: serde_json::Value) -> anyhow::Result<serde_json::Value> {
        let op = request["op"].as_str().unwrap_or("?").to_owned();
        let reply = self.exchange(&request);
        let reply = match reply {
            Ok(reply) => reply,
            Err(err) => {
                // The process may still be writing its traceback: wait for it to exit.
                let _ = self.child.wait();
                let stderr = self
                    .stderr
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .clone();
                bail!("llama.cpp reference failed at {op}: {err:#}\n{stderr}");
            }
        };
        match reply {
            Reply::Ok(value) => Ok(value),
            Reply::Error(message) => bail!("llama.cpp reference failed: {message}"),
        }
    }

    fn call_f64(&mut self, request: serde_json::Value) -> anyhow::Result<f64> {
        let value = self.call(request)?;
        value
            .as_f64()
            .with_context(|| format!("the reference answered {value} where a number was due"))
    }

    fn exchange(&mut self, request: &serde_json::Value) -> anyhow::Result<Reply> {
        writeln!(self.stdin, "{request}").context("writing to the reference")?;
        self.stdin.flush().context("writing to the reference")?;
        let mut line = String::new();
        if self
            .stdout
            .read_line(&mut line)
            .context("reading the reference's reply")?
            == 0
        {
            bail!("the reference exited");
        }
        serde_json::from_str(&line)
            .with_context(|| format!("parsing the reference's reply {line:?}"))
    }

    /// Closes the reference's input, so it exits, and checks that it exited cleanly.
    fn finish(self) -> anyhow::Result<ReferenceLoad> {
        let LlamaCpp {
            mut child,
            stdin,
            stderr,
            load,
            ..
        } = self;
        drop(stdin);
        let status = child.wait().context("waiting for the reference")?;
        if !status.success() {
            let stderr = stderr
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .clone();
            bail!("the llama.cpp reference exited with {status}:\n{stderr}");
        }
        Ok(load)
    }
}

#[derive(Deserialize)]
enum Reply {
    #[serde(rename = "ok")]
    Ok(serde_json::Value),
    #[serde(rename = "error")]
    Error(String),
}

/// Sentence `i` of the benchmarks' prompt text: varied enough in numbers and words that
/// windows cut from it at different offsets share no leading block. The serving benchmark
/// (`tests/tests/serve_bench.rs`) cuts its prompts from the same text.
pub fn benchmark_sentence(i: usize) -> String {
    const SUBJECTS: [&str; 6] = [
        "river",
        "mountain",
        "library",
        "harbour",
        "orchard",
        "observatory",
    ];
    const VERBS: [&str; 6] = [
        "crossed",
        "described",
        "measured",
        "painted",
        "visited",
        "mapped",
    ];
    format!(
        "In year {}, traveller {} {} the {} near town {}. ",
        1700 + i,
        i * 7 % 101,
        VERBS[i % VERBS.len()],
        SUBJECTS[i * 5 % SUBJECTS.len()],
        i * 13 % 97
    )
}

/// Token ids shared by both engines, cut from one long text at different offsets so no two
/// prompts share a first block (nothing is served from the prefix cache).
struct Prompts {
    warmup: Vec<u32>,
    /// Prompt length → one prompt per run.
    prefill: BTreeMap<usize, Vec<Vec<u32>>>,
    short: Vec<Vec<u32>>,
}

impl Prompts {
    fn new(model: &Model, args: &BenchArgs) -> anyhow::Result<Self> {
        let max_batch = args.batch_sizes.iter().copied().max().unwrap_or(1);
        let longest = args.prompt_tokens.iter().copied().max().unwrap_or(0);
        let shortest = args.prompt_tokens.iter().copied().min().unwrap_or(0);
        let mut text = String::new();
        let mut tokens = Vec::new();
        let needed = longest + (args.repeats + 1) * 17 + max_batch * 7 + 64;
        let mut sentence = 0usize;
        while tokens.len() < needed + args.short_prompt_tokens {
            for _ in 0..64 {
                text.push_str(&benchmark_sentence(sentence));
                sentence += 1;
            }
            tokens = model.tokenizer().encode(&text);
        }
        let window = |offset: usize, len: usize| tokens[offset..offset + len].to_vec();
        let prefill_offset = |r: usize| (r + 1) * 17;
        let short_base = prefill_offset(args.repeats + 1) + longest;
        Ok(Self {
            warmup: window(0, shortest),
            prefill: args
                .prompt_tokens
                .iter()
                .map(|&len| {
                    let runs = (0..args.repeats)
                        .map(|r| window(prefill_offset(r), len))
                        .collect();
                    (len, runs)
                })
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
        priority: 0,
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

fn print_reference_info(info: &ReferenceLoad) {
    println!(
        "reference: llama-cpp-python {} (llama.cpp built into it), system info: {}",
        info.version, info.system_info
    );
    for line in &info.buffers {
        println!("reference buffers: {line}");
    }
}

fn print_table(args: &BenchArgs, worker: &Figures, reference: Option<&Figures>) {
    let reference_name = match args.reference {
        Some(Reference::LlamaCpp) => "llama.cpp",
        None => "-",
    };
    let table = Table { reference };
    table.header(reference_name);
    table.speed_rows(worker);
    table.memory_rows(worker);
    println!();
    println!(
        "Each figure: median of {} runs per engine, the engines' runs alternating; spread is the slowest and fastest run. \
         Decode figures time {} steps per sequence on both sides; both engines were warmed with the same {}-token prompt.",
        args.repeats,
        args.decode_tokens,
        args.prompt_tokens.iter().min().copied().unwrap_or(0),
    );
    println!(
        "load: the file was read into the page cache first; npufleet's covers reading and repacking the weights and starting the engine, \
         llama.cpp's mapping the file and making its context. First token adds the first {}-token prompt to each, \
         so whatever either engine defers to its first request is counted.",
        args.short_prompt_tokens
    );
    for (n, reason) in reference.map(|f| &f.rejected).into_iter().flatten() {
        println!(
            "{reference_name} at {n} sequences: not measured, it refused to hold them ({reason})"
        );
    }
    println!();
}

/// The comparison table: one row a figure, the reference's beside ours when it ran.
struct Table<'a> {
    reference: Option<&'a Figures>,
}

/// How a row's figure compares.
#[derive(Clone, Copy, PartialEq)]
enum Better {
    Higher,
    Lower,
}

impl Table<'_> {
    fn header(&self, reference_name: &str) {
        println!();
        // The advantage column is above 1 where npufleet does better: ours ÷ theirs for
        // throughput, theirs ÷ ours for latency and memory (medians).
        println!(
            "| {:<42} | {:>9} | {:<17} | {:>9} | {:<17} | {:>9} | {:<16} |",
            "metric", "npufleet", "spread", reference_name, "spread", "advantage", "target"
        );
        println!(
            "|{:-<44}|{:->11}|{:-<19}|{:->11}|{:-<19}|{:->11}|{:-<18}|",
            "", "", "", "", "", "", ""
        );
    }

    fn row(&self, name: &str, ours: &Samples, theirs: Theirs<'_>, better: Better, target: &str) {
        let spread = |s: &Samples| {
            if s.0.len() < 2 {
                return String::new();
            }
            let (lo, hi) = s.spread();
            format!("{lo:.1}–{hi:.1}")
        };
        let ours_median = ours.median();
        let (theirs_text, theirs_spread, advantage_text) = match theirs {
            Theirs::Measured(s) if s.median() > 0.0 && ours_median > 0.0 => {
                let value = s.median();
                let advantage = match better {
                    Better::Higher => ours_median / value,
                    Better::Lower => value / ours_median,
                };
                (format!("{value:.1}"), spread(s), format!("{advantage:.2}×"))
            }
            Theirs::Refused => ("refused".to_owned(), "see below".to_owned(), "-".to_owned()),
            _ => ("-".to_owned(), String::new(), "-".to_owned()),
        };
        println!(
            "| {name:<42} | {ours_median:>9.1} | {:<17} | {theirs_text:>9} | {theirs_spread:<17} | {advantage_text:>9} | {target:<16} |",
            spread(ours)
        );
    }

    fn theirs(&self, pick: impl Fn(&Figures) -> Samples) -> Option<Samples> {
        self.reference.map(pick)
    }

    fn speed_rows(&self, worker: &Figures) {
        let one = |v: f64| Samples(vec![v]);
        let theirs = self.theirs(|f| one(f.load_s));
        self.row(
            "load s (file → ready)",
            &one(worker.load_s),
            measured(&theirs),
            Better::Lower,
            "",
        );
        let theirs = self.theirs(|f| one(f.first_token_s));
        self.row(
            "first token s (file → first short prompt)",
            &one(worker.first_token_s),
            measured(&theirs),
            Better::Lower,
            "",
        );
        for (&len, ttft) in &worker.ttft_s {
            let rate = |s: &Samples| s.map(|t| len as f64 / t);
            let theirs = self.theirs(|f| f.ttft_s.get(&len).map(rate).unwrap_or_default());
            self.row(
                &format!("prefill tok/s ({len}-token prompt)"),
                &rate(ttft),
                measured(&theirs),
                Better::Higher,
                "≥ 2× llama.cpp",
            );
            let ms = |s: &Samples| s.map(|t| t * 1000.0);
            let theirs = self.theirs(|f| f.ttft_s.get(&len).map(ms).unwrap_or_default());
            self.row(
                &format!("TTFT ms ({len}-token prompt)"),
                &ms(ttft),
                measured(&theirs),
                Better::Lower,
                "",
            );
        }
        let theirs = self.theirs(|f| f.decode_tok_s.clone());
        self.row(
            "decode tok/s, batch 1",
            &worker.decode_tok_s,
            measured(&theirs),
            Better::Higher,
            "≥ 1.1× llama.cpp",
        );
        for (&n, ours) in &worker.aggregate_tok_s {
            let theirs = self.theirs(|f| f.aggregate_tok_s.get(&n).cloned().unwrap_or_default());
            let refused = self.reference.is_some_and(|f| f.rejected.contains_key(&n));
            self.row(
                &format!("aggregate decode tok/s, {n} sequences"),
                ours,
                if refused {
                    Theirs::Refused
                } else {
                    measured(&theirs)
                },
                Better::Higher,
                if n == 32 { "≥ 1.5× llama.cpp" } else { "" },
            );
        }
        if let Some(at_32) = worker.aggregate_tok_s.get(&32) {
            let scaling = |f: &Figures| {
                let at_32 = f.aggregate_tok_s.get(&32).map_or(0.0, Samples::median);
                one(at_32 / f.decode_tok_s.median())
            };
            let theirs = self.theirs(scaling);
            self.row(
                "aggregate at 32 ÷ own batch 1 (medians)",
                &one(at_32.median() / worker.decode_tok_s.median()),
                measured(&theirs),
                Better::Higher,
                "≥ 4",
            );
        }
    }

    fn memory_rows(&self, worker: &Figures) {
        let one = |bytes: u64| Samples(vec![mib(bytes)]);
        let theirs = self.theirs(|f| one(f.peak_rss_bytes));
        let theirs = measured(&theirs);
        // Compared where both engines ran the same sequences: the reference's largest run.
        let compared = self
            .reference
            .and_then(|f| f.aggregate_tok_s.keys().max().copied())
            .and_then(|n| Some((n, *worker.peak_rss_bytes_by_sequences.get(&n)?)));
        let Some((n, ours)) = compared else {
            self.row(
                "peak RSS MiB (VmHWM)",
                &one(worker.peak_rss_bytes),
                theirs,
                Better::Lower,
                "",
            );
            return;
        };
        self.row(
            &format!("peak RSS MiB (VmHWM), up to {n} sequences"),
            &one(ours),
            theirs,
            Better::Lower,
            "≤ 1× llama.cpp",
        );
        self.row(
            "peak RSS MiB (VmHWM), every run",
            &one(worker.peak_rss_bytes),
            Theirs::None,
            Better::Lower,
            "",
        );
    }
}

fn measured(samples: &Option<Samples>) -> Theirs<'_> {
    samples.as_ref().map_or(Theirs::None, Theirs::Measured)
}

/// The reference's side of a row.
#[derive(Clone, Copy)]
enum Theirs<'a> {
    None,
    Measured(&'a Samples),
    /// The reference could not hold the run (the reason is printed under the table).
    Refused,
}

/// The size of this CPU's last-level cache, from sysfs; `None` where it does not say.
fn last_level_cache_bytes() -> Option<u64> {
    let caches = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    caches
        .filter_map(|entry| {
            let dir = entry.ok()?.path();
            let level: u32 = std::fs::read_to_string(dir.join("level"))
                .ok()?
                .trim()
                .parse()
                .ok()?;
            let size = parse_cache_size(&std::fs::read_to_string(dir.join("size")).ok()?)?;
            Some((level, size))
        })
        .max()
        .map(|(_, size)| size)
}

/// sysfs cache sizes: "32768K", "2M", or plain bytes.
fn parse_cache_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((at, _)) => text.split_at(at),
        None => (text, ""),
    };
    let value: u64 = digits.parse().ok()?;
    match unit {
        "" => Some(value),
        "K" => Some(value << 10),
        "M" => Some(value << 20),
        "G" => Some(value << 30),
        _ => None,
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
        100.0 * worker.decode_tok_s.median() / roofline,
        reference
            .map(|f| format!(
                ", llama.cpp {:.0}%",
                100.0 * f.decode_tok_s.median() / roofline
            ))
            .unwrap_or_default()
    );
    match last_level_cache_bytes() {
        Some(llc) if decode_bytes <= llc => println!(
            "the weights read per token fit in the {:.0} MiB last-level cache: they are served from cache, not DRAM, \
             so this is not a DRAM roofline and either engine may pass it",
            mib(llc)
        ),
        Some(llc) if decode_bytes <= 4 * llc => println!(
            "the weights read per token are within 4× the {:.0} MiB last-level cache: part of each step may be served \
             from cache, so the DRAM roofline is approximate",
            mib(llc)
        ),
        Some(llc) => println!("last-level cache {:.0} MiB: a DRAM-bound decode", mib(llc)),
        None => println!(
            "last-level cache size unknown: the roofline assumes every byte comes from DRAM"
        ),
    }
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

    #[test]
    fn samples_report_the_median_and_the_extremes() {
        let samples = Samples(vec![3.0, 1.0, 9.0, 2.0, 5.0]);
        assert_eq!(samples.median(), 3.0);
        assert_eq!(samples.spread(), (1.0, 9.0));
        assert_eq!(samples.map(|v| v * 2.0).median(), 6.0);
    }

    #[test]
    fn cache_sizes_parse_in_sysfs_units() {
        assert_eq!(parse_cache_size("32768K\n"), Some(32 << 20));
        assert_eq!(parse_cache_size("2M"), Some(2 << 20));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size("12Q"), None);
    }
}

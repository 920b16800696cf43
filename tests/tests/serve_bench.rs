//! The worker through `serve` against llama.cpp's own C++ `llama-server` on the same GGUF file
//! (`make bench-serve`; minutes, so not in `make test`, which runs one short round of it so
//! the harness keeps working): what a client of the OpenAI API sees of the engine speeds
//! `npufleet-worker bench` measures in process.
//!
//! Both servers run at once on loopback with the same thread count, one sequence at a time,
//! and get the same token ids (cut from one text that llama-server's own tokenizer split, so
//! the two prompts of a figure are identical). Each round times, on both servers in turn (the
//! order alternating round by round, so a slow spell of the machine falls on both): the time
//! to the first streamed token of a long prompt that no earlier request shares a first block
//! with, and the rate one stream decodes at from its first token to its last. The table gives
//! medians with the spread, and the ratios.
//!
//! `NPUFLEET_BENCH_MODEL` names another GGUF file (the 7B shape of `make bench-7b-shape`),
//! `NPUFLEET_BENCH_PROMPT_TOKENS` the long prompt's length (default 500),
//! `NPUFLEET_BENCH_DECODE_TOKENS` the decoded tokens timed per stream (default 128) and
//! `NPUFLEET_BENCH_ROUNDS` the rounds (default 11).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use futures::StreamExt;
use npufleet_tests::fleet::sse_data;
use npufleet_tests::net::free_port;
use npufleet_tests::process::{Process, ScratchDir};
use npufleet_tests::{paths, wait};
use npufleet_worker::tools::bench::{Samples, benchmark_sentence};
use serde_json::{Value, json};

const THREADS: usize = 2;
/// The decode figure's prompt: short, so the stream's time is the decode's.
const SHORT_PROMPT_TOKENS: usize = 16;

fn setting(name: &str, default: usize) -> Result<usize> {
    match std::env::var(name) {
        Ok(value) => value
            .parse()
            .with_context(|| format!("{name}={value:?} is not a count")),
        Err(_) => Ok(default),
    }
}

/// One server under test.
struct Server {
    name: &'static str,
    base: String,
    process: Process,
}

impl Server {
    /// Starts `command`, which serves HTTP on loopback `port`, logging to the scratch dir.
    fn start(
        name: &'static str,
        command: Command,
        port: u16,
        scratch: &ScratchDir,
    ) -> Result<Self> {
        let log = scratch.path().join(format!("{name}.log"));
        Ok(Server {
            name,
            base: format!("http://127.0.0.1:{port}"),
            process: Process::start(name, command, &log)?,
        })
    }

    async fn wait_ready(&mut self, http: &reqwest::Client) -> Result<()> {
        let url = format!("{}/health", self.base);
        let name = self.name;
        let process = &mut self.process;
        wait::until(
            &format!("{name} to answer /health"),
            Duration::from_secs(600),
            || {
                let exited = process.try_wait();
                let log = process.log_tail(20);
                let request = http.get(&url).send();
                async move {
                    if let Some(status) = exited {
                        return Err(wait::fatal(anyhow::anyhow!(
                            "{name} exited with {status}:\n{log}"
                        )));
                    }
                    Ok(request
                        .await
                        .ok()
                        .filter(|r| r.status().is_success())
                        .map(|_| ()))
                }
            },
        )
        .await
    }

    /// Streams a completion of `prompt` (token ids) and returns when each piece of generated
    /// text arrived.
    async fn stream(
        &self,
        http: &reqwest::Client,
        prompt: &[u32],
        max_tokens: usize,
    ) -> Result<Vec<Instant>> {
        let body = json!({
            "model": "bench",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": true,
            "stream": true,
        });
        let response = http
            .post(format!("{}/v1/completions", self.base))
            .json(&body)
            .send()
            .await?;
        let status = response.status();
        ensure!(
            status.is_success(),
            "{}: HTTP {status}: {}",
            self.name,
            response.text().await?
        );
        let mut bytes = response.bytes_stream();
        let mut pending = String::new();
        let mut arrivals = Vec::new();
        while let Some(chunk) = bytes.next().await {
            pending.push_str(&String::from_utf8_lossy(&chunk?));
            let at = Instant::now();
            // Only whole events: a read may end inside one.
            let Some(end) = pending.rfind("\n\n") else {
                continue;
            };
            for data in sse_data(&pending[..end + 2]) {
                if data == "[DONE]" {
                    continue;
                }
                let event: Value = serde_json::from_str(data)
                    .with_context(|| format!("{}: an event that is not JSON: {data}", self.name))?;
                if event.get("error").is_some() {
                    bail!("{}: the stream failed: {event}", self.name);
                }
                let text = event["choices"][0]["text"].as_str().unwrap_or_default();
                if !text.is_empty() {
                    arrivals.push(at);
                }
            }
            pending.drain(..end + 2);
        }
        ensure!(!arrivals.is_empty(), "{}: no generated text", self.name);
        Ok(arrivals)
    }
}

#[derive(Default)]
struct Figures {
    ttft_ms: Samples,
    decode_tok_s: Samples,
}

fn start_worker(model: &Path, scratch: &ScratchDir) -> Result<Server> {
    let http_port = free_port()?;
    let mut command = Command::new(paths::workspace_bin("npufleet-worker")?);
    command
        .arg("serve")
        .arg("--model")
        .arg(model)
        .args(["--served-model-name", "bench"])
        .args(["--threads", &THREADS.to_string()])
        .args(["--http-addr", &format!("127.0.0.1:{http_port}")])
        .args(["--grpc-addr", &format!("127.0.0.1:{}", free_port()?)]);
    Server::start("npufleet", command, http_port, scratch)
}

fn start_llama_server(model: &Path, scratch: &ScratchDir, context: usize) -> Result<Server> {
    let port = free_port()?;
    let mut command = Command::new(paths::llama_server()?);
    command
        .arg("--model")
        .arg(model)
        .args(["--threads", &THREADS.to_string()])
        .args(["--threads-batch", &THREADS.to_string()])
        .args(["--parallel", "1"])
        .args(["--ctx-size", &context.to_string()])
        .args(["--host", "127.0.0.1", "--port", &port.to_string()]);
    Server::start("llama.cpp", command, port, scratch)
}

/// Token ids of a long text, split by llama-server's tokenizer: the same vocabulary the worker
/// reads from the file.
async fn corpus(http: &reqwest::Client, server: &Server, tokens: usize) -> Result<Vec<u32>> {
    let text: String = (0..tokens.div_ceil(8)).map(benchmark_sentence).collect();
    let answer: Value = http
        .post(format!("{}/tokenize", server.base))
        .json(&json!({"content": text}))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let ids: Vec<u32> = serde_json::from_value(answer["tokens"].clone())
        .with_context(|| format!("llama-server's /tokenize answered {answer}"))?;
    ensure!(
        ids.len() >= tokens,
        "the corpus has {} tokens, {tokens} were needed",
        ids.len()
    );
    Ok(ids)
}

/// One round of both figures on one server.
async fn round(
    http: &reqwest::Client,
    server: &Server,
    long_prompt: &[u32],
    short_prompt: &[u32],
    decode_tokens: usize,
    figures: &mut Figures,
) -> Result<()> {
    let started = Instant::now();
    let arrivals = server.stream(http, long_prompt, 1).await?;
    figures
        .ttft_ms
        .push(arrivals[0].duration_since(started).as_secs_f64() * 1000.0);
    // One more token than timed: the first comes from the prompt's prefill.
    let arrivals = server.stream(http, short_prompt, decode_tokens + 1).await?;
    ensure!(
        arrivals.len() > decode_tokens / 2,
        "{}: {} pieces of text for {} tokens",
        server.name,
        arrivals.len(),
        decode_tokens + 1
    );
    let span = arrivals[arrivals.len() - 1].duration_since(arrivals[0]);
    figures
        .decode_tok_s
        .push((arrivals.len() - 1) as f64 / span.as_secs_f64());
    Ok(())
}

/// What one benchmark run measures.
struct Run {
    model: PathBuf,
    prompt_tokens: usize,
    decode_tokens: usize,
    rounds: usize,
}

/// Both servers' figures (npufleet's, then llama.cpp's) over `run.rounds` rounds.
async fn measure(run: &Run) -> Result<[Figures; 2]> {
    let Run {
        ref model,
        prompt_tokens,
        decode_tokens,
        rounds,
    } = *run;
    ensure!(
        rounds > 0 && prompt_tokens > 0 && decode_tokens > 1,
        "nothing to measure"
    );

    let scratch = ScratchDir::new("serve-bench")?;
    // A connection per request: llama-server closes idle keep-alive connections after a few
    // seconds, and a request sent on one as it closes fails. A loopback connect costs both
    // servers the same.
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(600))
        .pool_max_idle_per_host(0)
        .build()?;
    let mut servers = [
        start_worker(model, &scratch)?,
        start_llama_server(model, &scratch, context(run))?,
    ];
    for server in &mut servers {
        server.wait_ready(&http).await?;
    }

    // Each round's long prompt starts at its own offset, so neither server's prefix cache
    // (llama-server's slot keeps its last prompt) holds its first block; the first window
    // starts the untimed warm-up.
    let stride = 17;
    let tokens = corpus(
        &http,
        &servers[1],
        prompt_tokens + stride * (rounds + 2) + SHORT_PROMPT_TOKENS,
    )
    .await?;
    let long = |r: usize| &tokens[r * stride..r * stride + prompt_tokens];
    let short = &tokens[tokens.len() - SHORT_PROMPT_TOKENS..];
    // The warm-up pages in every weight; a long prompt's pages are the same as a short one's.
    let warm_up = &long(0)[..prompt_tokens.min(64)];
    for server in &servers {
        server.stream(&http, warm_up, 1).await?;
        server.stream(&http, short, 8).await?;
    }

    let mut figures = [Figures::default(), Figures::default()];
    for r in 0..rounds {
        eprintln!("round {} of {rounds} ...", r + 1);
        let order = if r % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            round(
                &http,
                &servers[i],
                long(r + 1),
                short,
                decode_tokens,
                &mut figures[i],
            )
            .await
            .with_context(|| servers[i].process.log_tail(20))?;
        }
    }
    Ok(figures)
}

/// The context both servers hold: the long prompt, the decode and room to spare.
fn context(run: &Run) -> usize {
    run.prompt_tokens + run.decode_tokens + 64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark of minutes: make bench-serve"]
async fn serve_against_llama_server() -> Result<()> {
    let run = Run {
        model: match std::env::var_os("NPUFLEET_BENCH_MODEL") {
            Some(path) => PathBuf::from(path),
            None => paths::smollm2_gguf()?,
        },
        prompt_tokens: setting("NPUFLEET_BENCH_PROMPT_TOKENS", 500)?,
        decode_tokens: setting("NPUFLEET_BENCH_DECODE_TOKENS", 128)?,
        rounds: setting("NPUFLEET_BENCH_ROUNDS", 11)?,
    };
    let [ours, theirs] = &measure(&run).await?;
    let Run {
        ref model,
        prompt_tokens,
        decode_tokens,
        rounds,
    } = run;
    println!(
        "\nmodel {}, {THREADS} threads each, one stream at a time, {rounds} rounds alternating the servers' order",
        model.display()
    );
    println!(
        "llama-server: {} (built from the pinned llama-cpp-python source, native CPU flags), --parallel 1 --ctx-size {context}",
        paths::llama_server()?.display(),
        context = context(&run),
    );
    println!();
    row(
        "metric",
        "npufleet",
        "spread",
        "llama.cpp",
        "spread",
        "advantage",
    );
    row("-", "-", "-", "-", "-", "-");
    let ttft = theirs.ttft_ms.median() / ours.ttft_ms.median();
    figure_row(
        &format!("TTFT ms, {prompt_tokens}-token prompt"),
        &ours.ttft_ms,
        &theirs.ttft_ms,
        ttft,
    );
    let decode = ours.decode_tok_s.median() / theirs.decode_tok_s.median();
    figure_row(
        &format!("decode tok/s, one stream, {decode_tokens} tokens"),
        &ours.decode_tok_s,
        &theirs.decode_tok_s,
        decode,
    );
    println!(
        "\nadvantage: above 1 where npufleet does better (theirs ÷ ours for TTFT, ours ÷ theirs for decode)"
    );
    Ok(())
}

/// A markdown table row; a cell of "-" is a separator row's dashes.
fn row(
    metric: &str,
    ours: &str,
    our_spread: &str,
    theirs: &str,
    their_spread: &str,
    advantage: &str,
) {
    let cell = |text: &str, width: usize| {
        if text == "-" {
            "-".repeat(width)
        } else {
            format!(" {text:<0$} ", width - 2)
        }
    };
    println!(
        "|{}|{}|{}|{}|{}|{}|",
        cell(metric, 42),
        cell(ours, 11),
        cell(our_spread, 17),
        cell(theirs, 11),
        cell(their_spread, 17),
        cell(advantage, 11)
    );
}

fn figure_row(metric: &str, ours: &Samples, theirs: &Samples, advantage: f64) {
    let spread = |s: &Samples| {
        let (low, high) = s.spread();
        format!("{low:.1}–{high:.1}")
    };
    row(
        metric,
        &format!("{:.1}", ours.median()),
        &spread(ours),
        &format!("{:.1}", theirs.median()),
        &spread(theirs),
        &format!("{advantage:.2}×"),
    );
}

/// One short round of the benchmark on SmolLM2, so its harness (both servers, the shared token
/// ids, the streams it times) is exercised on every change: each server gives each figure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_round_of_the_serving_benchmark_measures_both_servers() -> Result<()> {
    let run = Run {
        model: paths::smollm2_gguf()?,
        prompt_tokens: 64,
        decode_tokens: 8,
        rounds: 1,
    };
    for (server, figures) in ["npufleet", "llama.cpp"].iter().zip(measure(&run).await?) {
        for (what, samples) in [
            ("TTFT", &figures.ttft_ms),
            ("decode", &figures.decode_tok_s),
        ] {
            let value = samples.median();
            ensure!(
                value.is_finite() && value > 0.0,
                "{server}'s {what} figure is {value}"
            );
        }
    }
    Ok(())
}

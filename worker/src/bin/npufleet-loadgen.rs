//! Load generator for an npufleet worker on this machine: N concurrent clients stream
//! generations for T seconds over gRPC (ModelStreamInfer) or HTTP (streaming OpenAI chat or
//! completions), then report throughput, time to first token and inter-token latency
//! percentiles, and errors by kind. It only talks to loopback addresses.

use std::collections::BTreeMap;
use std::net::ToSocketAddrs;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, ValueEnum};
use futures::StreamExt;
use npufleet_contract::proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
use npufleet_contract::proto::inference::infer_parameter::ParameterChoice;
use npufleet_contract::proto::inference::{InferParameter, ModelInferRequest};
use npufleet_worker::server::oip;
use serde_json::json;
use tokio::sync::Mutex;

const MAX_CONCURRENCY: usize = 1024;
const MAX_DURATION_SECS: f64 = 600.0;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Api {
    /// Open Inference Protocol ModelStreamInfer.
    Grpc,
    /// OpenAI /v1/chat/completions with stream: true.
    Chat,
    /// OpenAI /v1/completions with stream: true.
    Completions,
}

#[derive(Debug, Parser)]
#[command(name = "npufleet-loadgen", version, about)]
struct Args {
    /// Worker address as host:port (gRPC port for --api grpc, HTTP port otherwise).
    #[arg(long, default_value = "127.0.0.1:8001")]
    target: String,
    #[arg(long, value_enum, default_value_t = Api::Grpc)]
    api: Api,
    /// The served model name.
    #[arg(long)]
    model: String,
    /// Concurrent streams, at most 1024.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Seconds during which new requests start, at most 600.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Most requests in total.
    #[arg(long, default_value_t = 100_000)]
    max_requests: usize,
    /// Seconds to wait for requests still running when the duration ends.
    #[arg(long, default_value_t = 60.0)]
    grace: f64,
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[arg(
        long,
        default_value = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    )]
    prompt: String,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// What one request measured.
#[derive(Debug, Default)]
struct Sample {
    ttft: Option<Duration>,
    inter_token: Vec<Duration>,
    tokens: u64,
    error: Option<String>,
}

#[derive(Debug, Default)]
struct Totals {
    requests: u64,
    completed: u64,
    tokens: u64,
    ttft: Vec<Duration>,
    inter_token: Vec<Duration>,
    errors: BTreeMap<String, u64>,
}

impl Totals {
    fn add(&mut self, sample: Sample) {
        self.requests += 1;
        self.tokens += sample.tokens;
        self.ttft.extend(sample.ttft);
        self.inter_token.extend(sample.inter_token);
        match sample.error {
            Some(kind) => *self.errors.entry(kind).or_default() += 1,
            None => self.completed += 1,
        }
    }
}

/// Nearest-rank percentile of unsorted samples, in milliseconds.
fn percentile_ms(samples: &mut [Duration], p: f64) -> Option<f64> {
    if samples.is_empty() {
        return None;
    }
    samples.sort_unstable();
    let rank = ((p / 100.0) * samples.len() as f64).ceil() as usize;
    let index = rank.clamp(1, samples.len()) - 1;
    Some(samples[index].as_secs_f64() * 1000.0)
}

/// Resolves `target` and refuses anything that is not a loopback address.
fn loopback_target(target: &str) -> anyhow::Result<std::net::SocketAddr> {
    let addrs: Vec<_> = target
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve '{target}' (expected host:port)"))?
        .collect();
    match addrs.iter().find(|a| !a.ip().is_loopback()) {
        Some(outside) => bail!(
            "'{target}' resolves to {outside}, which is not a loopback address; this tool \
             only loads workers on this machine"
        ),
        None => addrs
            .first()
            .copied()
            .with_context(|| format!("'{target}' resolves to no address")),
    }
}

/// A short name for an error, for counting by kind.
fn grpc_error_kind(message: &str) -> String {
    message
        .split_once(':')
        .map(|(code, _)| code)
        .filter(|code| code.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
        .unwrap_or("STREAM_ERROR")
        .to_string()
}

fn grpc_request(args: &Args) -> ModelInferRequest {
    let temperature = InferParameter {
        parameter_choice: Some(ParameterChoice::DoubleParam(args.temperature)),
    };
    oip::text_request(
        &args.model,
        args.prompt.as_bytes(),
        [
            ("max_tokens", oip::int_param(args.max_tokens.into())),
            ("temperature", temperature),
        ],
    )
}

async fn grpc_once(
    client: &mut GrpcInferenceServiceClient<tonic::transport::Channel>,
    request: ModelInferRequest,
) -> Sample {
    let mut sample = Sample::default();
    let started = Instant::now();
    let response = client.model_stream_infer(tokio_stream::once(request)).await;
    let mut responses = match response {
        Ok(response) => response.into_inner(),
        Err(status) => {
            sample.error = Some(format!("{:?}", status.code()));
            return sample;
        }
    };
    let mut last = None;
    loop {
        match responses.message().await {
            Ok(Some(message)) => {
                if !message.error_message.is_empty() {
                    sample.error = Some(grpc_error_kind(&message.error_message));
                    return sample;
                }
                let Some(response) = message.infer_response else {
                    continue;
                };
                let ids = response
                    .outputs
                    .iter()
                    .find(|o| o.name == oip::OUTPUT_IDS)
                    .map_or(0, |o| o.shape.first().copied().unwrap_or(0));
                if ids > 0 {
                    let now = Instant::now();
                    match last {
                        None => sample.ttft = Some(now - started),
                        Some(previous) => sample.inter_token.push(now - previous),
                    }
                    last = Some(now);
                    sample.tokens += ids as u64;
                }
                let is_final = matches!(
                    response
                        .parameters
                        .get("triton_final_response")
                        .and_then(|p| p.parameter_choice.as_ref()),
                    Some(ParameterChoice::BoolParam(true))
                );
                if is_final {
                    return sample;
                }
            }
            Ok(None) => {
                sample.error = Some("STREAM_ENDED_EARLY".into());
                return sample;
            }
            Err(status) => {
                sample.error = Some(format!("{:?}", status.code()));
                return sample;
            }
        }
    }
}

fn http_body(args: &Args) -> serde_json::Value {
    let mut body = json!({
        "model": args.model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    match args.api {
        Api::Chat => body["messages"] = json!([{"role": "user", "content": args.prompt}]),
        _ => body["prompt"] = json!(args.prompt),
    }
    body
}

async fn http_once(client: &reqwest::Client, url: &str, body: &serde_json::Value) -> Sample {
    let mut sample = Sample::default();
    let started = Instant::now();
    let response = match client.post(url).json(body).send().await {
        Ok(response) => response,
        Err(err) => {
            sample.error = Some(if err.is_connect() { "connect" } else { "http" }.into());
            return sample;
        }
    };
    if !response.status().is_success() {
        sample.error = Some(format!("http_{}", response.status().as_u16()));
        return sample;
    }
    let mut bytes = response.bytes_stream();
    let mut buffer = Vec::new();
    let mut last = None;
    while let Some(chunk) = bytes.next().await {
        let Ok(chunk) = chunk else {
            sample.error = Some("stream_broken".into());
            return sample;
        };
        buffer.extend_from_slice(&chunk);
        while let Some(end) = buffer.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buffer.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            let Some(data) = text.trim().strip_prefix("data:").map(str::trim) else {
                continue;
            };
            if data == "[DONE]" {
                return sample;
            }
            let Ok(value) = serde_json::from_str::<serde_json::Value>(data) else {
                sample.error = Some("bad_chunk".into());
                return sample;
            };
            if value.get("error").is_some() {
                sample.error = Some("stream_error".into());
                return sample;
            }
            if let Some(tokens) = value["usage"]["completion_tokens"].as_u64() {
                sample.tokens = tokens;
            }
            let choice = &value["choices"][0];
            let text = choice["text"]
                .as_str()
                .or_else(|| choice["delta"]["content"].as_str())
                .unwrap_or("");
            if !text.is_empty() {
                let now = Instant::now();
                match last {
                    None => sample.ttft = Some(now - started),
                    Some(previous) => sample.inter_token.push(now - previous),
                }
                last = Some(now);
            }
        }
    }
    sample.error = Some("stream_ended_early".into());
    sample
}

async fn run(args: Args) -> anyhow::Result<()> {
    if args.concurrency == 0 || args.concurrency > MAX_CONCURRENCY {
        bail!("--concurrency must be between 1 and {MAX_CONCURRENCY}");
    }
    if !(args.duration > 0.0 && args.duration <= MAX_DURATION_SECS) {
        bail!("--duration must be in (0, {MAX_DURATION_SECS}] seconds");
    }
    if !(args.grace >= 0.0 && args.grace <= MAX_DURATION_SECS) {
        bail!("--grace must be in [0, {MAX_DURATION_SECS}] seconds");
    }
    let addr = loopback_target(&args.target)?;
    let args = Arc::new(args);
    let issued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let totals = Arc::new(Mutex::new(Totals::default()));
    let started = Instant::now();
    let stop_issuing = started + Duration::from_secs_f64(args.duration);

    let grpc_client = match args.api {
        Api::Grpc => Some(
            GrpcInferenceServiceClient::connect(format!("http://{addr}"))
                .await
                .with_context(|| format!("cannot connect to gRPC at {addr}"))?,
        ),
        _ => None,
    };
    let http_client = reqwest::Client::builder()
        .pool_max_idle_per_host(MAX_CONCURRENCY)
        .build()
        .context("cannot build the HTTP client")?;
    let url = match args.api {
        Api::Chat => format!("http://{addr}/v1/chat/completions"),
        _ => format!("http://{addr}/v1/completions"),
    };

    let mut clients = Vec::new();
    for _ in 0..args.concurrency {
        let args = args.clone();
        let issued = issued.clone();
        let totals = totals.clone();
        let mut grpc_client = grpc_client.clone();
        let http_client = http_client.clone();
        let url = url.clone();
        let body = http_body(&args);
        clients.push(tokio::spawn(async move {
            while Instant::now() < stop_issuing
                && issued.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < args.max_requests
            {
                let sample = match grpc_client.as_mut() {
                    Some(client) => grpc_once(client, grpc_request(&args)).await,
                    None => http_once(&http_client, &url, &body).await,
                };
                totals.lock().await.add(sample);
            }
        }));
    }
    let all_done = futures::future::join_all(clients);
    let hard_deadline = stop_issuing + Duration::from_secs_f64(args.grace);
    let finished_in_time = tokio::time::timeout_at(hard_deadline.into(), all_done)
        .await
        .is_ok();
    let elapsed = started.elapsed();
    let mut totals = std::mem::take(&mut *totals.lock().await);
    if !finished_in_time {
        *totals
            .errors
            .entry("abandoned_at_grace".into())
            .or_default() += 1;
    }
    report(&args, &mut totals, elapsed);
    Ok(())
}

fn report(args: &Args, totals: &mut Totals, elapsed: Duration) {
    let seconds = elapsed.as_secs_f64();
    let ttft: Vec<Option<f64>> = [50.0, 90.0, 99.0]
        .iter()
        .map(|&p| percentile_ms(&mut totals.ttft, p))
        .collect();
    let itl: Vec<Option<f64>> = [50.0, 90.0, 99.0]
        .iter()
        .map(|&p| percentile_ms(&mut totals.inter_token, p))
        .collect();
    if args.json {
        let report = json!({
            "api": format!("{:?}", args.api).to_lowercase(),
            "concurrency": args.concurrency,
            "elapsed_s": seconds,
            "requests": totals.requests,
            "completed": totals.completed,
            "generated_tokens": totals.tokens,
            "requests_per_s": totals.completed as f64 / seconds,
            "tokens_per_s": totals.tokens as f64 / seconds,
            "ttft_ms": {"p50": ttft[0], "p90": ttft[1], "p99": ttft[2]},
            "inter_token_ms": {"p50": itl[0], "p90": itl[1], "p99": itl[2]},
            "errors": totals.errors,
        });
        println!("{report:#}");
        return;
    }
    let ms = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.1}"));
    println!(
        "| streams | requests | completed | errors | req/s | tok/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    println!(
        "| {} | {} | {} | {} | {:.2} | {:.1} | {} / {} / {} | {} / {} / {} |",
        args.concurrency,
        totals.requests,
        totals.completed,
        totals.errors.values().sum::<u64>(),
        totals.completed as f64 / seconds,
        totals.tokens as f64 / seconds,
        ms(ttft[0]),
        ms(ttft[1]),
        ms(ttft[2]),
        ms(itl[0]),
        ms(itl[1]),
        ms(itl[2]),
    );
    for (kind, count) in &totals.errors {
        println!("errors {kind}: {count}");
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let mut samples: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        samples.reverse();
        assert_eq!(percentile_ms(&mut samples, 50.0), Some(50.0));
        assert_eq!(percentile_ms(&mut samples, 99.0), Some(99.0));
        assert_eq!(percentile_ms(&mut [], 50.0), None);
    }

    #[test]
    fn only_loopback_targets_are_accepted() {
        assert!(loopback_target("127.0.0.1:8001").is_ok());
        assert!(loopback_target("[::1]:8001").is_ok());
        let err = loopback_target("10.1.2.3:8001").unwrap_err().to_string();
        assert!(err.contains("not a loopback"), "{err}");
        assert!(loopback_target("no-port").is_err());
    }

    #[test]
    fn in_stream_errors_are_classified_by_code() {
        assert_eq!(
            grpc_error_kind("RESOURCE_EXHAUSTED: queue full"),
            "RESOURCE_EXHAUSTED"
        );
        assert_eq!(grpc_error_kind("something odd: x"), "STREAM_ERROR");
    }
}

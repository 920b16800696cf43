//! The worker process's start-up: the command line of `serve`, logging, choosing the
//! accelerator, loading this process's ranks and starting the engine, then handing the engine
//! to [`crate::server`] (or, in a process without rank 0, following the leader's steps).
//!
//! It sits above every layer and is the only place that wires them together.

pub mod ranks;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use npufleet_contract::auth::ApiKey;
use npufleet_contract::listener::{self, ConnectionLimits, Protocol, parse_seconds};
use npufleet_contract::logging::{self, LogFormat};
use npufleet_contract::precision::{AUTO_INT8_MAX_PROMPT_TOKENS, Precision};
use npufleet_contract::{env, ports};
use tokio::net::TcpListener;

use crate::ascend::{AcceleratorKind, Selected};
use crate::backend::KvDtype;
use crate::collective::hccl_env::{InterfaceAddr, local_interfaces};
use crate::engine::{EngineConfig, KvCacheSize};
use crate::model::PrecisionPolicy;
use crate::server::kv_events_zmq::{self, ZmqEventsConfig};
use crate::server::reasoning::ReasoningParser;
use crate::server::{self, Listeners, ServerConfig, termination_signal};

/// The precision policy, as `serve` and the benchmarks take it.
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct PrecisionArgs {
    /// int8, fp32, fp16, or auto: int8 for prompts up to `--auto-int8-max-prompt-tokens`
    /// and for decode, full precision above.
    #[arg(long, env = env::PRECISION, default_value_t = Precision::Auto)]
    pub precision: Precision,
    /// With `--precision auto`: the longest prompt served at int8 (by default, every prompt).
    #[arg(long, env = env::AUTO_INT8_MAX_PROMPT_TOKENS, default_value_t = AUTO_INT8_MAX_PROMPT_TOKENS)]
    pub auto_int8_max_prompt_tokens: usize,
}

impl PrecisionArgs {
    pub fn policy(&self) -> PrecisionPolicy {
        PrecisionPolicy::new(self.precision, self.auto_int8_max_prompt_tokens)
    }
}

/// What the KV cache stores, as `--kv-cache-dtype` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvCacheDtype {
    /// f16, as llama.cpp and vLLM store it by default: every backend's attention reads the
    /// cache with the host kernels, which widen f16 as they load it.
    Auto,
    F16,
    F32,
}

impl KvCacheDtype {
    pub fn resolve(self) -> KvDtype {
        match self {
            KvCacheDtype::Auto | KvCacheDtype::F16 => KvDtype::F16,
            KvCacheDtype::F32 => KvDtype::F32,
        }
    }
}

/// The KV cache's element type; `serve` and `bench` share it, so the benchmark measures
/// the default `serve` runs.
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct KvCacheDtypeArgs {
    /// What the KV cache stores: f16 takes half the memory of f32, so the same
    /// `--kv-cache-bytes` holds twice the positions.
    #[arg(long, env = env::KV_CACHE_DTYPE, value_enum, default_value_t = KvCacheDtype::Auto)]
    pub kv_cache_dtype: KvCacheDtype,
}

impl KvCacheDtypeArgs {
    pub fn dtype(&self) -> KvDtype {
        self.kv_cache_dtype.resolve()
    }
}

/// How the engine runs the model.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    /// Most sequences in one engine step.
    #[arg(long, env = env::MAX_BATCH_SIZE, default_value_t = 128)]
    pub max_batch_size: usize,
    /// Most requests waiting to run; beyond it requests are refused with 429 /
    /// RESOURCE_EXHAUSTED.
    #[arg(long, env = env::QUEUE_LIMIT, default_value_t = 1024)]
    pub queue_limit: usize,
    /// Forward passes run before the worker reports ready.
    #[arg(long, env = env::WARMUP_ITERATIONS, default_value_t = 100)]
    pub warmup_iterations: u32,
    #[command(flatten)]
    pub precision: PrecisionArgs,
    /// Compute threads; 0 uses every core.
    #[arg(long, env = env::THREADS, default_value_t = 0)]
    pub threads: usize,
    /// Prompt prefixes (system prompts) to keep in the prefix cache: a JSON array of strings,
    /// or the path of a file holding one.
    #[arg(long, env = env::PREFIX_TEMPLATES)]
    pub prefix_templates: Option<String>,
    /// Where the kernels run: `auto` uses Ascend NPUs when CANN is installed, else the CPU.
    #[arg(long, env = env::ACCELERATOR, value_enum, default_value_t = AcceleratorKind::Auto)]
    pub accelerator: AcceleratorKind,
    /// Most tokens (prompt chunks plus decodes) in one engine step.
    #[arg(long, env = "NPUFLEET_MAX_NUM_BATCHED_TOKENS", default_value_t = 512)]
    pub max_num_batched_tokens: usize,
    /// Most positions of one prompt in one engine step, so that a request arriving during a
    /// long prompt's prefill waits for a chunk of it rather than all of it; 0 gives one
    /// prompt the whole step.
    #[arg(long, env = env::LONG_PREFILL_TOKEN_THRESHOLD, default_value_t = npufleet_contract::scheduling::LONG_PREFILL_TOKEN_THRESHOLD)]
    pub long_prefill_token_threshold: usize,
    /// Positions per KV-cache block.
    #[arg(long, env = "NPUFLEET_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: usize,
    /// Memory for the KV cache, in bytes. Without it (or `--kv-cache-blocks`) the cache
    /// takes `--kv-cache-memory-fraction` of what `--memory-limit-bytes` leaves beside the
    /// weights, or 1 GiB when no limit is known.
    #[arg(long, env = env::KV_CACHE_BYTES)]
    pub kv_cache_bytes: Option<usize>,
    /// The container's memory limit in bytes (the operator passes it through the downward
    /// API), which the KV cache is sized against.
    #[arg(long, env = env::MEMORY_LIMIT_BYTES)]
    pub memory_limit_bytes: Option<usize>,
    /// The share of `--memory-limit-bytes`, less the weights, that the KV cache takes; the
    /// rest is left for activations, per-request buffers and the runtime.
    #[arg(long, env = "NPUFLEET_KV_CACHE_MEMORY_FRACTION", default_value_t = 0.5, value_parser = parse_fraction)]
    pub kv_cache_memory_fraction: f64,
    /// KV-cache size in blocks; overrides `--kv-cache-bytes`.
    #[arg(long, env = "NPUFLEET_KV_CACHE_BLOCKS")]
    pub kv_cache_blocks: Option<usize>,
    #[command(flatten)]
    pub kv_cache_dtype: KvCacheDtypeArgs,
    /// Generate past the model's end-of-sequence tokens, so every request runs to its
    /// `max_tokens`: for benchmarks and load tests, not for serving users.
    #[arg(long, env = env::IGNORE_EOS)]
    pub ignore_eos: bool,
}

#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// The model: a GGUF file or a Hugging Face model directory.
    #[arg(long, env = env::MODEL)]
    pub model: PathBuf,
    /// The name clients address the model by; defaults to the model file's stem.
    #[arg(long, env = env::SERVED_MODEL_NAME)]
    pub served_model_name: Option<String>,
    /// Address of the gRPC listener (Open Inference Protocol, load, health, reflection).
    #[arg(long, env = env::GRPC_ADDR, default_value_t = SocketAddr::from(([0, 0, 0, 0], ports::GRPC_PORT)))]
    pub grpc_addr: SocketAddr,
    /// Address of the HTTP listener (OpenAI API, REST protocol, /metrics).
    #[arg(long, env = env::HTTP_ADDR, default_value_t = SocketAddr::from(([0, 0, 0, 0], ports::HTTP_PORT)))]
    pub http_addr: SocketAddr,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Longest wait, in seconds, for accepted requests to finish after SIGTERM.
    #[arg(long, env = env::DRAIN_TIMEOUT, default_value_t = 30.0, value_parser = parse_seconds)]
    pub drain_timeout: f64,
    /// The key clients must send (`Authorization: Bearer <key>`, or the same gRPC
    /// metadata) to the OpenAI and inference endpoints; health, metadata and metrics stay
    /// open. Unset: no key is required.
    #[arg(long, env = env::API_KEY, hide_env_values = true)]
    pub api_key: Option<ApiKey>,
    /// Largest accepted HTTP request body, in bytes.
    #[arg(long, env = "NPUFLEET_MAX_BODY_BYTES", default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// Largest accepted gRPC request message, in bytes; larger ones are refused with
    /// RESOURCE_EXHAUSTED.
    #[arg(long, env = "NPUFLEET_MAX_GRPC_MESSAGE_BYTES", default_value_t = 4 << 20)]
    pub max_grpc_message_bytes: usize,
    /// Longest wait, in seconds, for a client to take the next chunk of a streamed response;
    /// a client that stops reading for longer has its request cancelled.
    #[arg(long, env = "NPUFLEET_STALLED_READER_TIMEOUT", default_value_t = 30.0, value_parser = parse_seconds)]
    pub stalled_reader_timeout: f64,
    /// Kernel send buffer of each HTTP connection, in bytes. Bounded so that a client that
    /// stops reading an event stream fills it within seconds and meets
    /// `--stalled-reader-timeout`, instead of the kernel taking megabytes of tokens first.
    #[arg(long, env = "NPUFLEET_HTTP_SEND_BUFFER_BYTES", default_value_t = 64 << 10)]
    pub http_send_buffer_bytes: usize,
    /// What the gRPC and HTTP listeners bound their connections by.
    #[command(flatten)]
    pub connections: ConnectionLimits,
    #[arg(long, env = "NPUFLEET_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// How chat answers' `<think>` reasoning is returned: `auto` moves it to
    /// `reasoning_content` when the chat template opens a `<think>` block in the prompt
    /// (DeepSeek-R1 and its distills), `deepseek_r1` always does (vLLM's parser of that name),
    /// `none` leaves it in `content`.
    #[arg(long, env = env::REASONING_PARSER, value_enum, default_value_t = ReasoningParser::Auto)]
    pub reasoning_parser: ReasoningParser,
    #[command(flatten)]
    pub kv_events: KvEventsArgs,
}

/// The prefix cache's events in vLLM's ZeroMQ wire format, for KV-aware routers built for
/// vLLM. This project's router needs none of it: it reads them from the gRPC load service.
#[derive(Debug, Clone, clap::Args)]
pub struct KvEventsArgs {
    /// Publish on this ZeroMQ endpoint: one with a wildcard host (`tcp://*:5557`) is bound,
    /// any other (`tcp://<consumer>:5557`) is connected to, as vLLM's `--kv-events-config`
    /// endpoint is. Unset: no ZeroMQ events.
    #[arg(long, env = "NPUFLEET_KV_EVENTS_ENDPOINT", value_parser = kv_events_zmq::parse_endpoint)]
    pub kv_events_endpoint: Option<String>,
    /// Bind a ROUTER socket here that replays batches from a sequence number on request.
    #[arg(long, env = "NPUFLEET_KV_EVENTS_REPLAY_ENDPOINT", requires = "kv_events_endpoint", value_parser = kv_events_zmq::parse_endpoint)]
    pub kv_events_replay_endpoint: Option<String>,
    /// Every message's topic. Default: `kv@<pod IP>@<served model name>`, the form llm-d
    /// reads the pod and the model from (the pod IP: `POD_IP`, else the first address that
    /// is not loopback, else the host name).
    #[arg(
        long,
        env = "NPUFLEET_KV_EVENTS_TOPIC",
        requires = "kv_events_endpoint"
    )]
    pub kv_events_topic: Option<String>,
}

/// The pod's address as consumers of KV events name the pod: `POD_IP` where the operator
/// sets it, else the first address that is not loopback (in a pod, its own).
fn pod_address(pod_ip: Option<String>, interfaces: &[InterfaceAddr]) -> Option<String> {
    let outside = |v4: bool| {
        interfaces
            .iter()
            .find(|i| !i.ip.is_loopback() && i.ip.is_ipv4() == v4)
            .map(|i| i.ip.to_string())
    };
    pod_ip
        .filter(|ip| !ip.is_empty())
        .or_else(|| outside(true))
        .or_else(|| outside(false))
}

impl KvEventsArgs {
    fn config(&self, model_name: &str) -> Option<ZmqEventsConfig> {
        let endpoint = self.kv_events_endpoint.clone()?;
        let topic = self.kv_events_topic.clone().unwrap_or_else(|| {
            let pod = pod_address(
                std::env::var(env::POD_IP).ok(),
                &local_interfaces().unwrap_or_default(),
            )
            .unwrap_or_else(|| {
                rustix::system::uname()
                    .nodename()
                    .to_string_lossy()
                    .into_owned()
            });
            format!("kv@{pod}@{model_name}")
        });
        Some(ZmqEventsConfig {
            endpoint,
            replay_endpoint: self.kv_events_replay_endpoint.clone(),
            topic,
        })
    }
}

fn parse_fraction(value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(share) if share > 0.0 && share <= 1.0 => Ok(share),
        _ => Err(format!("'{value}' is not a fraction in (0, 1]")),
    }
}

/// The KV cache when neither its size nor a memory limit is given.
const DEFAULT_KV_CACHE_BYTES: usize = 1 << 30;

impl EngineArgs {
    /// The KV cache's size: `--kv-cache-blocks`, else `--kv-cache-bytes`, else a share of
    /// the memory limit, else [`DEFAULT_KV_CACHE_BYTES`].
    pub fn kv_cache_size(&self) -> KvCacheSize {
        match (
            self.kv_cache_blocks,
            self.kv_cache_bytes,
            self.memory_limit_bytes,
        ) {
            (Some(blocks), _, _) => KvCacheSize::Blocks(blocks),
            (None, Some(bytes), _) => KvCacheSize::Bytes(bytes),
            (None, None, Some(limit_bytes)) => KvCacheSize::ShareOfMemoryLimit {
                limit_bytes,
                share: self.kv_cache_memory_fraction,
            },
            (None, None, None) => KvCacheSize::Bytes(DEFAULT_KV_CACHE_BYTES),
        }
    }

    /// The prefix templates, read from `--prefix-templates`.
    pub fn prefix_templates(&self) -> anyhow::Result<Vec<String>> {
        let Some(value) = self.prefix_templates.as_deref() else {
            return Ok(Vec::new());
        };
        let (json, source) = if value.trim_start().starts_with('[') {
            (value.to_string(), "the value".to_string())
        } else {
            let text = std::fs::read_to_string(value)
                .with_context(|| format!("cannot read the prefix templates file '{value}'"))?;
            (text, format!("file '{value}'"))
        };
        serde_json::from_str(&json).with_context(|| {
            format!("--prefix-templates: {source} must be a JSON array of strings")
        })
    }
}

impl ServeArgs {
    /// What the serving surfaces take from these arguments.
    pub fn server_config(&self, model_name: String) -> ServerConfig {
        ServerConfig {
            warmup_iterations: self.engine.warmup_iterations,
            drain_timeout: Duration::from_secs_f64(self.drain_timeout),
            api_key: self.api_key.clone(),
            max_body_bytes: self.max_body_bytes,
            max_grpc_message_bytes: self.max_grpc_message_bytes,
            stalled_reader_timeout: Duration::from_secs_f64(self.stalled_reader_timeout),
            http_send_buffer_bytes: self.http_send_buffer_bytes,
            connections: self.connections,
            reasoning_parser: self.reasoning_parser,
            kv_events: self.kv_events.config(&model_name),
            model_name,
        }
    }

    /// The served name: `--served-model-name`, else the model's file or directory stem.
    pub fn model_name(&self) -> String {
        self.served_model_name.clone().unwrap_or_else(|| {
            self.model
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".to_string())
        })
    }
}

fn check_model_readable(path: &Path) -> anyhow::Result<()> {
    let metadata = std::fs::metadata(path)
        .with_context(|| format!("cannot read the model at '{}'", path.display()))?;
    if metadata.is_file() {
        std::fs::File::open(path)
            .with_context(|| format!("cannot open the model file '{}'", path.display()))?;
    }
    Ok(())
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let _telemetry = logging::init(args.log_format, "npufleet-worker");
    check_model_readable(&args.model)?;
    let model_name = args.model_name();
    if model_name.is_empty() {
        anyhow::bail!("--served-model-name must not be empty");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    match start_ranks(&args, &model_name)? {
        (ranks::Role::Leader { model, followers }, config) => {
            let engine = crate::engine::start(*model, config).context("cannot start the engine")?;
            let config = args.server_config(model_name);
            let served = runtime.block_on(async {
                let listeners = Listeners::bind(args.grpc_addr, args.http_addr).await?;
                server::serve(config, engine, listeners, termination_signal()).await
            });
            // Dropping the runtime drops the last engine handle, and with it the model, which
            // tells this process's followers (and every other rank) that the group is done.
            drop(runtime);
            let followed = followers.join();
            served.and(followed)
        }
        (ranks::Role::Follower(followers), _) => {
            runtime.block_on(follow(args.http_addr, args.connections, followers))
        }
    }
}

/// Loads this process's ranks; the engine configuration goes to rank 0's engine.
fn start_ranks(args: &ServeArgs, model_name: &str) -> anyhow::Result<(ranks::Role, EngineConfig)> {
    let engine_args = &args.engine;
    let prefix_templates = engine_args.prefix_templates()?;
    let selected = crate::ascend::select_backend(engine_args.accelerator)
        .context("cannot use the requested accelerator")?;
    match &selected {
        Selected::Cpu {
            fallback_reason: Some(reason),
        } => tracing::warn!(%reason, "no usable NPU; computing on the CPU"),
        Selected::Cpu {
            fallback_reason: None,
        } => tracing::info!("computing on the CPU"),
        Selected::Ascend(runtime) => {
            tracing::info!(devices = runtime.device_count, "Ascend runtime available")
        }
    }
    let policy = engine_args.precision.policy();
    let config = EngineConfig {
        model_name: model_name.to_string(),
        max_batch_size: engine_args.max_batch_size,
        queue_limit: engine_args.queue_limit,
        max_num_batched_tokens: engine_args.max_num_batched_tokens,
        long_prefill_token_threshold: engine_args.long_prefill_token_threshold,
        block_size: engine_args.block_size,
        kv_cache: engine_args.kv_cache_size(),
        kv_dtype: engine_args.kv_cache_dtype.dtype(),
        warmup_iterations: engine_args.warmup_iterations,
        prefix_templates,
        ignore_eos: engine_args.ignore_eos,
    };
    let started = Instant::now();
    let role = ranks::start(&args.model, &selected, policy, engine_args.threads, &config)
        .with_context(|| format!("cannot load the model '{}'", args.model.display()))?;
    match &role {
        ranks::Role::Leader { model, followers } => tracing::info!(
            elapsed = ?started.elapsed(),
            backend = %model.backend_name(),
            rank = model.shard().rank,
            world_size = model.shard().world,
            local_followers = ?followers.ranks(),
            "model loaded"
        ),
        ranks::Role::Follower(followers) => tracing::info!(
            elapsed = ?started.elapsed(),
            ranks = ?followers.ranks(),
            "model shards loaded; following rank 0 in another pod"
        ),
    }
    Ok((role, config))
}

/// A process without rank 0: answers health probes while its ranks follow the leader, and
/// exits when the leader stops the group (0) or a rank is lost (an error naming it). A
/// termination signal does not end it early: the leader may still be draining requests that
/// need these ranks.
async fn follow(
    http_addr: SocketAddr,
    connections: ConnectionLimits,
    followers: ranks::Followers,
) -> anyhow::Result<()> {
    let http_listener = TcpListener::bind(http_addr)
        .await
        .with_context(|| format!("cannot listen for HTTP on {http_addr}"))?;
    tracing::info!(http = %http_listener.local_addr()?, "serving health while following rank 0");
    let http = tokio::spawn(listener::serve(
        http_listener,
        server::router::follower_router(),
        Protocol::Http,
        connections,
        |_| {},
        std::future::pending(),
    ));
    let mut ticks = tokio::time::interval(Duration::from_millis(100));
    let mut signal = std::pin::pin!(termination_signal());
    let mut signalled = false;
    loop {
        tokio::select! {
            _ = ticks.tick() => {
                if followers.finished() {
                    break;
                }
            }
            received = &mut signal, if !signalled => {
                tracing::info!(signal = received?, "staying until rank 0 stops the group");
                signalled = true;
            }
        }
    }
    http.abort();
    tokio::task::spawn_blocking(move || followers.join())
        .await
        .context("joining the follower ranks")?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_events_name_the_pod_by_pod_ip_else_its_first_outside_address() {
        let interfaces: Vec<InterfaceAddr> = [
            ("lo", "127.0.0.1"),
            ("eth0", "fd00::2"),
            ("eth0", "198.18.0.9"),
        ]
        .into_iter()
        .map(|(name, ip)| InterfaceAddr {
            name: name.into(),
            ip: ip.parse().unwrap(),
        })
        .collect();
        assert_eq!(
            pod_address(Some("198.18.0.7".into()), &interfaces).as_deref(),
            Some("198.18.0.7")
        );
        assert_eq!(
            pod_address(Some(String::new()), &interfaces).as_deref(),
            Some("198.18.0.9")
        );
        assert_eq!(
            pod_address(None, &interfaces[..2]).as_deref(),
            Some("fd00::2")
        );
        assert_eq!(pod_address(None, &interfaces[..1]), None);
    }
}

//! Environment variables the operator sets on worker pods and the worker reads (its CLI flags
//! take the same values from them).

pub const MODEL: &str = "NPUFLEET_MODEL";
pub const SERVED_MODEL_NAME: &str = "NPUFLEET_SERVED_MODEL_NAME";
pub const GRPC_ADDR: &str = "NPUFLEET_GRPC_ADDR";
pub const HTTP_ADDR: &str = "NPUFLEET_HTTP_ADDR";
/// The HTTP port of an engine other than the worker, for its arguments to name as
/// `$(NPUFLEET_HTTP_PORT)`.
pub const HTTP_PORT: &str = "NPUFLEET_HTTP_PORT";
pub const MAX_BATCH_SIZE: &str = "NPUFLEET_MAX_BATCH_SIZE";
/// Prompt positions one request computes per engine step at most (0: the step's budget).
pub const LONG_PREFILL_TOKEN_THRESHOLD: &str = "NPUFLEET_LONG_PREFILL_TOKEN_THRESHOLD";
pub const QUEUE_LIMIT: &str = "NPUFLEET_QUEUE_LIMIT";
pub const WARMUP_ITERATIONS: &str = "NPUFLEET_WARMUP_ITERATIONS";
/// Compute threads (0: every core).
pub const THREADS: &str = "NPUFLEET_THREADS";
/// Memory for the KV cache, in bytes (otherwise sized from the memory limit).
pub const KV_CACHE_BYTES: &str = "NPUFLEET_KV_CACHE_BYTES";
/// What the KV cache stores: `auto`, `f16` or `f32`.
pub const KV_CACHE_DTYPE: &str = "NPUFLEET_KV_CACHE_DTYPE";
/// Generate to `max_tokens` past end-of-sequence tokens (benchmarks and load tests).
pub const IGNORE_EOS: &str = "NPUFLEET_IGNORE_EOS";
/// How chat answers' `<think>` reasoning is returned: `auto`, `deepseek_r1` or `none`.
pub const REASONING_PARSER: &str = "NPUFLEET_REASONING_PARSER";
/// A [`crate::precision::Precision`] name.
pub const PRECISION: &str = "NPUFLEET_PRECISION";
pub const AUTO_INT8_MAX_PROMPT_TOKENS: &str = "NPUFLEET_AUTO_INT8_MAX_PROMPT_TOKENS";
/// An [`crate::accelerator::AcceleratorType`] name, or `cpu`/`ascend`/`auto`.
pub const ACCELERATOR: &str = "NPUFLEET_ACCELERATOR";
/// Prompt prefixes to keep cached: a JSON array of strings.
pub const PREFIX_TEMPLATES: &str = "NPUFLEET_PREFIX_TEMPLATES";
/// Seconds to finish accepted requests after SIGTERM.
pub const DRAIN_TIMEOUT: &str = "NPUFLEET_DRAIN_TIMEOUT";
/// The key clients must present to the worker's inference endpoints (unset: none); see
/// [`crate::auth::ApiKey`].
pub const API_KEY: &str = "NPUFLEET_API_KEY";
/// The worker container's memory limit in bytes (from the downward API), which the KV cache is
/// sized against.
pub const MEMORY_LIMIT_BYTES: &str = "NPUFLEET_MEMORY_LIMIT_BYTES";

/// Path of the mounted rank table (the name HCCL and MindCluster use).
pub const RANK_TABLE_FILE: &str = "RANK_TABLE_FILE";
/// The pod's IP, matched against the rank table's `container_ip`.
pub const POD_IP: &str = "POD_IP";
/// An explicit rank_id, for processes outside Kubernetes.
pub const RANK: &str = "NPUFLEET_RANK";
/// Which of the pod's devices this process drives (unset: all of them).
pub const LOCAL_RANK: &str = "LOCAL_RANK";

/// HCCL's own settings, by the names CANN documents.
pub const HCCL_IF_IP: &str = "HCCL_IF_IP";
pub const HCCL_ALGO: &str = "HCCL_ALGO";
pub const HCCL_CONNECT_TIMEOUT: &str = "HCCL_CONNECT_TIMEOUT";
pub const HCCL_EXEC_TIMEOUT: &str = "HCCL_EXEC_TIMEOUT";
pub const HCCL_SOCKET_IFNAME: &str = "HCCL_SOCKET_IFNAME";

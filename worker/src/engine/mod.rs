//! The continuous-batching engine behind [`crate::api::Engine`].
//!
//! The engine core (`core`) deals in token ids only. One dedicated thread owns the model's
//! KV cache and runs engine steps. Each step it drops cancelled requests, gives every running
//! sequence its next token (a decode) or its next prompt chunk (chunked prefill) within a
//! per-step token budget, admits waiting requests while the batch and the budget have room,
//! runs one batched forward pass and samples (`execute`), then appends the sampled ids and
//! finishes sequences on their stop ids or length (`update`). When the KV cache runs out of
//! blocks the youngest running sequence of the lowest priority is preempted: its blocks are
//! freed and it is requeued to be recomputed later.
//!
//! Requests carry a priority (the router's flow control passes it on). Higher priorities are
//! admitted first and may preempt lower ones for a place in a full batch or cache; while a
//! higher priority's prompt is pending, lower-priority sequences sit its steps out, so its
//! first token does not wait on their decodes.
//!
//! Text is the front end's business: each request's stream (`stream`) detokenises the ids
//! and matches stop strings as its consumer reads it, and cancels the sequence in the core
//! when a stop string ends the request.
//!
//! Requests wait in a bounded queue whose depth is the autoscaling signal; a submit on a
//! full queue is rejected at once.

mod blocks;
mod core;
mod interrupt;
pub mod kv_events;
pub mod sampler;
mod stop;
mod stream;
mod warm_up;

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::{Context, bail};
use tokio::sync::mpsc;

use crate::api::{
    ChatMessage, Engine, EngineState, GenerateRequest, GenerationStream, LoadSnapshot, ModelInfo,
    Prompt, PromptRecipe, SamplingParams, SubmitError,
};
use crate::backend::KvDtype;
use crate::model::{Model, PrecisionPolicy, WeightPrecision};

use self::blocks::SequenceBlocks;
use self::sampler::Sampler;
use self::stream::{RequestStream, SequenceOutput};

/// How much memory the paged KV cache gets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvCacheSize {
    /// Exactly this many blocks.
    Blocks(usize),
    /// As many blocks as fit in this many bytes.
    Bytes(usize),
    /// As many blocks as fit in `share` of what a memory limit leaves beside the weights.
    /// Derived from the weights' size rather than a measurement of the process, so every
    /// rank of a tensor-parallel group arrives at the same number of blocks.
    ShareOfMemoryLimit { limit_bytes: usize, share: f64 },
}

impl KvCacheSize {
    /// The bytes the cache may take beside weights of `weight_bytes`.
    pub fn bytes(self, block_bytes: usize, weight_bytes: usize) -> usize {
        match self {
            KvCacheSize::Blocks(blocks) => blocks * block_bytes,
            KvCacheSize::Bytes(bytes) => bytes,
            KvCacheSize::ShareOfMemoryLimit { limit_bytes, share } => {
                (limit_bytes.saturating_sub(weight_bytes) as f64 * share) as usize
            }
        }
    }
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Reported in [`ModelInfo`].
    pub model_name: String,
    /// Sequences in one engine step.
    pub max_batch_size: usize,
    /// Requests that may wait for a batch slot before submits are refused.
    pub queue_limit: usize,
    /// Tokens (prompt chunks plus decodes) in one engine step.
    pub max_num_batched_tokens: usize,
    /// Most positions of one prompt in one step; 0 leaves a prompt the whole budget
    /// ([`npufleet_contract::scheduling::LONG_PREFILL_TOKEN_THRESHOLD`]).
    pub long_prefill_token_threshold: usize,
    /// Positions per KV-cache block.
    pub block_size: usize,
    pub kv_cache: KvCacheSize,
    /// What the KV cache stores; the cache's byte budget buys twice the blocks in f16.
    pub kv_dtype: KvDtype,
    /// Dummy forward passes before the engine reports ready.
    pub warmup_iterations: u32,
    /// Prompt prefixes (for example rendered system prompts) computed during warm-up and
    /// kept in the prefix cache for the engine's lifetime.
    pub prefix_templates: Vec<String>,
    /// Keep generating past the model's end-of-sequence ids (for benchmarks that need a
    /// fixed number of tokens). Requested stop ids and strings still apply.
    pub ignore_eos: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            model_name: "model".into(),
            max_batch_size: 128,
            queue_limit: 256,
            max_num_batched_tokens: 512,
            long_prefill_token_threshold:
                npufleet_contract::scheduling::LONG_PREFILL_TOKEN_THRESHOLD,
            block_size: 16,
            kv_cache: KvCacheSize::Bytes(1 << 30),
            kv_dtype: KvDtype::F16,
            warmup_iterations: 100,
            prefix_templates: Vec::new(),
            ignore_eos: false,
        }
    }
}

/// How many KV-cache blocks `cfg` gives `model`. Every rank of a tensor-parallel group holds
/// the same number of KV heads, so the followers size their caches to match the leader's.
pub fn kv_cache_blocks(model: &Model, cfg: &EngineConfig) -> usize {
    let block_bytes = kv_block_bytes(model, cfg);
    match cfg.kv_cache {
        KvCacheSize::Blocks(blocks) => blocks,
        size => size.bytes(block_bytes, model.weight_bytes()) / block_bytes,
    }
}

/// Bytes of one KV-cache block of `cfg`'s size and element type, across all layers.
pub fn kv_block_bytes(model: &Model, cfg: &EngineConfig) -> usize {
    model
        .new_kv_cache(1, cfg.block_size, cfg.kv_dtype)
        .bytes()
        .max(1)
}

/// Starts the engine thread. The engine warms up in the background; [`Engine::state`]
/// reports progress until it is ready.
pub fn start(model: Model, cfg: EngineConfig) -> anyhow::Result<Arc<EngineHandle>> {
    let model = Arc::new(model);
    let limits = core::EngineCore::plan(&model, &cfg)?;
    let shared = Arc::new(Shared {
        state: Mutex::new(SharedState {
            waiting: VecDeque::new(),
            warmup_done: 0,
            warming_up: true,
            draining: false,
            drained: false,
            shutdown: false,
            failure: None,
            next_order: 0,
            requests_total: 0,
            stats: LoadSnapshot {
                queue_limit: cfg.queue_limit,
                max_batch_size: cfg.max_batch_size,
                kv_blocks_total: limits.num_blocks,
                block_size: cfg.block_size,
                ..LoadSnapshot::default()
            },
        }),
        wake: Condvar::new(),
        kv_events: kv_events::KvEventLog::new(cfg.block_size),
        interrupt: interrupt::StepInterrupt::default(),
    });
    let config = model.config();
    let info = ModelInfo {
        name: cfg.model_name.clone(),
        architecture: config.architecture.clone(),
        context_length: config.context_length,
        vocab_size: config.vocab_size,
        tensor_parallel: model.shard().world,
        precision: model.policy().precision().as_str().to_owned(),
    };
    let mut stop_ids = if cfg.ignore_eos {
        Vec::new()
    } else {
        config.eos_token_ids.clone()
    };
    stop_ids.sort_unstable();
    let max_sequence_tokens = limits.max_sequence_tokens;
    let longest_token_bytes = model.tokenizer().longest_token_bytes();
    let policy = model.policy();
    let core = core::EngineCore::new(Arc::clone(&model), cfg.clone(), limits, &shared);
    let thread = std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || core.run())
        .context("starting the engine thread")?;
    Ok(Arc::new(EngineHandle {
        model,
        info,
        shared,
        precision: policy,
        warmup_iterations: cfg.warmup_iterations,
        queue_limit: cfg.queue_limit,
        max_sequence_tokens,
        longest_token_bytes,
        model_stop_ids: stop_ids,
        thread: Mutex::new(Some(thread)),
    }))
}

/// The engine as the server uses it. Dropping the last handle stops the engine thread.
pub struct EngineHandle {
    model: Arc<Model>,
    info: ModelInfo,
    shared: Arc<Shared>,
    precision: PrecisionPolicy,
    warmup_iterations: u32,
    queue_limit: usize,
    /// Longest sequence (prompt plus completion) the context and the KV cache allow.
    max_sequence_tokens: usize,
    /// Bytes of the vocabulary's longest token: a text of `n` bytes has at least
    /// `n / longest_token_bytes` tokens.
    longest_token_bytes: usize,
    /// End-of-sequence ids of the model that end every request.
    model_stop_ids: Vec<u32>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

struct Shared {
    state: Mutex<SharedState>,
    /// Signalled when work arrives or the engine must stop.
    wake: Condvar,
    kv_events: kv_events::KvEventLog,
    interrupt: interrupt::StepInterrupt,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, SharedState> {
        // The state stays consistent even if a holder panicked: every update is a plain
        // field write.
        self.state
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }
}

struct SharedState {
    /// Accepted requests not yet in the running batch, the highest priority first and within
    /// a priority the oldest; preempted sequences go back to the front of their priority.
    waiting: VecDeque<Sequence>,
    warmup_done: u32,
    warming_up: bool,
    draining: bool,
    drained: bool,
    shutdown: bool,
    /// Why the engine stopped for good, if it did.
    failure: Option<String>,
    next_order: u64,
    /// Valid requests submitted while accepting, refused for a full queue included: the
    /// demand the autoscaler sizes the fleet for.
    requests_total: u64,
    /// Published by the engine thread after every step (`waiting` is filled in on read).
    stats: LoadSnapshot,
}

impl SharedState {
    /// Queues a new request behind those of its priority and above.
    fn enqueue(&mut self, sequence: Sequence) {
        let at = self
            .waiting
            .partition_point(|waiting| waiting.priority >= sequence.priority);
        self.waiting.insert(at, sequence);
    }

    /// Queues a preempted sequence ahead of the others of its priority.
    fn requeue(&mut self, sequence: Sequence) {
        let at = self
            .waiting
            .partition_point(|waiting| waiting.priority > sequence.priority);
        self.waiting.insert(at, sequence);
    }
}

/// One request inside the engine.
struct Sequence {
    /// Submission order: a larger value is a younger request.
    order: u64,
    /// [`GenerateRequest::priority`].
    priority: i32,
    request_id: String,
    /// Prompt followed by the generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Length at which generation stops with [`crate::api::FinishReason::Length`].
    max_len: usize,
    /// Length before which no stop id ends generation (the prompt plus `min_tokens`).
    min_len: usize,
    /// Leading tokens whose K/V are in the cache.
    num_computed: usize,
    blocks: SequenceBlocks,
    precision: WeightPrecision,
    sampler: Sampler,
    /// Sorted token ids that end generation.
    stop_ids: Vec<u32>,
    /// To the request's [`GenerationStream`]; closed when the request is cancelled.
    outputs: mpsc::UnboundedSender<SequenceOutput>,
    /// Prompt tokens found in the prefix cache on first admission.
    cached_prompt_tokens: Option<usize>,
    submitted: Instant,
    admitted: Option<Instant>,
    first_token: Option<Instant>,
}

/// The checks of a request's parameters that need neither its prompt nor the KV cache.
fn check_params(params: &SamplingParams, vocab: usize) -> Result<(), SubmitError> {
    sampler::check(params)?;
    if let Some(max) = params.max_tokens
        && max < SamplingParams::MIN_MAX_TOKENS
    {
        return Err(SubmitError::invalid(
            "max_tokens",
            format!(
                "max_tokens must be at least {}, got {max}",
                SamplingParams::MIN_MAX_TOKENS
            ),
        ));
    }
    if let Some(max) = params.max_tokens
        && params.min_tokens > max
    {
        return Err(SubmitError::invalid(
            "min_tokens",
            format!(
                "min_tokens must not exceed max_tokens, got min_tokens {} and max_tokens {max}",
                params.min_tokens
            ),
        ));
    }
    if params.stop.iter().any(String::is_empty) {
        return Err(SubmitError::invalid(
            "stop",
            "stop must not contain an empty string",
        ));
    }
    if let Some(&bad) = params
        .stop_token_ids
        .iter()
        .find(|&&id| id as usize >= vocab)
    {
        return Err(SubmitError::invalid(
            "stop_token_ids",
            format!("stop_token_ids holds {bad}, outside the vocabulary (size {vocab})"),
        ));
    }
    Ok(())
}

impl EngineHandle {
    /// Turns a request into a sequence, or says what is wrong with it.
    fn validate(
        &self,
        request: &GenerateRequest,
        outputs: mpsc::UnboundedSender<SequenceOutput>,
    ) -> Result<Sequence, SubmitError> {
        let params = &request.params;
        check_params(params, self.model.config().vocab_size)?;
        let tokens = self.prompt_tokens(&request.prompt)?;
        let prompt_len = tokens.len();
        let max_new = self.generation_room(params, prompt_len)?;
        let precision = self.precision.for_prompt(prompt_len);
        let stop_ids = self.stop_ids(params);
        let sampler = Sampler::new(params, &tokens, &stop_ids);
        Ok(Sequence {
            order: 0,
            priority: request.priority,
            request_id: request.id.clone(),
            prompt_len,
            max_len: prompt_len + max_new,
            min_len: prompt_len + params.min_tokens as usize,
            tokens,
            num_computed: 0,
            blocks: SequenceBlocks::in_namespace(core::precision_namespace(precision)),
            precision,
            sampler,
            stop_ids,
            outputs,
            cached_prompt_tokens: None,
            submitted: Instant::now(),
            admitted: None,
            first_token: None,
        })
    }

    /// The prompt in token ids, refused when empty, outside the vocabulary or too long.
    fn prompt_tokens(&self, prompt: &Prompt) -> Result<Vec<u32>, SubmitError> {
        let config = self.model.config();
        let vocab = config.vocab_size;
        let tokens = match prompt {
            Prompt::Text(text) => {
                if text.is_empty() {
                    return Err(SubmitError::invalid("prompt", "the prompt is empty"));
                }
                // No token is longer than the vocabulary's longest entry, so a text this long
                // cannot fit; refusing it here spares tokenising megabytes for nothing.
                let fewest_tokens = text.len().div_ceil(self.longest_token_bytes);
                if fewest_tokens >= self.max_sequence_tokens {
                    return Err(SubmitError::invalid(
                        "prompt",
                        format!(
                            "the prompt is {} bytes, at least {fewest_tokens} tokens, but {}; \
                             it must be shorter to leave room for at least one generated token",
                            text.len(),
                            self.sequence_limit()
                        ),
                    ));
                }
                self.model.tokenizer().encode_prompt(config, text)
            }
            Prompt::Tokens(tokens) => {
                if tokens.is_empty() {
                    return Err(SubmitError::invalid("prompt", "the prompt is empty"));
                }
                if let Some((at, &bad)) = tokens
                    .iter()
                    .enumerate()
                    .find(|(_, id)| **id as usize >= vocab)
                {
                    return Err(SubmitError::invalid(
                        "prompt",
                        format!(
                            "prompt token id {bad} at position {at} is outside the vocabulary (size {vocab})"
                        ),
                    ));
                }
                tokens.clone()
            }
        };
        if tokens.len() >= self.max_sequence_tokens {
            return Err(SubmitError::invalid(
                "prompt",
                format!(
                    "the prompt has {} tokens but {}; it must be shorter to leave room for at least one generated token",
                    tokens.len(),
                    self.sequence_limit()
                ),
            ));
        }
        Ok(tokens)
    }

    /// How many tokens the sequence may generate after a prompt of `prompt_len` tokens.
    fn generation_room(
        &self,
        params: &SamplingParams,
        prompt_len: usize,
    ) -> Result<usize, SubmitError> {
        let room = self.max_sequence_tokens - prompt_len;
        let max_new = match params.max_tokens {
            None => room,
            Some(max) if max as usize <= room => max as usize,
            Some(max) => {
                return Err(SubmitError::invalid(
                    "max_tokens",
                    format!(
                        "max_tokens is {max} but the prompt has {prompt_len} tokens and {}, \
                         so at most {room} tokens can be generated",
                        self.sequence_limit()
                    ),
                ));
            }
        };
        // Only reachable without max_tokens, which is checked against min_tokens before.
        if params.min_tokens as usize > max_new {
            return Err(SubmitError::invalid(
                "min_tokens",
                format!(
                    "min_tokens is {} but the prompt has {prompt_len} tokens and {}, \
                     so at most {room} tokens can be generated",
                    params.min_tokens,
                    self.sequence_limit()
                ),
            ));
        }
        Ok(max_new)
    }

    /// The sorted token ids that end the sequence: the model's (unless `ignore_eos`) and the
    /// request's own.
    fn stop_ids(&self, params: &SamplingParams) -> Vec<u32> {
        let mut stop_ids = if params.ignore_eos {
            Vec::new()
        } else {
            self.model_stop_ids.clone()
        };
        stop_ids.extend(&params.stop_token_ids);
        stop_ids.sort_unstable();
        stop_ids.dedup();
        stop_ids
    }

    /// What bounds a sequence's length, for error messages.
    fn sequence_limit(&self) -> String {
        let context = self.model.config().context_length;
        if self.max_sequence_tokens < context {
            format!(
                "the KV cache holds at most {} tokens per sequence",
                self.max_sequence_tokens
            )
        } else {
            format!("the context length is {context}")
        }
    }

    fn refuse_if_not_accepting(&self, state: &SharedState) -> Result<(), SubmitError> {
        if state.draining {
            return Err(SubmitError::Draining);
        }
        if state.warming_up {
            return Err(SubmitError::WarmingUp {
                done: state.warmup_done,
                total: self.warmup_iterations,
            });
        }
        Ok(())
    }
}

impl Engine for EngineHandle {
    fn model_info(&self) -> &ModelInfo {
        &self.info
    }

    fn submit(&self, request: GenerateRequest) -> Result<GenerationStream, SubmitError> {
        self.refuse_if_not_accepting(&self.shared.lock())?;
        let (outputs, received) = mpsc::unbounded_channel();
        let mut sequence = self.validate(&request, outputs)?;
        let mut state = self.shared.lock();
        self.refuse_if_not_accepting(&state)?;
        state.requests_total += 1;
        if state.waiting.len() >= self.queue_limit {
            return Err(SubmitError::QueueFull {
                limit: self.queue_limit,
            });
        }
        sequence.order = state.next_order;
        state.next_order += 1;
        tracing::debug!(
            request = %sequence.request_id,
            prompt_tokens = sequence.prompt_len,
            "request queued"
        );
        self.shared.interrupt.offer(sequence.priority);
        state.enqueue(sequence);
        drop(state);
        self.shared.wake.notify_all();
        Ok(GenerationStream::new(RequestStream::new(
            received,
            Arc::clone(&self.model),
            request.params.stop,
            request.params.min_tokens,
        )))
    }

    fn state(&self) -> EngineState {
        let state = self.shared.lock();
        if state.drained {
            EngineState::Drained
        } else if state.draining {
            EngineState::Draining
        } else if state.warming_up {
            EngineState::WarmingUp {
                done: state.warmup_done,
                total: self.warmup_iterations,
            }
        } else {
            EngineState::Ready
        }
    }

    fn load(&self) -> LoadSnapshot {
        let state = self.shared.lock();
        LoadSnapshot {
            waiting: state.waiting.len(),
            requests_total: state.requests_total,
            ..state.stats
        }
    }

    fn failure(&self) -> Option<String> {
        // A lost rank is noticed by the group's heartbeat even while the engine idles.
        let failure = self.shared.lock().failure.clone();
        failure.or_else(|| self.model.group_failure().map(|err| err.to_string()))
    }

    fn begin_drain(&self) {
        self.shared.lock().draining = true;
        self.shared.wake.notify_all();
    }

    fn apply_chat_template(&self, messages: &[ChatMessage]) -> Result<String, SubmitError> {
        self.model
            .tokenizer()
            .apply_chat_template(messages, true)
            .map_err(|err| {
                SubmitError::invalid(
                    "messages",
                    format!("cannot apply the chat template: {err:#}"),
                )
            })
    }

    fn tokenize(&self, text: &str) -> Result<Vec<u32>, SubmitError> {
        Ok(self.model.tokenizer().encode(text))
    }

    fn kv_events(&self) -> Option<&kv_events::KvEventLog> {
        Some(&self.shared.kv_events)
    }

    fn prompt_recipe(&self) -> anyhow::Result<PromptRecipe> {
        self.model.tokenizer().recipe(
            self.model.config(),
            &self.info.name,
            self.shared.kv_events.block_size,
        )
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.wake.notify_all();
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .take();
        if let Some(thread) = thread
            && thread.join().is_err()
        {
            tracing::error!("the engine thread panicked");
        }
    }
}

/// Rejects configurations the engine cannot run with.
fn check_config(cfg: &EngineConfig) -> anyhow::Result<()> {
    if cfg.max_batch_size == 0 {
        bail!("max_batch_size must be at least 1");
    }
    if cfg.max_num_batched_tokens == 0 {
        bail!("max_num_batched_tokens must be at least 1");
    }
    if cfg.block_size == 0 {
        bail!("block_size must be at least 1");
    }
    if cfg.queue_limit == 0 {
        bail!("queue_limit must be at least 1");
    }
    Ok(())
}

//! The contract between the serving surfaces (gRPC, HTTP) and the engine.
//!
//! The server layer only ever sees this module: it submits a [`GenerateRequest`], reads a
//! stream of [`GenerationEvent`]s, and polls [`LoadSnapshot`] for metrics and the operator's
//! load signal. Dropping the stream cancels the request inside the engine. The engine core
//! produces token ids; the stream turns them into text (and applies stop strings) per request.

use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::mpsc;

/// What to generate from.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Plain text, tokenised by the engine (no chat template applied).
    Text(String),
    /// Already-tokenised input ids.
    Tokens(Vec<u32>),
}

/// Sampling settings of one request. Validated by the engine on submit.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Upper bound on generated tokens; `None` means "until the context is full".
    pub max_tokens: Option<u32>,
    /// 0 selects greedy decoding.
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1].
    pub top_p: f32,
    /// 0 disables top-k.
    pub top_k: u32,
    /// Tokens whose probability is below `min_p` times the most likely token's are never
    /// sampled; in [0, 1], 0 disables it.
    pub min_p: f32,
    /// Divides positive logits and multiplies negative ones of every token already in the
    /// prompt or the output (Hugging Face's and vLLM's definition); 1 disables it.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already in the output; in [-2, 2].
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it occurs in the output; in [-2, 2].
    pub frequency_penalty: f32,
    /// Fixes the random stream so the same request gives the same text.
    pub seed: Option<u64>,
    /// Generation stops before any of these strings; they are not returned.
    pub stop: Vec<String>,
    /// Extra token ids that end generation (the model's end-of-sequence ids always do).
    pub stop_token_ids: Vec<u32>,
    /// No end-of-sequence id, stop id or stop string ends generation before this many
    /// tokens: the ids that would end it are never sampled until then, as in vLLM.
    pub min_tokens: u32,
    /// The model's end-of-sequence ids do not end generation (requested stop ids and
    /// strings still do).
    pub ignore_eos: bool,
}

impl SamplingParams {
    /// The fewest tokens a request may ask for: asking for none is a mistake, not a no-op.
    pub const MIN_MAX_TOKENS: u32 = 1;
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_tokens: Some(16),
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            min_tokens: 0,
            ignore_eos: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    /// Caller-chosen id, echoed in logs.
    pub id: String,
    pub prompt: Prompt,
    pub params: SamplingParams,
    /// Scheduling priority, higher first (the router's flow control passes the one it admitted
    /// the request at); equal priorities run in arrival order. A waiting request of a higher
    /// priority runs its prompt in a step of its own and may preempt lower ones.
    pub priority: i32,
}

/// One chat message, for chat-template application (defined with the tokenizer that applies
/// the template).
pub use crate::model::ChatMessage;

pub use crate::engine::kv_events::{CacheEvent, CacheUpdate, KvEventLog};
pub use npufleet_contract::prompt::PromptRecipe;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string/token.
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
}

impl FinishReason {
    pub fn as_openai(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prompt tokens served from the prefix cache instead of being computed.
    pub cached_prompt_tokens: u32,
}

/// Where the time of one request went, measured by the engine.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RequestTimings {
    /// From submit until the request entered the running batch.
    pub queued: Duration,
    /// From submit until the first generated token.
    pub first_token: Duration,
    /// From submit until the end.
    pub total: Duration,
}

#[derive(Debug, Clone, PartialEq)]
pub enum GenerationEvent {
    /// New text. `text` may be empty when a token ends inside a multi-byte character;
    /// the bytes follow with a later token, so concatenating every `text` gives valid UTF-8.
    Token { token_id: u32, text: String },
    /// The last event of a successful request.
    Finished {
        reason: FinishReason,
        usage: Usage,
        timings: RequestTimings,
    },
    /// The request failed after it was accepted (for example a lost tensor-parallel rank).
    Failed { message: String },
}

/// Where a [`GenerationStream`]'s events come from: the engine's per-request stage, or any
/// other producer (a channel of ready-made events serves tests of the protocol layers).
pub trait EventSource: Send {
    /// The next event, `Ready(None)` after the final one.
    fn poll_event(&mut self, cx: &mut Context<'_>) -> Poll<Option<GenerationEvent>>;
    /// [`EventSource::poll_event`] for synchronous callers; panics inside an async context.
    fn blocking_event(&mut self) -> Option<GenerationEvent>;
}

impl EventSource for mpsc::UnboundedReceiver<GenerationEvent> {
    fn poll_event(&mut self, cx: &mut Context<'_>) -> Poll<Option<GenerationEvent>> {
        self.poll_recv(cx)
    }

    fn blocking_event(&mut self) -> Option<GenerationEvent> {
        self.blocking_recv()
    }
}

/// The events of one request, in order; the last is `Finished` or `Failed`. Dropping the
/// stream cancels the request inside the engine.
pub struct GenerationStream(Box<dyn EventSource>);

impl std::fmt::Debug for GenerationStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GenerationStream").finish_non_exhaustive()
    }
}

impl GenerationStream {
    pub fn new(source: impl EventSource + 'static) -> Self {
        Self(Box::new(source))
    }

    /// The next event, or `None` after the final one.
    pub async fn recv(&mut self) -> Option<GenerationEvent> {
        std::future::poll_fn(|cx| self.0.poll_event(cx)).await
    }

    /// [`GenerationStream::recv`] for synchronous callers; panics inside an async context.
    pub fn blocking_recv(&mut self) -> Option<GenerationEvent> {
        self.0.blocking_event()
    }

    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<GenerationEvent>> {
        self.0.poll_event(cx)
    }
}

/// Why a request was not accepted. Each maps to one protocol status.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SubmitError {
    /// HTTP 400 / gRPC INVALID_ARGUMENT. `param` names the request field at fault, in the
    /// names [`SamplingParams`] uses (`prompt` for the prompt).
    #[error("{message}")]
    Invalid {
        message: String,
        param: Option<&'static str>,
    },
    /// HTTP 429 / gRPC RESOURCE_EXHAUSTED.
    #[error("the waiting queue is full ({limit} requests); retry later")]
    QueueFull { limit: usize },
    /// HTTP 503 / gRPC UNAVAILABLE.
    #[error("the model is warming up ({done}/{total} iterations)")]
    WarmingUp { done: u32, total: u32 },
    /// HTTP 503 / gRPC UNAVAILABLE.
    #[error("the worker is draining and accepts no new requests")]
    Draining,
}

impl SubmitError {
    pub fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        SubmitError::Invalid {
            message: message.into(),
            param: Some(param),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineState {
    WarmingUp {
        done: u32,
        total: u32,
    },
    Ready,
    Draining,
    /// Draining finished: nothing queued or running.
    Drained,
}

/// A cheap, consistent view of the engine's load, read at sub-second cadence.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LoadSnapshot {
    pub waiting: usize,
    pub running: usize,
    pub queue_limit: usize,
    pub max_batch_size: usize,
    /// Fraction of KV-cache blocks in use, 0..=1.
    pub kv_cache_usage: f64,
    pub kv_blocks_total: usize,
    /// Positions per KV-cache block.
    pub block_size: usize,
    /// Most prompt positions one request computes in a step: a new prompt waits for at most
    /// this much of a longer one begun before it.
    pub prompt_chunk_tokens: usize,
    /// Counters since start.
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    pub prefix_cache_queries_total: u64,
    pub prefix_cache_hits_total: u64,
    pub preemptions_total: u64,
    pub steps_total: u64,
    /// Steps stopped before their end for a higher priority's request (in `steps_total` too).
    pub steps_interrupted_total: u64,
    /// Batch size of the last engine step.
    pub last_batch_size: usize,
    /// Steps that computed prompt positions, sized by the positions they computed.
    pub prefill_steps: StepSums,
    /// Steps of decodes only, sized by their batch.
    pub decode_steps: StepSums,
    /// Valid requests submitted, refused ones included.
    pub requests_total: u64,
    /// Requests admitted to the running batch (their prompts counted in
    /// `prompt_tokens_total`).
    pub requests_admitted_total: u64,
    /// Requests that produced their last token.
    pub requests_finished_total: u64,
    /// Sum of the squared prompt lengths of admitted requests.
    pub prompt_tokens_squared_total: f64,
    /// The warm-up's passes, timed (not in the step sums above): prompt chunks at several
    /// lengths and decodes at several batch sizes, a first measure of this serving shape.
    pub warmup_prefill_steps: StepSums,
    pub warmup_decode_steps: StepSums,
}

/// Running sums over engine steps of one kind from which a reader fits the step's duration
/// as a line in its size by least squares, using the differences of two readings.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepSums {
    pub steps: u64,
    pub size: u64,
    pub seconds: f64,
    pub size_squared: f64,
    pub size_seconds: f64,
}

impl StepSums {
    pub fn add(&mut self, size: usize, seconds: f64) {
        let x = size as f64;
        self.steps += 1;
        self.size += size as u64;
        self.seconds += seconds;
        self.size_squared += x * x;
        self.size_seconds += x * seconds;
    }
}

/// What the served model is.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    pub name: String,
    pub architecture: String,
    pub context_length: usize,
    pub vocab_size: usize,
    pub tensor_parallel: usize,
    pub precision: String,
}

/// The engine as the server sees it. Implemented by [`crate::engine::EngineHandle`].
pub trait Engine: Send + Sync + 'static {
    fn model_info(&self) -> &ModelInfo;
    /// Accepts or rejects at once; never blocks on a full queue.
    fn submit(&self, request: GenerateRequest) -> Result<GenerationStream, SubmitError>;
    fn state(&self) -> EngineState;
    fn load(&self) -> LoadSnapshot;
    /// Stop accepting; everything queued or running still completes.
    fn begin_drain(&self);
    /// Why the engine stopped serving for good (it then reports [`EngineState::Drained`]).
    fn failure(&self) -> Option<String>;
    fn apply_chat_template(&self, messages: &[ChatMessage]) -> Result<String, SubmitError>;
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, SubmitError>;
    /// The prefix cache's changes, for routers that send a prompt where its prefix is cached.
    fn kv_events(&self) -> Option<&KvEventLog> {
        None
    }
    /// How prompts become this engine's token ids, for those routers to name blocks alike.
    fn prompt_recipe(&self) -> anyhow::Result<PromptRecipe> {
        anyhow::bail!("this engine publishes no prompt recipe")
    }
}

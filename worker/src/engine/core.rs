//! The engine core's thread: warm-up, then one step after another, each a schedule, an
//! `execute` (forward pass and sampling) and an `update` (the sampled ids appended,
//! finished sequences released). Token ids in, token ids out.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;

use npufleet_contract::scheduling::LONGER_PROMPT_RATIO;

use super::blocks::{BlockManager, SequenceBlocks};
use super::stream::SequenceOutput;
use super::warm_up::WarmUpPlan;
use super::{EngineConfig, Sequence, Shared, SharedState, check_config};
use crate::api::{FinishReason, LoadSnapshot, RequestTimings, Usage};
use crate::model::{ForwardError, KvCache, Model, SequenceChunk, StepBuffers, WeightPrecision};

/// Sizes derived from the model and the configuration before the engine starts.
#[derive(Debug, Clone)]
pub(super) struct Limits {
    pub num_blocks: usize,
    /// Longest sequence the context length and the KV cache allow.
    pub max_sequence_tokens: usize,
    /// Tokenised prefix templates.
    templates: Vec<Vec<u32>>,
}

/// Prefix-cache namespace of a precision: K/V computed at one precision is not reused by a
/// sequence running at another.
pub(super) fn precision_namespace(precision: WeightPrecision) -> u16 {
    match precision {
        WeightPrecision::Int8 => 0,
        WeightPrecision::Full => 1,
    }
}

/// Prompt positions a step computes for a sequence while a higher priority runs beside it,
/// or a much shorter prompt's first token ([`LONGER_PROMPT_RATIO`]): the chunk shares the
/// step with the others, and a long one would stretch their wait many times over (a
/// 512-position chunk of a small model on CPU takes about as long as a hundred decode
/// steps); 32 positions about double a decode step there, and the prompt still advances
/// every step.
const OUTRANKED_PROMPT_CHUNK: usize = 32;

/// Waiting requests the scheduler orders by length, from the front of the queue: enough to
/// find the short prompts among a burst, bounded because each is looked up in the prefix
/// cache every step.
const SHORTEST_FIRST_WINDOW: usize = 16;

/// How a step's forward pass ended.
enum Step {
    Completed,
    /// Stopped for a more urgent request before its end: the step counts for nothing.
    Interrupted,
}

/// A prompt the step may advance ([`EngineCore::prompts_by_length`]).
struct Prompt {
    order: u64,
    priority: i32,
    /// Positions left to compute.
    left: usize,
    /// Positions computed, or held by the prefix cache.
    done: usize,
    /// Not admitted yet.
    waiting: bool,
}

/// One sequence's share of an engine step: positions `start..start + len`.
#[derive(Debug, Clone, Copy)]
struct Scheduled {
    order: u64,
    start: usize,
    len: usize,
}

pub(super) struct EngineCore {
    model: Arc<Model>,
    cfg: EngineConfig,
    limits: Limits,
    shared: Arc<Shared>,
    kv: KvCache,
    blocks: BlockManager,
    /// Admitted sequences by submission order (oldest first).
    running: BTreeMap<u64, Sequence>,
    /// Blocks of the prefix templates, referenced for the engine's lifetime.
    pinned: Vec<SequenceBlocks>,
    /// Counters published to [`SharedState::stats`] after each step.
    counters: LoadSnapshot,
    /// The forward pass's activations and logits, reused by every step.
    buffers: StepBuffers,
    /// The token `execute` sampled for each item of the step's plan (`None` where the item
    /// ends inside its prompt), reused by every step.
    sampled: Vec<Option<u32>>,
}

impl EngineCore {
    pub(super) fn plan(model: &Model, cfg: &EngineConfig) -> anyhow::Result<Limits> {
        check_config(cfg)?;
        let block_bytes = super::kv_block_bytes(model, cfg);
        if let super::KvCacheSize::ShareOfMemoryLimit { limit_bytes, .. } = cfg.kv_cache
            && model.weight_bytes() >= limit_bytes
        {
            bail!(
                "the model does not fit: its weights take {} bytes ({:.1} MiB) under the {} \
                 precision policy, and the memory limit is {limit_bytes} bytes ({:.1} MiB); \
                 give the pod more memory or serve a smaller quantisation",
                model.weight_bytes(),
                mib(model.weight_bytes()),
                model.policy().precision(),
                mib(limit_bytes)
            );
        }
        let num_blocks = super::kv_cache_blocks(model, cfg);
        if num_blocks == 0 {
            let budget = match cfg.kv_cache {
                super::KvCacheSize::ShareOfMemoryLimit { limit_bytes, share } => format!(
                    "{share} of the memory limit of {limit_bytes} bytes less {} bytes of weights",
                    model.weight_bytes()
                ),
                size => format!("{} bytes", size.bytes(block_bytes, model.weight_bytes())),
            };
            bail!(
                "the KV cache has room for no block: one block of {} positions takes \
                 {block_bytes} bytes and the cache gets {budget}",
                cfg.block_size
            );
        }
        let config = model.config();
        let templates: Vec<Vec<u32>> = cfg
            .prefix_templates
            .iter()
            .filter(|template| !template.is_empty())
            .map(|template| model.tokenizer().encode_prompt(config, template))
            .collect();
        let precisions = model.policy().precisions().len();
        let pinned_blocks: usize = templates
            .iter()
            .map(|tokens| tokens.len().div_ceil(cfg.block_size) * precisions)
            .sum();
        if pinned_blocks >= num_blocks {
            bail!(
                "the prefix templates need {pinned_blocks} KV-cache blocks but the cache has only {num_blocks}"
            );
        }
        let max_sequence_tokens = config
            .context_length
            .min((num_blocks - pinned_blocks) * cfg.block_size);
        if max_sequence_tokens < 2 {
            bail!("the KV cache is too small to hold a prompt and one generated token");
        }
        Ok(Limits {
            num_blocks,
            max_sequence_tokens,
            templates,
        })
    }

    pub(super) fn new(
        model: Arc<Model>,
        cfg: EngineConfig,
        limits: Limits,
        shared: &Arc<Shared>,
    ) -> Self {
        let kv = model.new_kv_cache(limits.num_blocks, cfg.block_size, cfg.kv_dtype);
        let blocks = BlockManager::new(limits.num_blocks, cfg.block_size);
        let max_batch_size = cfg.max_batch_size;
        Self {
            model,
            cfg,
            limits,
            shared: Arc::clone(shared),
            kv,
            blocks,
            running: BTreeMap::new(),
            pinned: Vec::new(),
            counters: LoadSnapshot::default(),
            buffers: StepBuffers::default(),
            sampled: Vec::with_capacity(max_batch_size),
        }
    }

    pub(super) fn run(mut self) {
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
            if self.warm_up() {
                self.serve();
            }
        }));
        let panicked = outcome.err().map(|panic| {
            panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into())
        });
        // A lost tensor-parallel rank ends the group for good: the operator recreates it.
        let group_lost = self.model.group_failure().map(|err| err.to_string());
        if let Some(message) = panicked.or(group_lost) {
            tracing::error!(%message, "the engine stopped");
            let failure = SequenceOutput::Failed {
                message: format!("the engine stopped: {message}"),
            };
            let mut state = self.shared.lock();
            state.failure = Some(message);
            state.warming_up = false;
            state.draining = true;
            state.drained = true;
            for sequence in state
                .waiting
                .drain(..)
                .chain(std::mem::take(&mut self.running).into_values())
            {
                let _ = sequence.outputs.send(failure.clone());
            }
        }
    }

    /// Runs the dummy iterations ([`WarmUpPlan`]), timing them, and computes the prefix
    /// templates. Returns false when the engine was shut down meanwhile.
    fn warm_up(&mut self) -> bool {
        let total = self.cfg.warmup_iterations;
        let config = self.model.config();
        let plan = WarmUpPlan::new(
            self.cfg.block_size,
            config.context_length,
            self.cfg.max_num_batched_tokens,
            self.cfg.max_batch_size,
            self.limits.num_blocks,
        );
        let vocab = config.vocab_size.max(1);
        let dummy_tokens: Vec<Vec<u32>> = (0..plan.rows)
            .map(|row| {
                (0..plan.span)
                    .map(|pos| ((row * plan.span + pos) * 7919 % vocab) as u32)
                    .collect()
            })
            .collect();
        let tables: Vec<Vec<u32>> = (0..plan.rows)
            .map(|row| {
                let first = (row * plan.blocks_per_row) as u32;
                (first..first + plan.blocks_per_row as u32).collect()
            })
            .collect();
        for iteration in 0..total {
            if self.shared.lock().shutdown {
                return false;
            }
            let pass = plan.pass(iteration);
            let precision = self.model.policy().for_prompt(pass.len.max(1));
            let batch: Vec<SequenceChunk<'_>> = (0..pass.rows)
                .map(|row| SequenceChunk {
                    tokens: &dummy_tokens[row][pass.start..pass.start + pass.len],
                    start_pos: pass.start,
                    block_table: &tables[row],
                    want_logits: true,
                    precision,
                })
                .collect();
            let started = Instant::now();
            match self
                .model
                .forward_into(&mut self.kv, &batch, &mut self.buffers)
            {
                Ok(()) if plan.timed(iteration) => {
                    let seconds = started.elapsed().as_secs_f64();
                    let sums = if pass.is_prefill() {
                        &mut self.counters.warmup_prefill_steps
                    } else {
                        &mut self.counters.warmup_decode_steps
                    };
                    sums.add(pass.size(), seconds);
                }
                Ok(()) => {}
                Err(err) => {
                    tracing::warn!(error = %err, "warm-up forward pass failed");
                    if self.model.group_failure().is_some() {
                        return false;
                    }
                }
            }
            self.shared.lock().warmup_done = iteration + 1;
        }

        let templates = std::mem::take(&mut self.limits.templates);
        for tokens in &templates {
            for precision in self.model.policy().precisions() {
                if self.shared.lock().shutdown {
                    return false;
                }
                self.compute_template(tokens, precision);
            }
        }
        let shared = Arc::clone(&self.shared);
        let mut state = shared.lock();
        state.warming_up = false;
        self.publish(&mut state);
        tracing::info!(
            iterations = total,
            templates = templates.len(),
            "engine warmed up"
        );
        true
    }

    fn compute_template(&mut self, tokens: &[u32], precision: WeightPrecision) {
        let mut blocks = SequenceBlocks::in_namespace(precision_namespace(precision));
        let mut computed = self.blocks.match_prefix(tokens, &mut blocks);
        if !self.blocks.grow(&mut blocks, tokens.len()) {
            tracing::warn!("no KV-cache room for a prefix template");
            self.blocks.free(&mut blocks);
            return;
        }
        while computed < tokens.len() {
            let len = (tokens.len() - computed).min(self.cfg.max_num_batched_tokens);
            let chunk = SequenceChunk {
                tokens: &tokens[computed..computed + len],
                start_pos: computed,
                block_table: &blocks.table,
                want_logits: false,
                precision,
            };
            if let Err(err) = self
                .model
                .forward_into(&mut self.kv, &[chunk], &mut self.buffers)
            {
                tracing::warn!(error = %err, "computing a prefix template failed");
                self.blocks.free(&mut blocks);
                return;
            }
            computed += len;
        }
        self.blocks
            .register_full_blocks(&mut blocks, tokens, tokens.len());
        self.pinned.push(blocks);
    }

    fn serve(&mut self) {
        let shared = Arc::clone(&self.shared);
        loop {
            let mut state = shared.lock();
            loop {
                if state.shutdown {
                    return;
                }
                self.drop_cancelled(&mut state);
                if !self.running.is_empty() || !state.waiting.is_empty() {
                    break;
                }
                if state.draining && !state.drained {
                    state.drained = true;
                    tracing::info!("drained: nothing queued or running");
                }
                self.publish(&mut state);
                state = shared
                    .wake
                    .wait(state)
                    .unwrap_or_else(|poison| poison.into_inner());
            }
            let plan = self.schedule(&mut state);
            if plan.is_empty() {
                // Nothing fits this step; wait for a cancellation or a finish elsewhere
                // rather than spinning.
                self.publish(&mut state);
                drop(
                    shared
                        .wake
                        .wait_timeout(state, Duration::from_millis(5))
                        .unwrap_or_else(|poison| poison.into_inner()),
                );
                continue;
            }
            let top = plan.iter().map(|item| self.running[&item.order].priority);
            self.shared.interrupt.arm(top.max().unwrap_or(i32::MAX));
            drop(state);
            let started = Instant::now();
            match self.execute(&plan) {
                Ok(Step::Completed) => {
                    self.count_step(&plan, started.elapsed().as_secs_f64());
                    self.update(&plan);
                }
                Ok(Step::Interrupted) => {
                    tracing::debug!(
                        sequences = plan.len(),
                        "step interrupted for a higher priority"
                    );
                    self.counters.steps_interrupted_total += 1;
                }
                Err(message) => {
                    tracing::error!(%message);
                    for item in &plan {
                        self.finish_with(
                            item.order,
                            SequenceOutput::Failed {
                                message: message.clone(),
                            },
                        );
                    }
                }
            }
            if self.model.group_failure().is_some() {
                return;
            }
            let mut state = shared.lock();
            self.counters.steps_total += 1;
            self.counters.last_batch_size = plan.len();
            self.publish(&mut state);
        }
    }

    /// Adds a step's duration to the sums of its kind: a step that computed more than one
    /// position for some sequence ran a prompt chunk.
    fn count_step(&mut self, plan: &[Scheduled], seconds: f64) {
        let positions: usize = plan.iter().map(|item| item.len).sum();
        if positions > plan.len() {
            self.counters.prefill_steps.add(positions, seconds);
        } else {
            self.counters.decode_steps.add(plan.len(), seconds);
        }
    }

    /// Most positions of one prompt in one step: the threshold, or the step's whole budget.
    fn prompt_chunk(&self) -> usize {
        match self.cfg.long_prefill_token_threshold {
            0 => self.cfg.max_num_batched_tokens,
            threshold => threshold.min(self.cfg.max_num_batched_tokens),
        }
    }

    fn publish(&mut self, state: &mut SharedState) {
        self.shared.kv_events.publish(self.blocks.take_events());
        let total = self.blocks.num_blocks();
        state.stats = LoadSnapshot {
            waiting: state.waiting.len(),
            running: self.running.len(),
            queue_limit: self.cfg.queue_limit,
            max_batch_size: self.cfg.max_batch_size,
            kv_cache_usage: self.blocks.num_in_use() as f64 / total as f64,
            kv_blocks_total: total,
            block_size: self.cfg.block_size,
            prompt_chunk_tokens: self.prompt_chunk(),
            ..self.counters
        };
    }

    /// Forgets requests whose caller dropped the event stream, freeing their blocks.
    fn drop_cancelled(&mut self, state: &mut SharedState) {
        let cancelled: Vec<u64> = self
            .running
            .iter()
            .filter(|(_, sequence)| sequence.outputs.is_closed())
            .map(|(&order, _)| order)
            .collect();
        for order in cancelled {
            if let Some(mut sequence) = self.running.remove(&order) {
                tracing::debug!(request = %sequence.request_id, "request cancelled while running");
                self.blocks.free(&mut sequence.blocks);
            }
        }
        state
            .waiting
            .retain(|sequence| !sequence.outputs.is_closed());
    }

    /// Picks this step's work: decodes first so they keep flowing, then prompts, running
    /// ones' chunks and newly admitted ones alike, the shortest first
    /// ([`EngineCore::prompts_by_length`]), all within the token budget, each by at most
    /// `long_prefill_token_threshold` positions. Beside a prompt this step finishes, one
    /// more than [`LONGER_PROMPT_RATIO`] times longer advances [`OUTRANKED_PROMPT_CHUNK`]
    /// positions: a chat's next turn that arrives during a new document's prefill gets its
    /// first token after a chunk of the document and a step of its own size, not after the
    /// whole document. A prompt of a higher priority than some running sequence runs
    /// without those: a step takes longer with every sequence in it, and the prompt's first
    /// token should not wait on lower priorities' decodes. Beside a higher priority's
    /// decodes, a lower priority's prompt advances [`OUTRANKED_PROMPT_CHUNK`] positions a
    /// step.
    fn schedule(&mut self, state: &mut SharedState) -> Vec<Scheduled> {
        let Some(urgent) = self.urgent_priority(state) else {
            return self.schedule_from(i32::MIN, state);
        };
        let plan = self.schedule_from(urgent, state);
        if plan.is_empty() {
            // The urgent prompt found no room; the others must not stall meanwhile.
            return self.schedule_from(i32::MIN, state);
        }
        plan
    }

    /// The priority of the most urgent prompt, a waiting request's or a running sequence's,
    /// when it is above the lowest running priority.
    fn urgent_priority(&self, state: &SharedState) -> Option<i32> {
        let lowest = self.running.values().map(|s| s.priority).min()?;
        let prompts = self
            .running
            .values()
            .filter(|s| s.tokens.len() - s.num_computed > 1)
            .map(|s| s.priority);
        let top = prompts
            .chain(state.waiting.front().map(|s| s.priority))
            .max()?;
        (top > lowest).then_some(top)
    }

    /// The running sequence to preempt first: the lowest priority, of those the youngest.
    fn victim(&self) -> Option<(i32, u64)> {
        self.running
            .iter()
            .map(|(&order, s)| (s.priority, order))
            .min_by_key(|&(priority, order)| (priority, std::cmp::Reverse(order)))
    }

    /// [`EngineCore::schedule`] for the sequences of priority `floor` and above.
    fn schedule_from(&mut self, floor: i32, state: &mut SharedState) -> Vec<Scheduled> {
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut plan: Vec<Scheduled> = Vec::new();
        let preemptions = self.counters.preemptions_total;
        let mut orders: Vec<(i32, u64)> = self
            .running
            .iter()
            .map(|(&order, s)| (s.priority, order))
            .filter(|&(priority, _)| priority >= floor)
            .collect();
        orders.sort_by_key(|&(priority, order)| (std::cmp::Reverse(priority), order));
        let top = orders.first().map_or(i32::MIN, |&(priority, _)| priority);
        for &(_, order) in &orders {
            if budget == 0 {
                break;
            }
            let decoding = self
                .running
                .get(&order)
                .is_some_and(|sequence| sequence.tokens.len() - sequence.num_computed == 1);
            if decoding {
                self.advance(order, 1, &mut plan, &mut budget, state);
            }
        }
        // Freshly preempted sequences are at the queue's front; admitting now would only
        // thrash.
        let mut admitting = self.counters.preemptions_total == preemptions;
        // The shortest prompt whose last positions this step computes.
        let mut finishing: Option<usize> = None;
        let chunk = self.prompt_chunk();
        for prompt in self.prompts_by_length(floor, budget, state) {
            if budget == 0 {
                break;
            }
            let outranked = prompt.priority < top
                || finishing.is_some_and(|shortest| prompt.left > LONGER_PROMPT_RATIO * shortest);
            let limit = if outranked {
                OUTRANKED_PROMPT_CHUNK
            } else {
                usize::MAX
            };
            let len = prompt.left.min(budget).min(limit).min(chunk);
            let scheduled = if prompt.waiting {
                admitting && {
                    admitting = self.admit(prompt.order, len, &mut plan, &mut budget, state);
                    admitting
                }
            } else if self.running.contains_key(&prompt.order) {
                let before = self.counters.preemptions_total;
                let advanced = self.advance(prompt.order, len, &mut plan, &mut budget, state);
                admitting &= self.counters.preemptions_total == before;
                advanced
            } else {
                false
            };
            if scheduled && len == prompt.left && finishing.is_none() {
                finishing = Some(len);
            }
        }
        plan
    }

    /// The prompts a step of priority `floor` and above may advance, the highest priority
    /// first and within a priority the fewest positions left to compute first (ties by
    /// age): a short prompt's first token should not wait on a long prompt that came first,
    /// for the long one is delayed by only the short one's compute. Waiting requests count
    /// by what the prefix cache does not hold of them, and only the first
    /// [`SHORTEST_FIRST_WINDOW`] of the queue are looked at; only the oldest, while it
    /// finds no room.
    fn prompts_by_length(&self, floor: i32, budget: usize, state: &SharedState) -> Vec<Prompt> {
        let running = self
            .running
            .values()
            .filter(|s| s.priority >= floor && s.tokens.len() - s.num_computed > 1)
            .map(|s| Prompt {
                order: s.order,
                priority: s.priority,
                left: s.tokens.len() - s.num_computed,
                done: s.num_computed,
                waiting: false,
            });
        let mut waiting: Vec<Prompt> = state
            .waiting
            .iter()
            .take_while(|s| s.priority >= floor)
            .take(SHORTEST_FIRST_WINDOW)
            .map(|s| {
                let cached = self.blocks.cached_prefix_len(&s.tokens, &s.blocks);
                Prompt {
                    order: s.order,
                    priority: s.priority,
                    left: s.tokens.len() - cached,
                    done: cached,
                    waiting: true,
                }
            })
            .collect();
        // Under a full batch or cache, shorter requests would take the room the oldest one
        // waits for, step after step.
        if waiting
            .first()
            .is_some_and(|oldest| !self.has_room_for(oldest, budget))
        {
            waiting.truncate(1);
        }
        let mut prompts: Vec<Prompt> = running.chain(waiting).collect();
        prompts.sort_by_key(|p| (std::cmp::Reverse(p.priority), p.left, p.order));
        prompts
    }

    /// Whether the waiting `prompt` could be admitted with up to `budget` positions now,
    /// preempting nothing.
    fn has_room_for(&self, prompt: &Prompt, budget: usize) -> bool {
        let end = prompt.done + prompt.left.min(budget);
        let needed = self.blocks.blocks_for(end) - self.blocks.blocks_for(prompt.done);
        self.running.len() < self.cfg.max_batch_size && needed <= self.blocks.num_available()
    }

    /// Admits the waiting request `order` with its first `len` uncached positions in this
    /// step. A full batch or cache makes room for it by preempting a lower priority;
    /// otherwise it waits, and returns false: the requests after it in this step's order
    /// wait too.
    fn admit(
        &mut self,
        order: u64,
        len: usize,
        plan: &mut Vec<Scheduled>,
        budget: &mut usize,
        state: &mut SharedState,
    ) -> bool {
        loop {
            let Some(at) = state.waiting.iter().position(|s| s.order == order) else {
                return false;
            };
            let sequence = &mut state.waiting[at];
            let priority = sequence.priority;
            let room = if self.running.len() >= self.cfg.max_batch_size {
                None
            } else {
                let cached = self
                    .blocks
                    .match_prefix(&sequence.tokens, &mut sequence.blocks);
                let len = len.min(sequence.tokens.len() - cached);
                if self.blocks.grow(&mut sequence.blocks, cached + len) {
                    Some((cached, len))
                } else {
                    self.blocks.free(&mut sequence.blocks);
                    None
                }
            };
            let Some((cached, len)) = room else {
                match self.victim() {
                    Some((lowest, victim)) if lowest < priority => {
                        self.preempt(victim, plan, budget, state);
                        continue;
                    }
                    _ => return false,
                }
            };
            let mut sequence = state
                .waiting
                .remove(at)
                .expect("the position was just found");
            sequence.num_computed = cached;
            if sequence.cached_prompt_tokens.is_none() {
                let cached_prompt = cached.min(sequence.prompt_len);
                sequence.cached_prompt_tokens = Some(cached_prompt);
                sequence.admitted = Some(Instant::now());
                self.counters.prompt_tokens_total += sequence.prompt_len as u64;
                self.counters.requests_admitted_total += 1;
                self.counters.prompt_tokens_squared_total += (sequence.prompt_len as f64).powi(2);
                // Counted in tokens, as vLLM's prefix-cache queries and hits are.
                self.counters.prefix_cache_queries_total += sequence.prompt_len as u64;
                self.counters.prefix_cache_hits_total += cached_prompt as u64;
            }
            plan.push(Scheduled {
                order,
                start: cached,
                len,
            });
            *budget -= len;
            self.running.insert(order, sequence);
            return true;
        }
    }

    /// Plans the running sequence `order`'s next `len` positions in this step, when
    /// [`EngineCore::reserve`] finds them blocks.
    fn advance(
        &mut self,
        order: u64,
        len: usize,
        plan: &mut Vec<Scheduled>,
        budget: &mut usize,
        state: &mut SharedState,
    ) -> bool {
        if !self.reserve(order, len, plan, budget, state) {
            return false;
        }
        let start = self.running[&order].num_computed;
        plan.push(Scheduled { order, start, len });
        *budget -= len;
        true
    }

    /// Makes sure the running sequence `order` has blocks for `len` more positions,
    /// preempting [`EngineCore::victim`]s until it does. Returns false when the
    /// sequence itself had to be preempted.
    fn reserve(
        &mut self,
        order: u64,
        len: usize,
        plan: &mut Vec<Scheduled>,
        budget: &mut usize,
        state: &mut SharedState,
    ) -> bool {
        loop {
            let sequence = self
                .running
                .get_mut(&order)
                .expect("reserve is called for running sequences");
            let needed = sequence.num_computed + len;
            if self.blocks.grow(&mut sequence.blocks, needed) {
                return true;
            }
            let (_, victim) = self.victim().expect("the map holds at least this sequence");
            self.preempt(victim, plan, budget, state);
            if victim == order {
                return false;
            }
        }
    }

    /// Frees a running sequence's blocks and requeues it to be recomputed.
    fn preempt(
        &mut self,
        order: u64,
        plan: &mut Vec<Scheduled>,
        budget: &mut usize,
        state: &mut SharedState,
    ) {
        let Some(mut sequence) = self.running.remove(&order) else {
            return;
        };
        if let Some(at) = plan.iter().position(|item| item.order == order) {
            *budget += plan.remove(at).len;
        }
        self.blocks.free(&mut sequence.blocks);
        sequence.num_computed = 0;
        self.counters.preemptions_total += 1;
        tracing::debug!(
            request = %sequence.request_id,
            tokens = sequence.tokens.len(),
            "preempted for lack of KV-cache blocks"
        );
        state.requeue(sequence);
    }

    /// Runs one forward pass over the plan and samples the next token of every sequence
    /// whose prompt it completes, into `self.sampled`, unless a submission outranking the
    /// whole plan stops the pass ([`super::interrupt`]).
    fn execute(&mut self, plan: &[Scheduled]) -> Result<Step, String> {
        let batch: Vec<SequenceChunk<'_>> = plan
            .iter()
            .map(|item| {
                let sequence = &self.running[&item.order];
                SequenceChunk {
                    tokens: &sequence.tokens[item.start..item.start + item.len],
                    start_pos: item.start,
                    block_table: &sequence.blocks.table,
                    want_logits: item.start + item.len == sequence.tokens.len(),
                    precision: sequence.precision,
                }
            })
            .collect();
        let interrupt = &self.shared.interrupt;
        let result = self
            .model
            .forward_unless(&mut self.kv, &batch, &mut self.buffers, &|| {
                interrupt.raised()
            });
        drop(batch);
        match result {
            Ok(()) => {}
            Err(ForwardError::Interrupted { .. }) => return Ok(Step::Interrupted),
            Err(err) => return Err(format!("the forward pass failed: {err}")),
        }
        let mut logits = self.buffers.logits();
        self.sampled.clear();
        for item in plan {
            let sequence = self
                .running
                .get_mut(&item.order)
                .expect("planned sequences are running");
            let token = if item.start + item.len == sequence.tokens.len() {
                logits.next().map(|row| sequence.sampler.sample(row))
            } else {
                None
            };
            self.sampled.push(token);
        }
        Ok(Step::Completed)
    }

    /// Advances every sequence of the plan past its computed positions, appends the tokens
    /// `execute` sampled, and finishes sequences on a stop id or at their length limit.
    fn update(&mut self, plan: &[Scheduled]) {
        let mut finished = Vec::new();
        for (item, &sampled) in plan.iter().zip(&self.sampled) {
            let Some(sequence) = self.running.get_mut(&item.order) else {
                continue;
            };
            sequence.num_computed += item.len;
            self.blocks.register_full_blocks(
                &mut sequence.blocks,
                &sequence.tokens,
                sequence.num_computed,
            );
            if sequence.num_computed < sequence.tokens.len() {
                continue;
            }
            let Some(token) = sampled else {
                finished.push((
                    item.order,
                    Some(SequenceOutput::Failed {
                        message: "the model returned fewer logits than requested".into(),
                    }),
                ));
                continue;
            };
            self.counters.generation_tokens_total += 1;
            let output = accept_token(sequence, token);
            let ends = matches!(
                output,
                SequenceOutput::Token {
                    finish: Some(_),
                    ..
                }
            );
            let _ = sequence.outputs.send(output);
            if ends {
                self.counters.requests_finished_total += 1;
                finished.push((item.order, None));
            }
        }
        for (order, output) in finished {
            match output {
                Some(output) => self.finish_with(order, output),
                None => self.release(order),
            }
        }
    }

    /// Sends the final output and forgets the sequence.
    fn finish_with(&mut self, order: u64, output: SequenceOutput) {
        if let Some(sequence) = self.running.get(&order) {
            let _ = sequence.outputs.send(output);
        }
        self.release(order);
    }

    /// Forgets a sequence and frees its blocks.
    fn release(&mut self, order: u64) {
        if let Some(mut sequence) = self.running.remove(&order) {
            self.blocks.free(&mut sequence.blocks);
        }
    }
}

/// Appends a sampled token and says whether it is the sequence's last: a stop id once
/// `min_tokens` are generated (the sampler masks them before), or the length limit reached.
fn accept_token(sequence: &mut Sequence, token: u32) -> SequenceOutput {
    sequence.first_token.get_or_insert_with(Instant::now);
    sequence.tokens.push(token);
    let finish = if sequence.tokens.len() > sequence.min_len
        && sequence.stop_ids.binary_search(&token).is_ok()
    {
        Some(FinishReason::Stop)
    } else if sequence.tokens.len() >= sequence.max_len {
        Some(FinishReason::Length)
    } else {
        None
    };
    SequenceOutput::Token {
        token_id: token,
        finish,
        usage: usage_of(sequence),
        timings: timings_of(sequence),
    }
}

fn usage_of(sequence: &Sequence) -> Usage {
    Usage {
        prompt_tokens: sequence.prompt_len as u32,
        completion_tokens: (sequence.tokens.len() - sequence.prompt_len) as u32,
        cached_prompt_tokens: sequence.cached_prompt_tokens.unwrap_or(0) as u32,
    }
}

fn timings_of(sequence: &Sequence) -> RequestTimings {
    let since_submit =
        |at: Option<Instant>| at.map_or(Duration::ZERO, |at| at.duration_since(sequence.submitted));
    RequestTimings {
        queued: since_submit(sequence.admitted),
        first_token: since_submit(sequence.first_token),
        total: sequence.submitted.elapsed(),
    }
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

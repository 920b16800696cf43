//! Tensor-parallel greedy generation for `collective-bench --model`: rank 0 leads (broadcasts
//! each step's plan, see [`crate::collective::step`]) and the other ranks follow, each holding only its
//! shard. Measures decode time, the part of it spent inside collectives (waiting for slower
//! ranks included), and the part that is communication alone: after the decode every rank
//! replays the decode's collectives back to back, so no rank waits for another's compute.
//!
//! This is a command-line tool on top of the model layer, like the engine benchmark; the
//! collective library itself does not depend on the model.

use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::Context;

use crate::collective::step::{self, PlannedChunk, StepPlan};
use crate::collective::{Collective, CollectiveError};
use crate::model::{LoadOptions, Model, PrecisionPolicy, SequenceChunk, WeightPrecision};

const BLOCK_SIZE: usize = 16;

/// One collective call, by size, so the sequence can be replayed without the model.
#[derive(Debug, Clone, Copy)]
enum Call {
    AllReduce { len: usize },
    AllGather { len: usize },
    Broadcast { len: usize, root: usize },
}

/// Counts the wall time spent inside each collective call and records the calls.
pub struct TimedCollective {
    inner: Arc<dyn Collective>,
    nanos: AtomicU64,
    calls: Mutex<Vec<Call>>,
}

impl TimedCollective {
    pub fn new(inner: Arc<dyn Collective>) -> Self {
        TimedCollective {
            inner,
            nanos: AtomicU64::new(0),
            calls: Mutex::new(Vec::new()),
        }
    }

    pub fn seconds(&self) -> f64 {
        self.nanos.load(Ordering::Relaxed) as f64 / 1e9
    }

    fn timed<R>(&self, call: Call, op: impl FnOnce() -> R) -> R {
        self.calls
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(call);
        let started = Instant::now();
        let result = op();
        self.nanos
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        result
    }

    fn calls_made(&self) -> usize {
        self.calls
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .len()
    }

    /// Replays calls `range` of those recorded, back to back with no model work between
    /// them, on every rank (rank 0 chooses the range; every rank recorded the same calls).
    /// Returns rank 0's seconds for the fastest of [`REPLAYS`] replays: the time the decode's
    /// collectives take when no rank has to wait for another to finish computing.
    fn replay(&self, range: Option<Range<usize>>) -> anyhow::Result<f64> {
        let mut bounds = match &range {
            Some(range) => [range.start as u64, range.end as u64]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            None => Vec::new(),
        };
        self.inner.broadcast_bytes(&mut bounds, 0)?;
        let word = |i: usize| -> anyhow::Result<usize> {
            let bytes = bounds.get(i * 8..(i + 1) * 8).context("replay bounds")?;
            Ok(u64::from_le_bytes(bytes.try_into()?) as usize)
        };
        let (start, end) = (word(0)?, word(1)?);
        let calls = self
            .calls
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(start..end)
            .context("rank 0 asked to replay calls this rank did not make")?
            .to_vec();
        let rank = self.inner.rank();
        let mut fastest = f64::INFINITY;
        for _ in 0..REPLAYS {
            self.inner.all_reduce_sum(&mut [0.0])?;
            let started = Instant::now();
            for &call in &calls {
                match call {
                    Call::AllReduce { len } => self.inner.all_reduce_sum(&mut vec![1.0; len])?,
                    Call::AllGather { len } => self.inner.all_gather(
                        &vec![1.0; len],
                        &mut vec![0.0; len * self.inner.world_size()],
                    )?,
                    Call::Broadcast { len, root } => {
                        let mut bytes = if rank == root {
                            vec![1; len]
                        } else {
                            Vec::new()
                        };
                        self.inner.broadcast_bytes(&mut bytes, root)?;
                    }
                }
            }
            fastest = fastest.min(started.elapsed().as_secs_f64());
        }
        Ok(fastest)
    }
}

/// Replays of the decode's collectives; the fastest counts.
const REPLAYS: usize = 3;

impl Collective for TimedCollective {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        let call = Call::AllReduce { len: buf.len() };
        self.timed(call, || self.inner.all_reduce_sum(buf))
    }

    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<(), CollectiveError> {
        let call = Call::AllGather { len: local.len() };
        self.timed(call, || self.inner.all_gather(local, out))
    }

    fn broadcast_bytes(&self, buf: &mut Vec<u8>, root: usize) -> Result<(), CollectiveError> {
        let call = Call::Broadcast {
            len: if self.inner.rank() == root {
                buf.len()
            } else {
                0
            },
            root,
        };
        let result = self.timed(call, || self.inner.broadcast_bytes(buf, root));
        // Only the root knows the length beforehand; every rank records what arrived.
        if let Some(Call::Broadcast { len, .. }) = self
            .calls
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .last_mut()
        {
            *len = buf.len();
        }
        result
    }
}

/// What rank 0 saw of one generation.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Generation {
    pub tokens: Vec<u32>,
    /// Wall time of the decode steps (after the prefill).
    pub decode_seconds: f64,
    /// Time inside collectives during those steps, plan broadcasts included. Includes any
    /// wait for a slower rank to finish computing and reach the collective.
    pub decode_comm_seconds: f64,
    /// The same collectives replayed back to back after the decode, with no model work between
    /// them: the part of the decode time that is data movement and ring synchronisation alone.
    pub decode_transfer_seconds: f64,
}

pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn to_chunk(planned: &PlannedChunk) -> SequenceChunk<'_> {
    SequenceChunk {
        tokens: &planned.tokens,
        start_pos: planned.start_pos,
        block_table: &planned.block_table,
        want_logits: planned.want_logits,
        precision: if planned.full_precision {
            WeightPrecision::Full
        } else {
            WeightPrecision::Int8
        },
    }
}

/// Loads this rank's shard and generates `decode_tokens` tokens greedily after `prompt`.
/// Rank 0 (or a lone process when `collective` is `None`) returns the generation; the other
/// ranks follow rank 0's plans and return `None` once it stops.
pub fn generate(
    model_path: &Path,
    collective: Option<Arc<dyn Collective>>,
    policy: PrecisionPolicy,
    threads: usize,
    prompt: &str,
    decode_tokens: usize,
) -> anyhow::Result<Option<Generation>> {
    let timed = collective.map(|c| Arc::new(TimedCollective::new(c)));
    let model = Model::load(
        model_path,
        LoadOptions {
            policy,
            threads,
            collective: timed.clone().map(|t| t as Arc<dyn Collective>),
            backend: None,
        },
    )
    .with_context(|| format!("loading {}", model_path.display()))?;
    let prompt = model.tokenizer().encode_prompt(model.config(), prompt);
    let blocks = (prompt.len() + decode_tokens).div_ceil(BLOCK_SIZE);
    // f32, not serve's f16 default: tensor-parallel generation is checked token for token
    // against one rank, and with f16 keys and values an int8 run at two ranks drifted from
    // one rank's greedy tokens on a random model.
    let dtype = crate::backend::KvDtype::F32;
    let mut kv = model.new_kv_cache(blocks, BLOCK_SIZE, dtype);
    if let Some(timed) = timed.as_ref().filter(|t| t.rank() != 0) {
        step::follow(timed.as_ref(), |chunks| -> anyhow::Result<()> {
            let batch: Vec<SequenceChunk<'_>> = chunks.iter().map(to_chunk).collect();
            model.forward(&mut kv, &batch)?;
            Ok(())
        })?;
        timed.replay(None)?;
        return Ok(None);
    }
    let block_table: Vec<u32> = (0..blocks as u32).collect();
    let mut run_step =
        |tokens: Vec<u32>, start_pos: usize, precision: WeightPrecision| -> anyhow::Result<u32> {
            let planned = PlannedChunk {
                tokens,
                start_pos,
                block_table: block_table.clone(),
                want_logits: true,
                full_precision: precision == WeightPrecision::Full,
            };
            if let Some(timed) = &timed {
                step::lead(timed.as_ref(), &StepPlan::Run(vec![planned.clone()]))?;
            }
            let logits = model.forward(&mut kv, &[to_chunk(&planned)])?;
            Ok(argmax(&logits[0]))
        };
    let mut tokens = Vec::with_capacity(decode_tokens);
    if decode_tokens > 0 {
        tokens.push(run_step(
            prompt.clone(),
            0,
            policy.for_prompt(prompt.len()),
        )?);
    }
    let comm_before = timed.as_ref().map_or(0.0, |t| t.seconds());
    let calls_before = timed.as_ref().map_or(0, |t| t.calls_made());
    let started = Instant::now();
    while tokens.len() < decode_tokens {
        let last = *tokens.last().expect("prefill produced a token");
        tokens.push(run_step(
            vec![last],
            prompt.len() + tokens.len() - 1,
            policy.for_prompt(1),
        )?);
    }
    let decode_seconds = started.elapsed().as_secs_f64();
    let decode_comm_seconds = timed.as_ref().map_or(0.0, |t| t.seconds()) - comm_before;
    let mut decode_transfer_seconds = 0.0;
    if let Some(timed) = &timed {
        let decode_calls = calls_before..timed.calls_made();
        step::lead(timed.as_ref(), &StepPlan::Stop)?;
        decode_transfer_seconds = timed.replay(Some(decode_calls))?;
    }
    Ok(Some(Generation {
        tokens,
        decode_seconds,
        decode_comm_seconds,
        decode_transfer_seconds,
    }))
}

/// Compute threads for each of `world_size` ranks sharing this machine: its cores split
/// evenly, so the ranks together use every core without oversubscribing them (at least one
/// each, so more ranks than cores must share).
pub fn threads_per_rank(world_size: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / world_size.max(1)).max(1)
}

/// Runs `generate` with `world_size` ranks as threads of this process on the in-process ring,
/// each with [`threads_per_rank`] compute threads.
pub fn generate_in_process(
    model_path: &Path,
    world_size: usize,
    policy: PrecisionPolicy,
    prompt: &str,
    decode_tokens: usize,
) -> anyhow::Result<Generation> {
    let threads = threads_per_rank(world_size);
    if world_size == 1 {
        return generate(model_path, None, policy, threads, prompt, decode_tokens)?
            .context("a lone rank leads");
    }
    let rings =
        crate::collective::transport::inproc::ring(world_size, std::time::Duration::from_secs(600));
    let results: Vec<anyhow::Result<Option<Generation>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = rings
            .into_iter()
            .map(|transport| {
                let collective: Arc<dyn Collective> =
                    Arc::new(crate::collective::RingCollective::new(transport));
                scope.spawn(move || {
                    generate(
                        model_path,
                        Some(collective),
                        policy,
                        threads,
                        prompt,
                        decode_tokens,
                    )
                })
            })
            .collect();
        super::join_ranks(handles)
    });
    let mut leader = None;
    for (rank, result) in results.into_iter().enumerate() {
        let generation = result.with_context(|| format!("tensor-parallel rank {rank}"))?;
        if rank == 0 {
            leader = generation;
        }
    }
    leader.context("rank 0 returned no generation")
}

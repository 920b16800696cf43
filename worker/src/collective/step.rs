//! Rank 0 drives a tensor-parallel group: before every engine step it broadcasts the step's
//! plan, and every other rank runs a follower loop that receives the plan and runs the same
//! step on its shard. The scheduler only ever talks to rank 0 and never sees this.
//!
//! The plan is plain data (no model types), so this module stays below the model layer; the
//! caller turns a [`PlannedChunk`] into its own batch type.

use super::{Collective, CollectiveError};

/// One sequence's part of a step, as the model layer's `SequenceChunk` but owned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedChunk {
    pub tokens: Vec<u32>,
    pub start_pos: usize,
    pub block_table: Vec<u32>,
    pub want_logits: bool,
    /// `false` for the int8 path, `true` for full-precision weights.
    pub full_precision: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepPlan {
    /// Run one engine step over these chunks.
    Run(Vec<PlannedChunk>),
    /// Nothing to run. An idle leader sends this well within the followers' collective timeout
    /// (`HCCL_EXEC_TIMEOUT`), so they do not take the silence for a lost leader.
    Idle,
    /// The group is shutting down.
    Stop,
}

const TAG_RUN: u8 = 1;
const TAG_IDLE: u8 = 2;
const TAG_STOP: u8 = 3;

impl StepPlan {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            StepPlan::Idle => out.push(TAG_IDLE),
            StepPlan::Stop => out.push(TAG_STOP),
            StepPlan::Run(chunks) => {
                out.push(TAG_RUN);
                put(&mut out, chunks.len() as u64);
                for chunk in chunks {
                    put(&mut out, chunk.start_pos as u64);
                    out.push(u8::from(chunk.want_logits) | (u8::from(chunk.full_precision) << 1));
                    for list in [&chunk.tokens, &chunk.block_table] {
                        put(&mut out, list.len() as u64);
                        out.extend(list.iter().flat_map(|v| v.to_le_bytes()));
                    }
                }
            }
        }
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<StepPlan, CollectiveError> {
        let mut reader = Reader { bytes, at: 0 };
        let plan = match reader.u8()? {
            TAG_IDLE => StepPlan::Idle,
            TAG_STOP => StepPlan::Stop,
            TAG_RUN => {
                let count = reader.len(17)?;
                let mut chunks = Vec::with_capacity(count);
                for _ in 0..count {
                    let start_pos = usize::try_from(reader.u64()?)
                        .map_err(|_| bad("a start position is too large"))?;
                    let flags = reader.u8()?;
                    let tokens = reader.u32_list()?;
                    let block_table = reader.u32_list()?;
                    chunks.push(PlannedChunk {
                        tokens,
                        start_pos,
                        block_table,
                        want_logits: flags & 1 != 0,
                        full_precision: flags & 2 != 0,
                    });
                }
                StepPlan::Run(chunks)
            }
            tag => return Err(bad(&format!("unknown plan tag {tag}"))),
        };
        if reader.at != bytes.len() {
            return Err(bad("trailing bytes after the plan"));
        }
        Ok(plan)
    }
}

fn put(out: &mut Vec<u8>, value: u64) {
    out.extend_from_slice(&value.to_le_bytes());
}

fn bad(what: &str) -> CollectiveError {
    CollectiveError::Invalid(format!("the leader's step plan is unreadable: {what}"))
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], CollectiveError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| bad("truncated"))?;
        let slice = &self.bytes[self.at..end];
        self.at = end;
        Ok(slice)
    }

    fn u8(&mut self) -> Result<u8, CollectiveError> {
        Ok(self.take(1)?[0])
    }

    fn u64(&mut self) -> Result<u64, CollectiveError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    /// A count of items of at least `item_bytes` each, checked against what is left.
    fn len(&mut self, item_bytes: usize) -> Result<usize, CollectiveError> {
        let n = self.u64()?;
        let left = (self.bytes.len() - self.at) as u64;
        if n.saturating_mul(item_bytes as u64) > left {
            return Err(bad("a count exceeds the plan's length"));
        }
        Ok(n as usize)
    }

    fn u32_list(&mut self) -> Result<Vec<u32>, CollectiveError> {
        let n = self.len(4)?;
        Ok(self
            .take(n * 4)?
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect())
    }
}

/// The leader's side: sends `plan` to every rank. Call before running the step locally.
pub fn lead(collective: &dyn Collective, plan: &StepPlan) -> Result<(), CollectiveError> {
    let mut bytes = plan.encode();
    collective.broadcast_bytes(&mut bytes, 0)
}

/// A follower's loop: receives each plan from rank 0 and hands the steps to `run` until the
/// leader sends [`StepPlan::Stop`]. Fails when the ring fails, so a lost leader ends it.
pub fn follow<E: From<CollectiveError>>(
    collective: &dyn Collective,
    mut run: impl FnMut(&[PlannedChunk]) -> Result<(), E>,
) -> Result<(), E> {
    let mut bytes = Vec::new();
    loop {
        collective.broadcast_bytes(&mut bytes, 0)?;
        match StepPlan::decode(&bytes)? {
            StepPlan::Run(chunks) => run(&chunks)?,
            StepPlan::Idle => {}
            StepPlan::Stop => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_round_trip_and_bad_bytes_are_refused() {
        let plan = StepPlan::Run(vec![
            PlannedChunk {
                tokens: vec![1, 2, 3],
                start_pos: 0,
                block_table: vec![4, 5],
                want_logits: true,
                full_precision: false,
            },
            PlannedChunk {
                tokens: vec![9],
                start_pos: 77,
                block_table: vec![],
                want_logits: false,
                full_precision: true,
            },
        ]);
        for plan in [plan, StepPlan::Run(vec![]), StepPlan::Idle, StepPlan::Stop] {
            let bytes = plan.encode();
            assert_eq!(StepPlan::decode(&bytes).unwrap(), plan);
            if bytes.len() > 1 {
                assert!(
                    StepPlan::decode(&bytes[..bytes.len() - 1])
                        .unwrap_err()
                        .to_string()
                        .contains("truncated")
                );
            }
        }
        assert!(
            StepPlan::decode(&[9])
                .unwrap_err()
                .to_string()
                .contains("unknown plan tag 9")
        );
        assert!(
            StepPlan::decode(&[TAG_IDLE, 0])
                .unwrap_err()
                .to_string()
                .contains("trailing")
        );
        let mut huge = vec![TAG_RUN];
        huge.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(
            StepPlan::decode(&huge)
                .unwrap_err()
                .to_string()
                .contains("exceeds")
        );
    }
}

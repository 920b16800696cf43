//! A tensor-parallel group as one model: the leader (rank 0) broadcasts each step's plan before
//! running it, and the other ranks replay those plans on their shards. The engine above
//! drives the leader's [`Model`] as if it were alone.

use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use super::{ForwardError, KvCache, Model, SequenceChunk, StepBuffers, WeightPrecision};
use crate::collective::step::{self, PlannedChunk, StepPlan};
use crate::collective::{Collective, CollectiveError};

/// How long an idle leader stays silent before telling the followers it is still there. Far
/// below any collective timeout HCCL accepts, and a one-byte broadcast costs nothing.
const IDLE_HEARTBEAT: Duration = Duration::from_secs(1);

/// The leader's end of the group. Steps, heartbeats and the final stop all go through `state`,
/// so the followers see one plan at a time, in order.
pub(super) struct Leader {
    collective: Arc<dyn Collective>,
    state: Mutex<LeaderState>,
}

struct LeaderState {
    last_sent: Instant,
    /// Set once the group was stopped or a collective failed; nothing is sent after that.
    closed: Option<CollectiveError>,
}

impl Leader {
    pub(super) fn start(collective: Arc<dyn Collective>) -> Arc<Leader> {
        let leader = Arc::new(Leader {
            collective,
            state: Mutex::new(LeaderState {
                last_sent: Instant::now(),
                closed: None,
            }),
        });
        let weak = Arc::downgrade(&leader);
        std::thread::Builder::new()
            .name("tp-heartbeat".into())
            .spawn(move || heartbeat(weak))
            .expect("spawning the heartbeat thread");
        leader
    }

    fn lock(&self) -> MutexGuard<'_, LeaderState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends `plan` (unless the group is closed), then runs `local` while still holding the
    /// group, so no heartbeat slips between a plan and the collectives of its step.
    pub(super) fn run<T>(
        &self,
        plan: &StepPlan,
        local: impl FnOnce() -> Result<T, ForwardError>,
    ) -> Result<T, ForwardError> {
        let mut state = self.lock();
        if let Some(err) = &state.closed {
            return Err(err.clone().into());
        }
        let sent = step::lead(self.collective.as_ref(), plan);
        state.last_sent = Instant::now();
        if let Err(err) = sent {
            state.closed = Some(err.clone());
            return Err(err.into());
        }
        let result = local();
        if let Err(ForwardError::Collective(err)) = &result {
            state.closed = Some(err.clone());
        }
        result
    }

    /// Tells the followers to exit; later steps fail.
    pub(super) fn stop(&self) -> Result<(), CollectiveError> {
        let mut state = self.lock();
        if state.closed.is_some() {
            return Ok(());
        }
        state.closed = Some(CollectiveError::Invalid(
            "the tensor-parallel group was stopped".into(),
        ));
        step::lead(self.collective.as_ref(), &StepPlan::Stop)
    }

    /// Why the group cannot run steps any more, if it cannot.
    pub(super) fn failure(&self) -> Option<CollectiveError> {
        self.lock().closed.clone()
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        if let Err(err) = self.stop() {
            tracing::warn!(error = %err, "could not tell the tensor-parallel group to stop");
        }
    }
}

/// Sends a heartbeat whenever the leader has been silent for [`IDLE_HEARTBEAT`], sleeping until
/// the next one is due; ends once the leader is gone or its group closed.
fn heartbeat(leader: Weak<Leader>) {
    let mut due = IDLE_HEARTBEAT;
    loop {
        std::thread::sleep(due);
        let Some(leader) = leader.upgrade() else {
            return;
        };
        let mut state = leader.lock();
        if state.closed.is_some() {
            return;
        }
        due = IDLE_HEARTBEAT.saturating_sub(state.last_sent.elapsed());
        if due.is_zero() {
            if let Err(err) = step::lead(leader.collective.as_ref(), &StepPlan::Idle) {
                tracing::error!(error = %err, "the tensor-parallel group is lost");
                state.closed = Some(err);
                return;
            }
            state.last_sent = Instant::now();
            due = IDLE_HEARTBEAT;
        }
    }
}

/// The plan a follower needs to run `batch` exactly as the leader does.
pub(super) fn plan_of(batch: &[SequenceChunk<'_>]) -> StepPlan {
    StepPlan::Run(
        batch
            .iter()
            .map(|c| PlannedChunk {
                tokens: c.tokens.to_vec(),
                start_pos: c.start_pos,
                block_table: c.block_table.to_vec(),
                want_logits: c.want_logits,
                full_precision: c.precision == WeightPrecision::Full,
            })
            .collect(),
    )
}

/// A follower's loop: runs every step the leader plans until it stops the group.
pub(super) fn follow(model: &Model, kv: &mut KvCache) -> Result<(), ForwardError> {
    let collective = model
        .collective
        .as_ref()
        .filter(|c| c.rank() != 0)
        .ok_or_else(|| {
            ForwardError::Collective(CollectiveError::Invalid(
                "only ranks other than 0 of a tensor-parallel group follow a leader".into(),
            ))
        })?;
    let mut buffers = StepBuffers::default();
    step::follow(collective.as_ref(), |chunks| {
        let batch: Vec<SequenceChunk<'_>> = chunks
            .iter()
            .map(|c| SequenceChunk {
                tokens: &c.tokens,
                start_pos: c.start_pos,
                block_table: &c.block_table,
                want_logits: c.want_logits,
                precision: if c.full_precision {
                    WeightPrecision::Full
                } else {
                    WeightPrecision::Int8
                },
            })
            .collect();
        model.forward_local(kv, &batch, &mut buffers, &|| false)
    })
}

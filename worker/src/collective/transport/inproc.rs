//! Ranks as threads of one process, linked through shared memory.
//!
//! A link is a rendezvous slot: the sender offers its frame in place and the receiver reads it
//! straight out of the sender's buffer. A reduce step therefore costs one read of the peer's
//! chunk plus one read-modify-write of the rank's own, a gather step one read and one write,
//! and nothing is copied into intermediate frames or allocated. The sender stays inside
//! [`Transport::exchange`] (so its buffer stays borrowed) until the receiver has finished
//! reading or the offer is withdrawn.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{Incoming, Transport, frame_length_mismatch};
use crate::collective::CollectiveError;

/// How long a waiting rank polls before it sleeps: a ring step on small messages finishes in
/// microseconds, far sooner than a sleeping thread is woken.
const SPIN_BEFORE_SLEEP: Duration = Duration::from_micros(50);

/// A frame offered in place: the sender's bytes, valid until the offer is read or withdrawn.
#[derive(Clone, Copy)]
struct OfferedFrame {
    ptr: *const u8,
    len: usize,
}

// SAFETY: the pointer is only dereferenced by the receiving rank while the offering rank is
// blocked inside `exchange` holding the borrow it came from (see `Offer`).
unsafe impl Send for OfferedFrame {}

enum FrameState {
    Empty,
    Offered(OfferedFrame),
    /// The receiver is reading the offered bytes; the sender must not return yet.
    Reading,
    Read,
}

struct Slot {
    frame: FrameState,
    /// The sending rank's transport was dropped.
    sender_gone: bool,
    /// The receiving rank's transport was dropped.
    receiver_gone: bool,
    /// Why the sender gave up on the ring, passed on so the receiver names the rank that was
    /// really lost.
    sender_failure: Option<CollectiveError>,
    /// Why the receiver gave up, so a sender waiting for it to read learns the same.
    receiver_failure: Option<CollectiveError>,
}

/// The one-way link from a rank to its successor.
struct Link {
    slot: Mutex<Slot>,
    changed: Condvar,
}

impl Link {
    fn new() -> Self {
        Link {
            slot: Mutex::new(Slot {
                frame: FrameState::Empty,
                sender_gone: false,
                receiver_gone: false,
                sender_failure: None,
                receiver_failure: None,
            }),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Slot> {
        // A panicking rank leaves the slot consistent: every change is a single assignment.
        self.slot
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Waits until `ready` holds or `deadline` passes (`None`: no deadline); returns the
    /// guard and whether `ready` holds.
    fn wait<'a>(
        &'a self,
        mut slot: MutexGuard<'a, Slot>,
        deadline: Option<Instant>,
        ready: impl Fn(&Slot) -> bool,
    ) -> (MutexGuard<'a, Slot>, bool) {
        let spin_until = Instant::now() + SPIN_BEFORE_SLEEP;
        while !ready(&slot) && Instant::now() < spin_until {
            drop(slot);
            std::thread::yield_now();
            slot = self.lock();
        }
        loop {
            if ready(&slot) {
                return (slot, true);
            }
            slot = match deadline {
                None => self
                    .changed
                    .wait(slot)
                    .unwrap_or_else(|poisoned| poisoned.into_inner()),
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return (slot, false);
                    }
                    self.changed
                        .wait_timeout(slot, left)
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .0
                }
            };
        }
    }
}

pub struct InProcTransport {
    rank: usize,
    world_size: usize,
    to_successor: Arc<Link>,
    from_predecessor: Arc<Link>,
    op_timeout: Duration,
    aborted: bool,
}

/// Builds the `world_size` linked ends of an in-process ring, one per rank, in rank order.
/// A rank waiting longer than `op_timeout` for a neighbour fails with a timeout.
pub fn ring(world_size: usize, op_timeout: Duration) -> Vec<InProcTransport> {
    // Link i carries data into rank i.
    let links: Vec<Arc<Link>> = (0..world_size).map(|_| Arc::new(Link::new())).collect();
    (0..world_size)
        .map(|rank| InProcTransport {
            rank,
            world_size,
            to_successor: links[(rank + 1) % world_size].clone(),
            from_predecessor: links[rank].clone(),
            op_timeout,
            aborted: false,
        })
        .collect()
}

/// A frame offered to the successor. Dropping it (also while unwinding) withdraws the offer,
/// or waits for a read already under way to finish, so the offered bytes outlive every read.
struct Offer<'a> {
    link: &'a Link,
    successor: usize,
    op_timeout: Duration,
    settled: bool,
}

impl Offer<'_> {
    /// Waits until the successor has read the frame.
    fn delivered(mut self) -> Result<(), CollectiveError> {
        let deadline = Instant::now() + self.op_timeout;
        let (slot, ready) = self.link.wait(self.link.lock(), Some(deadline), |s| {
            matches!(s.frame, FrameState::Read) || s.receiver_gone || s.receiver_failure.is_some()
        });
        let outcome = match (&slot.frame, &slot.receiver_failure) {
            (FrameState::Read, _) => Ok(()),
            _ if !ready => Err(CollectiveError::Timeout {
                rank: self.successor,
                seconds: self.op_timeout.as_secs(),
            }),
            (_, Some(failure)) => Err(failure.clone()),
            _ => Err(CollectiveError::LostRank {
                rank: self.successor,
                reason: "its end of the in-process ring was dropped".into(),
            }),
        };
        settle(self.link, slot);
        self.settled = true;
        outcome
    }
}

impl Drop for Offer<'_> {
    fn drop(&mut self) {
        if !self.settled {
            settle(self.link, self.link.lock());
        }
    }
}

/// Clears the link for the next frame once no read of the current one is under way.
fn settle(link: &Link, slot: MutexGuard<'_, Slot>) {
    // Reading a frame never blocks, so this wait is short.
    let (mut slot, _) = link.wait(slot, None, |s| !matches!(s.frame, FrameState::Reading));
    slot.frame = FrameState::Empty;
}

impl InProcTransport {
    fn closed(&self) -> CollectiveError {
        CollectiveError::Invalid(format!(
            "rank {}: the ring was closed by an earlier failure",
            self.rank
        ))
    }

    fn offer(&self, frame: &[u8]) -> Result<Offer<'_>, CollectiveError> {
        let successor = self.successor();
        let mut slot = self.to_successor.lock();
        if let Some(failure) = &slot.receiver_failure {
            return Err(failure.clone());
        }
        if slot.receiver_gone {
            return Err(CollectiveError::LostRank {
                rank: successor,
                reason: "its end of the in-process ring was dropped".into(),
            });
        }
        slot.frame = FrameState::Offered(OfferedFrame {
            ptr: frame.as_ptr(),
            len: frame.len(),
        });
        drop(slot);
        self.to_successor.changed.notify_all();
        Ok(Offer {
            link: &self.to_successor,
            successor,
            op_timeout: self.op_timeout,
            settled: false,
        })
    }

    fn receive(&self, incoming: Incoming<'_>) -> Result<(), CollectiveError> {
        let predecessor = self.predecessor();
        let link = &*self.from_predecessor;
        let deadline = Instant::now() + self.op_timeout;
        let (mut slot, ready) = link.wait(link.lock(), Some(deadline), |s| {
            matches!(s.frame, FrameState::Offered(_)) || s.sender_gone || s.sender_failure.is_some()
        });
        let frame = match (&slot.frame, &slot.sender_failure) {
            (&FrameState::Offered(frame), _) => frame,
            _ if !ready => {
                return Err(CollectiveError::Timeout {
                    rank: predecessor,
                    seconds: self.op_timeout.as_secs(),
                });
            }
            (_, Some(failure)) => return Err(failure.clone()),
            _ => {
                return Err(CollectiveError::LostRank {
                    rank: predecessor,
                    reason: "its end of the in-process ring was dropped".into(),
                });
            }
        };
        if frame.len != incoming.len {
            return Err(frame_length_mismatch(predecessor, frame.len, incoming.len));
        }
        slot.frame = FrameState::Reading;
        drop(slot);
        /// Marks the frame read even if `on_piece` unwinds, so the sender is never stuck.
        struct Finished<'a>(&'a Link);
        impl Drop for Finished<'_> {
            fn drop(&mut self) {
                self.0.lock().frame = FrameState::Read;
                self.0.changed.notify_all();
            }
        }
        let _finished = Finished(link);
        if frame.len > 0 {
            // SAFETY: the predecessor is blocked in `exchange` with these bytes borrowed until
            // the frame leaves the `Reading` state, which happens only when `_finished` drops.
            let bytes = unsafe { std::slice::from_raw_parts(frame.ptr, frame.len) };
            (incoming.on_piece)(bytes);
        }
        Ok(())
    }
}

impl Transport for InProcTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn exchange(
        &mut self,
        outgoing: Option<&[u8]>,
        incoming: Option<Incoming<'_>>,
    ) -> Result<(), CollectiveError> {
        if self.aborted {
            return Err(self.closed());
        }
        // Every rank offers before it waits, so the ring cannot deadlock.
        let offer = outgoing.map(|frame| self.offer(frame)).transpose()?;
        let received = incoming.map_or(Ok(()), |incoming| self.receive(incoming));
        match (received, offer) {
            (Ok(()), Some(offer)) => offer.delivered(),
            // Dropping the offer withdraws it before the error is reported.
            (received, _) => received,
        }
    }

    fn abort(&mut self, error: &CollectiveError) {
        self.aborted = true;
        for (link, to_successor) in [(&self.to_successor, true), (&self.from_predecessor, false)] {
            let mut slot = link.lock();
            let failure = if to_successor {
                &mut slot.sender_failure
            } else {
                &mut slot.receiver_failure
            };
            failure.get_or_insert_with(|| error.clone());
            drop(slot);
            link.changed.notify_all();
        }
    }
}

impl Drop for InProcTransport {
    fn drop(&mut self) {
        self.to_successor.lock().sender_gone = true;
        self.to_successor.changed.notify_all();
        self.from_predecessor.lock().receiver_gone = true;
        self.from_predecessor.changed.notify_all();
    }
}

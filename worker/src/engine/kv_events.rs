//! The prefix cache's changes as events for subscribers (a router keeping an index of which
//! replica holds which blocks): the engine thread appends what each step stored and evicted;
//! a subscriber takes a snapshot of every cached block and then the changes after it, with
//! no gap between the two because both happen under one lock.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::broadcast;

/// One change to the prefix cache. Blocks are named by
/// [`npufleet_contract::kv::block_hashes`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// A full block entered the cache; `parent` names the block before it in its prompt.
    Stored { hash: u64, parent: Option<u64> },
    /// A block left the cache to make room.
    Removed { hash: u64 },
}

/// Events after the snapshot or batch numbered `seq - 1`.
#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch {
    pub seq: u64,
    pub events: Arc<[CacheEvent]>,
}

/// Batches a slow subscriber may fall behind by before it is sent a new snapshot.
const BACKLOG: usize = 1024;

pub struct KvEventLog {
    /// Chosen at start: a subscriber that sees another epoch knows the worker restarted.
    pub epoch: u64,
    pub block_size: usize,
    held: Mutex<Held>,
    sender: broadcast::Sender<EventBatch>,
}

#[derive(Default)]
struct Held {
    /// Sequence number of the last batch.
    seq: u64,
    /// Each cached block's parent, with how many cached blocks carry the hash (the same
    /// tokens computed at two weight precisions are two blocks).
    blocks: HashMap<u64, (Option<u64>, u32)>,
}

/// What a new subscriber starts from: every cached block as of `seq`, then `changes`, of
/// which batches numbered `seq` or lower are already in the snapshot.
pub struct Subscription {
    pub seq: u64,
    pub snapshot: Vec<CacheEvent>,
    pub changes: broadcast::Receiver<EventBatch>,
}

impl KvEventLog {
    pub fn new(block_size: usize) -> Self {
        KvEventLog {
            epoch: rand::random(),
            block_size,
            held: Mutex::default(),
            sender: broadcast::Sender::new(BACKLOG),
        }
    }

    /// Records the events of one engine step and passes them on.
    pub fn publish(&self, events: Vec<CacheEvent>) {
        if events.is_empty() {
            return;
        }
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        for event in &events {
            match *event {
                CacheEvent::Stored { hash, parent } => {
                    held.blocks.entry(hash).or_insert((parent, 0)).1 += 1;
                }
                CacheEvent::Removed { hash } => {
                    if let Some((_, count)) = held.blocks.get_mut(&hash) {
                        *count -= 1;
                        if *count == 0 {
                            held.blocks.remove(&hash);
                        }
                    }
                }
            }
        }
        held.seq += 1;
        // No subscriber is no error: the snapshot covers whoever comes later.
        let _ = self.sender.send(EventBatch {
            seq: held.seq,
            events: events.into(),
        });
    }

    pub fn subscribe(&self) -> Subscription {
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let snapshot = held
            .blocks
            .iter()
            .flat_map(|(&hash, &(parent, count))| {
                std::iter::repeat_n(CacheEvent::Stored { hash, parent }, count as usize)
            })
            .collect();
        Subscription {
            seq: held.seq,
            snapshot,
            changes: self.sender.subscribe(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hash: u64) -> CacheEvent {
        CacheEvent::Stored { hash, parent: None }
    }

    #[test]
    fn a_subscriber_gets_the_cache_then_only_later_changes() {
        let log = KvEventLog::new(16);
        log.publish(vec![stored(1), stored(2)]);
        log.publish(vec![CacheEvent::Removed { hash: 1 }]);
        let mut sub = log.subscribe();
        assert_eq!(sub.seq, 2);
        assert_eq!(sub.snapshot, vec![stored(2)]);
        log.publish(vec![stored(3)]);
        let next = sub.changes.try_recv().unwrap();
        assert_eq!(next.seq, 3);
        assert_eq!(&*next.events, &[stored(3)]);
        log.publish(Vec::new());
        assert!(sub.changes.try_recv().is_err(), "an empty step is no batch");
    }

    #[test]
    fn a_hash_held_twice_stays_until_both_blocks_go() {
        let log = KvEventLog::new(16);
        log.publish(vec![stored(7), stored(7), CacheEvent::Removed { hash: 7 }]);
        assert_eq!(log.subscribe().snapshot, vec![stored(7)]);
        log.publish(vec![CacheEvent::Removed { hash: 7 }]);
        assert!(log.subscribe().snapshot.is_empty());
    }
}

//! The prefix cache's changes as events for subscribers (a router keeping an index of which
//! replica holds which blocks): the engine thread appends what each step stored and evicted;
//! a subscriber takes a snapshot of every cached block and then the changes after it, with
//! no gap between the two because both happen under one lock.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use tokio::sync::broadcast;

/// One change to the prefix cache. Blocks are named by
/// [`npufleet_contract::kv::block_hashes`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// A full block entered the cache; `parent` names the block before it in its prompt.
    /// `tokens` are its token ids, for subscribers that hash blocks their own way (vLLM's
    /// event consumers do).
    Stored {
        hash: u64,
        parent: Option<u64>,
        tokens: Arc<[u32]>,
    },
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

struct HeldBlock {
    parent: Option<u64>,
    tokens: Arc<[u32]>,
    count: u32,
}

#[derive(Default)]
struct Held {
    /// Sequence number of the last batch.
    seq: u64,
    /// Each cached block's parent and tokens, with how many cached blocks carry the hash
    /// (the same tokens computed at two weight precisions are two blocks).
    blocks: HashMap<u64, HeldBlock>,
}

/// What a new subscriber starts from: every cached block as of `seq`, then `changes`, of
/// which batches numbered `seq` or lower are already in the snapshot.
struct Subscription {
    seq: u64,
    snapshot: Vec<CacheEvent>,
    changes: broadcast::Receiver<EventBatch>,
}

/// What a follower of the log is given next.
#[derive(Debug, PartialEq)]
pub enum CacheUpdate {
    /// Every block cached as of batch `seq`: first, and again after the follower fell so far
    /// behind that batches were lost.
    Snapshot { seq: u64, blocks: Vec<CacheEvent> },
    /// The batch after the last one given.
    Batch(EventBatch),
}

/// Follows a [`KvEventLog`]: a snapshot, then each later batch once, with no gap.
pub struct Follower<'a> {
    log: &'a KvEventLog,
    /// The last batch given, and the batches after it; `None` before a snapshot.
    changes: Option<(u64, broadcast::Receiver<EventBatch>)>,
}

impl Follower<'_> {
    /// The next update; `None` once the log is gone. Cancel-safe: an update not returned is
    /// not lost.
    pub async fn next(&mut self) -> Option<CacheUpdate> {
        loop {
            let Some((last, changes)) = &mut self.changes else {
                let Subscription {
                    seq,
                    snapshot,
                    changes,
                } = self.log.subscribe();
                self.changes = Some((seq, changes));
                return Some(CacheUpdate::Snapshot {
                    seq,
                    blocks: snapshot,
                });
            };
            match changes.recv().await {
                Ok(batch) if batch.seq <= *last => {}
                Ok(batch) => {
                    *last = batch.seq;
                    return Some(CacheUpdate::Batch(batch));
                }
                Err(broadcast::error::RecvError::Lagged(_)) => self.changes = None,
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }
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
            match event {
                CacheEvent::Stored {
                    hash,
                    parent,
                    tokens,
                } => {
                    held.blocks
                        .entry(*hash)
                        .or_insert_with(|| HeldBlock {
                            parent: *parent,
                            tokens: tokens.clone(),
                            count: 0,
                        })
                        .count += 1;
                }
                CacheEvent::Removed { hash } => {
                    if let Some(block) = held.blocks.get_mut(hash) {
                        block.count -= 1;
                        if block.count == 0 {
                            held.blocks.remove(hash);
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

    /// Follows the log from a snapshot of the cache.
    pub fn follow(&self) -> Follower<'_> {
        Follower {
            log: self,
            changes: None,
        }
    }

    /// Every cached block as of the batch numbered by the first value, each listed after its
    /// parent as the engine stored them: consumers that name a block by its whole prefix
    /// (vLLM's do) need the parent's name first.
    pub fn snapshot(&self) -> (u64, Vec<CacheEvent>) {
        let Subscription { seq, snapshot, .. } = self.subscribe();
        (seq, snapshot)
    }

    fn subscribe(&self) -> Subscription {
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let mut placed = HashSet::with_capacity(held.blocks.len());
        let mut snapshot = Vec::with_capacity(held.blocks.len());
        let mut chain = Vec::new();
        for &leaf in held.blocks.keys() {
            let mut at = Some(leaf);
            while let Some(hash) = at.filter(|h| !placed.contains(h)) {
                let Some(block) = held.blocks.get(&hash) else {
                    break;
                };
                chain.push((hash, block));
                at = block.parent;
            }
            for (hash, block) in chain.drain(..).rev() {
                placed.insert(hash);
                let stored = CacheEvent::Stored {
                    hash,
                    parent: block.parent,
                    tokens: block.tokens.clone(),
                };
                snapshot.extend(std::iter::repeat_n(stored, block.count as usize));
            }
        }
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
        CacheEvent::Stored {
            hash,
            parent: None,
            tokens: Arc::from([hash as u32]),
        }
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
    fn the_snapshot_lists_parents_before_their_children() {
        let log = KvEventLog::new(16);
        let child = |hash: u64, parent: u64| CacheEvent::Stored {
            hash,
            parent: Some(parent),
            tokens: Arc::from([hash as u32]),
        };
        // Stored root first, as the engine does; a hash map would list them in any order.
        let mut events = vec![stored(1)];
        events.extend((2..40).map(|h| child(h, h - 1)));
        events.extend((100..110).map(|h| child(h, 5)));
        log.publish(events);
        let snapshot = log.subscribe().snapshot;
        assert_eq!(snapshot.len(), 49);
        let position = |wanted: u64| {
            snapshot
                .iter()
                .position(|e| matches!(e, CacheEvent::Stored { hash, .. } if *hash == wanted))
                .unwrap()
        };
        for event in &snapshot {
            if let CacheEvent::Stored {
                hash,
                parent: Some(parent),
                ..
            } = event
            {
                assert!(position(*parent) < position(*hash), "{parent} after {hash}");
            }
        }
    }

    #[tokio::test]
    async fn a_follower_gets_a_snapshot_then_each_batch_and_a_new_snapshot_after_falling_behind() {
        let log = KvEventLog::new(16);
        log.publish(vec![stored(1)]);
        let mut follower = log.follow();
        assert_eq!(
            follower.next().await,
            Some(CacheUpdate::Snapshot {
                seq: 1,
                blocks: vec![stored(1)]
            })
        );
        log.publish(vec![stored(2)]);
        assert!(matches!(follower.next().await, Some(CacheUpdate::Batch(b)) if b.seq == 2));
        let last = 3 + BACKLOG as u64;
        for hash in 3..=last {
            log.publish(vec![stored(hash)]);
        }
        match follower.next().await {
            Some(CacheUpdate::Snapshot { seq, blocks }) => {
                assert_eq!(seq, last);
                assert_eq!(blocks.len(), last as usize);
            }
            other => panic!("a follower that lost batches gets a snapshot, not {other:?}"),
        }
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

//! What one replica's prefix cache holds, kept from its worker's KV events
//! (`WorkerLoad.WatchKvEvents`): a snapshot replaces everything known, each later batch must
//! follow the last one without a gap, and a gap, a restarted worker (a new epoch) or a lost
//! stream empties the view until the next snapshot. An empty view only costs cache hits: the
//! replica is then placed by load, never wrongly favoured.

use std::collections::HashMap;

use npufleet_contract::proto::npufleet::v1::{KvEventBatch, kv_event};

/// The batch does not follow the last one applied: events were missed.
#[derive(Debug, PartialEq, Eq)]
pub struct Gap {
    pub expected: u64,
    pub got: u64,
}

#[derive(Default, Debug)]
pub struct CachedBlocks {
    /// The worker's epoch and the last batch applied, once a snapshot arrived.
    position: Option<(u64, u64)>,
    /// Cached blocks by name, with how many cached blocks carry it.
    held: HashMap<u64, u32>,
}

impl CachedBlocks {
    pub fn apply(&mut self, batch: &KvEventBatch) -> Result<(), Gap> {
        if batch.snapshot {
            self.held.clear();
        } else {
            let expected = match self.position {
                Some((epoch, seq)) if epoch == batch.epoch => seq + 1,
                _ => 0,
            };
            if batch.seq != expected {
                self.clear();
                return Err(Gap {
                    expected,
                    got: batch.seq,
                });
            }
        }
        for event in batch.events.iter().filter_map(|e| e.event.as_ref()) {
            match event {
                kv_event::Event::Stored(stored) => {
                    for &hash in &stored.block_hashes {
                        *self.held.entry(hash).or_default() += 1;
                    }
                }
                kv_event::Event::Removed(removed) => {
                    for hash in &removed.block_hashes {
                        if let Some(count) = self.held.get_mut(hash) {
                            *count -= 1;
                            if *count == 0 {
                                self.held.remove(hash);
                            }
                        }
                    }
                }
                kv_event::Event::AllCleared(_) => self.held.clear(),
            }
        }
        self.position = Some((batch.epoch, batch.seq));
        Ok(())
    }

    /// Forgets everything: the events can no longer be followed.
    pub fn clear(&mut self) {
        self.held.clear();
        self.position = None;
    }

    /// How many of `blocks` (a prompt's block names, first first) the cache holds as an
    /// unbroken run from the first: the worker reuses no block after a missing one.
    pub fn leading(&self, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|hash| self.held.contains_key(hash))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use npufleet_contract::proto::npufleet::v1::{
        AllBlocksCleared, BlockRemoved, BlockStored, KvEvent,
    };

    fn stored(hashes: &[u64]) -> KvEvent {
        KvEvent {
            event: Some(kv_event::Event::Stored(BlockStored {
                block_hashes: hashes.to_vec(),
                parent_block_hash: None,
            })),
        }
    }

    fn removed(hashes: &[u64]) -> KvEvent {
        KvEvent {
            event: Some(kv_event::Event::Removed(BlockRemoved {
                block_hashes: hashes.to_vec(),
            })),
        }
    }

    fn batch(epoch: u64, seq: u64, snapshot: bool, events: Vec<KvEvent>) -> KvEventBatch {
        KvEventBatch {
            epoch,
            seq,
            block_size: 16,
            snapshot,
            events,
        }
    }

    #[test]
    fn a_snapshot_then_changes_give_the_leading_run() {
        let mut cache = CachedBlocks::default();
        let cleared = KvEvent {
            event: Some(kv_event::Event::AllCleared(AllBlocksCleared {})),
        };
        cache
            .apply(&batch(7, 4, true, vec![cleared, stored(&[1, 2, 3])]))
            .unwrap();
        assert_eq!(cache.leading(&[1, 2, 3, 4]), 3);
        cache
            .apply(&batch(7, 5, false, vec![removed(&[2])]))
            .unwrap();
        assert_eq!(cache.leading(&[1, 2, 3]), 1, "a hole ends the run");
        assert_eq!(cache.leading(&[9, 1]), 0);
        cache
            .apply(&batch(7, 6, false, vec![stored(&[2, 2])]))
            .unwrap();
        cache
            .apply(&batch(7, 7, false, vec![removed(&[2])]))
            .unwrap();
        assert_eq!(
            cache.leading(&[1, 2, 3]),
            3,
            "a name held twice stays until both go"
        );
    }

    #[test]
    fn a_gap_or_a_new_epoch_empties_the_view_until_the_next_snapshot() {
        let mut cache = CachedBlocks::default();
        assert_eq!(
            cache.apply(&batch(7, 1, false, vec![stored(&[1])])),
            Err(Gap {
                expected: 0,
                got: 1
            }),
            "changes before any snapshot cannot be placed"
        );
        cache.apply(&batch(7, 1, true, vec![stored(&[1])])).unwrap();
        assert_eq!(
            cache.apply(&batch(7, 3, false, vec![stored(&[2])])),
            Err(Gap {
                expected: 2,
                got: 3
            })
        );
        assert_eq!(cache.leading(&[1]), 0);
        cache.apply(&batch(7, 3, true, vec![stored(&[1])])).unwrap();
        assert!(
            cache
                .apply(&batch(8, 4, false, vec![stored(&[2])]))
                .is_err()
        );
        assert!(
            cache.leading(&[1]) == 0,
            "a restarted worker's cache is not the old one"
        );
    }
}

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
    /// Cached blocks by name.
    held: HashMap<u64, Held>,
}

#[derive(Debug)]
struct Held {
    /// How many cached blocks carry the name.
    copies: u32,
    parent: Option<u64>,
    /// Held blocks that continue this one: more than one, and prompts fork here.
    children: u32,
}

/// How much of a prompt a replica's cache holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Lookup {
    /// The prompt's leading blocks held as an unbroken run.
    pub blocks: usize,
    /// Held continuations of the run's last block: other prompts that share the run and go
    /// on differently (the prompt's own continuation is not held, or the run would be
    /// longer). A prompt's own earlier answer is at most one of them.
    pub forks: u32,
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
                    let mut parent = stored.parent_block_hash;
                    for &hash in &stored.block_hashes {
                        self.store(hash, parent);
                        parent = Some(hash);
                    }
                }
                kv_event::Event::Removed(removed) => {
                    for &hash in &removed.block_hashes {
                        self.remove(hash);
                    }
                }
                kv_event::Event::AllCleared(_) => self.held.clear(),
            }
        }
        self.position = Some((batch.epoch, batch.seq));
        Ok(())
    }

    fn store(&mut self, hash: u64, parent: Option<u64>) {
        if let Some(held) = self.held.get_mut(&hash) {
            held.copies += 1;
            return;
        }
        self.held.insert(
            hash,
            Held {
                copies: 1,
                parent,
                children: 0,
            },
        );
        if let Some(parent) = parent.and_then(|p| self.held.get_mut(&p)) {
            parent.children += 1;
        }
    }

    fn remove(&mut self, hash: u64) {
        let Some(held) = self.held.get_mut(&hash) else {
            return;
        };
        held.copies -= 1;
        if held.copies > 0 {
            return;
        }
        let parent = held.parent;
        self.held.remove(&hash);
        if let Some(parent) = parent.and_then(|p| self.held.get_mut(&p)) {
            parent.children = parent.children.saturating_sub(1);
        }
    }

    /// Forgets everything: the events can no longer be followed.
    pub fn clear(&mut self) {
        self.held.clear();
        self.position = None;
    }

    /// How many of `blocks` (a prompt's block names, first first) the cache holds as an
    /// unbroken run from the first: the worker reuses no block after a missing one.
    pub fn leading(&self, blocks: &[u64]) -> Lookup {
        let run = blocks
            .iter()
            .take_while(|hash| self.held.contains_key(hash))
            .count();
        let forks = run
            .checked_sub(1)
            .and_then(|last| self.held.get(&blocks[last]))
            .map_or(0, |held| held.children);
        Lookup { blocks: run, forks }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use npufleet_contract::proto::npufleet::v1::{
        AllBlocksCleared, BlockRemoved, BlockStored, KvEvent,
    };

    fn stored(hashes: &[u64]) -> KvEvent {
        stored_after(None, hashes)
    }

    fn stored_after(parent: Option<u64>, hashes: &[u64]) -> KvEvent {
        KvEvent {
            event: Some(kv_event::Event::Stored(BlockStored {
                block_hashes: hashes.to_vec(),
                parent_block_hash: parent,
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
        assert_eq!(cache.leading(&[1, 2, 3, 4]).blocks, 3);
        cache
            .apply(&batch(7, 5, false, vec![removed(&[2])]))
            .unwrap();
        assert_eq!(cache.leading(&[1, 2, 3]).blocks, 1, "a hole ends the run");
        assert_eq!(cache.leading(&[9, 1]).blocks, 0);
        cache
            .apply(&batch(7, 6, false, vec![stored(&[2, 2])]))
            .unwrap();
        cache
            .apply(&batch(7, 7, false, vec![removed(&[2])]))
            .unwrap();
        assert_eq!(
            cache.leading(&[1, 2, 3]).blocks,
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
        assert_eq!(cache.leading(&[1]).blocks, 0);
        cache.apply(&batch(7, 3, true, vec![stored(&[1])])).unwrap();
        assert!(
            cache
                .apply(&batch(8, 4, false, vec![stored(&[2])]))
                .is_err()
        );
        assert!(
            cache.leading(&[1]).blocks == 0,
            "a restarted worker's cache is not the old one"
        );
    }

    #[test]
    fn the_run_tells_how_many_held_prompts_fork_where_it_ends() {
        let mut cache = CachedBlocks::default();
        // A shared prefix 1, 2 and two prompts going on from it: 3, 4 and 5.
        cache
            .apply(&batch(1, 0, true, vec![stored(&[1, 2, 3, 4])]))
            .unwrap();
        cache
            .apply(&batch(1, 1, false, vec![stored_after(Some(2), &[5])]))
            .unwrap();
        let lookup = |cache: &CachedBlocks, blocks: &[u64]| {
            let found = cache.leading(blocks);
            (found.blocks, found.forks)
        };
        assert_eq!(lookup(&cache, &[1, 2, 9]), (2, 2), "a third prompt forks");
        assert_eq!(
            lookup(&cache, &[1, 2, 3, 9]),
            (3, 1),
            "one held continuation"
        );
        assert_eq!(lookup(&cache, &[1, 2, 3, 4, 9]), (4, 0));
        assert_eq!(lookup(&cache, &[9]), (0, 0));
        // An evicted continuation no longer counts, nor does one evicted parent first.
        cache
            .apply(&batch(1, 2, false, vec![removed(&[4, 3])]))
            .unwrap();
        assert_eq!(lookup(&cache, &[1, 2, 9]), (2, 1));
        cache
            .apply(&batch(1, 3, false, vec![removed(&[2]), removed(&[5])]))
            .unwrap();
        assert_eq!(lookup(&cache, &[1, 9]), (1, 0));
    }
}

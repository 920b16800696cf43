//! Paged KV-cache block allocation with a prefix cache.
//!
//! The KV cache is split into fixed-size blocks; a sequence owns a block table naming the
//! blocks that hold its positions. A block that is full and computed is entered into the
//! prefix cache under a key chained to its predecessor, so a later prompt that starts with
//! the same tokens takes a reference to those blocks instead of recomputing them. Only full
//! blocks are ever shared, so the model never writes into a block another sequence reads.
//! Cached blocks that no sequence references stay resident until the allocator needs the
//! space, and are then reused least recently released first.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use npufleet_contract::kv::block_hash;

use super::kv_events::CacheEvent;

pub type BlockId = u32;

/// Identifies one block's content: the chain id of the block before it plus its own tokens.
/// Chain ids are never reused, so equal keys mean equal token prefixes, exactly (no hash
/// collision can alias two different prefixes).
#[derive(Clone, PartialEq, Eq, Hash)]
struct BlockKey {
    parent: u64,
    /// Shared with the block's [`CacheEvent::Stored`], which carries its tokens to
    /// subscribers that name blocks by their own hashes.
    tokens: Arc<[u32]>,
}

/// Chain ids below this stand for "no predecessor": the first block of a sequence chains
/// to its namespace, so sequences in different namespaces (computed at different weight
/// precisions) never share blocks.
const FIRST_CONTENT_CHAIN_ID: u64 = 1 << 16;

#[derive(Default)]
struct Block {
    ref_count: u32,
    /// Set while the block is in the prefix cache, with the block's published name.
    cached: Option<(BlockKey, u64)>,
    /// Release order of a cached, unreferenced block, for least-recently-used eviction.
    released_at: u64,
}

/// The blocks of one sequence.
#[derive(Default, Debug)]
pub struct SequenceBlocks {
    /// `table[i]` holds positions `i * block_size .. (i + 1) * block_size`.
    pub table: Vec<BlockId>,
    /// Chain id of each leading full block whose content is known to the cache.
    chain: Vec<u64>,
    /// The published name of each block in `chain`.
    hashes: Vec<u64>,
    namespace: u64,
}

impl SequenceBlocks {
    pub fn in_namespace(namespace: u16) -> Self {
        Self {
            namespace: u64::from(namespace),
            ..Self::default()
        }
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }
}

pub struct BlockManager {
    block_size: usize,
    blocks: Vec<Block>,
    /// Blocks without content.
    free: Vec<BlockId>,
    /// Cached blocks with no references, ordered by release time.
    evictable: BTreeSet<(u64, BlockId)>,
    cache: HashMap<BlockKey, (BlockId, u64)>,
    next_chain_id: u64,
    clock: u64,
    /// Changes to the cache since [`BlockManager::take_events`] last ran.
    events: Vec<CacheEvent>,
}

impl BlockManager {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block size must be positive");
        Self {
            block_size,
            blocks: (0..num_blocks).map(|_| Block::default()).collect(),
            // Reversed so blocks are handed out in ascending order.
            free: (0..num_blocks as BlockId).rev().collect(),
            evictable: BTreeSet::new(),
            cache: HashMap::new(),
            next_chain_id: FIRST_CONTENT_CHAIN_ID,
            clock: 0,
            events: Vec::new(),
        }
    }

    /// The blocks entered into and evicted from the prefix cache since the last call.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        std::mem::take(&mut self.events)
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that an allocation can take: empty ones plus unreferenced cached ones.
    pub fn num_available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks referenced by at least one sequence.
    pub fn num_in_use(&self) -> usize {
        self.blocks.len() - self.num_available()
    }

    /// Blocks needed to hold `num_tokens` positions.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// Takes references to the cached blocks that hold the longest full-block prefix of
    /// `tokens`, leaving at least one token uncomputed (the model needs it to produce
    /// logits). `seq` must be empty. Returns the number of tokens now covered.
    pub fn match_prefix(&mut self, tokens: &[u32], seq: &mut SequenceBlocks) -> usize {
        debug_assert!(seq.is_empty());
        let run: Vec<_> = self.cached_run(tokens, seq.namespace).collect();
        for (chunk, (block, chain_id)) in tokens.chunks_exact(self.block_size).zip(run) {
            self.retain(block);
            seq.table.push(block);
            seq.chain.push(chain_id);
            seq.hashes
                .push(block_hash(seq.hashes.last().copied(), chunk));
        }
        seq.table.len() * self.block_size
    }

    /// The number of tokens [`BlockManager::match_prefix`] would cover for a sequence in
    /// `seq`'s namespace now, taking nothing.
    pub fn cached_prefix_len(&self, tokens: &[u32], seq: &SequenceBlocks) -> usize {
        self.cached_run(tokens, seq.namespace).count() * self.block_size
    }

    /// The cached blocks holding `tokens`' leading full blocks, each with its chain id,
    /// short of the last token.
    fn cached_run(&self, tokens: &[u32], namespace: u64) -> impl Iterator<Item = (BlockId, u64)> {
        let max_blocks = tokens.len().saturating_sub(1) / self.block_size;
        tokens
            .chunks_exact(self.block_size)
            .take(max_blocks)
            .scan(namespace, |parent, chunk| {
                let key = BlockKey {
                    parent: *parent,
                    tokens: chunk.into(),
                };
                let &(block, chain_id) = self.cache.get(&key)?;
                *parent = chain_id;
                Some((block, chain_id))
            })
    }

    /// Extends `seq` so its table covers `num_tokens` positions. All or nothing: returns
    /// false, changing nothing, when not enough blocks are available.
    pub fn grow(&mut self, seq: &mut SequenceBlocks, num_tokens: usize) -> bool {
        let needed = self.blocks_for(num_tokens).saturating_sub(seq.table.len());
        if needed > self.num_available() {
            return false;
        }
        for _ in 0..needed {
            let block = self.take_block();
            seq.table.push(block);
        }
        true
    }

    /// Enters the full blocks among the first `num_computed` positions of `tokens` into
    /// the prefix cache.
    pub fn register_full_blocks(
        &mut self,
        seq: &mut SequenceBlocks,
        tokens: &[u32],
        num_computed: usize,
    ) {
        let full = (num_computed / self.block_size).min(seq.table.len());
        while seq.chain.len() < full {
            let index = seq.chain.len();
            let parent = seq.chain.last().copied().unwrap_or(seq.namespace);
            let start = index * self.block_size;
            let key = BlockKey {
                parent,
                tokens: tokens[start..start + self.block_size].into(),
            };
            let parent_hash = seq.hashes.last().copied();
            let hash = block_hash(parent_hash, &key.tokens);
            let chain_id = match self.cache.get(&key) {
                // Another block already holds this content (computed concurrently); this
                // one stays private and the chain continues from the cached one.
                Some(&(_, existing)) => existing,
                None => {
                    let chain_id = self.next_chain_id;
                    self.next_chain_id += 1;
                    let block = seq.table[index];
                    self.events.push(CacheEvent::Stored {
                        hash,
                        parent: parent_hash,
                        tokens: key.tokens.clone(),
                    });
                    self.blocks[block as usize].cached = Some((key.clone(), hash));
                    self.cache.insert(key, (block, chain_id));
                    chain_id
                }
            };
            seq.chain.push(chain_id);
            seq.hashes.push(hash);
        }
    }

    /// Drops the sequence's references. Blocks are released last first, so the tail of a
    /// prompt is evicted before its (more widely shared) head.
    pub fn free(&mut self, seq: &mut SequenceBlocks) {
        while let Some(block) = seq.table.pop() {
            self.release(block);
        }
        seq.chain.clear();
        seq.hashes.clear();
    }

    fn retain(&mut self, block: BlockId) {
        let entry = &mut self.blocks[block as usize];
        if entry.ref_count == 0 {
            self.evictable.remove(&(entry.released_at, block));
        }
        entry.ref_count += 1;
    }

    fn release(&mut self, block: BlockId) {
        let entry = &mut self.blocks[block as usize];
        debug_assert!(entry.ref_count > 0, "block {block} released twice");
        entry.ref_count -= 1;
        if entry.ref_count == 0 {
            if entry.cached.is_some() {
                self.clock += 1;
                entry.released_at = self.clock;
                self.evictable.insert((self.clock, block));
            } else {
                self.free.push(block);
            }
        }
    }

    /// Caller has checked `num_available() > 0`.
    fn take_block(&mut self) -> BlockId {
        let block = match self.free.pop() {
            Some(block) => block,
            None => {
                let (_, block) = self
                    .evictable
                    .pop_first()
                    .expect("caller checked that a block is available");
                let (key, hash) = self.blocks[block as usize]
                    .cached
                    .take()
                    .expect("evictable blocks are cached");
                self.cache.remove(&key);
                self.events.push(CacheEvent::Removed { hash });
                block
            }
        };
        self.blocks[block as usize].ref_count = 1;
        block
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(n: usize, offset: u32) -> Vec<u32> {
        (0..n as u32).map(|t| t + offset).collect()
    }

    #[test]
    fn grow_allocates_whole_blocks_all_or_nothing() {
        let mut blocks = BlockManager::new(4, 4);
        let mut a = SequenceBlocks::default();
        assert!(blocks.grow(&mut a, 5));
        assert_eq!(a.table.len(), 2);
        assert!(blocks.grow(&mut a, 8));
        assert_eq!(a.table.len(), 2);
        let mut b = SequenceBlocks::default();
        assert!(!blocks.grow(&mut b, 9), "needs 3 blocks, only 2 left");
        assert!(b.is_empty());
        assert_eq!(blocks.num_available(), 2);
        blocks.free(&mut a);
        assert_eq!(blocks.num_available(), 4);
    }

    #[test]
    fn full_computed_blocks_are_shared_and_the_last_token_is_left_to_compute() {
        let mut blocks = BlockManager::new(8, 4);
        let prompt = tokens(10, 1);
        let mut a = SequenceBlocks::default();
        assert_eq!(blocks.match_prefix(&prompt, &mut a), 0);
        assert!(blocks.grow(&mut a, 10));
        blocks.register_full_blocks(&mut a, &prompt, 10);

        // Same 8-token head, different tail: both full blocks are shared.
        let mut other = prompt[..8].to_vec();
        other.extend([99, 98, 97]);
        let mut b = SequenceBlocks::default();
        assert_eq!(blocks.match_prefix(&other, &mut b), 8);
        assert_eq!(b.table[..], a.table[..2]);

        // A prompt of exactly 8 tokens may reuse only one block: one token must be computed.
        let mut c = SequenceBlocks::default();
        assert_eq!(blocks.match_prefix(&prompt[..8], &mut c), 4);

        // A different first block breaks the chain even if the second block matches.
        let mut shifted = vec![1000];
        shifted.extend_from_slice(&prompt[1..]);
        let mut d = SequenceBlocks::default();
        assert_eq!(blocks.match_prefix(&shifted, &mut d), 0);

        // Another namespace shares nothing.
        let mut e = SequenceBlocks::in_namespace(1);
        assert_eq!(blocks.match_prefix(&prompt, &mut e), 0);
    }

    #[test]
    fn the_cache_publishes_what_it_stores_and_evicts_under_the_routers_names() {
        let mut blocks = BlockManager::new(4, 2);
        let prompt = tokens(5, 1);
        let names = npufleet_contract::kv::block_hashes(&prompt, 2);
        let mut a = SequenceBlocks::default();
        assert!(blocks.grow(&mut a, 5));
        blocks.register_full_blocks(&mut a, &prompt, 5);
        assert_eq!(
            blocks.take_events(),
            vec![
                CacheEvent::Stored {
                    hash: names[0],
                    parent: None,
                    tokens: prompt[..2].into(),
                },
                CacheEvent::Stored {
                    hash: names[1],
                    parent: Some(names[0]),
                    tokens: prompt[2..4].into(),
                },
            ]
        );
        // A second sequence reusing the blocks stores nothing new.
        let mut b = SequenceBlocks::default();
        assert_eq!(blocks.match_prefix(&prompt, &mut b), 4);
        assert!(blocks.grow(&mut b, 5));
        blocks.register_full_blocks(&mut b, &prompt, 5);
        assert!(blocks.take_events().is_empty());
        blocks.free(&mut a);
        blocks.free(&mut b);
        // Room for a new prompt is made by evicting, tail first.
        let mut c = SequenceBlocks::default();
        assert!(blocks.grow(&mut c, 8));
        assert_eq!(
            blocks.take_events(),
            vec![
                CacheEvent::Removed { hash: names[1] },
                CacheEvent::Removed { hash: names[0] },
            ]
        );
    }

    #[test]
    fn cached_blocks_survive_until_space_is_needed_then_lru_goes_first() {
        let mut blocks = BlockManager::new(3, 2);
        let first = tokens(3, 1);
        let second = tokens(3, 50);
        for prompt in [&first, &second] {
            let mut seq = SequenceBlocks::default();
            assert!(blocks.grow(&mut seq, 3));
            blocks.register_full_blocks(&mut seq, prompt, 3);
            blocks.free(&mut seq);
        }
        // Both single full blocks stay cached and unreferenced.
        assert_eq!(blocks.num_in_use(), 0);
        let mut hit = SequenceBlocks::default();
        assert_eq!(blocks.match_prefix(&first, &mut hit), 2);
        blocks.free(&mut hit);

        // Taking all three blocks evicts everything; `second` was released longest ago.
        let mut big = SequenceBlocks::default();
        assert!(blocks.grow(&mut big, 4));
        let mut probe = SequenceBlocks::default();
        assert_eq!(blocks.match_prefix(&second, &mut probe), 0);
        assert_eq!(blocks.match_prefix(&first, &mut probe), 2);
        blocks.free(&mut probe);
        blocks.free(&mut big);
    }

    #[test]
    fn referenced_blocks_are_never_evicted() {
        let mut blocks = BlockManager::new(2, 2);
        let prompt = tokens(3, 1);
        let mut holder = SequenceBlocks::default();
        assert!(blocks.grow(&mut holder, 3));
        blocks.register_full_blocks(&mut holder, &prompt, 3);
        let mut other = SequenceBlocks::default();
        assert!(!blocks.grow(&mut other, 1));
        blocks.free(&mut holder);
        assert!(blocks.grow(&mut other, 4));
    }

    #[test]
    fn concurrent_duplicates_keep_one_cached_copy() {
        let mut blocks = BlockManager::new(4, 2);
        let prompt = tokens(5, 1);
        let mut a = SequenceBlocks::default();
        let mut b = SequenceBlocks::default();
        assert!(blocks.grow(&mut a, 5));
        assert!(blocks.grow(&mut b, 2));
        blocks.register_full_blocks(&mut a, &prompt, 2);
        blocks.register_full_blocks(&mut b, &prompt, 2);
        blocks.register_full_blocks(&mut a, &prompt, 4);
        let mut c = SequenceBlocks::default();
        assert_eq!(blocks.match_prefix(&prompt, &mut c), 4);
        assert_eq!(c.table[..], a.table[..2]);
    }
}

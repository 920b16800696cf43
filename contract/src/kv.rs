//! How a prefix-cache block is named between the worker, which publishes the blocks it holds,
//! and the router, which looks up the blocks of a prompt: a 64-bit hash chained over the
//! token ids of each full block, so a block's name stands for the whole prefix that ends
//! with it, as vLLM's block hashes do.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The seed of the first block of a prompt. Fixed, so that every worker and router agree.
const ROOT: u64 = 0x6e70_7566_6c65_6574;

/// The hash of a block whose tokens are `tokens`, following the block hashed `parent`
/// (`None`: the prompt's first block).
pub fn block_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut bytes = Vec::with_capacity(tokens.len() * 4);
    for token in tokens {
        bytes.extend_from_slice(&token.to_le_bytes());
    }
    xxh3_64_with_seed(&bytes, parent.unwrap_or(ROOT))
}

/// The hashes of the full blocks of `tokens`, each chained to the one before. A trailing
/// partial block has none: the prefix cache only ever shares full blocks.
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut parent = None;
    tokens
        .chunks_exact(block_size.max(1))
        .map(|chunk| {
            let hash = block_hash(parent, chunk);
            parent = Some(hash);
            hash
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_names_its_whole_prefix() {
        let a = block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 4);
        let b = block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_eq!(a.len(), 2, "the partial block is not named");
        assert_eq!(a, b);
        let c = block_hashes(&[0, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_ne!(a[0], c[0]);
        assert_ne!(a[1], c[1], "equal tokens after a different prefix differ");
        assert_eq!(a[1], block_hash(Some(a[0]), &[5, 6, 7, 8]));
    }

    #[test]
    fn the_hash_is_fixed_across_builds() {
        // Workers and routers of different builds share one index: the value must not move.
        assert_eq!(block_hashes(&[1, 2], 2), vec![block_hash(None, &[1, 2])]);
        assert_eq!(block_hash(None, &[1, 2]), 0xff07_3b33_34a7_c9cc);
    }
}

//! The prefix-affinity key of a request: a hash of its prompt's leading blocks.
//!
//! The worker's prefix cache shares full blocks of `block_size` tokens; the block size is the
//! worker's own (`vllm:cache_config_info`, read by [`crate::load`]). The router does not
//! tokenize: the model file lives on the workers' volumes, which a router serving every
//! InferenceService in its scope should not mount, and the worker renders its chat template
//! (role headers, special tokens) before tokenising, so even the exact tokenizer would not
//! reproduce the worker's block boundaries. What the key needs is only that prompts sharing
//! their first `max_blocks` cache blocks share a key; the router takes those blocks as
//! `BYTES_PER_TOKEN` bytes a token, which holds within a factor of two for English prose and
//! code (about four bytes a token) and for CJK text (three bytes a character, one or two
//! characters a token). Requests that share a system prompt and differ in their question
//! land together.

use crate::policy::{Fnv1a, mix};

/// Bytes of UTF-8 prompt text per token, for cutting blocks without a tokenizer.
pub const BYTES_PER_TOKEN: usize = 4;

/// How many of a prompt's leading blocks make up its prefix-affinity key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixBlocks {
    pub max_blocks: usize,
}

impl PrefixBlocks {
    /// The key of `prompt` for a worker whose prefix cache shares blocks of `block_tokens`
    /// tokens: a hash of its leading full blocks, at most `max_blocks` of them. `None` for a
    /// prompt shorter than one block: it shares nothing worth keeping a replica for, so the
    /// request goes to the least-loaded replica instead.
    pub fn key(&self, prompt: &[u8], block_tokens: usize) -> Option<u64> {
        let block_bytes = block_tokens.max(1) * BYTES_PER_TOKEN;
        let full_blocks = (prompt.len() / block_bytes).min(self.max_blocks);
        if full_blocks == 0 {
            return None;
        }
        let mut hash = Fnv1a::default();
        hash.write(&prompt[..full_blocks * block_bytes]);
        Some(mix(hash.finish()))
    }
}

/// The `block_size` label of the worker's `vllm:cache_config_info` series in its `/metrics`
/// text: the tokens per prefix-cache block.
pub fn cache_block_size(metrics: &str) -> Option<usize> {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix("vllm:cache_config_info{"))?
        .split(',')
        .find_map(|label| label.trim().strip_prefix("block_size=\""))?
        .split('"')
        .next()?
        .parse()
        .ok()
        .filter(|&size| size > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BLOCKS: PrefixBlocks = PrefixBlocks { max_blocks: 2 };
    /// Two tokens a block: eight bytes.
    const BLOCK_TOKENS: usize = 2;

    #[test]
    fn prompts_that_share_their_leading_blocks_share_a_key() {
        let a = BLOCKS.key(b"You are a helpful bot. What is 2+2?", BLOCK_TOKENS);
        let b = BLOCKS.key(b"You are a helpful bot. Name a river.", BLOCK_TOKENS);
        assert!(a.is_some());
        assert_eq!(a, b);
    }

    #[test]
    fn prompts_that_differ_within_the_leading_blocks_differ() {
        let a = BLOCKS.key(b"You are a helpful bot.", BLOCK_TOKENS);
        let b = BLOCKS.key(b"You are a pirate bot.", BLOCK_TOKENS);
        assert_ne!(a, b);
    }

    #[test]
    fn a_prompt_shorter_than_a_block_has_no_key() {
        assert_eq!(BLOCKS.key(b"Hi!", BLOCK_TOKENS), None);
        assert!(BLOCKS.key(b"12345678", BLOCK_TOKENS).is_some());
    }

    #[test]
    fn the_key_spans_the_workers_block_size() {
        // With 16-token blocks, the first block is 64 bytes: prompts that differ after it
        // share a key, prompts that differ inside it do not.
        let shared = "s".repeat(64);
        let a = BLOCKS.key(format!("{shared}A question").as_bytes(), 16);
        let b = BLOCKS.key(format!("{shared}Another one").as_bytes(), 16);
        assert_eq!(a, b);
        assert!(a.is_some());
        assert_eq!(BLOCKS.key(&[b's'; 63], 16), None);
        assert_ne!(
            BLOCKS.key(format!("x{}", &shared[1..]).as_bytes(), 16),
            a,
            "a difference inside the first block changes the key"
        );
    }

    #[test]
    fn the_block_size_is_read_from_the_workers_cache_config_info() {
        let metrics = "# HELP vllm:cache_config_info KV-cache configuration.\n\
            # TYPE vllm:cache_config_info gauge\n\
            vllm:cache_config_info{block_size=\"32\",model_name=\"smollm2\",num_gpu_blocks=\"640\"} 1\n\
            vllm:num_requests_waiting{model_name=\"smollm2\"} 0\n";
        assert_eq!(cache_block_size(metrics), Some(32));
        assert_eq!(cache_block_size("vllm:num_requests_waiting 0\n"), None);
        assert_eq!(
            cache_block_size("vllm:cache_config_info{block_size=\"0\"} 1\n"),
            None
        );
    }
}

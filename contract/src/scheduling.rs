//! How a worker orders the prompts it has accepted, which the router's estimate of a new
//! prompt's wait at a replica follows.

/// A prompt more than this many times as long (in positions left to compute) as the shortest
/// one a worker's step finishes is outranked by it: it advances a small chunk in that step,
/// and a prompt not yet begun goes after it. A short prompt therefore waits for the prompt in
/// its step and for those of like length, not for every longer prompt that came first.
pub const LONGER_PROMPT_RATIO: usize = 2;

/// A worker's default for the most positions of one prompt in one step (vLLM's
/// `long_prefill_token_threshold`): a step runs to its end once begun, so a prompt arriving
/// during a long one's prefill waits for a chunk of it, not all of it. On a CPU, where a
/// position costs about a millisecond, 128 positions a step prefill as fast as 512.
pub const LONG_PREFILL_TOKEN_THRESHOLD: usize = 128;

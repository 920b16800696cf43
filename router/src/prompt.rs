//! Where a request's prompt would like to go: the blocks of it a replica's prefix cache may
//! already hold.
//!
//! Two ways to name them. Exactly, for an engine that publishes its cache events (this
//! project's worker): the router rebuilds the worker's tokenizer and chat template from the
//! recipe the worker publishes ([`Recipes`]), tokenises the prompt as the worker will, and
//! names its full blocks as the worker does ([`npufleet_contract::kv::block_hashes`]), so it
//! can look them up in each replica's cache ([`crate::cache_index`]). Approximately, for any
//! other engine (or before the recipe arrived): a hash of the prompt's leading bytes, taking
//! a block as `block_size × BYTES_PER_TOKEN` bytes ([`PrefixBlocks`]), which holds within a
//! factor of two for English prose and code (about four bytes a token) and for CJK text.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use npufleet_contract::prompt::{
    CHAT_ROLES, ChatMessage, PromptRecipe, PromptTokenizer, RECIPE_PATH,
};

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

/// A request's prompt, as far as routing needs it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Prompt {
    /// The prompt's text in the order the model sees it (for a chat, each message's role and
    /// text): what the approximate key hashes.
    pub flat: Vec<u8>,
    /// What the worker tokenises, when the router can rebuild it exactly.
    pub exact: Option<ExactPrompt>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum ExactPrompt {
    /// A completion or inference prompt's text.
    Text(String),
    /// Chat messages, to render with the model's chat template.
    Chat(Vec<ChatMessage>),
}

impl Prompt {
    pub fn text(text: &str) -> Self {
        Prompt {
            flat: text.as_bytes().to_vec(),
            exact: Some(ExactPrompt::Text(text.to_owned())),
        }
    }

    /// A chat's messages as the worker reads them: `developer` is `system`, a list of text
    /// parts is their texts joined by newlines. A message the worker would refuse (another
    /// role, a part that is not text) leaves only the approximate key.
    pub fn chat(messages: &[serde_json::Value]) -> Self {
        let mut flat = String::new();
        let mut exact = Some(Vec::with_capacity(messages.len()));
        for message in messages {
            let role = message.get("role").and_then(|r| r.as_str()).unwrap_or("");
            let content = match message.get("content") {
                None | Some(serde_json::Value::Null) => Some(String::new()),
                Some(serde_json::Value::String(text)) => Some(text.clone()),
                Some(serde_json::Value::Array(parts)) => parts
                    .iter()
                    .map(|part| match part.get("type").and_then(|t| t.as_str()) {
                        Some("text") => part.get("text").and_then(|t| t.as_str()),
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()
                    .map(|texts| texts.join("\n")),
                Some(_) => None,
            };
            flat.push_str(role);
            flat.push('\n');
            flat.push_str(content.as_deref().unwrap_or(""));
            flat.push('\n');
            exact = match (exact, content) {
                (Some(mut list), Some(content)) if CHAT_ROLES.contains(&role) => {
                    let role = if role == "developer" { "system" } else { role };
                    list.push(ChatMessage {
                        role: role.to_owned(),
                        content,
                    });
                    Some(list)
                }
                _ => None,
            };
        }
        Prompt {
            flat: flat.into_bytes(),
            exact: exact.map(ExactPrompt::Chat),
        }
    }
}

/// Where a request would like to go.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Affinity {
    /// Anywhere: placed by load.
    #[default]
    None,
    /// The approximate key of the prompt's leading bytes ([`PrefixBlocks::key`]).
    Key(u64),
    /// The prompt's token blocks as the worker names them.
    Blocks(TokenBlocks),
}

/// A prompt's tokens as the worker will see them, and the names of its full blocks.
#[derive(Clone, PartialEq)]
pub struct TokenBlocks {
    /// First first.
    pub names: Vec<u64>,
    pub tokens: Vec<u32>,
    pub block_size: usize,
}

impl TokenBlocks {
    pub fn new(tokens: Vec<u32>, block_size: usize) -> Self {
        TokenBlocks {
            names: npufleet_contract::kv::block_hashes(&tokens, block_size),
            tokens,
            block_size,
        }
    }

    /// The tokens of the first `blocks` blocks.
    pub fn leading_tokens(&self, blocks: usize) -> &[u32] {
        &self.tokens[..(blocks * self.block_size).min(self.tokens.len())]
    }
}

/// The names only: a prompt's tokens have no place in a log line.
impl std::fmt::Debug for TokenBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenBlocks")
            .field("names", &self.names)
            .field("block_size", &self.block_size)
            .finish_non_exhaustive()
    }
}

/// How long a failed recipe fetch is left before the next request tries again.
const RECIPE_RETRY: Duration = Duration::from_secs(10);

/// Each model's prompt tokenisation, fetched once from one of its workers.
pub struct Recipes {
    http: reqwest::Client,
    models: Mutex<HashMap<String, RecipeState>>,
}

enum RecipeState {
    Ready(Arc<PromptTokenizer>),
    Fetching,
    Failed(Instant),
}

impl Recipes {
    pub fn new(http: reqwest::Client) -> Self {
        Recipes {
            http,
            models: Mutex::default(),
        }
    }

    /// The model's tokenisation, when it is known. Otherwise starts fetching it from the
    /// worker at `worker` (its HTTP address), and the request at hand goes without.
    pub fn get(
        self: &Arc<Self>,
        model: &str,
        worker: Option<SocketAddr>,
    ) -> Option<Arc<PromptTokenizer>> {
        let mut models = self.models.lock().expect("recipes lock");
        match models.get(model) {
            Some(RecipeState::Ready(tokenizer)) => return Some(tokenizer.clone()),
            Some(RecipeState::Fetching) => return None,
            Some(RecipeState::Failed(at)) if at.elapsed() < RECIPE_RETRY => return None,
            _ => {}
        }
        let worker = worker?;
        models.insert(model.to_owned(), RecipeState::Fetching);
        let (recipes, model) = (Arc::clone(self), model.to_owned());
        tokio::spawn(async move {
            let state = match recipes.fetch(worker).await {
                Ok(tokenizer) => {
                    tracing::info!(%model, %worker, "routing on the worker's own token blocks");
                    RecipeState::Ready(Arc::new(tokenizer))
                }
                Err(error) => {
                    tracing::warn!(%model, %worker, error = format!("{error:#}"), "no prompt recipe; routing on the prompt's leading bytes");
                    RecipeState::Failed(Instant::now())
                }
            };
            recipes
                .models
                .lock()
                .expect("recipes lock")
                .insert(model, state);
        });
        None
    }

    async fn fetch(&self, worker: SocketAddr) -> anyhow::Result<PromptTokenizer> {
        let recipe: PromptRecipe = self
            .http
            .get(format!("http://{worker}{RECIPE_PATH}"))
            .timeout(Duration::from_secs(30))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        let tokenizer =
            tokio::task::spawn_blocking(move || PromptTokenizer::from_recipe(recipe)).await??;
        Ok(tokenizer)
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
    fn a_chat_is_read_as_the_worker_reads_it() {
        let messages = serde_json::json!([
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]);
        let prompt = Prompt::chat(messages.as_array().unwrap());
        assert_eq!(prompt.flat, b"developer\nBe brief.\nuser\na\nb\n");
        let message = |role: &str, content: &str| ChatMessage {
            role: role.into(),
            content: content.into(),
        };
        assert_eq!(
            prompt.exact,
            Some(ExactPrompt::Chat(vec![
                message("system", "Be brief."),
                message("user", "a\nb"),
            ]))
        );
        let tool = serde_json::json!([{"role": "tool", "content": "42"}]);
        let image = serde_json::json!([{"role": "user", "content": [{"type": "image_url"}]}]);
        for messages in [tool, image] {
            let prompt = Prompt::chat(messages.as_array().unwrap());
            assert_eq!(prompt.exact, None, "only the approximate key is left");
            assert!(!prompt.flat.is_empty());
        }
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

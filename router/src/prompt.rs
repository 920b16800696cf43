//! The prefix-affinity key of a request: a hash of its prompt's leading blocks.
//!
//! The router does not tokenize. It cuts the prompt's bytes into blocks of about the size of
//! the worker's prefix-cache blocks (16 tokens at roughly four bytes a token by default), so
//! that prompts sharing a cached prefix share a key. Only the first few blocks count: requests
//! that share a system prompt and differ in their question must land together.

use serde_json::Value;

use crate::policy::{Fnv1a, mix};

/// How prompts are cut into blocks for the prefix-affinity key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixBlocks {
    /// Bytes of prompt text per block.
    pub block_bytes: usize,
    /// Leading blocks that make up the key.
    pub max_blocks: usize,
}

impl PrefixBlocks {
    /// The key of `prompt`: a hash of its leading full blocks, at most `max_blocks` of them.
    /// `None` for a prompt shorter than one block: it shares nothing worth keeping a replica
    /// for, so the request goes to the least-loaded replica instead.
    pub fn key(&self, prompt: &[u8]) -> Option<u64> {
        let full_blocks = (prompt.len() / self.block_bytes.max(1)).min(self.max_blocks);
        if full_blocks == 0 {
            return None;
        }
        let mut hash = Fnv1a::default();
        hash.write(&prompt[..full_blocks * self.block_bytes]);
        Some(mix(hash.finish()))
    }
}

/// The prompt text of an OpenAI `/v1/completions` or `/v1/chat/completions` body, in the order
/// the model sees it: each chat message's role and text, or the completion prompt (the first
/// of a list). Token-id prompts have no text and give `None`.
pub fn openai_prompt(body: &Value) -> Option<String> {
    if let Some(messages) = body.get("messages").and_then(Value::as_array) {
        let mut text = String::new();
        for message in messages {
            text.push_str(message.get("role").and_then(Value::as_str).unwrap_or(""));
            text.push('\n');
            match message.get("content") {
                Some(Value::String(content)) => text.push_str(content),
                Some(Value::Array(parts)) => {
                    for part in parts {
                        if let Some(part) = part.get("text").and_then(Value::as_str) {
                            text.push_str(part);
                        }
                    }
                }
                _ => {}
            }
            text.push('\n');
        }
        return Some(text);
    }
    match body.get("prompt")? {
        Value::String(prompt) => Some(prompt.clone()),
        Value::Array(prompts) => prompts.first()?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// The prompt of a KServe v2 REST infer body: the first input whose first element is a string
/// (the worker's `BYTES` text input).
pub fn v2_rest_prompt(body: &Value) -> Option<String> {
    body.get("inputs")?
        .as_array()?
        .iter()
        .find_map(|input| input.get("data")?.as_array()?.first()?.as_str())
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const BLOCKS: PrefixBlocks = PrefixBlocks {
        block_bytes: 8,
        max_blocks: 2,
    };

    #[test]
    fn prompts_that_share_their_leading_blocks_share_a_key() {
        let a = BLOCKS.key(b"You are a helpful bot. What is 2+2?");
        let b = BLOCKS.key(b"You are a helpful bot. Name a river.");
        assert!(a.is_some());
        assert_eq!(a, b);
    }

    #[test]
    fn prompts_that_differ_within_the_leading_blocks_differ() {
        let a = BLOCKS.key(b"You are a helpful bot.");
        let b = BLOCKS.key(b"You are a pirate bot.");
        assert_ne!(a, b);
    }

    #[test]
    fn a_prompt_shorter_than_a_block_has_no_key() {
        assert_eq!(BLOCKS.key(b"Hi!"), None);
        assert!(BLOCKS.key(b"12345678").is_some());
    }

    #[test]
    fn chat_messages_give_roles_and_texts_in_order() {
        let body = json!({"model": "m", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]},
        ]});
        assert_eq!(
            openai_prompt(&body).unwrap(),
            "system\nBe brief.\nuser\nHello there\n"
        );
    }

    #[test]
    fn completion_prompts_are_read_as_strings_or_the_first_of_a_list() {
        assert_eq!(
            openai_prompt(&json!({"prompt": "Once upon"})).as_deref(),
            Some("Once upon")
        );
        assert_eq!(
            openai_prompt(&json!({"prompt": ["first", "second"]})).as_deref(),
            Some("first")
        );
        assert_eq!(openai_prompt(&json!({"prompt": [1, 2, 3]})), None);
        assert_eq!(openai_prompt(&json!({"model": "m"})), None);
    }

    #[test]
    fn v2_rest_prompt_is_the_first_text_input() {
        let body = json!({"inputs": [
            {"name": "max_tokens", "datatype": "INT32", "shape": [1], "data": [8]},
            {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Tell me a story"]},
        ]});
        assert_eq!(v2_rest_prompt(&body).as_deref(), Some("Tell me a story"));
        assert_eq!(v2_rest_prompt(&json!({"inputs": []})), None);
    }
}

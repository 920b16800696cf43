//! Tokenisation and chat templates.
//!
//! GGUF files carry a GPT-2 style byte-level BPE vocabulary (`tokenizer.ggml.tokens`,
//! `merges`, `token_type`, and the pre-tokenizer name in `tokenizer.ggml.pre`); it is turned
//! into a `tokenizers::Tokenizer` with the matching pre-tokenizer. Hugging Face directories
//! bring their own `tokenizer.json`. Chat templates are Jinja, rendered with minijinja.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result, bail, ensure};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use npufleet_contract::prompt::PromptRecipe;

use super::ModelConfig;
use super::gguf::{GgufFile, Value};

/// GGUF `tokenizer.ggml.token_type` values.
const TOKEN_TYPE_CONTROL: u64 = 3;
const TOKEN_TYPE_USER_DEFINED: u64 = 4;

/// Texts of tokens that end an assistant turn in common chat formats.
const END_OF_TURN_TEXTS: &[&str] = &["<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"];

/// The Llama 3 pre-tokenizer split (llama.cpp's `llama-bpe`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The Qwen2 pre-tokenizer split (llama.cpp's `qwen2`, also named `deepseek-r1-qwen` in the
/// DeepSeek-R1 distills): Llama 3's, but every digit is a piece of its own.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

pub use npufleet_contract::prompt::{ChatMessage, render_chat_template};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The bytes each id stands for (byte-level symbols mapped back to bytes).
    bytes: Vec<Vec<u8>>,
    /// Ids of special (control) tokens.
    special: Vec<bool>,
    chat_template: Option<String>,
    bos_token: String,
    eos_token: String,
}

/// GPT-2's reversible map from bytes to printable characters.
fn byte_to_char() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
        map[b as usize] = if printable {
            b as char
        } else {
            let c = char::from_u32(next).expect("GPT-2 byte symbols are valid chars");
            next += 1;
            c
        };
    }
    map
}

/// Builds a byte-level BPE tokenizer. `pre` names the pre-tokenizer as llama.cpp does in
/// `tokenizer.ggml.pre`; `added` lists (id, is_special) of tokens matched verbatim in text.
pub fn byte_level_bpe(
    tokens: &[String],
    merges: &[String],
    added: &[(u32, bool)],
    pre: &str,
) -> Result<tokenizers::Tokenizer> {
    let vocab: ahash::AHashMap<String, u32> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .with_context(|| format!("malformed merge {m:?}"))
        })
        .collect::<Result<Vec<_>>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(matches!(pre, "llama3" | "llama-bpe"))
        .build()
        .map_err(|e| anyhow::anyhow!("building the BPE model: {e}"))?;
    let byte_level =
        |use_regex| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, use_regex));
    // The split regex isolates the pieces; byte-level then only maps bytes to symbols.
    let split_then_bytes = |regex: &str| -> Result<PreTokenizerWrapper> {
        Ok(PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Split(
                Split::new(
                    SplitPattern::Regex(regex.into()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .map_err(|e| anyhow::anyhow!("pre-tokenizer regex: {e}"))?,
            ),
            byte_level(false),
        ])))
    };
    let pre_tokenizer = match pre {
        "" | "default" | "gpt2" | "gpt-2" => byte_level(true),
        "smollm" | "starcoder" | "refact" | "codeshell" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                byte_level(true),
            ]))
        }
        "llama3" | "llama-bpe" => split_then_bytes(LLAMA3_SPLIT)?,
        "qwen2" | "deepseek-r1-qwen" => split_then_bytes(QWEN2_SPLIT)?,
        other => bail!("unsupported pre-tokenizer {other:?} (tokenizer.ggml.pre)"),
    };
    let mut tk = tokenizers::Tokenizer::new(bpe);
    tk.with_pre_tokenizer(Some(pre_tokenizer));
    tk.with_decoder(Some(ByteLevelDecoder::default()));
    let (special, normal): (Vec<_>, Vec<_>) = added.iter().partition(|(_, s)| *s);
    let as_added = |list: Vec<&(u32, bool)>| -> Vec<AddedToken> {
        list.iter()
            .map(|&&(id, s)| AddedToken::from(tokens[id as usize].clone(), s))
            .collect()
    };
    let _ = tk.add_special_tokens(as_added(special));
    let _ = tk.add_tokens(as_added(normal));
    Ok(tk)
}

impl Tokenizer {
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer> {
        let strings = |key: &str| -> Result<Vec<String>> {
            file.get(key)
                .and_then(Value::as_array)
                .with_context(|| format!("metadata {key} is missing"))?
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .with_context(|| format!("{key} holds a non-string"))
                })
                .collect()
        };
        let model = file
            .get("tokenizer.ggml.model")
            .and_then(Value::as_str)
            .unwrap_or("");
        ensure!(
            model == "gpt2",
            "unsupported tokenizer model {model:?}: only byte-level BPE (gpt2) GGUF vocabularies are implemented"
        );
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?;
        let types: Vec<u64> = match file
            .get("tokenizer.ggml.token_type")
            .and_then(Value::as_array)
        {
            Some(a) => a.iter().map(|v| v.as_u64().unwrap_or(1)).collect(),
            None => vec![1; tokens.len()],
        };
        let added: Vec<(u32, bool)> = types
            .iter()
            .enumerate()
            .filter_map(|(i, &t)| match t {
                TOKEN_TYPE_CONTROL => Some((i as u32, true)),
                TOKEN_TYPE_USER_DEFINED => Some((i as u32, false)),
                _ => None,
            })
            .collect();
        let pre = file
            .get("tokenizer.ggml.pre")
            .and_then(Value::as_str)
            .unwrap_or("default");
        let inner = byte_level_bpe(&tokens, &merges, &added, pre)?;
        let token_text = |key: &str| {
            file.get(key)
                .and_then(Value::as_u64)
                .and_then(|id| tokens.get(id as usize).cloned())
                .unwrap_or_default()
        };
        let mut special = vec![false; tokens.len()];
        for &(id, s) in &added {
            special[id as usize] = s;
        }
        Ok(Tokenizer {
            bytes: byte_level_bytes(&tokens, &special),
            special,
            chat_template: file
                .get("tokenizer.chat_template")
                .and_then(Value::as_str)
                .map(str::to_string),
            bos_token: token_text("tokenizer.ggml.bos_token_id"),
            eos_token: token_text("tokenizer.ggml.eos_token_id"),
            inner,
        })
    }

    /// Reads `tokenizer.json` and, when present, `tokenizer_config.json` (chat template,
    /// BOS/EOS texts).
    pub fn from_hf_dir(dir: &Path) -> Result<Tokenizer> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
        let config: serde_json::Value =
            match std::fs::read_to_string(dir.join("tokenizer_config.json")) {
                Ok(text) => serde_json::from_str(&text).context("parsing tokenizer_config.json")?,
                Err(_) => serde_json::Value::Null,
            };
        let token_text = |key: &str| match config.get(key) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(v) => v
                .get("content")
                .and_then(|c| c.as_str())
                .unwrap_or_default()
                .to_string(),
            None => String::new(),
        };
        let n = inner.get_vocab_size(true);
        let tokens: Vec<String> = (0..n as u32)
            .map(|i| inner.id_to_token(i).unwrap_or_default())
            .collect();
        let mut special = vec![false; n];
        for (id, t) in inner.get_added_tokens_decoder() {
            if t.special && (id as usize) < n {
                special[id as usize] = true;
            }
        }
        let byte_level = inner
            .get_decoder()
            .and_then(|d| serde_json::to_value(d).ok())
            .is_some_and(|d| d.to_string().contains("\"ByteLevel\""));
        let bytes = if byte_level {
            byte_level_bytes(&tokens, &special)
        } else {
            sentencepiece_bytes(&tokens)
        };
        Ok(Tokenizer {
            inner,
            bytes,
            special,
            chat_template: config
                .get("chat_template")
                .and_then(|t| t.as_str())
                .map(str::to_string),
            bos_token: token_text("bos_token"),
            eos_token: token_text("eos_token"),
        })
    }

    /// A prompt's token ids: the model's BOS first when its configuration asks for one, then
    /// `text` encoded. Every path that turns prompt text into model input goes through here.
    pub fn encode_prompt(&self, config: &ModelConfig, text: &str) -> Vec<u32> {
        let bos = config.bos_token_id.filter(|_| config.add_bos);
        bos.into_iter().chain(self.encode(text)).collect()
    }

    /// Token ids; no BOS is added (prompts go through [`Tokenizer::encode_prompt`]).
    /// Special-token texts such as `<|im_start|>` in `text` become their single ids.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        match self.inner.encode(text, false) {
            Ok(e) => e.get_ids().to_vec(),
            Err(err) => {
                tracing::warn!(error = %err, "tokenizer failed; falling back to single-byte tokens");
                let single: HashMap<&[u8], u32> = self
                    .bytes
                    .iter()
                    .enumerate()
                    .filter(|(_, b)| b.len() == 1)
                    .map(|(i, b)| (b.as_slice(), i as u32))
                    .collect();
                text.bytes()
                    .filter_map(|b| single.get([b].as_slice()).copied())
                    .collect()
            }
        }
    }

    /// The text of `ids`; unknown ids are skipped and invalid UTF-8 is replaced.
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids
            .iter()
            .filter_map(|&id| self.token_bytes(id))
            .flatten()
            .copied()
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.bytes.get(id as usize).map(Vec::as_slice)
    }

    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.inner.token_to_id(text)
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// Bytes of the longest token (at least 1).
    pub fn longest_token_bytes(&self) -> usize {
        self.bytes.iter().map(Vec::len).max().unwrap_or(1).max(1)
    }

    pub fn vocab_size(&self) -> usize {
        self.bytes.len()
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Special tokens that close a chat turn (`<|im_end|>` and the like).
    pub fn end_of_turn_tokens(&self) -> Vec<u32> {
        END_OF_TURN_TEXTS
            .iter()
            .filter_map(|t| self.token_id(t))
            .filter(|&id| self.is_special(id))
            .collect()
    }

    /// The underlying `tokenizers` tokenizer (for writing `tokenizer.json`).
    pub fn hf(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self
            .chat_template
            .as_deref()
            .context("the model has no chat template")?;
        Ok(render_chat_template(
            template,
            messages,
            add_generation_prompt,
            &self.bos_token,
            &self.eos_token,
        )?)
    }

    /// What a router needs to tokenise prompts as this worker does.
    pub fn recipe(
        &self,
        config: &ModelConfig,
        model: &str,
        block_size: usize,
    ) -> Result<PromptRecipe> {
        Ok(PromptRecipe {
            model: model.to_owned(),
            tokenizer: serde_json::to_value(&self.inner).context("writing tokenizer.json")?,
            chat_template: self.chat_template.clone(),
            bos_token: self.bos_token.clone(),
            eos_token: self.eos_token.clone(),
            prefix_ids: config
                .bos_token_id
                .filter(|_| config.add_bos)
                .into_iter()
                .collect(),
            block_size,
        })
    }
}

fn byte_level_bytes(tokens: &[String], special: &[bool]) -> Vec<Vec<u8>> {
    let map = byte_to_char();
    let inverse: HashMap<char, u8> = map.iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
    tokens
        .iter()
        .zip(special)
        .map(|(t, &is_special)| {
            if is_special {
                return t.as_bytes().to_vec();
            }
            let mut out = Vec::with_capacity(t.len());
            for c in t.chars() {
                match inverse.get(&c) {
                    Some(&b) => out.push(b),
                    None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                }
            }
            out
        })
        .collect()
}

/// SentencePiece conventions: `▁` is a space, `<0xNN>` a raw byte.
fn sentencepiece_bytes(tokens: &[String]) -> Vec<Vec<u8>> {
    tokens
        .iter()
        .map(|t| {
            let hex = t.strip_prefix("<0x").and_then(|h| h.strip_suffix('>'));
            match hex
                .filter(|h| h.len() == 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                Some(b) => vec![b],
                None => t.replace('\u{2581}', " ").into_bytes(),
            }
        })
        .collect()
}

/// Incremental detokenisation that never splits a UTF-8 character: bytes of an unfinished
/// character wait for the next token.
#[derive(Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// The text that `id` completes (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        if let Some(b) = tok.token_bytes(id) {
            self.pending.extend_from_slice(b);
        }
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(
                        std::str::from_utf8(&self.pending[..valid]).expect("validated prefix"),
                    );
                    match e.error_len() {
                        // An incomplete character at the end: keep it for the next token.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Whatever is left, with an unfinished character replaced.
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::{ChatMessage, render_chat_template};

    #[test]
    fn block_tags_on_their_own_lines_leave_no_blank_lines() {
        let template = "{% for message in messages %}\n  {{ message.role }}: {{ message.content }}\n{% endfor %}\n{% if add_generation_prompt %}\nassistant:{% endif %}";
        let messages = [
            ChatMessage {
                role: "system".into(),
                content: "be brief".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "hi".into(),
            },
        ];
        let text = render_chat_template(template, &messages, true, "", "").unwrap();
        assert_eq!(text, "  system: be brief\n  user: hi\nassistant:");
    }
}

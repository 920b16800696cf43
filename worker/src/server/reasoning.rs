//! Splits a chat answer's `<think>…</think>` reasoning from its content, as vLLM's
//! `deepseek_r1` reasoning parser does: everything up to `</think>` is reasoning (a leading
//! `<think>` is dropped, since DeepSeek-R1's chat template already opens the block in the
//! prompt), everything after it is content, and an answer that never closes the block is all
//! reasoning.
//!
//! Which chat requests are split is the worker's `--reasoning-parser`: `auto` (the default)
//! splits when the rendered chat prompt ends inside an open `<think>` block, so a DeepSeek-R1
//! distill answers with `reasoning_content` and other models are untouched; `deepseek_r1`
//! splits every chat answer; `none` never does.

const START: &str = "<think>";
const END: &str = "</think>";

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ReasoningParser {
    /// Split when the chat prompt opens a `<think>` block.
    #[default]
    Auto,
    /// Split every chat answer.
    #[value(name = "deepseek_r1")]
    DeepseekR1,
    /// Never split.
    None,
}

impl ReasoningParser {
    /// Whether the answer to a chat request whose rendered prompt is `prompt` is split.
    pub fn applies(self, prompt: &str) -> bool {
        match self {
            ReasoningParser::Auto => prompt.trim_end().ends_with(START),
            ReasoningParser::DeepseekR1 => true,
            ReasoningParser::None => false,
        }
    }
}

/// Text routed to either side of `</think>`.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

/// The streaming splitter: text arrives in arbitrary pieces, so a piece ending in what may be
/// the start of a tag is held back until the next piece decides it.
#[derive(Debug)]
pub struct ReasoningSplitter {
    in_reasoning: bool,
    /// Nothing has been routed yet, so a `<think>` here opens the block and is dropped.
    at_start: bool,
    pending: String,
}

impl Default for ReasoningSplitter {
    fn default() -> Self {
        ReasoningSplitter {
            in_reasoning: true,
            at_start: true,
            pending: String::new(),
        }
    }
}

impl ReasoningSplitter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Routes `text` and whatever earlier text it decides.
    pub fn push(&mut self, text: &str) -> Split {
        self.pending.push_str(text);
        let mut out = Split::default();
        if self.at_start {
            if let Some(rest) = self.pending.strip_prefix(START) {
                self.pending = rest.to_string();
            } else if START.starts_with(self.pending.as_str()) {
                return out;
            }
            self.at_start = false;
        }
        if self.in_reasoning {
            if let Some(at) = self.pending.find(END) {
                out.reasoning = self.pending[..at].to_string();
                self.pending.drain(..at + END.len());
                self.in_reasoning = false;
            } else {
                let keep = partial_tag_len(&self.pending, END);
                let emit = self.pending.len() - keep;
                out.reasoning = self.pending[..emit].to_string();
                self.pending.drain(..emit);
                return out;
            }
        }
        out.content = std::mem::take(&mut self.pending);
        out
    }

    /// The held-back text, once the answer has ended.
    pub fn finish(self) -> Split {
        let mut out = Split::default();
        if self.in_reasoning {
            out.reasoning = self.pending;
        } else {
            out.content = self.pending;
        }
        out
    }

    /// A whole answer at once.
    pub fn split(text: &str) -> Split {
        let mut splitter = ReasoningSplitter::new();
        let mut out = splitter.push(text);
        let rest = splitter.finish();
        out.reasoning.push_str(&rest.reasoning);
        out.content.push_str(&rest.content);
        out
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `tag`.
fn partial_tag_len(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && text.ends_with(&tag[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(reasoning: &str, content: &str) -> Split {
        Split {
            reasoning: reasoning.into(),
            content: content.into(),
        }
    }

    /// Streams `pieces` and returns the concatenated sides.
    fn streamed(pieces: &[&str]) -> Split {
        let mut splitter = ReasoningSplitter::new();
        let mut out = Split::default();
        for piece in pieces {
            let part = splitter.push(piece);
            out.reasoning.push_str(&part.reasoning);
            out.content.push_str(&part.content);
        }
        let rest = splitter.finish();
        out.reasoning.push_str(&rest.reasoning);
        out.content.push_str(&rest.content);
        out
    }

    #[test]
    fn answers_split_at_the_closing_tag() {
        assert_eq!(
            ReasoningSplitter::split("Let me add.\n</think>\n\n4"),
            split("Let me add.\n", "\n\n4")
        );
        assert_eq!(
            ReasoningSplitter::split("<think>hmm</think>ok"),
            split("hmm", "ok")
        );
        assert_eq!(
            ReasoningSplitter::split("still thinking"),
            split("still thinking", "")
        );
        assert_eq!(ReasoningSplitter::split("</think>"), split("", ""));
        assert_eq!(
            ReasoningSplitter::split("a</think>b</think>c"),
            split("a", "b</think>c")
        );
    }

    #[test]
    fn a_tag_split_across_pieces_is_recognised() {
        let whole = "<think>\nwhy</think>\n\nbecause";
        let expected = split("\nwhy", "\n\nbecause");
        for cut in 1..whole.len() {
            let (a, b) = whole.split_at(cut);
            assert_eq!(streamed(&[a, b]), expected, "cut at {cut}");
        }
        let chars: Vec<String> = whole.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(streamed(&pieces), expected);
        assert_eq!(
            streamed(&["x</th", "ink", ">y"]),
            split("x", "y"),
            "three pieces"
        );
    }

    #[test]
    fn held_back_text_is_released_when_it_is_not_a_tag() {
        let mut splitter = ReasoningSplitter::new();
        assert_eq!(splitter.push("a</thi"), split("a", ""));
        assert_eq!(splitter.push("ng"), split("</thing", ""));
        assert_eq!(splitter.push("<"), split("", ""));
        assert_eq!(splitter.finish(), split("<", ""));
        let mut splitter = ReasoningSplitter::new();
        assert_eq!(splitter.push("<thi"), split("", ""));
        assert_eq!(splitter.push("s is it"), split("<this is it", ""));
    }

    #[test]
    fn a_late_opening_tag_is_text() {
        assert_eq!(
            ReasoningSplitter::split("a<think>b</think>c"),
            split("a<think>b", "c")
        );
    }

    #[test]
    fn multibyte_text_next_to_a_partial_tag() {
        assert_eq!(streamed(&["é</", "think>ü"]), split("é", "ü"));
        assert_eq!(streamed(&["思考<", "/think>答"]), split("思考", "答"));
    }

    #[test]
    fn auto_applies_to_prompts_that_open_a_think_block() {
        let prompt = "<｜User｜>1+1?<｜Assistant｜><think>\n";
        assert!(ReasoningParser::Auto.applies(prompt));
        assert!(!ReasoningParser::Auto.applies("<|im_start|>assistant\n"));
        assert!(ReasoningParser::DeepseekR1.applies("<|im_start|>assistant\n"));
        assert!(!ReasoningParser::None.applies(prompt));
    }
}

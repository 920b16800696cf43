//! The front-end stage of one request: turns the engine core's token ids into the text
//! events the servers stream, and applies the request's stop strings.
//!
//! It runs on the consumer's side of the stream, as the consumer reads it, so the engine
//! thread spends its time on forward passes. A stop string ends the request here: the stage
//! sends the final event and closes the channel, which the core treats as a cancellation and
//! frees the sequence's blocks.

use std::collections::VecDeque;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::sync::mpsc;

use super::stop::{StopMatcher, StopOutcome};
use crate::api::{EventSource, FinishReason, GenerationEvent, RequestTimings, Usage};
use crate::model::{Model, StreamDecoder};

/// What the engine core reports for one sequence: token ids, never text.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum SequenceOutput {
    /// A sampled token. `finish` is set on the sequence's last token (a stop id or the length
    /// limit); `usage` and `timings` are as of this token.
    Token {
        token_id: u32,
        finish: Option<FinishReason>,
        usage: Usage,
        timings: RequestTimings,
    },
    /// The sequence failed after it was accepted.
    Failed { message: String },
}

/// One request's front-end stage: the [`EventSource`] behind its [`GenerationStream`].
pub(super) struct RequestStream {
    outputs: mpsc::UnboundedReceiver<SequenceOutput>,
    model: Arc<Model>,
    decoder: StreamDecoder,
    stop: StopMatcher,
    /// Stop strings are looked for only in the text of tokens after the first `min_tokens`.
    min_tokens: u32,
    /// Events produced but not yet read (a last token brings its final event with it).
    ready: VecDeque<GenerationEvent>,
    /// The final event has been produced; nothing the core still sends is read.
    ended: bool,
}

impl EventSource for RequestStream {
    fn poll_event(&mut self, cx: &mut Context<'_>) -> Poll<Option<GenerationEvent>> {
        loop {
            if let Some(event) = self.ready.pop_front() {
                return Poll::Ready(Some(event));
            }
            if self.ended {
                return Poll::Ready(None);
            }
            let output = std::task::ready!(self.outputs.poll_recv(cx));
            self.absorb(output);
        }
    }

    fn blocking_event(&mut self) -> Option<GenerationEvent> {
        loop {
            if let Some(event) = self.ready.pop_front() {
                return Some(event);
            }
            if self.ended {
                return None;
            }
            let output = self.outputs.blocking_recv();
            self.absorb(output);
        }
    }
}

impl RequestStream {
    pub(super) fn new(
        outputs: mpsc::UnboundedReceiver<SequenceOutput>,
        model: Arc<Model>,
        stops: Vec<String>,
        min_tokens: u32,
    ) -> Self {
        Self {
            outputs,
            model,
            decoder: StreamDecoder::new(),
            stop: StopMatcher::new(stops),
            min_tokens,
            ready: VecDeque::new(),
            ended: false,
        }
    }

    /// Turns one output of the core into events.
    fn absorb(&mut self, output: Option<SequenceOutput>) {
        let Some(output) = output else {
            // The core dropped the sequence without a final output: the engine is gone.
            self.ended = true;
            return;
        };
        let (token_id, finish, usage, timings) = match output {
            SequenceOutput::Token {
                token_id,
                finish,
                usage,
                timings,
            } => (token_id, finish, usage, timings),
            SequenceOutput::Failed { message } => {
                self.end(GenerationEvent::Failed { message });
                return;
            }
        };
        let (text, reason) = if finish == Some(FinishReason::Stop) {
            // A stop id: its own text is not part of the output.
            let (text, _) = self.release_remaining();
            (text, Some(FinishReason::Stop))
        } else {
            let tokenizer = self.model.tokenizer();
            // Special tokens (an ignored end-of-sequence id, a turn marker) are not text, as
            // with vLLM's default `skip_special_tokens`.
            let piece = if tokenizer.is_special(token_id) {
                String::new()
            } else {
                self.decoder.push(tokenizer, token_id)
            };
            let outcome = if usage.completion_tokens > self.min_tokens {
                self.stop.push(&piece)
            } else {
                StopOutcome::Release(piece)
            };
            match outcome {
                StopOutcome::Stopped(text) => (text, Some(FinishReason::Stop)),
                StopOutcome::Release(mut text) if finish.is_some() => {
                    let (rest, stopped) = self.release_remaining();
                    text.push_str(&rest);
                    let reason = if stopped {
                        FinishReason::Stop
                    } else {
                        FinishReason::Length
                    };
                    (text, Some(reason))
                }
                StopOutcome::Release(text) => (text, None),
            }
        };
        self.ready
            .push_back(GenerationEvent::Token { token_id, text });
        if let Some(reason) = reason {
            self.end(GenerationEvent::Finished {
                reason,
                usage,
                timings,
            });
        }
    }

    /// Queues the final event and cancels the sequence in the core, which matters when a
    /// stop string ended a sequence the core would go on generating.
    fn end(&mut self, event: GenerationEvent) {
        self.ready.push_back(event);
        self.ended = true;
        self.outputs.close();
    }

    /// Ends the text: the decoder's pending bytes, then everything held back for stop
    /// strings. Says whether a stop string turned up in the pending bytes.
    fn release_remaining(&mut self) -> (String, bool) {
        let tail = std::mem::take(&mut self.decoder).finish();
        match self.stop.push(&tail) {
            StopOutcome::Stopped(text) => (text, true),
            StopOutcome::Release(mut text) => {
                text.push_str(&self.stop.flush());
                (text, false)
            }
        }
    }
}

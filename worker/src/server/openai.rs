//! The OpenAI-compatible HTTP API: `/v1/completions`, `/v1/chat/completions` (both with
//! server-sent-event streaming) and `/v1/models`. Chat answers that reason in a
//! `<think>` block return it as `reasoning_content` (see [`super::reasoning`]).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::Instrument;

use crate::api::{GenerateRequest, GenerationEvent, Prompt, Usage};
use crate::server::error::ServeError;
use crate::server::http::{BodyBytes, BodyError, HttpState, OpenAiError};
use crate::server::reasoning::{ReasoningParser, ReasoningSplitter, Split};
use crate::server::shared::{Shared, TrackedStream, http_priority};

mod request;

use request::in_request_terms;
pub use request::{RequestInput, ValidatedRequest, validate_chat_body, validate_completion_body};

/// Chunks of one streamed response buffered ahead of its connection.
const STREAM_BUFFER_CHUNKS: usize = 64;

fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

fn usage_json(usage: &Usage) -> Value {
    json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Completions,
    Chat,
}

/// Everything a response needs besides the generated text.
struct Reply {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    /// The chat answer's `<think>` block goes to `reasoning_content`.
    split_reasoning: bool,
}

/// `None` for an empty side, as vLLM leaves a missing side null.
fn non_empty(text: &str) -> Value {
    if text.is_empty() {
        Value::Null
    } else {
        Value::from(text)
    }
}

impl Reply {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        let mut body = json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if chunk && self.include_usage {
            body["usage"] = Value::Null;
        }
        body
    }

    /// A streamed chunk carrying `text`, or the end of the choice when `finish` is set.
    fn chunk(&self, text: Option<&str>, finish: Option<&str>) -> Value {
        let choice = match self.endpoint {
            Endpoint::Completions => json!({
                "index": 0,
                "text": text.unwrap_or(""),
                "logprobs": null,
                "finish_reason": finish,
            }),
            Endpoint::Chat => json!({
                "index": 0,
                "delta": text.map_or_else(|| json!({}), |t| json!({"content": t})),
                "logprobs": null,
                "finish_reason": finish,
            }),
        };
        self.envelope(true, json!([choice]))
    }

    /// A streamed chat chunk carrying both sides of a reasoning split; `None` when both are
    /// empty.
    fn split_chunk(&self, split: &Split) -> Option<Value> {
        let mut delta = Map::new();
        if !split.reasoning.is_empty() {
            delta.insert("reasoning_content".into(), split.reasoning.as_str().into());
        }
        if !split.content.is_empty() {
            delta.insert("content".into(), split.content.as_str().into());
        }
        if delta.is_empty() {
            return None;
        }
        Some(self.envelope(
            true,
            json!([{
                "index": 0,
                "delta": delta,
                "logprobs": null,
                "finish_reason": null,
            }]),
        ))
    }

    fn role_chunk(&self) -> Value {
        self.envelope(
            true,
            json!([{
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": null,
                "finish_reason": null,
            }]),
        )
    }

    fn usage_chunk(&self, usage: &Usage) -> Value {
        let mut body = self.envelope(true, json!([]));
        body["usage"] = usage_json(usage);
        body
    }

    fn complete(&self, text: &str, finish: &str, usage: &Usage) -> Value {
        let choice = match self.endpoint {
            Endpoint::Completions => json!({
                "index": 0,
                "text": text,
                "logprobs": null,
                "finish_reason": finish,
            }),
            Endpoint::Chat => {
                let message = if self.split_reasoning {
                    let split = ReasoningSplitter::split(text);
                    json!({
                        "role": "assistant",
                        "content": non_empty(&split.content),
                        "reasoning_content": non_empty(&split.reasoning),
                    })
                } else {
                    json!({"role": "assistant", "content": text})
                };
                json!({
                    "index": 0,
                    "message": message,
                    "logprobs": null,
                    "finish_reason": finish,
                })
            }
        };
        let mut body = self.envelope(false, json!([choice]));
        body["usage"] = usage_json(usage);
        body
    }
}

fn sse_json(value: &Value) -> Event {
    Event::default().data(value.to_string())
}

fn error_chunk(err: &ServeError) -> Value {
    json!({"error": {
        "message": err.to_string(),
        "type": err.openai_type(),
        "param": err.param(),
        "code": err.openai_code(),
    }})
}

/// Forwards engine events as SSE chunks, ending with `data: [DONE]`. A failure, including
/// a drain that gave up on the request, arrives as an error event before `[DONE]`.
async fn stream_events(
    shared: Arc<Shared>,
    reply: Reply,
    mut events: TrackedStream,
    out: mpsc::Sender<Event>,
) {
    // The role goes out with the first token, as vLLM sends it: sent on arrival, it reads as
    // the first token to a client timing the first chunk.
    let mut role_pending = reply.endpoint == Endpoint::Chat;
    let mut ended = false;
    let mut splitter = reply.split_reasoning.then(ReasoningSplitter::new);
    while let Some(event) = events.next().await {
        let chunks = match event {
            GenerationEvent::Token { text, .. } if text.is_empty() => continue,
            GenerationEvent::Token { text, .. } => match splitter.as_mut() {
                Some(splitter) => reply
                    .split_chunk(&splitter.push(&text))
                    .into_iter()
                    .collect(),
                None => vec![reply.chunk(Some(&text), None)],
            },
            GenerationEvent::Finished { reason, usage, .. } => {
                ended = true;
                // Text held back as a possible tag is released before the end.
                let mut chunks: Vec<Value> = splitter
                    .take()
                    .and_then(|splitter| reply.split_chunk(&splitter.finish()))
                    .into_iter()
                    .collect();
                chunks.push(reply.chunk(None, Some(reason.as_openai())));
                if reply.include_usage {
                    chunks.push(reply.usage_chunk(&usage));
                }
                chunks
            }
            GenerationEvent::Failed { message } => {
                ended = true;
                vec![error_chunk(&ServeError::Internal(message))]
            }
        };
        let role = std::mem::take(&mut role_pending).then(|| reply.role_chunk());
        for chunk in role.into_iter().chain(chunks) {
            if shared.send_chunk(&out, sse_json(&chunk)).await.is_err() {
                // The client went away or stopped reading; dropping the events cancels the
                // request.
                return;
            }
        }
    }
    if !ended {
        let err = ServeError::Internal("the engine ended the request without a result".into());
        let _ = out.send(sse_json(&error_chunk(&err))).await;
    }
    let _ = out.send(Event::default().data("[DONE]")).await;
}

async fn generate(
    state: HttpState,
    endpoint: Endpoint,
    reasoning: ReasoningParser,
    request: ValidatedRequest,
    priority: i32,
) -> Result<Response, ServeError> {
    let (prompt, split_reasoning) = match request.input {
        RequestInput::Prompt(prompt) => (prompt, false),
        RequestInput::Messages(messages) => {
            let text = state.shared.apply_chat_template(messages).await?;
            let split = endpoint == Endpoint::Chat && reasoning.applies(&text);
            (Prompt::Text(text), split)
        }
    };
    let prefix = match endpoint {
        Endpoint::Completions => "cmpl",
        Endpoint::Chat => "chatcmpl",
    };
    let reply = Reply {
        endpoint,
        id: state.shared.next_request_id(prefix),
        created: unix_seconds(),
        model: state.shared.model_name.clone(),
        include_usage: request.include_usage,
        split_reasoning,
    };
    let events = state
        .shared
        .submit(GenerateRequest {
            id: reply.id.clone(),
            prompt,
            params: request.params,
            priority,
        })
        .await?;
    if request.stream {
        let (out, chunks) = mpsc::channel(STREAM_BUFFER_CHUNKS);
        tokio::spawn(stream_events(state.shared.clone(), reply, events, out).in_current_span());
        let body = ReceiverStream::new(chunks).map(Ok::<_, Infallible>);
        return Ok(Sse::new(body).into_response());
    }
    let collected = events.collect_all().await?;
    let finish = collected
        .reason
        .map_or("stop", crate::api::FinishReason::as_openai);
    Ok(Json(reply.complete(&collected.text, finish, &collected.usage)).into_response())
}

async fn serve(
    state: HttpState,
    endpoint: Endpoint,
    reasoning: ReasoningParser,
    headers: &HeaderMap,
    body: Result<BodyBytes, BodyError>,
) -> Response {
    let BodyBytes(body) = match body {
        Ok(body) => body,
        Err(err) => return err.into_response(),
    };
    let priority = match http_priority(headers) {
        Ok(priority) => priority,
        Err(err) => return OpenAiError(err).into_response(),
    };
    let validate = match endpoint {
        Endpoint::Completions => validate_completion_body,
        Endpoint::Chat => validate_chat_body,
    };
    let result = match validate(&body, &state.shared.model_name) {
        Ok(request) => {
            let renamed = request.renamed.clone();
            generate(state, endpoint, reasoning, request, priority)
                .await
                .map_err(|err| in_request_terms(&renamed, err))
        }
        Err(err) => Err(err),
    };
    result.unwrap_or_else(|err| OpenAiError(err).into_response())
}

pub async fn completions(
    State(state): State<HttpState>,
    headers: HeaderMap,
    body: Result<BodyBytes, BodyError>,
) -> Response {
    serve(
        state,
        Endpoint::Completions,
        ReasoningParser::None,
        &headers,
        body,
    )
    .await
}

pub async fn chat_completions(
    State(state): State<HttpState>,
    headers: HeaderMap,
    body: Result<BodyBytes, BodyError>,
) -> Response {
    let reasoning = state.reasoning_parser;
    serve(state, Endpoint::Chat, reasoning, &headers, body).await
}

pub async fn models(State(state): State<HttpState>) -> Json<Value> {
    let info = state.shared.engine.model_info();
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.shared.model_name,
            "object": "model",
            "created": unix_seconds(),
            "owned_by": "npufleet",
            "root": state.shared.model_name,
            "max_model_len": info.context_length,
        }],
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_chunks_have_the_openai_shape() {
        let reply = Reply {
            endpoint: Endpoint::Chat,
            id: "chatcmpl-1".into(),
            created: 1,
            model: "m".into(),
            include_usage: true,
            split_reasoning: false,
        };
        let chunk = reply.chunk(Some("hi"), None);
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["choices"][0]["delta"]["content"], "hi");
        assert!(chunk["usage"].is_null() && chunk.get("usage").is_some());
        let usage = reply.usage_chunk(&Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
            cached_prompt_tokens: 0,
        });
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["total_tokens"], 5);
        let done = reply.chunk(None, Some("length"));
        assert_eq!(done["choices"][0]["delta"], json!({}));
        assert_eq!(done["choices"][0]["finish_reason"], "length");
    }

    #[test]
    fn reasoning_goes_to_its_own_field() {
        let reply = Reply {
            endpoint: Endpoint::Chat,
            id: "chatcmpl-1".into(),
            created: 1,
            model: "m".into(),
            include_usage: false,
            split_reasoning: true,
        };
        let usage = Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
            cached_prompt_tokens: 0,
        };
        let body = reply.complete("2+2 is 4.\n</think>\n\n4", "stop", &usage);
        let message = &body["choices"][0]["message"];
        assert_eq!(message["reasoning_content"], "2+2 is 4.\n");
        assert_eq!(message["content"], "\n\n4");
        let body = reply.complete("no end yet", "length", &usage);
        let message = &body["choices"][0]["message"];
        assert_eq!(message["reasoning_content"], "no end yet");
        assert!(message["content"].is_null());
        let chunk = reply
            .split_chunk(&Split {
                reasoning: "a".into(),
                content: "b".into(),
            })
            .unwrap();
        assert_eq!(
            chunk["choices"][0]["delta"],
            json!({"reasoning_content": "a", "content": "b"})
        );
        assert!(reply.split_chunk(&Split::default()).is_none());
    }
}

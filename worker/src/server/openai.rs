//! The OpenAI-compatible HTTP API: `/v1/completions`, `/v1/chat/completions` (both with
//! server-sent-event streaming) and `/v1/models`. Chat answers that reason in a
//! `<think>` block return it as `reasoning_content` (see [`super::reasoning`]).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::api::{ChatMessage, GenerateRequest, GenerationEvent, Prompt, SamplingParams, Usage};
use crate::server::error::ServeError;
use crate::server::http::{BodyBytes, BodyError, HttpState, OpenAiError, parse_json};
use crate::server::reasoning::{ReasoningParser, ReasoningSplitter, Split};
use crate::server::shared::{Shared, TrackedStream};

/// Chunks of one streamed response buffered ahead of its connection.
const STREAM_BUFFER_CHUNKS: usize = 64;

/// Sampling fields shared by both endpoints.
#[derive(Debug, Default, Deserialize)]
struct SamplingFields {
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    /// vLLM's extension; -1 (or 0) disables it.
    top_k: Option<i64>,
    seed: Option<i64>,
    stop: Option<Value>,
    stop_token_ids: Option<Vec<u32>>,
    n: Option<u32>,
    best_of: Option<u32>,
    logprobs: Option<Value>,
    top_logprobs: Option<u32>,
    echo: Option<bool>,
    suffix: Option<String>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    logit_bias: Option<Map<String, Value>>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    functions: Option<Value>,
    function_call: Option<Value>,
    response_format: Option<Value>,
    /// vLLM's extensions for log probabilities of the prompt and for guided decoding.
    prompt_logprobs: Option<Value>,
    guided_json: Option<Value>,
    guided_regex: Option<Value>,
    guided_choice: Option<Value>,
    guided_grammar: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    model: Option<String>,
    prompt: Value,
    #[serde(flatten)]
    sampling: SamplingFields,
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    model: Option<String>,
    messages: Vec<ChatMessageIn>,
    #[serde(flatten)]
    sampling: SamplingFields,
}

#[derive(Debug, Deserialize)]
struct ChatMessageIn {
    role: String,
    #[serde(default)]
    content: Value,
}

fn unsupported(param: &str, what: &str) -> ServeError {
    ServeError::bad_param(param, format!("'{param}': {what}"))
}

impl SamplingFields {
    /// Turns the request fields into engine settings; `default_max_tokens` applies when the
    /// request names no limit.
    fn to_params(&self, default_max_tokens: Option<u32>) -> Result<SamplingParams, ServeError> {
        if self.n.is_some_and(|n| n != 1) {
            return Err(unsupported(
                "n",
                "only one choice per request is supported (n = 1)",
            ));
        }
        if self.best_of.is_some_and(|n| n != 1) {
            return Err(unsupported("best_of", "only best_of = 1 is supported"));
        }
        if self
            .logprobs
            .as_ref()
            .is_some_and(|v| !v.is_null() && *v != Value::Bool(false))
        {
            return Err(unsupported(
                "logprobs",
                "log probabilities are not supported",
            ));
        }
        if self.top_logprobs.is_some_and(|n| n > 0) {
            return Err(unsupported(
                "top_logprobs",
                "log probabilities are not supported",
            ));
        }
        self.refuse_unimplemented_features()?;
        if self.echo == Some(true) {
            return Err(unsupported("echo", "echoing the prompt is not supported"));
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(unsupported("suffix", "suffixes are not supported"));
        }
        for (param, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if value.is_some_and(|v| v != 0.0) {
                return Err(unsupported(param, "penalties are not supported; use 0"));
            }
        }
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return Err(unsupported("logit_bias", "logit biases are not supported"));
        }
        let top_k = match self.top_k {
            None | Some(-1) => 0,
            Some(k) => u32::try_from(k).map_err(|_| {
                unsupported("top_k", "must be -1 (disabled) or a non-negative integer")
            })?,
        };
        Ok(SamplingParams {
            max_tokens: self
                .max_completion_tokens
                .or(self.max_tokens)
                .or(default_max_tokens),
            temperature: self.temperature.unwrap_or(1.0),
            top_p: self.top_p.unwrap_or(1.0),
            top_k,
            // Negative seeds are valid in the OpenAI API; any fixed value fixes the stream.
            seed: self.seed.map(|s| s as u64),
            stop: parse_stop(self.stop.as_ref())?,
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
        })
    }

    /// Features whose silent omission would change what the client gets (a tool call, JSON
    /// that follows a schema) are refused rather than ignored.
    fn refuse_unimplemented_features(&self) -> Result<(), ServeError> {
        let given = |value: &Option<Value>| value.as_ref().is_some_and(|v| !v.is_null());
        let empty_list = |value: &Option<Value>| {
            value
                .as_ref()
                .is_none_or(|v| v.is_null() || v.as_array().is_some_and(Vec::is_empty))
        };
        let no_choice = |value: &Option<Value>| {
            value
                .as_ref()
                .is_none_or(|v| v.is_null() || v == "none" || v == "auto")
        };
        if !empty_list(&self.tools) {
            return Err(unsupported("tools", "tool calling is not supported"));
        }
        if !no_choice(&self.tool_choice) {
            return Err(unsupported(
                "tool_choice",
                "tool calling is not supported; only \"none\" or \"auto\" without tools",
            ));
        }
        if !empty_list(&self.functions) {
            return Err(unsupported(
                "functions",
                "function calling is not supported",
            ));
        }
        if !no_choice(&self.function_call) {
            return Err(unsupported(
                "function_call",
                "function calling is not supported; only \"none\" or \"auto\" without functions",
            ));
        }
        if let Some(format) = self.response_format.as_ref().filter(|v| !v.is_null()) {
            let kind = format.get("type").and_then(Value::as_str);
            if kind != Some("text") {
                return Err(unsupported(
                    "response_format",
                    format!(
                        "only {{\"type\": \"text\"}} is supported, not {}; structured output \
                         (JSON mode, JSON schema) is not implemented",
                        kind.map_or_else(|| format.to_string(), |k| format!("\"{k}\""))
                    )
                    .as_str(),
                ));
            }
        }
        for (param, value) in [
            ("prompt_logprobs", &self.prompt_logprobs),
            ("guided_json", &self.guided_json),
            ("guided_regex", &self.guided_regex),
            ("guided_choice", &self.guided_choice),
            ("guided_grammar", &self.guided_grammar),
        ] {
            if given(value) {
                return Err(unsupported(param, "this vLLM extension is not supported"));
            }
        }
        Ok(())
    }

    fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|options| options.include_usage)
    }
}

fn parse_stop(stop: Option<&Value>) -> Result<Vec<String>, ServeError> {
    let invalid = || unsupported("stop", "must be a string or a list of strings");
    match stop {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| item.as_str().map(str::to_string).ok_or_else(invalid))
            .collect(),
        Some(_) => Err(invalid()),
    }
}

/// A prompt is a string, a list of token ids, or a one-element list of either.
fn parse_prompt(prompt: &Value) -> Result<Prompt, ServeError> {
    let invalid = || {
        ServeError::bad_param(
            "prompt",
            "'prompt' must be a string, a list of token ids, or a one-element list of either",
        )
    };
    let token_ids = |items: &[Value]| -> Result<Vec<u32>, ServeError> {
        items
            .iter()
            .map(|item| {
                item.as_u64()
                    .and_then(|v| u32::try_from(v).ok())
                    .ok_or_else(invalid)
            })
            .collect()
    };
    match prompt {
        Value::String(text) => Ok(Prompt::Text(text.clone())),
        Value::Array(items) => match items.as_slice() {
            [Value::String(text)] => Ok(Prompt::Text(text.clone())),
            [Value::Array(ids)] => Ok(Prompt::Tokens(token_ids(ids)?)),
            [] => Err(ServeError::bad_param("prompt", "'prompt' is empty")),
            [first, ..] if first.is_number() => Ok(Prompt::Tokens(token_ids(items)?)),
            _ => Err(ServeError::bad_param(
                "prompt",
                "batched prompts are not supported; send one prompt per request",
            )),
        },
        _ => Err(invalid()),
    }
}

/// Text of a message's `content`: a string, null, or a list of text parts.
fn message_text(index: usize, content: &Value) -> Result<String, ServeError> {
    let param = format!("messages[{index}].content");
    match content {
        Value::String(text) => Ok(text.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let texts = parts
                .iter()
                .map(|part| match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text"), Some(Value::String(text))) => Ok(text.as_str()),
                    _ => Err(ServeError::bad_param(
                        &param,
                        format!("'{param}': only parts of type \"text\" with a string \"text\" are supported"),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(texts.join("\n"))
        }
        _ => Err(ServeError::bad_param(
            &param,
            format!("'{param}' must be a string or a list of text parts"),
        )),
    }
}

/// A request for another model than the one served is refused by name.
fn check_model(served: &str, model: Option<&str>) -> Result<(), ServeError> {
    match model {
        Some(name) if name != served => Err(ServeError::ModelNotFound {
            requested: name.to_string(),
            served: served.to_string(),
        }),
        _ => Ok(()),
    }
}

/// What a chat or completion body asks of the engine.
#[derive(Debug, Clone, PartialEq)]
pub enum RequestInput {
    Prompt(Prompt),
    /// Rendered with the model's chat template before it reaches the engine.
    Messages(Vec<ChatMessage>),
}

/// An OpenAI request body, checked and turned into engine settings. The engine still checks
/// what depends on the model (vocabulary, context length) when the request is submitted.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedRequest {
    pub input: RequestInput,
    pub params: SamplingParams,
    pub stream: bool,
    pub include_usage: bool,
}

/// A `/v1/completions` body, for a worker serving `served_model`: bytes in, a validated
/// request or the error to answer with. Touches no state, so the fuzz target runs it as is.
pub fn validate_completion_body(
    body: &[u8],
    served_model: &str,
) -> Result<ValidatedRequest, ServeError> {
    let request: CompletionRequest = parse_json(body)?;
    check_model(served_model, request.model.as_deref())?;
    let prompt = parse_prompt(&request.prompt)?;
    validated(RequestInput::Prompt(prompt), &request.sampling, Some(16))
}

/// A `/v1/chat/completions` body; see [`validate_completion_body`].
pub fn validate_chat_body(body: &[u8], served_model: &str) -> Result<ValidatedRequest, ServeError> {
    let request: ChatRequest = parse_json(body)?;
    check_model(served_model, request.model.as_deref())?;
    if request.messages.is_empty() {
        return Err(ServeError::bad_param(
            "messages",
            "'messages' must not be empty",
        ));
    }
    let messages = request
        .messages
        .iter()
        .enumerate()
        .map(|(index, message)| {
            Ok(ChatMessage {
                role: message.role.clone(),
                content: message_text(index, &message.content)?,
            })
        })
        .collect::<Result<Vec<_>, ServeError>>()?;
    validated(RequestInput::Messages(messages), &request.sampling, None)
}

fn validated(
    input: RequestInput,
    sampling: &SamplingFields,
    default_max_tokens: Option<u32>,
) -> Result<ValidatedRequest, ServeError> {
    Ok(ValidatedRequest {
        input,
        params: sampling.to_params(default_max_tokens)?,
        stream: sampling.stream,
        include_usage: sampling.include_usage(),
    })
}

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
        "param": null,
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
    if reply.endpoint == Endpoint::Chat
        && shared
            .send_chunk(&out, sse_json(&reply.role_chunk()))
            .await
            .is_err()
    {
        return;
    }
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
        for chunk in chunks {
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
        })
        .await?;
    if request.stream {
        let (out, chunks) = mpsc::channel(STREAM_BUFFER_CHUNKS);
        tokio::spawn(stream_events(state.shared.clone(), reply, events, out));
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
    body: Result<BodyBytes, BodyError>,
) -> Response {
    let BodyBytes(body) = match body {
        Ok(body) => body,
        Err(err) => return err.into_response(),
    };
    let validate = match endpoint {
        Endpoint::Completions => validate_completion_body,
        Endpoint::Chat => validate_chat_body,
    };
    let result = match validate(&body, &state.shared.model_name) {
        Ok(request) => generate(state, endpoint, reasoning, request).await,
        Err(err) => Err(err),
    };
    result.unwrap_or_else(|err| OpenAiError(err).into_response())
}

pub async fn completions(
    State(state): State<HttpState>,
    body: Result<BodyBytes, BodyError>,
) -> Response {
    serve(state, Endpoint::Completions, ReasoningParser::None, body).await
}

pub async fn chat_completions(
    State(state): State<HttpState>,
    body: Result<BodyBytes, BodyError>,
) -> Response {
    let reasoning = state.reasoning_parser;
    serve(state, Endpoint::Chat, reasoning, body).await
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

    fn fields(value: Value) -> SamplingFields {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn openai_defaults_and_overrides() {
        let params = fields(json!({})).to_params(Some(16)).unwrap();
        assert_eq!(params.max_tokens, Some(16));
        assert_eq!(params.temperature, 1.0);
        let params = fields(json!({
            "max_tokens": 3, "max_completion_tokens": 5, "temperature": 0, "top_k": -1,
            "seed": -2, "stop": ["a", "b"], "n": 1, "logprobs": null,
        }))
        .to_params(None)
        .unwrap();
        assert_eq!(params.max_tokens, Some(5));
        assert_eq!(params.temperature, 0.0);
        assert_eq!(params.top_k, 0);
        assert_eq!(params.seed, Some(-2i64 as u64));
        assert_eq!(params.stop, vec!["a".to_string(), "b".to_string()]);
    }

    #[test]
    fn harmless_forms_of_unimplemented_features_are_accepted() {
        for body in [
            json!({"response_format": {"type": "text"}}),
            json!({"tools": [], "tool_choice": "none"}),
            json!({"tool_choice": "auto", "function_call": null, "guided_json": null}),
            json!({"logprobs": false, "top_logprobs": 0}),
        ] {
            assert!(fields(body.clone()).to_params(None).is_ok(), "{body}");
        }
    }

    #[test]
    fn unsupported_options_are_refused_by_name() {
        for (body, param) in [
            (json!({"n": 2}), "n"),
            (json!({"logprobs": 3}), "logprobs"),
            (json!({"top_logprobs": 2}), "top_logprobs"),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f"}}]}),
                "tools",
            ),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (json!({"functions": [{"name": "f"}]}), "functions"),
            (
                json!({"response_format": {"type": "json_object"}}),
                "response_format",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {}}}),
                "response_format",
            ),
            (json!({"guided_json": {"type": "object"}}), "guided_json"),
            (json!({"prompt_logprobs": 1}), "prompt_logprobs"),
            (json!({"echo": true}), "echo"),
            (json!({"presence_penalty": 0.5}), "presence_penalty"),
            (json!({"stop": 5}), "stop"),
            (json!({"top_k": -5}), "top_k"),
        ] {
            let err = fields(body).to_params(None).unwrap_err();
            assert_eq!(err.param(), Some(param));
        }
    }

    #[test]
    fn prompts_in_every_accepted_form() {
        assert_eq!(
            parse_prompt(&json!("hi")).unwrap(),
            Prompt::Text("hi".into())
        );
        assert_eq!(
            parse_prompt(&json!(["hi"])).unwrap(),
            Prompt::Text("hi".into())
        );
        assert_eq!(
            parse_prompt(&json!([1, 2])).unwrap(),
            Prompt::Tokens(vec![1, 2])
        );
        assert_eq!(
            parse_prompt(&json!([[1, 2]])).unwrap(),
            Prompt::Tokens(vec![1, 2])
        );
        for bad in [
            json!(["a", "b"]),
            json!([]),
            json!([1, -1]),
            json!(5),
            json!({"a": 1}),
        ] {
            assert_eq!(
                parse_prompt(&bad).unwrap_err().param(),
                Some("prompt"),
                "{bad}"
            );
        }
    }

    #[test]
    fn chat_content_parts_are_joined() {
        let content = json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]);
        assert_eq!(message_text(0, &content).unwrap(), "a\nb");
        let image = json!([{"type": "image_url", "image_url": {"url": "x"}}]);
        assert_eq!(
            message_text(2, &image).unwrap_err().param(),
            Some("messages[2].content")
        );
    }

    #[test]
    fn bodies_validate_into_engine_requests() {
        let request = validate_completion_body(
            br#"{"model": "m", "prompt": [[1, 2]], "stream": true, "stream_options": {"include_usage": true}}"#,
            "m",
        )
        .unwrap();
        assert_eq!(
            request.input,
            RequestInput::Prompt(Prompt::Tokens(vec![1, 2]))
        );
        assert_eq!(request.params.max_tokens, Some(16));
        assert!(request.stream && request.include_usage);
        let request = validate_chat_body(
            br#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}"#,
            "m",
        )
        .unwrap();
        assert_eq!(
            request.input,
            RequestInput::Messages(vec![ChatMessage {
                role: "user".into(),
                content: "hi".into()
            }])
        );
        assert_eq!(request.params.max_tokens, Some(3));
        assert!(!request.stream);
    }

    #[test]
    fn bad_bodies_are_the_clients_mistake() {
        for (body, code) in [
            (&br#"{"prompt": "#[..], "invalid_request"),
            (br#"{"model": "other", "prompt": "x"}"#, "model_not_found"),
            (br#"{"prompt": "x", "n": 2}"#, "invalid_request"),
            (br#"{"messages": []}"#, "invalid_request"),
        ] {
            let completion = validate_completion_body(body, "m").unwrap_err();
            let chat = validate_chat_body(body, "m").unwrap_err();
            assert!(completion.http_status().is_client_error());
            assert!(chat.http_status().is_client_error());
            assert!([completion.openai_code(), chat.openai_code()].contains(&code));
        }
    }

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

//! OpenAI request bodies, read field by field. Every field of the OpenAI and vLLM request
//! bodies that this server accepts is read here, and is either honoured or refused by name
//! when it asks for something the server does not do; a field read nowhere is refused as
//! unknown. No field is accepted and dropped, except those that cannot change the answer
//! (`user`, `safety_identifier`, `prompt_cache_key`, `parallel_tool_calls` without tools).
//! Every error names its field in `param` and in plain words in the message.

use serde_json::{Map, Value};

use crate::api::{ChatMessage, Prompt, SamplingParams};
use crate::server::error::ServeError;
use crate::server::http::parse_json;

/// What a chat or completion body asks of the engine.
#[derive(Debug, Clone, PartialEq)]
pub enum RequestInput {
    Prompt(Prompt),
    /// Rendered with the model's chat template before it reaches the engine.
    Messages(Vec<ChatMessage>),
}

/// An OpenAI request body, checked and turned into engine settings. The engine still checks
/// what depends on the model (vocabulary, context length) and the sampling settings' ranges
/// when the request is submitted.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedRequest {
    pub input: RequestInput,
    pub params: SamplingParams,
    pub stream: bool,
    pub include_usage: bool,
    /// The request's names of fields the engine names otherwise, as (engine's, request's).
    pub renamed: Vec<(&'static str, &'static str)>,
}

/// An error of the engine, with its field as the request named it (`renamed` as in
/// [`ValidatedRequest::renamed`]), in `param` and where the message opens with the field.
pub fn in_request_terms(renamed: &[(&'static str, &'static str)], err: ServeError) -> ServeError {
    let ServeError::BadRequest {
        message,
        param: Some(param),
    } = err
    else {
        return err;
    };
    match renamed.iter().find(|(engine, _)| *engine == param) {
        Some((engine, request)) => ServeError::BadRequest {
            message: match message.strip_prefix(engine) {
                Some(rest) => format!("{request}{rest}"),
                None => message,
            },
            param: Some(request.to_string()),
        },
        None => ServeError::BadRequest {
            message,
            param: Some(param),
        },
    }
}

/// A `/v1/completions` body, for a worker serving `served_model`: bytes in, a validated
/// request or the error to answer with. Touches no state, so the fuzz target runs it as is.
pub fn validate_completion_body(
    body: &[u8],
    served_model: &str,
) -> Result<ValidatedRequest, ServeError> {
    let mut fields = Fields::body(body)?;
    check_model(&mut fields, served_model)?;
    let prompt = match fields.take("prompt") {
        Some(prompt) => parse_prompt(&prompt)?,
        None => return Err(missing("prompt")),
    };
    fields.only(
        "suffix",
        |v| *v == "",
        "suffixes (text after the completion) are not supported",
    )?;
    fields.only("logprobs", |_| false, "log probabilities are not supported")?;
    let request = read_common(&mut fields, RequestInput::Prompt(prompt), Some(16))?;
    fields.finish()?;
    Ok(request)
}

/// A `/v1/chat/completions` body; see [`validate_completion_body`].
pub fn validate_chat_body(body: &[u8], served_model: &str) -> Result<ValidatedRequest, ServeError> {
    let mut fields = Fields::body(body)?;
    check_model(&mut fields, served_model)?;
    let messages = match fields.take("messages") {
        Some(Value::Array(messages)) if messages.is_empty() => {
            return Err(ServeError::bad_param(
                "messages",
                "messages must not be empty",
            ));
        }
        Some(Value::Array(messages)) => messages
            .into_iter()
            .enumerate()
            .map(|(index, message)| chat_message(index, message))
            .collect::<Result<Vec<_>, _>>()?,
        Some(other) => return Err(wrong_type("messages", "a list of messages", &other)),
        None => return Err(missing("messages")),
    };
    let max_completion_tokens = fields.integer(
        "max_completion_tokens",
        i64::from(SamplingParams::MIN_MAX_TOKENS),
        i64::from(u32::MAX),
    )?;
    fields.only("logprobs", is_false, "log probabilities are not supported")?;
    fields.only(
        "top_logprobs",
        |v| v.as_f64() == Some(0.0),
        "log probabilities are not supported",
    )?;
    fields.only("tools", is_empty_list, "tool calling is not supported")?;
    fields.only(
        "tool_choice",
        |v| *v == "none" || *v == "auto",
        "tool calling is not supported; only \"none\" or \"auto\" without tools",
    )?;
    // Says how several tool calls may be made; without tools there are none to make.
    fields.boolean("parallel_tool_calls")?;
    fields.only(
        "functions",
        is_empty_list,
        "function calling is not supported",
    )?;
    fields.only(
        "function_call",
        |v| *v == "none" || *v == "auto",
        "function calling is not supported; only \"none\" or \"auto\" without functions",
    )?;
    fields.only(
        "modalities",
        |v| v.as_array().is_some_and(|m| m.iter().all(|m| *m == "text")),
        "only [\"text\"] is supported: this model produces no audio",
    )?;
    fields.only(
        "audio",
        |_| false,
        "audio output is not supported: this model produces text only",
    )?;
    fields.only("store", is_false, "stored completions are not supported")?;
    fields.only(
        "metadata",
        is_empty_object,
        "metadata is kept with stored completions, and this server stores none",
    )?;
    fields.only(
        "service_tier",
        |v| *v == "auto" || *v == "default",
        "this server has one service tier; only \"auto\" or \"default\"",
    )?;
    fields.only(
        "add_generation_prompt",
        is_true,
        "the chat template is always applied with the generation prompt",
    )?;
    fields.only(
        "continue_final_message",
        is_false,
        "continuing the final message is not supported",
    )?;
    fields.string("safety_identifier")?;
    fields.string("prompt_cache_key")?;
    let mut request = read_common(&mut fields, RequestInput::Messages(messages), None)?;
    if let Some(max) = max_completion_tokens {
        request.params.max_tokens = Some(max as u32);
        request
            .renamed
            .push(("max_tokens", "max_completion_tokens"));
    }
    request.renamed.push(("prompt", "messages"));
    fields.finish()?;
    Ok(request)
}

/// The fields both endpoints share: sampling, streaming and the harmless client tags.
fn read_common(
    fields: &mut Fields,
    input: RequestInput,
    default_max_tokens: Option<u32>,
) -> Result<ValidatedRequest, ServeError> {
    let params = read_sampling(fields, default_max_tokens)?;
    refuse_unsupported_options(fields)?;
    fields.string("user")?;
    let stream = fields.boolean("stream")?.unwrap_or(false);
    let include_usage = read_stream_options(fields, stream)?;
    Ok(ValidatedRequest {
        input,
        params,
        stream,
        include_usage,
        renamed: Vec::new(),
    })
}

fn read_sampling(
    fields: &mut Fields,
    default_max_tokens: Option<u32>,
) -> Result<SamplingParams, ServeError> {
    let count = |fields: &mut Fields, field: &str| {
        fields
            .integer(field, 0, i64::from(u32::MAX))
            .map(|v| v.map(|v| v as u32))
    };
    let max_tokens = fields
        .integer(
            "max_tokens",
            i64::from(SamplingParams::MIN_MAX_TOKENS),
            i64::from(u32::MAX),
        )?
        .map(|v| v as u32);
    let defaults = SamplingParams::default();
    Ok(SamplingParams {
        max_tokens: max_tokens.or(default_max_tokens),
        // OpenAI's default temperature, where the engine's own default is greedy.
        temperature: fields.float("temperature")?.unwrap_or(1.0),
        top_p: fields.float("top_p")?.unwrap_or(defaults.top_p),
        // vLLM's extension: -1 (or 0) disables it.
        top_k: fields
            .integer("top_k", -1, i64::from(u32::MAX))?
            .map_or(defaults.top_k, |k| k.max(0) as u32),
        min_p: fields.float("min_p")?.unwrap_or(defaults.min_p),
        repetition_penalty: fields
            .float("repetition_penalty")?
            .unwrap_or(defaults.repetition_penalty),
        presence_penalty: fields
            .float("presence_penalty")?
            .unwrap_or(defaults.presence_penalty),
        frequency_penalty: fields
            .float("frequency_penalty")?
            .unwrap_or(defaults.frequency_penalty),
        // Negative seeds are valid in the OpenAI API; any fixed value fixes the stream.
        seed: fields
            .integer("seed", i64::MIN, i64::MAX)?
            .map(|s| s as u64),
        stop: stop_strings(fields.take("stop"))?,
        stop_token_ids: token_ids(fields.take("stop_token_ids"), "stop_token_ids")?,
        min_tokens: count(fields, "min_tokens")?.unwrap_or(defaults.min_tokens),
        ignore_eos: fields.boolean("ignore_eos")?.unwrap_or(defaults.ignore_eos),
    })
}

/// Whether a field's value is the one this server supports.
type Accepts = fn(&Value) -> bool;

/// Options this server accepts only at the value that means its one behaviour, each with
/// why another value is refused.
const FIXED_OPTIONS: &[(&str, Accepts, &str)] = &[
    (
        "n",
        is_one,
        "only one choice per request is supported (n = 1)",
    ),
    ("best_of", is_one, "only best_of = 1 is supported"),
    ("echo", is_false, "echoing the prompt is not supported"),
    ("use_beam_search", is_false, "beam search is not supported"),
    (
        "length_penalty",
        is_one,
        "the length penalty applies to beam search, which is not supported; only 1",
    ),
    (
        "logit_bias",
        is_empty_object,
        "logit biases are not supported",
    ),
    (
        "skip_special_tokens",
        is_true,
        "special tokens are always left out of the text",
    ),
    (
        "spaces_between_special_tokens",
        is_true,
        "only true is supported",
    ),
    (
        "include_stop_str_in_output",
        is_false,
        "the stop string is never part of the output",
    ),
    (
        "priority",
        |v| v.as_f64() == Some(0.0),
        "requests are ordered by the flow-control priority header (higher first), not by \
         this field; only 0",
    ),
    (
        "response_format",
        |v| v.get("type").is_some_and(|t| *t == "text"),
        "only {\"type\": \"text\"} is supported; structured output (JSON mode, JSON \
         schema) is not implemented",
    ),
];

fn refuse_unsupported_options(fields: &mut Fields) -> Result<(), ServeError> {
    for (field, allowed, why) in FIXED_OPTIONS {
        fields.only(field, allowed, why)?;
    }
    Ok(())
}

/// Whether usage is sent at the end of the stream; `stream_options` needs `stream`.
fn read_stream_options(fields: &mut Fields, stream: bool) -> Result<bool, ServeError> {
    match fields.take("stream_options") {
        None => Ok(false),
        Some(_) if !stream => Err(ServeError::bad_param(
            "stream_options",
            "stream_options is only allowed when stream is true",
        )),
        Some(options) => {
            let mut options = Fields::object(options, "stream_options")?;
            let include_usage = options.boolean("include_usage")?.unwrap_or(false);
            options.only(
                "continuous_usage_stats",
                is_false,
                "usage is reported once, at the end of the stream",
            )?;
            options.finish()?;
            Ok(include_usage)
        }
    }
}

/// A request for another model than the one served is refused by name; a request naming
/// none is served, as vLLM serves it (the router in front of a fleet requires the name).
fn check_model(fields: &mut Fields, served: &str) -> Result<(), ServeError> {
    match fields.string("model")? {
        Some(name) if name != served => Err(ServeError::ModelNotFound {
            requested: name,
            served: served.to_string(),
        }),
        _ => Ok(()),
    }
}

fn missing(field: &str) -> ServeError {
    ServeError::bad_param(field, format!("{field} is required"))
}

fn wrong_type(field: &str, expected: &str, got: &Value) -> ServeError {
    ServeError::bad_param(
        field,
        format!("{field} must be {expected}, got {}", shown(got)),
    )
}

/// A value as JSON, cut short when long.
fn shown(value: &Value) -> String {
    const LONGEST: usize = 40;
    let text = value.to_string();
    match text.char_indices().nth(LONGEST) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}

fn is_one(value: &Value) -> bool {
    value.as_f64() == Some(1.0)
}

fn is_true(value: &Value) -> bool {
    value == true
}

fn is_false(value: &Value) -> bool {
    value == false
}

fn is_empty_object(value: &Value) -> bool {
    value.as_object().is_some_and(Map::is_empty)
}

fn is_empty_list(value: &Value) -> bool {
    value.as_array().is_some_and(Vec::is_empty)
}

/// A JSON object's fields, taken one at a time by name (a null counts as absent); whatever
/// no read took is refused as unknown.
struct Fields {
    fields: Map<String, Value>,
    /// Where the object sits in the body (`messages[2]`), empty for the body itself.
    path: String,
}

impl Fields {
    fn body(body: &[u8]) -> Result<Self, ServeError> {
        match parse_json::<Value>(body)? {
            Value::Object(fields) => Ok(Fields {
                fields,
                path: String::new(),
            }),
            other => Err(ServeError::bad_request(format!(
                "the request body must be a JSON object, got {}",
                shown(&other)
            ))),
        }
    }

    fn object(value: Value, path: &str) -> Result<Self, ServeError> {
        match value {
            Value::Object(fields) => Ok(Fields {
                fields,
                path: path.to_string(),
            }),
            other => Err(wrong_type(path, "an object", &other)),
        }
    }

    /// The field's name as an error reports it.
    fn name(&self, field: &str) -> String {
        if self.path.is_empty() {
            field.to_string()
        } else {
            format!("{}.{field}", self.path)
        }
    }

    fn take(&mut self, field: &str) -> Option<Value> {
        self.fields.remove(field).filter(|v| !v.is_null())
    }

    /// An integer in `min..=max`; a number with no fraction (`5.0`) counts as one, as
    /// vLLM's request models take it.
    fn integer(&mut self, field: &str, min: i64, max: i64) -> Result<Option<i64>, ServeError> {
        let Some(value) = self.take(field) else {
            return Ok(None);
        };
        let name = self.name(field);
        let Value::Number(number) = &value else {
            return Err(wrong_type(&name, "an integer", &value));
        };
        // Compared as f64 only when the number has no exact integer form.
        let (whole, below, above) = match (number.as_i64(), number.as_u64(), number.as_f64()) {
            (Some(v), _, _) => (v, v < min, v > max),
            (None, Some(_), _) => (i64::MAX, false, true),
            (None, None, Some(v)) if v.fract() == 0.0 => (v as i64, v < min as f64, v > max as f64),
            _ => return Err(wrong_type(&name, "an integer", &value)),
        };
        if below {
            Err(ServeError::bad_param(
                &name,
                format!("{name} must be at least {min}, got {}", shown(&value)),
            ))
        } else if above {
            Err(ServeError::bad_param(
                &name,
                format!("{name} must be at most {max}, got {}", shown(&value)),
            ))
        } else {
            Ok(Some(whole))
        }
    }

    /// A number the engine holds as an `f32`; its range is the engine's to check.
    fn float(&mut self, field: &str) -> Result<Option<f32>, ServeError> {
        let Some(value) = self.take(field) else {
            return Ok(None);
        };
        let name = self.name(field);
        let number = value
            .as_f64()
            .ok_or_else(|| wrong_type(&name, "a number", &value))?;
        let narrowed = number as f32;
        if narrowed.is_infinite() {
            return Err(ServeError::bad_param(
                &name,
                format!(
                    "{name} must be between -{max:e} and {max:e}, got {}",
                    shown(&value),
                    max = f32::MAX
                ),
            ));
        }
        Ok(Some(narrowed))
    }

    fn boolean(&mut self, field: &str) -> Result<Option<bool>, ServeError> {
        match self.take(field) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(other) => Err(wrong_type(&self.name(field), "true or false", &other)),
        }
    }

    fn string(&mut self, field: &str) -> Result<Option<String>, ServeError> {
        match self.take(field) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(wrong_type(&self.name(field), "a string", &other)),
        }
    }

    /// A field accepted only in a form that asks for nothing the server lacks (`allowed`);
    /// any other value is refused, saying `why`.
    fn only(
        &mut self,
        field: &str,
        allowed: impl Fn(&Value) -> bool,
        why: &str,
    ) -> Result<(), ServeError> {
        match self.take(field) {
            Some(value) if !allowed(&value) => {
                let name = self.name(field);
                Err(ServeError::bad_param(
                    &name,
                    format!("{name} = {} is refused: {why}", shown(&value)),
                ))
            }
            _ => Ok(()),
        }
    }

    /// Refuses the first field no read took.
    fn finish(self) -> Result<(), ServeError> {
        match self.fields.keys().next() {
            Some(field) => {
                let name = self.name(field);
                Err(ServeError::bad_param(
                    &name,
                    format!("unknown field {name}: this server does not support it"),
                ))
            }
            None => Ok(()),
        }
    }
}

fn stop_strings(stop: Option<Value>) -> Result<Vec<String>, ServeError> {
    let expected = "a string or a list of strings";
    match stop {
        None => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s]),
        Some(Value::Array(items)) => items
            .into_iter()
            .enumerate()
            .map(|(index, item)| match item {
                Value::String(s) => Ok(s),
                other => Err(wrong_type(&format!("stop[{index}]"), "a string", &other)),
            })
            .collect(),
        Some(other) => Err(wrong_type("stop", expected, &other)),
    }
}

/// A list of token ids, each named by its position when it is not one.
fn token_ids(ids: Option<Value>, field: &str) -> Result<Vec<u32>, ServeError> {
    match ids {
        None => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(index, item)| {
                item.as_u64()
                    .and_then(|v| u32::try_from(v).ok())
                    .ok_or_else(|| wrong_type(&format!("{field}[{index}]"), "a token id", item))
            })
            .collect(),
        Some(other) => Err(wrong_type(field, "a list of token ids", &other)),
    }
}

/// A prompt is a string, a list of token ids, or a one-element list of either.
fn parse_prompt(prompt: &Value) -> Result<Prompt, ServeError> {
    let invalid = || {
        wrong_type(
            "prompt",
            "a string, a list of token ids, or a one-element list of either",
            prompt,
        )
    };
    match prompt {
        Value::String(text) => Ok(Prompt::Text(text.clone())),
        Value::Array(items) => match items.as_slice() {
            [Value::String(text)] => Ok(Prompt::Text(text.clone())),
            [ids @ Value::Array(_)] => {
                Ok(Prompt::Tokens(token_ids(Some(ids.clone()), "prompt[0]")?))
            }
            [] => Err(ServeError::bad_param("prompt", "prompt is empty")),
            [first, ..] if first.is_number() => {
                Ok(Prompt::Tokens(token_ids(Some(prompt.clone()), "prompt")?))
            }
            [Value::String(_), ..] | [Value::Array(_), ..] => Err(ServeError::bad_param(
                "prompt",
                "batched prompts are not supported; send one prompt per request",
            )),
            _ => Err(invalid()),
        },
        _ => Err(invalid()),
    }
}

/// The roles a chat template knows; `developer` is OpenAI's newer name for `system`.
const ROLES: &[&str] = &["system", "developer", "user", "assistant"];

fn chat_message(index: usize, message: Value) -> Result<ChatMessage, ServeError> {
    let path = format!("messages[{index}]");
    let mut fields = Fields::object(message, &path)?;
    let role = match fields.string("role")? {
        Some(role) if role == "developer" => "system".to_string(),
        Some(role) if ROLES.contains(&role.as_str()) => role,
        Some(role) => {
            let name = fields.name("role");
            return Err(ServeError::bad_param(
                &name,
                format!(
                    "{name} must be one of {}, got \"{role}\" (tool and function messages \
                     are refused: tool calling is not supported)",
                    ROLES.join(", ")
                ),
            ));
        }
        None => return Err(missing(&fields.name("role"))),
    };
    let content = message_text(&fields.name("content"), fields.take("content"))?;
    // An assistant turn as this server returned it: its reasoning is not shown to the model
    // again, as DeepSeek-R1's own template leaves earlier reasoning out.
    if role == "assistant" {
        fields.string("reasoning_content")?;
    }
    fields.only("name", |_| false, "participant names are not supported")?;
    fields.only("tool_calls", is_empty_list, "tool calling is not supported")?;
    fields.only(
        "function_call",
        |_| false,
        "function calling is not supported",
    )?;
    fields.only("refusal", |_| false, "refusals are not supported as input")?;
    fields.only("audio", |_| false, "audio is not supported")?;
    fields.only(
        "annotations",
        is_empty_list,
        "annotations are not supported",
    )?;
    fields.finish()?;
    Ok(ChatMessage { role, content })
}

/// Text of a message's `content`: a string, absent, or a list of text parts.
fn message_text(param: &str, content: Option<Value>) -> Result<String, ServeError> {
    match content {
        None => Ok(String::new()),
        Some(Value::String(text)) => Ok(text),
        Some(Value::Array(parts)) => {
            let texts = parts
                .iter()
                .map(|part| match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text"), Some(Value::String(text))) => Ok(text.as_str()),
                    _ => Err(ServeError::bad_param(
                        param,
                        format!("{param}: only parts of type \"text\" with a string \"text\" are supported"),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(texts.join("\n"))
        }
        Some(other) => Err(wrong_type(
            param,
            "a string or a list of text parts",
            &other,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(body: Value) -> Result<ValidatedRequest, ServeError> {
        validate_chat_body(body.to_string().as_bytes(), "m")
    }

    fn completion(body: Value) -> Result<ValidatedRequest, ServeError> {
        validate_completion_body(body.to_string().as_bytes(), "m")
    }

    fn with(body: Value, extra: Value) -> Value {
        let mut body = body;
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    }

    fn hello() -> Value {
        json!({"messages": [{"role": "user", "content": "Say hello."}]})
    }

    /// The param and message of a refused body.
    fn refused(result: Result<ValidatedRequest, ServeError>) -> (String, String) {
        match result {
            Err(err @ ServeError::BadRequest { .. }) => {
                (err.param().unwrap_or("").to_string(), err.to_string())
            }
            other => panic!("expected a 400, got {other:?}"),
        }
    }

    #[test]
    fn openai_defaults_and_overrides() {
        let params = completion(json!({"prompt": "x"})).unwrap().params;
        assert_eq!(params.max_tokens, Some(16));
        assert_eq!(params.temperature, 1.0);
        let request = chat(with(
            hello(),
            json!({
                "max_tokens": 3, "max_completion_tokens": 5, "temperature": 0, "top_k": -1,
                "seed": -2, "stop": ["a", "b", "c", "d", "e", "f"], "n": 1, "logprobs": null,
            }),
        ))
        .unwrap();
        let params = request.params;
        assert_eq!(params.max_tokens, Some(5));
        assert_eq!(params.temperature, 0.0);
        assert_eq!(params.top_k, 0);
        assert_eq!(params.seed, Some(-2i64 as u64));
        assert_eq!(
            params.stop.len(),
            6,
            "more than OpenAI's four, as vLLM allows"
        );
    }

    #[test]
    fn vllm_sampling_fields_reach_the_engine() {
        let params = chat(with(
            hello(),
            json!({
                "min_tokens": 60, "ignore_eos": true, "repetition_penalty": 1.3,
                "presence_penalty": 0.5, "frequency_penalty": -0.5, "min_p": 0.1,
                "top_k": 20, "top_p": 0.9, "stop_token_ids": [7, 8], "max_tokens": 5.0,
            }),
        ))
        .unwrap()
        .params;
        assert_eq!(
            params,
            SamplingParams {
                max_tokens: Some(5),
                temperature: 1.0,
                top_p: 0.9,
                top_k: 20,
                min_p: 0.1,
                repetition_penalty: 1.3,
                presence_penalty: 0.5,
                frequency_penalty: -0.5,
                seed: None,
                stop: Vec::new(),
                stop_token_ids: vec![7, 8],
                min_tokens: 60,
                ignore_eos: true,
            }
        );
        assert_eq!(
            completion(json!({"prompt": "x", "top_k": 0}))
                .unwrap()
                .params
                .top_k,
            0
        );
    }

    #[test]
    fn harmless_forms_of_unimplemented_features_are_accepted() {
        for extra in [
            json!({"response_format": {"type": "text"}}),
            json!({"tools": [], "tool_choice": "none", "parallel_tool_calls": false}),
            json!({"tool_choice": "auto", "function_call": null, "functions": []}),
            json!({"logprobs": false, "top_logprobs": 0}),
            json!({"modalities": ["text"], "audio": null, "store": false, "metadata": {}}),
            json!({"n": 1, "best_of": 1, "use_beam_search": false, "length_penalty": 1.0}),
            json!({"user": "u1", "safety_identifier": "s", "prompt_cache_key": "k"}),
            json!({"service_tier": "auto", "priority": 0, "skip_special_tokens": true}),
            json!({"stream": true, "stream_options": {"include_usage": true}}),
            json!({"stream": false, "stream_options": null}),
        ] {
            assert!(chat(with(hello(), extra.clone())).is_ok(), "{extra}");
        }
        let history = json!({"messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello", "reasoning_content": "greet",
             "refusal": null, "tool_calls": [], "annotations": [], "audio": null},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]});
        let RequestInput::Messages(messages) = chat(history).unwrap().input else {
            panic!("a chat request holds messages");
        };
        assert_eq!(messages[0].role, "system");
        assert_eq!(messages[3].content, "a\nb");
    }

    #[test]
    fn unsupported_fields_are_refused_by_name() {
        for (extra, param) in [
            (json!({"n": 2}), "n"),
            (json!({"logprobs": true}), "logprobs"),
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
            (json!({"guided_json": {"type": "object"}}), "guided_json"),
            (json!({"prompt_logprobs": 1}), "prompt_logprobs"),
            (json!({"echo": true}), "echo"),
            (json!({"logit_bias": {"1": 5}}), "logit_bias"),
            (json!({"modalities": ["text", "audio"]}), "modalities"),
            (
                json!({"audio": {"voice": "alloy", "format": "wav"}}),
                "audio",
            ),
            (json!({"store": true}), "store"),
            (json!({"use_beam_search": true}), "use_beam_search"),
            (
                json!({"include_stop_str_in_output": true}),
                "include_stop_str_in_output",
            ),
            (json!({"reasoning_effort": "high"}), "reasoning_effort"),
            (
                json!({"stream_options": {"include_usage": true}}),
                "stream_options",
            ),
            (
                json!({"stream": true, "stream_options": {"continuous_usage_stats": true}}),
                "stream_options.continuous_usage_stats",
            ),
            (json!({"stop": 5}), "stop"),
            (json!({"stop": ["a", 5]}), "stop[1]"),
            (json!({"top_k": -5}), "top_k"),
            (json!({"suffix": "x"}), "suffix"),
            (json!({"max_token": 5}), "max_token"),
        ] {
            let (named, message) = refused(chat(with(hello(), extra.clone())));
            assert_eq!(named, param, "{extra}: {message}");
            assert!(message.contains(param), "{extra}: {message}");
        }
        for (message, param) in [
            (
                json!({"role": "wizard", "content": "x"}),
                "messages[0].role",
            ),
            (
                json!({"role": "tool", "content": "x", "tool_call_id": "1"}),
                "messages[0].role",
            ),
            (json!({"content": "x"}), "messages[0].role"),
            (
                json!({"role": "user", "content": "x", "name": "bob"}),
                "messages[0].name",
            ),
            (json!({"role": "user", "content": 5}), "messages[0].content"),
            (
                json!({"role": "user", "content": "x", "extra": 1}),
                "messages[0].extra",
            ),
            (json!("hi"), "messages[0]"),
        ] {
            let (named, text) = refused(chat(json!({"messages": [message]})));
            assert_eq!(named, param, "{text}");
        }
        assert_eq!(refused(chat(json!({"messages": []}))).0, "messages");
        assert_eq!(refused(chat(json!({}))).0, "messages");
        assert_eq!(
            refused(completion(json!({"prompt": "x", "logprobs": 1}))).0,
            "logprobs"
        );
        assert_eq!(
            refused(completion(
                json!({"prompt": "x", "max_completion_tokens": 1})
            ))
            .0,
            "max_completion_tokens",
            "a chat field is unknown to completions"
        );
    }

    #[test]
    fn type_and_range_errors_name_the_field_in_plain_words() {
        for (extra, param, says) in [
            (
                json!({"max_tokens": -1}),
                "max_tokens",
                "max_tokens must be at least 1, got -1",
            ),
            (
                json!({"max_tokens": 0}),
                "max_tokens",
                "max_tokens must be at least 1, got 0",
            ),
            (
                json!({"max_tokens": 5_000_000_000u64}),
                "max_tokens",
                "max_tokens must be at most 4294967295, got 5000000000",
            ),
            (
                json!({"max_tokens": 1.5}),
                "max_tokens",
                "max_tokens must be an integer, got 1.5",
            ),
            (
                json!({"max_tokens": "8"}),
                "max_tokens",
                "max_tokens must be an integer, got \"8\"",
            ),
            (
                json!({"max_completion_tokens": -1}),
                "max_completion_tokens",
                "max_completion_tokens must be at least 1, got -1",
            ),
            (
                json!({"temperature": "NaN"}),
                "temperature",
                "temperature must be a number, got \"NaN\"",
            ),
            (
                json!({"temperature": 1e39}),
                "temperature",
                "temperature must be between",
            ),
            (
                json!({"seed": 1e30}),
                "seed",
                "seed must be at most 9223372036854775807, got 1e+30",
            ),
            (json!({"seed": "7"}), "seed", "seed must be an integer"),
            (
                json!({"min_tokens": -3}),
                "min_tokens",
                "min_tokens must be at least 0, got -3",
            ),
            (
                json!({"ignore_eos": "yes"}),
                "ignore_eos",
                "ignore_eos must be true or false",
            ),
            (
                json!({"stop_token_ids": [1, -2]}),
                "stop_token_ids[1]",
                "must be a token id, got -2",
            ),
            (
                json!({"model": 5}),
                "model",
                "model must be a string, got 5",
            ),
            (
                json!({"stream": 1}),
                "stream",
                "stream must be true or false, got 1",
            ),
        ] {
            let (named, message) = refused(chat(with(hello(), extra.clone())));
            assert_eq!(named, param, "{extra}: {message}");
            assert!(message.contains(says), "{extra}: {message}");
        }
    }

    #[test]
    fn engine_errors_take_the_requests_field_names() {
        let request = chat(with(hello(), json!({"max_completion_tokens": 9}))).unwrap();
        let named = |request: &ValidatedRequest, param: &str| {
            let message = format!("{param} is too large");
            let err = in_request_terms(&request.renamed, ServeError::bad_param(param, message));
            assert!(err.to_string().starts_with(err.param().unwrap()), "{err}");
            err.param().map(str::to_string)
        };
        assert_eq!(
            named(&request, "max_tokens").as_deref(),
            Some("max_completion_tokens")
        );
        assert_eq!(named(&request, "prompt").as_deref(), Some("messages"));
        assert_eq!(named(&request, "top_p").as_deref(), Some("top_p"));
        let request = completion(json!({"prompt": "x"})).unwrap();
        assert_eq!(named(&request, "prompt").as_deref(), Some("prompt"));
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
        for (bad, param) in [
            (json!(["a", "b"]), "prompt"),
            (json!([]), "prompt"),
            (json!([1, -1]), "prompt[1]"),
            (json!([[1, "x"]]), "prompt[0][1]"),
            (json!(5), "prompt"),
            (json!({"a": 1}), "prompt"),
        ] {
            assert_eq!(
                parse_prompt(&bad).unwrap_err().param(),
                Some(param),
                "{bad}"
            );
        }
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
        let request =
            chat(json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}))
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
            (br#"[1, 2]"#, "invalid_request"),
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
}

//! One routed request: what the router reads from a request of any protocol (OpenAI HTTP,
//! KServe v2 REST, an Open Inference Protocol `ModelInfer` call or one request of a
//! `ModelStreamInfer` stream) to pick a replica for it and to name it in its logs. The body
//! itself is passed on to the replica untouched.

use http::HeaderMap;
use npufleet_contract::auth::AUTHORIZATION;
use npufleet_contract::headers::{FLOW_PRIORITY, REQUEST_ID, TRACEPARENT};
use npufleet_contract::proto::inference::ModelInferRequest;
use npufleet_contract::proto::inference::infer_parameter::ParameterChoice;
use npufleet_contract::trace::TraceParent;
use serde_json::Value;
use tonic::metadata::MetadataMap;

use crate::error::RouteError;
use crate::prompt::{Affinity, Prompt};

/// The worker's text input (see the worker's Open Inference Protocol mapping).
const TEXT_INPUT: &str = "text_input";

/// The request field (OpenAI) or parameter (Open Inference Protocol) that names a priority.
const PRIORITY: &str = "priority";

#[derive(Clone, Debug, PartialEq)]
pub struct RoutedRequest {
    pub model: String,
    /// Where the prompt would like to go ([`crate::prompt::Affinity`]).
    pub affinity: Affinity,
    /// The client's priority, when it gave an integer one. The replica judges it: a value the
    /// router cannot read is left for the replica to refuse with its own error.
    pub priority: Option<i64>,
    /// The client's name for the request (`x-request-id`, the v2 or OIP request `id`), else
    /// the trace id, so that every request's log lines share a name.
    pub id: String,
    /// The client's trace, or one the router started; passed on to the replica.
    pub trace: TraceParent,
    /// Who sent it, as flow control tells keys apart.
    pub caller: Caller,
    /// What flow control charges it: its prompt (a token for each four bytes) and the
    /// output tokens it asks for.
    pub tokens: u32,
    /// Its prompt alone, counted the same way: how long its prefill will be.
    pub prompt_tokens: u32,
}

/// The caller of a request as flow control sees it: the SHA-256 of the API key it presents
/// (never the key) and the priority it asks for in `x-npufleet-priority`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Caller {
    pub key_sha256: Option<[u8; 32]>,
    pub priority: Option<i32>,
    /// What it presented, for work the router does on its behalf (a prefix copy), which a
    /// worker with an API key checks like any request.
    pub credentials: Option<Credentials>,
}

/// An `authorization` value as the client sent it; never shown.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Credentials(pub Vec<u8>);

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Credentials(..)")
    }
}

impl Caller {
    pub fn from_headers(headers: &HeaderMap) -> Result<Self, RouteError> {
        let value = |name: &str| headers.get(name).map(|v| v.as_bytes());
        Self::from_values(value(AUTHORIZATION), value(FLOW_PRIORITY))
    }

    pub fn from_metadata(metadata: &MetadataMap) -> Result<Self, RouteError> {
        let value = |name: &str| metadata.get(name).map(|v| v.as_bytes());
        Self::from_values(value(AUTHORIZATION), value(FLOW_PRIORITY))
    }

    fn from_values(
        authorization: Option<&[u8]>,
        priority: Option<&[u8]>,
    ) -> Result<Self, RouteError> {
        Ok(Caller {
            key_sha256: authorization.and_then(crate::flow::key_sha256),
            priority: flow_priority(priority)?,
            credentials: authorization.map(|value| Credentials(value.to_vec())),
        })
    }
}

/// The priority a request asks for, refused by name when it is not an integer.
fn flow_priority(value: Option<&[u8]>) -> Result<Option<i32>, RouteError> {
    value
        .map(npufleet_contract::headers::parse_priority)
        .transpose()
        .map_err(RouteError::BadRequest)
}

/// Each constructor takes the affinity of a model's prompt as `affinity`:
/// [`crate::route::Router::affinity`], or a stand-in in tests.
impl RoutedRequest {
    /// The span the request is followed in, from the router's log lines to the replica's (by
    /// trace id); the retry policy records the replica that took it.
    pub fn span(&self) -> tracing::Span {
        let span = tracing::info_span!(
            "request",
            model = %self.model,
            request_id = %self.id,
            trace_id = %self.trace.trace_id_hex(),
            priority = self.priority,
            replica = tracing::field::Empty,
        );
        npufleet_contract::logging::follow(&span, &self.trace);
        span
    }

    #[allow(clippy::too_many_arguments)]
    fn new(
        model: String,
        prompt: Option<Prompt>,
        priority: Option<i64>,
        id: Option<&str>,
        trace: Option<TraceParent>,
        caller: Caller,
        output_tokens: u64,
        affinity: impl Fn(&str, &Prompt) -> Affinity,
    ) -> Self {
        let trace = trace.unwrap_or_else(|| TraceParent::start(rand::random(), rand::random()));
        let prompt_tokens = prompt.as_ref().map_or(0, |p| p.flat.len().div_ceil(4)) as u64;
        RoutedRequest {
            tokens: u32::try_from(prompt_tokens.saturating_add(output_tokens)).unwrap_or(u32::MAX),
            prompt_tokens: u32::try_from(prompt_tokens).unwrap_or(u32::MAX),
            caller,
            affinity: prompt.map_or(Affinity::None, |prompt| affinity(&model, &prompt)),
            model,
            priority,
            id: id
                .filter(|id| !id.is_empty())
                .map_or_else(|| trace.trace_id_hex(), str::to_owned),
            trace,
        }
    }

    /// An OpenAI `/v1/completions` or `/v1/chat/completions` request.
    pub fn openai(
        body: &[u8],
        headers: &HeaderMap,
        affinity: impl Fn(&str, &Prompt) -> Affinity,
    ) -> Result<Self, RouteError> {
        let json = parse_json(body)?;
        let model = match json.get("model") {
            Some(Value::String(model)) => model.clone(),
            Some(_) => {
                return Err(RouteError::BadRequest(
                    "the field `model` must be a string".to_owned(),
                ));
            }
            None => {
                return Err(RouteError::BadRequest(
                    "the request names no model (field `model`)".to_owned(),
                ));
            }
        };
        let output_tokens = ["max_completion_tokens", "max_tokens"]
            .iter()
            .find_map(|field| json.get(*field)?.as_u64())
            .unwrap_or(0);
        Ok(Self::new(
            model,
            openai_prompt(&json),
            json.get(PRIORITY).and_then(Value::as_i64),
            header(headers, REQUEST_ID),
            http_trace(headers),
            Caller::from_headers(headers)?,
            output_tokens,
            affinity,
        ))
    }

    /// A KServe v2 REST request for `model` (named by its path); an empty body (a metadata or
    /// readiness call) has no prompt.
    pub fn v2_rest(
        model: &str,
        body: &[u8],
        headers: &HeaderMap,
        affinity: impl Fn(&str, &Prompt) -> Affinity,
    ) -> Result<Self, RouteError> {
        let json = if body.is_empty() {
            Value::Null
        } else {
            parse_json(body)?
        };
        let prompt = v2_rest_prompt(&json).map(|text| Prompt::text(&text));
        let id = json
            .get("id")
            .and_then(Value::as_str)
            .or_else(|| header(headers, REQUEST_ID));
        Ok(Self::new(
            model.to_owned(),
            prompt,
            None,
            id,
            http_trace(headers),
            Caller::from_headers(headers)?,
            0,
            affinity,
        ))
    }

    /// An Open Inference Protocol infer request, unary or one of a stream's; `trace` is the
    /// call's (a stream's requests share the client's, or each starts its own).
    pub fn oip(
        message: &ModelInferRequest,
        trace: Option<TraceParent>,
        caller: Caller,
        affinity: impl Fn(&str, &Prompt) -> Affinity,
    ) -> Self {
        let priority = message
            .parameters
            .get(PRIORITY)
            .and_then(|p| match p.parameter_choice {
                Some(ParameterChoice::Int64Param(priority)) => Some(priority),
                Some(ParameterChoice::Uint64Param(priority)) => i64::try_from(priority).ok(),
                _ => None,
            });
        Self::new(
            message.model_name.clone(),
            text_input(message).map(|bytes| match std::str::from_utf8(bytes) {
                Ok(text) => Prompt::text(text),
                Err(_) => Prompt {
                    flat: bytes.to_vec(),
                    exact: None,
                },
            }),
            priority,
            Some(&message.id),
            trace,
            caller,
            oip_max_tokens(message),
            affinity,
        )
    }

    /// A call that names only a model (Open Inference Protocol model metadata).
    pub fn named(model: &str, trace: Option<TraceParent>) -> Self {
        Self::new(
            model.to_owned(),
            None,
            None,
            None,
            trace,
            Caller::default(),
            0,
            |_: &str, _: &Prompt| Affinity::None,
        )
    }
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name)?.to_str().ok()
}

/// The client's trace of an HTTP request; an invalid `traceparent` counts as none, as the
/// specification asks.
pub fn http_trace(headers: &HeaderMap) -> Option<TraceParent> {
    TraceParent::parse(header(headers, TRACEPARENT)?)
}

/// The client's trace of a gRPC call.
pub fn grpc_trace(metadata: &MetadataMap) -> Option<TraceParent> {
    TraceParent::parse(metadata.get(TRACEPARENT)?.to_str().ok()?)
}

fn parse_json(body: &[u8]) -> Result<Value, RouteError> {
    serde_json::from_slice(body)
        .map_err(|e| RouteError::BadRequest(format!("the request body is not valid JSON: {e}")))
}

/// The prompt of an OpenAI `/v1/completions` or `/v1/chat/completions` body: the chat's
/// messages, or the completion prompt (the first of a list). Token-id prompts have no text
/// and give `None`.
fn openai_prompt(body: &Value) -> Option<Prompt> {
    if let Some(messages) = body.get("messages").and_then(Value::as_array) {
        return Some(Prompt::chat(messages));
    }
    match body.get("prompt")? {
        Value::String(prompt) => Some(Prompt::text(prompt)),
        Value::Array(prompts) => prompts.first()?.as_str().map(Prompt::text),
        _ => None,
    }
}

/// The prompt of a KServe v2 REST infer body: the first input whose first element is a string
/// (the worker's `BYTES` text input).
fn v2_rest_prompt(body: &Value) -> Option<String> {
    body.get("inputs")?
        .as_array()?
        .iter()
        .find_map(|input| input.get("data")?.as_array()?.first()?.as_str())
        .map(str::to_owned)
}

/// The output tokens an Open Inference Protocol request asks for (its `max_tokens` parameter).
fn oip_max_tokens(message: &ModelInferRequest) -> u64 {
    match message
        .parameters
        .get("max_tokens")
        .and_then(|p| p.parameter_choice.as_ref())
    {
        Some(ParameterChoice::Int64Param(n)) => u64::try_from(*n).unwrap_or(0),
        Some(ParameterChoice::Uint64Param(n)) => *n,
        _ => 0,
    }
}

/// The prompt of an Open Inference Protocol infer request: its `text_input` tensor's first
/// element, given in `contents` or, length-prefixed, in `raw_input_contents`.
fn text_input(request: &ModelInferRequest) -> Option<&[u8]> {
    let (index, input) = request
        .inputs
        .iter()
        .enumerate()
        .find(|(_, input)| input.name == TEXT_INPUT)?;
    if let Some(first) = input
        .contents
        .as_ref()
        .and_then(|c| c.bytes_contents.first())
    {
        return Some(first);
    }
    let raw = request.raw_input_contents.get(index)?;
    let length = u32::from_le_bytes(raw.get(..4)?.try_into().ok()?) as usize;
    raw.get(4..4 + length)
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;
    use npufleet_contract::proto::inference::model_infer_request::InferInputTensor;
    use npufleet_contract::proto::inference::{InferParameter, InferTensorContents};
    use serde_json::json;

    use super::*;

    const CLIENT_TRACE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    /// A stand-in key: the prompt's length, so a test can see which text was keyed.
    fn length_key(_model: &str, prompt: &Prompt) -> Affinity {
        Affinity::Key(prompt.flat.len() as u64)
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.insert(*name, HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    #[test]
    fn an_openai_request_gives_model_prompt_key_priority_and_the_clients_ids() {
        let body = json!({"model": "m", "prompt": "Once upon", "priority": 3}).to_string();
        let request = RoutedRequest::openai(
            body.as_bytes(),
            &headers(&[(REQUEST_ID, "req-7"), (TRACEPARENT, CLIENT_TRACE)]),
            length_key,
        )
        .unwrap();
        assert_eq!(request.model, "m");
        assert_eq!(request.affinity, Affinity::Key(9));
        assert_eq!(request.priority, Some(3));
        assert_eq!(request.id, "req-7");
        assert_eq!(request.trace.to_string(), CLIENT_TRACE);
    }

    #[test]
    fn without_the_clients_trace_or_id_the_router_starts_a_trace_and_names_the_request_by_it() {
        let body = json!({"model": "m", "prompt": [1, 2]}).to_string();
        let invalid = headers(&[(TRACEPARENT, "00-nonsense")]);
        let request = RoutedRequest::openai(body.as_bytes(), &invalid, length_key).unwrap();
        assert_eq!(
            request.affinity,
            Affinity::None,
            "token ids have no text to key"
        );
        assert_eq!(request.priority, None);
        assert_eq!(request.id, request.trace.trace_id_hex());
        let again = RoutedRequest::openai(body.as_bytes(), &invalid, length_key).unwrap();
        assert_ne!(
            request.trace, again.trace,
            "each request starts its own trace"
        );
    }

    #[test]
    fn the_caller_is_its_keys_digest_its_priority_and_its_charge() {
        let body = json!({"model": "m", "prompt": "12345678", "max_tokens": 10}).to_string();
        let request = RoutedRequest::openai(
            body.as_bytes(),
            &headers(&[("authorization", "Bearer k"), (FLOW_PRIORITY, " -2 ")]),
            length_key,
        )
        .unwrap();
        assert_eq!(
            request.caller.key_sha256,
            crate::flow::key_sha256(b"Bearer k")
        );
        assert_eq!(request.caller.priority, Some(-2));
        assert_eq!(
            request.tokens,
            2 + 10,
            "two tokens of prompt, ten asked for"
        );
        let error = RoutedRequest::openai(
            body.as_bytes(),
            &headers(&[(FLOW_PRIORITY, "high")]),
            length_key,
        )
        .unwrap_err();
        assert!(
            matches!(&error, RouteError::BadRequest(m) if m.contains(FLOW_PRIORITY) && m.contains("high")),
            "{error}"
        );
    }

    #[test]
    fn openai_requests_without_a_readable_model_are_bad_requests() {
        for (body, wanted) in [
            ("{\"model\": ", "not valid JSON"),
            ("{\"prompt\": \"hi\"}", "names no model (field `model`)"),
            ("{\"model\": 7}", "`model` must be a string"),
        ] {
            let error =
                RoutedRequest::openai(body.as_bytes(), &HeaderMap::new(), length_key).unwrap_err();
            assert!(
                matches!(&error, RouteError::BadRequest(m) if m.contains(wanted)),
                "{body}: {error}"
            );
        }
    }

    #[test]
    fn a_v2_rest_request_takes_its_model_from_the_path_and_its_id_from_the_body() {
        let body = json!({"id": "v2-1", "inputs": [
            {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Tell me"]},
        ]})
        .to_string();
        let with_body = headers(&[(REQUEST_ID, "header-id")]);
        let request = RoutedRequest::v2_rest("m", body.as_bytes(), &with_body, length_key).unwrap();
        assert_eq!(
            (
                request.model.as_str(),
                &request.affinity,
                request.id.as_str()
            ),
            ("m", &Affinity::Key(7), "v2-1")
        );
        let metadata = RoutedRequest::v2_rest("m", b"", &with_body, length_key).unwrap();
        assert_eq!(
            (metadata.affinity, metadata.id.as_str()),
            (Affinity::None, "header-id")
        );
        assert!(RoutedRequest::v2_rest("m", b"{", &with_body, length_key).is_err());
    }

    #[test]
    fn chat_messages_give_roles_and_texts_in_order() {
        let body = json!({"model": "m", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]},
        ]});
        assert_eq!(
            openai_prompt(&body).unwrap().flat,
            b"system\nBe brief.\nuser\nHello\n there\n"
        );
    }

    #[test]
    fn completion_prompts_are_read_as_strings_or_the_first_of_a_list() {
        assert_eq!(
            openai_prompt(&json!({"prompt": "Once upon"})),
            Some(Prompt::text("Once upon"))
        );
        assert_eq!(
            openai_prompt(&json!({"prompt": ["first", "second"]})),
            Some(Prompt::text("first"))
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

    fn text(name: &str) -> InferInputTensor {
        InferInputTensor {
            name: name.to_owned(),
            datatype: "BYTES".to_owned(),
            shape: vec![1],
            ..Default::default()
        }
    }

    #[test]
    fn an_oip_request_gives_model_prompt_key_priority_and_id() {
        let mut message = ModelInferRequest {
            model_name: "m".to_owned(),
            id: "oip-1".to_owned(),
            inputs: vec![text(TEXT_INPUT)],
            ..Default::default()
        };
        message.inputs[0].contents = Some(InferTensorContents {
            bytes_contents: vec![b"hello".to_vec()],
            ..Default::default()
        });
        message.parameters.insert(
            PRIORITY.to_owned(),
            InferParameter {
                parameter_choice: Some(ParameterChoice::Uint64Param(2)),
            },
        );
        let client = TraceParent::parse(CLIENT_TRACE);
        let request = RoutedRequest::oip(&message, client, Caller::default(), length_key);
        assert_eq!(request.model, "m");
        assert_eq!(request.affinity, Affinity::Key(5));
        assert_eq!(request.priority, Some(2));
        assert_eq!(request.id, "oip-1");
        assert_eq!(Some(request.trace), client);
    }

    #[test]
    fn text_input_is_read_from_contents_or_raw_bytes() {
        let mut with_contents = ModelInferRequest {
            inputs: vec![text("max_tokens"), text(TEXT_INPUT)],
            ..Default::default()
        };
        with_contents.inputs[1].contents = Some(InferTensorContents {
            bytes_contents: vec![b"hello".to_vec()],
            ..Default::default()
        });
        assert_eq!(text_input(&with_contents), Some(&b"hello"[..]));

        let mut raw = 5u32.to_le_bytes().to_vec();
        raw.extend_from_slice(b"world");
        let with_raw = ModelInferRequest {
            inputs: vec![text("max_tokens"), text(TEXT_INPUT)],
            raw_input_contents: vec![8u32.to_le_bytes().to_vec(), raw],
            ..Default::default()
        };
        assert_eq!(text_input(&with_raw), Some(&b"world"[..]));

        let truncated = ModelInferRequest {
            inputs: vec![text(TEXT_INPUT)],
            raw_input_contents: vec![vec![9, 0, 0, 0, b'x']],
            ..Default::default()
        };
        assert_eq!(text_input(&truncated), None);
    }
}

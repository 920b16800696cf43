//! Open Inference Protocol requests and responses for a text-generation model, independent of
//! transport: the gRPC service uses them directly, the REST routes convert JSON to and from
//! the same messages first.
//!
//! Inputs: BYTES `text_input` (one element) or an integer `input_ids` (INT64 or INT32, any
//! shape). Outputs: BYTES `text_output` and INT64 `output_ids`. Sampling settings are request
//! parameters.

use std::collections::HashMap;

use crate::api::{Prompt, SamplingParams};
use crate::server::error::ServeError;
use npufleet_contract::proto::inference::{
    InferParameter, InferTensorContents, ModelInferRequest, ModelInferResponse,
    infer_parameter::ParameterChoice, model_infer_request::InferInputTensor,
    model_infer_response::InferOutputTensor,
};

pub const TEXT_INPUT: &str = "text_input";
pub const INPUT_IDS: &str = "input_ids";
pub const TEXT_OUTPUT: &str = "text_output";
pub const OUTPUT_IDS: &str = "output_ids";

/// The only model version this server has.
pub const MODEL_VERSION: &str = "1";

/// Request parameters clients send routinely that carry no meaning for this model.
const IGNORED_PARAMETERS: &[&str] = &[
    "stream",
    "priority",
    "timeout",
    "sequence_id",
    "sequence_start",
    "sequence_end",
    "triton_enable_empty_final_response",
    "binary_data_output",
];

/// The request parameters that set sampling, each a field of [`SamplingParams`].
const SAMPLING_PARAMETERS: &[&str] = &[
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "ignore_eos",
];

/// A decoded inference request.
#[derive(Debug, Clone, PartialEq)]
pub struct InferRequest {
    pub id: String,
    pub prompt: Prompt,
    pub params: SamplingParams,
    pub outputs: RequestedOutputs,
    /// Answer in `raw_output_contents`, as the request used `raw_input_contents`.
    pub raw_output: bool,
}

/// Which outputs to return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestedOutputs {
    pub text: bool,
    pub ids: bool,
}

/// Checks the model name and version a request addresses.
pub fn check_model(name: &str, version: &str, served: &str) -> Result<(), ServeError> {
    if name != served {
        return Err(ServeError::ModelNotFound {
            requested: name.to_string(),
            served: served.to_string(),
        });
    }
    if !version.is_empty() && version != MODEL_VERSION {
        return Err(ServeError::ModelNotFound {
            requested: format!("{name} version {version}"),
            served: format!("{served} version {MODEL_VERSION}"),
        });
    }
    Ok(())
}

/// Decodes and validates one request. Never panics, whatever the message holds.
pub fn decode_infer_request(request: &ModelInferRequest) -> Result<InferRequest, ServeError> {
    let raw = !request.raw_input_contents.is_empty();
    if raw {
        if request.raw_input_contents.len() != request.inputs.len() {
            return Err(ServeError::bad_request(format!(
                "raw_input_contents has {} entries but the request has {} inputs; \
                 there must be one entry per input",
                request.raw_input_contents.len(),
                request.inputs.len()
            )));
        }
        if let Some(input) = request.inputs.iter().find(|i| i.contents.is_some()) {
            return Err(ServeError::bad_param(
                &input.name,
                format!(
                    "input '{}' sets contents while the request uses raw_input_contents; \
                     use one encoding for all inputs",
                    input.name
                ),
            ));
        }
    }

    let mut prompt = None;
    for (index, input) in request.inputs.iter().enumerate() {
        let raw_bytes = request.raw_input_contents.get(index).map(Vec::as_slice);
        let decoded = match input.name.as_str() {
            TEXT_INPUT => Prompt::Text(decode_text_input(input, raw_bytes)?),
            INPUT_IDS => Prompt::Tokens(decode_input_ids(input, raw_bytes)?),
            other => {
                return Err(ServeError::bad_param(
                    other,
                    format!(
                        "unknown input '{other}'; this model takes '{TEXT_INPUT}' (BYTES) \
                         or '{INPUT_IDS}' (INT64)"
                    ),
                ));
            }
        };
        if prompt.replace(decoded).is_some() {
            return Err(ServeError::bad_request(format!(
                "the request has more than one prompt input; send exactly one of \
                 '{TEXT_INPUT}' or '{INPUT_IDS}'"
            )));
        }
    }
    let prompt = prompt.ok_or_else(|| {
        ServeError::bad_request(format!(
            "missing input: send a BYTES input named '{TEXT_INPUT}' or an INT64 input named \
             '{INPUT_IDS}'"
        ))
    })?;

    let mut outputs = RequestedOutputs {
        text: request.outputs.is_empty(),
        ids: request.outputs.is_empty(),
    };
    for output in &request.outputs {
        match output.name.as_str() {
            TEXT_OUTPUT => outputs.text = true,
            OUTPUT_IDS => outputs.ids = true,
            other => {
                return Err(ServeError::bad_param(
                    other,
                    format!(
                        "unknown output '{other}'; this model returns '{TEXT_OUTPUT}' and \
                         '{OUTPUT_IDS}'"
                    ),
                ));
            }
        }
    }

    Ok(InferRequest {
        id: request.id.clone(),
        prompt,
        params: decode_parameters(&request.parameters)?,
        outputs,
        raw_output: raw,
    })
}

/// The number of elements a shape holds, rejecting negative or overflowing dimensions.
fn element_count(input: &InferInputTensor) -> Result<usize, ServeError> {
    input.shape.iter().try_fold(1usize, |count, &dim| {
        let dim = usize::try_from(dim).map_err(|_| {
            ServeError::bad_param(
                &input.name,
                format!(
                    "input '{}' has shape {:?}; dimensions must not be negative",
                    input.name, input.shape
                ),
            )
        })?;
        count.checked_mul(dim).ok_or_else(|| {
            ServeError::bad_param(
                &input.name,
                format!(
                    "input '{}' has shape {:?}, too large",
                    input.name, input.shape
                ),
            )
        })
    })
}

fn shape_mismatch(input: &InferInputTensor, expected: usize, got: usize) -> ServeError {
    ServeError::bad_param(
        &input.name,
        format!(
            "input '{}' has shape {:?} ({expected} elements) but carries {got} elements",
            input.name, input.shape
        ),
    )
}

fn decode_text_input(input: &InferInputTensor, raw: Option<&[u8]>) -> Result<String, ServeError> {
    if input.datatype != "BYTES" {
        return Err(ServeError::bad_param(
            TEXT_INPUT,
            format!(
                "input '{TEXT_INPUT}' must have datatype BYTES, got '{}'",
                input.datatype
            ),
        ));
    }
    let expected = element_count(input)?;
    let elements: Vec<&[u8]> = match raw {
        Some(raw) => split_raw_bytes(raw).map_err(|message| {
            ServeError::bad_param(TEXT_INPUT, format!("input '{TEXT_INPUT}': {message}"))
        })?,
        None => input
            .contents
            .as_ref()
            .map(|c| c.bytes_contents.iter().map(Vec::as_slice).collect())
            .unwrap_or_default(),
    };
    if elements.len() != expected {
        return Err(shape_mismatch(input, expected, elements.len()));
    }
    let [text] = elements.as_slice() else {
        return Err(ServeError::bad_param(
            TEXT_INPUT,
            format!(
                "input '{TEXT_INPUT}' must hold exactly one prompt (shape [1]), got {} elements",
                elements.len()
            ),
        ));
    };
    String::from_utf8(text.to_vec()).map_err(|err| {
        ServeError::bad_param(
            TEXT_INPUT,
            format!(
                "input '{TEXT_INPUT}' is not valid UTF-8 (invalid byte at offset {})",
                err.utf8_error().valid_up_to()
            ),
        )
    })
}

/// Splits raw BYTES contents: each element is a 4-byte little-endian length, then the bytes.
pub fn split_raw_bytes(mut raw: &[u8]) -> Result<Vec<&[u8]>, String> {
    let mut elements = Vec::new();
    while !raw.is_empty() {
        let Some((length, rest)) = raw.split_first_chunk::<4>() else {
            return Err(format!(
                "raw BYTES contents end with {} stray bytes where a 4-byte length prefix was \
                 expected",
                raw.len()
            ));
        };
        let length = u32::from_le_bytes(*length) as usize;
        if rest.len() < length {
            return Err(format!(
                "raw BYTES element {} declares {length} bytes but only {} remain",
                elements.len(),
                rest.len()
            ));
        }
        let (element, rest) = rest.split_at(length);
        elements.push(element);
        raw = rest;
    }
    Ok(elements)
}

/// Joins BYTES elements into the raw layout [`split_raw_bytes`] reads.
pub fn join_raw_bytes<'a>(elements: impl IntoIterator<Item = &'a [u8]>) -> Vec<u8> {
    let mut raw = Vec::new();
    for element in elements {
        let length = u32::try_from(element.len()).expect("a BYTES element fits in 4 GiB");
        raw.extend_from_slice(&length.to_le_bytes());
        raw.extend_from_slice(element);
    }
    raw
}

/// The little-endian integers of `N` bytes each in the raw contents of the token-id input.
fn raw_ints<const N: usize>(
    raw: &[u8],
    datatype: &str,
    decode: impl Fn([u8; N]) -> i64,
) -> Result<Vec<i64>, ServeError> {
    let chunks = raw.chunks_exact(N);
    if !chunks.remainder().is_empty() {
        return Err(ServeError::bad_param(
            INPUT_IDS,
            format!(
                "raw contents of '{INPUT_IDS}' are {} bytes, not a multiple of {N} ({datatype})",
                raw.len()
            ),
        ));
    }
    Ok(chunks
        .map(|c| decode(c.try_into().expect("chunks of N bytes")))
        .collect())
}

fn decode_input_ids(input: &InferInputTensor, raw: Option<&[u8]>) -> Result<Vec<u32>, ServeError> {
    let expected = element_count(input)?;
    let values: Vec<i64> = match (input.datatype.as_str(), raw) {
        ("INT64", Some(raw)) => raw_ints(raw, "INT64", i64::from_le_bytes)?,
        ("INT32", Some(raw)) => raw_ints(raw, "INT32", |b| i32::from_le_bytes(b).into())?,
        ("INT64", None) => input
            .contents
            .as_ref()
            .map(|c| c.int64_contents.clone())
            .unwrap_or_default(),
        ("INT32", None) => input
            .contents
            .as_ref()
            .map(|c| c.int_contents.iter().map(|&v| v.into()).collect())
            .unwrap_or_default(),
        (other, _) => {
            return Err(ServeError::bad_param(
                INPUT_IDS,
                format!("input '{INPUT_IDS}' must have datatype INT64 or INT32, got '{other}'"),
            ));
        }
    };
    if values.len() != expected {
        return Err(shape_mismatch(input, expected, values.len()));
    }
    if values.is_empty() {
        return Err(ServeError::bad_param(
            INPUT_IDS,
            format!("input '{INPUT_IDS}' is empty; send at least one token id"),
        ));
    }
    values
        .iter()
        .map(|&v| {
            u32::try_from(v).map_err(|_| {
                ServeError::bad_param(
                    INPUT_IDS,
                    format!("input '{INPUT_IDS}' holds {v}, which is not a token id"),
                )
            })
        })
        .collect()
}

fn param_f64(name: &str, param: &InferParameter) -> Result<f64, ServeError> {
    match param.parameter_choice {
        Some(ParameterChoice::DoubleParam(v)) => Ok(v),
        Some(ParameterChoice::Int64Param(v)) => Ok(v as f64),
        Some(ParameterChoice::Uint64Param(v)) => Ok(v as f64),
        _ => Err(ServeError::bad_param(
            name,
            format!("parameter '{name}' must be a number"),
        )),
    }
}

/// A number the engine holds as an `f32`; its range is the engine's to check.
fn param_f32(name: &str, param: &InferParameter) -> Result<f32, ServeError> {
    let value = param_f64(name, param)?;
    let narrowed = value as f32;
    if narrowed.is_infinite() {
        return Err(ServeError::bad_param(
            name,
            format!(
                "parameter '{name}' must be between -{max:e} and {max:e}, got {value:e}",
                max = f32::MAX
            ),
        ));
    }
    Ok(narrowed)
}

fn param_bool(name: &str, param: &InferParameter) -> Result<bool, ServeError> {
    match param.parameter_choice {
        Some(ParameterChoice::BoolParam(b)) => Ok(b),
        _ => Err(ServeError::bad_param(
            name,
            format!("parameter '{name}' must be a bool"),
        )),
    }
}

/// vLLM's `top_k`: -1 (or 0) disables it.
fn param_top_k(name: &str, param: &InferParameter) -> Result<u32, ServeError> {
    if let Some(ParameterChoice::Int64Param(-1)) = param.parameter_choice {
        return Ok(0);
    }
    param_u32(name, param).map_err(|_| {
        ServeError::bad_param(
            name,
            format!("parameter '{name}' must be -1 (disabled) or a non-negative integer"),
        )
    })
}

fn param_u64(name: &str, param: &InferParameter) -> Result<u64, ServeError> {
    let not_count = || {
        ServeError::bad_param(
            name,
            format!("parameter '{name}' must be a non-negative integer"),
        )
    };
    match param.parameter_choice {
        Some(ParameterChoice::Uint64Param(v)) => Ok(v),
        Some(ParameterChoice::Int64Param(v)) => u64::try_from(v).map_err(|_| not_count()),
        Some(ParameterChoice::DoubleParam(v))
            if v >= 0.0 && v.fract() == 0.0 && v < 2f64.powi(64) =>
        {
            Ok(v as u64)
        }
        _ => Err(not_count()),
    }
}

fn param_u32(name: &str, param: &InferParameter) -> Result<u32, ServeError> {
    u32::try_from(param_u64(name, param)?)
        .map_err(|_| ServeError::bad_param(name, format!("parameter '{name}' is too large")))
}

/// `stop` is a string; a string holding a JSON array of strings gives several stop strings.
fn param_stop(param: &InferParameter) -> Result<Vec<String>, ServeError> {
    match &param.parameter_choice {
        Some(ParameterChoice::StringParam(s)) => {
            if s.trim_start().starts_with('[')
                && let Ok(list) = serde_json::from_str::<Vec<String>>(s)
            {
                return Ok(list);
            }
            Ok(vec![s.clone()])
        }
        _ => Err(ServeError::bad_param(
            "stop",
            "parameter 'stop' must be a string (or a string holding a JSON array of strings)",
        )),
    }
}

fn decode_parameters(
    parameters: &HashMap<String, InferParameter>,
) -> Result<SamplingParams, ServeError> {
    let mut params = SamplingParams::default();
    let mut names: Vec<&String> = parameters.keys().collect();
    names.sort();
    for name in names {
        let param = &parameters[name];
        match name.as_str() {
            "max_tokens" => params.max_tokens = Some(param_u32(name, param)?),
            "min_tokens" => params.min_tokens = param_u32(name, param)?,
            "temperature" => params.temperature = param_f32(name, param)?,
            "top_p" => params.top_p = param_f32(name, param)?,
            "top_k" => params.top_k = param_top_k(name, param)?,
            "min_p" => params.min_p = param_f32(name, param)?,
            "repetition_penalty" => params.repetition_penalty = param_f32(name, param)?,
            "presence_penalty" => params.presence_penalty = param_f32(name, param)?,
            "frequency_penalty" => params.frequency_penalty = param_f32(name, param)?,
            "seed" => params.seed = Some(param_u64(name, param)?),
            "stop" => params.stop = param_stop(param)?,
            "ignore_eos" => params.ignore_eos = param_bool(name, param)?,
            ignored if IGNORED_PARAMETERS.contains(&ignored) => {}
            other => {
                return Err(ServeError::bad_param(
                    other,
                    format!(
                        "unknown parameter '{other}'; supported: {}",
                        SAMPLING_PARAMETERS.join(", ")
                    ),
                ));
            }
        }
    }
    Ok(params)
}

/// Builds a response holding the requested outputs for `text` and `ids`.
pub fn build_response(
    model_name: &str,
    request: &InferRequest,
    text: &str,
    ids: &[u32],
    parameters: HashMap<String, InferParameter>,
) -> ModelInferResponse {
    let mut response = ModelInferResponse {
        model_name: model_name.to_string(),
        model_version: MODEL_VERSION.to_string(),
        id: request.id.clone(),
        parameters,
        outputs: Vec::new(),
        raw_output_contents: Vec::new(),
    };
    if request.outputs.text {
        let contents = if request.raw_output {
            response
                .raw_output_contents
                .push(join_raw_bytes([text.as_bytes()]));
            None
        } else {
            Some(InferTensorContents {
                bytes_contents: vec![text.as_bytes().to_vec()],
                ..Default::default()
            })
        };
        response.outputs.push(InferOutputTensor {
            name: TEXT_OUTPUT.to_string(),
            datatype: "BYTES".to_string(),
            shape: vec![1],
            parameters: HashMap::new(),
            contents,
        });
    }
    if request.outputs.ids {
        let values: Vec<i64> = ids.iter().map(|&id| id.into()).collect();
        let contents = if request.raw_output {
            response
                .raw_output_contents
                .push(values.iter().flat_map(|v| v.to_le_bytes()).collect());
            None
        } else {
            Some(InferTensorContents {
                int64_contents: values.clone(),
                ..Default::default()
            })
        };
        response.outputs.push(InferOutputTensor {
            name: OUTPUT_IDS.to_string(),
            datatype: "INT64".to_string(),
            shape: vec![values.len() as i64],
            parameters: HashMap::new(),
            contents,
        });
    }
    response
}

pub fn bool_param(value: bool) -> InferParameter {
    InferParameter {
        parameter_choice: Some(ParameterChoice::BoolParam(value)),
    }
}

pub fn string_param(value: impl Into<String>) -> InferParameter {
    InferParameter {
        parameter_choice: Some(ParameterChoice::StringParam(value.into())),
    }
}

/// A request for `model_name` with `text` as its `text_input`, and `parameters` (sampling
/// settings such as `max_tokens`), as a client sends one.
pub fn text_request<'a>(
    model_name: &str,
    text: &[u8],
    parameters: impl IntoIterator<Item = (&'a str, InferParameter)>,
) -> ModelInferRequest {
    ModelInferRequest {
        model_name: model_name.to_string(),
        inputs: vec![InferInputTensor {
            name: TEXT_INPUT.to_string(),
            datatype: "BYTES".to_string(),
            shape: vec![1],
            contents: Some(InferTensorContents {
                bytes_contents: vec![text.to_vec()],
                ..Default::default()
            }),
            ..Default::default()
        }],
        parameters: parameters
            .into_iter()
            .map(|(name, value)| (name.to_string(), value))
            .collect(),
        ..Default::default()
    }
}

pub fn int_param(value: i64) -> InferParameter {
    InferParameter {
        parameter_choice: Some(ParameterChoice::Int64Param(value)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text_request(text: &[u8]) -> ModelInferRequest {
        super::text_request("m", text, [])
    }

    fn raw_text_request(text: &[u8]) -> ModelInferRequest {
        let mut request = text_request(text);
        request.inputs[0].contents = None;
        request.raw_input_contents = vec![join_raw_bytes([text])];
        request
    }

    fn double_param(value: f64) -> InferParameter {
        InferParameter {
            parameter_choice: Some(ParameterChoice::DoubleParam(value)),
        }
    }

    fn message(err: ServeError) -> String {
        err.to_string()
    }

    #[test]
    fn decodes_text_from_contents_and_raw() {
        for request in [text_request(b"hello"), raw_text_request(b"hello")] {
            let decoded = decode_infer_request(&request).unwrap();
            assert_eq!(decoded.prompt, Prompt::Text("hello".into()));
            assert_eq!(decoded.raw_output, !request.raw_input_contents.is_empty());
            assert_eq!(
                decoded.outputs,
                RequestedOutputs {
                    text: true,
                    ids: true
                }
            );
        }
    }

    #[test]
    fn decodes_sampling_parameters() {
        let mut request = text_request(b"hi");
        request.parameters = HashMap::from([
            ("max_tokens".into(), int_param(5)),
            (
                "temperature".into(),
                InferParameter {
                    parameter_choice: Some(ParameterChoice::DoubleParam(0.5)),
                },
            ),
            ("top_k".into(), int_param(40)),
            ("seed".into(), int_param(7)),
            ("stop".into(), string_param(r#"["\n", "END"]"#)),
            ("stream".into(), bool_param(true)),
            ("min_tokens".into(), int_param(3)),
            ("ignore_eos".into(), bool_param(true)),
            ("repetition_penalty".into(), double_param(1.5)),
            ("presence_penalty".into(), double_param(-0.5)),
            ("frequency_penalty".into(), int_param(1)),
            ("min_p".into(), double_param(0.25)),
        ]);
        let params = decode_infer_request(&request).unwrap().params;
        assert_eq!(params.max_tokens, Some(5));
        assert_eq!(params.temperature, 0.5);
        assert_eq!(params.top_k, 40);
        assert_eq!(params.seed, Some(7));
        assert_eq!(params.stop, vec!["\n".to_string(), "END".to_string()]);
        assert_eq!(params.min_tokens, 3);
        assert!(params.ignore_eos);
        assert_eq!(params.repetition_penalty, 1.5);
        assert_eq!(params.presence_penalty, -0.5);
        assert_eq!(params.frequency_penalty, 1.0);
        assert_eq!(params.min_p, 0.25);
        request.parameters = HashMap::from([("top_k".into(), int_param(-1))]);
        assert_eq!(decode_infer_request(&request).unwrap().params.top_k, 0);
    }

    #[test]
    fn a_plain_stop_string_is_one_stop() {
        let mut request = text_request(b"hi");
        request.parameters = HashMap::from([("stop".into(), string_param("[x"))]);
        assert_eq!(
            decode_infer_request(&request).unwrap().params.stop,
            vec!["[x"]
        );
    }

    #[test]
    fn rejects_bad_parameters() {
        for (name, param, needle) in [
            ("max_tokens", int_param(-1), "non-negative integer"),
            ("temperature", string_param("hot"), "must be a number"),
            ("stop", int_param(3), "must be a string"),
            ("max_token", int_param(3), "unknown parameter 'max_token'"),
            ("top_k", int_param(-2), "-1 (disabled)"),
            ("ignore_eos", int_param(1), "must be a bool"),
            ("temperature", double_param(1e39), "must be between"),
        ] {
            let mut request = text_request(b"hi");
            request.parameters = HashMap::from([(name.to_string(), param)]);
            let err = decode_infer_request(&request).unwrap_err();
            assert_eq!(err.param(), Some(name));
            let err = message(err);
            assert!(err.contains(needle), "{name}: {err}");
        }
    }

    #[test]
    fn decodes_token_ids_in_both_encodings() {
        let ids = [1i64, 2, 300];
        let mut request = ModelInferRequest {
            inputs: vec![InferInputTensor {
                name: INPUT_IDS.into(),
                datatype: "INT64".into(),
                shape: vec![1, 3],
                contents: Some(InferTensorContents {
                    int64_contents: ids.to_vec(),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        };
        let expected = Prompt::Tokens(vec![1, 2, 300]);
        assert_eq!(decode_infer_request(&request).unwrap().prompt, expected);
        request.inputs[0].contents = None;
        request.raw_input_contents = vec![ids.iter().flat_map(|v| v.to_le_bytes()).collect()];
        assert_eq!(decode_infer_request(&request).unwrap().prompt, expected);
    }

    #[test]
    fn rejects_negative_token_ids() {
        let request = ModelInferRequest {
            inputs: vec![InferInputTensor {
                name: INPUT_IDS.into(),
                datatype: "INT64".into(),
                shape: vec![2],
                contents: Some(InferTensorContents {
                    int64_contents: vec![5, -1],
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        };
        assert!(message(decode_infer_request(&request).unwrap_err()).contains("-1"));
    }

    #[test]
    fn rejects_malformed_inputs_with_a_named_reason() {
        let mut wrong_type = text_request(b"hi");
        wrong_type.inputs[0].datatype = "FP32".into();
        let mut wrong_shape = text_request(b"hi");
        wrong_shape.inputs[0].shape = vec![2];
        let mut negative_shape = text_request(b"hi");
        negative_shape.inputs[0].shape = vec![-1];
        let mut two_prompts = text_request(b"a");
        two_prompts.inputs[0].shape = vec![2];
        two_prompts.inputs[0]
            .contents
            .as_mut()
            .unwrap()
            .bytes_contents
            .push(b"b".to_vec());
        let mut mixed = raw_text_request(b"hi");
        mixed.inputs[0].contents = Some(InferTensorContents::default());
        let mut raw_count = raw_text_request(b"hi");
        raw_count.raw_input_contents.push(Vec::new());
        let mut truncated = raw_text_request(b"hi");
        truncated.raw_input_contents[0].pop();
        let mut unknown_input = text_request(b"hi");
        unknown_input.inputs[0].name = "prompt".into();
        let mut unknown_output = text_request(b"hi");
        unknown_output.outputs.push(Default::default());
        unknown_output.outputs[0].name = "logits".into();
        let mut duplicate = text_request(b"hi");
        duplicate.inputs.push(duplicate.inputs[0].clone());
        let cases = [
            (wrong_type, "must have datatype BYTES, got 'FP32'"),
            (wrong_shape, "(2 elements) but carries 1"),
            (negative_shape, "must not be negative"),
            (two_prompts, "exactly one prompt"),
            (
                text_request(&[b'a', 0xff, b'b']),
                "not valid UTF-8 (invalid byte at offset 1)",
            ),
            (mixed, "use one encoding"),
            (raw_count, "one entry per input"),
            (truncated, "declares 2 bytes but only 1 remain"),
            (unknown_input, "unknown input 'prompt'"),
            (unknown_output, "unknown output 'logits'"),
            (duplicate, "more than one prompt input"),
            (ModelInferRequest::default(), "missing input"),
        ];
        for (request, needle) in cases {
            let err = decode_infer_request(&request).unwrap_err();
            assert!(matches!(err, ServeError::BadRequest { .. }));
            assert!(message(err.clone()).contains(needle), "{needle}: {err}");
        }
    }

    #[test]
    fn random_and_corrupted_messages_never_panic() {
        use prost::Message;
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let valid = raw_text_request(b"hello").encode_to_vec();
        for round in 0..20_000 {
            let bytes: Vec<u8> = if round % 2 == 0 {
                let len = rng.random_range(0..64);
                (0..len).map(|_| rng.random()).collect()
            } else {
                let mut bytes = valid.clone();
                for _ in 0..rng.random_range(1..4) {
                    let at = rng.random_range(0..bytes.len());
                    bytes[at] = rng.random();
                }
                bytes
            };
            if let Ok(request) = ModelInferRequest::decode(bytes.as_slice()) {
                let _ = decode_infer_request(&request);
            }
        }
    }

    #[test]
    fn raw_bytes_round_trip() {
        let elements: [&[u8]; 3] = [b"", b"abc", &[0, 1, 2, 255]];
        let raw = join_raw_bytes(elements);
        assert_eq!(split_raw_bytes(&raw).unwrap(), elements.to_vec());
        assert!(split_raw_bytes(&raw[..raw.len() - 1]).is_err());
        assert!(
            split_raw_bytes(&[1, 0])
                .unwrap_err()
                .contains("2 stray bytes")
        );
    }

    #[test]
    fn model_name_and_version_are_checked() {
        assert!(check_model("m", "", "m").is_ok());
        assert!(check_model("m", "1", "m").is_ok());
        assert!(matches!(
            check_model("other", "", "m"),
            Err(ServeError::ModelNotFound { .. })
        ));
        assert!(matches!(
            check_model("m", "2", "m"),
            Err(ServeError::ModelNotFound { .. })
        ));
    }

    #[test]
    fn responses_follow_the_request_encoding() {
        let request = decode_infer_request(&raw_text_request(b"hi")).unwrap();
        let response = build_response("m", &request, "out", &[4, 5], HashMap::new());
        assert_eq!(response.raw_output_contents.len(), 2);
        assert_eq!(
            split_raw_bytes(&response.raw_output_contents[0]).unwrap(),
            [b"out"]
        );
        assert_eq!(response.outputs[1].shape, vec![2]);
        let request = decode_infer_request(&text_request(b"hi")).unwrap();
        let response = build_response("m", &request, "out", &[4], HashMap::new());
        assert!(response.raw_output_contents.is_empty());
        let contents = response.outputs[0].contents.as_ref().unwrap();
        assert_eq!(contents.bytes_contents, vec![b"out".to_vec()]);
    }
}

//! The Open Inference Protocol's REST form. Requests are converted to the gRPC messages and
//! served by the same code; errors use the protocol's `{"error": "<message>"}` shape.

use std::collections::HashMap;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::server::error::ServeError;
use crate::server::http::{BodyError, HttpState, JsonBody, with_retry_after};
use crate::server::inference::{self, SERVER_NAME};
use crate::server::oip;
use crate::server::shared::http_priority;
use npufleet_contract::proto::inference::infer_parameter::ParameterChoice;
use npufleet_contract::proto::inference::model_infer_request::{
    InferInputTensor, InferRequestedOutputTensor,
};
use npufleet_contract::proto::inference::{
    InferParameter, InferTensorContents, ModelInferRequest, ModelInferResponse,
};

/// An error in the protocol's REST shape.
pub struct RestError(ServeError);

impl From<ServeError> for RestError {
    fn from(err: ServeError) -> Self {
        RestError(err)
    }
}

impl IntoResponse for RestError {
    fn into_response(self) -> Response {
        let response = (
            self.0.http_status(),
            Json(json!({"error": self.0.to_string()})),
        )
            .into_response();
        with_retry_after(&self.0, response)
    }
}

fn body_error(err: BodyError) -> Response {
    let status = match err {
        BodyError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
        BodyError::Invalid(_) => StatusCode::BAD_REQUEST,
    };
    (status, Json(json!({"error": err.message()}))).into_response()
}

pub async fn server_metadata() -> Json<Value> {
    Json(json!({
        "name": SERVER_NAME,
        "version": env!("CARGO_PKG_VERSION"),
        "extensions": [],
    }))
}

pub async fn live() -> Json<Value> {
    Json(json!({"live": true}))
}

fn readiness(ready: bool) -> Response {
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(json!({"ready": ready}))).into_response()
}

pub async fn ready(State(state): State<HttpState>) -> Response {
    readiness(state.shared.ready())
}

pub async fn model_ready(
    State(state): State<HttpState>,
    Path(name): Path<String>,
) -> Result<Response, RestError> {
    oip::check_model(&name, "", &state.shared.model_name)?;
    Ok(readiness(state.shared.ready()))
}

pub async fn model_ready_version(
    State(state): State<HttpState>,
    Path((name, version)): Path<(String, String)>,
) -> Result<Response, RestError> {
    oip::check_model(&name, &version, &state.shared.model_name)?;
    Ok(readiness(state.shared.ready()))
}

fn metadata_json(state: &HttpState) -> Value {
    let metadata = inference::model_metadata(&state.shared);
    let tensors =
        |tensors: &[npufleet_contract::proto::inference::model_metadata_response::TensorMetadata]| {
            tensors
                .iter()
                .map(|t| json!({"name": t.name, "datatype": t.datatype, "shape": t.shape}))
                .collect::<Vec<_>>()
        };
    json!({
        "name": metadata.name,
        "versions": metadata.versions,
        "platform": metadata.platform,
        "inputs": tensors(&metadata.inputs),
        "outputs": tensors(&metadata.outputs),
    })
}

pub async fn model_metadata(
    State(state): State<HttpState>,
    Path(name): Path<String>,
) -> Result<Json<Value>, RestError> {
    oip::check_model(&name, "", &state.shared.model_name)?;
    Ok(Json(metadata_json(&state)))
}

pub async fn model_metadata_version(
    State(state): State<HttpState>,
    Path((name, version)): Path<(String, String)>,
) -> Result<Json<Value>, RestError> {
    oip::check_model(&name, &version, &state.shared.model_name)?;
    Ok(Json(metadata_json(&state)))
}

#[derive(Debug, Deserialize)]
pub struct RestInferRequest {
    #[serde(default)]
    id: String,
    #[serde(default)]
    parameters: Map<String, Value>,
    inputs: Vec<RestInput>,
    #[serde(default)]
    outputs: Vec<RestOutput>,
}

#[derive(Debug, Deserialize)]
struct RestInput {
    name: String,
    shape: Vec<i64>,
    datatype: String,
    #[serde(default)]
    parameters: Map<String, Value>,
    data: Value,
}

#[derive(Debug, Deserialize)]
struct RestOutput {
    name: String,
    #[serde(default)]
    parameters: Map<String, Value>,
}

fn parameter(name: &str, value: &Value) -> Result<InferParameter, ServeError> {
    let choice = match value {
        Value::Bool(b) => ParameterChoice::BoolParam(*b),
        Value::String(s) => ParameterChoice::StringParam(s.clone()),
        // A list of strings (such as several stop strings) travels as its JSON text.
        Value::Array(items) if items.iter().all(Value::is_string) => {
            ParameterChoice::StringParam(value.to_string())
        }
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                ParameterChoice::Int64Param(i)
            } else if let Some(u) = n.as_u64() {
                ParameterChoice::Uint64Param(u)
            } else {
                ParameterChoice::DoubleParam(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        _ => {
            return Err(ServeError::bad_param(
                name,
                format!(
                    "parameter '{name}' must be a bool, a number, a string or a list of strings"
                ),
            ));
        }
    };
    Ok(InferParameter {
        parameter_choice: Some(choice),
    })
}

fn parameters(map: &Map<String, Value>) -> Result<HashMap<String, InferParameter>, ServeError> {
    map.iter()
        .map(|(name, value)| Ok((name.clone(), parameter(name, value)?)))
        .collect()
}

/// Flattens nested JSON arrays into their elements in row-major order.
fn flatten<'a>(value: &'a Value, out: &mut Vec<&'a Value>) {
    match value {
        Value::Array(items) => items.iter().for_each(|item| flatten(item, out)),
        other => out.push(other),
    }
}

fn contents(input: &RestInput) -> Result<InferTensorContents, ServeError> {
    let mut elements = Vec::new();
    flatten(&input.data, &mut elements);
    let wrong = |expected: &str| {
        ServeError::bad_param(
            &input.name,
            format!(
                "input '{}' has datatype {} but its data holds an element that is not {expected}",
                input.name, input.datatype
            ),
        )
    };
    let mut contents = InferTensorContents::default();
    match input.datatype.as_str() {
        "BYTES" => {
            for element in elements {
                let text = element.as_str().ok_or_else(|| wrong("a string"))?;
                contents.bytes_contents.push(text.as_bytes().to_vec());
            }
        }
        "INT64" => {
            for element in elements {
                contents
                    .int64_contents
                    .push(element.as_i64().ok_or_else(|| wrong("a 64-bit integer"))?);
            }
        }
        "INT32" => {
            for element in elements {
                let value = element
                    .as_i64()
                    .and_then(|v| i32::try_from(v).ok())
                    .ok_or_else(|| wrong("a 32-bit integer"))?;
                contents.int_contents.push(value);
            }
        }
        // Datatypes this model does not take are reported by the decoder, naming the input.
        _ => {}
    }
    Ok(contents)
}

fn to_grpc(
    name: &str,
    version: &str,
    body: &RestInferRequest,
) -> Result<ModelInferRequest, ServeError> {
    Ok(ModelInferRequest {
        model_name: name.to_string(),
        model_version: version.to_string(),
        id: body.id.clone(),
        parameters: parameters(&body.parameters)?,
        inputs: body
            .inputs
            .iter()
            .map(|input| {
                Ok(InferInputTensor {
                    name: input.name.clone(),
                    datatype: input.datatype.clone(),
                    shape: input.shape.clone(),
                    parameters: parameters(&input.parameters)?,
                    contents: Some(contents(input)?),
                })
            })
            .collect::<Result<_, ServeError>>()?,
        outputs: body
            .outputs
            .iter()
            .map(|output| {
                Ok(InferRequestedOutputTensor {
                    name: output.name.clone(),
                    parameters: parameters(&output.parameters)?,
                })
            })
            .collect::<Result<_, ServeError>>()?,
        raw_input_contents: Vec::new(),
    })
}

fn parameter_json(param: &InferParameter) -> Value {
    match &param.parameter_choice {
        Some(ParameterChoice::BoolParam(b)) => json!(b),
        Some(ParameterChoice::Int64Param(i)) => json!(i),
        Some(ParameterChoice::Uint64Param(u)) => json!(u),
        Some(ParameterChoice::DoubleParam(d)) => json!(d),
        Some(ParameterChoice::StringParam(s)) => json!(s),
        None => Value::Null,
    }
}

fn response_json(response: &ModelInferResponse) -> Value {
    let outputs: Vec<Value> = response
        .outputs
        .iter()
        .map(|output| {
            let contents = output.contents.clone().unwrap_or_default();
            let data: Vec<Value> = if output.datatype == "BYTES" {
                contents
                    .bytes_contents
                    .iter()
                    .map(|b| json!(String::from_utf8_lossy(b)))
                    .collect()
            } else {
                contents.int64_contents.iter().map(|v| json!(v)).collect()
            };
            json!({
                "name": output.name,
                "datatype": output.datatype,
                "shape": output.shape,
                "data": data,
            })
        })
        .collect();
    let parameters: Map<String, Value> = response
        .parameters
        .iter()
        .map(|(k, v)| (k.clone(), parameter_json(v)))
        .collect();
    json!({
        "model_name": response.model_name,
        "model_version": response.model_version,
        "id": response.id,
        "parameters": parameters,
        "outputs": outputs,
    })
}

async fn serve_infer(
    state: HttpState,
    name: String,
    version: String,
    headers: &HeaderMap,
    body: Result<JsonBody<RestInferRequest>, BodyError>,
) -> Response {
    let JsonBody(body) = match body {
        Ok(body) => body,
        Err(err) => return body_error(err),
    };
    let result = async {
        let priority = http_priority(headers)?;
        let request = to_grpc(&name, &version, &body)?;
        inference::infer_unary(&state.shared, &request, priority).await
    }
    .await;
    match result {
        Ok(response) => Json(response_json(&response)).into_response(),
        Err(err) => RestError(err).into_response(),
    }
}

pub async fn infer(
    State(state): State<HttpState>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Result<JsonBody<RestInferRequest>, BodyError>,
) -> Response {
    serve_infer(state, name, String::new(), &headers, body).await
}

pub async fn infer_version(
    State(state): State<HttpState>,
    Path((name, version)): Path<(String, String)>,
    headers: HeaderMap,
    body: Result<JsonBody<RestInferRequest>, BodyError>,
) -> Response {
    serve_infer(state, name, version, &headers, body).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Prompt;

    #[test]
    fn rest_requests_decode_like_grpc_ones() {
        let body: RestInferRequest = serde_json::from_value(json!({
            "id": "r1",
            "parameters": {"max_tokens": 4, "temperature": 0.5, "stop": ["\n", "."]},
            "inputs": [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": [["hi"]]}],
            "outputs": [{"name": "text_output"}],
        }))
        .unwrap();
        let decoded = oip::decode_infer_request(&to_grpc("m", "", &body).unwrap()).unwrap();
        assert_eq!(decoded.prompt, Prompt::Text("hi".into()));
        assert_eq!(decoded.params.max_tokens, Some(4));
        assert_eq!(decoded.params.temperature, 0.5);
        assert_eq!(decoded.params.stop, vec!["\n".to_string(), ".".to_string()]);
        assert!(decoded.outputs.text && !decoded.outputs.ids);
    }

    #[test]
    fn wrong_element_types_are_named() {
        let body: RestInferRequest = serde_json::from_value(json!({
            "inputs": [{"name": "input_ids", "shape": [2], "datatype": "INT64", "data": [1, "two"]}],
        }))
        .unwrap();
        let err = to_grpc("m", "", &body).unwrap_err().to_string();
        assert!(
            err.contains("'input_ids'") && err.contains("64-bit integer"),
            "{err}"
        );
        let body: RestInferRequest = serde_json::from_value(json!({
            "parameters": {"seed": {"value": 1}},
            "inputs": [],
        }))
        .unwrap();
        assert!(
            to_grpc("m", "", &body)
                .unwrap_err()
                .to_string()
                .contains("'seed'")
        );
    }
}

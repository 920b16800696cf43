//! The Open Inference Protocol's operations on the engine, shared by the gRPC service and
//! the REST routes: the model's metadata, and checking, submitting and answering one request.

use std::collections::HashMap;
use std::sync::Arc;

use crate::api::{GenerateRequest, Usage};
use crate::server::error::ServeError;
use crate::server::oip::{self, InferRequest};
use crate::server::shared::{Shared, TrackedStream};
use npufleet_contract::proto::inference::model_metadata_response::TensorMetadata;
use npufleet_contract::proto::inference::{
    InferParameter, ModelInferRequest, ModelInferResponse, ModelMetadataResponse,
};

/// The server's name in the protocol's server metadata.
pub const SERVER_NAME: &str = "npufleet-worker";

/// The tensors a text-generation model takes and returns, as metadata.
pub fn model_metadata(shared: &Shared) -> ModelMetadataResponse {
    let tensor = |name: &str, datatype: &str, shape: i64| TensorMetadata {
        name: name.to_string(),
        datatype: datatype.to_string(),
        shape: vec![shape],
    };
    ModelMetadataResponse {
        name: shared.model_name.clone(),
        versions: vec![oip::MODEL_VERSION.to_string()],
        platform: format!("npufleet/{}", shared.engine.model_info().architecture),
        inputs: vec![
            tensor(oip::TEXT_INPUT, "BYTES", 1),
            tensor(oip::INPUT_IDS, "INT64", -1),
        ],
        outputs: vec![
            tensor(oip::TEXT_OUTPUT, "BYTES", 1),
            tensor(oip::OUTPUT_IDS, "INT64", -1),
        ],
    }
}

/// Checks, decodes and submits one inference request.
pub async fn start_infer(
    shared: &Arc<Shared>,
    request: &ModelInferRequest,
    priority: i32,
) -> Result<(InferRequest, TrackedStream), ServeError> {
    oip::check_model(
        &request.model_name,
        &request.model_version,
        &shared.model_name,
    )?;
    let mut decoded = oip::decode_infer_request(request).inspect_err(|err| {
        shared.metrics.count_rejected(err.kind());
    })?;
    if decoded.id.is_empty() {
        decoded.id = shared.next_request_id("infer");
    }
    let events = shared
        .submit(GenerateRequest {
            id: decoded.id.clone(),
            prompt: decoded.prompt.clone(),
            params: decoded.params.clone(),
            priority,
        })
        .await?;
    Ok((decoded, events))
}

/// Runs one request to completion and builds its single response.
pub async fn infer_unary(
    shared: &Arc<Shared>,
    request: &ModelInferRequest,
    priority: i32,
) -> Result<ModelInferResponse, ServeError> {
    let (decoded, events) = start_infer(shared, request, priority).await?;
    let collected = events.collect_all().await?;
    let mut parameters = usage_parameters(&collected.usage);
    if let Some(reason) = collected.reason {
        parameters.insert(
            "finish_reason".into(),
            oip::string_param(reason.as_openai()),
        );
    }
    Ok(oip::build_response(
        &shared.model_name,
        &decoded,
        &collected.text,
        &collected.token_ids,
        parameters,
    ))
}

/// The request's token counts, as response parameters.
pub fn usage_parameters(usage: &Usage) -> HashMap<String, InferParameter> {
    HashMap::from([
        (
            "prompt_tokens".into(),
            oip::int_param(usage.prompt_tokens.into()),
        ),
        (
            "completion_tokens".into(),
            oip::int_param(usage.completion_tokens.into()),
        ),
        (
            "cached_prompt_tokens".into(),
            oip::int_param(usage.cached_prompt_tokens.into()),
        ),
    ])
}

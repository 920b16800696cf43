//! The gRPC surfaces: the Open Inference Protocol service and npufleet's load service.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{IntervalStream, ReceiverStream};
use tonic::{Code, Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::api::{CacheEvent, CacheUpdate, EngineState, GenerationEvent};
use crate::server::auth;
use crate::server::error::ServeError;
use crate::server::inference::{self, SERVER_NAME};
use crate::server::oip;
use crate::server::shared::{Shared, request_priority};
use crate::server::trace;
use npufleet_contract::auth::ApiKey;
use npufleet_contract::headers::FLOW_PRIORITY;
use npufleet_contract::proto::inference::grpc_inference_service_server::GrpcInferenceService;
use npufleet_contract::proto::inference::*;
use npufleet_contract::proto::npufleet::v1::worker_load_server::WorkerLoad;
use npufleet_contract::proto::npufleet::v1::{
    AllBlocksCleared, BlockRemoved, BlockStored, GetLoadRequest, KvEvent, KvEventBatch, LoadReport,
    StepSums, WatchKvEventsRequest, WatchLoadRequest, WorkerState, kv_event,
};

fn step_sums(sums: &crate::api::StepSums) -> StepSums {
    StepSums {
        steps: sums.steps,
        size: sums.size,
        seconds: sums.seconds,
        size_squared: sums.size_squared,
        size_seconds: sums.size_seconds,
    }
}

pub struct InferenceService {
    shared: Arc<Shared>,
    /// Required on the inference calls when set.
    api_key: Option<ApiKey>,
}

impl InferenceService {
    pub fn new(shared: Arc<Shared>, api_key: Option<ApiKey>) -> Self {
        InferenceService { shared, api_key }
    }

    /// ModelInfer itself, which [`GrpcInferenceService::model_infer`] runs in its span.
    async fn infer(
        &self,
        request: Request<ModelInferRequest>,
    ) -> Result<Response<ModelInferResponse>, Status> {
        auth::check_grpc(self.api_key.as_ref(), request.metadata())?;
        let priority = metadata_priority(request.metadata())?;
        let response = inference::infer_unary(&self.shared, request.get_ref(), priority).await?;
        Ok(Response::new(response))
    }
}

type StreamSender = mpsc::Sender<Result<ModelStreamInferResponse, Status>>;

/// The priority of a call's requests ([`request_priority`]), for a whole stream.
fn metadata_priority(metadata: &tonic::metadata::MetadataMap) -> Result<i32, ServeError> {
    request_priority(metadata.get(FLOW_PRIORITY).map(|v| v.as_bytes()))
}

fn stream_error(request_id: &str, model_name: &str, err: &ServeError) -> ModelStreamInferResponse {
    npufleet_contract::proto::stream_error(model_name, request_id, &Status::from(err.clone()))
}

/// Streams one request: a response per generated chunk, then a last response flagged
/// `triton_final_response` that carries the finish reason and token usage.
async fn stream_one(
    shared: Arc<Shared>,
    request: ModelInferRequest,
    priority: i32,
    out: StreamSender,
) {
    let (decoded, mut events) = match inference::start_infer(&shared, &request, priority).await {
        Ok(started) => started,
        Err(err) => {
            let _ = shared
                .send_chunk(
                    &out,
                    Ok(stream_error(&request.id, &shared.model_name, &err)),
                )
                .await;
            return;
        }
    };
    let mut pending_ids = Vec::new();
    while let Some(event) = events.next().await {
        let response = match event {
            GenerationEvent::Token { token_id, text } => {
                pending_ids.push(token_id);
                if text.is_empty() {
                    continue;
                }
                let parameters =
                    HashMap::from([("triton_final_response".into(), oip::bool_param(false))]);
                let response = oip::build_response(
                    &shared.model_name,
                    &decoded,
                    &text,
                    &pending_ids,
                    parameters,
                );
                pending_ids.clear();
                response
            }
            GenerationEvent::Finished { reason, usage, .. } => {
                let mut parameters = inference::usage_parameters(&usage);
                parameters.insert("triton_final_response".into(), oip::bool_param(true));
                parameters.insert(
                    "finish_reason".into(),
                    oip::string_param(reason.as_openai()),
                );
                let response =
                    oip::build_response(&shared.model_name, &decoded, "", &pending_ids, parameters);
                let _ = shared
                    .send_chunk(
                        &out,
                        Ok(ModelStreamInferResponse {
                            error_message: String::new(),
                            infer_response: Some(response),
                        }),
                    )
                    .await;
                return;
            }
            GenerationEvent::Failed { message } => {
                let err = ServeError::Internal(message);
                let _ = shared
                    .send_chunk(
                        &out,
                        Ok(stream_error(&decoded.id, &shared.model_name, &err)),
                    )
                    .await;
                return;
            }
        };
        let sent = shared
            .send_chunk(
                &out,
                Ok(ModelStreamInferResponse {
                    error_message: String::new(),
                    infer_response: Some(response),
                }),
            )
            .await;
        if sent.is_err() {
            // The caller hung up or stopped reading; dropping the events cancels the request
            // in the engine.
            return;
        }
    }
    let err = ServeError::Internal("the engine ended the request without a result".into());
    let _ = shared
        .send_chunk(
            &out,
            Ok(stream_error(&decoded.id, &shared.model_name, &err)),
        )
        .await;
}

/// Responses of one `ModelStreamInfer` stream buffered ahead of its connection.
const STREAM_BUFFER_RESPONSES: usize = 64;

/// The transport refuses an oversized message with OUT_OF_RANGE and its own wording; clients
/// get RESOURCE_EXHAUSTED and the setting that sets the limit, as HTTP clients get 413.
pub fn message_limit_status(status: Status) -> Status {
    if status.code() == tonic::Code::OutOfRange && status.message().contains("too large") {
        Status::resource_exhausted(format!(
            "the request message is too large: {} (the limit is set by --max-grpc-message-bytes)",
            status.message()
        ))
    } else {
        status
    }
}

/// [`message_limit_status`] for the responses the transport writes itself: an oversized
/// unary request never reaches a handler.
pub fn name_message_limit<B>(mut response: http::Response<B>) -> http::Response<B> {
    if let Some(status) = Status::from_header_map(response.headers())
        && status.code() == tonic::Code::OutOfRange
    {
        let renamed = message_limit_status(status);
        if renamed.code() != tonic::Code::OutOfRange {
            // Only fails for a message that cannot be a header value; ours always can.
            let _ = renamed.add_header(response.headers_mut());
        }
    }
    response
}

type ResponseStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl GrpcInferenceService for InferenceService {
    async fn server_live(
        &self,
        _request: Request<ServerLiveRequest>,
    ) -> Result<Response<ServerLiveResponse>, Status> {
        Ok(Response::new(ServerLiveResponse { live: true }))
    }

    async fn server_ready(
        &self,
        _request: Request<ServerReadyRequest>,
    ) -> Result<Response<ServerReadyResponse>, Status> {
        Ok(Response::new(ServerReadyResponse {
            ready: self.shared.ready(),
        }))
    }

    async fn model_ready(
        &self,
        request: Request<ModelReadyRequest>,
    ) -> Result<Response<ModelReadyResponse>, Status> {
        let request = request.into_inner();
        oip::check_model(&request.name, &request.version, &self.shared.model_name)?;
        Ok(Response::new(ModelReadyResponse {
            ready: self.shared.ready(),
        }))
    }

    async fn server_metadata(
        &self,
        _request: Request<ServerMetadataRequest>,
    ) -> Result<Response<ServerMetadataResponse>, Status> {
        Ok(Response::new(ServerMetadataResponse {
            name: SERVER_NAME.to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            extensions: Vec::new(),
        }))
    }

    async fn model_metadata(
        &self,
        request: Request<ModelMetadataRequest>,
    ) -> Result<Response<ModelMetadataResponse>, Status> {
        let request = request.into_inner();
        oip::check_model(&request.name, &request.version, &self.shared.model_name)?;
        Ok(Response::new(inference::model_metadata(&self.shared)))
    }

    async fn model_infer(
        &self,
        request: Request<ModelInferRequest>,
    ) -> Result<Response<ModelInferResponse>, Status> {
        let span = trace::grpc_span("ModelInfer", request.metadata());
        let started = Instant::now();
        let result = self.infer(request).instrument(span.clone()).await;
        let code = result.as_ref().map_or_else(Status::code, |_| Code::Ok);
        let elapsed_ms = trace::elapsed_ms(started);
        span.in_scope(|| tracing::info!(?code, elapsed_ms, "answered"));
        result
    }

    type ModelStreamInferStream = ResponseStream<ModelStreamInferResponse>;

    async fn model_stream_infer(
        &self,
        request: Request<Streaming<ModelInferRequest>>,
    ) -> Result<Response<Self::ModelStreamInferStream>, Status> {
        let span = trace::grpc_span("ModelStreamInfer", request.metadata());
        auth::check_grpc(self.api_key.as_ref(), request.metadata())?;
        let priority = metadata_priority(request.metadata())?;
        let started = Instant::now();
        let mut incoming = request.into_inner();
        let (out, responses) = mpsc::channel(STREAM_BUFFER_RESPONSES);
        let shared = self.shared.clone();
        // The response stream ends, with an OK status, when the client closes its side and
        // every request has been answered, or when the server stops serving: an idle stream
        // must not hold the process past its drain.
        tokio::spawn(
            async move {
                let mut requests = tokio::task::JoinSet::new();
                let mut closing = std::pin::pin!(shared.closing());
                let mut client_done = false;
                loop {
                    tokio::select! {
                        message = incoming.message(), if !client_done => match message {
                            Ok(Some(request)) => {
                                let one = stream_one(shared.clone(), request, priority, out.clone());
                                requests.spawn(one.in_current_span());
                            }
                            Ok(None) => client_done = true,
                            Err(status) => {
                                let _ = out.send(Err(message_limit_status(status))).await;
                                break;
                            }
                        },
                        Some(_) = requests.join_next(), if !requests.is_empty() => {}
                        () = &mut closing => {
                            if !requests.is_empty() {
                                let _ = out
                                    .send(Err(Status::unavailable(format!(
                                        "the worker shut down with {} requests of this stream \
                                         unanswered",
                                        requests.len()
                                    ))))
                                    .await;
                            }
                            break;
                        }
                    }
                    if client_done && requests.is_empty() {
                        break;
                    }
                }
                // Cancels whatever is left; dropping `out` ends the response stream.
                requests.abort_all();
                tracing::info!(elapsed_ms = trace::elapsed_ms(started), "stream closed");
            }
            .instrument(span),
        );
        Ok(Response::new(Box::pin(ReceiverStream::new(responses))))
    }
}

pub struct LoadService {
    shared: Arc<Shared>,
}

impl LoadService {
    pub fn new(shared: Arc<Shared>) -> Self {
        LoadService { shared }
    }
}

/// The load report of this moment.
pub fn load_report(shared: &Shared) -> LoadReport {
    let load = shared.engine.load();
    let (state, warmup_done, warmup_total) = match shared.state() {
        EngineState::WarmingUp { done, total } => (WorkerState::WarmingUp, done, total),
        EngineState::Ready => (
            WorkerState::Ready,
            shared.warmup_iterations,
            shared.warmup_iterations,
        ),
        EngineState::Draining => (
            WorkerState::Draining,
            shared.warmup_iterations,
            shared.warmup_iterations,
        ),
        EngineState::Drained => (
            WorkerState::Drained,
            shared.warmup_iterations,
            shared.warmup_iterations,
        ),
    };
    let saturate = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    LoadReport {
        model_name: shared.model_name.clone(),
        state: state.into(),
        waiting: saturate(load.waiting),
        running: saturate(load.running),
        queue_limit: saturate(load.queue_limit),
        max_batch_size: saturate(load.max_batch_size),
        prompt_chunk_tokens: saturate(load.prompt_chunk_tokens),
        kv_cache_usage: load.kv_cache_usage,
        warmup_done,
        warmup_total,
        prompt_tokens_total: load.prompt_tokens_total,
        generation_tokens_total: load.generation_tokens_total,
        preemptions_total: load.preemptions_total,
        prefix_cache_queries_total: load.prefix_cache_queries_total,
        prefix_cache_hits_total: load.prefix_cache_hits_total,
        last_batch_size: saturate(load.last_batch_size),
        prefill_steps_total: load.prefill_steps.steps,
        prefill_step_tokens_total: load.prefill_steps.size,
        prefill_step_seconds_total: load.prefill_steps.seconds,
        prefill_step_tokens_squared_total: load.prefill_steps.size_squared,
        prefill_step_tokens_seconds_total: load.prefill_steps.size_seconds,
        decode_steps_total: load.decode_steps.steps,
        decode_step_batch_total: load.decode_steps.size,
        decode_step_seconds_total: load.decode_steps.seconds,
        decode_step_batch_squared_total: load.decode_steps.size_squared,
        decode_step_batch_seconds_total: load.decode_steps.size_seconds,
        requests_total: load.requests_total,
        requests_admitted_total: load.requests_admitted_total,
        requests_finished_total: load.requests_finished_total,
        prompt_tokens_squared_total: load.prompt_tokens_squared_total,
        warmup_prefill_steps: Some(step_sums(&load.warmup_prefill_steps)),
        warmup_decode_steps: Some(step_sums(&load.warmup_decode_steps)),
        time_to_first_token: Some(shared.metrics.time_to_first_token()),
        timestamp_unix_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or_default(),
    }
}

/// The interval a watcher asked for, within the documented bounds.
fn watch_interval(interval_ms: u32) -> Duration {
    match interval_ms {
        0 => Duration::from_secs(1),
        ms => Duration::from_millis(ms.clamp(100, 60_000).into()),
    }
}

#[tonic::async_trait]
impl WorkerLoad for LoadService {
    async fn get_load(
        &self,
        _request: Request<GetLoadRequest>,
    ) -> Result<Response<LoadReport>, Status> {
        Ok(Response::new(load_report(&self.shared)))
    }

    type WatchLoadStream = ResponseStream<LoadReport>;

    async fn watch_load(
        &self,
        request: Request<WatchLoadRequest>,
    ) -> Result<Response<Self::WatchLoadStream>, Status> {
        let interval = watch_interval(request.get_ref().interval_ms);
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let shared = self.shared.clone();
        let closing = shared.closing();
        let reports = IntervalStream::new(ticks)
            .map(move |_| Ok(load_report(&shared)))
            .take_until(closing);
        Ok(Response::new(Box::pin(reports)))
    }

    type WatchKvEventsStream = ResponseStream<KvEventBatch>;

    async fn watch_kv_events(
        &self,
        _request: Request<WatchKvEventsRequest>,
    ) -> Result<Response<Self::WatchKvEventsStream>, Status> {
        if self.shared.engine.kv_events().is_none() {
            return Err(Status::unimplemented(
                "this engine publishes no prefix-cache events",
            ));
        }
        let (tx, rx) = mpsc::channel(16);
        let shared = self.shared.clone();
        tokio::spawn(async move {
            let closing = shared.closing();
            tokio::select! {
                () = forward_kv_events(&shared, &tx) => {}
                () = closing => {}
                () = tx.closed() => {}
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// A snapshot of the prefix cache, then its changes, until the subscriber hangs up. A
/// subscriber that falls too far behind gets a new snapshot rather than a gap.
async fn forward_kv_events(shared: &Shared, tx: &mpsc::Sender<Result<KvEventBatch, Status>>) {
    let Some(log) = shared.engine.kv_events() else {
        return;
    };
    let mut follower = log.follow();
    while let Some(update) = follower.next().await {
        let (seq, snapshot, events): (u64, bool, Vec<KvEvent>) = match update {
            CacheUpdate::Snapshot { seq, blocks } => {
                let cleared = KvEvent {
                    event: Some(kv_event::Event::AllCleared(AllBlocksCleared {})),
                };
                let blocks = blocks.iter().map(to_kv_event);
                (seq, true, std::iter::once(cleared).chain(blocks).collect())
            }
            CacheUpdate::Batch(batch) => (
                batch.seq,
                false,
                batch.events.iter().map(to_kv_event).collect(),
            ),
        };
        let batch = KvEventBatch {
            epoch: log.epoch,
            seq,
            block_size: u32::try_from(log.block_size).unwrap_or(u32::MAX),
            snapshot,
            events,
        };
        if tx.send(Ok(batch)).await.is_err() {
            return;
        }
    }
}

fn to_kv_event(event: &CacheEvent) -> KvEvent {
    let event = match *event {
        CacheEvent::Stored { hash, parent, .. } => kv_event::Event::Stored(BlockStored {
            block_hashes: vec![hash],
            parent_block_hash: parent,
        }),
        CacheEvent::Removed { hash } => kv_event::Event::Removed(BlockRemoved {
            block_hashes: vec![hash],
        }),
    };
    KvEvent { event: Some(event) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_interval_is_clamped() {
        assert_eq!(watch_interval(0), Duration::from_secs(1));
        assert_eq!(watch_interval(5), Duration::from_millis(100));
        assert_eq!(watch_interval(250), Duration::from_millis(250));
        assert_eq!(watch_interval(u32::MAX), Duration::from_secs(60));
    }
}

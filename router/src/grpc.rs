//! The Open Inference Protocol (KServe v2 gRPC) front door: each call, and each request of a
//! `ModelStreamInfer` stream, is sent to a replica of the model it names, through one HTTP/2
//! channel per replica.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::Stream;
use npufleet_contract::auth::AUTHORIZATION;
use npufleet_contract::headers;
use npufleet_contract::ports::GRPC_PORT;
use npufleet_contract::proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
use npufleet_contract::proto::inference::grpc_inference_service_server::GrpcInferenceService;
use npufleet_contract::proto::inference::{
    ModelInferRequest, ModelInferResponse, ModelMetadataRequest, ModelMetadataResponse,
    ModelReadyRequest, ModelReadyResponse, ModelStreamInferResponse, ServerLiveRequest,
    ServerLiveResponse, ServerMetadataRequest, ServerMetadataResponse, ServerReadyRequest,
    ServerReadyResponse,
};
use npufleet_contract::proto::stream_error;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::{AsciiMetadataValue, MetadataMap};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Response, Status, Streaming};

use crate::error::RouteError;
use crate::metrics::NO_REPLICA;
use crate::pool::Lease;
use crate::route::Router;

/// The worker's text input (see the worker's Open Inference Protocol mapping).
const TEXT_INPUT: &str = "text_input";

/// The client's credentials, passed to the replica as they came: workers of an
/// InferenceService with an API key check it, the router holds none.
fn credentials(metadata: &MetadataMap) -> Option<AsciiMetadataValue> {
    metadata.get(AUTHORIZATION).cloned()
}

/// `message` as an upstream request carrying the client's `credentials`.
fn with_credentials<T>(message: T, credentials: Option<&AsciiMetadataValue>) -> Request<T> {
    let mut request = Request::new(message);
    if let Some(value) = credentials {
        request.metadata_mut().insert(AUTHORIZATION, value.clone());
    }
    request
}

/// Responses of one `ModelStreamInfer` stream buffered ahead of its client.
const STREAM_BUFFER_RESPONSES: usize = 64;

type StreamSender = mpsc::Sender<Result<ModelStreamInferResponse, Status>>;

#[derive(Clone)]
pub struct GrpcFrontDoor {
    router: Arc<Router>,
    channels: Arc<Mutex<HashMap<IpAddr, Channel>>>,
    connect_timeout: Duration,
}

impl GrpcFrontDoor {
    pub fn new(router: Arc<Router>, connect_timeout: Duration) -> Self {
        GrpcFrontDoor {
            router,
            channels: Arc::default(),
            connect_timeout,
        }
    }

    /// The replica's channel, connecting on first use. Channels of replicas that left the
    /// fleet are dropped as new ones are made.
    fn client(&self, ip: IpAddr) -> GrpcInferenceServiceClient<Channel> {
        let mut channels = self.channels.lock().expect("channel lock");
        if !channels.contains_key(&ip) {
            let live: Vec<IpAddr> = self
                .router
                .discovery
                .fleet
                .borrow()
                .models
                .values()
                .flat_map(|m| m.endpoints.iter().map(|e| e.ip))
                .collect();
            channels.retain(|ip, _| live.contains(ip));
        }
        let channel = channels
            .entry(ip)
            .or_insert_with(|| {
                Endpoint::from_shared(format!("http://{}", SocketAddr::new(ip, GRPC_PORT)))
                    .expect("an IP and port make a valid URI")
                    .connect_timeout(self.connect_timeout)
                    .connect_lazy()
            })
            .clone();
        let limit = self.router.settings.max_body_bytes;
        GrpcInferenceServiceClient::new(channel)
            .max_decoding_message_size(limit)
            .max_encoding_message_size(limit)
    }

    fn count(&self, model: &str, replica: &str, code: Code) {
        self.router
            .metrics
            .requests
            .with_label_values(&[model, replica, &format!("{code:?}")])
            .inc();
    }

    fn route_error(&self, model: &str, error: RouteError) -> Status {
        let status = error.grpc_status();
        self.count(model, NO_REPLICA, status.code());
        status
    }

    fn prefix_key(&self, request: &ModelInferRequest) -> Option<u64> {
        let text = text_input(request)?;
        self.router.prefix_key(&request.model_name, text)
    }

    /// Sends one unary call to replicas of `model` in turn until one answers, retrying only
    /// failures that mean the replica did not take the request.
    async fn unary<Req, Resp, F, Fut>(
        &self,
        model: &str,
        prefix_key: Option<u64>,
        request: Request<Req>,
        call: F,
    ) -> Result<Response<Resp>, Status>
    where
        Req: Clone,
        F: Fn(GrpcInferenceServiceClient<Channel>, Request<Req>) -> Fut,
        Fut: Future<Output = Result<Response<Resp>, Status>>,
    {
        let credentials = credentials(request.metadata());
        let (lease, sent_at, mut response) = self
            .send(
                model,
                prefix_key,
                None,
                request.into_inner(),
                credentials.as_ref(),
                call,
            )
            .await?;
        self.router
            .metrics
            .upstream_ttft_seconds
            .with_label_values(&[model])
            .observe(sent_at.elapsed().as_secs_f64());
        self.count(model, &lease.pod, Code::Ok);
        if let Ok(value) = lease.pod.parse() {
            response.metadata_mut().insert(headers::REPLICA, value);
        }
        Ok(response)
    }

    /// Sends `message` to replicas of `model` in turn until one takes it, retrying only
    /// failures that mean the replica did not: the replica's response, the lease that counts
    /// the request there, and when it was sent. `lease`, if given, is the replica to try first.
    async fn send<Req, Resp, F, Fut>(
        &self,
        model: &str,
        prefix_key: Option<u64>,
        mut lease: Option<Lease>,
        message: Req,
        credentials: Option<&AsciiMetadataValue>,
        call: F,
    ) -> Result<(Lease, Instant, Response<Resp>), Status>
    where
        Req: Clone,
        F: Fn(GrpcInferenceServiceClient<Channel>, Request<Req>) -> Fut,
        Fut: Future<Output = Result<Response<Resp>, Status>>,
    {
        let router = &self.router;
        let mut tried: Vec<String> = Vec::new();
        let mut last: Option<Status> = None;
        while tried.len() < router.settings.max_attempts {
            let lease = match lease.take() {
                Some(lease) => lease,
                None => match router.lease(model, prefix_key, &tried).await {
                    Ok(lease) => lease,
                    Err(RouteError::ReplicasFailed { .. }) if last.is_some() => break,
                    Err(error) => return Err(self.route_error(model, error)),
                },
            };
            tried.push(lease.pod.clone());
            let sent_at = Instant::now();
            let attempt = with_credentials(message.clone(), credentials);
            match call(self.client(lease.ip), attempt).await {
                Ok(response) => return Ok((lease, sent_at, response)),
                Err(status) if retryable(&status) => {
                    let reason = if status.code() == Code::ResourceExhausted {
                        "busy"
                    } else {
                        "unavailable"
                    };
                    if tried.len() < router.settings.max_attempts {
                        router
                            .metrics
                            .retries
                            .with_label_values(&[model, reason])
                            .inc();
                    }
                    last = Some(status);
                }
                Err(status) => {
                    self.count(model, &lease.pod, status.code());
                    return Err(status);
                }
            }
        }
        let last = last.expect("the loop ends early only after a failed attempt");
        self.count(model, NO_REPLICA, last.code());
        Err(last)
    }

    /// One request of a client's stream, sent as a stream call of its own to the replica
    /// picked for it (or `lease`), its responses passed to `out` as they arrive. The call ends
    /// with the request's last response, and with it the lease that counts the request in
    /// flight there. A request that cannot be sent is answered in the stream with the reason.
    async fn stream_one(
        self,
        request: ModelInferRequest,
        lease: Option<Lease>,
        credentials: Option<AsciiMetadataValue>,
        out: StreamSender,
    ) {
        let model = request.model_name.clone();
        let key = self.prefix_key(&request);
        let sent = self
            .send(
                &model,
                key,
                lease,
                request.clone(),
                credentials.as_ref(),
                |mut client, request| async move {
                    client
                        .model_stream_infer(request.map(|message| futures::stream::iter([message])))
                        .await
                },
            )
            .await;
        let (lease, sent_at, response) = match sent {
            Ok(sent) => sent,
            Err(status) => {
                let error = stream_error(&model, &request.id, &status);
                let _ = out.send(Ok(error)).await;
                return;
            }
        };
        let mut upstream = response.into_inner();
        let mut first = true;
        let code = loop {
            match upstream.message().await {
                Ok(Some(message)) => {
                    if std::mem::take(&mut first) {
                        self.router
                            .metrics
                            .upstream_ttft_seconds
                            .with_label_values(&[&model])
                            .observe(sent_at.elapsed().as_secs_f64());
                    }
                    if out.send(Ok(message)).await.is_err() {
                        // The client went; dropping the call cancels the request upstream.
                        break Code::Cancelled;
                    }
                }
                Ok(None) => break Code::Ok,
                Err(status) => {
                    let failed = Status::new(
                        status.code(),
                        format!(
                            "replica {} failed while answering: {}",
                            lease.pod,
                            status.message()
                        ),
                    );
                    let _ = out
                        .send(Ok(stream_error(&model, &request.id, &failed)))
                        .await;
                    break status.code();
                }
            }
        };
        self.count(&model, &lease.pod, code);
    }
}

/// The replica refused or never saw the request: another may take it.
fn retryable(status: &Status) -> bool {
    matches!(status.code(), Code::Unavailable | Code::ResourceExhausted)
}

/// The prompt of an infer request: its `text_input` tensor's first element, given in
/// `contents` or, length-prefixed, in `raw_input_contents`.
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

type ResponseStream = Pin<Box<dyn Stream<Item = Result<ModelStreamInferResponse, Status>> + Send>>;

#[tonic::async_trait]
impl GrpcInferenceService for GrpcFrontDoor {
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
        let ready = *self.router.discovery.synced.borrow();
        Ok(Response::new(ServerReadyResponse { ready }))
    }

    /// Ready when the model has a serving replica; unknown models are NOT_FOUND.
    async fn model_ready(
        &self,
        request: Request<ModelReadyRequest>,
    ) -> Result<Response<ModelReadyResponse>, Status> {
        let name = &request.get_ref().name;
        let model = self
            .router
            .model(name)
            .map_err(|e| self.route_error(name, e))?;
        Ok(Response::new(ModelReadyResponse {
            ready: !model.endpoints.is_empty(),
        }))
    }

    async fn server_metadata(
        &self,
        _request: Request<ServerMetadataRequest>,
    ) -> Result<Response<ServerMetadataResponse>, Status> {
        Ok(Response::new(ServerMetadataResponse {
            name: "npufleet-router".to_owned(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            extensions: Vec::new(),
        }))
    }

    async fn model_metadata(
        &self,
        request: Request<ModelMetadataRequest>,
    ) -> Result<Response<ModelMetadataResponse>, Status> {
        let model = request.get_ref().name.clone();
        self.unary(&model, None, request, |mut client, request| async move {
            client.model_metadata(request).await
        })
        .await
    }

    async fn model_infer(
        &self,
        request: Request<ModelInferRequest>,
    ) -> Result<Response<ModelInferResponse>, Status> {
        let model = request.get_ref().model_name.clone();
        let key = self.prefix_key(request.get_ref());
        self.unary(&model, key, request, |mut client, request| async move {
            client.model_infer(request).await
        })
        .await
    }

    type ModelStreamInferStream = ResponseStream;

    /// Each request of the stream is routed on its own, as a unary call is: to the replica
    /// picked for it, counted in flight there until its last response, retried elsewhere
    /// when that replica cannot take it. Responses pass through as they arrive, in order for
    /// each request. A stream whose first request cannot be routed (an unknown model, no
    /// replica within the hold) fails as a whole; a later request that cannot, or whose
    /// replica fails mid-answer, gets an error response in the stream, and the stream goes on.
    async fn model_stream_infer(
        &self,
        request: Request<Streaming<ModelInferRequest>>,
    ) -> Result<Response<Self::ModelStreamInferStream>, Status> {
        let credentials = credentials(request.metadata());
        let mut incoming = request.into_inner();
        let Some(first) = incoming.message().await? else {
            return Err(Status::invalid_argument(
                "the stream ended before its first request",
            ));
        };
        let model = first.model_name.clone();
        let lease = self
            .router
            .lease(&model, self.prefix_key(&first), &[])
            .await
            .map_err(|e| self.route_error(&model, e))?;
        let (out, responses) = mpsc::channel(STREAM_BUFFER_RESPONSES);
        let door = self.clone();
        // The response stream ends, with an OK status, once the client has closed its side and
        // every request has been answered; a client that goes cancels what is left.
        tokio::spawn(async move {
            let mut requests = JoinSet::new();
            requests.spawn(door.clone().stream_one(
                first,
                Some(lease),
                credentials.clone(),
                out.clone(),
            ));
            let mut client_done = false;
            loop {
                tokio::select! {
                    message = incoming.message(), if !client_done => match message {
                        Ok(Some(request)) => {
                            requests.spawn(door.clone().stream_one(
                                request,
                                None,
                                credentials.clone(),
                                out.clone(),
                            ));
                        }
                        Ok(None) => client_done = true,
                        Err(status) => {
                            let _ = out.send(Err(status)).await;
                            break;
                        }
                    },
                    Some(_) = requests.join_next(), if !requests.is_empty() => {}
                    () = out.closed() => break,
                }
                if client_done && requests.is_empty() {
                    break;
                }
            }
        });
        Ok(Response::new(
            Box::pin(ReceiverStream::new(responses)) as ResponseStream
        ))
    }
}

#[cfg(test)]
mod tests {
    use npufleet_contract::proto::inference::InferTensorContents;
    use npufleet_contract::proto::inference::model_infer_request::InferInputTensor;

    use super::*;

    fn text(name: &str) -> InferInputTensor {
        InferInputTensor {
            name: name.to_owned(),
            datatype: "BYTES".to_owned(),
            shape: vec![1],
            ..Default::default()
        }
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

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
use npufleet_contract::logging::next_hop;
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
use npufleet_contract::trace::TraceParent;
use npufleet_crds::Engine;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::{AsciiMetadataValue, MetadataMap};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::error::RouteError;
use crate::metrics::NO_REPLICA;
use crate::pool::Lease;
use crate::request::{Caller, RoutedRequest, grpc_trace};
use crate::retry::{self, Attempt, Reason, Unanswered};
use crate::route::Router;

/// The client's credentials, passed to the replica as they came: workers of an
/// InferenceService with an API key check it, the router holds none.
fn credentials(metadata: &MetadataMap) -> Option<AsciiMetadataValue> {
    metadata.get(AUTHORIZATION).cloned()
}

/// `message` as an upstream call for `request` on `lease`, carrying the client's
/// `credentials`, the request's trace and the priority flow control admitted it at.
fn upstream<T>(
    message: T,
    credentials: Option<&AsciiMetadataValue>,
    request: &RoutedRequest,
    lease: &Lease,
) -> Request<T> {
    let mut upstream = Request::new(message);
    let metadata = upstream.metadata_mut();
    if let Some(value) = credentials {
        metadata.insert(AUTHORIZATION, value.clone());
    }
    if let Some(priority) = lease.priority {
        metadata.insert(headers::FLOW_PRIORITY, AsciiMetadataValue::from(priority));
    }
    if let Ok(trace) = next_hop(&tracing::Span::current(), &request.trace)
        .to_string()
        .parse()
    {
        metadata.insert(headers::TRACEPARENT, trace);
    }
    upstream
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

    fn routed(
        &self,
        message: &ModelInferRequest,
        trace: Option<TraceParent>,
        caller: &Caller,
    ) -> RoutedRequest {
        RoutedRequest::oip(message, trace, caller.clone(), |model, prompt| {
            self.router.affinity(model, prompt)
        })
    }

    /// The status of a request no replica answered, counted.
    fn unanswered(&self, model: &str, unanswered: Unanswered<Status>) -> Status {
        match unanswered {
            Unanswered::Route(error) => self.route_error(model, error),
            Unanswered::Replica { pod, error } => {
                self.count(model, &pod, error.code());
                error
            }
        }
    }

    /// One unary call, sent to replicas of the request's model per the retry policy.
    async fn unary<Req, Resp, F, Fut>(
        &self,
        request: RoutedRequest,
        message: Request<Req>,
        call: F,
    ) -> Result<Response<Resp>, Status>
    where
        Req: Clone,
        F: Fn(GrpcInferenceServiceClient<Channel>, Request<Req>) -> Fut,
        Fut: Future<Output = Result<Response<Resp>, Status>>,
    {
        let credentials = credentials(message.metadata());
        let model = request.model.as_str();
        let (lease, sent_at, mut response) = self
            .send(
                &request,
                None,
                message.into_inner(),
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

    /// Sends `message` to replicas of the request's model per the retry policy (`first`, if
    /// given, is the replica to try first): the replica's response, the lease that counts the
    /// request there, and when it was sent.
    async fn send<Req, Resp, F, Fut>(
        &self,
        request: &RoutedRequest,
        first: Option<Lease>,
        message: Req,
        credentials: Option<&AsciiMetadataValue>,
        call: F,
    ) -> Result<(Lease, Instant, Response<Resp>), Status>
    where
        Req: Clone,
        F: Fn(GrpcInferenceServiceClient<Channel>, Request<Req>) -> Fut,
        Fut: Future<Output = Result<Response<Resp>, Status>>,
    {
        if let Ok(model) = self.router.model(&request.model)
            && model.engine != Engine::Npufleet
        {
            let error = RouteError::NoGrpc {
                model: request.model.clone(),
                engine: model.engine.as_str(),
            };
            return Err(self.route_error(&request.model, error));
        }
        let sent = retry::send(&self.router, request, first, |lease| {
            let call = call(
                self.client(lease.ip),
                upstream(message.clone(), credentials, request, lease),
            );
            async move {
                let sent_at = Instant::now();
                match call.await {
                    Ok(response) => Attempt::Answered((sent_at, response)),
                    Err(status) => match Reason::of_grpc_code(status.code()) {
                        Some(reason) => Attempt::Refused(reason, status),
                        None => Attempt::Failed(status),
                    },
                }
            }
        })
        .await;
        match sent {
            Ok((lease, (sent_at, response))) => Ok((lease, sent_at, response)),
            Err(unanswered) => Err(self.unanswered(&request.model, unanswered)),
        }
    }

    /// One request of a client's stream, sent as a stream call of its own to the replica
    /// picked for it (or `lease`), its responses passed to `out` as they arrive. The call ends
    /// with the request's last response, and with it the lease that counts the request in
    /// flight there. A request that cannot be sent is answered in the stream with the reason.
    async fn stream_one(
        self,
        message: ModelInferRequest,
        request: RoutedRequest,
        lease: Option<Lease>,
        credentials: Option<AsciiMetadataValue>,
        out: StreamSender,
    ) {
        let model = request.model.as_str();
        let sent = self
            .send(
                &request,
                lease,
                message.clone(),
                credentials.as_ref(),
                |mut client, request| async move {
                    client
                        .model_stream_infer(request.map(|message| futures::stream::iter([message])))
                        .await
                },
            )
            .await;
        let (mut lease, sent_at, response) = match sent {
            Ok(sent) => sent,
            Err(status) => {
                let error = stream_error(model, &message.id, &status);
                let _ = out.send(Ok(error)).await;
                return;
            }
        };
        let mut upstream = response.into_inner();
        let mut first = true;
        let code = loop {
            match upstream.message().await {
                Ok(Some(answer)) => {
                    if std::mem::take(&mut first) {
                        lease.first_token();
                        self.router
                            .metrics
                            .upstream_ttft_seconds
                            .with_label_values(&[model])
                            .observe(sent_at.elapsed().as_secs_f64());
                    }
                    if out.send(Ok(answer)).await.is_err() {
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
                        .send(Ok(stream_error(model, &message.id, &failed)))
                        .await;
                    break status.code();
                }
            }
        };
        self.count(model, &lease.pod, code);
    }
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
        let routed = RoutedRequest::named(&request.get_ref().name, grpc_trace(request.metadata()));
        let span = routed.span();
        self.unary(routed, request, |mut client, request| async move {
            client.model_metadata(request).await
        })
        .instrument(span)
        .await
    }

    async fn model_infer(
        &self,
        request: Request<ModelInferRequest>,
    ) -> Result<Response<ModelInferResponse>, Status> {
        let caller = Caller::from_metadata(request.metadata())
            .map_err(|e| self.route_error(&request.get_ref().model_name, e))?;
        let routed = self.routed(request.get_ref(), grpc_trace(request.metadata()), &caller);
        let span = routed.span();
        self.unary(routed, request, |mut client, request| async move {
            client.model_infer(request).await
        })
        .instrument(span)
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
        let trace = grpc_trace(request.metadata());
        let caller = Caller::from_metadata(request.metadata()).map_err(|e| e.grpc_status())?;
        let mut incoming = request.into_inner();
        let Some(first) = incoming.message().await? else {
            return Err(Status::invalid_argument(
                "the stream ended before its first request",
            ));
        };
        let routed = self.routed(&first, trace, &caller);
        let lease = self
            .router
            .lease(&routed, &[])
            .await
            .map_err(|e| self.route_error(&routed.model, e))?;
        let (out, responses) = mpsc::channel(STREAM_BUFFER_RESPONSES);
        let door = self.clone();
        // The response stream ends, with an OK status, once the client has closed its side and
        // every request has been answered; a client that goes cancels what is left.
        tokio::spawn(async move {
            let mut requests = JoinSet::new();
            let span = routed.span();
            requests.spawn(
                door.clone()
                    .stream_one(first, routed, Some(lease), credentials.clone(), out.clone())
                    .instrument(span),
            );
            let mut client_done = false;
            loop {
                tokio::select! {
                    message = incoming.message(), if !client_done => match message {
                        Ok(Some(message)) => {
                            let routed = door.routed(&message, trace, &caller);
                            let span = routed.span();
                            requests.spawn(
                                door.clone()
                                    .stream_one(message, routed, None, credentials.clone(), out.clone())
                                    .instrument(span),
                            );
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

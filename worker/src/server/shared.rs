//! State every surface shares: the engine, metrics, and the shutdown bookkeeping that lets a
//! drain wait for every accepted request to be answered.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::Stream;
use tokio::sync::{mpsc, watch};

use crate::api::{
    ChatMessage, Engine, EngineState, GenerateRequest, GenerationEvent, GenerationStream,
};
use crate::server::error::ServeError;
use crate::server::metrics::Metrics;
use npufleet_contract::headers::FLOW_PRIORITY;

pub struct Shared {
    pub engine: Arc<dyn Engine>,
    /// The name clients address the model by.
    pub model_name: String,
    pub metrics: Metrics,
    /// Warm-up iterations the engine was configured with.
    pub warmup_iterations: u32,
    /// Longest wait for a client to take the next chunk of a streamed response before the
    /// request is cancelled.
    pub stalled_reader_timeout: Duration,
    shutting_down: AtomicBool,
    in_flight: AtomicUsize,
    request_counter: AtomicUsize,
    closing: watch::Sender<bool>,
    abandoned: watch::Sender<bool>,
    abandon_reason: Mutex<String>,
}

impl Shared {
    pub fn new(
        engine: Arc<dyn Engine>,
        model_name: String,
        warmup_iterations: u32,
        stalled_reader_timeout: Duration,
    ) -> Self {
        let metrics = Metrics::new(&model_name);
        Shared {
            engine,
            model_name,
            metrics,
            warmup_iterations,
            stalled_reader_timeout,
            shutting_down: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            request_counter: AtomicUsize::new(0),
            closing: watch::channel(false).0,
            abandoned: watch::channel(false).0,
            abandon_reason: Mutex::new(String::new()),
        }
    }

    /// Whether new inference requests are accepted.
    pub fn ready(&self) -> bool {
        !self.shutting_down.load(Ordering::SeqCst) && self.engine.state() == EngineState::Ready
    }

    pub fn state(&self) -> EngineState {
        match self.engine.state() {
            EngineState::Ready | EngineState::WarmingUp { .. }
                if self.shutting_down.load(Ordering::SeqCst) =>
            {
                EngineState::Draining
            }
            state => state,
        }
    }

    /// Refuses new requests from now on and tells the engine to drain.
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        self.engine.begin_drain();
    }

    /// Responses still being written.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// A process-unique id for requests that came without one.
    pub fn next_request_id(&self, prefix: &str) -> String {
        let n = self.request_counter.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:x}-{n}", std::process::id())
    }

    /// Submits to the engine; the returned stream records metrics as events pass through and
    /// counts as in flight until dropped. Tokenising a prompt takes time in proportion to its
    /// length, so the engine's submit runs on a blocking thread, away from the tasks that
    /// answer health probes.
    pub async fn submit(
        self: &Arc<Self>,
        request: GenerateRequest,
    ) -> Result<TrackedStream, ServeError> {
        let submitted = Instant::now();
        if self.shutting_down.load(Ordering::SeqCst) {
            self.metrics.count_rejected("draining");
            return Err(ServeError::Unavailable(
                "the worker is draining and accepts no new requests".into(),
            ));
        }
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let guard = InFlight(self.clone());
        let engine = self.engine.clone();
        let submitted_to_engine = tokio::task::spawn_blocking(move || engine.submit(request))
            .await
            .map_err(|err| ServeError::Internal(format!("submitting the request failed: {err}")))?;
        match submitted_to_engine {
            Ok(events) => Ok(TrackedStream {
                events,
                submitted,
                last_token_at: None,
                abandoned: Box::pin(until_set(self.abandoned.subscribe())),
                ended: false,
                in_flight: guard,
            }),
            Err(err) => {
                let err = ServeError::from(err);
                self.metrics.count_rejected(err.kind());
                Err(err)
            }
        }
    }

    /// The chat template applied on a blocking thread, for the same reason as [`Self::submit`].
    pub async fn apply_chat_template(
        &self,
        messages: Vec<ChatMessage>,
    ) -> Result<String, ServeError> {
        let engine = self.engine.clone();
        tokio::task::spawn_blocking(move || engine.apply_chat_template(&messages))
            .await
            .map_err(|err| {
                ServeError::Internal(format!("applying the chat template failed: {err}"))
            })?
            .map_err(ServeError::from)
    }

    /// Ends every request still in flight with a failure saying why, so clients learn that
    /// their answer is incomplete instead of seeing the connection just close.
    pub fn abandon_in_flight(&self, reason: &str) {
        *self
            .abandon_reason
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = reason.to_string();
        self.abandoned.send_replace(true);
    }

    /// Resolves once the server stops serving: long-lived streams end then.
    pub fn closing(&self) -> impl Future<Output = ()> + Send + 'static {
        until_set(self.closing.subscribe())
    }

    /// Tells long-lived streams to end.
    pub fn close(&self) {
        self.closing.send_replace(true);
    }

    /// Hands one chunk of a streamed response to its connection, waiting at most
    /// `stalled_reader_timeout` for room: a client that stops reading would otherwise keep
    /// its sequence decoding into buffers without bound. Err means the request is over (the
    /// client left or stalled) and its events should be dropped, which cancels it.
    pub async fn send_chunk<T>(&self, out: &mpsc::Sender<T>, chunk: T) -> Result<(), ChunkRefused> {
        match tokio::time::timeout(self.stalled_reader_timeout, out.send(chunk)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(ChunkRefused::ClientLeft),
            Err(_) => {
                self.metrics.count_rejected("stalled_reader");
                tracing::warn!(
                    timeout = ?self.stalled_reader_timeout,
                    "cancelling a streamed request whose client stopped reading"
                );
                Err(ChunkRefused::Stalled)
            }
        }
    }
}

/// Why a streamed chunk was not delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkRefused {
    ClientLeft,
    /// The client took nothing for `--stalled-reader-timeout`.
    Stalled,
}

/// Resolves once the flag behind `flag` is set (or its sender is gone).
async fn until_set(mut flag: watch::Receiver<bool>) {
    let _ = flag.wait_for(|set| *set).await;
}

struct InFlight(Arc<Shared>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The engine's event stream of one request, observed for metrics. When the server gives
/// up on in-flight requests (a drain that timed out) it ends with a failure naming why.
pub struct TrackedStream {
    events: GenerationStream,
    /// When the server received the request (before tokenising).
    submitted: Instant,
    last_token_at: Option<Instant>,
    abandoned: Pin<Box<dyn Future<Output = ()> + Send>>,
    /// A final event has been yielded; nothing follows it.
    ended: bool,
    in_flight: InFlight,
}

impl Stream for TrackedStream {
    type Item = GenerationEvent;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        let shared = &this.in_flight.0;
        // Abandonment is checked first: a sequence still decoding always has a token ready,
        // and would otherwise run on past the drain timeout.
        let polled = if this.abandoned.as_mut().poll(cx).is_ready() {
            let reason = shared
                .abandon_reason
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            Poll::Ready(Some(GenerationEvent::Failed { message: reason }))
        } else {
            this.events.poll_recv(cx)
        };
        if let Poll::Ready(Some(event)) = &polled {
            let metrics = &shared.metrics;
            match event {
                GenerationEvent::Token { .. } => {
                    let now = Instant::now();
                    match this.last_token_at.replace(now) {
                        Some(previous) => metrics.observe_inter_token(now - previous),
                        None => metrics.observe_first_token(now - this.submitted),
                    }
                }
                GenerationEvent::Finished {
                    reason,
                    timings,
                    usage,
                } => {
                    this.ended = true;
                    metrics.observe_finished(*reason, timings, usage);
                }
                GenerationEvent::Failed { .. } => {
                    this.ended = true;
                    metrics.count_rejected("failed");
                }
            }
        }
        polled
    }
}

/// The whole output of a request.
#[derive(Debug, Default)]
pub struct Collected {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub reason: Option<crate::api::FinishReason>,
    pub usage: crate::api::Usage,
}

impl TrackedStream {
    /// Reads events to the end.
    pub async fn collect_all(mut self) -> Result<Collected, ServeError> {
        use futures::StreamExt;
        let mut collected = Collected::default();
        while let Some(event) = self.next().await {
            match event {
                GenerationEvent::Token { token_id, text } => {
                    collected.token_ids.push(token_id);
                    collected.text.push_str(&text);
                }
                GenerationEvent::Finished { reason, usage, .. } => {
                    collected.reason = Some(reason);
                    collected.usage = usage;
                    return Ok(collected);
                }
                GenerationEvent::Failed { message } => return Err(ServeError::Internal(message)),
            }
        }
        Err(ServeError::Internal(
            "the engine ended the request without a result".into(),
        ))
    }
}

/// A request's scheduling priority from its [`FLOW_PRIORITY`] header (HTTP) or metadata
/// (gRPC): 0 when absent, a 400 / INVALID_ARGUMENT naming it when not an integer.
pub fn request_priority(value: Option<&[u8]>) -> Result<i32, ServeError> {
    value.map_or(Ok(0), |value| {
        npufleet_contract::headers::parse_priority(value).map_err(ServeError::bad_request)
    })
}

/// [`request_priority`] of an HTTP request.
pub fn http_priority(headers: &http::HeaderMap) -> Result<i32, ServeError> {
    request_priority(headers.get(FLOW_PRIORITY).map(|v| v.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{LoadSnapshot, ModelInfo, SubmitError};

    /// An engine that accepts nothing: these tests only exercise the server-side plumbing.
    struct NoEngine(ModelInfo);

    impl Engine for NoEngine {
        fn model_info(&self) -> &ModelInfo {
            &self.0
        }
        fn submit(&self, _: GenerateRequest) -> Result<GenerationStream, SubmitError> {
            Err(SubmitError::Draining)
        }
        fn state(&self) -> EngineState {
            EngineState::Ready
        }
        fn load(&self) -> LoadSnapshot {
            LoadSnapshot::default()
        }
        fn begin_drain(&self) {}
        fn failure(&self) -> Option<String> {
            None
        }
        fn apply_chat_template(&self, _: &[ChatMessage]) -> Result<String, SubmitError> {
            Ok(String::new())
        }
        fn tokenize(&self, _: &str) -> Result<Vec<u32>, SubmitError> {
            Ok(Vec::new())
        }
    }

    fn shared(stalled_reader_timeout: Duration) -> Shared {
        let info = ModelInfo {
            name: "m".into(),
            architecture: "llama".into(),
            context_length: 16,
            vocab_size: 8,
            tensor_parallel: 1,
            precision: "int8".into(),
        };
        Shared::new(
            Arc::new(NoEngine(info)),
            "m".into(),
            0,
            stalled_reader_timeout,
        )
    }

    #[tokio::test]
    async fn a_reader_that_stops_taking_chunks_is_given_up_on() {
        let shared = shared(Duration::from_millis(50));
        let (out, mut connection) = mpsc::channel(1);
        assert_eq!(shared.send_chunk(&out, 1).await, Ok(()));
        // The buffer is full and nobody reads: the send gives up after the bound.
        let started = Instant::now();
        assert_eq!(shared.send_chunk(&out, 2).await, Err(ChunkRefused::Stalled));
        assert!(started.elapsed() >= Duration::from_millis(50));
        let rendered = shared.metrics.render(
            &LoadSnapshot::default(),
            EngineState::Ready,
            std::path::Path::new("/nonexistent"),
        );
        assert!(
            rendered.contains("reason=\"stalled_reader\"} 1"),
            "{rendered}"
        );
        // A reader that keeps up is never cut off, and one that left is told apart.
        assert_eq!(connection.recv().await, Some(1));
        assert_eq!(shared.send_chunk(&out, 3).await, Ok(()));
        drop(connection);
        assert_eq!(
            shared.send_chunk(&out, 4).await,
            Err(ChunkRefused::ClientLeft)
        );
    }
}

//! State every surface shares: the engine, metrics, and the shutdown bookkeeping that lets a
//! drain wait for every accepted request to be answered.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Instant;

use futures::Stream;

use crate::api::{Engine, EngineState, GenerateRequest, GenerationEvent, GenerationStream};
use crate::server::error::ServeError;
use crate::server::metrics::Metrics;

pub struct Shared {
    pub engine: Arc<dyn Engine>,
    /// The name clients address the model by.
    pub model_name: String,
    pub metrics: Metrics,
    /// Warm-up iterations the engine was configured with.
    pub warmup_iterations: u32,
    shutting_down: AtomicBool,
    in_flight: AtomicUsize,
    request_counter: AtomicUsize,
}

impl Shared {
    pub fn new(engine: Arc<dyn Engine>, model_name: String, warmup_iterations: u32) -> Self {
        let metrics = Metrics::new(&model_name);
        Shared {
            engine,
            model_name,
            metrics,
            warmup_iterations,
            shutting_down: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            request_counter: AtomicUsize::new(0),
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
    /// counts as in flight until dropped.
    pub fn submit(self: &Arc<Self>, request: GenerateRequest) -> Result<TrackedStream, ServeError> {
        if self.shutting_down.load(Ordering::SeqCst) {
            self.metrics.count_rejected("draining");
            return Err(ServeError::Unavailable(
                "the worker is draining and accepts no new requests".into(),
            ));
        }
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let guard = InFlight(self.clone());
        match self.engine.submit(request) {
            Ok(events) => Ok(TrackedStream {
                events,
                last_token_at: None,
                in_flight: guard,
            }),
            Err(err) => {
                let err = ServeError::from(err);
                self.metrics.count_rejected(err.kind());
                Err(err)
            }
        }
    }
}

struct InFlight(Arc<Shared>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The engine's event stream of one request, observed for metrics.
pub struct TrackedStream {
    events: GenerationStream,
    last_token_at: Option<Instant>,
    in_flight: InFlight,
}

impl Stream for TrackedStream {
    type Item = GenerationEvent;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let polled = this.events.poll_recv(cx);
        if let Poll::Ready(Some(event)) = &polled {
            let metrics = &this.in_flight.0.metrics;
            match event {
                GenerationEvent::Token { .. } => {
                    let now = Instant::now();
                    if let Some(previous) = this.last_token_at.replace(now) {
                        metrics.observe_inter_token(now - previous);
                    }
                }
                GenerationEvent::Finished {
                    reason, timings, ..
                } => metrics.observe_finished(*reason, timings),
                GenerationEvent::Failed { .. } => metrics.count_rejected("failed"),
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

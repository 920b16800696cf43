//! The worker's serving surfaces run in the test's own process, in front of [`EchoEngine`]:
//! tests of the protocols (parsing, status codes, streaming framing, authentication, drain)
//! start in milliseconds and do not depend on a model. What a real model answers is proven
//! by the tests that start the binary.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use npufleet_contract::listener::ConnectionLimits;
use npufleet_contract::proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
use npufleet_worker::api::{
    ChatMessage, Engine, EngineState, FinishReason, GenerateRequest, GenerationEvent,
    GenerationStream, LoadSnapshot, ModelInfo, Prompt, RequestTimings, SubmitError, Usage,
};
use npufleet_worker::server::reasoning::ReasoningParser;
use npufleet_worker::server::{self, Listeners, ServerConfig};
use tokio::sync::{mpsc, oneshot, watch};

use super::MODEL_NAME;

/// Answers each prompt with its own characters, one token each (the id is the character's
/// code point), up to `max_tokens`. While [`EchoEngine::hold`] is on, answers wait for
/// [`EchoEngine::release`], which lets a test keep requests in flight.
pub struct EchoEngine {
    info: ModelInfo,
    queue_limit: usize,
    running: Arc<AtomicUsize>,
    draining: Mutex<bool>,
    gate: watch::Sender<bool>,
}

impl EchoEngine {
    pub fn new(queue_limit: usize) -> EchoEngine {
        EchoEngine {
            info: ModelInfo {
                name: MODEL_NAME.into(),
                architecture: "echo".into(),
                context_length: 4096,
                vocab_size: 0x11_0000,
                tensor_parallel: 1,
                precision: "fp32".into(),
            },
            queue_limit,
            running: Arc::new(AtomicUsize::new(0)),
            draining: Mutex::new(false),
            gate: watch::channel(true).0,
        }
    }

    /// Answers wait until [`EchoEngine::release`].
    pub fn hold(&self) {
        self.gate.send_replace(false);
    }

    pub fn release(&self) {
        self.gate.send_replace(true);
    }

    /// Requests accepted and not yet answered.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }
}

fn echo_events(text: &str, max_tokens: Option<u32>) -> Vec<GenerationEvent> {
    let prompt_tokens = text.chars().count() as u32;
    let limit = max_tokens.unwrap_or(u32::MAX) as usize;
    let mut events: Vec<GenerationEvent> = text
        .chars()
        .take(limit)
        .map(|c| GenerationEvent::Token {
            token_id: c as u32,
            text: c.to_string(),
        })
        .collect();
    let completion_tokens = events.len() as u32;
    events.push(GenerationEvent::Finished {
        reason: if completion_tokens < prompt_tokens {
            FinishReason::Length
        } else {
            FinishReason::Stop
        },
        usage: Usage {
            prompt_tokens,
            completion_tokens,
            cached_prompt_tokens: 0,
        },
        timings: RequestTimings::default(),
    });
    events
}

impl Engine for EchoEngine {
    fn model_info(&self) -> &ModelInfo {
        &self.info
    }

    fn submit(&self, request: GenerateRequest) -> Result<GenerationStream, SubmitError> {
        if *self.draining.lock().unwrap() {
            return Err(SubmitError::Draining);
        }
        if self.running() >= self.queue_limit {
            return Err(SubmitError::QueueFull {
                limit: self.queue_limit,
            });
        }
        let text = match request.prompt {
            Prompt::Text(text) => text,
            Prompt::Tokens(ids) => ids.iter().filter_map(|&id| char::from_u32(id)).collect(),
        };
        let events = echo_events(&text, request.params.max_tokens);
        let (sender, receiver) = mpsc::unbounded_channel();
        let running = self.running.clone();
        running.fetch_add(1, Ordering::SeqCst);
        let mut gate = self.gate.subscribe();
        tokio::spawn(async move {
            let _ = gate.wait_for(|open| *open).await;
            for event in events {
                if sender.send(event).is_err() {
                    break;
                }
            }
            running.fetch_sub(1, Ordering::SeqCst);
        });
        Ok(GenerationStream::new(receiver))
    }

    fn state(&self) -> EngineState {
        match (*self.draining.lock().unwrap(), self.running()) {
            (false, _) => EngineState::Ready,
            (true, 0) => EngineState::Drained,
            (true, _) => EngineState::Draining,
        }
    }

    fn load(&self) -> LoadSnapshot {
        LoadSnapshot {
            running: self.running(),
            queue_limit: self.queue_limit,
            ..LoadSnapshot::default()
        }
    }

    fn begin_drain(&self) {
        *self.draining.lock().unwrap() = true;
    }

    fn failure(&self) -> Option<String> {
        None
    }

    fn apply_chat_template(&self, messages: &[ChatMessage]) -> Result<String, SubmitError> {
        if messages.is_empty() {
            return Err(SubmitError::invalid("messages", "no messages"));
        }
        Ok(messages.iter().map(|m| m.content.as_str()).collect())
    }

    fn tokenize(&self, text: &str) -> Result<Vec<u32>, SubmitError> {
        Ok(text.chars().map(|c| c as u32).collect())
    }
}

/// The server's configuration as `serve`'s defaults give it, for the model [`MODEL_NAME`].
pub fn default_config() -> ServerConfig {
    ServerConfig {
        model_name: MODEL_NAME.into(),
        warmup_iterations: 0,
        drain_timeout: Duration::from_secs(30),
        api_key: None,
        max_body_bytes: 4 << 20,
        max_grpc_message_bytes: 4 << 20,
        stalled_reader_timeout: Duration::from_secs(30),
        http_send_buffer_bytes: 64 << 10,
        connections: ConnectionLimits::default(),
        reasoning_parser: ReasoningParser::Auto,
        kv_events: None,
    }
}

/// The serving surfaces on loopback ports, in this process.
pub struct InProcessWorker {
    pub http: String,
    pub grpc: String,
    pub engine: Arc<EchoEngine>,
    shutdown: Option<oneshot::Sender<()>>,
    served: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl InProcessWorker {
    pub async fn start(config: ServerConfig, engine: EchoEngine) -> InProcessWorker {
        let engine = Arc::new(engine);
        let loopback = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
        let listeners = Listeners::bind(loopback, loopback)
            .await
            .expect("binding loopback listeners");
        let http = format!("http://{}", listeners.http.local_addr().unwrap());
        let grpc = format!("http://{}", listeners.grpc.local_addr().unwrap());
        let (shutdown, shutdown_received) = oneshot::channel();
        let served = tokio::spawn(server::serve(
            config,
            engine.clone(),
            listeners,
            async move {
                let _ = shutdown_received.await;
                Ok("test shutdown")
            },
        ));
        InProcessWorker {
            http,
            grpc,
            engine,
            shutdown: Some(shutdown),
            served: Some(served),
        }
    }

    /// A worker in front of an [`EchoEngine`] with room for 64 requests, and `config`
    /// changed by `change`.
    pub async fn with(change: impl FnOnce(&mut ServerConfig)) -> InProcessWorker {
        let mut config = default_config();
        change(&mut config);
        InProcessWorker::start(config, EchoEngine::new(64)).await
    }

    pub async fn grpc_client(&self) -> GrpcInferenceServiceClient<tonic::transport::Channel> {
        GrpcInferenceServiceClient::connect(self.grpc.clone())
            .await
            .expect("connecting over gRPC")
    }

    /// Sends the shutdown that a SIGTERM sends to the binary.
    pub fn shut_down(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
    }

    /// What `serve` returned.
    pub async fn served(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let served = self.served.take().expect("serve's outcome is taken once");
        tokio::time::timeout(timeout, served)
            .await
            .expect("serve returned within the timeout")
            .expect("the serve task did not panic")
    }
}

impl Drop for InProcessWorker {
    fn drop(&mut self) {
        if let Some(served) = &self.served {
            served.abort();
        }
    }
}

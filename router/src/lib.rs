//! `npufleet-router`: the fleet's front door. One router serves every InferenceService in its
//! scope: it routes OpenAI HTTP, KServe v2 REST and Open Inference Protocol gRPC requests by
//! model name over the ready rank-0 replicas (cache-aware, least-load, prefix-affinity or
//! round-robin, per InferenceService), retries on another replica when one fails before answering, and holds
//! requests for a fleet with no ready replica while it wakes.
//!
//! Where a request goes: [`http`] or [`grpc`] read it into a [`request::RoutedRequest`] and
//! send it through [`retry`] (the attempts) → [`route`] (lookup, [`flow`] control, hold,
//! wake) → [`pool`]
//! (per-replica state) → [`policy`] (the pick, pure) — with [`discovery`] (watches) and
//! [`load`] (the workers' load and cache-event streams, into [`cache_index`]) keeping the view
//! current, and [`prompt`] naming a prompt's blocks as the workers do.

pub mod cache_index;
pub mod discovery;
pub mod error;
pub mod flow;
pub mod grpc;
pub mod http;
pub mod load;
pub mod metrics;
pub mod policy;
pub mod pool;
pub mod prefill;
pub mod prompt;
pub mod request;
pub mod retry;
pub mod route;
pub mod server;

pub use server::{Args, run};

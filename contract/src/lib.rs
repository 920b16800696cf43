//! What npufleet's operator, worker and router agree on, written once: the gRPC protocols, the
//! API-key check, the HCCL rank table (`hccl.json`) schema, ports and their names, the
//! environment variables the operator sets on worker pods, labels and annotations, the
//! router's response headers, the trace context the router passes to the workers, the names
//! of precisions and accelerators, the engines a fleet can run and where each publishes its load, how a prefix-cache block is
//! named, the order in which a worker takes prompts, the worker's and the router's listeners take
//! connections, and how every process logs.
//!
//! A fact that two processes must share lives here, so a drift between them is a compile error
//! rather than a fleet that does not start.

pub mod accelerator;
pub mod annotations;
pub mod auth;
pub mod env;
pub mod headers;
pub mod kv;
pub mod labels;
#[cfg(feature = "serve")]
pub mod listener;
#[cfg(feature = "logging")]
pub mod logging;
#[cfg(feature = "k8s")]
pub mod pods;
pub mod ports;
pub mod precision;
#[cfg(feature = "tokenize")]
pub mod prompt;
#[cfg(feature = "grpc")]
pub mod proto;
pub mod rank_table;
pub mod runtime;
pub mod scheduling;
pub mod trace;

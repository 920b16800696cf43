//! The npufleet inference worker.
//!
//! Layers, each only calling the one below it:
//! `server` (gRPC, HTTP, metrics) → `scheduler` (queue, continuous batching, KV blocks)
//! → `model` (weights, tokenizer, forward pass) → `backend` (kernels) and `collective`
//! (tensor-parallel ring). `api` is the contract between `server` and `scheduler`;
//! `ascend` plugs the NPU runtime in under `backend` and `collective`.

pub mod api;
pub mod ascend;
pub mod backend;
pub mod bench;
pub mod collective;
pub mod fuzz;
pub mod model;
pub mod scheduler;
pub mod server;

//! The npufleet inference worker.
//!
//! Layers, each only calling the one below it:
//! `startup` (the command line of `serve`: picks the accelerator, loads this process's ranks,
//! starts the engine and hands it to the server) → `server` (gRPC, HTTP, metrics) → `engine`
//! (the engine core in token ids: queue, continuous batching, KV blocks, sampling; and each
//! request's stream, which detokenises and applies stop strings) → `model` (weights,
//! tokenizer, forward pass) → `backend` (kernels) and `collective` (tensor-parallel ring).
//! `api` is the contract between `server` and `engine`; `ascend` plugs the NPU runtime in
//! under `backend` and `collective`. `tools` (benchmarks, the Ascend self-test, the
//! test-model generator) sits beside `startup` at the top: it calls the layers, and none of
//! them calls it.

pub mod api;
pub mod ascend;
pub mod backend;
pub mod collective;
pub mod engine;
pub mod fuzz;
pub mod model;
pub mod server;
pub mod startup;
pub mod tools;

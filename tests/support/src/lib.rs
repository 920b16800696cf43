//! Test support shared by every npufleet crate's tests: raw HTTP/1 connections for tests of a
//! server's connection handling, beside the waiting and listening the local platform uses too.

pub mod raw_http;

pub use npufleet_wait::{net, runtime, wait};

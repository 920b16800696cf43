//! Test support shared by every npufleet crate's tests: polling with a deadline (the only way a
//! test waits), free loopback ports, set-up run once on a runtime of its own, and raw HTTP/1
//! connections for tests of a server's connection handling.

pub mod net;
pub mod raw_http;
pub mod runtime;
pub mod wait;

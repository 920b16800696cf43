//! Test support shared by every npufleet crate's tests: polling with a deadline (the only way a
//! test waits), free loopback ports, and set-up run once on a runtime of its own.

pub mod net;
pub mod runtime;
pub mod wait;

//! Test support shared by every npufleet crate's tests: polling with a deadline (the only way a
//! test waits) and free loopback ports.

pub mod net;
pub mod wait;

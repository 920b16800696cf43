//! How the local platform and the tests wait and listen: polling with a deadline (the only way
//! either waits for a process or the cluster), loopback ports that are handed out once, and
//! set-up run once on a runtime of its own.

pub mod net;
pub mod runtime;
pub mod wait;

//! Test support for npufleet: throw-away local Kubernetes control planes built from the
//! upstream binaries, and the paths of the project's own binaries, model and Python clients.
//!
//! A test binary shares one cluster ([`cluster::shared`]) and gives each test its own
//! namespace, so the control plane starts once per binary.

pub mod cluster;
pub mod crd;
pub mod fleet;
pub mod inventory;
pub mod monitoring;
pub mod node_agent;
pub mod operator;
pub mod paths;
pub mod process;

pub use npufleet_test_support::{net, wait};

//! A throw-away local Kubernetes platform for npufleet, built from the upstream binaries:
//! etcd, kube-apiserver, kube-controller-manager, kube-scheduler and KWOK fake nodes
//! ([`cluster`]), the InferenceService CRD ([`crd`]), a node agent that plays the kubelet and
//! runs worker pods as local processes ([`node_agent`]) on a loopback /24 no other local
//! platform holds ([`pod_subnet`]), and the router in front of them ([`router`]); or a real
//! node ([`real_node`]) running this build's images with the chart installed ([`chart`]). `make run`
//! (the `npufleet-local` binary) shows a fleet scaling on it; the end-to-end tests run on it.

pub mod chart;
pub mod cluster;
pub mod crd;
pub mod node_agent;
pub mod paths;
pub mod pod_subnet;
pub mod process;
pub mod real_node;
pub mod router;

pub use npufleet_wait::{net, runtime, wait};

//! Operator-wide settings that shape the objects it makes.

/// The worker image the chart and the Dockerfiles build, tagged with this release.
pub const DEFAULT_WORKER_IMAGE: &str = concat!(
    "ghcr.io/npufleet/npufleet-worker:",
    env!("CARGO_PKG_VERSION")
);

/// Pods one InferenceService may run unless `--max-pods-per-service` says otherwise: 128
/// replica groups of a full 910 node (8 NPUs), far beyond any fleet of one model yet, and
/// small enough that a mistyped `replicas: 1000` cannot flood the cluster.
pub const DEFAULT_MAX_PODS_PER_SERVICE: u32 = 1024;

/// Pods one reconcile creates at most (a group is never split), so a large service shows
/// its progress in status as it is made and the apiserver sees its load grow in steps.
pub const CREATE_BATCH_PODS: u32 = 64;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Worker image used when an InferenceService names none.
    pub worker_image: String,
    /// DNS suffix of the cluster, for the endpoints in status.
    pub cluster_domain: String,
    /// The most pods one InferenceService runs; the replica groups beyond it are not made.
    pub max_pods_per_service: u32,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            worker_image: DEFAULT_WORKER_IMAGE.to_string(),
            cluster_domain: "cluster.local".to_string(),
            max_pods_per_service: DEFAULT_MAX_PODS_PER_SERVICE,
        }
    }
}

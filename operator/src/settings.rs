//! Operator-wide settings that shape the objects it makes.

/// The worker image the chart and the Dockerfiles build, tagged with this release.
pub const DEFAULT_WORKER_IMAGE: &str = concat!(
    "ghcr.io/npufleet/npufleet-worker:",
    env!("CARGO_PKG_VERSION")
);

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Worker image used when an InferenceService names none.
    pub worker_image: String,
    /// DNS suffix of the cluster, for the endpoints in status.
    pub cluster_domain: String,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            worker_image: DEFAULT_WORKER_IMAGE.to_string(),
            cluster_domain: "cluster.local".to_string(),
        }
    }
}

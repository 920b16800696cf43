//! Annotations one npufleet component writes for another to read.

/// On an InferenceService: when a router last held requests for it while it had no ready
/// replica (RFC 3339). The built-in autoscaler wakes a fleet scaled to zero when this is newer
/// than its last scale-down.
pub const WAKE_REQUESTED_AT: &str = "npufleet.io/wake-requested-at";

/// On a worker pod: the name of the container port its engine's Prometheus metrics are on
/// (`http`, `metrics`, or `none` for an engine that publishes none), and their path. The
/// shipped scrape job (`deploy/cce/prometheus-scrape.yaml`) and PodMonitor read them, so every
/// engine is scraped where its metrics are.
pub const METRICS_PORT_NAME: &str = "npufleet.io/metrics-port-name";
pub const METRICS_PATH: &str = "npufleet.io/metrics-path";
/// [`METRICS_PORT_NAME`] of a pod whose engine publishes no metrics.
pub const NO_METRICS_PORT: &str = "none";

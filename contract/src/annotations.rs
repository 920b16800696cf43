//! Annotations one npufleet component writes for another to read.

/// On an InferenceService: when a router last held requests for it while it had no ready
/// replica (RFC 3339). The built-in autoscaler wakes a fleet scaled to zero when this is newer
/// than its last scale-down.
pub const WAKE_REQUESTED_AT: &str = "npufleet.io/wake-requested-at";

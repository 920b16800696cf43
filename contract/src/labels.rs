//! The labels on worker pods that the operator writes and the router and the local platform
//! select on.

/// The InferenceService a worker pod belongs to.
pub const INFERENCE_SERVICE: &str = "npufleet.io/inference-service";
/// The replica group (index) of a worker pod.
pub const GROUP: &str = "npufleet.io/group";
/// A worker pod's rank within its replica group. Rank 0 serves clients; the other ranks only
/// take part in its tensor-parallel steps.
pub const RANK: &str = "npufleet.io/rank";
/// The value of [`RANK`] on the pod that serves a replica group.
pub const SERVING_RANK: &str = "0";
/// Selects the pods that serve clients: one per replica group.
pub const SERVING_PODS: &str = "npufleet.io/rank=0";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_serving_selector_is_the_rank_label_at_the_serving_rank() {
        assert_eq!(SERVING_PODS, format!("{RANK}={SERVING_RANK}"));
    }
}

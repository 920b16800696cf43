//! npufleet's operator: reconciles InferenceServices into groups of Ascend (or CPU) worker pods.

pub mod autoscaler;
pub mod cache;
pub mod controller;
pub mod external_metrics;
pub mod fleet;
pub mod labels;
pub mod leader;
pub mod metrics;
pub mod reconcile;
pub mod resources;
pub mod settings;
pub mod status;

pub use controller::{Context, run};
pub use settings::Settings;

//! Names of the objects made for an InferenceService.

use kube::ResourceExt;
use npufleet_crds::InferenceService;

/// Replica group `group`: also its Volcano PodGroup's name.
pub fn group(isvc: &InferenceService, group: i32) -> String {
    format!("{}-{group}", isvc.name_any())
}

pub fn pod(isvc: &InferenceService, group: i32, rank: i32) -> String {
    format!("{}-{group}-{rank}", isvc.name_any())
}

/// ascend-operator's name for a job's rank table, the job here being one replica group.
pub fn rank_table(isvc: &InferenceService, group: i32) -> String {
    format!("rings-config-{}-{group}", isvc.name_any())
}

/// Rank discovery: `<pod>.<name>-ranks.<namespace>.svc`.
pub fn headless_service(isvc: &InferenceService) -> String {
    format!("{}-ranks", isvc.name_any())
}

pub fn client_service(isvc: &InferenceService) -> String {
    isvc.name_any()
}

pub fn disruption_budget(isvc: &InferenceService) -> String {
    isvc.name_any()
}

use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateTerminated, ContainerStateWaiting, ContainerStatus, Pod,
    PodCondition, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use npufleet_crds::{
    AcceleratorSpec, AcceleratorType, HcclAlgorithm, InferenceService, InferenceServiceSpec,
    ModelFormat, ModelSource, ModelSpec, Platform,
};

use super::{Membership, Observed, count, kept_groups, membership, objects, plan};
use crate::labels;
use crate::resources::{self, pod};
use crate::settings::Settings;
use crate::status;

fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::from_second(1_800_000_000).unwrap())
}

fn service(
    kind: AcceleratorType,
    platform: Platform,
    devices_per_pod: i32,
    tensor: i32,
    replicas: i32,
) -> InferenceService {
    let spec: InferenceServiceSpec = serde_json::from_value(serde_json::json!({
        "model": {"name": "m", "source": {"imagePath": "/models/m.gguf"}},
        "replicas": replicas,
        "accelerator": {"type": kind, "platform": platform, "devicesPerPod": devices_per_pod},
        "parallelism": {"tensor": tensor},
    }))
    .unwrap();
    let mut isvc = InferenceService::new("llm", spec);
    isvc.metadata.namespace = Some("ns".into());
    isvc.metadata.uid = Some("uid-1".into());
    isvc.metadata.generation = Some(3);
    isvc
}

/// The pods a previous reconcile created, given the status the cluster reports for them.
fn running(isvc: &InferenceService, ready: bool) -> Vec<Pod> {
    let first = plan(isvc, &Observed::default(), &Settings::default(), &now());
    first
        .create_pods
        .into_iter()
        .enumerate()
        .map(|(i, p)| with_status(p, "Running", ready, i))
        .collect()
}

fn with_status(mut pod: Pod, phase: &str, ready: bool, index: usize) -> Pod {
    pod.status = Some(PodStatus {
        phase: Some(phase.into()),
        pod_ip: Some(format!("10.244.0.{}", index + 10)),
        host_ip: Some(format!("192.168.0.{}", index + 1)),
        conditions: Some(vec![PodCondition {
            type_: "Ready".into(),
            status: if ready { "True" } else { "False" }.into(),
            ..Default::default()
        }]),
        ..Default::default()
    });
    pod
}

fn condition<'a>(
    s: &'a npufleet_crds::InferenceServiceStatus,
    type_: &str,
) -> &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    s.conditions.iter().find(|c| c.type_ == type_).unwrap()
}

/// The plan for `isvc` with `pods` observed and nothing else.
fn plan_with_pods(isvc: &InferenceService, pods: Vec<Pod>) -> super::Plan {
    plan(
        isvc,
        &Observed {
            pods,
            ..Default::default()
        },
        &Settings::default(),
        &now(),
    )
}

fn names(pods: &[Pod]) -> Vec<String> {
    pods.iter().map(|p| p.name_any()).collect()
}

fn env_value(pod: &Pod, name: &str) -> Option<String> {
    let container = &pod.spec.as_ref().unwrap().containers[0];
    container
        .env
        .as_ref()
        .unwrap()
        .iter()
        .find(|e| e.name == name)
        .and_then(|e| e.value.clone())
}

#[test]
fn a_new_service_creates_every_rank_of_every_group() {
    let isvc = service(AcceleratorType::Ascend910, Platform::Mindcluster, 2, 4, 2);
    let p = plan(&isvc, &Observed::default(), &Settings::default(), &now());
    let names: Vec<String> = p.create_pods.iter().map(|p| p.name_any()).collect();
    assert_eq!(names, ["llm-0-0", "llm-0-1", "llm-1-0", "llm-1-1"]);
    assert_eq!(p.rank_tables.len(), 2);
    assert_eq!(p.rank_tables[0].name_any(), "rings-config-llm-0");
    let table = &p.rank_tables[0].data.as_ref().unwrap()["hccl.json"];
    assert!(table.contains(r#""status":"initializing""#), "{table}");
    let s = &p.status;
    assert_eq!((s.replicas, s.ready_replicas), (0, 0));
    assert_eq!(
        s.selector.as_deref(),
        Some("npufleet.io/inference-service=llm,npufleet.io/rank=0")
    );
    assert_eq!(condition(s, status::READY).status, "False");
    assert_eq!(condition(s, status::PROGRESSING).status, "True");
    assert_eq!(
        condition(s, status::RANK_TABLE_READY).reason,
        "WaitingForRanks"
    );
    assert_eq!(s.observed_generation, Some(3));
    assert_eq!(
        s.endpoints.as_ref().unwrap().grpc,
        "llm.ns.svc.cluster.local:8001"
    );
    assert!(p.notes.iter().all(|n| n.reason == "CreatingGroup"));
}

#[test]
fn ready_pods_make_the_service_ready_and_complete_the_rank_table() {
    let isvc = service(AcceleratorType::Ascend910, Platform::Mindcluster, 2, 4, 1);
    let observed = Observed {
        pods: running(&isvc, true),
        ..Default::default()
    };
    let p = plan(&isvc, &observed, &Settings::default(), &now());
    assert!(p.create_pods.is_empty() && p.delete_pods.is_empty());
    assert_eq!((p.status.replicas, p.status.ready_replicas), (1, 1));
    assert_eq!(condition(&p.status, status::READY).status, "True");
    assert_eq!(
        condition(&p.status, status::PROGRESSING).reason,
        "Converged"
    );
    assert_eq!(
        condition(&p.status, status::RANK_TABLE_READY).status,
        "True"
    );
    let table: serde_json::Value =
        serde_json::from_str(&p.rank_tables[0].data.as_ref().unwrap()["hccl.json"]).unwrap();
    assert_eq!(table["status"], "completed");
    assert_eq!(table["server_count"], "2");
    assert_eq!(table["server_list"][1]["device"][1]["rank_id"], "3");
    assert_eq!(table["server_list"][1]["container_ip"], "10.244.0.11");
    assert_eq!(
        p.status.model_state,
        Some(npufleet_crds::ModelState::Loaded)
    );
}

#[test]
fn a_failed_rank_recreates_its_whole_group_and_degrades_until_ready() {
    let isvc = service(AcceleratorType::Ascend910, Platform::Cce, 2, 4, 2);
    let mut pods = running(&isvc, true);
    let failed = pods.iter_mut().find(|p| p.name_any() == "llm-1-1").unwrap();
    failed.status.as_mut().unwrap().phase = Some("Failed".into());
    let p = plan_with_pods(&isvc, pods.clone());
    let mut deleted = p.delete_pods.clone();
    deleted.sort();
    assert_eq!(deleted, ["llm-1-0", "llm-1-1"], "the healthy peer goes too");
    assert!(
        p.create_pods.is_empty(),
        "new ranks wait until the old ones are gone"
    );
    let degraded = condition(&p.status, status::DEGRADED);
    assert_eq!(
        (degraded.status.as_str(), degraded.reason.as_str()),
        ("True", "RankFailed")
    );
    assert!(degraded.message.contains("llm-1-1"), "{}", degraded.message);
    assert!(
        p.observation
            .failure
            .as_deref()
            .is_some_and(|f| f.contains("llm-1-1"))
    );
    assert_eq!(
        p.status.last_failure, None,
        "written apart from the rest of status, so a later write cannot drop it"
    );
    assert!(
        p.notes
            .iter()
            .any(|n| n.warning && n.reason == "GroupRecreating")
    );
    let table = &p.rank_tables[1].data.as_ref().unwrap()["hccl.json"];
    assert!(
        table.contains("initializing"),
        "the failed group's table is reset: {table}"
    );

    // The group is gone: it is recreated, and Degraded holds while it starts.
    let mut isvc = isvc;
    isvc.status = Some(p.status.clone());
    let survivors: Vec<Pod> = pods
        .into_iter()
        .filter(|p| p.labels()[labels::GROUP] == "0")
        .collect();
    let p = plan_with_pods(&isvc, survivors.clone());
    let created: Vec<String> = p.create_pods.iter().map(|p| p.name_any()).collect();
    assert_eq!(created, ["llm-1-0", "llm-1-1"]);
    assert_eq!(condition(&p.status, status::DEGRADED).status, "True");

    // Once every group is ready again it recovers.
    isvc.status = Some(p.status.clone());
    let all = running(&isvc, true);
    let p = plan_with_pods(&isvc, all);
    assert_eq!(condition(&p.status, status::DEGRADED).status, "False");
    assert_eq!(condition(&p.status, status::READY).status, "True");
    assert_eq!(p.observation.failure, None);
    assert_eq!(p.status.last_failure, None);
}

#[test]
fn a_deleted_rank_takes_its_group_down() {
    let isvc = service(AcceleratorType::Ascend910, Platform::Mindcluster, 1, 2, 1);
    let pods: Vec<Pod> = running(&isvc, true)
        .into_iter()
        .filter(|p| p.name_any() != "llm-0-1")
        .collect();
    let p = plan_with_pods(&isvc, pods);
    assert_eq!(p.delete_pods, ["llm-0-0"]);
    assert!(
        condition(&p.status, status::DEGRADED)
            .message
            .contains("lost rank(s) 1")
    );
}

#[test]
fn terminating_pods_block_recreation() {
    let isvc = service(AcceleratorType::Ascend910, Platform::Mindcluster, 1, 2, 1);
    let pods: Vec<Pod> = running(&isvc, true)
        .into_iter()
        .map(|mut p| {
            p.metadata.deletion_timestamp = Some(now());
            p
        })
        .collect();
    let p = plan_with_pods(&isvc, pods);
    assert!(p.create_pods.is_empty() && p.delete_pods.is_empty());
}

#[test]
fn scaling_follows_spec_replicas_without_writing_it() {
    let mut isvc = service(AcceleratorType::Cpu, Platform::Mindcluster, 1, 1, 3);
    let pods = running(&isvc, true);
    // An autoscaler lowered spec.replicas through the scale subresource.
    isvc.spec.replicas = 1;
    let p = plan_with_pods(&isvc, pods.clone());
    let mut deleted = p.delete_pods.clone();
    deleted.sort();
    assert_eq!(deleted, ["llm-1-0", "llm-2-0"]);
    assert_eq!(
        p.status.replicas, 3,
        "surplus groups count until they are gone"
    );
    // And raised it.
    isvc.spec.replicas = 4;
    let p = plan_with_pods(&isvc, pods);
    assert_eq!(names(&p.create_pods), ["llm-3-0"]);
}

#[test]
fn scale_down_removes_marked_groups_first_and_scale_up_fills_the_lowest_gaps() {
    let groups = |pairs: &[(i32, bool)]| {
        pairs
            .iter()
            .map(|&(g, marked)| {
                let standing = super::Standing {
                    marked,
                    serving: true,
                    ..Default::default()
                };
                (g, standing)
            })
            .collect()
    };
    let unmarked = groups(&[(0, false), (1, false), (2, false), (3, false)]);
    assert_eq!(
        kept_groups(&unmarked, 2).into_iter().collect::<Vec<_>>(),
        [0, 1],
        "without marks the highest-numbered groups go"
    );
    let marked = groups(&[(0, true), (1, false), (2, false), (3, false)]);
    assert_eq!(
        kept_groups(&marked, 2).into_iter().collect::<Vec<_>>(),
        [1, 2]
    );
    let two_marked = groups(&[(0, true), (1, false), (2, true), (3, false)]);
    assert_eq!(
        kept_groups(&two_marked, 3).into_iter().collect::<Vec<_>>(),
        [0, 1, 3],
        "of the marked groups the highest-numbered goes first"
    );
    let gaps = groups(&[(1, false), (4, true)]);
    assert_eq!(
        kept_groups(&gaps, 4).into_iter().collect::<Vec<_>>(),
        [0, 1, 2, 4],
        "marks do not matter when scaling up"
    );
    assert!(kept_groups(&gaps, 0).is_empty());
    assert!(kept_groups(&gaps, -1).is_empty());
    // Unmarked, a group of an older spec goes first, then one that does not serve.
    let standing = |stale, serving| super::Standing {
        marked: false,
        stale,
        serving,
    };
    let mixed = std::collections::BTreeMap::from([
        (0, standing(false, true)),
        (1, standing(true, true)),
        (2, standing(false, false)),
        (3, standing(false, true)),
    ]);
    assert_eq!(
        kept_groups(&mixed, 3).into_iter().collect::<Vec<_>>(),
        [0, 2, 3]
    );
    assert_eq!(
        kept_groups(&mixed, 2).into_iter().collect::<Vec<_>>(),
        [0, 3]
    );

    // Through the plan: the marked group's pods are the ones deleted.
    let mut isvc = service(AcceleratorType::Cpu, Platform::Mindcluster, 1, 1, 3);
    let pods: Vec<Pod> = running(&isvc, true)
        .into_iter()
        .map(|mut p| {
            if p.name_any() == "llm-1-0" {
                p.annotations_mut().insert(
                    crate::fleet::SCALE_DOWN_ANNOTATION.into(),
                    "2026-01-01T00:00:00Z".into(),
                );
            }
            p
        })
        .collect();
    isvc.spec.replicas = 2;
    let p = plan_with_pods(&isvc, pods.clone());
    assert_eq!(p.delete_pods, ["llm-1-0"]);
    assert!(p.create_pods.is_empty());
    // With group 1 gone, scaling back up reuses its number.
    let remaining: Vec<Pod> = pods
        .into_iter()
        .filter(|p| p.name_any() != "llm-1-0")
        .collect();
    isvc.spec.replicas = 3;
    let p = plan_with_pods(&isvc, remaining);
    assert_eq!(names(&p.create_pods), ["llm-1-0"]);
}

#[test]
fn a_changed_spec_surges_a_group_before_replacing_one() {
    let mut isvc = service(AcceleratorType::Cpu, Platform::Mindcluster, 1, 1, 1);
    let pods = running(&isvc, true);
    isvc.spec.engine.max_batch_size = 64;
    let observe = |pods: &[Pod]| Observed {
        pods: pods.to_vec(),
        ..Default::default()
    };
    // The one serving group stays while a group with the new spec is made beside it.
    let p = plan(&isvc, &observe(&pods), &Settings::default(), &now());
    assert!(p.delete_pods.is_empty(), "{:?}", p.delete_pods);
    let surge: Vec<Pod> = p
        .create_pods
        .into_iter()
        .map(|pod| with_status(pod, "Running", false, 1))
        .collect();
    assert_eq!(
        surge.iter().map(|p| p.name_any()).collect::<Vec<_>>(),
        ["llm-1-0"]
    );
    assert_eq!(
        env_value(&surge[0], "NPUFLEET_MAX_BATCH_SIZE").as_deref(),
        Some("64")
    );
    // The old group still serves while the new one starts: Ready and Available hold, and
    // Progressing tells the rollout.
    assert_eq!(p.status.ready_replicas, 1);
    let rolling = |s: &npufleet_crds::InferenceServiceStatus| {
        for type_ in [status::READY, status::AVAILABLE] {
            assert_eq!(condition(s, type_).status, "True", "{type_}");
        }
        let progressing = condition(s, status::PROGRESSING);
        assert_eq!(
            (progressing.status.as_str(), progressing.reason.as_str()),
            ("True", "RollingGroups")
        );
    };
    rolling(&p.status);
    // Not yet ready: the old group is kept.
    let both: Vec<Pod> = pods.iter().cloned().chain(surge.iter().cloned()).collect();
    let p = plan(&isvc, &observe(&both), &Settings::default(), &now());
    assert!(p.delete_pods.is_empty() && p.create_pods.is_empty());
    rolling(&p.status);
    // Ready: the outdated group goes, and nothing new is made.
    let ready: Vec<Pod> = pods
        .iter()
        .cloned()
        .chain(
            surge
                .into_iter()
                .map(|pod| with_status(pod, "Running", true, 1)),
        )
        .collect();
    let p = plan(&isvc, &observe(&ready), &Settings::default(), &now());
    assert_eq!(p.delete_pods, ["llm-0-0"]);
    assert!(p.create_pods.is_empty());
    rolling(&p.status);
    // Once it is gone the rollout is over: one group, with the new spec.
    let p = plan(&isvc, &observe(&ready[1..]), &Settings::default(), &now());
    assert!(p.delete_pods.is_empty() && p.create_pods.is_empty());
    assert_eq!(p.status.ready_replicas, 1);
    assert_eq!(condition(&p.status, status::READY).status, "True");
    assert_eq!(
        condition(&p.status, status::PROGRESSING).reason,
        "Converged"
    );
}

#[test]
fn a_spec_put_back_while_its_surge_group_crash_loops_removes_that_group_at_once() {
    let mut isvc = service(AcceleratorType::Cpu, Platform::Mindcluster, 1, 1, 1);
    let pods = running(&isvc, true);
    let good = isvc.spec.clone();
    isvc.spec.engine.max_batch_size = 64;
    let observe = |pods: &[Pod]| Observed {
        pods: pods.to_vec(),
        ..Default::default()
    };
    let p = plan(&isvc, &observe(&pods), &Settings::default(), &now());
    // The surge group never serves: its worker exits on the new spec.
    let crashing: Vec<Pod> = p
        .create_pods
        .into_iter()
        .map(|pod| with_status(pod, "Running", false, 1))
        .collect();
    let both: Vec<Pod> = pods.iter().cloned().chain(crashing).collect();
    let p = plan(&isvc, &observe(&both), &Settings::default(), &now());
    assert!(p.delete_pods.is_empty(), "the serving group stays");
    // The spec put back: the serving group is current again, and the crash-looping one,
    // now outdated, is deleted without waiting for it to serve.
    isvc.spec = good;
    let p = plan(&isvc, &observe(&both), &Settings::default(), &now());
    assert_eq!(p.delete_pods, ["llm-1-0"]);
    assert!(p.create_pods.is_empty(), "{:?}", names(&p.create_pods));
    assert!(
        p.notes.iter().any(|n| n.reason == "RollingGroup"
            && n.message == "deleting replica group 1: it runs an older spec and does not serve"),
        "{:?}",
        p.notes
    );
    let p = plan(&isvc, &observe(&pods), &Settings::default(), &now());
    assert!(p.delete_pods.is_empty() && p.create_pods.is_empty());
    assert_eq!(
        condition(&p.status, status::PROGRESSING).reason,
        "Converged"
    );
}

#[test]
fn without_surge_a_changed_spec_rolls_one_group_at_a_time() {
    let mut isvc = service(AcceleratorType::Cpu, Platform::Mindcluster, 1, 1, 2);
    isvc.spec.rollout.max_surge = 0;
    isvc.spec.rollout.max_unavailable = 1;
    let pods = running(&isvc, true);
    isvc.spec.engine.max_batch_size = 64;
    let p = plan_with_pods(&isvc, pods.clone());
    assert_eq!(p.delete_pods, ["llm-0-0"]);
    assert!(p.create_pods.is_empty());
    // Both groups served when this reconcile looked; the rollout is in Progressing.
    assert_eq!(condition(&p.status, status::READY).status, "True");
    assert_eq!(
        condition(&p.status, status::PROGRESSING).reason,
        "RollingGroups"
    );
    // While group 0 is replaced, group 1 keeps serving: one short of Ready, and within
    // maxUnavailable, so still Available.
    let rest: Vec<Pod> = pods
        .into_iter()
        .filter(|p| p.name_any() == "llm-1-0")
        .collect();
    let p = plan_with_pods(&isvc, rest);
    assert!(p.delete_pods.is_empty());
    assert_eq!(
        env_value(&p.create_pods[0], "NPUFLEET_MAX_BATCH_SIZE").as_deref(),
        Some("64")
    );
    assert_eq!(condition(&p.status, status::READY).status, "False");
    assert_eq!(condition(&p.status, status::AVAILABLE).status, "True");
}

#[test]
fn replica_and_autoscaling_changes_do_not_roll_pods() {
    let isvc = service(AcceleratorType::Cpu, Platform::Mindcluster, 1, 1, 1);
    let mut scaled = isvc.clone();
    scaled.spec.replicas = 7;
    scaled.spec.autoscaling =
        serde_json::from_value(serde_json::json!({"maxReplicas": 9})).unwrap();
    let settings = Settings::default();
    assert_eq!(
        resources::template_hash(&isvc, &settings),
        resources::template_hash(&scaled, &settings)
    );
}

/// Every change of the spec that changes a worker pod changes the template hash, and no
/// other: a pod that would be built differently is rolled, and a change that shapes no pod
/// rolls none.
#[test]
fn the_template_hash_changes_exactly_when_the_pods_would() {
    let base = service(AcceleratorType::Ascend910, Platform::Mindcluster, 2, 4, 2);
    let changes: Vec<(&str, serde_json::Value)> = vec![
        ("replicas", serde_json::json!({"replicas": 5})),
        (
            "autoscaling",
            serde_json::json!({"autoscaling": {"maxReplicas": 9}}),
        ),
        (
            "routing",
            serde_json::json!({"routing": {"policy": "least-load"}}),
        ),
        (
            "rollout",
            serde_json::json!({"rollout": {"maxSurge": 0, "maxUnavailable": 1}}),
        ),
        (
            "disruptionBudget",
            serde_json::json!({"disruptionBudget": {"maxUnavailable": 2}}),
        ),
        (
            "progressDeadlineSeconds",
            serde_json::json!({"progressDeadlineSeconds": 900}),
        ),
        (
            "model",
            serde_json::json!({"model": {"name": "m", "source": {"imagePath": "/models/n.gguf"}}}),
        ),
        ("engine", serde_json::json!({"engine": {"maxBatchSize": 7}})),
        (
            "scheduling",
            serde_json::json!({"scheduling": {"priorityClassName": "high"}}),
        ),
        (
            "template",
            serde_json::json!({"template": {"env": [{"name": "X", "value": "1"}]}}),
        ),
        (
            "apiKeySecret",
            serde_json::json!({"apiKeySecret": {"name": "keys", "key": "k"}}),
        ),
        (
            "runtime",
            serde_json::json!({"runtime": {"engine": "vllm-ascend"}}),
        ),
        (
            "progressDeadlineSeconds under MindIE",
            serde_json::json!({"runtime": {"engine": "mindie"}, "progressDeadlineSeconds": 900}),
        ),
    ];
    let settings = Settings::default();
    let pod = |isvc: &InferenceService| {
        let mut pod = resources::pod::build(isvc, &settings, 0, 1, "");
        pod.metadata
            .labels
            .as_mut()
            .unwrap()
            .remove(crate::labels::TEMPLATE_HASH);
        pod
    };
    let mindie = {
        let mut isvc = base.clone();
        isvc.spec.runtime =
            serde_json::from_value(serde_json::json!({"engine": "mindie"})).unwrap();
        isvc
    };
    for (field, change) in changes {
        let before = if field.ends_with("under MindIE") {
            &mindie
        } else {
            &base
        };
        let mut spec = serde_json::to_value(&base.spec).unwrap();
        for (key, value) in change.as_object().unwrap() {
            spec[key] = value.clone();
        }
        let mut changed = base.clone();
        changed.spec = serde_json::from_value(spec).unwrap();
        let pods_differ = pod(before) != pod(&changed);
        let hashes_differ = resources::template_hash(before, &settings)
            != resources::template_hash(&changed, &settings);
        assert_eq!(
            hashes_differ, pods_differ,
            "{field}: pods differ {pods_differ}, hashes differ {hashes_differ}"
        );
    }
}

#[test]
fn worker_pods_carry_the_ascend_contract() {
    let mut isvc = service(AcceleratorType::Ascend910, Platform::Mindcluster, 4, 4, 1);
    isvc.spec.parallelism.hccl.algorithm = Some(HcclAlgorithm::Ring);
    isvc.spec.parallelism.hccl.connect_timeout_seconds = Some(600);
    isvc.spec.parallelism.hccl.socket_ifname = Some("eth0".into());
    isvc.spec.accelerator.chip_name = Some("910B3".into());
    let p = plan(&isvc, &Observed::default(), &Settings::default(), &now());
    let pod = &p.create_pods[0];
    let spec = pod.spec.as_ref().unwrap();
    let c = &spec.containers[0];
    assert_eq!(c.args.as_deref(), Some(&["serve".to_string()][..]));
    let limits = c.resources.as_ref().unwrap().limits.as_ref().unwrap();
    assert_eq!(limits["huawei.com/Ascend910"].0, "4");
    assert_eq!(
        c.resources.as_ref().unwrap().requests.as_ref().unwrap()["huawei.com/Ascend910"].0,
        "4"
    );
    for (name, value) in [
        ("HCCL_ALGO", "level0:NA;level1:ring"),
        ("HCCL_CONNECT_TIMEOUT", "600"),
        ("HCCL_SOCKET_IFNAME", "eth0"),
        (
            "RANK_TABLE_FILE",
            "/user/serverid/devindex/config/hccl.json",
        ),
        ("NPUFLEET_MODEL", "/models/m.gguf"),
        ("NPUFLEET_MAX_BATCH_SIZE", "128"),
        ("NPUFLEET_WARMUP_ITERATIONS", "100"),
        ("NPUFLEET_ACCELERATOR", "ascend910"),
        ("NPUFLEET_DRAIN_TIMEOUT", "30"),
    ] {
        assert_eq!(env_value(pod, name).as_deref(), Some(value), "{name}");
    }
    for name in ["HCCL_IF_IP", "POD_IP"] {
        let var = c
            .env
            .as_ref()
            .unwrap()
            .iter()
            .find(|e| e.name == name)
            .unwrap();
        let field = var.value_from.as_ref().unwrap().field_ref.as_ref().unwrap();
        assert_eq!(field.field_path, "status.podIP");
    }
    let selector = spec.node_selector.as_ref().unwrap();
    assert_eq!(selector["accelerator"], "huawei-Ascend910");
    assert_eq!(selector["node.kubernetes.io/npu.chip.name"], "910B3");
    let mount = c
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .find(|m| m.name == "rank-table")
        .unwrap();
    assert_eq!(mount.mount_path, "/user/serverid/devindex/config");
    let volume = spec
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .find(|v| v.name == "rank-table")
        .unwrap();
    assert_eq!(
        volume.config_map.as_ref().unwrap().name,
        "rings-config-llm-0"
    );
    assert_eq!(pod.annotations()["hccl/rankIndex"], "0");
    assert_eq!(pod.labels()["ring-controller.atlas"], "ascend-910");
    assert_eq!(
        spec.restart_policy.as_deref(),
        Some("Always"),
        "a one-pod group restarts in place"
    );
    // Secure by default.
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(
        sc.capabilities.as_ref().unwrap().drop.as_deref(),
        Some(&["ALL".to_string()][..])
    );
    let psc = spec.security_context.as_ref().unwrap();
    assert_eq!(psc.run_as_non_root, Some(true));
    assert_eq!(
        psc.seccomp_profile.as_ref().unwrap().type_,
        "RuntimeDefault"
    );
    assert_eq!(
        c.readiness_probe
            .as_ref()
            .unwrap()
            .http_get
            .as_ref()
            .unwrap()
            .path
            .as_deref(),
        Some("/v2/health/ready")
    );
    assert_eq!(
        c.liveness_probe
            .as_ref()
            .unwrap()
            .http_get
            .as_ref()
            .unwrap()
            .path
            .as_deref(),
        Some("/v2/health/live")
    );
    assert_eq!(spec.termination_grace_period_seconds, Some(35));
    assert!(p.pod_groups.is_empty());
}

#[test]
fn cce_groups_use_volcano_where_it_is_served() {
    let isvc = service(AcceleratorType::Ascend910, Platform::Cce, 2, 4, 2);
    let observed = Observed {
        volcano_served: true,
        pod_groups: vec!["llm-5".into()],
        ..Default::default()
    };
    let p = plan(&isvc, &observed, &Settings::default(), &now());
    let pod = &p.create_pods[0];
    let spec = pod.spec.as_ref().unwrap();
    assert_eq!(spec.scheduler_name.as_deref(), Some("volcano"));
    assert_eq!(
        spec.restart_policy.as_deref(),
        Some("Never"),
        "a rank of a multi-pod group never restarts alone"
    );
    assert_eq!(pod.annotations()["scheduling.k8s.io/group-name"], "llm-0");
    let limits = spec.containers[0]
        .resources
        .as_ref()
        .unwrap()
        .limits
        .as_ref()
        .unwrap();
    assert_eq!(limits["huawei.com/ascend-1980"].0, "2");
    assert_eq!(p.pod_groups.len(), 2);
    assert_eq!(p.pod_groups[0].data["spec"]["minMember"], 2);
    assert_eq!(
        p.pod_groups[0].data["spec"]["minResources"]["huawei.com/ascend-1980"],
        "4"
    );
    assert_eq!(p.delete_pod_groups, ["llm-5"]);

    let without = plan(&isvc, &Observed::default(), &Settings::default(), &now());
    assert!(
        without.pod_groups.is_empty(),
        "no PodGroup where Volcano is not served"
    );
    assert_eq!(
        condition(&without.status, status::PROGRESSING).reason,
        "WaitingForVolcano"
    );
}

#[test]
fn cpu_services_request_no_devices_and_need_no_rank_table() {
    let isvc = service(AcceleratorType::Cpu, Platform::Mindcluster, 1, 1, 1);
    let p = plan(&isvc, &Observed::default(), &Settings::default(), &now());
    let pod = &p.create_pods[0];
    let c = &pod.spec.as_ref().unwrap().containers[0];
    assert!(c.resources.is_none());
    assert!(env_value(pod, "RANK_TABLE_FILE").is_none() && env_value(pod, "HCCL_IF_IP").is_none());
    assert!(p.rank_tables.is_empty());
    assert_eq!(
        condition(&p.status, status::RANK_TABLE_READY).reason,
        "NotRequired"
    );
    assert_eq!(ModelFormat::default(), ModelFormat::Gguf);
}

#[test]
fn user_env_overrides_and_model_sources_resolve() {
    let mut isvc = service(AcceleratorType::Cpu, Platform::Mindcluster, 1, 1, 1);
    isvc.spec.template.env = vec![k8s_openapi::api::core::v1::EnvVar {
        name: "NPUFLEET_PRECISION".into(),
        value: Some("int8".into()),
        value_from: None,
    }];
    isvc.spec.model = ModelSpec {
        name: "m".into(),
        source: ModelSource {
            persistent_volume_claim: Some(npufleet_crds::ClaimModelSource {
                claim_name: "weights".into(),
                path: "a/b.gguf".into(),
            }),
            ..Default::default()
        },
        format: ModelFormat::Gguf,
    };
    let p = plan(&isvc, &Observed::default(), &Settings::default(), &now());
    let pod = &p.create_pods[0];
    assert_eq!(
        env_value(pod, "NPUFLEET_PRECISION").as_deref(),
        Some("int8")
    );
    let count = pod.spec.as_ref().unwrap().containers[0]
        .env
        .as_ref()
        .unwrap()
        .iter()
        .filter(|e| e.name == "NPUFLEET_PRECISION")
        .count();
    assert_eq!(count, 1);
    assert_eq!(
        env_value(pod, "NPUFLEET_MODEL").as_deref(),
        Some("/models/a/b.gguf")
    );
    let volume = pod
        .spec
        .as_ref()
        .unwrap()
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .find(|v| v.name == "model")
        .unwrap();
    assert_eq!(
        volume.persistent_volume_claim.as_ref().unwrap().claim_name,
        "weights"
    );
    assert_eq!(pod::model_path(&isvc), "/models/a/b.gguf");
}

#[test]
fn condition_times_survive_unchanged_conditions() {
    let mut isvc = service(AcceleratorType::Cpu, Platform::Mindcluster, 1, 1, 1);
    let p = plan(&isvc, &Observed::default(), &Settings::default(), &now());
    isvc.status = Some(p.status);
    let later = Time(k8s_openapi::jiff::Timestamp::from_second(1_800_000_100).unwrap());
    let p = plan(&isvc, &Observed::default(), &Settings::default(), &later);
    assert_eq!(
        condition(&p.status, status::READY).last_transition_time,
        now()
    );
    let p = plan(
        &isvc,
        &Observed {
            pods: running(&isvc, true),
            ..Default::default()
        },
        &Settings::default(),
        &later,
    );
    assert_eq!(
        condition(&p.status, status::READY).last_transition_time,
        later
    );
}

#[test]
fn accelerator_spec_helpers_agree_with_the_pod() {
    let spec = AcceleratorSpec {
        kind: AcceleratorType::Ascend310p,
        platform: Platform::Cce,
        devices_per_pod: 1,
        resource_name: None,
        chip_name: None,
    };
    assert_eq!(
        spec.resource_name().as_deref(),
        Some("huawei.com/ascend-310")
    );
}

/// `pods` as the cluster shows them `age_seconds` after their creation, not ready.
fn pending(mut pods: Vec<Pod>, age_seconds: i64) -> Vec<Pod> {
    let created = Time(now().0 - k8s_openapi::jiff::SignedDuration::from_secs(age_seconds));
    for pod in &mut pods {
        pod.metadata.creation_timestamp = Some(created.clone());
        pod.status = Some(PodStatus {
            phase: Some("Pending".into()),
            ..Default::default()
        });
    }
    pods
}

fn unschedulable(pod: &mut Pod, message: &str) {
    pod.status.get_or_insert_with(Default::default).conditions = Some(vec![PodCondition {
        type_: "PodScheduled".into(),
        status: "False".into(),
        reason: Some("Unschedulable".into()),
        message: Some(message.into()),
        ..Default::default()
    }]);
}

#[test]
fn a_waiting_group_names_the_schedulers_reason_and_stalls_after_its_deadline() {
    let mut isvc = service(AcceleratorType::Ascend910, Platform::Mindcluster, 16, 16, 1);
    isvc.spec.progress_deadline_seconds = 60;
    let created = plan(&isvc, &Observed::default(), &Settings::default(), &now()).create_pods;
    let why = "0/4 nodes are available: 4 Insufficient huawei.com/Ascend910.";

    // Within the deadline: Ready says why, and the reconcile comes back at the deadline.
    let mut pods = pending(created.clone(), 20);
    unschedulable(&mut pods[0], why);
    let observed = Observed {
        pods,
        ..Default::default()
    };
    let p = plan(&isvc, &observed, &Settings::default(), &now());
    let ready = condition(&p.status, status::READY);
    assert!(
        ready
            .message
            .contains("pod llm-0-0 Unschedulable: 0/4 nodes"),
        "{}",
        ready.message
    );
    assert_eq!(condition(&p.status, status::PROGRESSING).status, "True");
    assert_eq!(p.recheck_after, Some(std::time::Duration::from_secs(40)));
    assert!(p.create_pods.is_empty() && p.delete_pods.is_empty());

    // Past it: Progressing turns False naming the reason, with a warning about the pod.
    let mut pods = pending(created, 61);
    unschedulable(&mut pods[0], why);
    let observed = Observed {
        pods,
        ..Default::default()
    };
    let p = plan(&isvc, &observed, &Settings::default(), &now());
    let progressing = condition(&p.status, status::PROGRESSING);
    assert_eq!(
        (progressing.status.as_str(), progressing.reason.as_str()),
        ("False", "ProgressDeadlineExceeded")
    );
    assert!(
        progressing.message.contains("(60s)") && progressing.message.contains(why),
        "{}",
        progressing.message
    );
    let note = p
        .notes
        .iter()
        .find(|n| n.reason == "ProgressDeadlineExceeded")
        .unwrap();
    assert!(note.warning);
    assert_eq!(note.related, Some(super::Related::pod("llm-0-0".into())));
    assert_eq!(p.recheck_after, None);
}

/// The Ready condition's message while the one pod of a one-replica service waits with
/// its container in `state`, after `last` if it ran before.
fn ready_message_while_waiting(state: ContainerState, last: Option<ContainerState>) -> String {
    let isvc = service(AcceleratorType::Cpu, Platform::Mindcluster, 1, 1, 1);
    let created = plan(&isvc, &Observed::default(), &Settings::default(), &now()).create_pods;
    let mut pods = pending(created, 5);
    pods[0].status.as_mut().unwrap().container_statuses = Some(vec![ContainerStatus {
        name: "worker".into(),
        state: Some(state),
        last_state: last,
        ..Default::default()
    }]);
    let observed = Observed {
        pods,
        ..Default::default()
    };
    let p = plan(&isvc, &observed, &Settings::default(), &now());
    condition(&p.status, status::READY).message.clone()
}

fn waiting(reason: &str, message: &str) -> ContainerState {
    ContainerState {
        waiting: Some(ContainerStateWaiting {
            reason: Some(reason.into()),
            message: Some(message.into()),
        }),
        ..Default::default()
    }
}

#[test]
fn an_image_that_cannot_be_pulled_is_the_waiting_reason() {
    let message = ready_message_while_waiting(
        waiting(
            "ImagePullBackOff",
            "Back-off pulling image \"registry.example/worker:9\"",
        ),
        None,
    );
    assert!(
        message.contains("pod llm-0-0 container worker ImagePullBackOff: Back-off pulling image"),
        "{message}"
    );
}

/// The container status a kubelet reports for a worker that exited with clap's error for a
/// bad value, under `FallbackToLogsOnError`: the log's tail is the termination message.
fn exited_on_a_bad_flag() -> ContainerStateTerminated {
    ContainerStateTerminated {
        exit_code: 2,
        reason: Some("Error".into()),
        message: Some(
            "{\"level\":\"INFO\",\"message\":\"loading the model\"}\nerror: invalid value 'abc' for '--long-prefill-token-threshold <TOKENS>': invalid digit found in string\n\nFor more information, try '--help'.\n"
                .into(),
        ),
        ..Default::default()
    }
}

#[test]
fn a_container_in_crash_loop_back_off_names_its_last_exit() {
    let last = ContainerState {
        terminated: Some(exited_on_a_bad_flag()),
        ..Default::default()
    };
    let message = ready_message_while_waiting(
        waiting(
            "CrashLoopBackOff",
            "back-off 40s restarting failed container=worker",
        ),
        Some(last),
    );
    assert!(
        message.contains(
            "CrashLoopBackOff: back-off 40s restarting failed container=worker; last exit with code 2 (Error): error: invalid value 'abc' for '--long-prefill-token-threshold <TOKENS>': invalid digit found in string For more information, try '--help'."
        ),
        "{message}"
    );
    assert!(!message.contains("loading the model"), "{message}");
}

#[test]
fn a_failed_rank_names_its_containers_exit() {
    let isvc = service(AcceleratorType::Ascend910, Platform::Cce, 2, 4, 1);
    let mut pods = running(&isvc, true);
    let status = pods[1].status.as_mut().unwrap();
    status.phase = Some("Failed".into());
    status.container_statuses = Some(vec![ContainerStatus {
        name: "worker".into(),
        state: Some(ContainerState {
            terminated: Some(exited_on_a_bad_flag()),
            ..Default::default()
        }),
        ..Default::default()
    }]);
    let p = plan_with_pods(&isvc, pods);
    let degraded = condition(&p.status, status::DEGRADED);
    assert!(
        degraded.message.contains(
            "pod llm-0-1 failed (Failed); container worker exited with code 2 (Error): error: invalid value 'abc'"
        ),
        "{}",
        degraded.message
    );
}

#[test]
fn refused_writes_become_a_replica_failure_condition_until_they_succeed() {
    let isvc = service(AcceleratorType::Cpu, Platform::Mindcluster, 1, 1, 1);
    let p = plan(&isvc, &Observed::default(), &Settings::default(), &now());
    assert!(
        p.status
            .conditions
            .iter()
            .all(|c| c.type_ != status::REPLICA_FAILURE),
        "no condition while every write succeeds"
    );
    let mut seen = p.observation.clone();
    seen.apply_failures = vec![
        "creating Pod llm-0-0: pods \"llm-0-0\" is forbidden: no PriorityClass with name x was found"
            .into(),
    ];
    let with_failure = status::build(&isvc, &Settings::default(), &seen, &now());
    let failure = condition(&with_failure, status::REPLICA_FAILURE);
    assert_eq!(
        (failure.status.as_str(), failure.reason.as_str()),
        ("True", "FailedCreate")
    );
    assert!(failure.message.contains("no PriorityClass with name x"));
    assert!(status::truncate(&"é".repeat(3000), 4096).len() <= 4096);
}

#[test]
fn events_about_groups_name_the_group_so_each_keeps_its_message() {
    let isvc = service(AcceleratorType::Cpu, Platform::Mindcluster, 1, 1, 3);
    let p = plan(&isvc, &Observed::default(), &Settings::default(), &now());
    let related: Vec<(String, String)> = p
        .notes
        .iter()
        .map(|n| {
            let r = n.related.clone().unwrap();
            (r.name, n.message.clone())
        })
        .collect();
    assert_eq!(
        related,
        [
            (
                "llm-0-0".to_string(),
                "creating replica group 0 (1 pods)".to_string()
            ),
            (
                "llm-1-0".to_string(),
                "creating replica group 1 (1 pods)".to_string()
            ),
            (
                "llm-2-0".to_string(),
                "creating replica group 2 (1 pods)".to_string()
            ),
        ]
    );
}

#[test]
fn the_disruption_budget_counts_pods_so_one_eviction_spends_one_group() {
    let mut isvc = service(AcceleratorType::Ascend910, Platform::Mindcluster, 1, 2, 2);
    let budget = resources::services::disruption_budget(&isvc, isvc.spec.replicas);
    let spec = budget.spec.unwrap();
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    assert_eq!(spec.min_available, Some(IntOrString::Int(3)));
    assert_eq!(spec.max_unavailable, None, "no scale-subresource counting");
    assert_eq!(
        spec.unhealthy_pod_eviction_policy.as_deref(),
        Some("AlwaysAllow")
    );
    isvc.spec.disruption_budget.max_unavailable = 2;
    isvc.spec.replicas = 1;
    let spec = resources::services::disruption_budget(&isvc, isvc.spec.replicas)
        .spec
        .unwrap();
    assert_eq!(spec.min_available, Some(IntOrString::Int(0)));
}

#[test]
fn model_like_names_name_every_object_validly() {
    let mut isvc = service(AcceleratorType::Ascend910, Platform::Mindcluster, 1, 2, 1);
    isvc.metadata.name = Some("qwen2.5-0.5b".into());
    let p = plan(&isvc, &Observed::default(), &Settings::default(), &now());
    let base = resources::names::base_of("qwen2.5-0.5b");
    let pod = &p.create_pods[0];
    assert_eq!(pod.name_any(), format!("{base}-0-0"));
    let spec = pod.spec.as_ref().unwrap();
    assert_eq!(
        spec.hostname.as_deref(),
        Some(format!("{base}-0-0").as_str())
    );
    assert_eq!(
        spec.subdomain.as_deref(),
        Some(format!("{base}-ranks").as_str())
    );
    assert_eq!(p.services[1].name_any(), base);
    assert_eq!(
        pod.labels()[labels::INFERENCE_SERVICE],
        "qwen2.5-0.5b",
        "labels keep the InferenceService's own name"
    );
}

#[test]
fn an_endpoint_picker_gets_an_inference_pool_of_the_group_leaders_where_the_api_is_served() {
    let mut isvc = service(AcceleratorType::Cpu, Platform::Mindcluster, 1, 1, 2);
    isvc.spec.routing.endpoint_picker = Some(npufleet_crds::EndpointPicker {
        service: "llm-epp".into(),
        port: 9002,
    });
    let served = Observed {
        inference_pools_served: true,
        ..Default::default()
    };
    let made = plan(&isvc, &served, &Settings::default(), &now());
    let pool = made.inference_pool.expect("an InferencePool");
    assert_eq!(pool.name_any(), "llm");
    assert_eq!(
        pool.data["spec"]["selector"]["matchLabels"],
        serde_json::json!(labels::group_leaders(&isvc))
    );
    assert_eq!(
        pool.data["spec"]["targetPorts"],
        serde_json::json!([{"number": npufleet_contract::ports::HTTP_PORT}])
    );
    assert_eq!(
        pool.data["spec"]["endpointPickerRef"],
        serde_json::json!({"kind": "Service", "name": "llm-epp", "port": {"number": 9002}})
    );
    assert_eq!(made.status.inference_pool.as_deref(), Some("llm"));

    // Without the API: no pool, and a warning saying what to install.
    let missing = plan(&isvc, &Observed::default(), &Settings::default(), &now());
    assert!(missing.inference_pool.is_none());
    let note = missing
        .notes
        .iter()
        .find(|n| n.reason == "InferencePoolNotServed")
        .expect("a warning");
    assert!(note.warning && note.message.contains("inference.networking.k8s.io/v1"));

    // The picker taken out of the spec: the pool the status names goes.
    let mut dropped = isvc.clone();
    dropped.spec.routing.endpoint_picker = None;
    dropped.status = Some(made.status);
    let after = plan(&dropped, &served, &Settings::default(), &now());
    assert!(after.inference_pool.is_none());
    assert_eq!(after.delete_inference_pool.as_deref(), Some("llm"));
    assert_eq!(after.status.inference_pool, None);
}

#[test]
fn worker_pods_leave_a_lost_node_after_the_configured_time_unless_the_user_says_otherwise() {
    let tolerations = |isvc: &InferenceService| {
        let made = plan(isvc, &Observed::default(), &Settings::default(), &now());
        let spec = made.create_pods[0].spec.clone().unwrap();
        spec.tolerations.unwrap_or_default()
    };
    let seconds_for = |list: &[k8s_openapi::api::core::v1::Toleration], key: &str| {
        list.iter()
            .find(|t| t.key.as_deref() == Some(key))
            .map(|t| (t.effect.clone(), t.toleration_seconds))
    };
    let mut isvc = service(AcceleratorType::Cpu, Platform::Mindcluster, 1, 1, 1);
    let default = tolerations(&isvc);
    for key in [
        "node.kubernetes.io/not-ready",
        "node.kubernetes.io/unreachable",
    ] {
        assert_eq!(
            seconds_for(&default, key),
            Some((
                Some("NoExecute".to_string()),
                Some(npufleet_crds::DEFAULT_NODE_LOSS_TOLERATION_SECONDS)
            ))
        );
    }

    isvc.spec.scheduling.node_loss_toleration_seconds = Some(5);
    isvc.spec.scheduling.tolerations = vec![k8s_openapi::api::core::v1::Toleration {
        key: Some("node.kubernetes.io/unreachable".into()),
        operator: Some("Exists".into()),
        effect: Some("NoExecute".into()),
        toleration_seconds: Some(600),
        value: None,
    }];
    let configured = tolerations(&isvc);
    assert_eq!(
        seconds_for(&configured, "node.kubernetes.io/not-ready"),
        Some((Some("NoExecute".to_string()), Some(5)))
    );
    assert_eq!(
        seconds_for(&configured, "node.kubernetes.io/unreachable"),
        Some((Some("NoExecute".to_string()), Some(600))),
        "the user's own toleration wins"
    );
    assert_eq!(configured.len(), 2);
}

#[test]
fn a_pod_evicted_from_a_lost_node_is_removed_at_once_and_others_wait_for_their_kubelet() {
    let isvc = service(AcceleratorType::Cpu, Platform::Mindcluster, 1, 1, 1);
    let mut pods = running(&isvc, true);
    let mut draining = pods[0].clone();
    draining.metadata.deletion_timestamp = Some(now());
    let waiting = plan(
        &isvc,
        &Observed {
            pods: vec![draining.clone()],
            ..Default::default()
        },
        &Settings::default(),
        &now(),
    );
    assert!(waiting.force_delete_pods.is_empty());
    assert!(
        waiting.create_pods.is_empty(),
        "the same name is still taken"
    );

    let conditions = draining
        .status
        .as_mut()
        .unwrap()
        .conditions
        .as_mut()
        .unwrap();
    conditions.push(PodCondition {
        type_: "DisruptionTarget".into(),
        status: "True".into(),
        reason: Some("DeletionByTaintManager".into()),
        ..Default::default()
    });
    pods[0] = draining;
    let lost = plan_with_pods(&isvc, pods);
    assert_eq!(lost.force_delete_pods, vec!["llm-0-0".to_string()]);
    assert_eq!(waiting.recheck_after, Some(super::SETTLING_RECHECK));
    assert!(
        lost.notes
            .iter()
            .any(|n| n.reason == "NodeLost" && n.warning)
    );
}

/// What a cache would show after the plan's objects were applied: each one's kind, name and
/// digest annotation.
fn applied_by(plan: &super::Plan) -> std::collections::BTreeMap<(String, String), String> {
    let digest = |kind: &str, meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
        let name = meta.name.clone().unwrap();
        let value = meta.annotations.as_ref().unwrap()[labels::APPLIED_DIGEST].clone();
        ((kind.to_string(), name), value)
    };
    let mut applied: Vec<_> = plan
        .services
        .iter()
        .map(|s| digest("Service", &s.metadata))
        .collect();
    applied.extend(
        plan.disruption_budget
            .iter()
            .map(|b| digest("PodDisruptionBudget", &b.metadata)),
    );
    applied.extend(
        plan.rank_tables
            .iter()
            .map(|t| digest("ConfigMap", &t.metadata)),
    );
    applied.extend(
        plan.pod_groups
            .iter()
            .map(|g| digest("PodGroup", &g.metadata)),
    );
    applied.into_iter().collect()
}

#[test]
fn objects_applied_unchanged_before_are_not_applied_again() {
    let mut isvc = service(AcceleratorType::Ascend910, Platform::Mindcluster, 2, 4, 2);
    isvc.spec.scheduling.scheduler_name = Some("volcano".into());
    let mut observed = Observed {
        volcano_served: true,
        ..Observed::default()
    };
    let first = plan(&isvc, &observed, &Settings::default(), &now());
    assert_eq!(first.services.len(), 2);
    assert!(first.disruption_budget.is_some());
    assert_eq!(first.rank_tables.len(), 2);
    assert_eq!(first.pod_groups.len(), 2);

    observed.applied = applied_by(&first);
    let again = plan(&isvc, &observed, &Settings::default(), &now());
    assert!(again.services.is_empty(), "{:?}", again.services);
    assert!(again.disruption_budget.is_none());
    assert!(again.rank_tables.is_empty());
    assert!(again.pod_groups.is_empty());

    // A changed budget is applied again, and only it.
    isvc.spec.disruption_budget.max_unavailable = 2;
    let changed = plan(&isvc, &observed, &Settings::default(), &now());
    assert!(changed.disruption_budget.is_some());
    assert!(changed.services.is_empty());

    // An object gone from the cluster (deleted by hand) is applied again.
    observed.applied.retain(|(kind, _), _| kind != "ConfigMap");
    let restored = plan(&isvc, &observed, &Settings::default(), &now());
    assert_eq!(restored.rank_tables.len(), 2);
}

#[test]
fn a_placed_pod_that_is_not_ready_brings_the_reconcile_back_soon() {
    let isvc = service(AcceleratorType::Cpu, Platform::Mindcluster, 1, 1, 1);
    let observe = |pods: Vec<Pod>| plan_with_pods(&isvc, pods);
    assert_eq!(observe(running(&isvc, true)).recheck_after, None);
    let mut not_ready = running(&isvc, false);
    not_ready[0]
        .spec
        .get_or_insert_with(Default::default)
        .node_name = Some("n1".into());
    assert_eq!(
        observe(not_ready.clone()).recheck_after,
        Some(super::SETTLING_RECHECK)
    );
    not_ready[0]
        .spec
        .get_or_insert_with(Default::default)
        .node_name = None;
    assert_eq!(
        observe(not_ready).recheck_after,
        None,
        "an unplaced pod waits for the scheduler and its progress deadline"
    );
}

#[test]
fn a_large_service_is_created_a_batch_at_a_time_and_says_how_far_it_got() {
    let isvc = service(AcceleratorType::Ascend910, Platform::Mindcluster, 1, 8, 20);
    let p = plan(&isvc, &Observed::default(), &Settings::default(), &now());
    // 64 pods a reconcile: 8 groups of 8, never part of a group.
    assert_eq!(p.create_pods.len(), 64);
    assert_eq!(p.notes.len(), 8);
    assert_eq!(p.rank_tables.len(), 8, "no rank table ahead of its group");
    let progressing = condition(&p.status, status::PROGRESSING);
    assert_eq!(progressing.reason, "CreatingGroups");
    assert!(
        progressing
            .message
            .starts_with("8 of 20 replica groups created, 0 ready"),
        "{}",
        progressing.message
    );
    assert_eq!(p.recheck_after, Some(std::time::Duration::ZERO));

    // The next reconcile sees those pods and makes the next batch.
    let pods: Vec<Pod> = p
        .create_pods
        .into_iter()
        .enumerate()
        .map(|(i, p)| with_status(p, "Pending", false, i))
        .collect();
    let observed = Observed {
        pods,
        ..Default::default()
    };
    let next = plan(&isvc, &observed, &Settings::default(), &now());
    assert_eq!(next.create_pods.len(), 64);
    assert_eq!(next.create_pods[0].name_any(), "llm-8-0");
}

#[test]
fn a_group_larger_than_a_batch_is_made_whole() {
    let isvc = service(AcceleratorType::Ascend910, Platform::Mindcluster, 1, 128, 2);
    let p = plan(&isvc, &Observed::default(), &Settings::default(), &now());
    assert_eq!(p.create_pods.len(), 128);
}

#[test]
fn a_service_beyond_the_pod_limit_runs_what_fits_and_says_why() {
    let isvc = service(
        AcceleratorType::Ascend910,
        Platform::Mindcluster,
        1,
        64,
        1000,
    );
    let settings = Settings {
        max_pods_per_service: 256,
        ..Settings::default()
    };
    let p = plan(&isvc, &Observed::default(), &settings, &now());
    assert_eq!(p.create_pods.len(), 64, "one whole group per batch");
    let failure = condition(&p.status, status::REPLICA_FAILURE);
    assert_eq!(
        (failure.status.as_str(), failure.reason.as_str()),
        ("True", status::POD_LIMIT_EXCEEDED)
    );
    assert!(
        failure
            .message
            .contains("1000 replica groups of 64 pods would be 64000 pods")
            && failure.message.contains("at most 256 pods")
            && failure.message.ends_with("so 4 replica groups"),
        "{}",
        failure.message
    );
    assert!(
        condition(&p.status, status::READY)
            .message
            .starts_with("0 of 4 replica groups ready")
    );
    assert!(
        p.notes
            .iter()
            .any(|n| n.warning && n.reason == status::POD_LIMIT_EXCEEDED)
    );
    let budget = p.disruption_budget.unwrap().spec.unwrap();
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    assert_eq!(budget.min_available, Some(IntOrString::Int(255)));
}

/// A TP-2 group whose rank 0 a drain evicted `seconds_ago`.
fn evicted_rank_zero(seconds_ago: i64) -> (InferenceService, Observed) {
    let isvc = service(AcceleratorType::Ascend910, Platform::Mindcluster, 1, 2, 1);
    let mut pods = running(&isvc, true);
    pods.remove(0);
    let at = Time(now().0 - k8s_openapi::jiff::SignedDuration::from_secs(seconds_ago));
    let observed = Observed {
        pods,
        evictions: [(0, at)].into(),
        ..Default::default()
    };
    (isvc, observed)
}

#[test]
fn the_peers_of_an_evicted_rank_are_left_to_the_drain_outside_the_budget() {
    let (isvc, observed) = evicted_rank_zero(2);
    let p = plan(&isvc, &observed, &Settings::default(), &now());
    assert_eq!(p.make_evictable, ["llm-0-1"]);
    assert!(
        p.delete_pods.is_empty(),
        "the drain evicts it: {:?}",
        p.delete_pods
    );
    assert!(p.create_pods.is_empty());
    assert_eq!(p.recheck_after, Some(std::time::Duration::from_secs(18)));
    assert!(p.notes.iter().any(|n| n.reason == "GroupRecreating"));

    // Labelled already: nothing more to do until the drain takes it or the grace ends.
    let mut observed = observed;
    observed.pods[0]
        .labels_mut()
        .insert(labels::EVICTABLE.into(), "true".into());
    let p = plan(&isvc, &observed, &Settings::default(), &now());
    assert!(p.make_evictable.is_empty() && p.delete_pods.is_empty());
    assert!(p.notes.iter().all(|n| n.reason != "GroupRecreating"));

    let budget = resources::services::disruption_budget(&isvc, 1)
        .spec
        .unwrap();
    let exclusions = budget.selector.unwrap().match_expressions.unwrap();
    assert_eq!(exclusions[0].key, labels::EVICTABLE);
    assert_eq!(exclusions[0].operator, "DoesNotExist");
}

#[test]
fn peers_no_drain_evicts_are_deleted_once_the_grace_is_over() {
    let (isvc, observed) = evicted_rank_zero(25);
    let p = plan(&isvc, &observed, &Settings::default(), &now());
    assert!(p.make_evictable.is_empty());
    assert_eq!(p.delete_pods, ["llm-0-1"]);
}

#[test]
fn a_rank_lost_without_an_eviction_has_its_group_recreated_at_once() {
    let (isvc, mut observed) = evicted_rank_zero(2);
    observed.evictions.clear();
    let p = plan(&isvc, &observed, &Settings::default(), &now());
    assert!(p.make_evictable.is_empty());
    assert_eq!(p.delete_pods, ["llm-0-1"]);
}

// The stages on their own.

#[test]
fn the_count_stage_cuts_the_asked_groups_to_the_pod_limit() {
    let isvc = service(AcceleratorType::Ascend910, Platform::Mindcluster, 1, 4, 5);
    let settings = Settings {
        max_pods_per_service: 10,
        ..Settings::default()
    };
    let count = count(&isvc, &settings);
    assert_eq!((count.asked, count.ranks, count.desired), (5, 4, 2));
    let limit = count.pod_limit.unwrap();
    assert!(
        limit.contains("5 replica groups of 4 pods would be 20 pods"),
        "{limit}"
    );
    let within = super::count(&isvc, &Settings::default());
    assert_eq!((within.desired, within.pod_limit), (5, None));
}

#[test]
fn the_membership_stage_keeps_surge_groups_only_while_groups_are_outdated() {
    let isvc = service(AcceleratorType::Cpu, Platform::Mindcluster, 1, 1, 2);
    let hash = resources::template_hash(&isvc, &Settings::default());
    let mut pods = running(&isvc, true);
    let current = crate::fleet::groups(&pods);
    let kept = |m: Membership| (m.kept.into_iter().collect::<Vec<_>>(), m.scaled_down);
    assert_eq!(
        kept(membership(&current, 2, 1, 1, &hash)),
        (vec![0, 1], vec![])
    );
    assert_eq!(
        kept(membership(&current, 1, 1, 1, &hash)),
        (vec![0], vec![1])
    );
    pods[1]
        .labels_mut()
        .insert(labels::TEMPLATE_HASH.into(), "older".into());
    let outdated = crate::fleet::groups(&pods);
    assert_eq!(
        kept(membership(&outdated, 2, 1, 1, &hash)),
        (vec![0, 1, 2], vec![]),
        "one group is made ahead of replacing the outdated one"
    );
    assert_eq!(
        kept(membership(&outdated, 2, 1, 0, &hash)),
        (vec![0, 1], vec![])
    );
}

#[test]
fn the_objects_stage_deletes_what_the_kept_groups_no_longer_need() {
    let isvc = service(AcceleratorType::Ascend910, Platform::Mindcluster, 2, 4, 1);
    let observed = Observed {
        rank_tables: vec!["rings-config-llm-0".into(), "rings-config-llm-1".into()],
        ..Default::default()
    };
    let kept = [0].into_iter().collect();
    let objects = objects(&isvc, &observed, &kept, 1, Vec::new());
    assert_eq!(objects.delete_rank_tables, ["rings-config-llm-1"]);
    assert_eq!(objects.services.len(), 2);
    let budget = objects.disruption_budget.unwrap();
    assert_eq!(
        budget.spec.unwrap().min_available,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(1)),
        "two pods of one group, one may go"
    );
    assert!(objects.inference_pool.is_none() && objects.note.is_none());
}

//! Resource-name presets and node selection for each platform.

use npufleet_crds::{AcceleratorSpec, AcceleratorType, Platform};

fn accelerator(kind: AcceleratorType, platform: Platform) -> AcceleratorSpec {
    AcceleratorSpec {
        kind,
        platform,
        devices_per_pod: 1,
        resource_name: None,
        chip_name: None,
    }
}

#[test]
fn presets_follow_the_device_plugin_of_each_platform() {
    use AcceleratorType::*;
    use Platform::*;
    let cases = [
        (Ascend910, Mindcluster, Some("huawei.com/Ascend910")),
        (Ascend310p, Mindcluster, Some("huawei.com/Ascend310P")),
        (Ascend910, Cce, Some("huawei.com/ascend-1980")),
        (Ascend310p, Cce, Some("huawei.com/ascend-310")),
        (Cpu, Mindcluster, None),
        (Cpu, Cce, None),
    ];
    for (kind, platform, expected) in cases {
        assert_eq!(
            accelerator(kind, platform).resource_name().as_deref(),
            expected,
            "{kind:?} on {platform:?}"
        );
    }
}

#[test]
fn override_wins_over_the_preset() {
    let mut spec = accelerator(AcceleratorType::Ascend910, Platform::Mindcluster);
    spec.resource_name = Some("huawei.com/Ascend910-2c".into());
    assert_eq!(
        spec.resource_name().as_deref(),
        Some("huawei.com/Ascend910-2c")
    );
}

#[test]
fn node_selector_uses_the_real_node_labels() {
    let mut spec = accelerator(AcceleratorType::Ascend910, Platform::Mindcluster);
    spec.chip_name = Some("910B3".into());
    let labels = spec.node_selector();
    assert_eq!(
        labels.get("accelerator").map(String::as_str),
        Some("huawei-Ascend910")
    );
    assert_eq!(
        labels
            .get("node.kubernetes.io/npu.chip.name")
            .map(String::as_str),
        Some("910B3")
    );

    let cce = accelerator(AcceleratorType::Ascend910, Platform::Cce);
    assert!(
        cce.node_selector().is_empty(),
        "CCE nodes carry no MindCluster accelerator label"
    );
    assert!(
        accelerator(AcceleratorType::Cpu, Platform::Mindcluster)
            .node_selector()
            .is_empty()
    );
}

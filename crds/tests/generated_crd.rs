//! The checked-in CRD YAML must be exactly what the types generate.

use std::path::Path;

#[test]
fn checked_in_crds_match_the_types() {
    let expected = npufleet_crds::crd_yaml().expect("the CRD serialises");
    let root =
        Path::new(&std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
            .join("..");
    for dir in ["crds/generated", "charts/npufleet/crds"] {
        let path = root.join(dir).join(npufleet_crds::CRD_FILE);
        let actual = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        assert!(
            actual == expected,
            "{} drifted from the types; run `cargo run -p npufleet-crds --bin npufleet-crdgen`",
            path.display()
        );
    }
}

#[test]
fn scale_subresource_has_all_three_paths() {
    use kube::CustomResourceExt;
    let crd = npufleet_crds::InferenceService::crd();
    let version = &crd.spec.versions[0];
    let scale = version
        .subresources
        .as_ref()
        .and_then(|s| s.scale.as_ref())
        .expect("scale subresource");
    assert_eq!(scale.spec_replicas_path, ".spec.replicas");
    assert_eq!(scale.status_replicas_path, ".status.replicas");
    assert_eq!(
        scale.label_selector_path.as_deref(),
        Some(".status.selector")
    );
    assert_eq!(
        crd.spec.names.short_names.as_deref(),
        Some(&["infsvc".to_string()][..])
    );
}

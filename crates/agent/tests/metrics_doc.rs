//! docs/metrics.md documents every family stowage-agent registers, with its type and label
//! names, and nothing else — including labelled families a run may never give a series.

#[test]
fn the_metrics_reference_matches_the_registry() {
    stowage_testkit::metricsdoc::check("stowage-agent", &stowage_agent::metric_families());
}

/// docs/metrics.md ("Telling nodes apart"): the node, and the rest of where a series comes from,
/// are target labels the scrape adds. A family exporting one of them would clash with the
/// scrape's (`exported_node` under Prometheus' default `honor_labels: false`).
#[test]
fn no_family_exports_a_label_the_scrape_adds() {
    const TARGET_LABELS: [&str; 5] = ["node", "instance", "job", "pod", "namespace"];
    for f in stowage_agent::metric_families() {
        for l in &f.labels {
            assert!(
                !TARGET_LABELS.contains(&l.as_str()),
                "{} exports `{l}`, a label the scrape adds",
                f.name
            );
        }
    }
}

/// The CSI call family has exactly the CSI sidecars' labels, documented under that name.
#[test]
fn the_csi_call_family_is_the_sidecars_one() {
    let name = stowage_loopdriver::csi::metrics::NAME;
    assert_eq!(name, "csi_sidecar_operations_seconds");
    let f = stowage_agent::metric_families()
        .into_iter()
        .find(|f| f.name == name)
        .expect("registered by the agent");
    assert_eq!(f.kind, Some("histogram"));
    assert_eq!(f.labels, ["driver_name", "method_name", "grpc_status_code"]);
    assert!(stowage_testkit::metricsdoc::documented("stowage-agent").contains_key(name));
}

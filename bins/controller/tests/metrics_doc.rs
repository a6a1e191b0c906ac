//! docs/metrics.md documents every family stowage-controller registers, with its type and label
//! names, and nothing else — including labelled families a run may never give a series (a scrape
//! cannot show those, so only the registry can).

#[test]
fn the_metrics_reference_matches_the_registry() {
    stowage_testkit::metricsdoc::check("stowage-controller", &stowage_controller::metric_families());
}

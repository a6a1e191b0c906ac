//! docs/metrics.md documents every family stowage-agent registers, with its type and label
//! names, and nothing else — including labelled families a run may never give a series.

#[test]
fn the_metrics_reference_matches_the_registry() {
    stowage_testkit::metricsdoc::check("stowage-agent", &stowage_agent::metric_families());
}

//! The process-wide Prometheus registry: build info, process metrics, and the helpers every
//! controller uses to register its own families.

use prometheus::{IntGauge, IntGaugeVec, Opts, Registry};

/// A registry with `stowage_build_info` and the process collector already in it.
pub fn registry(binary: &str) -> Registry {
    let registry = Registry::new();
    let info = IntGaugeVec::new(
        Opts::new("stowage_build_info", "Build of this binary; always 1."),
        &["binary", "version"],
    )
    .expect("static metric definition");
    info.with_label_values(&[binary, env!("CARGO_PKG_VERSION")])
        .set(1);
    register(&registry, info);
    register(&registry, crate::events::EVENTS_TOTAL.clone());
    #[cfg(target_os = "linux")]
    registry
        .register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))
        .expect("process metrics are registered once");
    registry
}

/// `stowage_leader`: 1 while this replica holds the lease.
pub fn leader_gauge(registry: &Registry) -> IntGauge {
    let g = IntGauge::new(
        "stowage_leader",
        "1 while this replica holds the leader lease, else 0.",
    )
    .expect("static metric definition");
    register(registry, g.clone());
    g
}

/// Registers a collector; a duplicate name is a programming error caught by every test run.
pub fn register<C: prometheus::core::Collector + Clone + 'static>(registry: &Registry, c: C) -> C {
    registry
        .register(Box::new(c.clone()))
        .expect("metric families are registered once");
    c
}

/// The text exposition of everything in `registry`.
pub fn encode(registry: &Registry) -> String {
    use prometheus::Encoder;
    let mut buf = Vec::new();
    // Encoding into a Vec cannot fail on I/O; a family that fails to encode is skipped by the
    // encoder's own error, which we log rather than fail the scrape.
    if let Err(e) = prometheus::TextEncoder::new().encode(&registry.gather(), &mut buf) {
        tracing::warn!(error = %e, "metrics encoding failed");
    }
    String::from_utf8(buf).unwrap_or_default()
}

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
    crate::queue::FAMILIES.register(&registry);
    crate::clientmetrics::FAMILIES.register(&registry);
    #[cfg(target_os = "linux")]
    registry
        .register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))
        .expect("process metrics are registered once");
    registry
}

/// Leadership as seen by dashboards: `stowage_leader` (1 while this replica holds the lease),
/// client-go's `leader_election_master_status{name}` (the same, under the lease's name, as
/// kube-controller-manager exports it) and `stowage_leader_transitions_total` (times this
/// replica became leader; a rate above zero across replicas means leadership flaps).
#[derive(Clone)]
pub struct Leader {
    ours: IntGauge,
    client_go: IntGauge,
    transitions: prometheus::IntCounter,
}

impl Leader {
    pub fn set(&self, leading: bool) {
        if leading && self.ours.get() == 0 {
            self.transitions.inc();
        }
        self.ours.set(i64::from(leading));
        self.client_go.set(i64::from(leading));
    }
}

/// Registers the leadership metrics for the lease `name`.
pub fn leader_metrics(registry: &Registry, name: &str) -> Leader {
    let ours = IntGauge::new(
        "stowage_leader",
        "1 while this replica holds the leader lease, else 0.",
    )
    .expect("static metric definition");
    let status = IntGaugeVec::new(
        Opts::new(
            "leader_election_master_status",
            "1 while this replica is the leader of the lease `name`, else 0 (client-go's gauge).",
        ),
        &["name"],
    )
    .expect("static metric definition");
    let transitions = prometheus::IntCounter::new(
        "stowage_leader_transitions_total",
        "Times this replica became leader.",
    )
    .expect("static metric definition");
    register(registry, ours.clone());
    register(registry, status.clone());
    register(registry, transitions.clone());
    let client_go = status.with_label_values(&[name]);
    client_go.set(0);
    Leader {
        ours,
        client_go,
        transitions,
    }
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

//! The process-wide Prometheus registry: build info, process metrics, and the helpers every
//! controller uses to register its own families.

use std::sync::{Arc, Mutex};

use prometheus::core::Collector;
use prometheus::proto::{MetricFamily, MetricType};
use prometheus::{IntGauge, IntGaugeVec, Opts};

/// A Prometheus registry that also keeps a description of every family registered in it.
/// `gather` leaves out labelled families that have no series yet (an error counter in a run
/// without errors), so only this list can tell which families a binary exports at all; the
/// metrics reference (docs/metrics.md) is checked against it.
#[derive(Clone, Default)]
pub struct Registry {
    inner: prometheus::Registry,
    described: Arc<Mutex<Vec<Family>>>,
}

/// One registered family as a scrape would show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Family {
    /// As registered: histograms by their base name, counters with their `_total` (if any).
    pub name: String,
    /// `counter`, `gauge`, `histogram`, `summary`, `untyped`; `None` when the collector
    /// described the family but did not collect it at registration (the process collector
    /// when /proc cannot be read).
    pub kind: Option<&'static str>,
    pub help: String,
    /// Variable label names, in registration order.
    pub labels: Vec<String>,
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a collector; a duplicate name is a programming error caught by every test run.
    pub fn register(&self, collector: Box<dyn Collector>) {
        // Collected once now: a vector with no series still yields its (empty) family, which
        // carries the type that `desc()` does not.
        let collected = collector.collect();
        let kind_of = |name: &str| {
            collected
                .iter()
                .find(|f| f.name() == name)
                .map(|f| kind_name(f.get_field_type()))
        };
        let families: Vec<Family> = collector
            .desc()
            .into_iter()
            .map(|d| Family {
                name: d.fq_name.clone(),
                kind: kind_of(&d.fq_name),
                help: d.help.clone(),
                labels: d.variable_labels.clone(),
            })
            .collect();
        self.inner
            .register(collector)
            .expect("metric families are registered once");
        self.described
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(families);
    }

    /// What a scrape shows: families with at least one series.
    pub fn gather(&self) -> Vec<MetricFamily> {
        self.inner.gather()
    }

    /// Every family registered, with or without series, by name.
    pub fn families(&self) -> Vec<Family> {
        let mut all = self.described.lock().unwrap_or_else(|p| p.into_inner()).clone();
        all.sort_by(|a, b| a.name.cmp(&b.name));
        all
    }
}

fn kind_name(t: MetricType) -> &'static str {
    match t {
        MetricType::COUNTER => "counter",
        MetricType::GAUGE => "gauge",
        MetricType::HISTOGRAM => "histogram",
        MetricType::SUMMARY => "summary",
        MetricType::UNTYPED => "untyped",
    }
}

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
    register(&registry, crate::observe::events::EVENTS_TOTAL.clone());
    #[cfg(target_os = "linux")]
    registry.register(Box::new(
        prometheus::process_collector::ProcessCollector::for_self(),
    ));
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
    caches: IntGauge,
}

impl Leader {
    /// Whether this replica's informers hold their first lists (a warm standby's do before it
    /// leads).
    pub fn caches_synced(&self, synced: bool) {
        self.caches.set(i64::from(synced));
    }

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
    let caches = IntGauge::new(
        "stowage_caches_synced",
        "1 while this replica's caches hold their first lists: a warm standby's before it leads, a cold one's only while it leads.",
    )
    .expect("static metric definition");
    register(registry, transitions.clone());
    register(registry, caches.clone());
    let client_go = status.with_label_values(&[name]);
    client_go.set(0);
    Leader {
        ours,
        client_go,
        transitions,
        caches,
    }
}

/// Registers a collector; a duplicate name is a programming error caught by every test run.
pub fn register<C: Collector + Clone + 'static>(registry: &Registry, c: C) -> C {
    registry.register(Box::new(c.clone()));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_include_labelled_ones_without_series() {
        let registry = Registry::new();
        let errors = prometheus::IntCounterVec::new(
            Opts::new("x_errors_total", "Errors by kind."),
            &["kind", "error"],
        )
        .unwrap();
        register(&registry, errors);
        register(&registry, IntGauge::new("x_depth", "Depth.").unwrap());
        // A scrape shows only the unlabelled gauge ...
        let scraped: Vec<String> = registry.gather().iter().map(|f| f.name().to_string()).collect();
        assert_eq!(scraped, ["x_depth"]);
        // ... the registry knows both, with their types and labels.
        assert_eq!(
            registry.families(),
            vec![
                Family {
                    name: "x_depth".into(),
                    kind: Some("gauge"),
                    help: "Depth.".into(),
                    labels: vec![],
                },
                Family {
                    name: "x_errors_total".into(),
                    kind: Some("counter"),
                    help: "Errors by kind.".into(),
                    labels: vec!["kind".into(), "error".into()],
                },
            ]
        );
    }
}

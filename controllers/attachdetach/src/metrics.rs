//! Attach/detach metrics, all prefixed `stowage_attachdetach_`. Inventory gauges (volumes in
//! desired and actual state, detaches waiting for unmount) are computed at scrape time from a
//! snapshot the controller refreshes after each pass, so waiting times stay current between
//! passes.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tokio::time::Instant;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
};
use stowage_common::observe::metrics::{Registry, register};

use crate::core::ForceReason;

/// What the scrape-time gauges are computed from.
#[derive(Debug, Default, Clone)]
pub struct Snapshot {
    /// (state, driver) → volumes; state is `desired_state_of_world` or `actual_state_of_world`.
    pub volumes: BTreeMap<(&'static str, String), i64>,
    /// When each detach now waiting for unmount was first wanted.
    pub waiting_since: Vec<Instant>,
}

#[derive(Clone)]
struct Inventory {
    volumes: IntGaugeVec,
    /// kube-controller-manager's `attachdetach_controller_total_volumes`: the same counts by
    /// `plugin_name` (`kubernetes.io/csi:<driver>`, as KCM names a CSI volume's plugin, and
    /// `kubernetes.io/iscsi` / `kubernetes.io/fc` for those in-tree plugins).
    kcm_volumes: IntGaugeVec,
    waiting: IntGauge,
    longest_wait: Gauge,
    snapshot: Arc<Mutex<Snapshot>>,
}

impl Collector for Inventory {
    fn desc(&self) -> Vec<&Desc> {
        let mut d = self.volumes.desc();
        d.extend(self.kcm_volumes.desc());
        d.extend(self.waiting.desc());
        d.extend(self.longest_wait.desc());
        d
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let snap = self.snapshot.lock().unwrap_or_else(|p| p.into_inner()).clone();
        self.volumes.reset();
        self.kcm_volumes.reset();
        for ((state, driver), n) in &snap.volumes {
            self.volumes.with_label_values(&[state, driver.as_str()]).set(*n);
            let plugin = kcm_plugin(driver);
            self.kcm_volumes
                .with_label_values(&[plugin.as_str(), state])
                .set(*n);
        }
        self.waiting.set(snap.waiting_since.len() as i64);
        let longest = snap
            .waiting_since
            .iter()
            .min()
            .map(|t| t.elapsed().as_secs_f64())
            .unwrap_or(0.0);
        self.longest_wait.set(longest);
        let mut out = self.volumes.collect();
        out.extend(self.kcm_volumes.collect());
        out.extend(self.waiting.collect());
        out.extend(self.longest_wait.collect());
        out
    }
}

/// The plugin name kube-controller-manager labels a volume of `driver` with
/// (`plugin_name`, `volume_plugin`): `kubernetes.io/csi:<driver>` for a CSI driver, the plugin
/// itself for the in-tree iSCSI and FC plugins.
pub fn kcm_plugin(driver: &str) -> String {
    match driver {
        crate::translate::ISCSI_PLUGIN | crate::translate::FC_PLUGIN => driver.to_string(),
        _ => stowage_common::observe::storageops::csi_plugin(driver),
    }
}

/// One attach or detach attempt under KCM's `storage_operation_duration_seconds`.
pub(crate) fn observe_attempt(driver: &str, operation: &str, ok: bool, started: Instant) {
    stowage_common::observe::storageops::observe(
        &kcm_plugin(driver),
        operation,
        ok,
        started.elapsed().as_secs_f64(),
    );
}

#[derive(Clone)]
pub struct Metrics {
    /// Reconciler passes.
    pub reconciles: IntCounter,
    /// Attach steps: the attaches of the volumes pod events touched, decided between passes.
    pub attach_steps: IntCounter,
    /// Time one pass took to decide (the pure reconciler).
    pub reconcile_seconds: Histogram,
    /// Failed operations started by the reconciler, by operation and error category.
    pub reconcile_errors: IntCounterVec,
    /// API operations by operation (`attach`, `detach`, `node_status`) and result.
    pub operations: IntCounterVec,
    /// Time of one API operation, by operation.
    pub operation_seconds: HistogramVec,
    /// A pod's watch event received → its VolumeAttachment's create request sent: the
    /// controller's own share of an attach's latency (the create itself is `operation_seconds`).
    pub attach_decision_seconds: Histogram,
    /// Attach requested (VolumeAttachment created) → attached, end to end.
    pub attach_seconds: Histogram,
    /// Detach started → VolumeAttachment gone, end to end.
    pub detach_seconds: Histogram,
    /// Detaches that went ahead although the node still used the volume, by reason.
    forced_detaches: IntCounterVec,
    /// The same count under kube-controller-manager's name and label.
    kcm_forced_detaches: IntCounterVec,
    /// How long detaches waited for the node to unmount before they went ahead.
    pub unmount_wait_seconds: Histogram,
    /// Multi-attach events sent.
    pub multi_attach_errors: IntCounter,
    /// Operations waiting for a slot or in flight, by queue (`attach`, `detach`).
    pub queue_depth: IntGaugeVec,
    snapshot: Arc<Mutex<Snapshot>>,
}

impl Metrics {
    /// Registers every family in `registry`; call once per process (per registry).
    pub fn new(registry: &Registry) -> Self {
        let op_buckets = prometheus::exponential_buckets(0.001, 2.0, 16).expect("static buckets");
        let e2e_buckets = prometheus::exponential_buckets(0.05, 2.0, 16).expect("static buckets");
        let inventory = Inventory {
            volumes: IntGaugeVec::new(
                Opts::new(
                    "stowage_attachdetach_volumes",
                    "Volumes (volume, node pairs) in desired and actual state, by state and driver.",
                ),
                &["state", "driver"],
            )
            .expect("static metric definition"),
            kcm_volumes: IntGaugeVec::new(
                Opts::new(
                    "attachdetach_controller_total_volumes",
                    "Volumes (volume, node pairs) in desired and actual state, by plugin (KCM's gauge).",
                ),
                &["plugin_name", "state"],
            )
            .expect("static metric definition"),
            waiting: IntGauge::new(
                "stowage_attachdetach_detaches_waiting_for_unmount",
                "Detaches held back because the node still uses the volume.",
            )
            .expect("static metric definition"),
            longest_wait: Gauge::new(
                "stowage_attachdetach_longest_unmount_wait_seconds",
                "How long the oldest detach now waiting for unmount has waited.",
            )
            .expect("static metric definition"),
            snapshot: Arc::new(Mutex::new(Snapshot::default())),
        };
        let m = Self {
            reconciles: IntCounter::new("stowage_attachdetach_reconcile_total", "Reconciler passes.")
                .expect("static metric definition"),
            attach_steps: IntCounter::new(
                "stowage_attachdetach_attach_steps_total",
                "Attach steps: the attaches of the volumes that pod events touched, decided between full passes.",
            )
            .expect("static metric definition"),
            reconcile_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "stowage_attachdetach_reconcile_duration_seconds",
                    "Time one reconciler pass took to decide.",
                )
                .buckets(prometheus::exponential_buckets(1e-5, 4.0, 10).expect("static buckets")),
            )
            .expect("static metric definition"),
            reconcile_errors: IntCounterVec::new(
                Opts::new(
                    "stowage_attachdetach_reconcile_errors_total",
                    "Operations started by the reconciler that failed, by operation and error category.",
                ),
                &["operation", "error"],
            )
            .expect("static metric definition"),
            operations: IntCounterVec::new(
                Opts::new(
                    "stowage_attachdetach_operations_total",
                    "API operations by operation (attach, detach, node_status) and result.",
                ),
                &["operation", "result"],
            )
            .expect("static metric definition"),
            operation_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "stowage_attachdetach_operation_duration_seconds",
                    "Time of one API operation (VolumeAttachment create/delete, node status patch).",
                )
                .buckets(op_buckets),
                &["operation"],
            )
            .expect("static metric definition"),
            attach_decision_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "stowage_attachdetach_attach_decision_seconds",
                    "A pod's watch event received to its VolumeAttachment's create request sent (the controller's share of an attach).",
                )
                .buckets(prometheus::exponential_buckets(0.000_25, 2.0, 14).expect("static buckets")),
            )
            .expect("static metric definition"),
            attach_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "stowage_attachdetach_attach_duration_seconds",
                    "VolumeAttachment created to status.attached, end to end.",
                )
                .buckets(e2e_buckets.clone()),
            )
            .expect("static metric definition"),
            detach_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "stowage_attachdetach_detach_duration_seconds",
                    "Detach started to VolumeAttachment gone, end to end.",
                )
                .buckets(e2e_buckets.clone()),
            )
            .expect("static metric definition"),
            forced_detaches: IntCounterVec::new(
                Opts::new(
                    "stowage_attachdetach_forced_detaches_total",
                    "Detaches of volumes the node still used, by reason (timeout, out-of-service, node-deleted).",
                ),
                &["reason"],
            )
            .expect("static metric definition"),
            // KCM registers its counter under subsystem `attach_detach_controller` with a name
            // that already starts with `attachdetach_controller`, hence the doubled prefix, and
            // without `_total`; dashboards query exactly that name.
            kcm_forced_detaches: IntCounterVec::new(
                Opts::new(
                    "attach_detach_controller_attachdetach_controller_forced_detaches",
                    "Forced detaches by reason (KCM's counter; same count as stowage_attachdetach_forced_detaches_total).",
                ),
                &["reason"],
            )
            .expect("static metric definition"),
            unmount_wait_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "stowage_attachdetach_unmount_wait_seconds",
                    "Time from a detach first wanted to the detach going ahead.",
                )
                .buckets(e2e_buckets),
            )
            .expect("static metric definition"),
            multi_attach_errors: IntCounter::new(
                "stowage_attachdetach_multi_attach_errors_total",
                "Multi-Attach events: a single-node volume wanted on a node while attached to another.",
            )
            .expect("static metric definition"),
            queue_depth: IntGaugeVec::new(
                Opts::new(
                    "stowage_attachdetach_queue_depth",
                    "Operations waiting for a slot or in flight, by queue (attach, detach).",
                ),
                &["queue"],
            )
            .expect("static metric definition"),
            snapshot: inventory.snapshot.clone(),
        };
        register(registry, m.reconciles.clone());
        register(registry, m.attach_steps.clone());
        register(registry, m.reconcile_seconds.clone());
        register(registry, m.reconcile_errors.clone());
        register(registry, m.operations.clone());
        register(registry, m.operation_seconds.clone());
        register(registry, m.attach_decision_seconds.clone());
        register(registry, m.attach_seconds.clone());
        register(registry, m.detach_seconds.clone());
        register(registry, m.forced_detaches.clone());
        register(registry, m.kcm_forced_detaches.clone());
        register(registry, m.unmount_wait_seconds.clone());
        register(registry, m.multi_attach_errors.clone());
        register(registry, m.queue_depth.clone());
        register(registry, inventory);
        for q in ["attach", "detach"] {
            m.queue_depth.with_label_values(&[q]).set(0);
        }
        m
    }

    /// Counts a detach that did not wait for the node to unmount, under both names. KCM knows
    /// two reasons: a deleted Node's detach is forced by the same timeout there.
    pub fn forced_detach(&self, reason: ForceReason) {
        self.forced_detaches.with_label_values(&[reason.label()]).inc();
        let kcm = match reason {
            ForceReason::OutOfService => "out-of-service",
            ForceReason::Timeout | ForceReason::NodeDeleted => "timeout",
        };
        self.kcm_forced_detaches.with_label_values(&[kcm]).inc();
    }

    /// Replaces the snapshot the scrape-time gauges read.
    pub fn set_snapshot(&self, snap: Snapshot) {
        *self.snapshot.lock().unwrap_or_else(|p| p.into_inner()) = snap;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn inventory_is_computed_at_scrape_time() {
        let registry = Registry::new();
        let m = Metrics::new(&registry);
        let mut snap = Snapshot::default();
        snap.volumes.insert(("desired_state_of_world", "d".into()), 3);
        snap.volumes
            .insert(("actual_state_of_world", "kubernetes.io/iscsi".into()), 1);
        snap.waiting_since.push(Instant::now() - Duration::from_secs(5));
        m.set_snapshot(snap);
        let text = stowage_common::observe::metrics::encode(&registry);
        assert!(
            text.contains("stowage_attachdetach_volumes{driver=\"d\",state=\"desired_state_of_world\"} 3"),
            "{text}"
        );
        assert!(
            text.contains(
                "attachdetach_controller_total_volumes{plugin_name=\"kubernetes.io/csi:d\",state=\"desired_state_of_world\"} 3"
            ),
            "{text}"
        );
        // In-tree plugins are named as upstream names them, without the CSI prefix.
        assert!(
            text.contains(
                "attachdetach_controller_total_volumes{plugin_name=\"kubernetes.io/iscsi\",state=\"actual_state_of_world\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("stowage_attachdetach_detaches_waiting_for_unmount 1"),
            "{text}"
        );
        m.forced_detach(ForceReason::OutOfService);
        m.forced_detach(ForceReason::NodeDeleted);
        let text = stowage_common::observe::metrics::encode(&registry);
        for line in [
            "stowage_attachdetach_forced_detaches_total{reason=\"out-of-service\"} 1",
            "stowage_attachdetach_forced_detaches_total{reason=\"node-deleted\"} 1",
            "attach_detach_controller_attachdetach_controller_forced_detaches{reason=\"out-of-service\"} 1",
            "attach_detach_controller_attachdetach_controller_forced_detaches{reason=\"timeout\"} 1",
        ] {
            assert!(text.contains(line), "{line} missing from {text}");
        }
        let line = text
            .lines()
            .find(|l| l.starts_with("stowage_attachdetach_longest_unmount_wait_seconds "))
            .unwrap();
        let v: f64 = line.split(' ').nth(1).unwrap().parse().unwrap();
        assert!(v >= 5.0, "{line}");
    }
}

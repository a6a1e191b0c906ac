//! kube-controller-manager's volume operation families, under its names, label names, label
//! values and buckets, so a dashboard built on KCM reads the same series from stowage:
//!
//! - `storage_operation_duration_seconds{volume_plugin, operation_name, status, migrated}`: one
//!   attempt of an operation (attach, detach, expand, and the built-in driver's provision and
//!   delete), `status` `success` or `fail-unknown`.
//! - `volume_operation_total_seconds{plugin_name, operation_name}`: the binder's end-to-end
//!   `provision` (first attempt → claim Bound) and `delete` (deletion started → PV gone).
//! - `volume_operation_errors_total` and, as KCM before v1.36 named it (v1.36 hides it),
//!   `volume_operation_total_errors`, both `{plugin_name, operation_name}`: failed attempts of
//!   those end-to-end operations.
//!
//! The families are process-wide (several controllers observe them); `register_metrics` exposes
//! them in the controller's registry.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};
use std::time::Instant;

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts};

/// `operation_name` values, as KCM's operation generators and PV controller write them.
pub const VOLUME_ATTACH: &str = "volume_attach";
pub const VOLUME_DETACH: &str = "volume_detach";
pub const EXPAND_VOLUME: &str = "expand_volume";
pub const VOLUME_PROVISION: &str = "volume_provision";
pub const VOLUME_DELETE: &str = "volume_delete";
/// The PV controller's end-to-end operations (`volume_operation_total_seconds`).
pub const PROVISION: &str = "provision";
pub const DELETE: &str = "delete";

/// `status` values.
pub const STATUS_SUCCESS: &str = "success";
pub const STATUS_FAIL: &str = "fail-unknown";

/// KCM's `plugin_name` when the provisioner of a volume cannot be told (no class).
pub const NOT_AVAILABLE: &str = "N/A";

/// KCM's buckets for both duration histograms, in seconds.
pub const BUCKETS: [f64; 13] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 25.0, 50.0, 120.0, 300.0, 600.0,
];

/// The `volume_plugin` KCM gives an operation on a volume of CSI driver `driver`: the CSI
/// plugin's name qualified with the driver, as it names every CSI volume's plugin.
pub fn csi_plugin(driver: &str) -> String {
    format!("kubernetes.io/csi:{driver}")
}

struct Families {
    duration: HistogramVec,
    total_seconds: HistogramVec,
    errors: IntCounterVec,
    errors_old: IntCounterVec,
}

static FAMILIES: LazyLock<Families> = LazyLock::new(|| {
    let histogram = |name: &str, help: &str, labels: &[&str]| {
        HistogramVec::new(HistogramOpts::new(name, help).buckets(BUCKETS.to_vec()), labels)
            .expect("static metric definition")
    };
    let counter = |name: &str, help: &str| {
        IntCounterVec::new(Opts::new(name, help), &["plugin_name", "operation_name"])
            .expect("static metric definition")
    };
    Families {
        duration: histogram(
            "storage_operation_duration_seconds",
            "Storage operation duration (one attempt), by plugin, operation and status.",
            &["volume_plugin", "operation_name", "status", "migrated"],
        ),
        total_seconds: histogram(
            "volume_operation_total_seconds",
            "Storage operation end to end duration in seconds (provision: first attempt to claim Bound; delete: start to volume gone).",
            &["plugin_name", "operation_name"],
        ),
        errors: counter(
            "volume_operation_errors_total",
            "Failed attempts of end-to-end provision and delete operations.",
        ),
        errors_old: counter(
            "volume_operation_total_errors",
            "Failed attempts of end-to-end provision and delete operations (KCM's name before v1.36).",
        ),
    }
});

/// Registers the families (the controller binary only: the agent observes none of them).
pub fn register_metrics(registry: &crate::observe::metrics::Registry) {
    use crate::observe::metrics::register;
    let f = &*FAMILIES;
    register(registry, f.duration.clone());
    register(registry, f.total_seconds.clone());
    register(registry, f.errors.clone());
    register(registry, f.errors_old.clone());
}

/// One attempt of `operation` on a volume of `plugin` took `seconds`. stowage handles no
/// migrated in-tree volume in these operations, so `migrated` is always `false`.
pub fn observe(plugin: &str, operation: &str, ok: bool, seconds: f64) {
    let status = if ok { STATUS_SUCCESS } else { STATUS_FAIL };
    FAMILIES
        .duration
        .with_label_values(&[plugin, operation, status, "false"])
        .observe(seconds);
}

/// Times one attempt: observes `fail-unknown` when dropped unless [`Attempt::succeeded`] was
/// called, so every early return of a failed attempt is counted.
pub struct Attempt {
    plugin: String,
    operation: &'static str,
    started: Instant,
    done: bool,
}

impl Attempt {
    pub fn start(plugin: impl Into<String>, operation: &'static str) -> Self {
        Self {
            plugin: plugin.into(),
            operation,
            started: Instant::now(),
            done: false,
        }
    }

    pub fn succeeded(mut self) {
        self.finish(true);
    }

    fn finish(&mut self, ok: bool) {
        if !self.done {
            self.done = true;
            observe(
                &self.plugin,
                self.operation,
                ok,
                self.started.elapsed().as_secs_f64(),
            );
        }
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        self.finish(false);
    }
}

fn plugin_or_na(plugin: &str) -> &str {
    if plugin.is_empty() { NOT_AVAILABLE } else { plugin }
}

/// A failed attempt of an end-to-end operation: both error counters, as KCM v1.36 counts both
/// names (the old one hidden by default there).
pub fn count_error(plugin: &str, operation: &str) {
    let labels = [plugin_or_na(plugin), operation];
    FAMILIES.errors.with_label_values(&labels).inc();
    FAMILIES.errors_old.with_label_values(&labels).inc();
}

struct Started {
    plugin: String,
    operation: &'static str,
    at: Instant,
}

/// When each end-to-end operation began, by object key (a claim's `namespace/name` for
/// `provision`, a PV's name for `delete`), as KCM's PV controller keeps them: the first start
/// is kept while attempts fail, a success observes the whole span and forgets the key.
#[derive(Default)]
pub struct Timestamps {
    started: Mutex<HashMap<String, Started>>,
}

impl Timestamps {
    /// Starts timing `key` unless it is timed already.
    pub fn start(&self, key: &str, plugin: &str, operation: &'static str) {
        let mut m = self.started.lock().unwrap_or_else(|p| p.into_inner());
        if !m.contains_key(key) {
            m.insert(
                key.to_string(),
                Started {
                    plugin: plugin_or_na(plugin).to_string(),
                    operation,
                    at: Instant::now(),
                },
            );
        }
    }

    /// An attempt of the operation timed under `key` failed: counted, the start kept.
    pub fn failed(&self, key: &str) {
        let m = self.started.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = m.get(key) {
            count_error(&s.plugin, s.operation);
        }
    }

    /// The operation timed under `key` finished: its whole span is observed.
    pub fn finished(&self, key: &str) {
        let s = self.started.lock().unwrap_or_else(|p| p.into_inner()).remove(key);
        if let Some(s) = s {
            FAMILIES
                .total_seconds
                .with_label_values(&[s.plugin.as_str(), s.operation])
                .observe(s.at.elapsed().as_secs_f64());
        }
    }

    /// Stops timing `key` without an observation (its object went away unfinished).
    pub fn forget(&self, key: &str) {
        self.started.lock().unwrap_or_else(|p| p.into_inner()).remove(key);
    }

    pub fn is_timed(&self, key: &str) -> bool {
        self.started
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::core::Metric;

    fn duration_count(plugin: &str, op: &str, status: &str) -> u64 {
        FAMILIES
            .duration
            .with_label_values(&[plugin, op, status, "false"])
            .get_sample_count()
    }

    #[test]
    fn names_labels_and_buckets_are_kube_controller_managers() {
        let registry = crate::observe::metrics::Registry::new();
        register_metrics(&registry);
        let got: Vec<(String, Option<&str>, Vec<String>)> = registry
            .families()
            .into_iter()
            .map(|f| (f.name, f.kind, f.labels))
            .collect();
        let labels = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            got,
            vec![
                (
                    "storage_operation_duration_seconds".into(),
                    Some("histogram"),
                    labels(&["volume_plugin", "operation_name", "status", "migrated"])
                ),
                (
                    "volume_operation_errors_total".into(),
                    Some("counter"),
                    labels(&["plugin_name", "operation_name"])
                ),
                (
                    "volume_operation_total_errors".into(),
                    Some("counter"),
                    labels(&["plugin_name", "operation_name"])
                ),
                (
                    "volume_operation_total_seconds".into(),
                    Some("histogram"),
                    labels(&["plugin_name", "operation_name"])
                ),
            ]
        );
        observe("test-buckets", VOLUME_ATTACH, true, 0.2);
        let h =
            FAMILIES
                .duration
                .with_label_values(&["test-buckets", VOLUME_ATTACH, STATUS_SUCCESS, "false"]);
        let upper: Vec<f64> = h
            .metric()
            .get_histogram()
            .get_bucket()
            .iter()
            .map(|b| b.upper_bound())
            .collect();
        assert_eq!(upper, BUCKETS.to_vec());
    }

    #[test]
    fn label_values() {
        assert_eq!(
            csi_plugin("loop.stowage.dev"),
            "kubernetes.io/csi:loop.stowage.dev"
        );
        let p = csi_plugin("test-label-values");
        observe(&p, VOLUME_DETACH, true, 1.0);
        observe(&p, VOLUME_DETACH, false, 1.0);
        assert_eq!(duration_count(&p, "volume_detach", "success"), 1);
        assert_eq!(duration_count(&p, "volume_detach", "fail-unknown"), 1);
    }

    #[test]
    fn an_attempt_dropped_without_success_is_a_failure() {
        let p = "test-attempt";
        drop(Attempt::start(p, EXPAND_VOLUME));
        Attempt::start(p, EXPAND_VOLUME).succeeded();
        assert_eq!(duration_count(p, EXPAND_VOLUME, STATUS_FAIL), 1);
        assert_eq!(duration_count(p, EXPAND_VOLUME, STATUS_SUCCESS), 1);
    }

    #[test]
    fn timestamps_keep_the_first_start_count_failures_and_observe_once() {
        let t = Timestamps::default();
        let total = || {
            FAMILIES
                .total_seconds
                .with_label_values(&["test-ts", "provision"])
                .get_sample_count()
        };
        let errors = |f: &IntCounterVec| f.with_label_values(&["test-ts", "provision"]).get();
        t.failed("ns/c"); // not timed: nothing counted
        t.start("ns/c", "test-ts", PROVISION);
        t.start("ns/c", "other", DELETE); // already timed: the first start stays
        t.failed("ns/c");
        t.failed("ns/c");
        assert_eq!(errors(&FAMILIES.errors), 2);
        assert_eq!(errors(&FAMILIES.errors_old), 2);
        assert!(t.is_timed("ns/c"));
        t.finished("ns/c");
        t.finished("ns/c");
        assert_eq!(total(), 1);
        assert!(!t.is_timed("ns/c"));
        // No provisioner known: KCM's N/A.
        t.start("ns/d", "", DELETE);
        t.failed("ns/d");
        assert_eq!(FAMILIES.errors.with_label_values(&["N/A", "delete"]).get(), 1);
        t.forget("ns/d");
        t.finished("ns/d");
        assert_eq!(
            FAMILIES
                .total_seconds
                .with_label_values(&["N/A", "delete"])
                .get_sample_count(),
            0
        );
    }
}

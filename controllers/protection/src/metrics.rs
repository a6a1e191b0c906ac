//! Metrics of both protection controllers, prefix `stowage_protection_`. See docs/protection.md.

use std::fmt::Debug;

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts};
use stowage_common::errors::MetricLabel;
use stowage_common::observe::metrics::{Registry, register};
use stowage_common::runtime::driver::Retry;

use crate::error::Error;

/// Label values of `kind`.
pub const PVC: &str = "PersistentVolumeClaim";
pub const PV: &str = "PersistentVolume";
/// Label values of `controller`.
pub const PVC_CONTROLLER: &str = "pvc-protection";
pub const PV_CONTROLLER: &str = "pv-protection";

/// Cheap to clone (every field is a handle). Create once per registry: a second `new` on the same
/// registry panics on the duplicate names.
#[derive(Clone)]
pub struct Metrics {
    pub finalizers_added: IntCounterVec,
    pub finalizers_removed: IntCounterVec,
    /// Claims being deleted that pods still use.
    pub claims_waiting: IntGauge,
    /// Volumes being deleted that are still Bound.
    pub volumes_waiting: IntGauge,
    pub reconciles: IntCounterVec,
    pub errors: IntCounterVec,
    pub duration: HistogramVec,
    pub queue_depth: IntGaugeVec,
    /// Namespace pod lists made to confirm a claim is unused.
    pub live_lists: IntCounterVec,
    /// `ClaimInUse` events recorded.
    pub in_use_events: IntCounterVec,
}

impl Metrics {
    pub fn new(registry: &Registry) -> Self {
        let counter = |name: &str, help: &str, labels: &[&str]| {
            register(
                registry,
                IntCounterVec::new(Opts::new(name, help), labels).expect("static metric definition"),
            )
        };
        let gauge = |name: &str, help: &str| {
            register(
                registry,
                IntGauge::new(name, help).expect("static metric definition"),
            )
        };
        let m = Self {
            finalizers_added: counter(
                "stowage_protection_finalizers_added_total",
                "Protection finalizers added to objects that lacked them, by kind.",
                &["kind"],
            ),
            finalizers_removed: counter(
                "stowage_protection_finalizers_removed_total",
                "Protection finalizers removed from deleted objects nothing uses any more, by kind.",
                &["kind"],
            ),
            claims_waiting: gauge(
                "stowage_protection_claims_waiting_on_pods",
                "Claims being deleted whose deletion waits for pods that still use them.",
            ),
            volumes_waiting: gauge(
                "stowage_protection_volumes_waiting_on_unbind",
                "Volumes being deleted whose deletion waits because they are still Bound.",
            ),
            reconciles: counter(
                "stowage_protection_reconcile_total",
                "Syncs of one object, by controller.",
                &["controller"],
            ),
            errors: counter(
                "stowage_protection_reconcile_errors_total",
                "Syncs that failed and were retried with backoff, by controller and error (the shared error vocabulary).",
                &["controller", "error"],
            ),
            duration: register(
                registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "stowage_protection_reconcile_duration_seconds",
                        "Time of one sync including its API calls, by controller.",
                    )
                    .buckets(prometheus::exponential_buckets(0.0005, 2.0, 16).expect("static buckets")),
                    &["controller"],
                )
                .expect("static metric definition"),
            ),
            queue_depth: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "stowage_protection_queue_depth",
                        "Objects waiting in the work queue (ready or backing off).",
                    ),
                    &["controller"],
                )
                .expect("static metric definition"),
            ),
            live_lists: counter(
                "stowage_protection_live_pod_lists_total",
                "Live pod lists of a namespace made to confirm a claim is unused before removing its finalizer, by result and what they found (in_use, unused; unknown when the list failed).",
                &["result", "claim"],
            ),
            in_use_events: counter(
                "stowage_protection_claim_in_use_events_total",
                "ClaimInUse events recorded (one per change of the set of pods a deleted claim waits for).",
                &["type"],
            ),
        };
        // Known label values start at zero, so every family is visible from the first scrape.
        for kind in [PVC, PV] {
            m.finalizers_added.with_label_values(&[kind]);
            m.finalizers_removed.with_label_values(&[kind]);
        }
        m.in_use_events.with_label_values(&["Normal"]);
        m
    }
}

impl Metrics {
    /// Counts a failed sync of `controller`.
    pub fn failed(&self, controller: &str, error: &str) {
        self.errors.with_label_values(&[controller, error]).inc();
    }

    /// A failed sync of `controller` (both controllers' error policy): counted, and its key
    /// retried after the queue's backoff.
    pub fn retry<K: Debug>(&self, controller: &str, key: &K, error: &Error) -> Retry {
        self.failed(controller, error.metric_label());
        tracing::debug!(controller, ?key, %error, "sync failed, retrying");
        Retry::Backoff
    }

    /// The depth of `controller`'s queue, set before its loop waits.
    pub fn depth(&self, controller: &str, len: usize) {
        self.queue_depth.with_label_values(&[controller]).set(len as i64);
    }
}

/// One sync, counted when it starts and timed until it is dropped (also when it fails or panics).
pub struct Reconcile {
    duration: prometheus::Histogram,
    started: std::time::Instant,
}

impl Reconcile {
    pub fn start(m: &Metrics, controller: &str) -> Self {
        m.reconciles.with_label_values(&[controller]).inc();
        Self {
            duration: m.duration.with_label_values(&[controller]),
            started: std::time::Instant::now(),
        }
    }
}

impl Drop for Reconcile {
    fn drop(&mut self) {
        self.duration.observe(self.started.elapsed().as_secs_f64());
    }
}

//! Expansion metrics (prefix `stowage_expand_`), registered once per process.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts};
use stowage_common::observe::metrics::{Registry, register};

#[derive(Clone)]
pub struct Metrics {
    /// Claim syncs.
    pub reconciles: IntCounterVec,
    /// Syncs whose work failed, by error (the shared error vocabulary).
    pub errors: IntCounterVec,
    /// Time to carry out one sync's writes (and image growth).
    pub reconcile_seconds: HistogramVec,
    /// Claims with a resize under way (allocatedResourceStatuses[storage] set).
    pub in_progress: IntGauge,
    /// Expansion durations: `controller` = start → PV grown and claim marked; `total` = start →
    /// claim capacity reached (node step included), for expansions started by this process.
    pub expansion_seconds: HistogramVec,
    /// Expansion outcomes of the controller part, by the state they reached.
    pub expansions: IntCounterVec,
    /// Failed or refused expansions by error.
    pub failures: IntCounterVec,
    /// API writes by operation.
    pub writes: IntCounterVec,
    /// Keys waiting (ready or delayed) in the work queue.
    pub queue_depth: IntGauge,
}

impl Metrics {
    pub fn new(registry: &Registry) -> Self {
        let m = Self {
            reconciles: IntCounterVec::new(
                Opts::new("stowage_expand_reconcile_total", "Expand controller claim syncs."),
                &["kind"],
            )
            .unwrap(),
            errors: IntCounterVec::new(
                Opts::new(
                    "stowage_expand_reconcile_errors_total",
                    "Expand controller syncs whose work failed, by error (the shared error vocabulary).",
                ),
                &["error"],
            )
            .unwrap(),
            reconcile_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "stowage_expand_reconcile_duration_seconds",
                    "Time to carry out the work of one sync.",
                )
                .buckets(prometheus::exponential_buckets(0.001, 2.0, 15).unwrap()),
                &["kind"],
            )
            .unwrap(),
            in_progress: IntGauge::new(
                "stowage_expand_expansions_in_progress",
                "Claims with a resize under way (controller or node side).",
            )
            .unwrap(),
            expansion_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "stowage_expand_expansion_duration_seconds",
                    "Expansion durations: controller part, and total until the claim has the new size.",
                )
                .buckets(prometheus::exponential_buckets(0.01, 2.0, 16).unwrap()),
                &["stage"],
            )
            .unwrap(),
            expansions: IntCounterVec::new(
                Opts::new(
                    "stowage_expand_expansions_total",
                    "Controller-side expansion outcomes by the state reached (node_pending, finished, failed, handed_off, canceled).",
                ),
                &["state"],
            )
            .unwrap(),
            failures: IntCounterVec::new(
                Opts::new(
                    "stowage_expand_failures_total",
                    "Failed or refused expansions by error (image, infeasible, not_allowed).",
                ),
                &["error"],
            )
            .unwrap(),
            writes: IntCounterVec::new(
                Opts::new("stowage_expand_api_writes_total", "API writes by operation."),
                &["operation"],
            )
            .unwrap(),
            queue_depth: IntGauge::new(
                "stowage_expand_queue_depth",
                "Claims waiting in the expand work queue.",
            )
            .unwrap(),
        };
        register(registry, m.reconciles.clone());
        register(registry, m.errors.clone());
        register(registry, m.reconcile_seconds.clone());
        register(registry, m.in_progress.clone());
        register(registry, m.expansion_seconds.clone());
        register(registry, m.expansions.clone());
        register(registry, m.failures.clone());
        register(registry, m.writes.clone());
        register(registry, m.queue_depth.clone());
        // Known outcomes start at zero, so the family is visible from the first scrape.
        for outcome in ["finished", "node_pending", "handed_off", "failed", "canceled"] {
            m.expansions.with_label_values(&[outcome]);
        }
        m
    }
}

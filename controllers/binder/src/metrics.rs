//! Binder metrics. Inventory gauges (volumes and claims by phase and class) are computed from the
//! shared stores at scrape time, not kept by inc/dec bookkeeping.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::runtime::reflector::Store;
use prometheus::core::{Collector, Desc, Describer};
use prometheus::proto::MetricFamily;
use prometheus::{Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry};
use stowage_common::metrics::register;

use crate::objects::{claim_class, claim_phase, pv_class, pv_phase};

/// The stores of the current leadership term, read at scrape time.
type SharedStores = Arc<RwLock<Option<(Store<PersistentVolume>, Store<PersistentVolumeClaim>)>>>;

#[derive(Clone)]
pub struct Metrics {
    /// Syncs by kind (claim, volume).
    pub reconciles: IntCounterVec,
    /// Failed action batches by kind and error category.
    pub errors: IntCounterVec,
    /// Time to decide one sync (pure core), by kind.
    pub decide_seconds: HistogramVec,
    /// Time to carry out one sync's writes, by kind.
    pub write_seconds: HistogramVec,
    /// API writes by operation.
    pub writes: IntCounterVec,
    /// Keys waiting (ready or delayed) in the work queue.
    pub queue_depth: IntGauge,
    /// Claims whose writes are in flight.
    pub in_flight: IntGauge,
    /// Claim created → Bound.
    pub bind_latency: Histogram,
    /// Built-in provisioning and deletion outcomes.
    pub provisioning: IntCounterVec,
    pub deletions: IntCounterVec,
    /// Warning events sent (once per change of their text), by reason.
    pub warnings: IntCounterVec,
    stores: SharedStores,
}

impl Metrics {
    pub fn new(registry: &Registry) -> Self {
        let kinds = &["kind"];
        let m = Self {
            reconciles: IntCounterVec::new(
                Opts::new("stowage_binder_reconcile_total", "Binder syncs by object kind."),
                kinds,
            )
            .unwrap(),
            errors: IntCounterVec::new(
                Opts::new(
                    "stowage_binder_reconcile_errors_total",
                    "Binder syncs whose writes failed, by kind and error category.",
                ),
                &["kind", "error"],
            )
            .unwrap(),
            decide_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "stowage_binder_decide_duration_seconds",
                    "Time the pure state machine took for one sync.",
                )
                .buckets(prometheus::exponential_buckets(1e-6, 4.0, 10).unwrap()),
                kinds,
            )
            .unwrap(),
            write_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "stowage_binder_reconcile_duration_seconds",
                    "Time to carry out the writes of one sync.",
                )
                .buckets(prometheus::exponential_buckets(0.001, 2.0, 15).unwrap()),
                kinds,
            )
            .unwrap(),
            writes: IntCounterVec::new(
                Opts::new("stowage_binder_api_writes_total", "API writes by operation."),
                &["op"],
            )
            .unwrap(),
            queue_depth: IntGauge::new(
                "stowage_binder_queue_depth",
                "Objects waiting in the binder work queue.",
            )
            .unwrap(),
            in_flight: IntGauge::new("stowage_binder_in_flight", "Objects whose writes are in flight.")
                .unwrap(),
            bind_latency: Histogram::with_opts(
                HistogramOpts::new(
                    "stowage_binder_claim_bind_latency_seconds",
                    "Claim creation to Bound, end to end.",
                )
                .buckets(prometheus::exponential_buckets(0.05, 2.0, 16).unwrap()),
            )
            .unwrap(),
            provisioning: IntCounterVec::new(
                Opts::new(
                    "stowage_binder_provisioning_total",
                    "Built-in provisioning steps by result.",
                ),
                &["result"],
            )
            .unwrap(),
            deletions: IntCounterVec::new(
                Opts::new(
                    "stowage_binder_deletions_total",
                    "Built-in volume deletions by result.",
                ),
                &["result"],
            )
            .unwrap(),
            warnings: IntCounterVec::new(
                Opts::new(
                    "stowage_binder_warning_events_total",
                    "Warning events the binder sent (once per change of their text), by reason.",
                ),
                &["reason"],
            )
            .unwrap(),
            stores: Arc::new(RwLock::new(None)),
        };
        register(registry, m.reconciles.clone());
        register(registry, m.errors.clone());
        register(registry, m.decide_seconds.clone());
        register(registry, m.write_seconds.clone());
        register(registry, m.writes.clone());
        register(registry, m.queue_depth.clone());
        register(registry, m.in_flight.clone());
        register(registry, m.bind_latency.clone());
        register(registry, m.provisioning.clone());
        register(registry, m.deletions.clone());
        register(registry, m.warnings.clone());
        // Known outcomes start at zero, so the families are visible from the first scrape.
        for result in ["succeeded", "failed"] {
            m.provisioning.with_label_values(&[result]);
            m.deletions.with_label_values(&[result]);
        }
        for kind in ["claim", "volume"] {
            m.reconciles.with_label_values(&[kind]);
        }
        for reason in [
            "ProvisioningFailed",
            "VolumeFailedDelete",
            crate::core::DELETE_REFUSED,
        ] {
            m.warnings.with_label_values(&[reason]);
        }
        registry
            .register(Box::new(Inventory {
                stores: m.stores.clone(),
                descs: Inventory::descs(),
            }))
            .expect("inventory collector registered once");
        m
    }

    /// Points the inventory gauges at the stores of the current leadership term.
    pub fn attach(&self, pvs: Store<PersistentVolume>, pvcs: Store<PersistentVolumeClaim>) {
        *self.stores.write().unwrap_or_else(|p| p.into_inner()) = Some((pvs, pvcs));
    }
}

struct Inventory {
    stores: SharedStores,
    descs: Vec<Desc>,
}

impl Inventory {
    fn opts() -> [Opts; 2] {
        [
            Opts::new(
                "stowage_persistentvolumes",
                "PersistentVolumes by phase and storage class.",
            )
            .variable_labels(vec!["phase".into(), "storage_class".into()]),
            Opts::new(
                "stowage_persistentvolumeclaims",
                "PersistentVolumeClaims by phase and storage class.",
            )
            .variable_labels(vec!["phase".into(), "storage_class".into()]),
        ]
    }

    fn descs() -> Vec<Desc> {
        Self::opts()
            .into_iter()
            .map(|o| o.describe().expect("static metric definition"))
            .collect()
    }
}

impl Collector for Inventory {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let guard = self.stores.read().unwrap_or_else(|p| p.into_inner());
        let mut pv_counts: BTreeMap<(String, String), i64> = BTreeMap::new();
        let mut pvc_counts: BTreeMap<(String, String), i64> = BTreeMap::new();
        if let Some((pvs, pvcs)) = guard.as_ref() {
            for pv in pvs.state() {
                *pv_counts
                    .entry((pv_phase(&pv).into(), pv_class(&pv).into()))
                    .or_default() += 1;
            }
            for c in pvcs.state() {
                *pvc_counts
                    .entry((claim_phase(&c).into(), claim_class(&c).unwrap_or("").into()))
                    .or_default() += 1;
            }
        }
        let [pv_opts, pvc_opts] = Self::opts();
        let mut out = Vec::new();
        for (opts, counts) in [(pv_opts, pv_counts), (pvc_opts, pvc_counts)] {
            let g = prometheus::IntGaugeVec::new(opts, &["phase", "storage_class"])
                .expect("static metric definition");
            for ((phase, class), n) in counts {
                g.with_label_values(&[phase.as_str(), class.as_str()]).set(n);
            }
            out.extend(g.collect());
        }
        out
    }
}

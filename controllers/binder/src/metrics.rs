//! Binder metrics. Inventory gauges (volumes and claims by phase and class) are computed from the
//! shared stores at scrape time, not kept by inc/dec bookkeeping.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use k8s_openapi::api::core::v1::PersistentVolume;
use kube::runtime::reflector::Store;
use prometheus::core::{Collector, Desc, Describer};
use prometheus::proto::MetricFamily;
use prometheus::{Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts};
use stowage_common::observe::metrics::{Registry, register};
use stowage_common::store::{StoredClaim, StoredVolume};

use crate::pv::{claim_class, claim_phase, claim_vac, pv_block, pv_class, pv_phase};
use kube::ResourceExt;

/// The stores of the current leadership term, read at scrape time.
type SharedStores = Arc<RwLock<Option<(Store<StoredVolume>, Store<StoredClaim>)>>>;

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
    /// 1 while the image store's marker was found at the last check, else 0.
    pub image_store_ready: IntGauge,
    /// Image creations and deletions refused because the marker was missing, by operation.
    pub image_store_refusals: IntCounterVec,
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
                    "Binder syncs that failed, by kind and error (the shared error vocabulary).",
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
                &["operation"],
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
                    "Built-in provisioning steps by result (success, error).",
                ),
                &["result"],
            )
            .unwrap(),
            deletions: IntCounterVec::new(
                Opts::new(
                    "stowage_binder_deletions_total",
                    "Built-in volume deletions by result (success, error).",
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
            image_store_ready: IntGauge::new(
                "stowage_binder_image_store_ready",
                "1 while the image store's marker was found at the last check (every 10 s while leading), else 0.",
            )
            .unwrap(),
            image_store_refusals: IntCounterVec::new(
                Opts::new(
                    "stowage_binder_image_store_refusals_total",
                    "Image creations and deletions refused because the image store's marker was missing, by operation.",
                ),
                &["operation"],
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
        register(registry, m.image_store_ready.clone());
        register(registry, m.image_store_refusals.clone());
        for op in ["create", "delete"] {
            m.image_store_refusals.with_label_values(&[op]);
        }
        // Known outcomes start at zero, so the families are visible from the first scrape.
        for result in [stowage_common::errors::SUCCESS, stowage_common::errors::ERROR] {
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
            crate::core::IMAGE_STORE_NOT_READY,
        ] {
            m.warnings.with_label_values(&[reason]);
        }
        registry.register(Box::new(Inventory {
            stores: m.stores.clone(),
            descs: Inventory::descs(),
        }));
        m
    }

    /// Points the inventory gauges at the stores of the current leadership term.
    pub fn attach(&self, pvs: Store<StoredVolume>, pvcs: Store<StoredClaim>) {
        *self.stores.write().unwrap_or_else(|p| p.into_inner()) = Some((pvs, pvcs));
    }
}

struct Inventory {
    stores: SharedStores,
    descs: Vec<Desc>,
}

impl Inventory {
    /// Our gauges, then kube-controller-manager's `pv_collector_*` under its names and labels,
    /// so a KCM dashboard keeps working after the switch (docs/metrics.md maps them).
    fn opts() -> [(Opts, &'static [&'static str]); 7] {
        let pv_class: &'static [&'static str] = &["storage_class"];
        let pvc_dims: &'static [&'static str] = &["namespace", "storage_class", "volume_attributes_class"];
        [
            (
                Opts::new(
                    "stowage_persistentvolumes",
                    "PersistentVolumes by phase and storage class.",
                ),
                &["phase", "storage_class"],
            ),
            (
                Opts::new(
                    "stowage_persistentvolumeclaims",
                    "PersistentVolumeClaims by phase and storage class.",
                ),
                &["phase", "storage_class"],
            ),
            (
                Opts::new(
                    "pv_collector_bound_pv_count",
                    "PersistentVolumes that are Bound (KCM's gauge).",
                ),
                pv_class,
            ),
            (
                Opts::new(
                    "pv_collector_unbound_pv_count",
                    "PersistentVolumes that are not Bound (KCM's gauge).",
                ),
                pv_class,
            ),
            (
                Opts::new(
                    "pv_collector_bound_pvc_count",
                    "PersistentVolumeClaims that are Bound (KCM's gauge).",
                ),
                pvc_dims,
            ),
            (
                Opts::new(
                    "pv_collector_unbound_pvc_count",
                    "PersistentVolumeClaims that are not Bound (KCM's gauge).",
                ),
                pvc_dims,
            ),
            (
                Opts::new(
                    "pv_collector_total_pv_count",
                    "PersistentVolumes by volume plugin and volume mode (KCM's gauge).",
                ),
                &["plugin_name", "volume_mode"],
            ),
        ]
    }

    fn descs() -> Vec<Desc> {
        Self::opts()
            .into_iter()
            .map(|(o, labels)| {
                o.variable_labels(labels.iter().map(|l| l.to_string()).collect())
                    .describe()
                    .expect("static metric definition")
            })
            .collect()
    }
}

/// The plugin name KCM reports for a volume (`kubernetes.io/csi:<driver>` for CSI).
fn plugin_name(pv: &PersistentVolume) -> String {
    let Some(spec) = pv.spec.as_ref() else {
        return "N/A".into();
    };
    if let Some(csi) = &spec.csi {
        return format!("kubernetes.io/csi:{}", csi.driver);
    }
    let name = if spec.host_path.is_some() {
        "kubernetes.io/host-path"
    } else if spec.local.is_some() {
        "kubernetes.io/local-volume"
    } else if spec.nfs.is_some() {
        "kubernetes.io/nfs"
    } else if spec.fc.is_some() {
        "kubernetes.io/fc"
    } else if spec.iscsi.is_some() {
        "kubernetes.io/iscsi"
    } else {
        "N/A"
    };
    name.into()
}

impl Collector for Inventory {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        type Counts = BTreeMap<Vec<String>, i64>;
        let guard = self.stores.read().unwrap_or_else(|p| p.into_inner());
        // One map per family, in the order of `opts`.
        let mut counts: [Counts; 7] = Default::default();
        let mut bump = |i: usize, labels: Vec<String>| *counts[i].entry(labels).or_default() += 1;
        if let Some((pvs, pvcs)) = guard.as_ref() {
            // Each object is decoded in turn, never all at once.
            for stored in pvs.state() {
                let pv = stored.decode();
                let class = pv_class(&pv).to_string();
                bump(0, vec![pv_phase(&pv).into(), class.clone()]);
                bump(if pv_phase(&pv) == "Bound" { 2 } else { 3 }, vec![class]);
                let mode = if pv_block(&pv) { "Block" } else { "Filesystem" };
                bump(6, vec![plugin_name(&pv), mode.into()]);
            }
            for stored in pvcs.state() {
                let c = stored.decode();
                let class = claim_class(&c).unwrap_or("").to_string();
                bump(1, vec![claim_phase(&c).into(), class.clone()]);
                let vac = claim_vac(&c).to_string();
                let ns = c.namespace().unwrap_or_default();
                bump(
                    if claim_phase(&c) == "Bound" { 4 } else { 5 },
                    vec![ns, class, vac],
                );
            }
        }
        let mut out = Vec::new();
        for ((opts, labels), counts) in Self::opts().into_iter().zip(counts) {
            let g = prometheus::IntGaugeVec::new(opts, labels).expect("static metric definition");
            for (values, n) in counts {
                let v: Vec<&str> = values.iter().map(String::as_str).collect();
                g.with_label_values(&v).set(n);
            }
            out.extend(g.collect());
        }
        out
    }
}

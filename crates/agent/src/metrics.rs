//! The agent's metric families (all `stowage_agent_*`).

use std::time::Instant;

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
};
use stowage_common::errors::{ERROR, SUCCESS};
use stowage_common::observe::metrics::{Registry, register};
use stowage_loopdriver::csi::metrics::RpcMetrics;

/// Operation names used as the `operation` label.
pub const OPERATIONS: [&str; 7] = [
    "attach",
    "mount_device",
    "setup",
    "teardown",
    "unmount_device",
    "detach",
    "expand_fs",
];

#[derive(Clone)]
pub struct Metrics {
    /// Finished operations by name and result (`success`, `error`).
    pub operations: IntCounterVec,
    /// Failed operations by name.
    pub errors: IntCounterVec,
    /// How long each operation took.
    pub duration: HistogramVec,
    /// Volumes in the desired and the actual state.
    pub volumes: IntGaugeVec,
    /// Pod volumes (pod, volume) desired and mounted.
    pub pod_volumes: IntGaugeVec,
    /// Pod created → its volume published in the pod dir.
    pub pod_volume_ready: Histogram,
    /// Reconciler passes.
    pub passes: IntCounterVec,
    /// Passes skipped because the node could not be observed, by `error` (`mount_table`,
    /// `volume_dirs`): nothing was decided or published on them.
    pub observe_errors: IntCounterVec,
    /// Mounts under the root dir by `health` (healthy, pending, unknown, broken) at the last pass.
    pub mount_health: IntGaugeVec,
    /// Mount probes (`stat` threads) that have not returned.
    pub probes_in_flight: IntGauge,
    /// 1 while the image store's marker was found at the last check, else 0.
    pub image_store_ready: IntGauge,
    /// Loop devices of the store released because nothing accounted for them (`attacher/sweep.rs`).
    pub stale_devices_released: IntCounter,
    /// Every call the CSI server answers (`csi_sidecar_operations_seconds`), filled by the
    /// server's layer.
    pub csi: RpcMetrics,
}

/// Label values of `observe_errors`.
pub const OBSERVE_SOURCES: [&str; 2] = ["mount_table", "volume_dirs"];
/// Label values of `mount_health`.
pub const HEALTH_STATES: [&str; 4] = ["healthy", "pending", "unknown", "broken"];

impl Metrics {
    pub fn new(registry: &Registry) -> Self {
        let buckets = vec![
            0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
        ];
        let m = Self {
            operations: register(
                registry,
                IntCounterVec::new(
                    Opts::new("stowage_agent_operations_total", "Volume operations finished, by operation and result."),
                    &["operation", "result"],
                )
                .expect("static metric definition"),
            ),
            errors: register(
                registry,
                IntCounterVec::new(
                    Opts::new("stowage_agent_operation_errors_total", "Volume operations that failed, by operation."),
                    &["operation"],
                )
                .expect("static metric definition"),
            ),
            duration: register(
                registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "stowage_agent_operation_duration_seconds",
                        "Duration of volume operations, by operation and result.",
                    )
                    .buckets(buckets.clone()),
                    &["operation", "result"],
                )
                .expect("static metric definition"),
            ),
            volumes: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "stowage_agent_volumes",
                        "Volumes in the desired state (wanted by pods) and the actual state (mounted on the node).",
                    ),
                    &["state"],
                )
                .expect("static metric definition"),
            ),
            pod_volumes: register(
                registry,
                IntGaugeVec::new(
                    Opts::new("stowage_agent_pod_volumes", "Pod volumes desired and mounted."),
                    &["state"],
                )
                .expect("static metric definition"),
            ),
            pod_volume_ready: register(
                registry,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "stowage_agent_pod_volume_ready_seconds",
                        "From pod creation to its volume being published into the pod directory.",
                    )
                    .buckets(buckets),
                )
                .expect("static metric definition"),
            ),
            passes: register(
                registry,
                IntCounterVec::new(
                    Opts::new("stowage_agent_reconcile_passes_total", "Reconciler passes, by loop."),
                    &["loop"],
                )
                .expect("static metric definition"),
            ),
            observe_errors: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "stowage_agent_observe_errors_total",
                        "Volume manager passes skipped because the mount table or the agent's directories could not be read.",
                    ),
                    &["error"],
                )
                .expect("static metric definition"),
            ),
            mount_health: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "stowage_agent_mount_health",
                        "Mounts under the root dir by health at the last pass (pending: the probe has not answered).",
                    ),
                    &["health"],
                )
                .expect("static metric definition"),
            ),
            probes_in_flight: register(
                registry,
                IntGauge::new(
                    "stowage_agent_mount_probes_in_flight",
                    "Mount health probes (stat threads) that have not returned; at most one per mount.",
                )
                .expect("static metric definition"),
            ),
            image_store_ready: register(
                registry,
                IntGauge::new(
                    "stowage_agent_image_store_ready",
                    "1 while the image store's marker was found at the last check (every 10 s), else 0.",
                )
                .expect("static metric definition"),
            ),
            stale_devices_released: register(
                registry,
                IntCounter::new(
                    "stowage_agent_stale_devices_released_total",
                    "Loop devices of the image store released because no attachment, mount or pod used them.",
                )
                .expect("static metric definition"),
            ),
            csi: RpcMetrics::new(),
        };
        register(registry, m.csi.histogram().clone());
        for s in OBSERVE_SOURCES {
            m.observe_errors.with_label_values(&[s]);
        }
        for h in HEALTH_STATES {
            m.mount_health.with_label_values(&[h]).set(0);
        }
        // Every series exists from the start, so rates work before the first operation.
        for op in OPERATIONS {
            m.errors.with_label_values(&[op]);
            for st in [SUCCESS, ERROR] {
                m.operations.with_label_values(&[op, st]);
            }
        }
        for st in ["desired", "actual"] {
            m.volumes.with_label_values(&[st]).set(0);
            m.pod_volumes.with_label_values(&[st]).set(0);
        }
        m
    }

    /// Records one finished operation.
    pub fn record(&self, op: &str, started: Instant, ok: bool) {
        let result = if ok { SUCCESS } else { ERROR };
        self.operations.with_label_values(&[op, result]).inc();
        self.duration
            .with_label_values(&[op, result])
            .observe(started.elapsed().as_secs_f64());
        if !ok {
            self.errors.with_label_values(&[op]).inc();
        }
    }
}

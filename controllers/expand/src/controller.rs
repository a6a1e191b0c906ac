//! The expand `Controller`: one task decides (serially, from the shared stores plus the objects
//! this controller wrote itself, newest resourceVersion winning); each claim's work runs in the
//! shared window (`exec`), at most one per claim, and reports the objects it wrote back
//! (`results`). Store events become keys in `ingest`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use stowage_common::events::Events;
use stowage_common::inflight::Window;
use stowage_common::informer::Change;
use stowage_common::informers::Informers;
use stowage_common::pv::{claim_class, claim_volume_name, pv_block};
use stowage_common::queue::WorkQueue;
use tokio::time::Instant;

use crate::core::{self, Action};
use crate::exec::{Executor, is_attached};
use crate::metrics::Metrics;
use crate::results::Outcome;

/// Expand controller settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where the built-in driver keeps its images (shared with the binder and every agent).
    pub image_dir: PathBuf,
    /// Full resync period: every bound claim is looked at again (a converged one costs nothing).
    pub resync: Duration,
    /// Claims whose work may run at once (upstream runs 10 workers).
    pub max_in_flight: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            image_dir: PathBuf::from("/var/lib/stowage/images"),
            resync: Duration::from_secs(60),
            max_in_flight: 10,
        }
    }
}

pub(crate) struct Controller {
    /// Work tasks, one per claim: dropped (aborted) with the controller when leadership ends,
    /// so a former leader stops writing at once; claims wait in the queue while it is full.
    pub(crate) window: Window<String, Outcome>,
    pub(crate) cluster: Arc<Informers>,
    pub(crate) queue: WorkQueue<String>,
    /// Objects this controller wrote, until the stores catch up (newest resourceVersion wins).
    pub(crate) claims: HashMap<String, Arc<PersistentVolumeClaim>>,
    pub(crate) pvs: HashMap<String, Arc<PersistentVolume>>,
    /// Claims with a resize status, and when this process started their expansion.
    pub(crate) resizing: HashMap<String, Option<Instant>>,
    pub(crate) executor: Arc<Executor>,
}

pub async fn run(cluster: Arc<Informers>, metrics: Metrics, config: Config) -> anyhow::Result<()> {
    // Subscribe before reading the stores so nothing falls between the two.
    let mut pvc_feed = cluster.pvcs.feed();
    let mut pv_feed = cluster.pvs.feed();
    let mut class_feed = cluster.classes.feed();
    let client = cluster.client.clone();
    let mut ctl = Controller {
        window: Window::new(config.max_in_flight),
        queue: WorkQueue::default().named("volume_expand"),
        claims: HashMap::new(),
        pvs: HashMap::new(),
        resizing: HashMap::new(),
        executor: Arc::new(Executor {
            events: Events::new(client.clone(), "stowage-expand"),
            client,
            last_events: Default::default(),
            metrics,
            image_dir: config.image_dir.clone(),
            attachments: cluster.attachments.store().clone(),
        }),
        cluster,
    };
    ctl.resync();
    let mut resync = tokio::time::interval_at(Instant::now() + config.resync, config.resync);
    loop {
        ctl.executor.metrics.queue_depth.set(ctl.queue.len() as i64);
        ctl.queue.report(Instant::now());
        ctl.executor.metrics.in_progress.set(ctl.resizing.len() as i64);
        let next_due = ctl.queue.next_due();
        tokio::select! {
            biased;
            landed = ctl.window.next() => ctl.finish(landed),
            r = pvc_feed.next() => match r? {
                Change::Applied(c) => ctl.claim_seen(&c.unpack()),
                Change::Deleted(c) => ctl.claim_gone(&c.unpack()),
                Change::Resynced => ctl.resync(),
            },
            r = pv_feed.next() => match r? {
                Change::Applied(pv) => ctl.pv_seen(&pv.unpack()),
                Change::Deleted(pv) => {
                    ctl.pvs.remove(&pv.name_any());
                    ctl.queue_claim_of(&pv.unpack());
                }
                Change::Resynced => ctl.resync(),
            },
            r = class_feed.next() => match r? {
                // A class that now allows expansion unblocks its claims (and a refusal is news).
                Change::Applied(sc) | Change::Deleted(sc) => ctl.wake_class(&sc.name_any()),
                Change::Resynced => ctl.resync(),
            },
            _ = resync.tick() => ctl.resync(),
            _ = std::future::ready(()), if ctl.window.has_room() && ctl.queue.has_ready() => ctl.work(Instant::now()),
            _ = tokio::time::sleep_until(next_due.unwrap_or_else(Instant::now)), if next_due.is_some() && ctl.window.has_room() => {
                ctl.work(Instant::now())
            }
        }
    }
}

impl Controller {
    pub(crate) fn work(&mut self, now: Instant) {
        for _ in 0..256 {
            if !self.window.has_room() {
                return;
            }
            let Some(key) = self.queue.pop(now) else { return };
            self.sync(key);
        }
    }

    pub(crate) fn sync(&mut self, key: String) {
        if self.window.defer_if_running(&key) {
            return;
        }
        let Some(claim) = self.claim(&key) else {
            self.queue.succeeded(&key);
            return;
        };
        let pv = Some(claim_volume_name(&claim))
            .filter(|n| !n.is_empty())
            .and_then(|n| self.pv(n));
        let class = claim_class(&claim)
            .filter(|n| !n.is_empty())
            .and_then(|n| self.cluster.classes.store().get(&ObjectRef::new(n)));
        // Only Block volumes ask; a scan of the attachments is not worth it otherwise.
        let attached = pv
            .as_ref()
            .filter(|v| pv_block(v) || stowage_common::pv::claim_block(&claim))
            .is_some_and(|v| is_attached(&self.executor.attachments, &v.name_any()));
        let actions = core::sync_claim(
            &claim,
            pv.as_deref(),
            class.as_deref(),
            attached,
            Timestamp::now(),
        );
        self.executor
            .metrics
            .reconciles
            .with_label_values(&["claim"])
            .inc();
        // Events are queued, not awaited: a sync that only reports needs no write task.
        if actions.iter().all(|a| matches!(a, Action::Event { .. })) {
            for e in &actions {
                if let Action::Event {
                    warning,
                    reason,
                    note,
                } = e
                {
                    self.executor.report(&key, &claim, *warning, reason, note);
                }
            }
            self.queue.succeeded(&key);
            return;
        }
        let executor = self.executor.clone();
        self.window.start(key.clone(), async move {
            let timer = executor
                .metrics
                .reconcile_seconds
                .with_label_values(&["claim"])
                .start_timer();
            let mut done = Outcome {
                claims: vec![],
                pvs: vec![],
                started: None,
                error: None,
            };
            for a in &actions {
                if let Err(e) = executor.apply(&key, a, &claim, pv.as_deref(), &mut done).await {
                    tracing::warn!(claim = %key, error = %e, "expansion work failed");
                    done.error = Some(e);
                    break;
                }
            }
            timer.observe_duration();
            done
        });
    }
}

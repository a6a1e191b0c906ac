//! The expand `Controller`: one task decides (serially, from the shared stores plus the objects
//! this controller wrote itself, newest resourceVersion winning); each claim's work runs in the
//! shared window (`exec`), at most one per claim, and reports the objects it wrote back
//! (`results`). Store events become keys in `ingest`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use stowage_common::errors::{MetricLabel, PANIC};
use stowage_common::observe::events::Events;
use stowage_common::runtime::driver::{self, Inputs, Next, Pace, Reconciler, Retry};
use stowage_common::runtime::inflight::{Landed, Window};
use stowage_common::runtime::queue::WorkQueue;
use stowage_common::store::informer::Change;
use stowage_common::store::informers::Informers;
use stowage_common::store::pv::{claim_class, claim_volume_name, pv_block};
use stowage_common::store::{StoredClaim, StoredVolume};
use tokio::time::Instant;

use crate::core::{self, Action};
use crate::error::Error;
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
    let pvc_feed = cluster.pvcs.feed();
    let pv_feed = cluster.pvs.feed();
    let class_feed = cluster.classes.feed();
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
            metrics,
            image_dir: config.image_dir.clone(),
            attachments: cluster.attachments.store().clone(),
        }),
        cluster,
    };
    ctl.resync();
    let inputs = Inputs::new()
        .feed(pvc_feed, Input::Claim)
        .feed(pv_feed, Input::Volume)
        .feed(class_feed, Input::Class)
        .every(Instant::now() + config.resync, config.resync, || Input::Resync);
    driver::run(ctl, inputs, Pace::default()).await
}

pub(crate) enum Input {
    Claim(Change<StoredClaim>),
    Volume(Change<StoredVolume>),
    Class(Change<StorageClass>),
    Resync,
}

impl Reconciler for Controller {
    type Key = String;
    type Input = Input;
    type Done = Outcome;
    type Error = Error;

    fn queue(&mut self) -> &mut WorkQueue<String> {
        &mut self.queue
    }

    fn window(&mut self) -> Option<&mut Window<String, Outcome>> {
        Some(&mut self.window)
    }

    fn input(&mut self, input: Input) {
        match input {
            Input::Claim(Change::Applied(c)) => self.claim_seen(&c.decode()),
            Input::Claim(Change::Deleted(c)) => self.claim_gone(&c.decode()),
            Input::Volume(Change::Applied(pv)) => self.pv_seen(&pv.decode()),
            Input::Volume(Change::Deleted(pv)) => {
                self.pvs.remove(&pv.name_any());
                self.queue_claim_of(&pv.decode());
            }
            // A class that now allows expansion unblocks its claims (and a refusal is news).
            Input::Class(Change::Applied(sc) | Change::Deleted(sc)) => self.wake_class(&sc.name_any()),
            Input::Claim(Change::Resynced)
            | Input::Volume(Change::Resynced)
            | Input::Class(Change::Resynced)
            | Input::Resync => self.resync(),
        }
    }

    async fn reconcile(&mut self, key: String) -> Result<Next, Self::Error> {
        Ok(self.sync(key))
    }

    fn landed(&mut self, landed: Landed<String, Outcome>) -> Result<Next, Error> {
        self.finish(landed)
    }

    /// Counted by kind; an infeasible expansion waits for a changed request (or the core's slow
    /// retry), anything else comes back after the queue's backoff.
    fn error_policy(&mut self, key: &String, error: Error, _failures: u32) -> Retry {
        self.executor
            .metrics
            .errors
            .with_label_values(&[error.metric_label()])
            .inc();
        tracing::debug!(claim = %key, %error, "expansion failed");
        if error.retry() {
            Retry::Backoff
        } else {
            Retry::Never
        }
    }

    fn panicked(&mut self, _: &String) {
        self.executor.metrics.errors.with_label_values(&[PANIC]).inc();
    }

    fn before_wait(&mut self) {
        self.executor.metrics.queue_depth.set(self.queue.len() as i64);
        self.executor.metrics.in_progress.set(self.resizing.len() as i64);
    }
}

impl Controller {
    /// Decides one claim: reports at once, or starts its writes (then `finish` settles it).
    pub(crate) fn sync(&mut self, key: String) -> Next {
        if self.window.defer_if_running(&key) {
            return Next::Pending;
        }
        let Some(claim) = self.claim(&key) else {
            return Next::Done;
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
            .filter(|v| pv_block(v) || stowage_common::store::pv::claim_block(&claim))
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
            return Next::Done;
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
        Next::Pending
    }
}

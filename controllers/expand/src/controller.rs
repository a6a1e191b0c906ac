//! The expand `Controller`: one task decides (serially, from the shared stores plus the objects
//! this controller wrote itself, newest resourceVersion winning); each claim's work runs in the
//! shared window (`exec`), at most one per claim, and reports the objects it wrote back
//! (`results`). Store events become keys in `ingest`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

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
use crate::ingest::Known;
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

/// The one decision task's state. Its parts take data: `Known` (ingest) turns changes into
/// claim keys and settles results (`results`), the `Executor` writes; only this file holds the
/// controller.
struct Controller {
    /// Work tasks, one per claim: dropped (aborted) with the controller when leadership ends,
    /// so a former leader stops writing at once; claims wait in the queue while it is full.
    window: Window<String, Outcome>,
    queue: WorkQueue<String>,
    known: Known,
    executor: Arc<Executor>,
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
        executor: Arc::new(Executor {
            events: Events::new(client.clone(), "stowage-expand"),
            client,
            metrics: metrics.clone(),
            image_dir: config.image_dir.clone(),
            attachments: cluster.attachments.store().clone(),
        }),
        known: Known::new(cluster, metrics),
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
            Input::Claim(Change::Applied(c)) => {
                if let Some(t) = self.known.claim_seen(&c.decode()) {
                    // A claim with writes running is synced again when they land.
                    if !self.window.defer_if_running(&t.key) && t.bound {
                        self.queue.add(t.key);
                    }
                }
            }
            Input::Claim(Change::Deleted(c)) => {
                let key = self.known.claim_gone(&c.decode());
                self.executor.events.forget(&crate::exec::subject(&key));
            }
            Input::Volume(Change::Applied(pv)) => {
                let key = self.known.pv_seen(&pv.decode());
                self.sync_later(key);
            }
            Input::Volume(Change::Deleted(pv)) => {
                let key = self.known.pv_gone(&pv.decode());
                self.sync_later(key);
            }
            Input::Class(Change::Applied(sc) | Change::Deleted(sc)) => {
                for key in self.known.claims_of_class(&sc.name_any()) {
                    self.queue.add(key);
                }
            }
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
        let key = landed.key.clone();
        let f = self.known.finish(landed);
        if f.changed && f.next.is_err() {
            // Changed by someone else: decide again on the newer object now, failed or not.
            self.queue.add(key);
        }
        f.next
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
        self.executor
            .metrics
            .in_progress
            .set(self.known.resizing.len() as i64);
    }
}

impl Controller {
    /// Every bound claim, queued (the periodic net, and after a relist).
    fn resync(&mut self) {
        for key in self.known.resync() {
            self.queue.add(key);
        }
    }

    /// Queues a claim a volume change touched, unless its writes are running (it is synced
    /// again when they land).
    fn sync_later(&mut self, key: Option<String>) {
        if let Some(key) = key
            && !self.window.defer_if_running(&key)
        {
            self.queue.add(key);
        }
    }

    /// Decides one claim: reports at once, or starts its writes (then `finish` settles it).
    fn sync(&mut self, key: String) -> Next {
        if self.window.defer_if_running(&key) {
            return Next::Pending;
        }
        let Some(claim) = self.known.claim(&key) else {
            return Next::Done;
        };
        let pv = Some(claim_volume_name(&claim))
            .filter(|n| !n.is_empty())
            .and_then(|n| self.known.pv(n));
        let class = claim_class(&claim)
            .filter(|n| !n.is_empty())
            .and_then(|n| self.known.cluster.classes.store().get(&ObjectRef::new(n)));
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

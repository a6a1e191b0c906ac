//! pv-protection's `Controller`. A volume being deleted keeps its finalizer while Bound; the
//! resourceVersion guard on the patch means a store that still shows an old Released phase
//! cannot take the finalizer off a volume that was bound again meanwhile.

use std::collections::HashSet;
use std::sync::Arc;

use k8s_openapi::api::core::v1::PersistentVolume;
use kube::Api;
use kube::runtime::reflector::ObjectRef;
use stowage_common::store::StoredVolume;
use stowage_common::store::informer::Change;
use stowage_common::store::informers::Informers;

use crate::core::{Action, PV_FINALIZER, decide_pv, decide_pv_of};
use crate::error::Error;
use crate::exec as write;
use crate::metrics::{self, Metrics};
use stowage_common::errors::PANIC;
use stowage_common::runtime::driver::{self, Inputs, Next, Pace, Reconciler, Retry};
use stowage_common::runtime::queue::WorkQueue;

struct Controller {
    cluster: Arc<Informers>,
    metrics: Metrics,
    queue: WorkQueue<String>,
    /// Volumes being deleted that are still Bound.
    waiting: HashSet<String>,
}

/// Whether a change of this volume can lead to an action (reads its metadata and phase only).
fn needs_sync(pv: &StoredVolume) -> bool {
    decide_pv_of(pv.meta(), pv.phase().as_deref()) != Action::Nothing
}

/// Runs pv-protection until the feed closes or the future is dropped.
pub async fn run_pv_protection(cluster: Arc<Informers>, metrics: Metrics) -> anyhow::Result<()> {
    let volumes = cluster.pvs.feed();
    cluster.pvs.ready().await;
    let mut c = Controller {
        cluster,
        metrics,
        // Finalizer writes retry more patiently than binds: 10 ms doubling to 2 min.
        queue: WorkQueue::with_backoff(
            std::time::Duration::from_millis(10),
            std::time::Duration::from_secs(120),
        )
        .named("pvprotection"),
        waiting: HashSet::new(),
    };
    c.resync();
    tracing::info!("pv-protection started");
    // One sync at a time, each on the newest view (upstream's single worker).
    driver::run(c, Inputs::new().feed(volumes, |c| c), Pace { batch: 1 }).await
}

impl Reconciler for Controller {
    type Key = String;
    type Input = Change<StoredVolume>;
    type Done = ();
    type Error = Error;

    fn queue(&mut self) -> &mut WorkQueue<String> {
        &mut self.queue
    }

    fn input(&mut self, f: Self::Input) {
        self.on_volume(f)
    }

    async fn reconcile(&mut self, name: String) -> Result<Next, Error> {
        let _timer = metrics::Reconcile::start(&self.metrics, metrics::PV_CONTROLLER);
        self.sync(&name).await.map(|()| Next::Done)
    }

    fn error_policy(&mut self, name: &String, e: Error, _failures: u32) -> Retry {
        self.metrics.retry(metrics::PV_CONTROLLER, name, &e)
    }

    fn panicked(&mut self, _: &String) {
        self.metrics.failed(metrics::PV_CONTROLLER, PANIC);
    }

    fn before_wait(&mut self) {
        self.metrics.depth(metrics::PV_CONTROLLER, self.queue.len());
    }
}

impl Controller {
    fn on_volume(&mut self, f: Change<StoredVolume>) {
        match f {
            Change::Applied(pv) => {
                let name = pv.meta().name.clone().unwrap_or_default();
                if needs_sync(&pv) {
                    self.queue.add(name);
                } else {
                    self.set_waiting(&name, false);
                }
            }
            Change::Deleted(pv) => {
                let name = pv.meta().name.clone().unwrap_or_default();
                self.queue.forget(&name);
                self.set_waiting(&name, false);
            }
            Change::Resynced => self.resync(),
        }
    }

    fn resync(&mut self) {
        let all = self.cluster.pvs.store().state();
        let present: HashSet<String> = all.iter().filter_map(|v| v.meta().name.clone()).collect();
        self.waiting.retain(|n| present.contains(n));
        self.metrics.volumes_waiting.set(self.waiting.len() as i64);
        for pv in all.iter().filter(|v| needs_sync(v)) {
            self.queue.add(pv.meta().name.clone().unwrap_or_default());
        }
    }

    fn set_waiting(&mut self, name: &str, on: bool) {
        let changed = if on {
            self.waiting.insert(name.to_string())
        } else {
            self.waiting.remove(name)
        };
        if changed {
            self.metrics.volumes_waiting.set(self.waiting.len() as i64);
            if on {
                tracing::info!(volume = name, "volume deletion waits until it is no longer Bound");
            }
        }
    }

    async fn sync(&mut self, name: &str) -> Result<(), Error> {
        let Some(pv) = self
            .cluster
            .pvs
            .store()
            .get(&ObjectRef::new(name))
            .map(|p| p.decode())
        else {
            self.set_waiting(name, false);
            return Ok(());
        };
        let api: Api<PersistentVolume> = Api::all(self.cluster.client.clone());
        match decide_pv(&pv) {
            Action::WaitForUnbind => {
                self.set_waiting(name, true);
                Ok(())
            }
            Action::AddFinalizer => {
                let Some(patch) = write::add_finalizer(&pv.metadata, PV_FINALIZER) else {
                    return Ok(());
                };
                if write::send(&api, name, patch).await?.is_some() {
                    self.metrics
                        .finalizers_added
                        .with_label_values(&[metrics::PV])
                        .inc();
                    tracing::info!(volume = name, "added protection finalizer");
                }
                Ok(())
            }
            Action::RemoveFinalizer => {
                let Some(patch) = write::remove_finalizer(&pv.metadata, PV_FINALIZER) else {
                    return Ok(());
                };
                if write::send(&api, name, patch).await?.is_some() {
                    self.metrics
                        .finalizers_removed
                        .with_label_values(&[metrics::PV])
                        .inc();
                    tracing::info!(volume = name, "removed protection finalizer: volume is not Bound");
                }
                self.set_waiting(name, false);
                Ok(())
            }
            Action::Nothing | Action::WaitForPods(_) => {
                self.set_waiting(name, false);
                Ok(())
            }
        }
    }
}

//! pvc-protection's `Controller`. One task owns the queue, the pods-by-claim index and the set of
//! claims whose deletion waits for pods; syncs run one at a time (as
//! upstream's single worker), each a store read, at most one live pod list, and one patch.

use std::collections::HashSet;
use std::sync::Arc;

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::ListParams;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Resource};
use stowage_common::observe::events::{Events, Occurrence, Repeat, Subject};
use stowage_common::store::StoredClaim;
use stowage_common::store::StoredPod;
use stowage_common::store::informer::Change;
use stowage_common::store::informers::Informers;

use crate::core::{Action, PVC_FINALIZER, PodRef, decide_pvc, pvc_needs_sync, users, waiting_note};
use crate::error::Error;
use crate::exec as write;
use crate::index::{Key, PodsByClaim, key_of};
use crate::metrics::{self, Metrics};
use stowage_common::errors::{ERROR, PANIC, SUCCESS};
use stowage_common::runtime::driver::{self, Inputs, Next, Pace, Reconciler, Retry};
use stowage_common::runtime::queue::WorkQueue;

/// Reason of the event on a claim whose deletion waits for pods.
pub const REASON_CLAIM_IN_USE: &str = "ClaimInUse";
/// Reporting controller of the events.
const EVENT_SOURCE: &str = "stowage-protection";

struct Controller {
    cluster: Arc<Informers>,
    metrics: Metrics,
    queue: WorkQueue<Key>,
    index: PodsByClaim,
    /// Claims whose deletion waits for pods (the gauge; the events gate holds what was said).
    waiting: HashSet<Key>,
    events: Events,
}

/// Runs pvc-protection until the feeds close (the informers stopped) or the future is dropped.
pub async fn run_pvc_protection(cluster: Arc<Informers>, metrics: Metrics) -> anyhow::Result<()> {
    // Subscribe before the first scan, so nothing that changes during it is missed.
    let claims = cluster.pvcs.feed();
    let pods = cluster.pods.feed();
    cluster.pvcs.ready().await;
    cluster.pods.ready().await;
    let mut c = Controller {
        events: Events::new(cluster.client.clone(), EVENT_SOURCE),
        cluster,
        metrics,
        // Finalizer writes retry more patiently than binds: 10 ms doubling to 2 min.
        queue: WorkQueue::with_backoff(
            std::time::Duration::from_millis(10),
            std::time::Duration::from_secs(120),
        )
        .named("pvcprotection"),
        index: PodsByClaim::default(),
        waiting: HashSet::new(),
    };
    c.resync_pods();
    c.resync_claims();
    tracing::info!("pvc-protection started");
    // One sync at a time, each on the newest view (upstream's single worker).
    let inputs = Inputs::new().feed(claims, Input::Claim).feed(pods, Input::Pod);
    driver::run(c, inputs, Pace { batch: 1 }).await
}

enum Input {
    Claim(Change<StoredClaim>),
    Pod(Change<StoredPod>),
}

impl Reconciler for Controller {
    type Key = Key;
    type Input = Input;
    type Done = ();
    type Error = Error;

    fn queue(&mut self) -> &mut WorkQueue<Key> {
        &mut self.queue
    }

    fn input(&mut self, input: Input) {
        match input {
            Input::Claim(f) => self.on_claim(f),
            Input::Pod(f) => self.on_pod(f),
        }
    }

    async fn reconcile(&mut self, key: Key) -> Result<Next, Error> {
        let _timer = metrics::Reconcile::start(&self.metrics, metrics::PVC_CONTROLLER);
        self.sync(&key).await.map(|()| Next::Done)
    }

    fn error_policy(&mut self, key: &Key, e: Error, _failures: u32) -> Retry {
        self.metrics.retry(metrics::PVC_CONTROLLER, key, &e)
    }

    fn panicked(&mut self, _: &Key) {
        self.metrics.failed(metrics::PVC_CONTROLLER, PANIC);
    }

    fn before_wait(&mut self) {
        self.metrics.depth(metrics::PVC_CONTROLLER, self.queue.len());
    }
}

impl Controller {
    /// The stored claim (its metadata reads without decoding).
    fn stored_claim(&self, key: &Key) -> Option<Arc<StoredClaim>> {
        self.cluster
            .pvcs
            .store()
            .get(&ObjectRef::new(&key.1).within(&key.0))
    }

    fn claim(&self, key: &Key) -> Option<Arc<PersistentVolumeClaim>> {
        self.stored_claim(key).map(|c| Arc::new(c.decode()))
    }

    fn on_claim(&mut self, f: Change<StoredClaim>) {
        match f {
            Change::Applied(pvc) => {
                let key = key_of(pvc.meta());
                if pvc_needs_sync(pvc.meta()) {
                    self.queue.add(key);
                } else {
                    // Someone else took the finalizer off: it no longer waits on our account.
                    self.not_waiting(&key);
                }
            }
            Change::Deleted(pvc) => {
                let key = key_of(pvc.meta());
                self.queue.forget(&key);
                self.not_waiting(&key);
            }
            Change::Resynced => self.resync_claims(),
        }
    }

    fn on_pod(&mut self, f: Change<StoredPod>) {
        let touched = match f {
            Change::Applied(pod) => self.index.apply(&pod),
            Change::Deleted(pod) => self.index.delete(&pod),
            Change::Resynced => {
                self.resync_pods();
                // Pods deleted while the watch was down left no `Deleted`: look at every claim.
                self.resync_claims();
                return;
            }
        };
        // A pod change matters only to claims that are being deleted or lack the finalizer.
        for key in touched {
            if self.stored_claim(&key).is_some_and(|p| pvc_needs_sync(p.meta())) {
                self.queue.add(key);
            }
        }
    }

    fn resync_pods(&mut self) {
        let pods = self.cluster.pods.store().state();
        self.index.rebuild(pods.iter().map(|p| p.as_ref()));
    }

    fn resync_claims(&mut self) {
        let claims = self.cluster.pvcs.store().state();
        let present: std::collections::HashSet<Key> = claims.iter().map(|c| key_of(c.meta())).collect();
        let gone: Vec<Key> = self.waiting.difference(&present).cloned().collect();
        for key in &gone {
            self.not_waiting(key);
        }
        for c in claims.iter().filter(|c| pvc_needs_sync(c.meta())) {
            self.queue.add(key_of(c.meta()));
        }
    }

    /// The claim waits for pods no longer (or is gone): out of the gauge, and its next wait is
    /// said at once.
    fn not_waiting(&mut self, key: &Key) {
        if self.waiting.remove(key) {
            self.metrics.claims_waiting.set(self.waiting.len() as i64);
            self.events.forget(&subject(key));
        }
    }

    /// Users of `pvc` according to the shared pod store.
    fn cached_users(&self, pvc: &PersistentVolumeClaim, key: &Key) -> Vec<PodRef> {
        let store = self.cluster.pods.store();
        let pods: Vec<Arc<StoredPod>> = self
            .index
            .pods_of(key)
            .filter_map(|name| store.get(&ObjectRef::new(name).within(&key.0)))
            .collect();
        users(pvc, pods.iter().map(|p| p.as_ref()))
    }

    async fn sync(&mut self, key: &Key) -> Result<(), Error> {
        let Some(pvc) = self.claim(key) else {
            self.not_waiting(key);
            return Ok(());
        };
        let cached = self.cached_users(&pvc, key);
        match decide_pvc(&pvc.metadata, &cached) {
            Action::Nothing | Action::WaitForUnbind => {
                self.not_waiting(key);
                Ok(())
            }
            Action::WaitForPods(users) => {
                self.report_waiting(key, &pvc, users);
                Ok(())
            }
            Action::AddFinalizer => self.add_finalizer(&pvc).await,
            Action::RemoveFinalizer => {
                // The store may not have seen a pod created a moment ago: ask the apiserver.
                let live = self.live_users(&pvc, key).await?;
                match decide_pvc(&pvc.metadata, &live) {
                    Action::RemoveFinalizer => self.remove_finalizer(&pvc, key).await,
                    Action::WaitForPods(users) => {
                        self.report_waiting(key, &pvc, users);
                        Ok(())
                    }
                    _ => Ok(()),
                }
            }
        }
    }

    async fn live_users(&self, pvc: &PersistentVolumeClaim, key: &Key) -> Result<Vec<PodRef>, Error> {
        let api: Api<StoredPod> = Api::namespaced(self.cluster.client.clone(), &key.0);
        // No resourceVersion: a consistent read, newer than the claim's deletion we reacted to.
        match api.list(&ListParams::default()).await {
            Ok(list) => {
                let u = users(pvc, &list.items);
                let claim = if u.is_empty() { "unused" } else { "in_use" };
                self.metrics.live_lists.with_label_values(&[SUCCESS, claim]).inc();
                Ok(u)
            }
            Err(e) => {
                self.metrics
                    .live_lists
                    .with_label_values(&[ERROR, "unknown"])
                    .inc();
                Err(Error::Api(e))
            }
        }
    }

    fn report_waiting(&mut self, key: &Key, pvc: &PersistentVolumeClaim, users: Vec<PodRef>) {
        if self.waiting.insert(key.clone()) {
            self.metrics.claims_waiting.set(self.waiting.len() as i64);
        }
        // Said once per change of the pods named, not on every resync (the events gate).
        let e = Occurrence {
            warning: false,
            reason: REASON_CLAIM_IN_USE,
            action: "Delete",
            note: waiting_note(&users),
        };
        if self
            .events
            .report(&subject(key), Repeat::OnChange, &pvc.object_ref(&()), e)
        {
            tracing::info!(claim = %format!("{}/{}", key.0, key.1), pods = ?users.iter().map(|u| &u.name).collect::<Vec<_>>(), "claim deletion waits for pods");
            self.metrics.in_use_events.with_label_values(&["Normal"]).inc();
        }
    }

    async fn add_finalizer(&self, pvc: &PersistentVolumeClaim) -> Result<(), Error> {
        let Some(patch) = write::add_finalizer(&pvc.metadata, PVC_FINALIZER) else {
            return Ok(()); // no resourceVersion: not an object from the apiserver
        };
        let (ns, name) = key_of(&pvc.metadata);
        let api: Api<PersistentVolumeClaim> = Api::namespaced(self.cluster.client.clone(), &ns);
        if write::send(&api, &name, patch).await?.is_some() {
            self.metrics
                .finalizers_added
                .with_label_values(&[metrics::PVC])
                .inc();
            tracing::info!(claim = %format!("{ns}/{name}"), "added protection finalizer");
        }
        Ok(())
    }

    async fn remove_finalizer(&mut self, pvc: &PersistentVolumeClaim, key: &Key) -> Result<(), Error> {
        let Some(patch) = write::remove_finalizer(&pvc.metadata, PVC_FINALIZER) else {
            return Ok(());
        };
        let api: Api<PersistentVolumeClaim> = Api::namespaced(self.cluster.client.clone(), &key.0);
        if write::send(&api, &key.1, patch).await?.is_some() {
            self.metrics
                .finalizers_removed
                .with_label_values(&[metrics::PVC])
                .inc();
        }
        self.not_waiting(key);
        tracing::info!(claim = %format!("{}/{}", key.0, key.1), "removed protection finalizer: no pod uses the claim");
        Ok(())
    }
}

/// The events gate's subject of a claim pvc-protection reports on.
fn subject((ns, name): &Key) -> Subject {
    Subject::new("claim", &format!("{ns}/{name}"))
}

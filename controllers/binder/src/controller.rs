//! The binder's `Controller`: one task owns the cache and the queue and makes every decision
//! serially (so matching can never hand one volume to two claims); the writes of different objects
//! run concurrently in the shared window (`exec`), each object's writes in order, and their
//! outcomes come back to that task (`results::settle`), which keeps the newest objects it has seen
//! or written. Store events become keys in `ingest`. The parts take the data they work on
//! (`Ingest` borrows the cache, queue and indexes for one change); only this file holds the
//! controller.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::storage::v1::StorageClass;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};
use stowage_common::errors::{MetricLabel, PANIC};
use stowage_common::observe::events::Events;
use stowage_common::runtime::driver::{self, Inputs, Next, Pace, Reconciler, Retry};
use stowage_common::runtime::inflight::{Landed, Window};
use stowage_common::store::StoredPod;
use stowage_common::store::informer::Change;
use stowage_common::store::informers::Informers;
use stowage_common::store::{StoredClaim, StoredVolume};
use tokio::time::Instant;

use crate::core::{self, Action, Cache, Env, Event};
use crate::error::Error;
use crate::exec::{Executor, Outcome, Snapshot};
use crate::ingest::{Ingest, PodIndex, Unbound};
pub use crate::key::Key;
use crate::metrics::Metrics;
use crate::pv::*;
use crate::results::{failure_backoff, release_reservations, settle};
use stowage_common::runtime::queue::WorkQueue;

/// Binder settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Full resync period (upstream's --pvclaimbinder-sync-period).
    pub resync: Duration,
    /// Where the built-in driver keeps its images (used in shared mode).
    pub image_dir: PathBuf,
    /// Shared: one store this controller mounts too. Local: each node's agent makes, grows and
    /// deletes the images of its own store.
    pub store_mode: stowage_loopdriver::StoreMode,
    /// Objects whose writes may be in flight at once.
    pub max_in_flight: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            resync: Duration::from_secs(15),
            image_dir: PathBuf::from("/var/lib/stowage/images"),
            store_mode: Default::default(),
            max_in_flight: 64,
        }
    }
}

/// The single decision task's state.
struct Controller {
    /// Write tasks, one per key (see `Window`): dropped (aborted) with the controller when
    /// leadership ends, so a former leader stops writing at once. Keys are only decided while
    /// it has room.
    window: Window<Key, Outcome>,
    cache: Cache,
    queue: WorkQueue<Key>,
    /// Unbound claims by class, and the classes to wake (`ingest::Unbound`).
    unbound: Unbound,
    /// Which pods use which claim (delayed-binding events, Recycle waiting for pods).
    pods: PodIndex,
    cluster: Arc<Informers>,
    executor: Arc<Executor>,
}

pub async fn run(cluster: Arc<Informers>, metrics: Metrics, config: Config) -> anyhow::Result<()> {
    prepare(cluster, metrics, config).lead().await
}

/// A binder built before its term: the cache, volume index, unbound claims and pod index filled
/// from the stores and, on a warm standby, kept current from their feeds while the replica waits
/// (`Follow`), so a term starts deciding at once.
pub struct Prepared {
    ctl: Controller,
    inputs: Inputs<Input>,
    resync: Duration,
}

/// The binder's state from the stores as they are (full, on a warm standby: its task waits for
/// them). Nothing is queued yet: a term queues every key when it starts.
pub fn prepare(cluster: Arc<Informers>, metrics: Metrics, config: Config) -> Prepared {
    metrics.attach(cluster.pvs.store().clone(), cluster.pvcs.store().clone());
    // Subscribe before reading the stores so nothing falls between the two.
    let inputs = Inputs::new()
        .feed(cluster.pvs.feed(), Input::Volume)
        .feed(cluster.pvcs.feed(), Input::Claim)
        .feed(cluster.pods.feed(), Input::Pod)
        .feed(cluster.classes.feed(), |_| Input::Class);
    let client = cluster.client.clone();
    let mut ctl = Controller {
        window: Window::new(config.max_in_flight),
        cache: Cache::default(),
        // Unnamed until the term starts: keys a standby's changes touch are not work (see
        // `Prepared::follow`), and its queue metrics stay the leader's.
        queue: WorkQueue::default(),
        unbound: Unbound::default(),
        pods: PodIndex::default(),
        executor: Arc::new(Executor {
            pvs: Api::all(client.clone()),
            events: Events::new(client.clone(), "stowage-binder"),
            client,
            metrics,
            images: crate::loopdev::ImageStore::new(config.image_dir.clone()),
            store_mode: config.store_mode,
            live: Default::default(),
            store_check: Default::default(),
            timestamps: Default::default(),
        }),
        cluster,
    };
    ctl.ingest().pods_resync();
    ctl.ingest().resync();
    ctl.queue = WorkQueue::default();
    Prepared {
        ctl,
        inputs,
        resync: config.resync,
    }
}

impl Prepared {
    /// The term: every key queued (the claims waiting to bind first), then the run loop until a
    /// feed fails or the future is dropped.
    pub async fn lead(self) -> anyhow::Result<()> {
        let Prepared {
            mut ctl,
            inputs,
            resync,
        } = self;
        // One queue, reported as kube-controller-manager's two (its claim and volume queues).
        ctl.queue = WorkQueue::default().named_by(&["claims", "volumes"], |k| match k {
            Key::Claim(_) => 0,
            Key::Volume(_) => 1,
        });
        ctl.unbound.woken.clear();
        ctl.ingest().resync();
        let inputs = inputs
            .every(Instant::now() + resync, resync, || Input::Resync)
            // First check at once: the gauge is right from the start of the term.
            .every(Instant::now(), stowage_loopdriver::image::RECHECK, || {
                Input::StoreCheck
            });
        driver::run(ctl, inputs, Pace::default()).await
    }
}

impl stowage_common::runtime::standby::Follow for Prepared {
    /// Takes in each change as a term would, minus the work: the keys it touches and the classes
    /// it wakes are dropped, as the term queues everything when it starts.
    async fn follow(&mut self) -> anyhow::Result<()> {
        loop {
            let input = self.inputs.next().await?;
            self.ctl.input(input);
            if !self.ctl.queue.is_empty() {
                self.ctl.queue = WorkQueue::default();
            }
            self.ctl.unbound.woken.clear();
        }
    }
}

pub(crate) enum Input {
    Volume(Change<StoredVolume>),
    Claim(Change<StoredClaim>),
    Pod(Change<StoredPod>),
    /// A new or changed class can unblock claims waiting for it.
    Class,
    Resync,
    StoreCheck,
}

impl Reconciler for Controller {
    type Key = Key;
    type Input = Input;
    type Done = Outcome;
    type Error = Error;

    fn queue(&mut self) -> &mut WorkQueue<Key> {
        &mut self.queue
    }

    fn window(&mut self) -> Option<&mut Window<Key, Outcome>> {
        Some(&mut self.window)
    }

    fn input(&mut self, input: Input) {
        match input {
            Input::Volume(Change::Applied(pv)) => self.ingest().pv_seen(pv),
            Input::Volume(Change::Deleted(pv)) => self.ingest().pv_gone(&pv.decode()),
            Input::Claim(Change::Applied(c)) => self.ingest().claim_seen(c),
            Input::Claim(Change::Deleted(c)) => self.ingest().claim_gone(&c.decode()),
            Input::Volume(Change::Resynced) | Input::Claim(Change::Resynced) | Input::Resync => {
                self.ingest().resync()
            }
            Input::Pod(Change::Applied(p)) => self.ingest().pod_seen(&p, false),
            Input::Pod(Change::Deleted(p)) => self.ingest().pod_seen(&p, true),
            Input::Pod(Change::Resynced) => self.ingest().pods_resync(),
            Input::Class => self.unbound.wake_all(),
            Input::StoreCheck => self.executor.check_store(),
        }
    }

    /// Decided here; its writes (if any) are settled when they land, in `finish`.
    async fn reconcile(&mut self, key: Key) -> Result<Next, Error> {
        self.sync(key)
    }

    fn landed(&mut self, landed: Landed<Key, Outcome>) -> Result<Next, Error> {
        let (ing, window) = self.parts();
        settle(ing, window, landed)
    }

    /// Conflicts come back at the queue's quick pace (they pass once the cache catches up);
    /// any other failure after the binder's slower curve over the key's failures.
    fn error_policy(&mut self, key: &Key, error: Error, failures: u32) -> Retry {
        self.executor
            .metrics
            .errors
            .with_label_values(&[key.kind(), error.metric_label()])
            .inc();
        if error.is_conflict() {
            tracing::debug!(?key, %error, "sync conflicted, retrying");
            return Retry::Backoff;
        }
        let delay = failure_backoff(failures);
        tracing::warn!(?key, %error, ?delay, "binder sync failed");
        Retry::After(delay)
    }

    fn panicked(&mut self, key: &Key) {
        // A sync that panicked between reserving a volume and starting its writes leaves a
        // reservation no report will free; a running task's own is freed when it lands.
        if !self.window.is_running(key) {
            release_reservations(&mut self.cache, &self.window, key);
        }
        self.executor
            .metrics
            .errors
            .with_label_values(&[key.kind(), PANIC])
            .inc();
    }

    fn flush(&mut self) {
        self.unbound.flush(&mut self.queue);
    }

    fn before_wait(&mut self) {
        self.executor.metrics.queue_depth.set(self.queue.len() as i64);
    }
}

impl Controller {
    /// The state one change touches, borrowed for it (`ingest`).
    fn ingest(&mut self) -> Ingest<'_> {
        self.parts().0
    }

    /// `ingest`, and the window beside it (a landed task settles both).
    fn parts(&mut self) -> (Ingest<'_>, &mut Window<Key, Outcome>) {
        let ing = Ingest {
            cache: &mut self.cache,
            queue: &mut self.queue,
            unbound: &mut self.unbound,
            pods: &mut self.pods,
            executor: &self.executor,
            cluster: &self.cluster,
        };
        (ing, &mut self.window)
    }

    pub(crate) fn env_parts(&self) -> (Option<String>, kube::runtime::reflector::Store<StorageClass>) {
        let classes = self.cluster.classes.store().clone();
        let defaults: Vec<_> = classes
            .state()
            .into_iter()
            .filter(|c| {
                [ANN_DEFAULT_CLASS, ANN_BETA_DEFAULT_CLASS]
                    .iter()
                    .any(|a| ann(c.as_ref(), a) == Some("true"))
            })
            .collect();
        let default = core::newest_default_class(
            defaults
                .iter()
                .map(|c| (c.metadata.creation_timestamp.as_ref().map(|t| t.0), c.name_any())),
        );
        (default, classes)
    }

    /// Decides `key` and starts its writes; `Pending` while they run (or it waits for a bind's),
    /// `Done` when there was nothing to write, an error for a decision to retry later.
    pub(crate) fn sync(&mut self, key: Key) -> Result<Next, Error> {
        if self.window.defer_if_running(&key) {
            return Ok(Next::Pending);
        }
        // A volume being bound is synced after that bind's writes land.
        if let Key::Volume(name) = &key
            && self.cache.reserved.contains_key(name)
        {
            self.window.mark_dirty(key);
            return Ok(Next::Pending);
        }
        let (default_class, classes) = self.env_parts();
        let nodes = self.cluster.nodes.store().clone();
        let class_fn = |name: &str| classes.get(&ObjectRef::new(name));
        let node_fn = |name: &str| nodes.get(&ObjectRef::new(name)).map(|n| n.labels().clone());
        let pods = &self.pods;
        let pods_fn = |claim: &str| pods.of(claim);
        let capacities = self.cluster.capacities.as_ref().map(|c| c.store().clone());
        let room_fn = |class: &str| {
            capacities
                .as_ref()
                .map(|c| loop_room(c, class))
                .unwrap_or_default()
        };
        let publishing_fn = || capacities.as_ref().is_some_and(loop_publishing);
        let env = Env {
            class: &class_fn,
            default_class,
            node_labels: &node_fn,
            pods_of: &pods_fn,
            local: self.executor.store_mode.is_local(),
            room: &room_fn,
            publishing: &publishing_fn,
        };
        let timer = self
            .executor
            .metrics
            .decide_seconds
            .with_label_values(&[key.kind()])
            .start_timer();
        let actions = match &key {
            Key::Claim(k) => match self.cache.decode_claim(k) {
                Some(c) => core::sync_claim(&c, &self.cache, &env),
                None => vec![],
            },
            Key::Volume(n) => match self.cache.decode_pv(n) {
                Some(pv) => core::sync_volume(&pv, &self.cache, &env),
                None => vec![],
            },
        };
        timer.observe_duration();
        let kind = key.kind();
        let next = self.execute(key, actions);
        // Counted once its writes have started, so whoever sees the count also sees those writes
        // in `in_flight` until they land.
        self.executor.metrics.reconciles.with_label_values(&[kind]).inc();
        next
    }

    /// Handles the in-memory actions here and hands the API writes to a task of their own.
    pub(crate) fn execute(&mut self, key: Key, actions: Vec<Action>) -> Result<Next, Error> {
        let mut writes = Vec::new();
        let mut retry = None;
        for a in actions {
            match a {
                Action::WakeClaim(k) => self.queue.add(Key::Claim(k)),
                Action::Event(e) => self.event(e),
                Action::RetryLater { why } => retry = Some(why),
                other => writes.push(other),
            }
        }
        if writes.is_empty() {
            return match retry {
                Some(why) => Err(Error::InvalidState(why)),
                None => Ok(Next::Done),
            };
        }
        // Claim to reserve, objects as the cache has them now.
        let mut reserved = None;
        for w in &writes {
            if let Action::Bind { pv, claim } = w {
                self.cache.reserved.insert(pv.clone(), claim.clone());
                reserved = Some(pv.clone());
            }
        }
        let mut snapshot = Snapshot::of(&self.cache, &writes);
        for w in &writes {
            if let Action::ProvisionLoop { class, .. } = w
                && let Some(sc) = self.cluster.classes.store().get(&ObjectRef::new(class))
            {
                snapshot.classes.insert(class.clone(), sc);
            }
        }
        let executor = self.executor.clone();
        self.window.start(key.clone(), async move {
            let timer = executor
                .metrics
                .write_seconds
                .with_label_values(&[key.kind()])
                .start_timer();
            let mut done = Outcome::empty(reserved);
            for w in writes {
                if let Err(e) = executor.apply(&w, &snapshot, &mut done).await {
                    done.error = Some(e);
                    break;
                }
            }
            timer.observe_duration();
            done
        });
        self.executor.metrics.in_flight.set(self.window.len() as i64);
        Ok(Next::Pending)
    }

    fn event(&mut self, e: Event) {
        if let Some(reference) = crate::exec::reference(&self.cache, &e.target) {
            self.executor.report(&self.cache, e, reference);
        }
    }
}

/// Whether any node publishes room (for any class) under the driver's topology key.
fn loop_publishing(
    capacities: &kube::runtime::reflector::Store<k8s_openapi::api::storage::v1::CSIStorageCapacity>,
) -> bool {
    capacities.state().iter().any(|c| {
        c.node_topology
            .as_ref()
            .and_then(|t| t.match_labels.as_ref())
            .is_some_and(|l| l.contains_key(stowage_loopdriver::TOPOLOGY_KEY))
    })
}

/// The room each node's store publishes for `class`: (node, bytes) of the CSIStorageCapacity
/// objects of that class whose topology is one node of the driver (`maximumVolumeSize` first, as
/// the scheduler reads them).
fn loop_room(
    capacities: &kube::runtime::reflector::Store<k8s_openapi::api::storage::v1::CSIStorageCapacity>,
    class: &str,
) -> Vec<(String, u128)> {
    capacities
        .state()
        .iter()
        .filter(|c| c.storage_class_name == class)
        .filter_map(|c| {
            let node = c
                .node_topology
                .as_ref()?
                .match_labels
                .as_ref()?
                .get(stowage_loopdriver::TOPOLOGY_KEY)?;
            let q = c.maximum_volume_size.as_ref().or(c.capacity.as_ref())?;
            Some((node.clone(), stowage_common::store::quantity::bytes(&q.0)?))
        })
        .collect()
}

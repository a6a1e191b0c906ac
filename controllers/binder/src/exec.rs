//! The thin async layer. One task owns the cache and the queue and makes every decision serially
//! (so matching can never hand one volume to two claims); the writes of different objects run
//! concurrently, each object's writes in order, and their results come back to that task, which
//! keeps the newest objects it has seen or written.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{DeleteParams, PostParams};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Client, Resource, ResourceExt};
use stowage_common::cluster::Cluster;
use stowage_common::events::Events;
use stowage_common::inflight::{Landed, Window};
use stowage_common::informer::{Change, strip_managed_fields};
use tokio::time::Instant;

use crate::core::{self, Action, Cache, Env, Event, PodUse, Target};
use crate::loopdev;
use crate::metrics::Metrics;
use crate::objects::*;
use stowage_common::queue::WorkQueue;
use stowage_common::writes::{Writes, is_conflict, is_not_found};

/// Binder settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Full resync period (upstream's --pvclaimbinder-sync-period).
    pub resync: Duration,
    /// Where the built-in driver keeps its images.
    pub image_dir: PathBuf,
    /// Objects whose writes may be in flight at once.
    pub max_in_flight: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            resync: Duration::from_secs(15),
            image_dir: PathBuf::from("/var/lib/stowage/images"),
            max_in_flight: 64,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Key {
    Claim(String),
    Volume(String),
}

impl Key {
    fn kind(&self) -> &'static str {
        match self {
            Key::Claim(_) => "claim",
            Key::Volume(_) => "volume",
        }
    }
}

/// What a batch of writes reports back.
struct Done {
    key: Key,
    reserved: Option<String>,
    pvs: Vec<PersistentVolume>,
    claims: Vec<PersistentVolumeClaim>,
    /// Objects the batch deleted.
    deleted_pvs: Vec<String>,
    wake: Vec<Key>,
    /// Events the writes produced, with the object they are about (it may be gone from the
    /// cache by the time they land); the decision task sends each once per change of its text.
    events: Vec<(Event, ObjectReference)>,
    error: Option<(&'static str, String)>,
}

impl Done {
    /// Nothing written yet for `key`.
    fn empty(key: Key, reserved: Option<String>) -> Self {
        Self {
            key,
            reserved,
            pvs: vec![],
            claims: vec![],
            deleted_pvs: vec![],
            wake: vec![],
            events: vec![],
            error: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum WriteError {
    #[error("conflict: the object changed since it was read")]
    Conflict,
    #[error("{0}")]
    Api(kube::Error),
    #[error("{0}")]
    Image(#[from] loopdev::ImageError),
    #[error("claim {0} still exists; not releasing its volume")]
    ClaimStillThere(String),
}

impl WriteError {
    /// A stable category, used as metric label.
    fn category(&self) -> &'static str {
        match self {
            WriteError::Conflict => "Conflict",
            WriteError::Api(_) => "ApiError",
            WriteError::Image(_) => "ImageError",
            WriteError::ClaimStillThere(_) => "StaleCache",
        }
    }
}

/// Conflicts are their own category (expected under concurrency, retried quietly).
impl From<kube::Error> for WriteError {
    fn from(e: kube::Error) -> Self {
        if is_conflict(&e) {
            WriteError::Conflict
        } else {
            WriteError::Api(e)
        }
    }
}

/// Everything a write task needs; cheap to clone.
#[derive(Clone)]
struct Writer {
    client: Client,
    pvs: Api<PersistentVolume>,
    events: Events,
    metrics: Metrics,
    image_dir: PathBuf,
    /// The newest live list of built-in handles (see `live_handles`).
    live: Arc<tokio::sync::Mutex<Option<LiveHandles>>>,
}

/// Built-in handle → PV names, from a live list started at `started`.
struct LiveHandles {
    started: Instant,
    by_handle: Arc<HashMap<String, Vec<String>>>,
}

/// The single decision task's state.
struct Brain {
    /// Write tasks, one per key (see `Window`): dropped (aborted) with the controller when
    /// leadership ends, so a former leader stops writing at once. Keys are only decided while
    /// it has room.
    window: Window<Key, Done>,
    cache: Cache,
    queue: WorkQueue<Key>,
    /// Unbound claims (key → class) and the same by class, to wake the claims a freed volume
    /// could satisfy without scanning every claim.
    unbound: HashMap<String, String>,
    unbound_by_class: HashMap<String, HashSet<String>>,
    /// Classes whose unbound claims are to be woken at the next work pass.
    woken: HashSet<String>,
    /// Last event per object, so a condition that persists is reported once, not every resync.
    last_event: HashMap<Target, (&'static str, String)>,
    /// Consecutive failures (other than conflicts) per key, for the retry backoff.
    failing: HashMap<Key, u32>,
    /// Which pods use which claim (delayed-binding events, Recycle waiting for pods).
    pods: PodIndex,
    cluster: Arc<Cluster>,
    writer: Writer,
}

pub async fn run(cluster: Arc<Cluster>, metrics: Metrics, config: Config) -> anyhow::Result<()> {
    metrics.attach(cluster.pvs.store().clone(), cluster.pvcs.store().clone());
    // Subscribe before reading the stores so nothing falls between the two.
    let mut pv_feed = cluster.pvs.feed();
    let mut pvc_feed = cluster.pvcs.feed();
    let mut class_feed = cluster.classes.feed();
    let mut pod_feed = cluster.pods.feed();
    let client = cluster.client.clone();
    let mut brain = Brain {
        window: Window::new(config.max_in_flight),
        cache: Cache::default(),
        queue: WorkQueue::default().named("binder"),
        unbound: HashMap::new(),
        unbound_by_class: HashMap::new(),
        woken: HashSet::new(),
        last_event: HashMap::new(),
        failing: HashMap::new(),
        pods: PodIndex::default(),
        writer: Writer {
            pvs: Api::all(client.clone()),
            events: Events::new(client.clone(), "stowage-binder"),
            client,
            metrics,
            image_dir: config.image_dir.clone(),
            live: Arc::default(),
        },
        cluster,
    };
    brain.pods_resync();
    brain.resync();
    let mut resync = tokio::time::interval_at(Instant::now() + config.resync, config.resync);
    loop {
        brain.writer.metrics.queue_depth.set(brain.queue.len() as i64);
        brain.queue.report(Instant::now());
        let next_due = brain.queue.next_due();
        tokio::select! {
            biased;
            landed = brain.window.next() => brain.finish(landed),
            r = pv_feed.next() => match r? {
                Change::Applied(pv) => brain.pv_seen(pv),
                Change::Deleted(pv) => brain.pv_gone(&pv),
                Change::Resynced => brain.resync(),
            },
            r = pvc_feed.next() => match r? {
                Change::Applied(c) => brain.claim_seen(c),
                Change::Deleted(c) => brain.claim_gone(&c),
                Change::Resynced => brain.resync(),
            },
            r = pod_feed.next() => match r? {
                Change::Applied(p) => brain.pod_seen(&p, false),
                Change::Deleted(p) => brain.pod_seen(&p, true),
                Change::Resynced => brain.pods_resync(),
            },
            // A new or changed class can unblock claims waiting for it.
            r = class_feed.next() => { r?; brain.wake_pending_claims() }
            _ = resync.tick() => brain.resync(),
            _ = std::future::ready(()), if brain.window.has_room() && (brain.queue.has_ready() || !brain.woken.is_empty()) => {
                brain.work(Instant::now())
            }
            // A landing batch wakes the loop, so a full window needs no timer.
            _ = tokio::time::sleep_until(next_due.unwrap_or_else(Instant::now)), if next_due.is_some() && brain.window.has_room() => {
                brain.work(Instant::now())
            }
        }
    }
}

impl Brain {
    fn env_parts(&self) -> (Option<String>, kube::runtime::reflector::Store<StorageClass>) {
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

    /// Reloads the cache from the stores (keeping newer objects we wrote) and queues everything.
    fn resync(&mut self) {
        let pvs = self.cluster.pvs.store().state();
        let claims = self.cluster.pvcs.store().state();
        let live_pvs: HashSet<String> = pvs.iter().map(|p| p.name_any()).collect();
        let live_claims: HashSet<String> = claims.iter().map(|c| claim_key(c)).collect();
        // Objects deleted while a watch was down vanish from the store without an event.
        let gone_pvs: Vec<String> = self
            .cache
            .pvs
            .keys()
            .filter(|k| !live_pvs.contains(*k))
            .cloned()
            .collect();
        let gone_claims: Vec<String> = self
            .cache
            .claims
            .keys()
            .filter(|k| !live_claims.contains(*k))
            .cloned()
            .collect();
        for name in gone_pvs {
            if let Some(pv) = self.cache.remove_pv(&name) {
                self.pv_gone(&pv);
            }
        }
        for key in gone_claims {
            if let Some(c) = self.cache.remove_claim(&key) {
                self.claim_gone(&c);
            }
        }
        // A key backing off after a failure keeps its delay: the resync must not turn the
        // backoff into a retry every period (a change to the object still wakes it).
        for pv in pvs {
            self.requeue(Key::Volume(pv.name_any()));
            self.cache.put_pv(pv);
        }
        for c in claims {
            let key = claim_key(&c);
            self.requeue(Key::Claim(key.clone()));
            if self.cache.put_claim(c.clone()) {
                self.track_claim(&key, Some(&c));
            }
        }
    }

    /// Queues `key` now unless it is backing off after a failure.
    fn requeue(&mut self, key: Key) {
        if !self.failing.contains_key(&key) {
            self.queue.add(key);
        }
    }

    fn pv_seen(&mut self, pv: Arc<PersistentVolume>) {
        let name = pv.name_any();
        let was_free = self.cache.pvs.get(&name).is_some_and(|old| is_free(old));
        if self.cache.put_pv(pv.clone()) {
            self.queue.add(Key::Volume(name));
            // A volume that just became available may satisfy a waiting claim: wake the claims
            // of its class now instead of at the next resync (upstream waits, kubernetes#71761).
            if is_free(&pv) && !was_free {
                self.wake_claims_of_class(pv_class(&pv).to_string());
            }
        }
    }

    fn pv_gone(&mut self, pv: &PersistentVolume) {
        let name = pv.name_any();
        // The other volumes naming the same image may now delete it.
        for other in self.cache.sharing_handle(pv) {
            self.queue.add(Key::Volume(other));
        }
        self.cache.remove_pv(&name);
        self.failing.remove(&Key::Volume(name.clone()));
        self.last_event.remove(&Target::Volume(name));
        if let Some((ns, n, _)) = claim_ref(pv) {
            self.queue.add(Key::Claim(format!("{ns}/{n}")));
        }
    }

    fn claim_seen(&mut self, c: Arc<PersistentVolumeClaim>) {
        let key = claim_key(&c);
        if self.cache.put_claim(c.clone()) {
            self.track_claim(&key, Some(&c));
            self.queue.add(Key::Claim(key));
        }
    }

    fn claim_gone(&mut self, c: &PersistentVolumeClaim) {
        let key = claim_key(c);
        self.cache.remove_claim(&key);
        self.track_claim(&key, None);
        self.failing.remove(&Key::Claim(key.clone()));
        self.last_event.remove(&Target::Claim(key.clone()));
        let vol = claim_volume_name(c);
        if !vol.is_empty() {
            self.queue.add(Key::Volume(vol.to_string()));
        }
        // A claim that went away may have been waiting on a provisioned volume.
        let prebound: Vec<String> = self.cache.index.prebound_to(&key).map(String::from).collect();
        for pv in prebound {
            self.queue.add(Key::Volume(pv));
        }
    }

    /// Indexes a pod's claims; a change wakes what waits on pods: an unbound claim (its
    /// WaitForPodScheduled event) and a volume still naming the claim (Recycle waits for pods).
    fn pod_seen(&mut self, pod: &Pod, gone: bool) {
        for claim in self.pods.update(pod, gone) {
            if self.unbound.contains_key(&claim) {
                self.queue.add(Key::Claim(claim.clone()));
            }
            let pvs: Vec<String> = self.cache.index.prebound_to(&claim).map(String::from).collect();
            for pv in pvs {
                self.queue.add(Key::Volume(pv));
            }
        }
    }

    fn pods_resync(&mut self) {
        self.pods = PodIndex::default();
        for p in self.cluster.pods.store().state() {
            self.pods.update(&p, false);
        }
    }

    /// Keeps the index of unbound claims by class in step with the cache.
    fn track_claim(&mut self, key: &str, claim: Option<&PersistentVolumeClaim>) {
        if let Some(old) = self.unbound.remove(key)
            && let Some(set) = self.unbound_by_class.get_mut(&old)
        {
            set.remove(key);
            if set.is_empty() {
                self.unbound_by_class.remove(&old);
            }
        }
        if let Some(c) = claim.filter(|c| !has_ann(*c, ANN_BIND_COMPLETED)) {
            let class = claim_class(c).unwrap_or("").to_string();
            self.unbound_by_class
                .entry(class.clone())
                .or_default()
                .insert(key.to_string());
            self.unbound.insert(key.to_string(), class);
        }
    }

    /// Marks a class whose unbound claims should be synced; the wake-ups of a burst of freed
    /// volumes are coalesced into one pass over the class's claims (`flush_wakeups`).
    fn wake_claims_of_class(&mut self, class: String) {
        self.woken.insert(class);
    }

    fn wake_pending_claims(&mut self) {
        let classes: Vec<String> = self.unbound_by_class.keys().cloned().collect();
        self.woken.extend(classes);
    }

    fn flush_wakeups(&mut self) {
        for class in std::mem::take(&mut self.woken) {
            for key in self.unbound_by_class.get(&class).into_iter().flatten() {
                self.queue.add(Key::Claim(key.clone()));
            }
        }
    }

    /// Takes ready keys while writes may start (a bounded batch, so results and watch events
    /// are not starved).
    fn work(&mut self, now: Instant) {
        self.flush_wakeups();
        for _ in 0..256 {
            if !self.window.has_room() {
                return;
            }
            let Some(key) = self.queue.pop(now) else { return };
            self.sync(key);
        }
    }

    fn sync(&mut self, key: Key) {
        if self.window.defer_if_running(&key) {
            return;
        }
        // A volume being bound is synced after that bind's writes land.
        if let Key::Volume(name) = &key
            && self.cache.reserved.contains_key(name)
        {
            self.window.mark_dirty(key);
            return;
        }
        let (default_class, classes) = self.env_parts();
        let nodes = self.cluster.nodes.store().clone();
        let class_fn = |name: &str| classes.get(&ObjectRef::new(name));
        let node_fn = |name: &str| nodes.get(&ObjectRef::new(name)).map(|n| n.labels().clone());
        let pods = &self.pods;
        let pods_fn = |claim: &str| pods.of(claim);
        let env = Env {
            class: &class_fn,
            default_class,
            node_labels: &node_fn,
            pods_of: &pods_fn,
        };
        let timer = self
            .writer
            .metrics
            .decide_seconds
            .with_label_values(&[key.kind()])
            .start_timer();
        let actions = match &key {
            Key::Claim(k) => match self.cache.claims.get(k) {
                Some(c) => core::sync_claim(c, &self.cache, &env),
                None => vec![],
            },
            Key::Volume(n) => match self.cache.pvs.get(n) {
                Some(pv) => core::sync_volume(pv, &self.cache, &env),
                None => vec![],
            },
        };
        timer.observe_duration();
        self.writer
            .metrics
            .reconciles
            .with_label_values(&[key.kind()])
            .inc();
        self.execute(key, actions);
    }

    /// Handles the in-memory actions here and hands the API writes to a task of their own.
    fn execute(&mut self, key: Key, actions: Vec<Action>) {
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
            match retry {
                Some(why) => self.backoff(key, "Invalid", &why, Instant::now()),
                None => {
                    self.queue.forget(&key);
                    self.failing.remove(&key);
                }
            }
            return;
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
        let writer = self.writer.clone();
        self.window.start(key.clone(), async move {
            let timer = writer
                .metrics
                .write_seconds
                .with_label_values(&[key.kind()])
                .start_timer();
            let mut done = Done::empty(key, reserved);
            for w in writes {
                if let Err(e) = writer.apply(&w, &snapshot, &mut done).await {
                    done.error = Some((e.category(), e.to_string()));
                    break;
                }
            }
            timer.observe_duration();
            done
        });
        self.writer.metrics.in_flight.set(self.window.len() as i64);
    }

    fn event(&mut self, e: Event) {
        if let Some(reference) = self.reference(&e.target) {
            self.send_event(e, reference);
        }
    }

    /// Sends `e` unless it repeats the last event about the same object: a condition that
    /// persists is reported once per change of its text, however often it is retried.
    fn send_event(&mut self, e: Event, reference: ObjectReference) {
        let key = (e.reason, e.note.clone());
        if self.last_event.get(&e.target) == Some(&key) {
            return;
        }
        let known = match &e.target {
            Target::Claim(k) => self.cache.claims.contains_key(k),
            Target::Volume(n) => self.cache.pvs.contains_key(n),
        };
        // Only objects still known are remembered (their removal forgets them).
        if known {
            self.last_event.insert(e.target.clone(), key);
        }
        if e.warning {
            self.writer.metrics.warnings.with_label_values(&[e.reason]).inc();
        }
        if e.warning {
            self.writer
                .events
                .warning(&reference, e.reason, "Binding", e.note);
        } else {
            self.writer.events.normal(&reference, e.reason, "Binding", e.note);
        }
    }

    fn reference(&self, t: &Target) -> Option<ObjectReference> {
        Some(match t {
            Target::Claim(k) => self.cache.claims.get(k)?.object_ref(&()),
            Target::Volume(n) => self.cache.pvs.get(n)?.object_ref(&()),
        })
    }

    /// Counts a failed sync and retries its key: conflicts at the queue's quick pace (they pass
    /// once the cache catches up), anything else with the failure backoff.
    fn backoff(&mut self, key: Key, category: &'static str, msg: &str, now: Instant) {
        self.writer
            .metrics
            .errors
            .with_label_values(&[key.kind(), category])
            .inc();
        let delay = if category == "Conflict" {
            self.queue.retry(key.clone(), now)
        } else {
            let n = self.failing.entry(key.clone()).or_insert(0);
            let delay = failure_backoff(*n);
            *n = n.saturating_add(1);
            self.queue.retry_at(key.clone(), now, now + delay);
            delay
        };
        tracing::debug!(?key, %msg, ?delay, "sync failed, retrying");
        if category != "Conflict" {
            tracing::warn!(?key, error = %msg, "binder sync failed");
        }
    }

    /// Takes a batch's results: newest objects into the cache, reservation released, and the
    /// key requeued — at once if it changed meanwhile, with backoff if the batch failed.
    fn finish(&mut self, landed: Landed<Key, Done>) {
        let now = Instant::now();
        self.writer.metrics.in_flight.set(self.window.len() as i64);
        let done = landed.result.unwrap_or_else(|| {
            // The task died with its report: free what it may have reserved and retry the key.
            match &landed.key {
                Key::Claim(k) => self.cache.reserved.retain(|_, c| c != k),
                Key::Volume(n) => {
                    self.cache.reserved.remove(n);
                }
            }
            Done {
                error: Some(("Panic", "write task panicked".into())),
                ..Done::empty(landed.key.clone(), None)
            }
        });
        if let Some(pv) = &done.reserved {
            self.cache.reserved.remove(pv);
            if self.window.take_dirty(&Key::Volume(pv.clone())) {
                self.queue.add(Key::Volume(pv.clone()));
            }
        }
        for name in &done.deleted_pvs {
            if let Some(pv) = self.cache.remove_pv(name) {
                self.pv_gone(&pv);
            }
        }
        // Write responses carry managedFields; the informers drop them, and so does the cache.
        for mut pv in done.pvs {
            strip_managed_fields(&mut pv);
            self.pv_seen(Arc::new(pv));
        }
        for mut c in done.claims {
            strip_managed_fields(&mut c);
            self.claim_seen(Arc::new(c));
        }
        for k in done.wake {
            self.queue.add(k);
        }
        for (e, reference) in done.events {
            self.send_event(e, reference);
        }
        match done.error {
            Some((category, msg)) => self.backoff(done.key, category, &msg, now),
            None => {
                self.queue.forget(&done.key);
                self.failing.remove(&done.key);
                if landed.dirty {
                    self.queue.add(done.key);
                }
            }
        }
    }
}

/// Applies an `Action::Annotate` to an object's metadata.
fn edit_metadata<K: ResourceExt>(
    o: &mut K,
    set: &BTreeMap<String, String>,
    remove: &[String],
    drop: &[String],
    add: &[String],
) {
    let anns = o.annotations_mut();
    for k in remove {
        anns.remove(k);
    }
    anns.extend(set.iter().map(|(k, v)| (k.clone(), v.clone())));
    let fins = o.finalizers_mut();
    fins.retain(|f| !drop.contains(f));
    for f in add {
        if !fins.contains(f) {
            fins.push(f.clone());
        }
    }
}

/// An event about the claim `reference` names.
fn claim_event(
    reference: ObjectReference,
    warning: bool,
    reason: &'static str,
    note: String,
) -> (Event, ObjectReference) {
    let e = Event {
        target: Target::Claim(ref_key(&reference)),
        warning,
        reason,
        note,
    };
    (e, reference)
}

/// The cache key (namespace/name) of the claim `r` names.
fn ref_key(r: &ObjectReference) -> String {
    format!(
        "{}/{}",
        r.namespace.as_deref().unwrap_or(""),
        r.name.as_deref().unwrap_or("")
    )
}

/// An event about volume `pv`.
fn volume_event(
    pv: &PersistentVolume,
    warning: bool,
    reason: &'static str,
    note: String,
) -> (Event, ObjectReference) {
    let e = Event {
        target: Target::Volume(pv.name_any()),
        warning,
        reason,
        note,
    };
    (e, pv.object_ref(&()))
}

/// A reference to the claim a volume's claimRef names.
fn claim_of(pv: &PersistentVolume) -> Option<ObjectReference> {
    claim_ref(pv).map(|(ns, n, uid)| ObjectReference {
        kind: Some("PersistentVolumeClaim".into()),
        api_version: Some("v1".into()),
        namespace: Some(ns.into()),
        name: Some(n.into()),
        uid: (!uid.is_empty()).then(|| uid.into()),
        ..Default::default()
    })
}

/// Claim key → the pods (not terminated) that use it, and back.
#[derive(Default)]
struct PodIndex {
    by_claim: HashMap<String, BTreeMap<String, bool>>,
    by_pod: HashMap<String, Vec<String>>,
}

impl PodIndex {
    fn of(&self, claim: &str) -> Vec<PodUse> {
        self.by_claim
            .get(claim)
            .into_iter()
            .flatten()
            .map(|(name, scheduled)| PodUse {
                name: name.clone(),
                scheduled: *scheduled,
            })
            .collect()
    }

    /// Records `pod` (or its removal); returns the claims whose pods changed.
    fn update(&mut self, pod: &Pod, gone: bool) -> Vec<String> {
        let ns = pod.namespace().unwrap_or_default();
        let name = pod.name_any();
        let pod_key = format!("{ns}/{name}");
        let scheduled = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_deref())
            .is_some_and(|n| !n.is_empty());
        let now: Vec<String> = if gone || stowage_common::objects::pod_terminated(pod) {
            vec![]
        } else {
            stowage_common::objects::pod_claims(pod)
                .into_iter()
                .map(|c| format!("{ns}/{}", c.claim))
                .collect()
        };
        let before = self.by_pod.remove(&pod_key).unwrap_or_default();
        let mut changed = Vec::new();
        for c in &before {
            if !now.contains(c)
                && let Some(m) = self.by_claim.get_mut(c)
            {
                m.remove(&name);
                if m.is_empty() {
                    self.by_claim.remove(c);
                }
                changed.push(c.clone());
            }
        }
        for c in &now {
            let old = self
                .by_claim
                .entry(c.clone())
                .or_default()
                .insert(name.clone(), scheduled);
            if old != Some(scheduled) {
                changed.push(c.clone());
            }
        }
        if !now.is_empty() {
            self.by_pod.insert(pod_key, now);
        }
        changed
    }
}

/// Retry delay after `n` earlier consecutive failures that are not conflicts (an image that
/// cannot be created or removed, an API error): 1 s doubling to 5 min, external-provisioner's
/// defaults for provisioning and deletion retries. Conflicts keep the queue's quick 5 ms → 60 s
/// steps: they pass as soon as the cache catches up.
pub fn failure_backoff(n: u32) -> Duration {
    const START: Duration = Duration::from_secs(1);
    const MAX: Duration = Duration::from_secs(300);
    START.saturating_mul(1u32 << n.min(16)).min(MAX)
}

/// The last copy of object `key` written in this batch, else the one the batch started from.
fn newest<K: Clone>(
    written: &[K],
    start: &HashMap<String, Arc<K>>,
    key: &str,
    key_of: impl Fn(&K) -> String,
) -> Option<K> {
    written
        .iter()
        .rev()
        .find(|o| key_of(o) == key)
        .cloned()
        .or_else(|| start.get(key).map(|o| (**o).clone()))
}

/// A volume offered to any claim of its class.
fn is_free(pv: &PersistentVolume) -> bool {
    claim_ref(pv).is_none() && pv_phase(pv) == "Available" && !being_deleted(pv)
}

/// The objects the writes of one sync start from (as the cache had them).
struct Snapshot {
    pvs: HashMap<String, Arc<PersistentVolume>>,
    claims: HashMap<String, Arc<PersistentVolumeClaim>>,
    classes: HashMap<String, Arc<StorageClass>>,
}

impl Snapshot {
    fn of(cache: &Cache, writes: &[Action]) -> Self {
        let mut s = Snapshot {
            pvs: HashMap::new(),
            claims: HashMap::new(),
            classes: HashMap::new(),
        };
        let mut pv = |n: &str| {
            if let Some(p) = cache.pvs.get(n) {
                s.pvs.insert(n.to_string(), p.clone());
            }
        };
        let mut claim_names = Vec::new();
        for w in writes {
            match w {
                Action::Bind { pv: p, claim } => {
                    pv(p);
                    claim_names.push(claim.clone());
                }
                Action::VolumePhase { pv: p, .. }
                | Action::Release { pv: p }
                | Action::Unbind { pv: p }
                | Action::CreateLoopImage { pv: p }
                | Action::DeleteLoopVolume { pv: p }
                | Action::SetDeleterFinalizer { pv: p, .. } => pv(p),
                Action::ClaimPhase { claim, .. }
                | Action::ClaimCondition { claim, .. }
                | Action::SetProvisioner { claim, .. }
                | Action::SetDefaultClass { claim, .. }
                | Action::ProvisionLoop { claim, .. } => claim_names.push(claim.clone()),
                Action::Annotate {
                    target: Target::Volume(p),
                    ..
                } => pv(p),
                Action::Annotate {
                    target: Target::Claim(claim),
                    ..
                } => claim_names.push(claim.clone()),
                Action::WakeClaim(_) | Action::Event(_) | Action::RetryLater { .. } => {}
            }
        }
        for c in claim_names {
            if let Some(obj) = cache.claims.get(&c) {
                // A provisioned volume that already exists makes provisioning a no-op.
                if let Some(name) = loopdev::provisioned_name(obj)
                    && let Some(p) = cache.pvs.get(&name)
                {
                    s.pvs.insert(name, p.clone());
                }
                s.claims.insert(c, obj.clone());
            }
        }
        s
    }
}

impl Writer {
    fn claims(&self, ns: &str) -> Api<PersistentVolumeClaim> {
        Api::namespaced(self.client.clone(), ns)
    }

    fn count(&self, op: &str) {
        self.metrics.writes.with_label_values(&[op]).inc();
    }

    fn writes(&self) -> Writes {
        Writes::new(self.client.clone(), self.metrics.writes.clone())
    }

    /// The newest copy of a PV within this batch (an earlier write may have returned it).
    fn pv(snap: &Snapshot, done: &Done, name: &str) -> Option<PersistentVolume> {
        newest(&done.pvs, &snap.pvs, name, |p| p.name_any())
    }

    fn claim(snap: &Snapshot, done: &Done, key: &str) -> Option<PersistentVolumeClaim> {
        newest(&done.claims, &snap.claims, key, claim_key)
    }

    /// Whether the claim a volume points at still exists with the UID it names (a live read:
    /// the cache may lag a claim just created by someone else, and what follows is destructive).
    async fn claim_still_there(&self, pv: &PersistentVolume) -> Result<bool, WriteError> {
        let Some((ns, name, uid)) = claim_ref(pv) else {
            return Ok(false);
        };
        match self.claims(ns).get_opt(name).await? {
            Some(c) => Ok(c.metadata.uid.as_deref() == Some(uid) && {
                let vol = claim_volume_name(&c);
                vol.is_empty() || vol == pv.name_any()
            }),
            None => Ok(false),
        }
    }

    async fn apply(&self, action: &Action, snap: &Snapshot, done: &mut Done) -> Result<(), WriteError> {
        match action {
            Action::Bind { pv, claim } => {
                let (Some(mut v), Some(mut c)) = (Self::pv(snap, done, pv), Self::claim(snap, done, claim))
                else {
                    return Ok(());
                };
                if let Some(next) = core::bound_pv_spec(&v, &c) {
                    v = self.writes().replace_pv(&next, "bind_volume").await?;
                    done.pvs.push(v.clone());
                }
                if let Some(next) = core::bound_pv_status(&v) {
                    v = self
                        .writes()
                        .replace_pv_status(&next, "bind_volume_status")
                        .await?;
                    done.pvs.push(v.clone());
                }
                if let Some(next) = core::bound_claim_spec(&c, pv) {
                    c = self.writes().replace_claim(&next, "bind_claim").await?;
                    done.claims.push(c.clone());
                }
                if let Some(next) = core::bound_claim_status(&c, &v) {
                    let became_bound = claim_phase(&c) != "Bound";
                    c = self
                        .writes()
                        .replace_claim_status(&next, "bind_claim_status")
                        .await?;
                    if became_bound && let Some(created) = c.metadata.creation_timestamp.as_ref() {
                        let age = k8s_openapi::jiff::Timestamp::now().duration_since(created.0);
                        self.metrics.bind_latency.observe(age.as_secs_f64().max(0.0));
                    }
                    done.claims.push(c);
                }
            }
            Action::ClaimPhase { claim, phase } => {
                let Some(c) = Self::claim(snap, done, claim) else {
                    return Ok(());
                };
                if let Some(next) = core::with_claim_phase(&c, phase) {
                    done.claims
                        .push(self.writes().replace_claim_status(&next, "claim_phase").await?);
                }
            }
            Action::VolumePhase { pv, phase, message } => {
                let Some(v) = Self::pv(snap, done, pv) else {
                    return Ok(());
                };
                done.pvs.push(
                    self.writes()
                        .replace_pv_status(&core::with_pv_phase(&v, phase, message), "volume_phase")
                        .await?,
                );
            }
            Action::Release { pv } => {
                let Some(v) = Self::pv(snap, done, pv) else {
                    return Ok(());
                };
                if self.claim_still_there(&v).await? {
                    // Our cache had not seen the claim yet; sync both again.
                    if let Some((ns, n, _)) = claim_ref(&v) {
                        done.wake.push(Key::Claim(format!("{ns}/{n}")));
                    }
                    return Err(WriteError::ClaimStillThere(format!("{:?}", claim_ref(&v))));
                }
                let next = core::with_pv_phase(&v, "Released", "");
                done.pvs
                    .push(self.writes().replace_pv_status(&next, "volume_phase").await?);
                done.wake.push(Key::Volume(pv.clone()));
            }
            Action::Unbind { pv } => {
                let Some(v) = Self::pv(snap, done, pv) else {
                    return Ok(());
                };
                let v = self
                    .writes()
                    .replace_pv(&core::unbound_pv(&v), "unbind_volume")
                    .await?;
                done.pvs.push(v.clone());
                if pv_phase(&v) != "Available" {
                    let next = core::with_pv_phase(&v, "Available", "");
                    done.pvs
                        .push(self.writes().replace_pv_status(&next, "volume_phase").await?);
                }
            }
            Action::SetProvisioner { claim, provisioner } => {
                let Some(mut c) = Self::claim(snap, done, claim) else {
                    return Ok(());
                };
                c.annotations_mut()
                    .insert(ANN_STORAGE_PROVISIONER.into(), provisioner.clone());
                c.annotations_mut()
                    .insert(ANN_BETA_STORAGE_PROVISIONER.into(), provisioner.clone());
                done.claims
                    .push(self.writes().replace_claim(&c, "set_provisioner").await?);
            }
            Action::SetDefaultClass { claim, class } => {
                let Some(mut c) = Self::claim(snap, done, claim) else {
                    return Ok(());
                };
                c.spec.get_or_insert_with(Default::default).storage_class_name = Some(class.clone());
                done.claims
                    .push(self.writes().replace_claim(&c, "set_default_class").await?);
            }
            Action::ProvisionLoop { claim, class } => self.provision(snap, done, claim, class).await?,
            Action::CreateLoopImage { pv } => self.create_image(snap, done, pv).await?,
            Action::DeleteLoopVolume { pv } => self.delete_volume(snap, done, pv).await?,
            Action::SetDeleterFinalizer { pv, present } => {
                let Some(mut v) = Self::pv(snap, done, pv) else {
                    return Ok(());
                };
                let fins = v.finalizers_mut();
                fins.retain(|f| f != FINALIZER_LOOP_DELETER);
                if *present {
                    fins.push(FINALIZER_LOOP_DELETER.into());
                }
                done.pvs
                    .push(self.writes().replace_pv(&v, "deleter_finalizer").await?);
            }
            Action::ClaimCondition {
                claim,
                reason,
                message,
            } => {
                let Some(c) = Self::claim(snap, done, claim) else {
                    return Ok(());
                };
                let next =
                    core::with_pending_condition(&c, reason, message, k8s_openapi::jiff::Timestamp::now());
                done.claims.push(
                    self.writes()
                        .replace_claim_status(&next, "claim_condition")
                        .await?,
                );
            }
            Action::Annotate {
                target,
                set,
                remove,
                drop_finalizers,
                add_finalizers,
                op,
            } => match target {
                Target::Claim(claim) => {
                    let Some(mut c) = Self::claim(snap, done, claim) else {
                        return Ok(());
                    };
                    edit_metadata(&mut c, set, remove, drop_finalizers, add_finalizers);
                    done.claims.push(self.writes().replace_claim(&c, op).await?);
                }
                Target::Volume(pv) => {
                    let Some(mut v) = Self::pv(snap, done, pv) else {
                        return Ok(());
                    };
                    edit_metadata(&mut v, set, remove, drop_finalizers, add_finalizers);
                    done.pvs.push(self.writes().replace_pv(&v, op).await?);
                }
            },
            Action::WakeClaim(_) | Action::Event(_) | Action::RetryLater { .. } => {}
        }
        Ok(())
    }

    async fn provision(
        &self,
        snap: &Snapshot,
        done: &mut Done,
        claim: &str,
        class: &str,
    ) -> Result<(), WriteError> {
        let Some(c) = Self::claim(snap, done, claim) else {
            return Ok(());
        };
        let Some(name) = loopdev::provisioned_name(&c) else {
            return Ok(());
        };
        if snap.pvs.contains_key(&name) {
            return Ok(()); // created already; its own sync creates the image
        }
        let Some(sc) = snap.classes.get(class) else {
            return Ok(());
        };
        let Some(pv) = loopdev::provisioned_pv(&c, sc) else {
            let note = "claim has no storage request; cannot provision".to_string();
            done.events
                .push(claim_event(c.object_ref(&()), true, "ProvisioningFailed", note));
            return Ok(());
        };
        self.count("provision_volume");
        match self.pvs.create(&PostParams::default(), &pv).await {
            Ok(created) => done.pvs.push(created),
            // Idempotent by name: an earlier attempt created it.
            Err(kube::Error::Api(s)) if s.code == 409 => {
                if let Some(existing) = self.pvs.get_opt(&name).await? {
                    done.pvs.push(existing);
                }
            }
            Err(e) => {
                self.metrics.provisioning.with_label_values(&["failed"]).inc();
                let note = format!("failed to create volume {name}: {e}");
                done.events
                    .push(claim_event(c.object_ref(&()), true, "ProvisioningFailed", note));
                return Err(WriteError::Api(e));
            }
        }
        Ok(())
    }

    async fn create_image(&self, snap: &Snapshot, done: &mut Done, pv: &str) -> Result<(), WriteError> {
        let Some(mut v) = Self::pv(snap, done, pv) else {
            return Ok(());
        };
        let claim = claim_of(&v);
        let handle = volume_handle(&v).unwrap_or_default().to_string();
        let capacity = pv_capacity(&v).unwrap_or(0);
        let dir = self.image_dir.clone();
        let h = handle.clone();
        let made = tokio::task::spawn_blocking(move || {
            // A size no file offset can express is refused here, never rounded or truncated.
            let size = u64::try_from(capacity).map_err(|_| loopdev::ImageError::Io {
                path: dir.join(format!("{h}.img")),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("{capacity} bytes is more than a file can hold"),
                ),
            })?;
            loopdev::ImageStore::new(dir).ensure(&h, size)
        })
        .await
        .unwrap_or_else(|e| {
            Err(loopdev::ImageError::Io {
                path: PathBuf::new(),
                source: std::io::Error::other(e),
            })
        });
        if let Err(e) = made {
            self.metrics.provisioning.with_label_values(&["failed"]).inc();
            let msg = format!(
                "cannot create the {} image of volume {pv}: {e}",
                core::human(capacity)
            );
            if e.permanent() {
                // No retry can fix it: the volume ends Failed (still pending, so nothing binds
                // to it) and deletable; its claim reports the reason (`core::loop_refusal`).
                let next = core::with_pv_phase(&v, "Failed", &msg);
                done.pvs
                    .push(self.writes().replace_pv_status(&next, "volume_phase").await?);
                if let Some(t) = claim {
                    done.wake.push(Key::Claim(ref_key(&t)));
                }
                return Ok(());
            }
            if let Some(t) = claim {
                let note = format!("{msg}; retrying");
                done.events.push(claim_event(t, true, "ProvisioningFailed", note));
            }
            return Err(e.into());
        }
        v.annotations_mut().remove(ANN_IMAGE_PENDING);
        done.pvs
            .push(self.writes().replace_pv(&v, "provision_image").await?);
        self.metrics.provisioning.with_label_values(&["succeeded"]).inc();
        if let Some(t) = claim {
            let note = format!(
                "Successfully provisioned volume {pv} ({} image {handle}.img)",
                core::human(capacity)
            );
            done.wake.push(Key::Claim(ref_key(&t)));
            done.events
                .push(claim_event(t, false, "ProvisioningSucceeded", note));
        }
        Ok(())
    }

    /// Every built-in handle and the PVs naming it, from a live (paged) list that started no
    /// earlier than `since`: the cache may lag a PV just created, and removing an image is
    /// final. One list at a time, shared by every deletion that began before it started, so a
    /// burst of deletions costs a few lists, not one each.
    async fn live_handles(&self, since: Instant) -> Result<Arc<HashMap<String, Vec<String>>>, WriteError> {
        let mut last = self.live.lock().await;
        if let Some(l) = last.as_ref()
            && l.started >= since
        {
            return Ok(l.by_handle.clone());
        }
        let started = Instant::now();
        let mut by_handle: HashMap<String, Vec<String>> = HashMap::new();
        let mut lp = kube::api::ListParams::default().limit(500);
        loop {
            let page = self.pvs.list(&lp).await?;
            for p in &page.items {
                if let Some(h) = loop_handle(p) {
                    by_handle.entry(h.to_string()).or_default().push(p.name_any());
                }
            }
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(c) => lp = lp.continue_token(&c),
                None => break,
            }
        }
        let by_handle = Arc::new(by_handle);
        *last = Some(LiveHandles {
            started,
            by_handle: by_handle.clone(),
        });
        Ok(by_handle)
    }

    async fn delete_volume(&self, snap: &Snapshot, done: &mut Done, pv: &str) -> Result<(), WriteError> {
        let since = Instant::now();
        if Self::pv(snap, done, pv).is_none() {
            return Ok(());
        }
        // Decide on the live object: what follows cannot be undone.
        let Some(mut v) = self.pvs.get_opt(pv).await? else {
            return Ok(());
        };
        if !core::deleter_wanted(&v) {
            return Ok(()); // its next sync says why and drops the finalizer
        }
        // A volume whose image is still pending was never handed to its claim: no data.
        if !has_ann(&v, ANN_IMAGE_PENDING) && self.claim_still_there(&v).await? {
            return Err(WriteError::ClaimStillThere(format!("{:?}", claim_ref(&v))));
        }
        let handle = volume_handle(&v).unwrap_or_default().to_string();
        let live = self.live_handles(since).await?;
        let sharing: Vec<String> = live
            .get(&handle)
            .into_iter()
            .flatten()
            .filter(|n| *n != pv)
            .cloned()
            .collect();
        if !sharing.is_empty() {
            let note = format!(
                "image {handle}.img is also the volume of PersistentVolume(s) {}; it is kept, and deleted with this volume once no other PersistentVolume names it",
                sharing.join(", ")
            );
            done.events
                .push(volume_event(&v, true, core::DELETE_REFUSED, note));
            return Ok(());
        }
        let dir = self.image_dir.clone();
        let removed = tokio::task::spawn_blocking(move || loopdev::ImageStore::new(dir).remove(&handle))
            .await
            .unwrap_or_else(|e| {
                Err(loopdev::ImageError::Io {
                    path: PathBuf::new(),
                    source: std::io::Error::other(e),
                })
            });
        match removed {
            Ok(true) => {}
            Ok(false) => {
                let note = format!("image of volume {pv} was already gone; deleting the volume object");
                done.events
                    .push(volume_event(&v, false, "VolumeImageMissing", note));
            }
            Err(e) => {
                self.metrics.deletions.with_label_values(&["failed"]).inc();
                let msg = format!("cannot delete the image of volume {pv}: {e}");
                done.events
                    .push(volume_event(&v, true, "VolumeFailedDelete", msg.clone()));
                if pv_phase(&v) != "Failed" {
                    done.pvs.push(
                        self.writes()
                            .replace_pv_status(&core::with_pv_phase(&v, "Failed", &msg), "volume_phase")
                            .await?,
                    );
                }
                return Err(e.into());
            }
        }
        if v.finalizers().iter().any(|f| f == FINALIZER_LOOP_DELETER) {
            v.finalizers_mut().retain(|f| f != FINALIZER_LOOP_DELETER);
            v = self.writes().replace_pv(&v, "deleter_finalizer").await?;
            done.pvs.push(v.clone());
        }
        self.count("delete_volume");
        match self.pvs.delete(pv, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(e.into()),
        }
        self.metrics.deletions.with_label_values(&["succeeded"]).inc();
        // The object may linger behind other finalizers (pv-protection); the watch reports it.
        Ok(())
    }
}

#[cfg(test)]
mod live_tests {
    use super::*;
    use stowage_testkit::InProcess;
    use stowage_testkit::builders::pv as pv_builder;

    /// The cache may lag a PV just created that names the same image; the live list before the
    /// removal catches it (against the real apiserver, with a real image dir).
    #[tokio::test]
    async fn a_sharer_the_cache_has_not_seen_yet_keeps_the_image() {
        let h = InProcess::new().await;
        let made = h
            .create_pv(
                pv_builder("made")
                    .reclaim("Delete")
                    .driver(LOOP_DRIVER, "shared")
                    .annotation(ANN_PROVISIONED_BY, LOOP_DRIVER)
                    .build(),
            )
            .await;
        h.create_pv(pv_builder("late").driver(LOOP_DRIVER, "shared").build())
            .await;
        let img = h.images.path().join("shared.img");
        std::fs::write(&img, b"data").unwrap();
        let writer = Writer {
            pvs: Api::all(h.client.clone()),
            events: Events::new(h.client.clone(), "test"),
            client: h.client.clone(),
            metrics: Metrics::new(&h.registry),
            image_dir: h.images.path().to_path_buf(),
            live: Arc::default(),
        };
        // The cache knows only the volume being deleted.
        let mut cache = Cache::default();
        cache.put_pv(Arc::new(made));
        let action = Action::DeleteLoopVolume { pv: "made".into() };
        let snap = Snapshot::of(&cache, std::slice::from_ref(&action));
        let mut done = Done::empty(Key::Volume("made".into()), None);
        writer.apply(&action, &snap, &mut done).await.unwrap();
        assert_eq!(std::fs::read(&img).unwrap(), b"data", "the image is kept");
        let refused = done
            .events
            .iter()
            .find(|(e, _)| e.reason == core::DELETE_REFUSED)
            .map(|(e, _)| e.note.clone())
            .expect("VolumeDeleteRefused");
        assert!(refused.contains("late"), "{refused}");
        assert!(h.pvs().get_opt("made").await.unwrap().is_some(), "not deleted");

        // Once the other volume is gone, the same deletion goes through.
        h.pvs().delete("late", &Default::default()).await.unwrap();
        let patch = serde_json::json!({"metadata": {"finalizers": null}});
        h.pvs()
            .patch(
                "late",
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
            .unwrap();
        let mut done = Done::empty(Key::Volume("made".into()), None);
        writer.apply(&action, &snap, &mut done).await.unwrap();
        assert!(!img.exists(), "deleted with the last volume naming it");
    }
}

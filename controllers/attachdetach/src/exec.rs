//! The thin async layer. One task owns desired and actual state, feeds them from the shared
//! informers, runs the pure reconciler whenever something changed (or a deadline passed), and
//! hands API writes to tasks of their own: attaches and detaches draw from separate budgets so a
//! burst of one never starves the other. Results come back to the owning task, which records
//! what it wrote so the next pass never acts on an older object. Periodic work reads the stores
//! only: no GET per attachment.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, ObjectReference, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::{
    CSIDriver, VolumeAttachment, VolumeAttachmentSource, VolumeAttachmentSpec,
};
use kube::api::{DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Resource, ResourceExt};
use stowage_common::cluster::Cluster;
use stowage_common::events::Events;
use stowage_common::informer::{Change, is_newer};
use tokio::sync::{Semaphore, broadcast, mpsc};
use tokio::task::JoinSet;

use crate::Config;
use crate::actual::{Actual, Op};
use crate::desired::{Desired, Lookup, PodRef, pod_volumes};
use crate::metrics::{Metrics, Snapshot};
use crate::objects::{
    NodeInfo, VaState, pod_claims, pod_is_active, pod_node, pv_finalizer_change, split_unique_volume_name,
    unique_volume_name,
};
use crate::reconcile::{Action, ForceReason, Nodes, next_deadline, reconcile};

/// Event reporter name.
const COMPONENT: &str = "stowage-attachdetach";
/// How long a failed node status patch waits before the next try.
const STATUS_RETRY: Duration = Duration::from_secs(1);
/// Events handled in a row before a pending pass runs anyway, so a storm cannot starve it.
const MAX_BACKLOG: usize = 1024;
/// Time between two passes, as a multiple of what the last pass cost, within the bounds below. A
/// pass scans the whole desired and actual state; during a burst every watch event would
/// otherwise start one (3,000 full scans for 1,000 pods). Scaling the gap with the pass's cost
/// keeps passes under ~1/(1+PASS_GAP_FACTOR) of the loop's time whatever the state's size, while
/// a small state (a pass of microseconds) is not made to wait: a fixed 50 ms gap cost every
/// attach of a burst up to 50 ms (measured in `make bench`, docs/benchmarks.md).
const PASS_GAP_FACTOR: u32 = 4;
const MIN_PASS_GAP: Duration = Duration::from_millis(1);
const MAX_PASS_GAP: Duration = Duration::from_millis(50);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Api(#[from] kube::Error),
    /// The node still advertises the volume and could not be told otherwise: never detach then.
    #[error("node status not updated before detach: {0}")]
    NodeStatus(String),
    /// The live Node lists the volume in `status.volumesInUse` (upstream's
    /// `verifyVolumeIsSafeToDetach`): the informer's copy was older than the node's truth.
    #[error("volume is still in use on node {0} (status.volumesInUse); detach refused")]
    StillInUse(String),
    /// The live Node could not be read, so the detach could not be proven safe.
    #[error("could not read node {node} to check that the volume is unmounted: {error}")]
    NodeUnreadable { node: String, error: String },
}

impl Error {
    /// A stable category, used as metric label.
    pub fn category(&self) -> &'static str {
        match self {
            Error::NodeStatus(_) => "NodeStatusNotUpdated",
            Error::StillInUse(_) => "VolumeInUse",
            Error::NodeUnreadable { .. } => "NodeUnreadable",
            Error::Api(e) => api_category(e),
        }
    }
}

fn api_category(e: &kube::Error) -> &'static str {
    match e {
        kube::Error::Api(s) => match s.code {
            403 => "Forbidden",
            404 => "NotFound",
            409 => "Conflict",
            422 => "Invalid",
            429 => "Throttled",
            _ => "ApiError",
        },
        _ => "ApiError",
    }
}

fn code_is(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

/// Results of the write tasks.
enum Done {
    Attach {
        volume: String,
        node: String,
        va_name: String,
        result: Result<VolumeAttachment, kube::Error>,
    },
    Detach {
        volume: String,
        node: String,
        forced: Option<ForceReason>,
        /// `Some` while the VolumeAttachment still exists (finalizers), `None` once gone.
        result: Result<Option<VolumeAttachment>, Error>,
    },
    Status {
        node: String,
        result: Result<Node, kube::Error>,
    },
    Release {
        volume: String,
        node: String,
        result: Result<VolumeAttachment, kube::Error>,
    },
    PvFinalizer {
        pv: String,
        result: Result<(), kube::Error>,
    },
}

impl Done {
    /// Whether `self` and `other` report the same piece of work.
    fn same_work(&self, other: &Done) -> bool {
        match (self, other) {
            (
                Done::Attach {
                    volume: a, node: b, ..
                },
                Done::Attach {
                    volume: c, node: d, ..
                },
            )
            | (
                Done::Detach {
                    volume: a, node: b, ..
                },
                Done::Detach {
                    volume: c, node: d, ..
                },
            )
            | (
                Done::Release {
                    volume: a, node: b, ..
                },
                Done::Release {
                    volume: c, node: d, ..
                },
            ) => a == c && b == d,
            (Done::Status { node: a, .. }, Done::Status { node: b, .. }) => a == b,
            (Done::PvFinalizer { pv: a, .. }, Done::PvFinalizer { pv: b, .. }) => a == b,
            _ => false,
        }
    }
}

/// The error a panicked write task's outstanding work is reported with.
fn panicked() -> kube::Error {
    kube::Error::Service("the write task panicked".into())
}

/// What a write task still owes the decision loop: a failure report for each piece of work it
/// has not reported yet. Reports go through `send`, which settles the debt; if the task panics,
/// its guard (dropped during the unwind) sends the failures still owed, so those entries leave
/// their in-flight state and are retried with backoff. Without it a panicked task left its
/// entries' `op` set for good and those volumes were never reconciled again. An abort
/// (leadership lost) is not a panic and reports nothing: the loop is gone too.
#[derive(Clone)]
struct Owed {
    done: mpsc::UnboundedSender<Done>,
    left: Arc<std::sync::Mutex<Vec<Done>>>,
}

impl Owed {
    fn new(done: &mpsc::UnboundedSender<Done>, failures: Vec<Done>) -> Self {
        Self {
            done: done.clone(),
            left: Arc::new(std::sync::Mutex::new(failures)),
        }
    }

    fn send(&self, d: Done) {
        self.left
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|x| !x.same_work(&d));
        let _ = self.done.send(d);
    }

    /// Held by the task for its whole life.
    fn guard(&self) -> OwedGuard {
        OwedGuard(self.clone())
    }
}

struct OwedGuard(Owed);

impl Drop for OwedGuard {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let left = std::mem::take(&mut *self.0.left.lock().unwrap_or_else(|p| p.into_inner()));
        for d in left {
            let _ = self.0.done.send(d);
        }
    }
}

/// A test hook: the attach task of this PV panics once.
#[cfg(test)]
static PANIC_ON_ATTACH: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// Resolves pod volumes through the shared stores.
struct Stores<'a>(&'a Cluster);

impl Lookup for Stores<'_> {
    fn claim(&self, namespace: &str, name: &str) -> Option<Arc<PersistentVolumeClaim>> {
        self.0.pvcs.store().get(&ObjectRef::new(name).within(namespace))
    }
    fn volume(&self, name: &str) -> Option<Arc<PersistentVolume>> {
        self.0.pvs.store().get(&ObjectRef::new(name))
    }
    fn driver(&self, name: &str) -> Option<Arc<CSIDriver>> {
        self.0.csi_drivers.store().get(&ObjectRef::new(name))
    }
}

/// (namespace, name).
type PodKey = (String, String);

/// What the controller remembers of a scheduled, active pod.
struct PodSeen {
    uid: String,
    node: String,
    claims: Vec<String>,
}

/// Everything a write task needs; cheap to clone.
#[derive(Clone)]
struct Writer {
    vas: Api<VolumeAttachment>,
    pvs: Api<PersistentVolume>,
    nodes: Api<Node>,
    events: Events,
    metrics: Metrics,
    done: mpsc::UnboundedSender<Done>,
    attach_slots: Arc<Semaphore>,
    detach_slots: Arc<Semaphore>,
}

/// The owning task's state.
struct Ctrl {
    /// Write tasks: aborted with the controller when leadership ends, so a former leader
    /// stops writing at once.
    tasks: JoinSet<()>,
    cluster: Arc<Cluster>,
    config: Config,
    writer: Writer,
    desired: Desired,
    actual: Actual,
    nodes: Nodes,
    /// Active scheduled pods, managed node or not (a node may become managed later).
    pods: HashMap<PodKey, PodSeen>,
    /// (namespace, claim) → names of active pods that mount it.
    claim_pods: HashMap<(String, String), HashSet<String>>,
    /// Pods to resolve again before the next pass.
    dirty_pods: HashSet<PodKey>,
    /// VolumeAttachment name → (volume, node).
    va_keys: HashMap<String, (String, String)>,
    /// PV name → attachments naming it that arrived before the PV.
    unresolved: HashMap<String, HashSet<String>>,
    /// PV name → VolumeAttachments naming it (any driver), for the PV finalizer.
    pv_attachments: HashMap<String, HashSet<String>>,
    /// PVs whose attacher finalizer is to be checked at the next pass, and those being patched.
    pv_dirty: HashSet<String>,
    pv_patching: HashSet<String>,
    /// Nodes with a status patch in flight, and nodes whose last patch failed (retry time).
    status_in_flight: HashSet<String>,
    status_retry: HashMap<String, Instant>,
    /// A pass is due.
    dirty: bool,
    /// Events handled since the last pass.
    backlog: usize,
    /// When a pass is due without new events.
    wake_at: Option<Instant>,
    /// While loading the initial state: no events for what was already there.
    quiet: bool,
    last_pass: Option<Instant>,
    /// The wait the last pass's cost earned (see `PASS_GAP_FACTOR`).
    pass_gap: Duration,
}

/// Runs the controller until a watch ends or the future is dropped.
pub async fn run(cluster: Arc<Cluster>, metrics: Metrics, config: Config) -> anyhow::Result<()> {
    // Subscribe before reading the stores so nothing falls between the two.
    let mut pod_feed = cluster.pods.subscribe();
    let mut node_feed = cluster.nodes.subscribe();
    let mut pvc_feed = cluster.pvcs.subscribe();
    let mut pv_feed = cluster.pvs.subscribe();
    let mut va_feed = cluster.attachments.subscribe();
    let mut driver_feed = cluster.csi_drivers.subscribe();
    cluster.ready().await;

    let (done_tx, mut done_rx) = mpsc::unbounded_channel();
    let client = cluster.client.clone();
    let mut c = Ctrl {
        tasks: JoinSet::new(),
        writer: Writer {
            vas: Api::all(client.clone()),
            pvs: Api::all(client.clone()),
            nodes: Api::all(client.clone()),
            events: Events::new(client, COMPONENT),
            metrics,
            done: done_tx,
            attach_slots: Arc::new(Semaphore::new(config.max_attaches_in_flight.max(1))),
            detach_slots: Arc::new(Semaphore::new(config.max_detaches_in_flight.max(1))),
        },
        cluster,
        config: config.clone(),
        desired: Desired::default(),
        actual: Actual::default(),
        nodes: Nodes::new(),
        pods: HashMap::new(),
        claim_pods: HashMap::new(),
        dirty_pods: HashSet::new(),
        va_keys: HashMap::new(),
        unresolved: HashMap::new(),
        pv_attachments: HashMap::new(),
        pv_dirty: HashSet::new(),
        pv_patching: HashSet::new(),
        status_in_flight: HashSet::new(),
        status_retry: HashMap::new(),
        dirty: true,
        backlog: 0,
        wake_at: None,
        quiet: false,
        last_pass: None,
        pass_gap: MIN_PASS_GAP,
    };
    c.load();
    tracing::info!(
        desired = c.desired.len(),
        actual = c.actual.len(),
        nodes = c.nodes.len(),
        "attach/detach state loaded"
    );

    use broadcast::error::RecvError;
    let start = tokio::time::Instant::now() + config.resync;
    let mut resync = tokio::time::interval_at(start, config.resync.max(Duration::from_millis(100)));
    // A late resync is not made up for by a burst of them.
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let wake = c.wake_at.map(tokio::time::Instant::from_std);
        // A due pass that came too soon after the last one waits for the interval.
        let throttled = c
            .last_pass
            .map(|t| t + c.pass_gap)
            .filter(|t| c.dirty && *t > Instant::now())
            .map(tokio::time::Instant::from_std);
        tokio::select! {
            biased;
            _ = std::future::ready(()), if c.dirty && c.backlog >= MAX_BACKLOG => c.pass(),
            Some(done) = done_rx.recv() => c.finish(done),
            Some(_) = c.tasks.join_next(), if !c.tasks.is_empty() => {}
            r = pod_feed.recv() => match r {
                Ok(Change::Applied(p) | Change::Deleted(p)) => c.pod_changed(&p),
                Ok(Change::Resynced) | Err(RecvError::Lagged(_)) => c.resync(false),
                Err(RecvError::Closed) => anyhow::bail!("pod watch ended"),
            },
            r = node_feed.recv() => match r {
                Ok(Change::Applied(n)) => c.node_applied(&n),
                Ok(Change::Deleted(n)) => c.node_deleted(&n.name_any()),
                Ok(Change::Resynced) | Err(RecvError::Lagged(_)) => c.resync(false),
                Err(RecvError::Closed) => anyhow::bail!("node watch ended"),
            },
            r = pvc_feed.recv() => match r {
                Ok(Change::Applied(pvc) | Change::Deleted(pvc)) => {
                    c.claim_changed(&pvc.namespace().unwrap_or_default(), &pvc.name_any())
                }
                Ok(Change::Resynced) | Err(RecvError::Lagged(_)) => c.resync(false),
                Err(RecvError::Closed) => anyhow::bail!("claim watch ended"),
            },
            r = pv_feed.recv() => match r {
                Ok(Change::Applied(pv) | Change::Deleted(pv)) => c.volume_changed(&pv),
                Ok(Change::Resynced) | Err(RecvError::Lagged(_)) => c.resync(false),
                Err(RecvError::Closed) => anyhow::bail!("volume watch ended"),
            },
            r = va_feed.recv() => match r {
                Ok(Change::Applied(va)) => c.va_applied(&va),
                Ok(Change::Deleted(va)) => c.va_deleted(&va),
                Ok(Change::Resynced) | Err(RecvError::Lagged(_)) => c.resync(false),
                Err(RecvError::Closed) => anyhow::bail!("volume attachment watch ended"),
            },
            r = driver_feed.recv() => match r {
                // attachRequired may have changed: every pod's volumes are re-resolved.
                Ok(_) | Err(RecvError::Lagged(_)) => c.all_pods_dirty(),
                Err(RecvError::Closed) => anyhow::bail!("CSI driver watch ended"),
            },
            _ = resync.tick() => c.resync(true),
            _ = tokio::time::sleep_until(wake.unwrap_or_else(tokio::time::Instant::now)), if wake.is_some() => {
                c.wake_at = None;
                c.dirty = true;
            }
            _ = std::future::ready(()), if c.dirty && throttled.is_none() => c.pass(),
            _ = tokio::time::sleep_until(throttled.unwrap_or_else(tokio::time::Instant::now)), if throttled.is_some() => c.pass(),
        }
    }
}

impl Ctrl {
    fn touch(&mut self) {
        self.dirty = true;
        self.backlog += 1;
    }

    /// Initial state: nodes (and what their status says is attached, so a restart keeps it),
    /// then attachments, then pods.
    fn load(&mut self) {
        self.quiet = true;
        for node in self.cluster.nodes.store().state() {
            let info = NodeInfo::of(&node);
            let name = node.name_any();
            for (volume, path) in &info.volumes_attached {
                if let Some((driver, handle)) = split_unique_volume_name(volume) {
                    self.actual.entry(volume, &name, driver, handle).reported = Some(path.clone());
                }
            }
            self.nodes.insert(name, info);
        }
        for va in self.cluster.attachments.store().state() {
            self.va_applied(&va);
        }
        // PV finalizers left from before a restart are checked once.
        self.pv_dirty
            .extend(self.cluster.pvs.store().state().iter().map(|p| p.name_any()));
        self.all_pods_dirty();
        self.refresh_pods();
        self.quiet = false;
        self.dirty = true;
    }

    /// Reloads everything from the stores. `verify` also drops attachments known only from node
    /// status that have no VolumeAttachment (upstream's periodic verify, from the store: a CSI
    /// volume without one is not attached).
    fn resync(&mut self, verify: bool) {
        self.quiet = true;
        let live: HashSet<String> = self
            .cluster
            .nodes
            .store()
            .state()
            .iter()
            .map(|n| {
                self.node_applied(n);
                n.name_any()
            })
            .collect();
        let gone: Vec<String> = self
            .nodes
            .iter()
            .filter(|(n, i)| !i.deleted && !live.contains(*n))
            .map(|(n, _)| n.clone())
            .collect();
        for n in gone {
            self.node_deleted(&n);
        }
        let vas = self.cluster.attachments.store().state();
        let names: HashSet<String> = vas.iter().map(|v| v.name_any()).collect();
        // The PV finalizer index from scratch, and every PV checked (a missed event heals here).
        self.pv_attachments.clear();
        self.pv_dirty
            .extend(self.cluster.pvs.store().state().iter().map(|p| p.name_any()));
        for va in &vas {
            self.va_applied(va);
        }
        let now = Instant::now();
        for ((_, _), a) in self.actual.iter_mut() {
            if a.va.as_ref().is_some_and(|v| !names.contains(&v.name)) {
                a.va = None;
            }
            if verify && a.va.is_none() && a.op.is_none() {
                a.reported = None;
            }
        }
        self.va_keys.retain(|name, _| names.contains(name));
        self.actual.tidy_all(now);
        self.all_pods_dirty();
        self.quiet = false;
        self.dirty = true;
    }

    fn all_pods_dirty(&mut self) {
        let keys = self
            .cluster
            .pods
            .store()
            .state()
            .iter()
            .map(|p| (p.namespace().unwrap_or_default(), p.name_any()))
            .collect::<Vec<_>>();
        self.dirty_pods.extend(keys);
        // Pods that vanished without an event (missed while a watch was down).
        self.dirty_pods.extend(self.pods.keys().cloned());
        self.touch();
    }

    fn pod_changed(&mut self, pod: &Pod) {
        self.dirty_pods
            .insert((pod.namespace().unwrap_or_default(), pod.name_any()));
        self.touch();
    }

    fn claim_changed(&mut self, ns: &str, name: &str) {
        if let Some(pods) = self.claim_pods.get(&(ns.to_string(), name.to_string())) {
            let keys: Vec<PodKey> = pods.iter().map(|p| (ns.to_string(), p.clone())).collect();
            self.dirty_pods.extend(keys);
            self.touch();
        }
    }

    fn volume_changed(&mut self, pv: &PersistentVolume) {
        if pv_finalizer_change(pv, self.pv_attachments.contains_key(&pv.name_any())).is_some() {
            self.pv_dirty.insert(pv.name_any());
            self.touch();
        }
        if let Some(cr) = pv.spec.as_ref().and_then(|s| s.claim_ref.as_ref())
            && let (Some(ns), Some(name)) = (cr.namespace.as_deref(), cr.name.as_deref())
        {
            self.claim_changed(ns, name);
        }
        // Attachments that arrived before their volume can be placed now.
        if let Some(waiting) = self.unresolved.remove(&pv.name_any()) {
            for name in waiting {
                if let Some(va) = self.cluster.attachments.store().get(&ObjectRef::new(&name)) {
                    self.va_applied(&va);
                }
            }
        }
    }

    fn node_applied(&mut self, node: &Node) {
        let name = node.name_any();
        let info = NodeInfo::of(node);
        let old = self.nodes.get(&name);
        // Older than the copy our own status patch returned.
        if old.is_some_and(|o| is_newer(o.resource_version.as_deref(), info.resource_version.as_deref())) {
            return;
        }
        let managed_changed = old.is_none_or(|o| o.managed != info.managed);
        if old != Some(&info) {
            self.nodes.insert(name.clone(), info);
            self.touch();
        }
        if managed_changed {
            self.pods_on_node_dirty(&name);
        }
    }

    /// A deleted Node stays known, as it was last seen but not Ready (upstream keeps it in the
    /// desired state while it has volumes, and its last `volumesInUse`): its volumes are
    /// force-detached only after --max-wait-for-unmount or with the out-of-service taint. It is
    /// forgotten once nothing is attached to it and no pod wants anything there.
    fn node_deleted(&mut self, name: &str) {
        self.status_retry.remove(name);
        let Some(info) = self.nodes.remove(name) else {
            return;
        };
        if !info.deleted {
            self.pods_on_node_dirty(name);
            self.touch();
        }
        self.nodes.insert(name.to_string(), info.gone());
    }

    /// Drops deleted nodes that nothing refers to any more.
    fn forget_gone_nodes(&mut self) {
        if !self.nodes.values().any(|n| n.deleted) {
            return;
        }
        let mut used: HashSet<&str> = self.actual.iter().map(|((_, n), _)| n.as_str()).collect();
        used.extend(self.desired.iter().map(|(n, _)| n.as_str()));
        self.nodes
            .retain(|name, n| !n.deleted || used.contains(name.as_str()));
    }

    fn pods_on_node_dirty(&mut self, node: &str) {
        let keys: Vec<PodKey> = self
            .pods
            .iter()
            .filter(|(_, p)| p.node == node)
            .map(|(k, _)| k.clone())
            .collect();
        if !keys.is_empty() {
            self.dirty_pods.extend(keys);
            self.touch();
        }
    }

    fn refresh_pods(&mut self) {
        let keys: Vec<PodKey> = self.dirty_pods.drain().collect();
        for key in keys {
            self.refresh_pod(key);
        }
    }

    /// Re-resolves one pod's contribution to the desired state.
    fn refresh_pod(&mut self, key: PodKey) {
        let pod = self
            .cluster
            .pods
            .store()
            .get(&ObjectRef::new(&key.1).within(&key.0))
            .filter(|p| pod_is_active(p));
        if let Some(old) = self.pods.remove(&key) {
            for c in &old.claims {
                let ck = (key.0.clone(), c.clone());
                if let Some(set) = self.claim_pods.get_mut(&ck) {
                    set.remove(&key.1);
                    if set.is_empty() {
                        self.claim_pods.remove(&ck);
                    }
                }
            }
            if pod.as_ref().and_then(|p| p.uid()).as_deref() != Some(old.uid.as_str()) {
                self.desired.remove_pod(&old.uid);
            }
        }
        let Some(pod) = pod else { return };
        let uid = pod.uid().unwrap_or_default();
        let node = pod_node(&pod).unwrap_or_default().to_string();
        let claims = pod_claims(&pod);
        for c in &claims {
            self.claim_pods
                .entry((key.0.clone(), c.clone()))
                .or_default()
                .insert(key.1.clone());
        }
        // A deleted node's pods stay desired until they go (pod GC): their volumes may still be
        // mounted there.
        if self.nodes.get(&node).is_some_and(|n| n.managed) {
            let volumes = pod_volumes(&pod, &Stores(&self.cluster));
            self.desired.set_pod(PodRef::of(&pod), &node, volumes);
        } else {
            self.desired.remove_pod(&uid);
        }
        self.pods.insert(key, PodSeen { uid, node, claims });
    }

    /// (volume, node, driver, handle) of an attachment, through its PV.
    fn resolve_va(
        &mut self,
        va: &VolumeAttachment,
        remember: bool,
    ) -> Option<(String, String, String, String)> {
        // Inline (migrated) volumes are not handled by this controller.
        let pv_name = va.spec.source.persistent_volume_name.as_deref()?;
        let pv = self.cluster.pvs.store().get(&ObjectRef::new(pv_name));
        let Some(csi) = pv.as_ref().and_then(|p| p.spec.as_ref()?.csi.as_ref()) else {
            // Left alone until its volume shows up, as upstream skips it.
            if remember {
                self.unresolved
                    .entry(pv_name.to_string())
                    .or_default()
                    .insert(va.name_any());
            }
            return None;
        };
        Some((
            unique_volume_name(&csi.driver, &csi.volume_handle),
            va.spec.node_name.clone(),
            csi.driver.clone(),
            csi.volume_handle.clone(),
        ))
    }

    fn va_applied(&mut self, va: &VolumeAttachment) {
        if let Some(pv) = va.spec.source.persistent_volume_name.as_deref() {
            self.pv_attachments
                .entry(pv.to_string())
                .or_default()
                .insert(va.name_any());
            self.pv_dirty.insert(pv.to_string());
        }
        let name = va.name_any();
        let Some((volume, node, driver, handle)) = self.resolve_va(va, true) else {
            return;
        };
        let state = VaState::of(va);
        let e = self.actual.entry(&volume, &node, &driver, &handle);
        if let Some(old) = &e.va
            && old.name == state.name
            && is_newer(old.resource_version.as_deref(), state.resource_version.as_deref())
        {
            return;
        }
        let was_attached = e.va.as_ref().is_some_and(|v| v.attached);
        let old_error = e.va.as_ref().and_then(|v| v.attach_error.clone());
        let newly_attached = state.attached && !was_attached && !state.deleting;
        let new_error = state
            .attach_error
            .clone()
            .filter(|m| Some(m) != old_error.as_ref());
        let started = if newly_attached {
            e.attach_started.take()
        } else {
            None
        };
        e.va = Some(state);
        // The attachment object is the truth from now on.
        e.reported = None;
        self.va_keys.insert(name, (volume.clone(), node.clone()));
        if let Some(t) = started {
            self.writer
                .metrics
                .attach_seconds
                .observe(t.elapsed().as_secs_f64());
        }
        if !self.quiet {
            if newly_attached {
                self.pod_events(&volume, &node, false, "SuccessfulAttachVolume", |pv| {
                    format!("Volume \"{pv}\" is attached to node {node}")
                });
            }
            if let Some(msg) = new_error {
                self.pod_events(&volume, &node, true, "FailedAttachVolume", |pv| {
                    format!("Attaching volume \"{pv}\" failed: {msg}")
                });
            }
        }
        self.touch();
    }

    fn va_deleted(&mut self, va: &VolumeAttachment) {
        let name = va.name_any();
        if let Some(pv) = va.spec.source.persistent_volume_name.as_deref() {
            if let Some(set) = self.pv_attachments.get_mut(pv) {
                set.remove(&name);
                if set.is_empty() {
                    self.pv_attachments.remove(pv);
                }
            }
            self.pv_dirty.insert(pv.to_string());
            self.touch();
        }
        if let Some(pv) = va.spec.source.persistent_volume_name.as_deref()
            && let Some(set) = self.unresolved.get_mut(pv)
        {
            set.remove(&name);
            if set.is_empty() {
                self.unresolved.remove(pv);
            }
        }
        let key = match self.va_keys.remove(&name) {
            Some(k) => Some(k),
            None => self.resolve_va(va, false).map(|(v, n, _, _)| (v, n)),
        };
        let Some((volume, node)) = key else { return };
        let Some(e) = self.actual.get_mut(&volume, &node) else {
            return;
        };
        if e.va.as_ref().is_some_and(|v| v.name != name) {
            return;
        }
        e.va = None;
        e.reported = None;
        e.detach_requested = None;
        if let Some(t) = e.detach_started.take() {
            self.writer
                .metrics
                .detach_seconds
                .observe(t.elapsed().as_secs_f64());
        }
        self.actual.tidy(&volume, &node, Instant::now());
        self.touch();
    }

    /// One reconciler pass.
    fn pass(&mut self) {
        let started = Instant::now();
        self.refresh_pods();
        let now = Instant::now();
        self.last_pass = Some(now);
        let timer = self.writer.metrics.reconcile_seconds.start_timer();
        let actions = reconcile(&self.desired, &self.actual, &self.nodes, now, &self.config);
        timer.observe_duration();
        self.writer.metrics.reconciles.inc();
        self.dirty = false;
        self.backlog = 0;
        self.apply(actions, now);
        self.forget_gone_nodes();
        self.sync_pv_finalizers();
        self.update_wake(now);
        self.pass_gap = (started.elapsed() * PASS_GAP_FACTOR).clamp(MIN_PASS_GAP, MAX_PASS_GAP);
    }

    fn update_wake(&mut self, now: Instant) {
        let retry = self.status_retry.values().copied().filter(|t| *t > now).min();
        self.wake_at = [next_deadline(&self.actual, &self.config, now), retry]
            .into_iter()
            .flatten()
            .min();
    }

    fn apply(&mut self, actions: Vec<Action>, now: Instant) {
        let mut waiting_since = Vec::new();
        let mut detaches: BTreeMap<String, Vec<DetachJob>> = BTreeMap::new();
        let mut statuses: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
        for a in actions {
            match a {
                Action::MarkDetachRequested { volume, node } => {
                    if let Some(e) = self.actual.get_mut(&volume, &node) {
                        e.detach_requested = Some(now);
                    }
                }
                Action::CancelDetachRequest { volume, node } => {
                    if let Some(e) = self.actual.get_mut(&volume, &node) {
                        e.detach_requested = None;
                    }
                }
                Action::WaitForUnmount { waited, .. } => waiting_since.push(now - waited),
                Action::Detach {
                    volume,
                    node,
                    va_name,
                    forced,
                    waited,
                } => detaches.entry(node).or_default().push(DetachJob {
                    volume,
                    va_name,
                    forced,
                    waited,
                }),
                Action::UpdateNodeStatus { node, volumes } => {
                    statuses.insert(node, volumes);
                }
                Action::Attach {
                    volume,
                    node,
                    va_name,
                    pv_name,
                    driver,
                } => self.start_attach(volume, node, va_name, pv_name, driver, now),
                Action::ReleaseAttachment {
                    volume,
                    node,
                    va_name,
                    resource_version,
                } => self.start_release(volume, node, va_name, resource_version),
                Action::MultiAttachError { volume, node, notes } => {
                    self.desired.mark_multi_attach_reported(&volume, &node);
                    self.writer.metrics.multi_attach_errors.inc();
                    for (pod, note) in notes {
                        self.pod_event(&pod, true, "FailedAttachVolume", note);
                    }
                }
            }
        }
        let mut node_names: Vec<String> = detaches.keys().cloned().collect();
        node_names.extend(statuses.keys().filter(|n| !detaches.contains_key(*n)).cloned());
        for node in node_names {
            // One status write per node at a time; its detaches wait for the next pass.
            if self.status_in_flight.contains(&node) || self.status_retry.get(&node).is_some_and(|t| *t > now)
            {
                continue;
            }
            let patch = statuses.remove(&node);
            let jobs = detaches.remove(&node).unwrap_or_default();
            self.start_node_writes(node, patch, jobs, now);
        }
        let mut volumes: BTreeMap<(&'static str, String), i64> = BTreeMap::new();
        for (_, d) in self.desired.iter() {
            *volumes
                .entry(("desired_state_of_world", d.spec.driver.clone()))
                .or_default() += 1;
        }
        for (_, a) in self.actual.iter().filter(|(_, a)| a.exists()) {
            *volumes
                .entry(("actual_state_of_world", a.driver.clone()))
                .or_default() += 1;
        }
        self.writer.metrics.set_snapshot(Snapshot {
            volumes,
            waiting_since,
        });
    }

    fn start_attach(
        &mut self,
        volume: String,
        node: String,
        va_name: String,
        pv_name: String,
        driver: String,
        now: Instant,
    ) {
        let Some(handle) = self.desired.get(&volume, &node).map(|d| d.spec.handle.clone()) else {
            return;
        };
        let e = self.actual.entry(&volume, &node, &driver, &handle);
        e.op = Some(Op::Attach);
        e.attach_started.get_or_insert(now);
        let w = self.writer.clone();
        w.metrics.queue_depth.with_label_values(&["attach"]).inc();
        let va = VolumeAttachment {
            metadata: ObjectMeta {
                name: Some(va_name.clone()),
                ..Default::default()
            },
            spec: VolumeAttachmentSpec {
                attacher: driver,
                node_name: node.clone(),
                source: VolumeAttachmentSource {
                    persistent_volume_name: Some(pv_name),
                    inline_volume_spec: None,
                },
            },
            status: None,
        };
        let owed = Owed::new(
            &w.done,
            vec![Done::Attach {
                volume: volume.clone(),
                node: node.clone(),
                va_name: va_name.clone(),
                result: Err(panicked()),
            }],
        );
        self.tasks.spawn(async move {
            let _guard = owed.guard();
            let _slot = w.attach_slots.clone().acquire_owned().await;
            #[cfg(test)]
            {
                let mut hook = PANIC_ON_ATTACH.lock().unwrap_or_else(|p| p.into_inner());
                if hook.as_deref() == va.spec.source.persistent_volume_name.as_deref() {
                    *hook = None;
                    drop(hook);
                    panic!("test hook: attach task panics");
                }
            }
            let timer = w
                .metrics
                .operation_seconds
                .with_label_values(&["attach"])
                .start_timer();
            let result = w.vas.create(&PostParams::default(), &va).await;
            timer.observe_duration();
            owed.send(Done::Attach {
                volume,
                node,
                va_name,
                result,
            });
        });
    }

    /// Adds or removes the built-in attacher's finalizer on the PVs that changed (guarded by the
    /// resourceVersion read, so a PV that changed meanwhile is decided again).
    fn sync_pv_finalizers(&mut self) {
        let names: Vec<String> = self
            .pv_dirty
            .iter()
            .filter(|n| !self.pv_patching.contains(*n))
            .cloned()
            .collect();
        for name in names {
            self.pv_dirty.remove(&name);
            let Some(pv) = self.cluster.pvs.store().get(&ObjectRef::new(&name)) else {
                continue;
            };
            let Some(add) = pv_finalizer_change(&pv, self.pv_attachments.contains_key(&name)) else {
                continue;
            };
            let mut fins: Vec<String> = pv
                .finalizers()
                .iter()
                .filter(|f| *f != stowage_common::objects::LOOP_ATTACHER_FINALIZER)
                .cloned()
                .collect();
            if add {
                fins.push(stowage_common::objects::LOOP_ATTACHER_FINALIZER.into());
            }
            let patch = serde_json::json!({
                "metadata": { "finalizers": fins, "resourceVersion": pv.resource_version() }
            });
            self.pv_patching.insert(name.clone());
            let w = self.writer.clone();
            let owed = Owed::new(
                &w.done,
                vec![Done::PvFinalizer {
                    pv: name.clone(),
                    result: Err(panicked()),
                }],
            );
            self.tasks.spawn(async move {
                let _guard = owed.guard();
                let result = w
                    .pvs
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map(|_| ());
                owed.send(Done::PvFinalizer { pv: name, result });
            });
        }
    }

    /// Drops the built-in attacher's finalizer from a dead node's VolumeAttachment (guarded by the
    /// resourceVersion decided on, so a finalizer list that changed meanwhile is decided again).
    fn start_release(&mut self, volume: String, node: String, va_name: String, rv: Option<String>) {
        let Some(e) = self.actual.get_mut(&volume, &node) else {
            return;
        };
        e.op = Some(Op::Detach);
        let fins: Vec<String> = self
            .cluster
            .attachments
            .store()
            .get(&ObjectRef::new(&va_name))
            .map(|va| {
                va.finalizers()
                    .iter()
                    .filter(|f| !stowage_common::objects::is_loop_attacher_finalizer(f))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        let w = self.writer.clone();
        let owed = Owed::new(
            &w.done,
            vec![Done::Release {
                volume: volume.clone(),
                node: node.clone(),
                result: Err(panicked()),
            }],
        );
        self.tasks.spawn(async move {
            let _guard = owed.guard();
            let patch = serde_json::json!({
                "metadata": { "finalizers": fins, "resourceVersion": rv }
            });
            let result = w
                .vas
                .patch(&va_name, &PatchParams::default(), &Patch::Merge(&patch))
                .await;
            owed.send(Done::Release { volume, node, result });
        });
    }

    /// A node's status patch (if any) and then its detaches, in one task: a detach only starts
    /// once the node no longer advertises the volume as attached.
    fn start_node_writes(
        &mut self,
        node: String,
        patch: Option<Vec<(String, String)>>,
        jobs: Vec<DetachJob>,
        now: Instant,
    ) {
        for j in &jobs {
            if let Some(e) = self.actual.get_mut(&j.volume, &node) {
                e.op = Some(Op::Detach);
                e.detach_started = Some(now);
            }
        }
        let patch = patch.filter(|_| self.nodes.get(&node).is_some_and(|n| !n.deleted));
        if patch.is_some() {
            self.status_in_flight.insert(node.clone());
        }
        let w = self.writer.clone();
        w.metrics
            .queue_depth
            .with_label_values(&["detach"])
            .add(jobs.len() as i64);
        let mut failures: Vec<Done> = jobs
            .iter()
            .map(|j| Done::Detach {
                volume: j.volume.clone(),
                node: node.clone(),
                forced: j.forced,
                result: Err(Error::Api(panicked())),
            })
            .collect();
        if patch.is_some() {
            failures.push(Done::Status {
                node: node.clone(),
                result: Err(panicked()),
            });
        }
        let owed = Owed::new(&w.done, failures);
        self.tasks.spawn(async move {
            let _guard = owed.guard();
            let _slot = match jobs.is_empty() {
                true => None,
                false => w.detach_slots.clone().acquire_owned().await.ok(),
            };
            // The freshest Node: what the status patch returned, else read below when needed.
            // `Some(None)`: the Node is gone.
            let mut fresh: Option<Option<Node>> = None;
            if let Some(volumes) = patch {
                let timer = w
                    .metrics
                    .operation_seconds
                    .with_label_values(&["node_status"])
                    .start_timer();
                let result = patch_node_status(&w.nodes, &node, &volumes).await;
                timer.observe_duration();
                // A node that is gone advertises nothing any more.
                let blocked = match &result {
                    Err(e) if !code_is(e, 404) => Some(e.to_string()),
                    Err(_) => {
                        fresh = Some(None);
                        None
                    }
                    Ok(n) => {
                        fresh = Some(Some(n.clone()));
                        None
                    }
                };
                owed.send(Done::Status {
                    node: node.clone(),
                    result,
                });
                if let Some(msg) = blocked {
                    for j in jobs {
                        owed.send(Done::Detach {
                            volume: j.volume,
                            node: node.clone(),
                            forced: j.forced,
                            result: Err(Error::NodeStatus(msg.clone())),
                        });
                    }
                    return;
                }
            }
            // Never detach on the informer's word alone: a non-forced detach checks the live
            // Node's volumesInUse first (one read per node and batch, none when the patch above
            // already returned the Node). A gone Node uses nothing (upstream: safe to detach).
            let (jobs, refused) = if jobs.iter().all(|j| j.forced.is_some()) {
                (jobs, Vec::new())
            } else {
                let fresh = match fresh {
                    Some(n) => Ok(n),
                    None => w.nodes.get_opt(&node).await.map_err(|e| e.to_string()),
                };
                split_unsafe_detaches(jobs, &node, &fresh)
            };
            for (j, err) in refused {
                owed.send(Done::Detach {
                    volume: j.volume,
                    node: node.clone(),
                    forced: j.forced,
                    result: Err(err),
                });
            }
            let deletes = jobs.into_iter().map(|j| {
                let w = w.clone();
                let owed = owed.clone();
                let node = node.clone();
                async move {
                    if j.forced.is_some() || !j.waited.is_zero() {
                        w.metrics.unmount_wait_seconds.observe(j.waited.as_secs_f64());
                    }
                    let timer = w
                        .metrics
                        .operation_seconds
                        .with_label_values(&["detach"])
                        .start_timer();
                    let result = match w.vas.delete(&j.va_name, &DeleteParams::default()).await {
                        // The apiserver may answer with the object as it was when removed at
                        // once; only one still held by finalizers is still there.
                        Ok(either) => Ok(either.left().filter(|va| {
                            va.metadata.deletion_timestamp.is_some() && !va.finalizers().is_empty()
                        })),
                        Err(e) if code_is(&e, 404) => Ok(None),
                        Err(e) => Err(Error::Api(e)),
                    };
                    timer.observe_duration();
                    owed.send(Done::Detach {
                        volume: j.volume,
                        node,
                        forced: j.forced,
                        result,
                    });
                }
            });
            futures::future::join_all(deletes).await;
        });
    }

    /// Takes a write task's result back into the state.
    fn finish(&mut self, done: Done) {
        let now = Instant::now();
        let m = self.writer.metrics.clone();
        match done {
            Done::Attach {
                volume,
                node,
                va_name,
                result,
            } => {
                m.queue_depth.with_label_values(&["attach"]).dec();
                if let Some(e) = self.actual.get_mut(&volume, &node) {
                    e.op = None;
                }
                match result {
                    Ok(va) => {
                        m.operations.with_label_values(&["attach", "success"]).inc();
                        self.succeeded(&volume, &node);
                        self.va_applied(&va);
                    }
                    Err(err) if code_is(&err, 409) => {
                        // Someone (a previous leader) created it: follow the stored copy.
                        m.operations.with_label_values(&["attach", "success"]).inc();
                        self.succeeded(&volume, &node);
                        match self.cluster.attachments.store().get(&ObjectRef::new(&va_name)) {
                            Some(va) => self.va_applied(&va),
                            None => {
                                if let Some(e) = self.actual.get_mut(&volume, &node)
                                    && e.va.is_none()
                                {
                                    // Its watch event is on the way; a resync corrects a miss.
                                    e.va = Some(VaState {
                                        name: va_name,
                                        ..Default::default()
                                    });
                                }
                            }
                        }
                    }
                    Err(err) => {
                        let err = Error::Api(err);
                        m.operations.with_label_values(&["attach", "error"]).inc();
                        m.reconcile_errors
                            .with_label_values(&["attach", err.category()])
                            .inc();
                        tracing::warn!(%volume, %node, error = %err, "attach failed");
                        if let Some(e) = self.actual.get_mut(&volume, &node) {
                            e.failed(now);
                            e.attach_started = None;
                        }
                        let msg = err.to_string();
                        self.pod_events(&volume, &node, true, "FailedAttachVolume", |pv| {
                            format!("Cannot request attaching volume \"{pv}\": {msg}")
                        });
                    }
                }
                self.actual.tidy(&volume, &node, now);
            }
            Done::Detach {
                volume,
                node,
                forced,
                result,
            } => {
                m.queue_depth.with_label_values(&["detach"]).dec();
                if let Some(e) = self.actual.get_mut(&volume, &node) {
                    e.op = None;
                }
                match result {
                    Ok(left) => {
                        m.operations.with_label_values(&["detach", "success"]).inc();
                        if let Some(r) = forced {
                            m.forced_detaches.with_label_values(&[r.label()]).inc();
                        }
                        self.succeeded(&volume, &node);
                        match left {
                            // Finalizers hold it: the attacher detaches, the watch reports the end.
                            Some(va) => self.va_applied(&va),
                            None => {
                                if let Some(e) = self.actual.get_mut(&volume, &node) {
                                    e.va = None;
                                    e.reported = None;
                                    e.detach_requested = None;
                                    if let Some(t) = e.detach_started.take() {
                                        m.detach_seconds.observe(t.elapsed().as_secs_f64());
                                    }
                                }
                            }
                        }
                    }
                    Err(err) => {
                        m.operations.with_label_values(&["detach", "error"]).inc();
                        m.reconcile_errors
                            .with_label_values(&["detach", err.category()])
                            .inc();
                        tracing::warn!(%volume, %node, error = %err, "detach failed");
                        if let Some(e) = self.actual.get_mut(&volume, &node) {
                            e.failed(now);
                            e.detach_started = None;
                        }
                    }
                }
                self.actual.tidy(&volume, &node, now);
            }
            Done::Release { volume, node, result } => {
                if let Some(e) = self.actual.get_mut(&volume, &node) {
                    e.op = None;
                }
                match result {
                    Ok(va) => {
                        m.operations.with_label_values(&["release", "success"]).inc();
                        tracing::warn!(%volume, %node, va = %va.name_any(), "released the attachment of a node that is gone or out of service");
                        self.writer.events.warning(
                            &va.object_ref(&()),
                            "AttachmentReleased",
                            "Detach",
                            format!(
                                "node {node} is gone or out of service and no attacher is left there: the controller dropped the attacher's finalizer so volume {volume} can be attached elsewhere"
                            ),
                        );
                        self.succeeded(&volume, &node);
                        self.va_applied(&va);
                    }
                    Err(err) if code_is(&err, 404) => {
                        m.operations.with_label_values(&["release", "success"]).inc();
                    }
                    Err(err) => {
                        let err = Error::Api(err);
                        m.operations.with_label_values(&["release", "error"]).inc();
                        m.reconcile_errors
                            .with_label_values(&["release", err.category()])
                            .inc();
                        tracing::warn!(%volume, %node, error = %err, "release of a dead node's attachment failed");
                        if let Some(e) = self.actual.get_mut(&volume, &node) {
                            e.failed(now);
                        }
                    }
                }
                self.actual.tidy(&volume, &node, now);
            }
            Done::PvFinalizer { pv, result } => {
                self.pv_patching.remove(&pv);
                match result {
                    Ok(()) => {
                        m.operations.with_label_values(&["pv_finalizer", "success"]).inc();
                    }
                    Err(e) if code_is(&e, 404) => {}
                    Err(e) => {
                        m.operations.with_label_values(&["pv_finalizer", "error"]).inc();
                        m.reconcile_errors
                            .with_label_values(&["pv_finalizer", api_category(&e)])
                            .inc();
                        tracing::warn!(%pv, error = %e, "cannot update the attacher finalizer of the volume");
                        // A conflict is decided again on the newer copy; other errors wait for
                        // the next change or the periodic resync.
                        if code_is(&e, 409) {
                            self.pv_dirty.insert(pv);
                        }
                    }
                }
            }
            Done::Status { node, result } => {
                self.status_in_flight.remove(&node);
                match result {
                    Ok(n) => {
                        m.operations.with_label_values(&["node_status", "success"]).inc();
                        self.status_retry.remove(&node);
                        self.node_applied(&n);
                    }
                    Err(e) if code_is(&e, 404) => {
                        m.operations.with_label_values(&["node_status", "success"]).inc();
                    }
                    Err(e) => {
                        m.operations.with_label_values(&["node_status", "error"]).inc();
                        m.reconcile_errors
                            .with_label_values(&["node_status", api_category(&e)])
                            .inc();
                        tracing::warn!(%node, error = %e, "node status update failed");
                        self.status_retry.insert(node, now + STATUS_RETRY);
                    }
                }
            }
        }
        self.dirty = true;
        self.update_wake(now);
    }

    fn succeeded(&mut self, volume: &str, node: &str) {
        if let Some(e) = self.actual.get_mut(volume, node) {
            e.succeeded();
        }
    }

    /// An event on every pod that wants `volume` on `node`; `note` gets the PV name.
    fn pod_events(
        &self,
        volume: &str,
        node: &str,
        warning: bool,
        reason: &'static str,
        note: impl Fn(&str) -> String,
    ) {
        let Some(d) = self.desired.get(volume, node) else {
            return;
        };
        let text = note(&d.spec.pv_name);
        for pod in d.pods.values() {
            self.pod_event(pod, warning, reason, text.clone());
        }
    }

    fn pod_event(&self, pod: &PodRef, warning: bool, reason: &'static str, note: String) {
        let on = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            namespace: Some(pod.namespace.clone()),
            name: Some(pod.name.clone()),
            uid: Some(pod.uid.clone()),
            ..Default::default()
        };
        // Queued: events never hold up the reconciler.
        if warning {
            self.writer.events.warning(&on, reason, "Attach", note);
        } else {
            self.writer.events.normal(&on, reason, "Attach", note);
        }
    }
}

struct DetachJob {
    volume: String,
    va_name: String,
    forced: Option<ForceReason>,
    waited: Duration,
}

/// Replaces `status.volumesAttached` (a merge patch replaces the whole list, which this
/// controller owns).
/// Splits detach jobs into those safe by the live Node (`Ok(None)`: the Node is gone) and those
/// refused: a non-forced job whose volume the node lists in `status.volumesInUse`, or every
/// non-forced job when the Node could not be read.
fn split_unsafe_detaches(
    jobs: Vec<DetachJob>,
    node: &str,
    fresh: &Result<Option<Node>, String>,
) -> (Vec<DetachJob>, Vec<(DetachJob, Error)>) {
    let in_use: HashSet<&str> = match fresh {
        Ok(n) => n
            .iter()
            .filter_map(|n| n.status.as_ref()?.volumes_in_use.as_ref())
            .flatten()
            .map(String::as_str)
            .collect(),
        Err(_) => HashSet::new(),
    };
    let mut safe = Vec::new();
    let mut refused = Vec::new();
    for j in jobs {
        if j.forced.is_some() {
            safe.push(j);
        } else if let Err(e) = fresh {
            let err = Error::NodeUnreadable {
                node: node.to_string(),
                error: e.clone(),
            };
            refused.push((j, err));
        } else if in_use.contains(j.volume.as_str()) {
            refused.push((j, Error::StillInUse(node.to_string())));
        } else {
            safe.push(j);
        }
    }
    (safe, refused)
}

async fn patch_node_status(
    api: &Api<Node>,
    node: &str,
    volumes: &[(String, String)],
) -> Result<Node, kube::Error> {
    let list: Vec<serde_json::Value> = volumes
        .iter()
        .map(|(name, path)| serde_json::json!({ "name": name, "devicePath": path }))
        .collect();
    let patch = serde_json::json!({ "status": { "volumesAttached": list } });
    api.patch_status(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await
}

#[cfg(test)]
mod live_check_tests {
    use super::*;
    use k8s_openapi::api::core::v1::NodeStatus;

    fn job(volume: &str, forced: Option<ForceReason>) -> DetachJob {
        DetachJob {
            volume: volume.into(),
            va_name: format!("va-{volume}"),
            forced,
            waited: Duration::ZERO,
        }
    }

    fn names(jobs: &[DetachJob]) -> Vec<&str> {
        jobs.iter().map(|j| j.volume.as_str()).collect()
    }

    #[test]
    fn a_volume_the_live_node_still_uses_is_not_detached() {
        let node = Node {
            status: Some(NodeStatus {
                volumes_in_use: Some(vec!["used".into()]),
                ..Default::default()
            }),
            ..Default::default()
        };
        let jobs = vec![
            job("used", None),
            job("free", None),
            job("used-forced", Some(ForceReason::OutOfService)),
        ];
        let mut jobs2 = jobs;
        jobs2[2].volume = "used".into();
        let (safe, refused) = split_unsafe_detaches(jobs2, "n1", &Ok(Some(node)));
        assert_eq!(names(&safe), vec!["free", "used"]);
        assert!(safe[1].forced.is_some());
        assert_eq!(refused.len(), 1);
        assert!(matches!(&refused[0].1, Error::StillInUse(n) if n == "n1"));
        assert_eq!(refused[0].1.category(), "VolumeInUse");
    }

    #[test]
    fn a_gone_node_uses_nothing_and_an_unreadable_one_refuses_all_but_forced() {
        let (safe, refused) = split_unsafe_detaches(vec![job("v", None)], "n1", &Ok(None));
        assert_eq!(names(&safe), vec!["v"]);
        assert!(refused.is_empty());
        let (safe, refused) = split_unsafe_detaches(
            vec![job("v", None), job("w", Some(ForceReason::Timeout))],
            "n1",
            &Err("timeout".into()),
        );
        assert_eq!(names(&safe), vec!["w"]);
        assert_eq!(refused.len(), 1);
        assert_eq!(refused[0].1.category(), "NodeUnreadable");
    }
}

#[cfg(test)]
mod live_tests {
    use super::*;
    use kube::api::Patch;
    use stowage_testkit::builders::{csi_driver, node as node_builder, pod, pv, pvc};
    use stowage_testkit::{InProcess, eventually, inproc::WAIT};

    /// A write task that panics reports its attach as failed on the way down, so the volume is
    /// retried (with backoff) and attached, instead of staying "in flight" for good.
    #[tokio::test]
    async fn a_panicked_attach_task_is_retried_and_the_volume_attached() {
        const DRIVER: &str = "panic.test.stowage.dev";
        let mut h = InProcess::new().await;
        h.namespace("app").await;
        h.create(csi_driver(DRIVER, true)).await;
        h.create(node_builder("n1").controller_attach().build()).await;
        let ready = serde_json::json!({"status": {"conditions": [{"type": "Ready", "status": "True"}]}});
        Api::<Node>::all(h.client.clone())
            .patch_status("n1", &PatchParams::default(), &Patch::Merge(&ready))
            .await
            .unwrap();
        let claim = h.create_pvc(pvc("app", "c").volume_name("boom").build()).await;
        h.create_pv(
            pv("boom")
                .driver(DRIVER, "h-boom")
                .claim_ref("app", "c", &claim.uid().unwrap())
                .build(),
        )
        .await;
        let bound = Patch::Merge(serde_json::json!({"status": {"phase": "Bound"}}));
        h.pvs()
            .patch_status("boom", &PatchParams::default(), &bound)
            .await
            .unwrap();
        h.pvcs("app")
            .patch_status("c", &PatchParams::default(), &bound)
            .await
            .unwrap();
        *PANIC_ON_ATTACH.lock().unwrap() = Some("boom".into());

        let cluster = h.cluster().await;
        let metrics = Metrics::new(&h.registry);
        h.run(run(cluster, metrics, Config::default()));
        Api::<Pod>::namespaced(h.client.clone(), "app")
            .create(
                &PostParams::default(),
                &pod("app", "p").claim("data", "c").node("n1").build(),
            )
            .await
            .unwrap();
        let vas: Api<VolumeAttachment> = Api::all(h.client.clone());
        eventually(WAIT, || async {
            let list = vas.list(&Default::default()).await.map_err(|e| e.to_string())?;
            list.items
                .iter()
                .any(|va| va.spec.source.persistent_volume_name.as_deref() == Some("boom"))
                .then_some(())
                .ok_or_else(|| "no VolumeAttachment for boom yet".to_string())
        })
        .await;
        assert!(
            PANIC_ON_ATTACH.lock().unwrap().is_none(),
            "the hook fired: the first attach task did panic"
        );
        let text = h.metrics_text();
        assert!(
            text.lines()
                .any(|l| l.starts_with("stowage_attachdetach_operations_total")
                    && l.contains("operation=\"attach\"")
                    && l.contains("result=\"error\"")),
            "the panic was counted as a failed attach:\n{text}"
        );
        assert!(!h.controller_finished(), "the controller kept running");
    }
}

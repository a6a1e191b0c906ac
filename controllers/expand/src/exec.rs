//! The thin async layer. One task decides (serially, from the shared stores plus the objects this
//! controller wrote itself, newest resourceVersion winning); each claim's work runs in a task of
//! its own, at most one per claim, and reports the objects it wrote back to the decision task.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, Resource, ResourceExt};
use stowage_common::cluster::Cluster;
use stowage_common::events::Events;
use stowage_common::inflight::{Landed, Window};
use stowage_common::informer::{Change, is_newer};
use stowage_common::pv::{claim_class, claim_key, claim_ref, claim_volume_name, pv_block};
use stowage_common::queue::WorkQueue;
use stowage_common::writes::{Writes, is_conflict};
use stowage_loopdriver::{ImageError, ImageStore};
use tokio::time::Instant;

use crate::core::{self, Action, Size};
use crate::metrics::Metrics;

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

#[derive(Debug, thiserror::Error)]
enum WorkError {
    #[error("conflict: the object changed since it was read")]
    Conflict,
    #[error("{0}")]
    Api(#[from] kube::Error),
    #[error("{error}")]
    Image { error: ImageError, infeasible: bool },
}

impl WorkError {
    fn category(&self) -> &'static str {
        match self {
            WorkError::Conflict => "Conflict",
            WorkError::Api(_) => "ApiError",
            WorkError::Image { infeasible: true, .. } => "Infeasible",
            WorkError::Image { .. } => "ImageError",
        }
    }

    /// An infeasible expansion is not retried on a timer; a changed request (or the slow retry
    /// of the core) starts the next attempt.
    fn retry(&self) -> bool {
        !matches!(self, WorkError::Image { infeasible: true, .. })
    }
}

fn api_err(e: kube::Error) -> WorkError {
    if is_conflict(&e) {
        WorkError::Conflict
    } else {
        WorkError::Api(e)
    }
}

/// Errors that no retry at the same size can fix.
fn infeasible(e: &ImageError) -> bool {
    match e {
        ImageError::BadHandle(_) => true,
        ImageError::Io { source, .. } => matches!(
            source.raw_os_error(),
            Some(libc::EFBIG | libc::EINVAL | libc::ENAMETOOLONG)
        ),
    }
}

/// What one claim's work reports back.
struct Done {
    claims: Vec<PersistentVolumeClaim>,
    pvs: Vec<PersistentVolume>,
    /// When this process started an expansion of the claim (for the total duration).
    started: Option<Instant>,
    error: Option<WorkError>,
}

/// The last event published per claim, so a state that persists is reported once.
type LastEvents = Arc<Mutex<HashMap<String, (String, String)>>>;

#[derive(Clone)]
struct Worker {
    client: Client,
    events: Events,
    last_events: LastEvents,
    metrics: Metrics,
    image_dir: PathBuf,
    attachments: Store<VolumeAttachment>,
}

struct Brain {
    /// Work tasks, one per claim: dropped (aborted) with the controller when leadership ends,
    /// so a former leader stops writing at once; claims wait in the queue while it is full.
    window: Window<String, Done>,
    cluster: Arc<Cluster>,
    queue: WorkQueue<String>,
    /// Objects this controller wrote, until the stores catch up (newest resourceVersion wins).
    claims: HashMap<String, Arc<PersistentVolumeClaim>>,
    pvs: HashMap<String, Arc<PersistentVolume>>,
    /// Claims with a resize status, and when this process started their expansion.
    resizing: HashMap<String, Option<Instant>>,
    worker: Worker,
}

pub async fn run(cluster: Arc<Cluster>, metrics: Metrics, config: Config) -> anyhow::Result<()> {
    // Subscribe before reading the stores so nothing falls between the two.
    let mut pvc_feed = cluster.pvcs.feed();
    let mut pv_feed = cluster.pvs.feed();
    let mut class_feed = cluster.classes.feed();
    let client = cluster.client.clone();
    let mut brain = Brain {
        window: Window::new(config.max_in_flight),
        queue: WorkQueue::default().named("volume_expand"),
        claims: HashMap::new(),
        pvs: HashMap::new(),
        resizing: HashMap::new(),
        worker: Worker {
            events: Events::new(client.clone(), "stowage-expand"),
            client,
            last_events: Arc::default(),
            metrics,
            image_dir: config.image_dir.clone(),
            attachments: cluster.attachments.store().clone(),
        },
        cluster,
    };
    brain.resync();
    let mut resync = tokio::time::interval_at(Instant::now() + config.resync, config.resync);
    loop {
        brain.worker.metrics.queue_depth.set(brain.queue.len() as i64);
        brain.queue.report(Instant::now());
        brain.worker.metrics.in_progress.set(brain.resizing.len() as i64);
        let next_due = brain.queue.next_due();
        tokio::select! {
            biased;
            landed = brain.window.next() => brain.finish(landed),
            r = pvc_feed.next() => match r? {
                Change::Applied(c) => brain.claim_seen(&c),
                Change::Deleted(c) => brain.claim_gone(&c),
                Change::Resynced => brain.resync(),
            },
            r = pv_feed.next() => match r? {
                Change::Applied(pv) => brain.pv_seen(&pv),
                Change::Deleted(pv) => {
                    brain.pvs.remove(&pv.name_any());
                    brain.queue_claim_of(&pv);
                }
                Change::Resynced => brain.resync(),
            },
            r = class_feed.next() => match r? {
                // A class that now allows expansion unblocks its claims (and a refusal is news).
                Change::Applied(sc) | Change::Deleted(sc) => brain.wake_class(&sc.name_any()),
                Change::Resynced => brain.resync(),
            },
            _ = resync.tick() => brain.resync(),
            _ = std::future::ready(()), if brain.window.has_room() && brain.queue.has_ready() => brain.work(Instant::now()),
            _ = tokio::time::sleep_until(next_due.unwrap_or_else(Instant::now)), if next_due.is_some() && brain.window.has_room() => {
                brain.work(Instant::now())
            }
        }
    }
}

fn split(key: &str) -> (&str, &str) {
    key.split_once('/').unwrap_or(("", key))
}

fn newest<K: kube::Resource>(a: Option<Arc<K>>, b: Option<&Arc<K>>) -> Option<Arc<K>> {
    match (a, b) {
        (Some(a), Some(b))
            if is_newer(
                b.meta().resource_version.as_deref(),
                a.meta().resource_version.as_deref(),
            ) =>
        {
            Some(b.clone())
        }
        (Some(a), _) => Some(a),
        (None, b) => b.cloned(),
    }
}

impl Brain {
    fn claim(&self, key: &str) -> Option<Arc<PersistentVolumeClaim>> {
        let (ns, name) = split(key);
        let stored = self.cluster.pvcs.store().get(&ObjectRef::new(name).within(ns));
        // A claim gone from the store is gone, whatever we wrote before.
        stored.as_ref()?;
        newest(stored, self.claims.get(key))
    }

    fn pv(&self, name: &str) -> Option<Arc<PersistentVolume>> {
        let stored = self.cluster.pvs.store().get(&ObjectRef::new(name));
        stored.as_ref()?;
        newest(stored, self.pvs.get(name))
    }

    /// Queues every bound claim (the periodic net, and after a relist).
    fn resync(&mut self) {
        let live: HashSet<String> = self
            .cluster
            .pvcs
            .store()
            .state()
            .iter()
            .map(|c| claim_key(c))
            .collect();
        self.claims.retain(|k, _| live.contains(k));
        self.resizing.retain(|k, _| live.contains(k));
        let live_pvs: HashSet<String> = self
            .cluster
            .pvs
            .store()
            .state()
            .iter()
            .map(|p| p.name_any())
            .collect();
        self.pvs.retain(|k, _| live_pvs.contains(k));
        for key in live {
            if let Some(c) = self.claim(&key) {
                self.observe(&key, &c);
                if !claim_volume_name(&c).is_empty() {
                    self.queue.add(key);
                }
            }
        }
    }

    fn claim_seen(&mut self, c: &PersistentVolumeClaim) {
        let key = claim_key(c);
        // Our own writes come back through the watch; they are known already and must not
        // bypass the backoff of a failing claim.
        if let Some(mine) = self.claims.get(&key) {
            let (seen, written) = (c.resource_version(), mine.resource_version());
            if !is_newer(seen.as_deref(), written.as_deref()) {
                // Our write's own echo: the store holds it now, so our copy can go.
                if seen == written {
                    self.claims.remove(&key);
                }
                return;
            }
            self.claims.remove(&key);
        }
        self.observe(&key, c);
        if !self.window.defer_if_running(&key) && !claim_volume_name(c).is_empty() {
            self.queue.add(key);
        }
    }

    fn claim_gone(&mut self, c: &PersistentVolumeClaim) {
        let key = claim_key(c);
        self.claims.remove(&key);
        self.resizing.remove(&key);
        self.worker
            .last_events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key);
    }

    fn pv_seen(&mut self, pv: &PersistentVolume) {
        let name = pv.name_any();
        if let Some(mine) = self.pvs.get(&name) {
            let (seen, written) = (pv.resource_version(), mine.resource_version());
            if !is_newer(seen.as_deref(), written.as_deref()) {
                // Our write's own echo: the store holds it now, so our copy can go.
                if seen == written {
                    self.pvs.remove(&name);
                }
                return;
            }
            self.pvs.remove(&name);
        }
        self.queue_claim_of(pv);
    }

    fn queue_claim_of(&mut self, pv: &PersistentVolume) {
        if let Some((ns, name, _)) = claim_ref(pv) {
            let key = format!("{ns}/{name}");
            if !self.window.defer_if_running(&key) {
                self.queue.add(key);
            }
        }
    }

    fn wake_class(&mut self, class: &str) {
        for c in self.cluster.pvcs.store().state() {
            if claim_class(&c) == Some(class) && !claim_volume_name(&c).is_empty() {
                self.queue.add(claim_key(&c));
            }
        }
    }

    /// Tracks resizes under way (a gauge) and, when one this process started ends, its duration.
    fn observe(&mut self, key: &str, c: &PersistentVolumeClaim) {
        if core::resize_status(c).is_some() {
            self.resizing.entry(key.to_string()).or_insert(None);
        } else if let Some(Some(started)) = self.resizing.remove(key) {
            let reached = match (core::capacity(c), core::allocated(c)) {
                (Some(cap), Some(a)) => cap.bytes >= a.bytes,
                _ => false,
            };
            if reached {
                self.worker
                    .metrics
                    .expansion_seconds
                    .with_label_values(&["total"])
                    .observe(started.elapsed().as_secs_f64());
            }
        }
    }

    fn work(&mut self, now: Instant) {
        for _ in 0..256 {
            if !self.window.has_room() {
                return;
            }
            let Some(key) = self.queue.pop(now) else { return };
            self.sync(key);
        }
    }

    fn sync(&mut self, key: String) {
        if self.window.defer_if_running(&key) {
            return;
        }
        let Some(claim) = self.claim(&key) else {
            self.queue.forget(&key);
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
            .is_some_and(|v| is_attached(&self.worker.attachments, &v.name_any()));
        let actions = core::sync_claim(
            &claim,
            pv.as_deref(),
            class.as_deref(),
            attached,
            Timestamp::now(),
        );
        self.worker.metrics.reconciles.with_label_values(&["claim"]).inc();
        // Events are queued, not awaited: a sync that only reports needs no write task.
        if actions.iter().all(|a| matches!(a, Action::Event { .. })) {
            for e in &actions {
                if let Action::Event {
                    warning,
                    reason,
                    note,
                } = e
                {
                    self.worker.report(&key, &claim, *warning, reason, note);
                }
            }
            self.queue.forget(&key);
            return;
        }
        let worker = self.worker.clone();
        self.window.start(key.clone(), async move {
            let timer = worker
                .metrics
                .reconcile_seconds
                .with_label_values(&["claim"])
                .start_timer();
            let mut done = Done {
                claims: vec![],
                pvs: vec![],
                started: None,
                error: None,
            };
            for a in &actions {
                if let Err(e) = worker.apply(&key, a, &claim, pv.as_deref(), &mut done).await {
                    tracing::warn!(claim = %key, error = %e, "expansion work failed");
                    done.error = Some(e);
                    break;
                }
            }
            timer.observe_duration();
            done
        });
    }

    fn finish(&mut self, landed: Landed<String, Done>) {
        let key = landed.key;
        let Some(done) = landed.result else {
            // The task died without a report: retry the claim with backoff.
            self.worker.metrics.errors.with_label_values(&["Panic"]).inc();
            self.queue.retry(key, Instant::now());
            return;
        };
        for c in done.claims {
            let c = Arc::new(c);
            self.claims.insert(key.clone(), c);
        }
        for v in done.pvs {
            self.pvs.insert(v.name_any(), Arc::new(v));
        }
        if let Some(t) = done.started {
            self.resizing.insert(key.clone(), Some(t));
        }
        if let Some(c) = self.claim(&key) {
            self.observe(&key, &c);
        }
        match done.error {
            Some(e) => {
                self.worker
                    .metrics
                    .errors
                    .with_label_values(&[e.category()])
                    .inc();
                if e.retry() {
                    self.queue.retry(key.clone(), Instant::now());
                }
            }
            None => self.queue.forget(&key),
        }
        // Changed by someone else meanwhile: decide again on the newer object now.
        if landed.dirty {
            let (ns, name) = split(&key);
            let stored = self.cluster.pvcs.store().get(&ObjectRef::new(name).within(ns));
            let mine = self.claims.get(&key);
            let theirs_newer = match (&stored, mine) {
                (Some(s), Some(m)) => {
                    is_newer(s.resource_version().as_deref(), m.resource_version().as_deref())
                }
                _ => true,
            };
            if theirs_newer {
                self.queue.add(key);
            }
        }
    }
}

fn is_attached(store: &Store<VolumeAttachment>, pv: &str) -> bool {
    store
        .state()
        .iter()
        .any(|va| va.spec.source.persistent_volume_name.as_deref() == Some(pv))
}

impl Worker {
    fn writes(&self) -> Writes {
        Writes::new(self.client.clone(), self.metrics.writes.clone())
    }

    async fn replace_claim_status(
        &self,
        c: &PersistentVolumeClaim,
        op: &str,
    ) -> Result<PersistentVolumeClaim, WorkError> {
        self.writes().replace_claim_status(c, op).await.map_err(api_err)
    }

    async fn replace_pv(&self, v: &PersistentVolume, op: &str) -> Result<PersistentVolume, WorkError> {
        self.writes().replace_pv(v, op).await.map_err(api_err)
    }

    /// An event the core decided on, with its metrics; sent once per (reason, note).
    fn report(&self, key: &str, claim: &PersistentVolumeClaim, warning: bool, reason: &str, note: &str) {
        if !self.event(key, claim, warning, reason, note.to_string(), true) {
            return;
        }
        let outcome = match reason {
            core::REASON_NOT_ALLOWED => {
                self.metrics.failures.with_label_values(&["NotAllowed"]).inc();
                return;
            }
            core::REASON_RESIZE_CANCELED => "canceled",
            core::REASON_EXTERNAL_EXPANDING => "handed_off",
            _ => return,
        };
        self.metrics.expansions.with_label_values(&[outcome]).inc();
    }

    /// Publishes an event; with `once`, not again while the claim's last one is the same.
    /// Returns whether it was sent.
    fn event(
        &self,
        key: &str,
        on: &PersistentVolumeClaim,
        warning: bool,
        reason: &str,
        note: String,
        once: bool,
    ) -> bool {
        {
            let mut last = self.last_events.lock().unwrap_or_else(|p| p.into_inner());
            let entry = (reason.to_string(), note.clone());
            if once && last.get(key) == Some(&entry) {
                return false;
            }
            last.insert(key.to_string(), entry);
        }
        let target = on.object_ref(&());
        if warning {
            self.events.warning(&target, reason, "Resize", note);
        } else {
            self.events.normal(&target, reason, "Resize", note);
        }
        true
    }

    async fn apply(
        &self,
        key: &str,
        action: &Action,
        claim: &Arc<PersistentVolumeClaim>,
        pv: Option<&PersistentVolume>,
        done: &mut Done,
    ) -> Result<(), WorkError> {
        match action {
            Action::Event {
                warning,
                reason,
                note,
            } => self.report(key, claim, *warning, reason, note),
            Action::ClaimStatus { claim: next, op } => {
                done.claims.push(self.replace_claim_status(next, op).await?);
            }
            Action::Volume { pv: next, op } => {
                done.pvs.push(self.replace_pv(next, op).await?);
            }
            Action::Expand {
                pv: pv_name,
                handle,
                size,
                mark,
                node_step,
                filesystem,
            } => {
                let Some(pv) = pv.filter(|v| v.name_any() == *pv_name) else {
                    return Ok(());
                };
                self.expand(key, claim, pv, handle, size, *mark, *node_step, *filesystem, done)
                    .await?;
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    async fn expand(
        &self,
        key: &str,
        claim: &PersistentVolumeClaim,
        pv: &PersistentVolume,
        handle: &str,
        size: &Size,
        mark: bool,
        mut node_step: bool,
        filesystem: bool,
        done: &mut Done,
    ) -> Result<(), WorkError> {
        let started = Instant::now();
        let mut c = claim.clone();
        let human = size.quantity.0.clone();
        if mark {
            c = self
                .replace_claim_status(
                    &core::mark_in_progress(&c, size, Timestamp::now()),
                    "mark_resizing",
                )
                .await?;
            done.claims.push(c.clone());
            done.started = Some(started);
            let note = format!("expanding volume {} to {human}", pv.name_any());
            self.event(key, &c, false, core::REASON_RESIZING, note, false);
        }

        let bytes = u64::try_from(size.bytes).unwrap_or(u64::MAX);
        let (dir, h) = (self.image_dir.clone(), handle.to_string());
        // Grow only: a missing image is an error to report, never a fresh empty volume.
        let grown = tokio::task::spawn_blocking(move || ImageStore::new(dir).grow(&h, bytes))
            .await
            .unwrap_or_else(|e| {
                Err(ImageError::Io {
                    path: PathBuf::new(),
                    source: std::io::Error::other(e),
                })
            });
        if let Err(error) = grown {
            let infeasible = infeasible(&error);
            let msg = format!("failed to expand volume {} to {human}: {error}", pv.name_any());
            let reason = if infeasible { "Infeasible" } else { "ImageError" };
            self.metrics.failures.with_label_values(&[reason]).inc();
            self.metrics.expansions.with_label_values(&["failed"]).inc();
            if let Some(next) = core::mark_failed(&c, &msg, infeasible, Timestamp::now()) {
                c = self.replace_claim_status(&next, "mark_failed").await?;
                done.claims.push(c.clone());
            }
            self.event(key, &c, true, core::REASON_RESIZE_FAILED, msg, true);
            return Err(WorkError::Image { error, infeasible });
        }

        // The volume may have been attached since the decision: then its device needs a refresh.
        if !node_step && is_attached(&self.attachments, &pv.name_any()) {
            node_step = true;
        }
        let pre_resize = if node_step { core::capacity(&c) } else { None };
        if let Some(next) = core::grown_pv(pv, size, pre_resize.as_ref()) {
            done.pvs.push(self.replace_pv(&next, "grow_volume").await?);
        }
        if node_step {
            c = self
                .replace_claim_status(
                    &core::mark_node_pending(&c, filesystem, Timestamp::now()),
                    "mark_node_pending",
                )
                .await?;
            done.claims.push(c.clone());
            self.metrics.expansions.with_label_values(&["node_pending"]).inc();
            let note = if filesystem {
                format!(
                    "volume {} grown to {human}; the node must resize the file system",
                    pv.name_any()
                )
            } else {
                format!(
                    "volume {} grown to {human}; the node must refresh the device",
                    pv.name_any()
                )
            };
            self.event(key, &c, false, core::REASON_FS_RESIZE_REQUIRED, note, false);
        } else {
            c = self
                .replace_claim_status(&core::mark_finished(&c, size), "mark_finished")
                .await?;
            done.claims.push(c.clone());
            self.metrics.expansions.with_label_values(&["finished"]).inc();
            let note = format!("volume {} expanded to {human}", pv.name_any());
            self.event(key, &c, false, core::REASON_RESIZE_SUCCESSFUL, note, false);
        }
        self.metrics
            .expansion_seconds
            .with_label_values(&["controller"])
            .observe(started.elapsed().as_secs_f64());
        Ok(())
    }
}

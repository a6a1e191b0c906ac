//! The volume manager's async layer: one task observes (caches + mount table), decides with
//! `reconcile`, and starts operations; each operation runs as its own task and reports back. The
//! mount table is read on every pass, so the actual state is reconstructed at start and can never
//! drift from the node's truth.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolumeClaim};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{Patch, PatchParams};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::ctx::Ctx;
use crate::fsgroup;
use crate::mountinfo::{self, DevNo, MountEntry};
use crate::paths::{Place, unique_name};
use crate::probe::{self, Answer, Health, Prober};
use crate::reconcile::{Op, reconcile, schedule};
use crate::state::{Actual, Attachment, Desired, DesiredVolume, Mounted, PodInfo, PodMount, View, desired};
use crate::sys;
use crate::tracker::Tracker;

/// Longest sleep between passes: mounts are re-checked for health at least this often.
const PERIOD: Duration = Duration::from_secs(1);

/// What an operation reports back to the loop.
struct Done {
    op: Op,
    ok: bool,
    /// A claim whose expansion was finished: (uid, resourceVersion written).
    expanded: Option<(String, String)>,
}

/// Channels between the volume manager and the node status task.
pub struct NodeLink {
    /// Unique names to list in `volumesInUse` (None until the first pass).
    pub in_use: watch::Sender<Option<BTreeSet<String>>>,
    /// Unique names the node status lists now.
    pub reported: watch::Receiver<BTreeSet<String>>,
}

/// Rate limit for repeated "cannot mount yet" events of one (pod, volume, reason).
struct Noted {
    message: String,
    next: Instant,
    delay: Duration,
}

/// First gap between repeats of the same event; it doubles up to `NOTE_MAX`.
const NOTE_FIRST: Duration = Duration::from_secs(10);
const NOTE_MAX: Duration = Duration::from_secs(300);

/// Records that `key` wants to say `message` now; true when it is due (first time, a new
/// message, or the gap since the last one passed; gaps double while the message stays).
fn note_due<K: std::hash::Hash + Eq>(
    noted: &mut HashMap<K, Noted>,
    key: K,
    message: &str,
    now: Instant,
) -> bool {
    let due = match noted.get(&key) {
        None => true,
        Some(n) => n.message != message || now >= n.next,
    };
    if !due {
        return false;
    }
    let delay = noted
        .get(&key)
        .filter(|n| n.message == message)
        .map_or(NOTE_FIRST, |n| (n.delay * 2).min(NOTE_MAX));
    noted.insert(
        key,
        Noted {
            message: message.to_string(),
            next: now + delay,
            delay,
        },
    );
    true
}

/// Why a pass could not see the node. Nothing is decided or published on such a pass: an empty
/// table read as "nothing mounted" would drop every volume from `volumesInUse` and let the
/// controller detach what pods are using.
#[derive(Debug, thiserror::Error)]
pub enum ObserveError {
    #[error("cannot read the mount table {path}: {error}")]
    MountTable { path: String, error: std::io::Error },
    #[error("cannot list {path}: {error}")]
    VolumeDirs { path: String, error: std::io::Error },
}

impl ObserveError {
    /// The `source` label of `stowage_agent_observe_errors_total`.
    pub fn source_label(&self) -> &'static str {
        match self {
            ObserveError::MountTable { .. } => "mount_table",
            ObserveError::VolumeDirs { .. } => "volume_dirs",
        }
    }

    /// The Event reason on the Node.
    pub fn reason(&self) -> &'static str {
        match self {
            ObserveError::MountTable { .. } => "MountTableUnreadable",
            ObserveError::VolumeDirs { .. } => "VolumeDirUnreadable",
        }
    }
}

pub async fn run(ctx: Arc<Ctx>, mut link: NodeLink, mut stop: watch::Receiver<bool>) {
    tokio::join!(
        ctx.pods.ready(),
        ctx.pvcs.ready(),
        ctx.pvs.ready(),
        ctx.vas.ready()
    );
    let mut pods_rx = ctx.pods.subscribe();
    let mut pvcs_rx = ctx.pvcs.subscribe();
    let mut pvs_rx = ctx.pvs.subscribe();
    let mut vas_rx = ctx.vas.subscribe();
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<Done>();
    let mut tasks = JoinSet::new();
    let mut tracker = Tracker::default();
    let mut expanded: BTreeMap<String, String> = BTreeMap::new();
    let mut known_pods: HashMap<String, PodInfo> = HashMap::new();
    let mut handles: HashMap<String, String> = HashMap::new();
    let mut noted: HashMap<(String, String, &'static str), Noted> = HashMap::new();
    let mut blind: HashMap<&'static str, Noted> = HashMap::new();
    let prober = Prober::new(ctx.metrics.probes_in_flight.clone());
    tracing::info!("volume manager started");
    loop {
        let now = Instant::now();
        match observe_and_decide(&ctx, &link, &expanded, &prober).await {
            Ok((d, a)) => {
                if !blind.is_empty() {
                    tracing::info!("the node can be observed again, resuming");
                    blind.clear();
                }
                pass(
                    &ctx,
                    &link,
                    Pass {
                        d,
                        a,
                        now,
                        tracker: &mut tracker,
                        known_pods: &mut known_pods,
                        handles: &mut handles,
                        noted: &mut noted,
                        tasks: &mut tasks,
                        done_tx: &done_tx,
                    },
                )
                .await;
            }
            Err(e) => {
                // Keep the last known state: publish nothing, start nothing, look again soon.
                ctx.metrics
                    .observe_errors
                    .with_label_values(&[e.source_label()])
                    .inc();
                tracing::error!(error = %e, "cannot observe the node's volumes; keeping the last known state");
                let note = format!(
                    "{e}; the volume manager keeps its last known state (volumesInUse unchanged, nothing mounted or unmounted) and retries"
                );
                if note_due(&mut blind, e.reason(), &note, now) {
                    let node = k8s_openapi::api::core::v1::ObjectReference {
                        api_version: Some("v1".into()),
                        kind: Some("Node".into()),
                        name: Some(ctx.node.clone()),
                        ..Default::default()
                    };
                    ctx.events.warning(&node, e.reason(), "Observe", note);
                }
            }
        }

        // Sleep until something changes, an operation ends, a backoff expires or the period ends.
        let wake = tracker
            .next_expiry(now)
            .map_or(now + PERIOD, |t| t.min(now + PERIOD));
        tokio::select! {
            _ = pods_rx.recv() => {}
            _ = pvcs_rx.recv() => {}
            _ = pvs_rx.recv() => {}
            _ = vas_rx.recv() => {}
            _ = link.reported.changed() => {}
            Some(done) = done_rx.recv() => finish(&mut tracker, &mut expanded, done),
            _ = tokio::time::sleep_until(wake) => {}
            _ = stop.changed() => break,
        }
        // Fold everything else that queued up into this one wake-up.
        while let Ok(done) = done_rx.try_recv() {
            finish(&mut tracker, &mut expanded, done);
        }
        drain(&mut pods_rx);
        drain(&mut pvcs_rx);
        drain(&mut pvs_rx);
        drain(&mut vas_rx);
        // Let a burst of changes settle before the next full pass.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Let running operations end: a tool killed half-way (mkfs above all) could leave a device
    // that can neither be used nor safely reformatted.
    tracing::info!(running = tracker.running(), "volume manager stopping");
    let _ = tokio::time::timeout(Duration::from_secs(30), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
}

/// The state one pass works on, and the loop's memory it updates.
struct Pass<'a> {
    d: Desired,
    a: Actual,
    now: Instant,
    tracker: &'a mut Tracker,
    known_pods: &'a mut HashMap<String, PodInfo>,
    handles: &'a mut HashMap<String, String>,
    noted: &'a mut HashMap<(String, String, &'static str), Noted>,
    tasks: &'a mut JoinSet<()>,
    done_tx: &'a mpsc::UnboundedSender<Done>,
}

/// One pass on a node that could be observed: publish the in-use set, report, decide, start.
async fn pass(ctx: &Arc<Ctx>, link: &NodeLink, p: Pass<'_>) {
    let Pass {
        d,
        a,
        now,
        tracker,
        known_pods,
        handles,
        noted,
        tasks,
        done_tx,
    } = p;
    for (pv, dv) in &d.volumes {
        handles.insert(pv.clone(), dv.handle.clone());
        for u in dv.pods.values() {
            known_pods.insert(u.pod.uid.clone(), u.pod.clone());
        }
    }
    // volumesInUse: wanted or still (partly) mounted here.
    let in_use: BTreeSet<String> = d
        .volumes
        .values()
        .map(DesiredVolume::unique_name)
        .chain(a.volumes.keys().map(|pv| {
            let handle = handles.get(pv).cloned().or_else(|| {
                ctx.pv(pv)
                    .and_then(|p| p.spec.as_ref()?.csi.as_ref().map(|c| c.volume_handle.clone()))
            });
            unique_name(handle.as_deref().unwrap_or(pv))
        }))
        .collect();
    link.in_use.send_if_modified(|cur| {
        let changed = cur.as_ref() != Some(&in_use);
        if changed {
            *cur = Some(in_use.clone());
        }
        changed
    });
    note_errors(ctx, &d, noted, now).await;
    note_unsure(ctx, &d, &a, known_pods, noted, now);
    ctx.metrics
        .volumes
        .with_label_values(&["desired"])
        .set(d.volumes.len() as i64);
    ctx.metrics
        .volumes
        .with_label_values(&["actual"])
        .set(a.volumes.len() as i64);
    let want_pods: usize = d.volumes.values().map(|v| v.pods.len()).sum();
    ctx.metrics
        .pod_volumes
        .with_label_values(&["desired"])
        .set(want_pods as i64);
    let have_pods = a
        .volumes
        .values()
        .flat_map(|v| v.pods.values())
        .filter(|p| p.state.ok())
        .count();
    ctx.metrics
        .pod_volumes
        .with_label_values(&["actual"])
        .set(have_pods as i64);
    let mut health: BTreeMap<&str, i64> = crate::metrics::HEALTH_STATES.iter().map(|h| (*h, 0)).collect();
    let states = a
        .volumes
        .values()
        .flat_map(|v| v.device.iter().chain(v.pods.values().map(|p| &p.state)))
        .filter(|m| m.mounted);
    for m in states {
        let label = match m.health {
            Health::Healthy => "healthy",
            Health::Pending => "pending",
            Health::Unknown(_) => "unknown",
            Health::Broken(_) => "broken",
        };
        *health.entry(label).or_default() += 1;
    }
    for (label, n) in health {
        ctx.metrics.mount_health.with_label_values(&[label]).set(n);
    }
    ctx.metrics.passes.with_label_values(&["volumes"]).inc();

    let ops = reconcile(&d, &a);
    let wanted: BTreeSet<_> = ops.iter().map(|o| o.key()).collect();
    tracker.retain(|k| wanted.contains(k));
    for op in schedule(ops, tracker, now) {
        tracker.start(op.key());
        let job = Job {
            ctx: ctx.clone(),
            dv: d.volumes.get(op.pv()).cloned(),
            actual: a.volumes.get(op.pv()).cloned().unwrap_or_default(),
            pod: match &op {
                Op::Teardown { uid, .. } | Op::Mount { uid, .. } => known_pods.get(uid).cloned(),
                _ => None,
            },
        };
        let tx = done_tx.clone();
        tasks.spawn(async move {
            let done = job.run(op).await;
            let _ = tx.send(done);
        });
    }
    known_pods
        .retain(|uid, _| d.live_pods.contains(uid) || a.volumes.values().any(|v| v.pods.contains_key(uid)));
}

/// Empties a change feed: the next pass reads the stores, not the changes.
pub fn drain<T: Clone>(rx: &mut tokio::sync::broadcast::Receiver<T>) {
    use tokio::sync::broadcast::error::TryRecvError;
    loop {
        match rx.try_recv() {
            Ok(_) | Err(TryRecvError::Lagged(_)) => {}
            Err(_) => return,
        }
    }
}

fn finish(tracker: &mut Tracker, expanded: &mut BTreeMap<String, String>, done: Done) {
    tracker.finish(&done.op.key(), done.op.kind(), done.ok, Instant::now());
    if let Some((uid, rv)) = done.expanded {
        expanded.insert(uid, rv);
    }
}

async fn observe_and_decide(
    ctx: &Ctx,
    link: &NodeLink,
    expanded: &BTreeMap<String, String>,
    prober: &Prober,
) -> Result<(Desired, Actual), ObserveError> {
    // The node first: without it nothing can be decided safely.
    let a = observe(ctx, prober).await?;
    let reported = link.reported.borrow().clone();
    let pods = ctx.pods.store().state();
    let d = {
        let view = View {
            pvc: &|ns, n| ctx.pvc(ns, n),
            pv: &|n| ctx.pv(n),
            va: &|pv, h| ctx.va_for(pv, h),
            reported: &reported,
            expanded,
            now: Timestamp::now(),
        };
        desired(pods.iter().map(|p| p.as_ref()), &view)
    };
    Ok((d, a))
}

/// The actual state: mounts under the root dir from the mount table, plus leftover directories
/// and block device files found on disk, each judged for health. Any read error of the table or
/// of the directories is an error, never an empty (or partial) state.
pub async fn observe(ctx: &Ctx, prober: &Prober) -> Result<Actual, ObserveError> {
    let table = mountinfo::read_from(&ctx.mount_table)
        .await
        .map_err(|error| ObserveError::MountTable {
            path: ctx.mount_table.display().to_string(),
            error,
        })?;
    let layout = &ctx.layout;
    let mut places: BTreeMap<Place, Vec<MountEntry>> = BTreeMap::new();
    for m in table {
        if let Some(p) = layout.parse(&m.mount_point) {
            places.entry(p).or_default().push(m);
        }
    }
    for p in scan_dirs(layout).await? {
        places.entry(p).or_default();
    }
    let seen: BTreeSet<_> = places.keys().map(|p| layout.path_of(p)).collect();
    let checks = places.into_iter().map(|(place, entries)| async move {
        let path = layout.path_of(&place);
        let state = match &place {
            Place::PodDevice { .. } => device_file_state(&path).await,
            _ => mount_state(prober, &path, &entries).await,
        };
        (place, state)
    });
    let mut actual = Actual::default();
    for (place, state) in join_all(checks).await {
        match place {
            Place::Global { pv } => actual.volumes.entry(pv).or_default().device = Some(state),
            Place::PodMount { uid, pv } => {
                actual
                    .volumes
                    .entry(pv)
                    .or_default()
                    .pods
                    .insert(uid, PodMount { block: false, state });
            }
            Place::PodDevice { uid, pv } => {
                actual
                    .volumes
                    .entry(pv)
                    .or_default()
                    .pods
                    .insert(uid, PodMount { block: true, state });
            }
        }
    }
    prober.retain_seen(&seen);
    Ok(actual)
}

/// A mount's health, judged from its probe (`probe::judge`): the top mount's device as `stat`
/// shows it, and its source device node's numbers.
async fn mount_state(prober: &Prober, path: &Path, entries: &[MountEntry]) -> Mounted {
    let Some(top) = entries.last() else {
        return Mounted::absent();
    };
    let (answer, _) = prober.ask(path).await;
    let source_devno = match answer {
        Answer::Stat(Ok(_)) => sys::rdev(Path::new(&top.source)).await,
        _ => None,
    };
    Mounted {
        mounted: true,
        health: probe::judge(&answer, top.devno, &top.source, source_devno),
        devno: Some(top.devno),
        source: Some(top.source.clone()),
        read_only: top.read_only(),
    }
}

/// A block volume's device file is healthy while the loop device it names is still bound.
async fn device_file_state(path: &Path) -> Mounted {
    let meta = tokio::fs::symlink_metadata(path).await.ok();
    let devno = meta
        .filter(|m| m.file_type().is_block_device())
        .map(|m| mountinfo::split_dev(m.rdev()));
    let health = match devno {
        Some((maj, min)) => {
            let sysfs = format!("/sys/dev/block/{maj}:{min}/loop/backing_file");
            if tokio::fs::metadata(sysfs).await.is_ok() {
                Health::Healthy
            } else {
                Health::Broken(format!("loop device {maj}:{min} is no longer bound"))
            }
        }
        None => Health::Unknown("no device node".into()),
    };
    Mounted {
        mounted: devno.is_some(),
        health,
        devno,
        source: None,
        read_only: false,
    }
}

/// Names in `dir`; a directory that does not exist is empty, any other error is an error (a
/// directory that cannot be read must not look like one without volumes).
async fn list(dir: &Path) -> Result<Vec<String>, ObserveError> {
    let err = |error| ObserveError::VolumeDirs {
        path: dir.display().to_string(),
        error,
    };
    let mut rd = match tokio::fs::read_dir(dir).await {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(err(e)),
    };
    let mut out = vec![];
    while let Some(e) = rd.next_entry().await.map_err(err)? {
        if let Some(n) = e.file_name().to_str() {
            out.push(n.to_string());
        }
    }
    Ok(out)
}

/// Directories and files the agent made that may outlive their mounts (a crash between mount
/// and bookkeeping, a failed teardown): found here, they are cleaned up or reused.
async fn scan_dirs(layout: &crate::paths::Layout) -> Result<Vec<Place>, ObserveError> {
    let mut out = vec![];
    for pv in list(&layout.global_dir()).await? {
        out.push(Place::Global { pv });
    }
    for uid in list(&layout.pods_dir()).await? {
        let pod = layout.pods_dir().join(&uid);
        for pv in list(&pod.join("volumes").join(crate::paths::CSI_PLUGIN_DIR)).await? {
            out.push(Place::PodMount { uid: uid.clone(), pv });
        }
        for pv in list(&pod.join("volumeDevices").join(crate::paths::CSI_PLUGIN_DIR)).await? {
            out.push(Place::PodDevice { uid: uid.clone(), pv });
        }
    }
    Ok(out)
}

/// Events for pods whose volumes cannot be mounted yet, each repeated with growing gaps.
async fn note_errors(
    ctx: &Ctx,
    d: &Desired,
    noted: &mut HashMap<(String, String, &'static str), Noted>,
    now: Instant,
) {
    let mut seen = BTreeSet::new();
    for e in &d.errors {
        let key = (e.pod.uid.clone(), e.volume.clone(), e.reason);
        seen.insert(key.clone());
        if !note_due(noted, key, &e.message, now) {
            continue;
        }
        let note = format!("Unable to mount volume \"{}\": {}", e.volume, e.message);
        tracing::info!(pod = %e.pod.name, ns = %e.pod.namespace, reason = e.reason, "{note}");
        ctx.events.warning(&e.pod.reference(), e.reason, "Mount", note);
    }
    noted.retain(|k, _| seen.contains(k) || UNSURE_REASONS.contains(&k.2));
}

/// Event reasons of `note_unsure`.
const UNSURE_REASONS: [&str; 2] = ["VolumeMountUnresponsive", "VolumeMountCheckFailed"];

/// Events for running pods whose mount did not answer its probe or answered with an error that
/// does not prove it broken: the mount is left in place; the user hears why it may misbehave.
fn note_unsure(
    ctx: &Ctx,
    d: &Desired,
    a: &Actual,
    known_pods: &HashMap<String, PodInfo>,
    noted: &mut HashMap<(String, String, &'static str), Noted>,
    now: Instant,
) {
    let mut seen = BTreeSet::new();
    for (pv, av) in &a.volumes {
        for (uid, pm) in &av.pods {
            let (reason, message) = match &pm.state.health {
                Health::Pending if pm.state.mounted => (
                    UNSURE_REASONS[0],
                    format!(
                        "the mount of volume \"{pv}\" does not answer (stat has not returned within {}s); it is left in place, a running pod's volume is never unmounted for being slow",
                        probe::PROBE_WAIT.as_secs()
                    ),
                ),
                Health::Unknown(why) if pm.state.mounted => (
                    UNSURE_REASONS[1],
                    format!("the health check of volume \"{pv}\" failed ({why}); the mount is left in place"),
                ),
                _ => continue,
            };
            tracing::debug!(pv, pod_uid = %uid, "{message}");
            let (Some(pod), true) = (known_pods.get(uid), d.live_pods.contains(uid)) else {
                continue;
            };
            let key = (uid.clone(), pv.clone(), reason);
            seen.insert(key.clone());
            if note_due(noted, key, &message, now) {
                tracing::warn!(pv, pod = %pod.name, ns = %pod.namespace, "{message}");
                ctx.events.warning(&pod.reference(), reason, "Mount", message);
            }
        }
    }
    noted.retain(|k, _| seen.contains(k) || !UNSURE_REASONS.contains(&k.2));
}

/// One operation with everything it needs from the pass that started it.
struct Job {
    ctx: Arc<Ctx>,
    dv: Option<DesiredVolume>,
    actual: crate::state::ActualVolume,
    pod: Option<PodInfo>,
}

/// A failed step: its name (as upstream words it) and what went wrong.
struct StepError {
    step: &'static str,
    message: String,
}

fn step<E: std::fmt::Display>(step: &'static str) -> impl FnOnce(E) -> StepError {
    move |e| StepError {
        step,
        message: e.to_string(),
    }
}

impl Job {
    async fn run(self, op: Op) -> Done {
        let mut expanded = None;
        let result = match &op {
            Op::Mount {
                uid, mount_device, ..
            } => match self.mount(uid, *mount_device).await {
                Ok(done) => {
                    expanded = done;
                    Ok(())
                }
                Err(e) => Err(e),
            },
            Op::Teardown { uid, block, .. } => self.teardown(op.pv(), uid, *block).await,
            Op::UnmountDevice { pv } => self.unmount_device(pv).await,
            Op::Expand { .. } => match self.expand().await {
                Ok(done) => {
                    expanded = done;
                    Ok(())
                }
                Err(e) => Err(e),
            },
        };
        let ok = result.is_ok();
        if let Err(e) = &result {
            tracing::warn!(op = op.kind(), pv = op.pv(), step = e.step, error = %e.message, "operation failed");
        }
        Done { op, ok, expanded }
    }

    fn pod_event(&self, warning: bool, reason: &str, note: String) {
        let Some(pod) = &self.pod else { return };
        if warning {
            self.ctx.events.warning(&pod.reference(), reason, "Mount", note);
        } else {
            self.ctx.events.normal(&pod.reference(), reason, "Mount", note);
        }
    }

    /// Mounts; returns the claim whose expansion it finished on the way, if any.
    async fn mount(&self, uid: &str, mount_device: bool) -> Result<Option<(String, String)>, StepError> {
        let Some(dv) = &self.dv else { return Ok(None) };
        let Some(usage) = dv.pods.get(uid) else {
            return Ok(None);
        };
        let result = self.mount_inner(dv, uid, mount_device).await;
        match &result {
            Ok(_) => {
                let gid = dv
                    .gid
                    .map(|g| format!(" (supplemental group {g} from pv.beta.kubernetes.io/gid)"))
                    .unwrap_or_default();
                let note = format!("MountVolume.SetUp succeeded for volume \"{}\"{gid}", dv.pv);
                tracing::info!(pod = %usage.pod.name, pv = %dv.pv, "volume mounted");
                if let Some(created) = usage.pod.created {
                    let secs = Timestamp::now().duration_since(created).as_secs_f64().max(0.0);
                    self.ctx.metrics.pod_volume_ready.observe(secs);
                }
                self.pod_event(false, "SuccessfulMountVolume", note);
            }
            Err(e) => {
                let note = format!(
                    "MountVolume.{} failed for volume \"{}\": {}",
                    e.step, dv.pv, e.message
                );
                self.pod_event(true, "FailedMount", note);
            }
        }
        let grew = result?;
        if !grew {
            return Ok(None);
        }
        // Grown offline before the mount: finish the claim as an online expansion would.
        let size = dv.resize_to.clone().unwrap_or_default();
        let r = finish_claim_resize(&self.ctx, &dv.claim.namespace, &dv.claim.name, &size).await;
        let r = r.map_err(|e| StepError {
            step: "NodeExpandVolume",
            message: e.to_string(),
        });
        self.resize_events(dv, r.as_ref().err());
        Ok(Some((dv.claim.uid.clone(), r?)))
    }

    /// Returns whether the file system was grown before it was mounted.
    async fn mount_inner(
        &self,
        dv: &DesiredVolume,
        uid: &str,
        mount_device: bool,
    ) -> Result<bool, StepError> {
        let ctx = &self.ctx;
        let usage = &dv.pods[uid];
        let Attachment::Attached { device } = &dv.attachment else {
            return Err(StepError {
                step: "WaitForAttach",
                message: "volume is not attached".into(),
            });
        };
        let image = ctx.images.path(&dv.handle).ok().ok_or_else(|| StepError {
            step: "WaitForAttach",
            message: format!("volume handle {:?} is not a plain file name", dv.handle),
        })?;
        // The device named by the attachment must still be this volume's: a stale path could
        // point at a freed (or reused) loop device.
        if !sys::backs(device, &image).await {
            return Err(StepError {
                step: "WaitForAttach",
                message: format!(
                    "device {device} is not backed by {} any more; waiting for the attachment to be renewed",
                    image.display()
                ),
            });
        }
        let devno = sys::rdev(Path::new(device)).await.ok_or_else(|| StepError {
            step: "WaitForAttach",
            message: format!("{device} is not a block device"),
        })?;
        // A volume no node may write to (csi.readOnly, or ReadOnlyMany only), or a device the
        // kernel holds read-only, is mounted read-only everywhere and never formatted.
        let device_ro = sys::device_read_only(devno).await;
        let read_only = dv.pv_read_only || device_ro == Some(true);
        let may_format = !read_only && device_ro == Some(false);
        let layout = &ctx.layout;
        if dv.block {
            let started = std::time::Instant::now();
            let r = self
                .publish_block(&layout.pod_device(uid, &dv.pv), devno, usage.fs_group)
                .await;
            ctx.metrics.record("setup", started, r.is_ok());
            return r.map(|()| false);
        }
        let global = layout.global_mount(&dv.pv);
        let mut grew = false;
        if mount_device {
            let started = std::time::Instant::now();
            let grow = dv.resize_to.is_some() && !read_only;
            let lazy = self.actual.device.as_ref().is_some_and(Mounted::broken);
            let r = mount_global(
                device,
                devno,
                &global,
                MountMode {
                    read_only,
                    may_format,
                    grow,
                    lazy,
                },
            )
            .await;
            ctx.metrics.record("mount_device", started, r.is_ok());
            grew = r?;
        }
        let started = std::time::Instant::now();
        let r = self
            .setup(
                &global,
                &layout.pod_mount(uid, &dv.pv),
                devno,
                usage.read_only || read_only,
                usage,
            )
            .await;
        ctx.metrics.record("setup", started, r.is_ok());
        r.map(|()| grew)
    }

    async fn publish_block(&self, path: &Path, devno: DevNo, fs_group: Option<u32>) -> Result<(), StepError> {
        let parent = path.parent().unwrap_or(path);
        tokio::fs::create_dir_all(parent)
            .await
            .map_err(step("MapVolume.SetUpDevice"))?;
        let current = tokio::fs::symlink_metadata(path)
            .await
            .ok()
            .filter(|m| m.file_type().is_block_device())
            .map(|m| mountinfo::split_dev(m.rdev()));
        if current != Some(devno) {
            sys::mknod_block(path, devno)
                .await
                .map_err(step("MapVolume.MapPodDevice"))?;
        }
        if let Some(gid) = fs_group {
            std::os::unix::fs::lchown(path, None, Some(gid)).map_err(step("MapVolume.MapPodDevice"))?;
        }
        Ok(())
    }

    async fn setup(
        &self,
        global: &Path,
        target: &Path,
        devno: DevNo,
        read_only: bool,
        usage: &crate::state::PodUse,
    ) -> Result<(), StepError> {
        let s = "SetUp";
        tokio::fs::create_dir_all(target).await.map_err(step(s))?;
        let existing = sys::mounts_at(target).await.map_err(step(s))?;
        if let Some(top) = existing.last() {
            if top.devno == devno
                && sys::stat_dev(target).await == Some(devno)
                && top.read_only() == read_only
            {
                return Ok(());
            }
            // Broken, foreign or with the wrong mode: replace it (a plain unmount; a broken one
            // was torn down, lazily if need be, before this mount was started).
            sys::unmount(target, false).await.map_err(step(s))?;
        }
        // The device mount must be there and be this device; never bind an empty directory.
        if sys::stat_dev(global).await != Some(devno) {
            return Err(StepError {
                step: s,
                message: format!("device is not mounted at {}", global.display()),
            });
        }
        sys::bind_mount(global, target, read_only)
            .await
            .map_err(step(s))?;
        if let (Some(gid), false) = (usage.fs_group, read_only) {
            let started = std::time::Instant::now();
            let path = target.to_path_buf();
            let on_mismatch = usage.fs_group_on_root_mismatch;
            let r = tokio::task::spawn_blocking(move || fsgroup::apply(&path, gid, on_mismatch))
                .await
                .map_err(step(s))?;
            tracing::debug!(took = ?started.elapsed(), gid, "fsGroup applied");
            r.map_err(|e| StepError {
                step: s,
                message: format!("applying fsGroup {gid}: {e}"),
            })?;
        }
        Ok(())
    }

    async fn teardown(&self, pv: &str, uid: &str, block: bool) -> Result<(), StepError> {
        let ctx = &self.ctx;
        let started = std::time::Instant::now();
        let r = self.teardown_inner(pv, uid, block).await;
        ctx.metrics.record("teardown", started, r.is_ok());
        match &r {
            Ok(()) if still_wanted(self.dv.as_ref(), uid) => {
                // Only a broken mount is torn down under a pod that still wants it: tell the
                // user, who may have seen I/O errors, that it is being mounted again.
                let why = match self.actual.pods.get(uid).map(|p| &p.state.health) {
                    Some(Health::Broken(why)) => why.clone(),
                    _ => "failed its health check".into(),
                };
                let note =
                    format!("the mount of volume \"{pv}\" is broken ({why}); unmounted, mounting it again");
                tracing::warn!(pv, pod_uid = uid, "{note}");
                self.pod_event(true, "VolumeMountBroken", note);
            }
            Ok(()) => tracing::info!(pv, pod_uid = uid, "pod volume unmounted"),
            Err(e) => {
                let note = format!(
                    "UnmountVolume.{} failed for volume \"{pv}\" (pod {uid}): {}",
                    e.step, e.message
                );
                self.pod_event(true, "FailedUnmount", note);
            }
        }
        r
    }

    async fn teardown_inner(&self, pv: &str, uid: &str, block: bool) -> Result<(), StepError> {
        let layout = &self.ctx.layout;
        let pod_dir = layout.pods_dir().join(uid);
        let mut dirs = vec![];
        if block {
            let s = "UnmapDevice";
            let path = layout.pod_device(uid, pv);
            // Only remove what we made: a device node or nothing.
            if let Ok(m) = tokio::fs::symlink_metadata(&path).await {
                if m.is_dir() {
                    sys::remove_dir_if_empty(&path).await.map_err(step(s))?;
                } else {
                    tokio::fs::remove_file(&path).await.map_err(step(s))?;
                }
            }
            dirs.push(path.parent().map(Path::to_path_buf).unwrap_or_default());
            dirs.push(pod_dir.join("volumeDevices"));
        } else {
            let s = "TearDown";
            let target = layout.pod_mount(uid, pv);
            // Lazily only when judged broken: a healthy or slow mount that refuses (busy) is
            // reported and retried, never detached from under its users.
            let lazy = self.actual.pods.get(uid).is_some_and(|p| p.state.broken());
            sys::unmount(&target, lazy).await.map_err(step(s))?;
            // Anything left in the directory was written while nothing was mounted: keep it
            // and say so rather than delete data.
            match tokio::fs::remove_dir(&target).await {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(StepError {
                        step: s,
                        message: format!("cannot remove {}: {e}", target.display()),
                    });
                }
            }
            let vol_dir = layout.pod_volume_dir(uid, pv);
            dirs.push(vol_dir.clone());
            dirs.push(vol_dir.parent().map(Path::to_path_buf).unwrap_or_default());
            dirs.push(pod_dir.join("volumes"));
        }
        dirs.push(pod_dir);
        for d in dirs {
            sys::remove_dir_if_empty(&d).await.map_err(step("TearDown"))?;
        }
        Ok(())
    }

    async fn unmount_device(&self, pv: &str) -> Result<(), StepError> {
        let started = std::time::Instant::now();
        let r = self.unmount_device_inner(pv).await;
        self.ctx.metrics.record("unmount_device", started, r.is_ok());
        if r.is_ok() {
            tracing::info!(pv, "device unmounted");
        }
        r
    }

    async fn unmount_device_inner(&self, pv: &str) -> Result<(), StepError> {
        let s = "UnmountDevice";
        let global = self.ctx.layout.global_mount(pv);
        let table = mountinfo::read().await.map_err(step(s))?;
        if let Some(top) = table.iter().rev().find(|m| m.mount_point == global) {
            // Refuse while the file system is still mounted elsewhere (a bind mount we do not
            // know about would lose its device under it).
            let others: Vec<_> = table
                .iter()
                .filter(|m| m.devno == top.devno && m.mount_point != global && m.fstype == top.fstype)
                .map(|m| m.mount_point.display().to_string())
                .collect();
            if !others.is_empty() {
                return Err(StepError {
                    step: s,
                    message: format!("device {} is still mounted at {}", top.source, others.join(", ")),
                });
            }
        }
        let lazy = self.actual.device.as_ref().is_some_and(Mounted::broken);
        sys::unmount(&global, lazy).await.map_err(step(s))?;
        match tokio::fs::remove_dir(&global).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StepError {
                step: s,
                message: format!("cannot remove {}: {e}", global.display()),
            }),
        }
    }

    /// Online expansion; returns the claim (uid, resourceVersion) it finished.
    async fn expand(&self) -> Result<Option<(String, String)>, StepError> {
        let Some(dv) = &self.dv else { return Ok(None) };
        let started = std::time::Instant::now();
        let r = self.expand_inner(dv).await;
        self.ctx.metrics.record("expand_fs", started, r.is_ok());
        self.resize_events(dv, r.as_ref().err());
        r
    }

    /// FileSystemResizeSuccessful / FileSystemResizeFailed on the claim and its pods here.
    fn resize_events(&self, dv: &DesiredVolume, err: Option<&StepError>) {
        let pv = &dv.pv;
        let claim_ref = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("PersistentVolumeClaim".into()),
            namespace: Some(dv.claim.namespace.clone()),
            name: Some(dv.claim.name.clone()),
            uid: Some(dv.claim.uid.clone()),
            ..Default::default()
        };
        let (warning, reason, note) = match err {
            None => (
                false,
                "FileSystemResizeSuccessful",
                format!("MountVolume.NodeExpandVolume succeeded for volume \"{pv}\""),
            ),
            Some(e) => (
                true,
                "FileSystemResizeFailed",
                format!(
                    "MountVolume.NodeExpandVolume failed for volume \"{pv}\": {}",
                    e.message
                ),
            ),
        };
        let ev = &self.ctx.events;
        for obj in std::iter::once(claim_ref).chain(dv.pods.values().map(|u| u.pod.reference())) {
            if warning {
                ev.warning(&obj, reason, "Resize", note.clone());
            } else {
                ev.normal(&obj, reason, "Resize", note.clone());
            }
        }
    }

    async fn expand_inner(&self, dv: &DesiredVolume) -> Result<Option<(String, String)>, StepError> {
        let s = "NodeExpandVolume";
        let Some(new_size) = &dv.resize_to else {
            return Ok(None);
        };
        let Attachment::Attached { device } = &dv.attachment else {
            return Err(StepError {
                step: s,
                message: "volume is not attached".into(),
            });
        };
        if !dv.block {
            let dev = self.actual.device.as_ref();
            if dev.is_some_and(|d| d.read_only) {
                return Err(StepError {
                    step: s,
                    message: "the volume is mounted read-only, its file system cannot be grown".into(),
                });
            }
        }
        sys::loop_refresh(device).await.map_err(step(s))?;
        if !dv.block
            && let Err(e) = sys::resize2fs(device).await
        {
            let mut message = e.to_string();
            if message.contains("Permission denied") {
                // Online ext4 growth needs CAP_SYS_RESOURCE; without it the offline path on the
                // next device mount still works.
                message.push_str(
                    "; online resize is not permitted here (CAP_SYS_RESOURCE missing), \
                     the file system grows when the volume is next mounted on a node",
                );
            }
            return Err(StepError { step: s, message });
        }
        let rv = finish_claim_resize(&self.ctx, &dv.claim.namespace, &dv.claim.name, new_size)
            .await
            .map_err(step(s))?;
        tracing::info!(pv = %dv.pv, size = %new_size, "file system expanded");
        Ok(Some((dv.claim.uid.clone(), rv)))
    }
}

/// Does a live pod still want this volume (so a teardown of it is a repair, not a goodbye)?
fn still_wanted(dv: Option<&DesiredVolume>, uid: &str) -> bool {
    dv.is_some_and(|dv| dv.pods.contains_key(uid))
}

/// How `mount_global` may treat the device.
struct MountMode {
    /// Mount read-only.
    read_only: bool,
    /// A blank device may be formatted: the volume and the device are writable.
    may_format: bool,
    /// Grow an existing ext file system to the device's size first (offline expansion).
    grow: bool,
    /// A mount already there was judged broken: it may be detached lazily.
    lazy: bool,
}

/// Mounts the device at the global path, formatting it first only when it holds nothing at all
/// and may be written. With `grow`, an existing ext file system is grown to the device's size
/// before the mount (the offline path, for volumes whose online expansion could not run).
/// Returns whether it grew.
async fn mount_global(device: &str, devno: DevNo, global: &Path, mode: MountMode) -> Result<bool, StepError> {
    let s = "MountDevice";
    let read_only = mode.read_only;
    tokio::fs::create_dir_all(global).await.map_err(step(s))?;
    let existing = sys::mounts_at(global).await.map_err(step(s))?;
    if let Some(top) = existing.last() {
        if top.devno == devno && sys::stat_dev(global).await == Some(devno) && (top.read_only() || !read_only)
        {
            return Ok(false);
        }
        // A stale or foreign mount (or a writable one of a read-only volume) sits there; clear
        // it first.
        sys::unmount(global, mode.lazy).await.map_err(step(s))?;
    }
    match sys::probe(device).await.map_err(step(s))? {
        sys::Probe::Blank if !mode.may_format => {
            return Err(StepError {
                step: s,
                message: format!(
                    "{device} holds no file system and the volume is read-only (csi.readOnly, ReadOnlyMany access or a read-only device); \
                     it is never formatted here: write a file system to the image first"
                ),
            });
        }
        sys::Probe::Blank => {
            tracing::info!(device, "no file system found, formatting ext4");
            sys::mkfs_ext4(device).await.map_err(step(s))?;
        }
        sys::Probe::Found(kind) => {
            tracing::debug!(device, kind, "file system found, not formatting");
            if mode.grow && kind.starts_with("ext") {
                let s = "NodeExpandVolume";
                sys::loop_refresh(device).await.map_err(step(s))?;
                sys::fsck_ext(device).await.map_err(step(s))?;
                sys::resize2fs(device).await.map_err(step(s))?;
                tracing::info!(device, "file system grown before mounting");
                sys::mount_device(device, global, read_only)
                    .await
                    .map_err(step("MountDevice"))?;
                return Ok(true);
            }
        }
    }
    sys::mount_device(device, global, read_only)
        .await
        .map_err(step(s))?;
    Ok(false)
}

/// Finishes a node-side expansion in the claim's status the way the kubelet does: capacity is
/// the new size, the resize status entry and the resize conditions go. Returns the new
/// resourceVersion. Guarded by the resourceVersion read, so a concurrent change wins.
pub async fn finish_claim_resize(ctx: &Ctx, ns: &str, name: &str, size: &str) -> anyhow::Result<String> {
    let api: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), ns);
    let pvc = api.get_status(name).await?;
    let patch = resize_finished_patch(&pvc, size);
    let out = api
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(out.metadata.resource_version.unwrap_or_default())
}

/// The merge patch of `finish_claim_resize` (pure, for tests).
pub fn resize_finished_patch(pvc: &PersistentVolumeClaim, size: &str) -> serde_json::Value {
    const DONE: [&str; 3] = ["FileSystemResizePending", "Resizing", "NodeResizeError"];
    let conditions: Vec<_> = pvc
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default()
        .into_iter()
        .filter(|c| !DONE.contains(&c.type_.as_str()))
        .collect();
    serde_json::json!({
        "metadata": { "resourceVersion": pvc.metadata.resource_version },
        "status": {
            "capacity": { "storage": size },
            "allocatedResourceStatuses": { "storage": null },
            "conditions": conditions,
        }
    })
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{PersistentVolumeClaimCondition, PersistentVolumeClaimStatus};
    use kube::api::ObjectMeta;

    use super::*;

    #[tokio::test]
    async fn an_unreadable_directory_is_an_error_not_an_empty_one() {
        let dir = std::env::temp_dir().join(format!("stowage-list-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("v1")).unwrap();
        assert_eq!(list(&dir).await.unwrap(), vec!["v1".to_string()]);
        assert!(
            list(&dir.join("missing")).await.unwrap().is_empty(),
            "absent is empty"
        );
        // Not a directory (as any other read error): the pass must not go on without it.
        std::fs::write(dir.join("file"), b"").unwrap();
        let e = list(&dir.join("file")).await.unwrap_err();
        assert_eq!(e.reason(), "VolumeDirUnreadable");
        assert_eq!(e.source_label(), "volume_dirs");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn resize_patch_clears_only_resize_state() {
        let pvc = PersistentVolumeClaim {
            metadata: ObjectMeta {
                resource_version: Some("42".into()),
                ..Default::default()
            },
            spec: None,
            status: Some(PersistentVolumeClaimStatus {
                conditions: Some(vec![
                    PersistentVolumeClaimCondition {
                        type_: "FileSystemResizePending".into(),
                        status: "True".into(),
                        ..Default::default()
                    },
                    PersistentVolumeClaimCondition {
                        type_: "Other".into(),
                        status: "True".into(),
                        ..Default::default()
                    },
                ]),
                ..Default::default()
            }),
        };
        let p = resize_finished_patch(&pvc, "2Gi");
        assert_eq!(p["metadata"]["resourceVersion"], "42");
        assert_eq!(p["status"]["capacity"]["storage"], "2Gi");
        assert!(p["status"]["allocatedResourceStatuses"]["storage"].is_null());
        let conds = p["status"]["conditions"].as_array().unwrap();
        assert_eq!(conds.len(), 1);
        assert_eq!(conds[0]["type"], "Other");
    }
}

//! Workload `takeover`: what operators wait for when a leader dies. Two replicas of one
//! implementation (binder and attach/detach, leader election on, the same lease settings on both
//! sides, client limits lifted) over N bound pairs and M pods with attachments on K nodes.
//!
//! One run, on objects set up once per size and shared by every run of that size:
//! 1. **Cold start.** New work (claims against Available volumes, pods needing attachment) and
//!    the markers (below) are in place; replica A starts on a free lease. Process start → the
//!    first new bind, the first new VolumeAttachment, all of it, the last marker fixed.
//! 2. **Standby.** Replica B starts and settles (its CPU idle); its CPU over 10 s and its RSS,
//!    beside the leader's RSS.
//! 3. **Loss.** A gets SIGKILL (or SIGTERM: each side's graceful exit, releasing the lease if it
//!    does); new work arrives at once. After a SIGKILL the markers are planted again while no
//!    one leads. Lease acquired by B (its `acquireTime`) → the first new bind, the first new
//!    attachment, all of it, the last marker fixed; B's peak RSS after.
//! 4. **The apiserver's audit log** (each replica is its own admin user) says how many writes A
//!    made after B acquired the lease (must be 0), and whether B wrote anything but the Lease
//!    before it led (must not).
//!
//! Markers: one old claim in 100 loses its `pv.kubernetes.io/bind-completed` annotation. Both
//! binders restore it (one claim update) when they sync that claim, which the informer's first
//! pass over every claim does; the last one restored is the end of the first full pass, seen
//! from outside, the same way for both sides (neither exports it the same way).

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::{VolumeAttachment, VolumeAttachmentSource, VolumeAttachmentSpec};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, ObjectMeta, Patch, PatchParams};
use kube::runtime::watcher;
use serde::Serialize;
use serde_json::json;
use stowage_attachdetach::read::{attachment_name, unique_volume_name};
use stowage_testkit::ControlPlane;
use stowage_testkit::builders;
use stowage_testkit::controlplane::replica_user;
use stowage_testkit::process::{signal, spawn_tied, stop};
use tokio::task::JoinHandle;

use crate::controller::{Impl, Setup};
use crate::fixtures::{Objects, Pair, RUN_LABEL, attach_driver, claim_name, label, pod, pod_name, pv_name};
use crate::procstat;
use crate::tracker::follow;
use crate::workload::each;

/// The lease settings of both sides: client-go's and kube-controller-manager's defaults.
const LEASE: [(&str, &str); 3] = [
    ("--leader-elect-lease-duration", "15s"),
    ("--leader-elect-renew-deadline", "10s"),
    ("--leader-elect-retry-period", "2s"),
];
const LIFTED: [&str; 2] = ["--kube-api-qps=100000", "--kube-api-burst=100000"];
const BIND_COMPLETED: &str = "pv.kubernetes.io/bind-completed";
/// One old claim in this many is a marker.
const MARKER_EVERY: usize = 100;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizes {
    pub pairs: usize,
    pub pods: usize,
    pub nodes: usize,
    /// New claims of each phase (the new pods are one per node).
    pub new_claims: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Stop {
    /// SIGKILL: the lease is left to expire.
    Kill,
    /// SIGTERM: the process's own graceful exit.
    Term,
}

impl Stop {
    fn name(self) -> &'static str {
        match self {
            Stop::Kill => "SIGKILL",
            Stop::Term => "SIGTERM",
        }
    }
}

pub fn name(s: &Sizes) -> String {
    format!("takeover-{}", s.pairs)
}

pub fn describe(s: &Sizes) -> String {
    format!(
        "{} bound PV/PVC pairs, {} of them used by pods with attachments over {} Ready nodes; two \
         replicas (binder and attach/detach, leader election on, lease 15 s / renew 10 s / retry 2 s, \
         client limits lifted). Cold start: replica A starts with {} new claims and {} new pods \
         waiting and {} markers (old claims without `bind-completed`). Then replica B stands by; A \
         is stopped (SIGKILL, or SIGTERM) and as many new claims and pods arrive at once (after a \
         SIGKILL the markers are planted again while no one leads). Intervals from B's lease \
         `acquireTime`; full pass = the last marker restored; writes per replica from the \
         apiserver's audit log.",
        s.pairs,
        s.pods,
        s.nodes,
        s.new_claims,
        s.nodes,
        s.pairs / MARKER_EVERY
    )
}

/// Process start (cold) or lease acquired (takeover) to each milestone, in ms.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Intervals {
    pub first_bind_ms: Option<f64>,
    pub first_attach_ms: Option<f64>,
    pub all_new_ms: Option<f64>,
    /// The last marker restored (None where none were planted).
    pub full_pass_ms: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TakeoverResult {
    pub workload: String,
    pub implementation: String,
    pub stop: Stop,
    pub sizes: (usize, usize, usize),
    pub markers: usize,
    /// Replica A from process start.
    pub cold: Intervals,
    pub cold_peak_rss_mib: f64,
    pub cold_cpu_s: f64,
    pub loss_to_acquired_s: Option<f64>,
    /// Replica B from its lease's acquireTime.
    pub takeover: Intervals,
    /// Whether the markers were planted before B acquired (else no full-pass figure).
    pub markers_planted: bool,
    pub standby_cpu_cores: f64,
    pub standby_rss_mib: f64,
    pub leader_rss_mib: f64,
    /// B's peak RSS at the end of the run (after its takeover).
    pub peak_rss_after_mib: f64,
    /// B's CPU from the loss to the end of the run.
    pub cpu_after_s: f64,
    /// A's writes the apiserver received after B's acquireTime.
    pub old_leader_writes_after: Option<usize>,
    /// B's writes other than its Lease from its start to its acquireTime.
    pub standby_writes_before: Option<usize>,
    pub new_done: usize,
    pub new_total: usize,
    pub note: Option<String>,
    pub logs: Vec<String>,
}

/// A marker's life: stripped by the bench, seen stripped, seen restored.
#[derive(Debug, Clone, Copy)]
enum Mark {
    Planted,
    Stripped,
    Fixed(Instant),
}

#[derive(Default)]
struct Seen {
    /// Claims first seen `Bound`.
    bound: HashMap<String, Instant>,
    /// PVs whose VolumeAttachment was first seen.
    attached: HashMap<String, Instant>,
    marks: HashMap<String, Mark>,
    /// Per lease: (holder, its acquireTime, when the bench saw it) on every change of holder.
    holders: HashMap<String, Vec<(String, Option<Timestamp>, Instant)>>,
}

type Shared = Arc<Mutex<Seen>>;

fn lock(s: &Shared) -> std::sync::MutexGuard<'_, Seen> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

/// The earliest and latest first sightings among `keys` in `map`, and how many were seen.
fn span(map: &HashMap<String, Instant>, keys: &[String]) -> (Option<Instant>, Option<Instant>, usize) {
    let times: Vec<Instant> = keys.iter().filter_map(|k| map.get(k).copied()).collect();
    (
        times.iter().min().copied(),
        times.iter().max().copied(),
        times.len(),
    )
}

/// Milliseconds from `t0` to `t` (negative when `t` came first).
fn ms(t0: Instant, t: Option<Instant>) -> Option<f64> {
    t.map(|t| match t.checked_duration_since(t0) {
        Some(d) => d.as_secs_f64() * 1000.0,
        None => -(t0.duration_since(t).as_secs_f64() * 1000.0),
    })
}

/// One replica: a controller process with leader election on, as admin user `replica-<i>`.
struct Replica {
    child: Child,
    pid: u32,
    log: PathBuf,
    started: Instant,
    user: String,
}

impl Replica {
    fn start(
        cp: &ControlPlane,
        setup: &Setup,
        which: Impl,
        user: usize,
        ns: &str,
        lease: &str,
        tag: &str,
    ) -> anyhow::Result<Self> {
        let log = setup.log_dir.join(format!("{tag}.log"));
        let out = std::fs::File::create(&log).with_context(|| format!("create {}", log.display()))?;
        let kubeconfig = format!("--kubeconfig={}", cp.replica_kubeconfig(user)?.display());
        let election = [
            "--leader-elect=true".to_string(),
            format!("--leader-elect-resource-namespace={ns}"),
            format!("--leader-elect-resource-name={lease}"),
        ];
        let mut cmd = match which {
            Impl::Upstream => {
                let mut c = Command::new(&setup.kcm_bin);
                c.args([
                    kubeconfig.as_str(),
                    "--use-service-account-credentials=false",
                    "--secure-port=0",
                    "--controllers=persistentvolume-binder-controller,persistentvolume-attach-detach-controller",
                ])
                .args(&setup.upstream_args);
                c
            }
            Impl::Stowage => {
                let mut c = Command::new(&setup.stowage_bin);
                c.args([kubeconfig.as_str(), "--controllers=binder,attachdetach"])
                    .arg(format!("--leader-elect-identity={tag}"))
                    .arg(format!("--image-dir={}", setup.image_dir.display()))
                    .arg(format!(
                        "--metrics-bind-address=127.0.0.1:{}",
                        stowage_testkit::process::free_port()
                    ))
                    .args(&setup.stowage_args);
                c.env_remove("RUST_LOG");
                c
            }
            Impl::Floor { .. } => bail!("the floor writer has no leader election"),
        };
        cmd.args(election)
            .args(LEASE.map(|(k, v)| format!("{k}={v}")))
            .args(LIFTED);
        cmd.stdin(Stdio::null()).stdout(out.try_clone()?).stderr(out);
        let started = Instant::now();
        let child = spawn_tied(cmd).with_context(|| format!("start {tag}"))?;
        Ok(Self {
            pid: child.id(),
            child,
            log,
            started,
            user: replica_user(user),
        })
    }

    fn cpu(&self) -> f64 {
        procstat::cpu_seconds(self.pid).unwrap_or(0.0)
    }

    fn mib(bytes: Option<u64>) -> f64 {
        bytes.unwrap_or(0) as f64 / 1048576.0
    }

    fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        tokio::task::block_in_place(|| stop(&mut self.child, Duration::from_secs(20)));
    }
}

/// The bench's watches: claims, attachments (which it also marks attached, as an external
/// attacher would), and leases.
async fn watches(o: &Objects, ns: &str, run: &str, seen: &Shared) -> anyhow::Result<Vec<JoinHandle<()>>> {
    let c = o.client.clone();
    let s = seen.clone();
    let claims = follow(
        Api::<PersistentVolumeClaim>::namespaced(c.clone(), ns),
        watcher::Config::default().labels(&format!("{RUN_LABEL}={run}")),
        move |claim| {
            let now = Instant::now();
            let name = claim.name_any();
            let mut g = lock(&s);
            if claim.status.as_ref().and_then(|st| st.phase.as_deref()) == Some("Bound") {
                g.bound.entry(name.clone()).or_insert(now);
            }
            let annotated = claim.annotations().contains_key(BIND_COMPLETED);
            if let Some(m) = g.marks.get_mut(&name) {
                *m = match (*m, annotated) {
                    (Mark::Planted, false) => Mark::Stripped,
                    (Mark::Stripped, true) => Mark::Fixed(now),
                    (m, _) => m,
                };
            }
        },
    )
    .await?;
    let (to_attach, mut attach_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let driver = attach_driver(run);
    let s = seen.clone();
    let mut sent = HashSet::new();
    let vas = follow(
        Api::<VolumeAttachment>::all(c.clone()),
        watcher::Config::default(),
        move |va| {
            if va.spec.attacher != driver {
                return;
            }
            if let Some(pv) = va.spec.source.persistent_volume_name.clone() {
                lock(&s).attached.entry(pv).or_insert_with(Instant::now);
            }
            let attached = va.status.as_ref().is_some_and(|st| st.attached);
            if !attached && sent.insert(va.name_any()) {
                let _ = to_attach.send(va.name_any());
            }
        },
    )
    .await?;
    let api: Api<VolumeAttachment> = Api::all(c.clone());
    let attacher = tokio::spawn(async move {
        let status = json!({"status": {"attached": true}});
        while let Some(name) = attach_rx.recv().await {
            // Errors (gone, a conflict) only leave the attachment pending, as a slow attacher would.
            let _ = api
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
                .await;
        }
    });
    let s = seen.clone();
    let leases = follow(
        Api::<Lease>::namespaced(c, ns),
        watcher::Config::default(),
        move |l| {
            let now = Instant::now();
            let spec = l.spec.clone().unwrap_or_default();
            let holder = spec.holder_identity.unwrap_or_default();
            let acquired = spec.acquire_time.map(|t| t.0);
            let mut g = lock(&s);
            let h = g.holders.entry(l.name_any()).or_default();
            if h.last().is_none_or(|(last, ..)| *last != holder) {
                h.push((holder, acquired, now));
            }
        },
    )
    .await?;
    Ok(vec![claims, vas, attacher, leases])
}

/// Runs the takeover workload of one size for each implementation and way of stopping.
pub async fn run(
    cp: &ControlPlane,
    o: &Objects,
    setup: &Setup,
    sizes: Sizes,
    impls: &[Impl],
    stops: &[Stop],
) -> anyhow::Result<Vec<TakeoverResult>> {
    let run = format!("t{:06x}", rand::random::<u32>() & 0xff_ffff);
    let seen: Shared = Arc::default();
    let result = async {
        eprintln!(
            "  {}: setting up {} pairs, {} pods",
            name(&sizes),
            sizes.pairs,
            sizes.pods
        );
        prepare(o, &run, sizes).await?;
        let tasks = watches(o, &run, &run, &seen).await?;
        let mut out = Vec::new();
        let mut k = 0;
        for &stop in stops {
            for &which in impls {
                k += 1;
                let r = once(cp, o, setup, &run, sizes, which, stop, k, &seen).await;
                match r {
                    Ok(r) => {
                        eprintln!("  {}: {}", name(&sizes), summary(&r));
                        out.push(r);
                    }
                    Err(e) => {
                        tasks.iter().for_each(JoinHandle::abort);
                        return Err(e);
                    }
                }
            }
        }
        tasks.iter().for_each(JoinHandle::abort);
        Ok(out)
    }
    .await;
    eprintln!("  {}: cleaning up", name(&sizes));
    o.cleanup(&run, &run, &format!("{run}-pv-"))
        .await
        .context("cleanup")?;
    result
}

fn summary(r: &TakeoverResult) -> String {
    let f = |v: Option<f64>| v.map_or("–".into(), |v| format!("{v:.0} ms"));
    format!(
        "{} {}: lease after {}, then first bind {}, first attach {}, all new {}, full pass {}; cold: first bind {}, full pass {}; old leader's writes after: {}{}",
        r.implementation,
        r.stop.name(),
        r.loss_to_acquired_s.map_or("–".into(), |s| format!("{s:.1} s")),
        f(r.takeover.first_bind_ms),
        f(r.takeover.first_attach_ms),
        f(r.takeover.all_new_ms),
        f(r.takeover.full_pass_ms),
        f(r.cold.first_bind_ms),
        f(r.cold.full_pass_ms),
        r.old_leader_writes_after.map_or("–".into(), |n| n.to_string()),
        r.note.as_deref().map(|n| format!(" ({n})")).unwrap_or_default(),
    )
}

/// The old objects: a class, an attachable CSI driver, Ready nodes, bound pairs, pods on them with
/// their attachments attached and listed in the nodes' `volumesAttached`, as a running cluster
/// has them.
async fn prepare(o: &Objects, run: &str, s: Sizes) -> anyhow::Result<()> {
    let c = &o.client;
    let ns = run;
    o.namespace(ns, run).await?;
    let driver = attach_driver(run);
    o.create_all(
        &Api::all(c.clone()),
        vec![label(
            builders::storage_class(run, "kubernetes.io/no-provisioner").build(),
            run,
        )],
    )
    .await?;
    o.create_all(
        &Api::all(c.clone()),
        vec![label(builders::csi_driver(&driver, true), run)],
    )
    .await?;
    let nodes: Vec<String> = (0..s.nodes).map(|j| node_name(run, j)).collect();
    o.nodes(&nodes, run).await?;
    let pairs = (0..s.pairs)
        .map(|i| Pair {
            pv: pv_name(run, i),
            claim: claim_name(i),
        })
        .collect();
    o.bound_pairs(ns, run, pairs, run, &driver, "1Gi").await?;
    let pods = (0..s.pods)
        .map(|i| pod(ns, &pod_name(i), &claim_name(i), &nodes[i % s.nodes], run))
        .collect();
    o.create_all(&Api::<Pod>::namespaced(c.clone(), ns), pods).await?;
    let vas: Api<VolumeAttachment> = Api::all(c.clone());
    let attached: Vec<(String, String)> = (0..s.pods)
        .map(|i| (pv_name(run, i), nodes[i % s.nodes].clone()))
        .collect();
    o.create_all(
        &vas,
        attached
            .iter()
            .map(|(pv, node)| attachment(&driver, pv, node))
            .collect(),
    )
    .await?;
    let status = json!({"status": {"attached": true}});
    each(o.concurrency, attached.iter().collect(), |(pv, node)| {
        let (vas, status) = (&vas, &status);
        let name = attachment_name(pv, &driver, node);
        async move {
            vas.patch_status(&name, &PatchParams::default(), &Patch::Merge(status))
                .await
                .map(|_| ())
                .with_context(|| format!("mark {name} attached"))
        }
    })
    .await?;
    let node_api: Api<Node> = Api::all(c.clone());
    for (j, node) in nodes.iter().enumerate() {
        let listed: Vec<serde_json::Value> = (j..s.pods)
            .step_by(s.nodes)
            .map(|i| json!({"name": unique_volume_name(&driver, &pv_name(run, i)), "devicePath": ""}))
            .collect();
        node_api
            .patch_status(
                node,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"volumesAttached": listed}})),
            )
            .await
            .with_context(|| format!("node {node} volumesAttached"))?;
    }
    Ok(())
}

fn node_name(run: &str, j: usize) -> String {
    format!("{run}-node-{j:03}")
}

/// The attachment upstream's CSI attacher would have made for `pv` on `node`.
fn attachment(driver: &str, pv: &str, node: &str) -> VolumeAttachment {
    VolumeAttachment {
        metadata: ObjectMeta {
            name: Some(attachment_name(pv, driver, node)),
            ..Default::default()
        },
        spec: VolumeAttachmentSpec {
            attacher: driver.into(),
            node_name: node.into(),
            source: VolumeAttachmentSource {
                persistent_volume_name: Some(pv.into()),
                ..Default::default()
            },
        },
        status: None,
    }
}

/// New work of one phase: claims waiting for Available volumes, pods (one per node) whose bound
/// claims need attaching. `ready` creates what must exist before it arrives; `arrive` sends it.
struct Work {
    claims: Vec<PersistentVolumeClaim>,
    pods: Vec<Pod>,
    /// What the watches key them by: the claims, and the pods' volumes.
    claim_keys: Vec<String>,
    pod_keys: Vec<String>,
}

impl Work {
    async fn ready(o: &Objects, run: &str, phase: &str, s: Sizes) -> anyhow::Result<Self> {
        let ns = run;
        let driver = attach_driver(run);
        let claim = |i: usize| format!("new-{phase}-{i:03}");
        let vol = |i: usize| format!("{run}-pv-new-{phase}-{i:03}");
        let pvs = (0..s.new_claims)
            .map(|i| {
                label(
                    builders::pv(&vol(i))
                        .capacity("1Gi")
                        .class(run)
                        .driver(&driver, &vol(i))
                        .build(),
                    run,
                )
            })
            .collect();
        o.available_pvs(pvs).await?;
        let pod_claim = |j: usize| format!("np-{phase}-{j:03}");
        let pod_vol = |j: usize| format!("{run}-pv-np-{phase}-{j:03}");
        let pairs = (0..s.nodes)
            .map(|j| Pair {
                pv: pod_vol(j),
                claim: pod_claim(j),
            })
            .collect();
        o.bound_pairs(ns, run, pairs, run, &driver, "1Gi").await?;
        Ok(Self {
            claims: (0..s.new_claims)
                .map(|i| {
                    label(
                        builders::pvc(ns, &claim(i)).request("1Gi").class(run).build(),
                        run,
                    )
                })
                .collect(),
            pods: (0..s.nodes)
                .map(|j| pod(ns, &pod_claim(j), &pod_claim(j), &node_name(run, j), run))
                .collect(),
            claim_keys: (0..s.new_claims).map(claim).collect(),
            pod_keys: (0..s.nodes).map(pod_vol).collect(),
        })
    }

    async fn arrive(&mut self, o: &Objects, ns: &str) -> anyhow::Result<()> {
        let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(o.client.clone(), ns);
        let pods: Api<Pod> = Api::namespaced(o.client.clone(), ns);
        let (a, b) = tokio::join!(
            o.create_all(&pvcs, std::mem::take(&mut self.claims)),
            o.create_all(&pods, std::mem::take(&mut self.pods))
        );
        a.and(b)
    }

    fn total(&self) -> usize {
        self.claim_keys.len() + self.pod_keys.len()
    }

    /// (first bind, first attach, all done, done count) as sighting instants.
    fn progress(&self, seen: &Seen) -> (Option<Instant>, Option<Instant>, Option<Instant>, usize) {
        let (fb, lb, nb) = span(&seen.bound, &self.claim_keys);
        let (fa, la, na) = span(&seen.attached, &self.pod_keys);
        let all = (nb + na == self.total()).then(|| lb.max(la)).flatten();
        (fb, fa, all, nb + na)
    }
}

/// Strips the markers' annotation and waits until the watch saw every one stripped.
async fn plant(o: &Objects, ns: &str, seen: &Shared, markers: &[String]) -> anyhow::Result<()> {
    {
        let mut g = lock(seen);
        for m in markers {
            g.marks.insert(m.clone(), Mark::Planted);
        }
    }
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(o.client.clone(), ns);
    let strip = json!({"metadata": {"annotations": {BIND_COMPLETED: null}}});
    each(o.concurrency, markers.iter().collect(), |m| {
        let (pvcs, strip) = (&pvcs, &strip);
        async move {
            pvcs.patch(m, &PatchParams::default(), &Patch::Merge(strip))
                .await
                .map(|_| ())
                .with_context(|| format!("strip {m}"))
        }
    })
    .await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let planted = lock(seen)
            .marks
            .values()
            .filter(|m| matches!(m, Mark::Planted))
            .count();
        if planted == 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{planted} markers not seen stripped within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The last marker restored, once all are (None while any is not).
fn markers_fixed(seen: &Seen, markers: &[String]) -> Option<Instant> {
    let mut last = None;
    for m in markers {
        match seen.marks.get(m) {
            Some(Mark::Fixed(t)) => last = Some(last.map_or(*t, |l: Instant| l.max(*t))),
            _ => return None,
        }
    }
    last
}

/// Waits until `done` holds, printing progress every 5 s; gives up after `limit` or when a
/// replica exits. Returns why it gave up, if it did.
async fn until(
    what: &str,
    limit: Duration,
    replica: &mut Replica,
    mut done: impl FnMut() -> (bool, String),
) -> Option<String> {
    let t0 = Instant::now();
    let mut printed = Instant::now();
    loop {
        let (ok, progress) = done();
        if ok {
            return None;
        }
        if t0.elapsed() > limit {
            return Some(format!("{what}: {progress} after {limit:?}"));
        }
        if replica.exited() {
            return Some(format!(
                "{what}: the replica exited; see {}",
                replica.log.display()
            ));
        }
        if printed.elapsed() >= Duration::from_secs(5) {
            printed = Instant::now();
            eprintln!("    {what}: {progress} after {:.0} s", t0.elapsed().as_secs_f64());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the process's CPU stays below 2 % for 3 s (its start-up and lists are over).
async fn settle(r: &Replica, limit: Duration) {
    let t0 = Instant::now();
    let mut quiet = 0;
    let mut last = r.cpu();
    while quiet < 3 && t0.elapsed() < limit {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = r.cpu();
        quiet = if now - last < 0.02 { quiet + 1 } else { 0 };
        last = now;
    }
}

/// The instant on this machine's monotonic clock of a wall-clock time of this machine.
fn instant_of(t: Timestamp) -> Instant {
    let ago = Timestamp::now().duration_since(t).as_secs_f64();
    let now = Instant::now();
    if ago >= 0.0 {
        now.checked_sub(Duration::from_secs_f64(ago)).unwrap_or(now)
    } else {
        now + Duration::from_secs_f64(-ago)
    }
}

#[allow(clippy::too_many_arguments)]
async fn once(
    cp: &ControlPlane,
    o: &Objects,
    setup: &Setup,
    run: &str,
    s: Sizes,
    which: Impl,
    how: Stop,
    k: usize,
    seen: &Shared,
) -> anyhow::Result<TakeoverResult> {
    let ns = run;
    let lease = format!("{run}-lease-{k}");
    let tag = |r: &str| format!("{}-{}-{}-{r}-{run}", name(&s), which.name(), how.name());
    let markers: Vec<String> = (MARKER_EVERY / 2..s.pairs)
        .step_by(MARKER_EVERY)
        .map(claim_name)
        .collect();
    let mut notes = Vec::new();

    // 1. Cold start.
    let mut cold_work = Work::ready(o, run, &format!("c{k}"), s).await?;
    cold_work.arrive(o, ns).await?;
    plant(o, ns, seen, &markers).await?;
    eprintln!("  {}: cold start", tag("a"));
    let mut a = Replica::start(cp, setup, which, 0, ns, &lease, &tag("a"))?;
    let why = until("cold start", Duration::from_secs(600), &mut a, || {
        let g = lock(seen);
        let (_, _, all, n) = cold_work.progress(&g);
        let fixed = markers_fixed(&g, &markers);
        (
            all.is_some() && fixed.is_some(),
            format!("{n}/{} new, markers done: {}", cold_work.total(), fixed.is_some()),
        )
    })
    .await;
    notes.extend(why);
    let cold = {
        let g = lock(seen);
        let (fb, fa, all, _) = cold_work.progress(&g);
        Intervals {
            first_bind_ms: ms(a.started, fb),
            first_attach_ms: ms(a.started, fa),
            all_new_ms: ms(a.started, all),
            full_pass_ms: ms(a.started, markers_fixed(&g, &markers)),
        }
    };
    let cold_cpu_s = a.cpu();
    let cold_peak_rss_mib = Replica::mib(procstat::peak_rss_bytes(a.pid));
    let a_holder = lock(seen)
        .holders
        .get(&lease)
        .and_then(|h| h.last().map(|(who, ..)| who.clone()))
        .unwrap_or_default();
    if a_holder.is_empty() {
        bail!(
            "{}: replica A leads but its lease {lease} has no holder",
            tag("a")
        );
    }

    // 2. The standby, with the takeover's work ready to arrive.
    let mut work = Work::ready(o, run, &format!("t{k}"), s).await?;
    // Bounded: a leader with a periodic resync (upstream's binder, every 15 s) is never quiet for long.
    settle(&a, Duration::from_secs(30)).await;
    // The audit log holds every run's writes (the replica users recur): B's count starts here.
    let b_started = Timestamp::now();
    let mut b = Replica::start(cp, setup, which, 1, ns, &lease, &tag("b"))?;
    settle(&b, Duration::from_secs(300)).await;
    let cpu0 = b.cpu();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let standby_cpu_cores = (b.cpu() - cpu0) / 10.0;
    let standby_rss_mib = Replica::mib(procstat::rss_bytes(b.pid));
    let leader_rss_mib = Replica::mib(procstat::rss_bytes(a.pid));

    // 3. The loss.
    eprintln!("  {}: {} to the leader", tag("b"), how.name());
    let b_cpu0 = b.cpu();
    let lost = Instant::now();
    signal(
        &a.child,
        match how {
            Stop::Kill => libc::SIGKILL,
            Stop::Term => libc::SIGTERM,
        },
    );
    work.arrive(o, ns).await?;
    let new_holder = |g: &Seen| {
        g.holders
            .get(&lease)
            .and_then(|h| {
                h.iter()
                    .find(|(who, ..)| !who.is_empty() && *who != a_holder)
                    .cloned()
            })
            .map(|(_, acq, seen_at)| acq.map_or(seen_at, instant_of))
    };
    let mut markers_planted = false;
    if how == Stop::Kill {
        plant(o, ns, seen, &markers).await?;
        markers_planted = new_holder(&lock(seen)).is_none();
        if !markers_planted {
            notes.push("the lease changed hands before the markers were planted: no full-pass figure".into());
        }
    }
    let why = until("takeover", Duration::from_secs(600), &mut b, || {
        let g = lock(seen);
        let acquired = new_holder(&g).is_some();
        let (_, _, all, n) = work.progress(&g);
        let fixed = !markers_planted || markers_fixed(&g, &markers).is_some();
        (
            acquired && all.is_some() && fixed,
            format!(
                "lease taken: {acquired}, {n}/{} new, markers done: {fixed}",
                work.total()
            ),
        )
    })
    .await;
    notes.extend(why);
    let (acquired, takeover, new_done) = {
        let g = lock(seen);
        let acquired = new_holder(&g);
        let (fb, fa, all, n) = work.progress(&g);
        let t = acquired.map(|t0| Intervals {
            first_bind_ms: ms(t0, fb),
            first_attach_ms: ms(t0, fa),
            all_new_ms: ms(t0, all),
            full_pass_ms: markers_planted
                .then(|| ms(t0, markers_fixed(&g, &markers)))
                .flatten(),
        });
        (acquired, t.unwrap_or_default(), n)
    };
    let peak_rss_after_mib = Replica::mib(procstat::peak_rss_bytes(b.pid));
    let cpu_after_s = b.cpu() - b_cpu0;
    let (a_user, b_user) = (a.user.clone(), b.user.clone());
    let logs = vec![a.log.display().to_string(), b.log.display().to_string()];
    drop(b);
    drop(a);

    // 4. The audit log: who wrote what, when.
    let (old_after, standby_before) = match acquired {
        Some(t) => {
            let acquired_wall = Timestamp::now()
                - k8s_openapi::jiff::SignedDuration::try_from(t.elapsed()).unwrap_or_default();
            let w = audit_writes(&cp.audit_log())?;
            let after = w
                .iter()
                .filter(|w| w.user == a_user && w.at > acquired_wall)
                .count();
            let before = w
                .iter()
                .filter(|w| {
                    w.user == b_user && w.at >= b_started && w.at < acquired_wall && w.resource != "leases"
                })
                .count();
            (Some(after), Some(before))
        }
        None => (None, None),
    };
    Ok(TakeoverResult {
        workload: name(&s),
        implementation: which.name(),
        stop: how,
        sizes: (s.pairs, s.pods, s.nodes),
        markers: markers.len(),
        cold,
        cold_peak_rss_mib,
        cold_cpu_s,
        loss_to_acquired_s: acquired.map(|t| t.saturating_duration_since(lost).as_secs_f64()),
        takeover,
        markers_planted,
        standby_cpu_cores,
        standby_rss_mib,
        leader_rss_mib,
        peak_rss_after_mib,
        cpu_after_s,
        old_leader_writes_after: old_after,
        standby_writes_before: standby_before,
        new_done,
        new_total: work.total(),
        note: (!notes.is_empty()).then(|| notes.join("; ")),
        logs,
    })
}

/// A write the apiserver answered, from its audit log.
#[derive(Debug, PartialEq)]
struct Write {
    user: String,
    resource: String,
    /// When the apiserver received it.
    at: Timestamp,
}

fn audit_writes(path: &Path) -> anyhow::Result<Vec<Write>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    Ok(parse_audit(&text))
}

/// The answered writes in audit log lines (JSON events); other lines are skipped.
fn parse_audit(text: &str) -> Vec<Write> {
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["stage"] == "ResponseComplete")
        .filter(|e| {
            matches!(
                e["verb"].as_str(),
                Some("create" | "update" | "patch" | "delete" | "deletecollection")
            )
        })
        .filter_map(|e| {
            Some(Write {
                user: e["user"]["username"].as_str()?.to_string(),
                resource: e["objectRef"]["resource"].as_str().unwrap_or("").to_string(),
                at: e["requestReceivedTimestamp"].as_str()?.parse().ok()?,
            })
        })
        .collect()
}

/// The workload's tables: the takeover, the cold start, and stowage over upstream for each.
pub fn markdown(results: &[TakeoverResult], describe: &str) -> String {
    let mut out = String::new();
    let Some(first) = results.first() else {
        return out;
    };
    let f = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.0}"));
    let _ = write!(
        out,
        "### {}\n\n{describe}\n\n\
         | implementation | stop | loss → lease s | lease → first bind ms | → first attach ms | → all new ms | → full pass ms | standby CPU cores | standby / leader RSS MiB | peak RSS after MiB | CPU after s | old leader's writes after | standby's writes before | new done |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        first.workload
    );
    let mut notes = Vec::new();
    for r in results {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {:.3} | {:.0} / {:.0} | {:.0} | {:.2} | {} | {} | {}/{}{} |",
            r.implementation,
            r.stop.name(),
            r.loss_to_acquired_s.map_or("–".into(), |s| format!("{s:.1}")),
            f(r.takeover.first_bind_ms),
            f(r.takeover.first_attach_ms),
            f(r.takeover.all_new_ms),
            f(r.takeover.full_pass_ms),
            r.standby_cpu_cores,
            r.standby_rss_mib,
            r.leader_rss_mib,
            r.peak_rss_after_mib,
            r.cpu_after_s,
            r.old_leader_writes_after.map_or("–".into(), |n| n.to_string()),
            r.standby_writes_before.map_or("–".into(), |n| n.to_string()),
            r.new_done,
            r.new_total,
            if r.note.is_some() { " ¹" } else { "" },
        );
        if let Some(n) = &r.note {
            notes.push(format!("{} {}: {n}", r.implementation, r.stop.name()));
        }
    }
    out.push_str(
        "\nCold start (replica A, process start → …, on a free lease):\n\n\
         | implementation | run | first bind ms | first attach ms | all new ms | full pass ms | CPU s | peak RSS MiB |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for r in results {
        let _ = writeln!(
            out,
            "| {} | before {} | {} | {} | {} | {} | {:.2} | {:.0} |",
            r.implementation,
            r.stop.name(),
            f(r.cold.first_bind_ms),
            f(r.cold.first_attach_ms),
            f(r.cold.all_new_ms),
            f(r.cold.full_pass_ms),
            r.cold_cpu_s,
            r.cold_peak_rss_mib
        );
    }
    let ratios = ratio_lines(results);
    if !ratios.is_empty() {
        out.push('\n');
        out.push_str(&ratios);
    }
    if !notes.is_empty() {
        out.push_str("\n¹ ");
        out.push_str(&notes.join("; ¹ "));
        out.push('\n');
    }
    out.push('\n');
    out
}

/// Upstream's interval over stowage's (how many times faster stowage is), per way of stopping.
fn ratio_lines(results: &[TakeoverResult]) -> String {
    let mut out = String::new();
    let x = |u: Option<f64>, s: Option<f64>| match (u, s) {
        (Some(u), Some(s)) if s > 0.0 => format!("{:.1}×", u / s),
        _ => "–".into(),
    };
    for stop in [Stop::Kill, Stop::Term] {
        let of = |i: &str| results.iter().find(|r| r.stop == stop && r.implementation == i);
        let (Some(u), Some(s)) = (of("upstream"), of("stowage")) else {
            continue;
        };
        let _ = writeln!(
            out,
            "{}: stowage is faster by upstream's interval over its own: lease → first bind {}, first attach {}, all new {}, full pass {}; cold start → first bind {}, full pass {}; standby RSS {:.2}× upstream's, its own leader's {:.2}×.",
            stop.name(),
            x(u.takeover.first_bind_ms, s.takeover.first_bind_ms),
            x(u.takeover.first_attach_ms, s.takeover.first_attach_ms),
            x(u.takeover.all_new_ms, s.takeover.all_new_ms),
            x(u.takeover.full_pass_ms, s.takeover.full_pass_ms),
            x(u.cold.first_bind_ms, s.cold.first_bind_ms),
            x(u.cold.full_pass_ms, s.cold.full_pass_ms),
            if u.standby_rss_mib > 0.0 {
                s.standby_rss_mib / u.standby_rss_mib
            } else {
                0.0
            },
            if s.leader_rss_mib > 0.0 {
                s.standby_rss_mib / s.leader_rss_mib
            } else {
                0.0
            },
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_audit_log_gives_each_answered_write_its_user_and_time() {
        let log = r#"{"kind":"Event","level":"Metadata","stage":"ResponseComplete","verb":"update","user":{"username":"replica-0","groups":["system:masters"]},"objectRef":{"resource":"leases","namespace":"t1"},"requestReceivedTimestamp":"2026-12-02T04:40:00.123456Z"}
{"kind":"Event","level":"Metadata","stage":"ResponseStarted","verb":"update","user":{"username":"replica-0"},"objectRef":{"resource":"leases"},"requestReceivedTimestamp":"2026-12-02T04:40:00.200000Z"}
{"kind":"Event","level":"Metadata","stage":"ResponseComplete","verb":"get","user":{"username":"replica-1"},"objectRef":{"resource":"pods"},"requestReceivedTimestamp":"2026-12-02T04:40:01Z"}
not json
{"kind":"Event","level":"Metadata","stage":"ResponseComplete","verb":"create","user":{"username":"replica-1"},"objectRef":{"resource":"events"},"requestReceivedTimestamp":"2026-12-02T04:40:02.5Z"}"#;
        let w = parse_audit(log);
        assert_eq!(
            w,
            [
                Write {
                    user: "replica-0".into(),
                    resource: "leases".into(),
                    at: "2026-12-02T04:40:00.123456Z".parse().unwrap()
                },
                Write {
                    user: "replica-1".into(),
                    resource: "events".into(),
                    at: "2026-12-02T04:40:02.5Z".parse().unwrap()
                },
            ]
        );
    }

    #[test]
    fn spans_and_intervals_read_first_sightings() {
        let t0 = Instant::now();
        let map: HashMap<String, Instant> = [
            ("a".to_string(), t0 + Duration::from_millis(30)),
            ("b".to_string(), t0 + Duration::from_millis(10)),
        ]
        .into();
        let keys = ["a".to_string(), "b".to_string(), "c".to_string()];
        let (first, last, n) = span(&map, &keys);
        assert_eq!(n, 2);
        assert_eq!(ms(t0, first).map(f64::round), Some(10.0));
        assert_eq!(ms(t0, last).map(f64::round), Some(30.0));
        // Work done before the clock's start reads negative, not zero.
        assert_eq!(
            ms(t0 + Duration::from_millis(50), last).map(f64::round),
            Some(-20.0)
        );
        assert_eq!(ms(t0, None), None);
    }

    #[test]
    fn the_full_pass_ends_only_when_every_marker_is_restored() {
        let t0 = Instant::now();
        let mut seen = Seen::default();
        let markers = ["m1".to_string(), "m2".to_string()];
        seen.marks
            .insert("m1".into(), Mark::Fixed(t0 + Duration::from_millis(5)));
        seen.marks.insert("m2".into(), Mark::Stripped);
        assert_eq!(markers_fixed(&seen, &markers), None);
        seen.marks
            .insert("m2".into(), Mark::Fixed(t0 + Duration::from_millis(9)));
        assert_eq!(
            markers_fixed(&seen, &markers),
            Some(t0 + Duration::from_millis(9))
        );
    }

    #[test]
    fn markers_are_one_claim_in_a_hundred_spread_over_all() {
        let m: Vec<String> = (MARKER_EVERY / 2..1000)
            .step_by(MARKER_EVERY)
            .map(claim_name)
            .collect();
        assert_eq!(m.len(), 10);
        assert_eq!(m.first().map(String::as_str), Some("claim-00050"));
        assert_eq!(m.last().map(String::as_str), Some("claim-00950"));
    }

    #[test]
    fn the_tables_say_how_many_times_faster() {
        let row = |i: &str, bind: f64| TakeoverResult {
            workload: "takeover-10".into(),
            implementation: i.into(),
            stop: Stop::Kill,
            sizes: (10, 2, 1),
            markers: 0,
            cold: Intervals::default(),
            cold_peak_rss_mib: 0.0,
            cold_cpu_s: 0.0,
            loss_to_acquired_s: Some(15.2),
            takeover: Intervals {
                first_bind_ms: Some(bind),
                ..Default::default()
            },
            markers_planted: true,
            standby_cpu_cores: 0.0,
            standby_rss_mib: 50.0,
            leader_rss_mib: 100.0,
            peak_rss_after_mib: 0.0,
            cpu_after_s: 0.0,
            old_leader_writes_after: Some(0),
            standby_writes_before: Some(0),
            new_done: 3,
            new_total: 3,
            note: None,
            logs: vec![],
        };
        let md = markdown(&[row("upstream", 800.0), row("stowage", 100.0)], "x");
        assert!(md.contains("lease → first bind 8.0×"), "{md}");
        assert!(md.contains("| stowage | SIGKILL | 15.2 | 100 |"), "{md}");
        assert!(md.contains("its own leader's 0.50×"), "{md}");
    }
}

//! The workloads and one measured run of one of them against one implementation (the measured
//! window and its wait are in `window.rs`).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Event, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::{StorageClass, VolumeAttachment};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use stowage_testkit::builders;
use tokio::task::JoinHandle;

use crate::apiserver::Requests;
use crate::controller::{Controller, Impl, Limits, Setup};
use crate::fixtures::{Objects, RUN_LABEL, attach_driver, claim_name, label, pairs, pod, pod_name, pv_name};
use crate::procstat;
use crate::report::RunResult;
use crate::tracker::{Tracker, watch};
use crate::window::{WindowStart, wait_for};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Workload {
    /// N unbound PV/PVC pairs created before the controller starts.
    Static { n: usize },
    /// N claims created at full speed against N Available volumes, controller running.
    Burst { n: usize },
    /// N pods with bound claims, spread over `nodes` nodes, created with `nodeName` set.
    Attach { pods: usize, nodes: usize },
    /// N bound claims whose request grows, controller running.
    Expand { n: usize },
}

impl Workload {
    pub fn name(&self) -> String {
        match self {
            Workload::Static { n } => format!("static-{n}"),
            Workload::Burst { n } => format!("burst-{n}"),
            Workload::Attach { pods, nodes } => format!("attach-{pods}x{nodes}"),
            Workload::Expand { n } => format!("expand-{n}"),
        }
    }

    pub fn size(&self) -> usize {
        match self {
            Workload::Static { n } | Workload::Burst { n } | Workload::Expand { n } => *n,
            Workload::Attach { pods, .. } => *pods,
        }
    }

    /// What is timed, for the table's caption.
    pub fn describe(&self) -> String {
        match self {
            Workload::Static { n } => format!(
                "{n} unbound PV/PVC pairs (sizes 1–10Gi, one class, volumes Available) exist before the \
                 controller starts. Window: process start → every claim `Bound` (includes the initial \
                 list). Latency: process start → that claim seen `Bound`."
            ),
            Workload::Burst { n } => format!(
                "{n} Available volumes exist; once the controller has bound a warm-up claim, {n} claims \
                 are created 64 at a time. Latency: create request sent → claim seen `Bound`."
            ),
            Workload::Attach { pods, nodes } => format!(
                "{pods} pods, each with its own bound claim of an attachable CSI driver, created with \
                 `nodeName` set over {nodes} Ready nodes (controller-managed attach) after a warm-up pod \
                 got its attachment. Latency: pod create sent → its VolumeAttachment seen."
            ),
            Workload::Expand { n } => format!(
                "{n} bound claims of an external CSI driver (class allows expansion) grow 1Gi → 2Gi after a \
                 warm-up claim did. Upstream hands CSI expansion to external-resizer and only reacts \
                 (ExternalExpanding event); so the target is the controller's first reaction on the claim: \
                 an event on it, the `volume.kubernetes.io/storage-resizer` annotation, or a resize \
                 condition. Latency: patch sent → reaction seen."
            ),
        }
    }

    fn controllers(&self, which: Impl) -> &'static str {
        match (self, which) {
            (Workload::Static { .. }, Impl::Floor { .. }) => "static",
            (Workload::Burst { .. }, Impl::Floor { .. }) => "burst",
            (Workload::Attach { .. }, Impl::Floor { .. }) => "attach",
            (Workload::Expand { .. }, Impl::Floor { .. }) => "expand",
            (Workload::Static { .. } | Workload::Burst { .. }, Impl::Upstream) => {
                "persistentvolume-binder-controller"
            }
            (Workload::Static { .. } | Workload::Burst { .. }, Impl::Stowage) => "binder",
            (Workload::Attach { .. }, Impl::Upstream) => "persistentvolume-attach-detach-controller",
            (Workload::Attach { .. }, Impl::Stowage) => "attachdetach",
            (Workload::Expand { .. }, Impl::Upstream) => "persistentvolume-expander-controller",
            (Workload::Expand { .. }, Impl::Stowage) => "expand",
        }
    }
}

pub struct Env {
    pub objects: Objects,
    pub setup: Setup,
    pub stall: Duration,
    pub timeout: Duration,
}

pub struct Spec<'a> {
    pub workload: &'a Workload,
    pub which: Impl,
    pub mode: &'a str,
    /// Flags passed; None = the implementation's defaults.
    pub limits: Option<(f32, u32)>,
    /// Limits in effect.
    pub effective: Limits,
}

const WARM: &str = "warm";

/// Runs the workload once on fresh objects and removes them afterwards, whatever happened.
pub async fn run_one(env: &Env, spec: &Spec<'_>) -> anyhow::Result<RunResult> {
    let run = format!("b{:06x}", rand::random::<u32>() & 0xff_ffff);
    let label = format!(
        "{}-{}-{}-{run}",
        spec.workload.name(),
        spec.mode,
        spec.which.name()
    );
    let result = measure(env, spec, &run, &label).await;
    eprintln!("  {label}: cleaning up");
    env.objects
        .cleanup(&run, &run, &format!("{run}-pv-"))
        .await
        .context("cleanup")?;
    result
}

/// A measured window of a controller.
struct Window {
    ctrl: Controller,
    opened: WindowStart,
}

async fn measure(env: &Env, spec: &Spec<'_>, run: &str, tag: &str) -> anyhow::Result<RunResult> {
    let o = &env.objects;
    let client = o.client.clone();
    let ns = run;
    let n = spec.workload.size();
    let pv_name = |i: usize| pv_name(run, i);
    let by_label = watcher::Config::default().labels(&format!("{RUN_LABEL}={run}"));
    o.namespace(ns, run).await?;
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    let classes: Api<StorageClass> = Api::all(client.clone());
    let pp = PostParams::default();
    let mut watches: Vec<JoinHandle<()>> = Vec::new();
    let start_ctrl = || {
        Controller::start(
            &env.setup,
            spec.which,
            spec.workload.controllers(spec.which),
            run,
            spec.limits,
            tag,
        )
    };
    // The sizes and objects of the binding workloads (static, burst).
    let size = |i: usize| format!("{}Gi", 1 + i % 10);
    let sized_pv = |i: usize| {
        label(
            builders::pv(&pv_name(i)).capacity(&size(i)).class(run).build(),
            run,
        )
    };
    let sized_claim = |i: usize| {
        label(
            builders::pvc(ns, &claim_name(i))
                .request(&size(i))
                .class(run)
                .build(),
            run,
        )
    };
    let no_provisioner_class = || {
        label(
            builders::storage_class(run, "kubernetes.io/no-provisioner").build(),
            run,
        )
    };
    let warm_pv = format!("{run}-pv-warm");
    let bound = |c: &PersistentVolumeClaim| {
        (c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")).then(|| c.name_any())
    };
    eprintln!("  {tag}: creating {n} objects");

    let (tracker, window, trigger): (Arc<Tracker>, Result<Window, String>, Trigger) = match spec.workload {
        Workload::Static { n } => {
            let n = *n;
            classes.create(&pp, &no_provisioner_class()).await?;
            o.available_pvs((0..n).map(sized_pv).collect()).await?;
            o.create_all(&pvcs, (0..n).map(sized_claim).collect()).await?;
            let tracker = Tracker::new((0..n).map(claim_name), []);
            watches.push(watch(pvcs.clone(), by_label.clone(), tracker.clone(), bound).await?);
            let writes0 = Requests::scrape(&client).await?;
            let ctrl = start_ctrl()?;
            tracker.set_default_start(ctrl.started);
            let opened = WindowStart {
                start: ctrl.started,
                cpu0: 0.0,
                writes0,
            };
            (tracker, Ok(Window { ctrl, opened }), Trigger::None)
        }
        Workload::Burst { n } => {
            let n = *n;
            classes.create(&pp, &no_provisioner_class()).await?;
            // The warm-up pair is larger than any other, so it cannot take a measured volume.
            let mut vols: Vec<PersistentVolume> = (0..n).map(sized_pv).collect();
            vols.push(label(
                builders::pv(&warm_pv).capacity("100Gi").class(run).build(),
                run,
            ));
            o.available_pvs(vols).await?;
            let tracker = Tracker::new((0..n).map(claim_name), [WARM.to_string()]);
            watches.push(watch(pvcs.clone(), by_label.clone(), tracker.clone(), bound).await?);
            let ctrl = start_ctrl()?;
            let warm = label(builders::pvc(ns, WARM).request("100Gi").class(run).build(), run);
            pvcs.create(&pp, &warm).await?;
            let window = warm_up(env, tag, &tracker, ctrl, &client).await;
            let claims = (0..n).map(sized_claim).collect();
            (tracker, window, Trigger::CreateClaims(claims))
        }
        Workload::Attach { pods, nodes } => {
            let (n, nodes) = (*pods, (*nodes).max(1));
            let driver = attach_driver(run);
            o.create_all(
                &Api::all(client.clone()),
                vec![label(builders::csi_driver(&driver, true), run)],
            )
            .await?;
            let node_names: Vec<String> = (0..nodes).map(|j| format!("{run}-node-{j:03}")).collect();
            o.nodes(&node_names, run).await?;
            let pairs = pairs(n, pv_name, claim_name, &warm_pv, WARM);
            o.bound_pairs(ns, run, pairs, run, &driver, "1Gi").await?;
            let tracker = Tracker::new((0..n).map(pv_name), [warm_pv.clone()]);
            let drv = driver.clone();
            let va_key = move |va: &VolumeAttachment| {
                (va.spec.attacher == drv)
                    .then(|| va.spec.source.persistent_volume_name.clone())
                    .flatten()
            };
            let vas: Api<VolumeAttachment> = Api::all(client.clone());
            watches.push(watch(vas, watcher::Config::default(), tracker.clone(), va_key).await?);
            let ctrl = start_ctrl()?;
            let pods_api: Api<Pod> = Api::namespaced(client.clone(), ns);
            pods_api
                .create(&pp, &pod(ns, "pod-warm", WARM, &node_names[0], run))
                .await?;
            let window = warm_up_key(env, tag, &tracker, ctrl, &client, &warm_pv).await;
            let pods = (0..n)
                .map(|i| {
                    (
                        pv_name(i),
                        pod(ns, &pod_name(i), &claim_name(i), &node_names[i % nodes], run),
                    )
                })
                .collect();
            (tracker, window, Trigger::CreatePods(pods))
        }
        Workload::Expand { n } => {
            let n = *n;
            let driver = format!("{run}.expand.bench.example.com");
            let class = label(
                builders::storage_class(run, &driver)
                    .allow_expansion(true)
                    .build(),
                run,
            );
            classes.create(&pp, &class).await?;
            let pairs = pairs(n, pv_name, claim_name, &warm_pv, WARM);
            o.bound_pairs(ns, run, pairs, run, &driver, "1Gi").await?;
            let tracker = Tracker::new((0..n).map(claim_name), [WARM.to_string()]);
            let events: Api<Event> = Api::namespaced(client.clone(), ns);
            let ev_cfg = watcher::Config::default().fields("involvedObject.kind=PersistentVolumeClaim");
            watches.push(
                watch(events, ev_cfg, tracker.clone(), |e: &Event| {
                    e.involved_object.name.clone()
                })
                .await?,
            );
            watches.push(watch(pvcs.clone(), by_label.clone(), tracker.clone(), resize_reaction).await?);
            let ctrl = start_ctrl()?;
            pvcs.patch(WARM, &PatchParams::default(), &Patch::Merge(grow("2Gi")))
                .await?;
            let window = warm_up(env, tag, &tracker, ctrl, &client).await;
            (
                tracker,
                window,
                Trigger::GrowClaims((0..n).map(claim_name).collect()),
            )
        }
    };

    let mut base = RunResult::unmeasured(
        spec.workload.name(),
        spec.mode,
        &spec.which.name(),
        spec.effective,
        n,
    );
    let mut w = match window {
        Ok(w) => w,
        Err(note) => {
            watches.iter().for_each(JoinHandle::abort);
            base.note = Some(format!("warm-up failed: {note}"));
            return Ok(base);
        }
    };
    base.controller_log = w.ctrl.log.display().to_string();

    o.own_writes.store(0, Ordering::Relaxed);
    let failure = {
        let fire = trigger.fire(o, &tracker, &pvcs, ns);
        let wait = wait_for(
            env,
            tag,
            "done",
            || tracker.progress(),
            &mut w.ctrl,
            w.opened.start,
        );
        let (fired, failure) = tokio::join!(fire, wait);
        fired?;
        failure
    };
    let end = w.opened.close(&client, w.ctrl.pid).await?;
    if matches!(spec.workload, Workload::Attach { .. }) {
        base.profile = tokio::task::block_in_place(|| w.ctrl.attach_profile());
    }
    w.ctrl.stop();
    watches.iter().for_each(JoinHandle::abort);
    Ok(end.result(base, o, &tracker, failure))
}

fn grow(size: &str) -> serde_json::Value {
    json!({"spec": {"resources": {"requests": {"storage": size}}}})
}

/// A controller's visible reaction to a grown claim, other than an event.
fn resize_reaction(c: &PersistentVolumeClaim) -> Option<String> {
    let annotated = c
        .annotations()
        .contains_key("volume.kubernetes.io/storage-resizer");
    let conditioned = c
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter().any(|c| {
                matches!(
                    c.type_.as_str(),
                    "Resizing" | "FileSystemResizePending" | "ControllerResizeError"
                )
            })
        });
    (annotated || conditioned).then(|| c.name_any())
}

/// What starts the measured objects' clocks once the controller is warm.
enum Trigger {
    None,
    CreateClaims(Vec<PersistentVolumeClaim>),
    /// (tracked key = the pod's volume, pod)
    CreatePods(Vec<(String, Pod)>),
    GrowClaims(Vec<String>),
}

impl Trigger {
    async fn fire(
        self,
        o: &Objects,
        tracker: &Tracker,
        pvcs: &Api<PersistentVolumeClaim>,
        ns: &str,
    ) -> anyhow::Result<()> {
        let pp = PostParams::default();
        match self {
            Trigger::None => Ok(()),
            Trigger::CreateClaims(claims) => {
                each(o.concurrency, claims, |c| {
                    let pp = &pp;
                    async move {
                        let name = c.name_any();
                        tracker.start(&name);
                        o.count_own_write();
                        pvcs.create(pp, &c)
                            .await
                            .map(|_| ())
                            .with_context(|| format!("create {name}"))
                    }
                })
                .await
            }
            Trigger::CreatePods(pods) => {
                let api: Api<Pod> = Api::namespaced(o.client.clone(), ns);
                each(o.concurrency, pods, |(key, p)| {
                    let (api, pp) = (&api, &pp);
                    async move {
                        tracker.start(&key);
                        o.count_own_write();
                        api.create(pp, &p).await.map(|_| ()).context("create pod")
                    }
                })
                .await
            }
            Trigger::GrowClaims(names) => {
                let patch = grow("2Gi");
                each(o.concurrency, names, |name| {
                    let patch = &patch;
                    async move {
                        tracker.start(&name);
                        o.count_own_write();
                        pvcs.patch(&name, &PatchParams::default(), &Patch::Merge(patch))
                            .await
                            .map(|_| ())
                            .with_context(|| format!("grow {name}"))
                    }
                })
                .await
            }
        }
    }
}

/// Runs `f` on every item, `concurrency` at a time; the first error ends it.
pub(crate) async fn each<T, F, Fut>(concurrency: usize, items: Vec<T>, f: F) -> anyhow::Result<()>
where
    F: Fn(T) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let mut s = futures::stream::iter(items).map(f).buffer_unordered(concurrency);
    while let Some(r) = s.next().await {
        r?;
    }
    Ok(())
}

async fn warm_up(
    env: &Env,
    label: &str,
    tracker: &Tracker,
    ctrl: Controller,
    client: &kube::Client,
) -> Result<Window, String> {
    warm_up_key(env, label, tracker, ctrl, client, WARM).await
}

/// Waits until the controller has handled the warm-up object (so its caches are synced and it is
/// working), then opens the measured window.
async fn warm_up_key(
    env: &Env,
    label: &str,
    tracker: &Tracker,
    mut ctrl: Controller,
    client: &kube::Client,
    key: &str,
) -> Result<Window, String> {
    let started = ctrl.started;
    let progress = || (usize::from(tracker.is_done(key)), 1);
    if let Some(why) = wait_for(env, label, "warm-up", progress, &mut ctrl, started).await {
        return Err(why);
    }
    let writes0 = Requests::scrape(client).await.map_err(|e| format!("{e:#}"))?;
    let cpu0 = procstat::cpu_seconds(ctrl.pid).unwrap_or(0.0);
    let opened = WindowStart {
        start: Instant::now(),
        cpu0,
        writes0,
    };
    Ok(Window { ctrl, opened })
}

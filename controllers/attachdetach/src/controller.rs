//! `Controller`: one task owns desired and actual state, feeds them from the shared informers
//! (`ingest`), runs the pure pass (`core`) whenever something changed (or a deadline passed), and
//! hands API writes to tasks of their own (`exec`): attaches and detaches draw from separate budgets so a
//! burst of one never starves the other. Results come back to the owning task, which records
//! what it wrote so the next pass never acts on an older object. Periodic work reads the stores
//! only: no GET per attachment. The write tasks live in this task's JoinSet and draw from the
//! executor's semaphores rather than the shared window: why, see `exec`.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use kube::{Api, ResourceExt};
use stowage_common::api::attachments::Attachments;
use stowage_common::observe::events::Events;
use stowage_common::store::informer::Change;
use stowage_common::store::informers::Informers;
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;

use crate::Config;
use crate::actual::Actual;
use crate::core::{Nodes, next_deadline, reconcile, reconcile_attaches};
use crate::desired::Desired;
use crate::exec::Executor;
use crate::ingest::awaits_attach;
use crate::metrics::Metrics;
use crate::state::{Parts, State};

/// Event reporter name.
const COMPONENT: &str = "stowage-attachdetach";
/// Events handled in a row before a pending pass runs anyway, so a storm cannot starve it.
const MAX_BACKLOG: usize = 1024;
/// Time between two full passes, as a multiple of what the last pass cost, within the bounds
/// below. A full pass scans the whole desired and actual state; during a burst every watch event
/// would otherwise start one (3,000 full scans for 1,000 pods). Attaches do not wait for it: a
/// pod event is answered by an attach step over that pod's volumes (`attach_step`). What waits
/// for a full pass is detaches, node status and releases; a change that provably decides none of
/// them (an attachment created as wanted: `core::pass_unaffected`) does not even mark one due.
/// Passes are spaced widely enough to keep them under ~1/(1+PASS_GAP_FACTOR) of the loop's time
/// whatever the state's size, while a small state (a pass of microseconds) is not made to wait.
const PASS_GAP_FACTOR: u32 = 10;
const MIN_PASS_GAP: Duration = Duration::from_millis(1);
const MAX_PASS_GAP: Duration = Duration::from_millis(50);

/// The owning task: its write tasks, its handles, the decision state, and the pacing of its
/// passes. Only this file holds it; the parts work on `state::Parts`.
struct Controller {
    /// Write tasks: aborted with the controller when leadership ends, so a former leader
    /// stops writing at once.
    tasks: JoinSet<()>,
    cluster: Arc<Informers>,
    config: Config,
    executor: Arc<Executor>,
    /// When a pass is due without new events.
    wake_at: Option<Instant>,
    last_pass: Option<Instant>,
    /// The wait the last pass's cost earned (see `PASS_GAP_FACTOR`).
    pass_gap: Duration,
    st: State,
}

/// Runs the controller until a watch ends or the future is dropped.
pub async fn run(cluster: Arc<Informers>, metrics: Metrics, config: Config) -> anyhow::Result<()> {
    // Subscribe before reading the stores so nothing falls between the two.
    let mut pod_feed = cluster.pods.feed();
    let mut node_feed = cluster.nodes.feed();
    let mut pvc_feed = cluster.pvcs.feed();
    let mut pv_feed = cluster.pvs.feed();
    let mut va_feed = cluster.attachments.feed();
    let mut driver_feed = cluster.csi_drivers.feed();
    cluster.ready().await;

    let (done_tx, mut done_rx) = mpsc::unbounded_channel();
    let client = cluster.client.clone();
    let mut c = Controller {
        tasks: JoinSet::new(),
        executor: Arc::new(Executor {
            vas: Attachments::new(client.clone()),
            pvs: Api::all(client.clone()),
            nodes: Api::all(client.clone()),
            events: Events::new(client, COMPONENT),
            metrics,
            done: done_tx,
            attach_slots: Arc::new(Semaphore::new(config.max_attaches_in_flight.max(1))),
            detach_slots: Arc::new(Semaphore::new(config.max_detaches_in_flight.max(1))),
            hooks: config.hooks.clone(),
        }),
        cluster,
        config: config.clone(),
        st: State {
            desired: Desired::default(),
            actual: Actual::default(),
            nodes: Nodes::new(),
            pods: HashMap::new(),
            claim_pods: HashMap::new(),
            dirty_pods: HashSet::new(),
            pod_seen: HashMap::new(),
            wanted_since: HashMap::new(),
            attach_dirty: BTreeSet::new(),
            waiting_since: Vec::new(),
            va_keys: HashMap::new(),
            unresolved: HashMap::new(),
            pv_attachments: HashMap::new(),
            pv_dirty: HashSet::new(),
            pv_patching: HashSet::new(),
            status_in_flight: HashSet::new(),
            status_retry: HashMap::new(),
            dirty: true,
            backlog: 0,
            quiet: false,
        },
        wake_at: None,
        last_pass: None,
        pass_gap: MIN_PASS_GAP,
    };
    c.parts().load();
    tracing::info!(
        desired = c.st.desired.len(),
        actual = c.st.actual.len(),
        nodes = c.st.nodes.len(),
        "attach/detach state loaded"
    );

    let start = Instant::now() + config.resync;
    let mut resync = tokio::time::interval_at(start, config.resync.max(Duration::from_millis(100)));
    // A late resync is not made up for by a burst of them.
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Not the keyed driver (stowage_common::runtime::driver) the other controllers run on: as upstream's
    // reconciler, a pass compares the whole desired state with the whole actual state (a detach
    // is decided from every pod of every node, a node's status write carries its whole list),
    // so the unit of work is a pass over dirty state, not a key; passes are spaced and throttled
    // as a whole, and write tasks draw from two budgets instead of one window. Nor the agent's
    // pass skeleton (its `passes::wait`): those passes re-read the stores whatever changed, while
    // this loop folds each event into dirty state as it comes (an attach step answers a pod at
    // once, without a full pass), bounds the events it folds before a pass (`MAX_BACKLOG`) and
    // spaces full passes by what the last one cost (`PASS_GAP_FACTOR`).
    loop {
        let wake = c.wake_at;
        // A due pass that came too soon after the last one waits for the interval.
        let throttled = c
            .last_pass
            .map(|t| t + c.pass_gap)
            .filter(|t| c.st.dirty && *t > Instant::now());
        tokio::select! {
            biased;
            _ = std::future::ready(()), if c.st.backlog >= MAX_BACKLOG => c.catch_up(),
            Some(done) = done_rx.recv() => {
                if let Some(now) = c.parts().finish(done) {
                    c.update_wake(now);
                }
            }
            Some(_) = c.tasks.join_next(), if !c.tasks.is_empty() => {}
            r = pod_feed.next() => match r? {
                Change::Applied(p) | Change::Deleted(p) => c.parts().pod_changed(&p),
                Change::Resynced => c.parts().resync(false),
            },
            r = node_feed.next() => match r? {
                Change::Applied(n) => c.parts().node_applied(&n),
                Change::Deleted(n) => c.parts().node_deleted(&n.name_any()),
                Change::Resynced => c.parts().resync(false),
            },
            r = pvc_feed.next() => match r? {
                Change::Applied(pvc) | Change::Deleted(pvc) => {
                    c.parts().claim_changed(&pvc.namespace().unwrap_or_default(), &pvc.name_any())
                }
                Change::Resynced => c.parts().resync(false),
            },
            r = pv_feed.next() => match r? {
                Change::Applied(pv) | Change::Deleted(pv) => c.parts().volume_changed(&pv),
                Change::Resynced => c.parts().resync(false),
            },
            r = va_feed.next() => match r? {
                Change::Applied(va) => {
                    c.parts().va_applied(&va);
                }
                Change::Deleted(va) => c.parts().va_deleted(&va),
                Change::Resynced => c.parts().resync(false),
            },
            // attachRequired may have changed: every pod's volumes are re-resolved.
            r = driver_feed.next() => {
                r?;
                c.parts().all_pods_dirty();
            }
            _ = resync.tick() => c.parts().resync(true),
            _ = tokio::time::sleep_until(wake.unwrap_or_else(Instant::now)), if wake.is_some() => {
                c.wake_at = None;
                c.st.dirty = true;
            }
            // Pods resolved and their attaches started as soon as no event is waiting: a new pod
            // does not wait for a full pass (nor for its spacing).
            _ = std::future::ready(()), if !c.st.dirty_pods.is_empty() || !c.st.attach_dirty.is_empty() => c.attach_step(),
            _ = std::future::ready(()), if c.st.dirty && throttled.is_none() => c.pass(),
            _ = tokio::time::sleep_until(throttled.unwrap_or_else(Instant::now)), if throttled.is_some() => c.pass(),
        }
    }
}

impl Controller {
    /// The state and the handles a part works with, borrowed for one change or one pass.
    fn parts(&mut self) -> Parts<'_> {
        Parts {
            st: &mut self.st,
            cluster: &self.cluster,
            executor: &self.executor,
            tasks: &mut self.tasks,
        }
    }

    /// A storm of events held everything back: resolve pods, and run the full pass if one is due.
    pub(crate) fn catch_up(&mut self) {
        self.attach_step();
        self.st.backlog = 0;
        if self.st.dirty {
            self.pass();
        }
    }

    /// Resolves the pods that changed and decides the attaches of the volumes they want (phase 3
    /// of a pass, for those volumes only: `core::reconcile_attaches`). A pod that let go of a
    /// volume has marked a full pass due while being resolved.
    pub(crate) fn attach_step(&mut self) {
        self.parts().refresh_pods();
        if self.st.attach_dirty.is_empty() {
            return;
        }
        let volumes = std::mem::take(&mut self.st.attach_dirty);
        let now = Instant::now();
        let actions = reconcile_attaches(&self.st.desired, &self.st.actual, &self.st.nodes, now, &volumes);
        self.executor.metrics.attach_steps.inc();
        self.parts().apply(actions, now);
    }

    /// One reconciler pass.
    pub(crate) fn pass(&mut self) {
        let started = Instant::now();
        self.parts().refresh_pods();
        // The full pass decides every attach too.
        self.st.attach_dirty.clear();
        let now = Instant::now();
        self.last_pass = Some(now);
        let timer = self.executor.metrics.reconcile_seconds.start_timer();
        let actions = reconcile(
            &self.st.desired,
            &self.st.actual,
            &self.st.nodes,
            now,
            &self.config,
        );
        timer.observe_duration();
        self.executor.metrics.reconciles.inc();
        self.st.dirty = false;
        self.st.backlog = 0;
        self.st.waiting_since.clear();
        self.parts().apply(actions, now);
        self.parts().update_inventory();
        // What no attach is started for (already attached, or no longer wanted) has no latency.
        let (desired, actual) = (&self.st.desired, &self.st.actual);
        self.st
            .wanted_since
            .retain(|(v, n), _| desired.get(v, n).is_some() && awaits_attach(actual, v, n));
        self.parts().forget_gone_nodes();
        self.parts().sync_pv_finalizers();
        self.update_wake(now);
        self.pass_gap = (started.elapsed() * PASS_GAP_FACTOR).clamp(MIN_PASS_GAP, MAX_PASS_GAP);
    }

    pub(crate) fn update_wake(&mut self, now: Instant) {
        let retry = self.st.status_retry.values().copied().filter(|t| *t > now).min();
        self.wake_at = [next_deadline(&self.st.actual, &self.config, now), retry]
            .into_iter()
            .flatten()
            .min();
    }
}

#[cfg(test)]
mod live_tests {
    use super::*;
    use crate::exec::{HookPoints, Hooks};
    use k8s_openapi::api::core::v1::{Node, Pod};
    use k8s_openapi::api::storage::v1::VolumeAttachment;
    use kube::api::Patch;
    use kube::api::{PatchParams, PostParams};
    use stowage_testkit::builders::{csi_driver, node as node_builder, pod, pv, pvc};
    use stowage_testkit::{InProcess, eventually, inproc::WAIT};

    /// A Ready managed node n1 and claim app/c bound to PV `volume` of an attachable driver.
    async fn one_bound_claim(volume: &str) -> InProcess {
        const DRIVER: &str = "hooks.test.stowage.dev";
        let h = InProcess::new().await;
        h.namespace("app").await;
        h.create(csi_driver(DRIVER, true)).await;
        h.create(node_builder("n1").controller_attach().build()).await;
        let ready = serde_json::json!({"status": {"conditions": [{"type": "Ready", "status": "True"}]}});
        Api::<Node>::all(h.client.clone())
            .patch_status("n1", &PatchParams::default(), &Patch::Merge(&ready))
            .await
            .unwrap();
        let claim = h.create_pvc(pvc("app", "c").volume_name(volume).build()).await;
        h.create_pv(
            pv(volume)
                .driver(DRIVER, &format!("h-{volume}"))
                .claim_ref("app", "c", &claim.uid().unwrap())
                .build(),
        )
        .await;
        let bound = Patch::Merge(serde_json::json!({"status": {"phase": "Bound"}}));
        h.pvs()
            .patch_status(volume, &PatchParams::default(), &bound)
            .await
            .unwrap();
        h.pvcs("app")
            .patch_status("c", &PatchParams::default(), &bound)
            .await
            .unwrap();
        h
    }

    async fn attachments_of(h: &InProcess, volume: &str) -> Result<usize, String> {
        let vas: Api<VolumeAttachment> = Api::all(h.client.clone());
        let list = vas.list(&Default::default()).await.map_err(|e| e.to_string())?;
        Ok(list
            .items
            .iter()
            .filter(|va| va.spec.source.persistent_volume_name.as_deref() == Some(volume))
            .count())
    }

    /// Creates pod app/p on n1 with claim c, and waits until its volume has an attachment.
    async fn schedule_pod_and_await_attachment(h: &InProcess, volume: &str) -> Api<Pod> {
        let pods = Api::<Pod>::namespaced(h.client.clone(), "app");
        pods.create(
            &PostParams::default(),
            &pod("app", "p").claim("data", "c").node("n1").build(),
        )
        .await
        .unwrap();
        eventually(WAIT, || async {
            (attachments_of(h, volume).await? == 1)
                .then_some(())
                .ok_or_else(|| format!("no VolumeAttachment for {volume} yet"))
        })
        .await;
        pods
    }

    /// The create's result arrives after its own watch event and after the pod went: the object
    /// adds nothing, but the entry leaving "attaching" makes the unwanted attachment
    /// detachable, so a pass must follow then (not at the next resync, an hour away here).
    #[tokio::test]
    async fn an_attach_result_after_the_pod_went_is_followed_by_the_detach() {
        let mut h = one_bound_claim("held").await;
        let go = Arc::new(tokio::sync::Notify::new());
        let points = Arc::new(HookPoints::default());
        *points.hold_attach_result.lock().unwrap() = Some(("held".into(), go.clone()));
        let cluster = h.cluster().await;
        let metrics = Metrics::new(&h.registry);
        let config = Config {
            resync: Duration::from_secs(3600),
            hooks: Hooks::new(points),
            ..Config::default()
        };
        h.run(run(cluster, metrics.clone(), config));
        let pods = schedule_pod_and_await_attachment(&h, "held").await;
        // Gone at once (no kubelet here to finish a graceful deletion).
        let passes = metrics.reconciles.get();
        pods.delete("p", &kube::api::DeleteParams::default().grace_period(0))
            .await
            .unwrap();
        // The pod's going is folded into a pass, which must leave the attaching entry alone.
        eventually(WAIT, || async {
            (metrics.reconciles.get() > passes)
                .then_some(())
                .ok_or_else(|| "no pass after the pod went".to_string())
        })
        .await;
        assert_eq!(
            attachments_of(&h, "held").await.unwrap(),
            1,
            "detached while attaching"
        );
        go.notify_one();
        eventually(WAIT, || async {
            (attachments_of(&h, "held").await? == 0)
                .then_some(())
                .ok_or_else(|| "the unwanted attachment is still there".to_string())
        })
        .await;
    }

    /// A write task that panics reports its attach as failed on the way down, so the volume is
    /// retried (with backoff) and attached, instead of staying "in flight" for good.
    #[tokio::test]
    async fn a_panicked_attach_task_is_retried_and_the_volume_attached() {
        let mut h = one_bound_claim("boom").await;
        let points = Arc::new(HookPoints::default());
        *points.panic_on_attach.lock().unwrap() = Some("boom".into());

        let cluster = h.cluster().await;
        let metrics = Metrics::new(&h.registry);
        let config = Config {
            hooks: Hooks::new(points.clone()),
            ..Config::default()
        };
        h.run(run(cluster, metrics, config));
        schedule_pod_and_await_attachment(&h, "boom").await;
        assert!(
            points.panic_on_attach.lock().unwrap().is_none(),
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

    /// What this controller does not manage is never detached, on either side: a
    /// VolumeAttachment whose volume's source does not translate (a host path here) and another
    /// plugin's entry in the node's `status.volumesAttached` stay as they are, while an
    /// attachment it manages and no pod wants, on the same node, goes.
    #[tokio::test]
    async fn what_this_controller_does_not_manage_is_never_detached() {
        const FOREIGN_ENTRY: &str = "kubernetes.io/some-old-plugin/disk-1";
        let mut h = one_bound_claim("mine").await;
        let mut foreign = pv("foreign").build();
        let spec = foreign.spec.as_mut().unwrap();
        spec.csi = None;
        spec.host_path = Some(k8s_openapi::api::core::v1::HostPathVolumeSource {
            path: "/srv/foreign".into(),
            type_: None,
        });
        h.create_pv(foreign).await;
        let vas: Api<VolumeAttachment> = Api::all(h.client.clone());
        for (name, attacher, volume) in [
            ("va-foreign", "other.example.com", "foreign"),
            ("va-mine", "hooks.test.stowage.dev", "mine"),
        ] {
            let va: VolumeAttachment = serde_json::from_value(serde_json::json!({
                "apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttachment",
                "metadata": {"name": name},
                "spec": {"attacher": attacher, "nodeName": "n1",
                         "source": {"persistentVolumeName": volume}},
            }))
            .unwrap();
            vas.create(&PostParams::default(), &va).await.unwrap();
        }
        let listed = serde_json::json!({"status": {"volumesAttached": [
            {"name": FOREIGN_ENTRY, "devicePath": "/dev/old"}]}});
        Api::<Node>::all(h.client.clone())
            .patch_status("n1", &PatchParams::default(), &Patch::Merge(&listed))
            .await
            .unwrap();

        let cluster = h.cluster().await;
        let metrics = Metrics::new(&h.registry);
        h.run(run(cluster, metrics, Config::default()));
        // The managed attachment no pod wants is detached: passes over this node have run.
        eventually(WAIT, || async {
            (attachments_of(&h, "mine").await? == 0)
                .then_some(())
                .ok_or_else(|| "the unwanted managed attachment is still there".to_string())
        })
        .await;
        let kept = vas.get("va-foreign").await.unwrap();
        assert!(
            kept.metadata.deletion_timestamp.is_none(),
            "the foreign attachment is being deleted"
        );
        let node = Api::<Node>::all(h.client.clone()).get("n1").await.unwrap();
        let listed: Vec<String> = node
            .status
            .and_then(|s| s.volumes_attached)
            .unwrap_or_default()
            .into_iter()
            .map(|v| v.name)
            .collect();
        assert_eq!(
            listed,
            vec![FOREIGN_ENTRY.to_string()],
            "the foreign entry stays listed"
        );
    }
}

//! `Executor`: each decision of a pass becomes an API write run by a task of its own; attaches
//! and detaches draw from separate budgets so a burst of one never starves the other. Every task
//! reports an `Outcome` through `Owed`, also when it panics. (A little over 600 lines: the writes
//! and the live-Node check before a detach, with its unit tests, belong together.)
//!
//! Why two semaphores and a JoinSet, not `stowage_common::runtime::queue` + `inflight::Window` (decided in
//! issue 17): the window runs one task per key, with keys waiting undecided in the queue; this
//! controller decides all (volume, node) pairs in one pass, and one task carries a node's status
//! patch and then that node's detaches (several keys), in that order, which the rule "never
//! detach while the node advertises the volume" needs. What the window gives is kept here: one
//! operation per (volume, node) is `VolumeAttachment::op`, set before the task starts and cleared only
//! by its `Outcome`; a panicking task still reports (`Owed`, test
//! `a_panicked_attach_task_is_retried_and_the_volume_attached`); dropping the controller aborts
//! the tasks. A window of N keys would also make a burst beyond N wait for a later decision
//! rather than for a slot, which the attach throughput in docs/benchmarks.md was not measured
//! with.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use k8s_openapi::api::core::v1::{Node, PersistentVolume};
use kube::api::{ObjectMeta, Patch, PatchParams};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};
use stowage_common::api::attachments::Attachments;
use stowage_common::observe::events::Events;
use stowage_common::store::{VolumeAttachment, VolumeAttachmentSource, VolumeAttachmentSpec};
use tokio::sync::{Semaphore, mpsc};

use crate::actual::Op;
use crate::controller::Controller;
use crate::core::{Action, ForceReason, Kind};
use crate::error::Error;
use crate::metrics::{Metrics, Snapshot};
use crate::read::{is_loop, pv_finalizer_change};
use crate::results::Outcome;

/// A write task's debt: the `Outcome`s it owes its loop (`stowage_common::runtime::owed`).
type Owed = stowage_common::runtime::owed::Owed<Outcome>;

/// A test seam of the attach task (`controller.rs` live tests): empty in production, where each
/// point costs one `Option` check. Only this crate can fill it.
#[derive(Clone, Default)]
pub struct Hooks(Option<Arc<HookPoints>>);

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Hooks(set)"
        } else {
            "Hooks(none)"
        })
    }
}

#[derive(Default)]
pub(crate) struct HookPoints {
    /// The attach task of this PV panics once.
    pub(crate) panic_on_attach: std::sync::Mutex<Option<String>>,
    /// The attach task of this PV holds its result back until notified.
    pub(crate) hold_attach_result: std::sync::Mutex<Option<(String, Arc<tokio::sync::Notify>)>>,
}

impl Hooks {
    #[cfg(test)]
    pub(crate) fn new(points: Arc<HookPoints>) -> Self {
        Self(Some(points))
    }

    /// Panics if asked to for this attachment's PV (once).
    fn before_attach(&self, pv: Option<&str>) {
        let Some(h) = &self.0 else { return };
        let mut hook = h.panic_on_attach.lock().unwrap_or_else(|p| p.into_inner());
        if hook.is_some() && hook.as_deref() == pv {
            *hook = None;
            drop(hook);
            panic!("test hook: attach task panics");
        }
    }

    /// Waits, if asked to for this attachment's PV, before the result is reported.
    async fn before_attach_result(&self, pv: Option<&str>) {
        let Some(h) = &self.0 else { return };
        let held = h
            .hold_attach_result
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take_if(|(name, _)| Some(name.as_str()) == pv);
        if let Some((_, go)) = held {
            go.notified().await;
        }
    }
}

/// Everything a write task needs. Shared behind one `Arc` (`Controller::executor`): kube's `Api`
/// carries its resource's names and path as owned strings, so a copy per task allocated a dozen
/// times for each API handle.
pub(crate) struct Executor {
    /// Their answers come back as the informer decodes them (no managed fields).
    pub(crate) vas: Attachments,
    pub(crate) pvs: Api<PersistentVolume>,
    pub(crate) nodes: Api<Node>,
    pub(crate) events: Events,
    pub(crate) metrics: Metrics,
    pub(crate) done: mpsc::UnboundedSender<Outcome>,
    pub(crate) attach_slots: Arc<Semaphore>,
    pub(crate) detach_slots: Arc<Semaphore>,
    pub(crate) hooks: Hooks,
}

impl Controller {
    pub(crate) fn apply(&mut self, actions: Vec<Action>, now: Instant) {
        let mut detaches: BTreeMap<String, Vec<DetachJob>> = BTreeMap::new();
        let mut statuses: BTreeMap<String, StatusPatch> = BTreeMap::new();
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
                Action::WaitForUnmount { waited, .. } => self.waiting_since.push(now - waited),
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
                Action::UpdateNodeStatus { node, volumes, guard } => {
                    statuses.insert(node, StatusPatch { volumes, guard });
                }
                Action::Attach {
                    volume,
                    node,
                    va_name,
                    pv_name,
                    driver,
                    kind,
                } => self.start_attach(volume, node, va_name, pv_name, driver, kind, now),
                Action::ReleaseAttachment {
                    volume,
                    node,
                    va_name,
                    resource_version,
                } => self.start_release(volume, node, va_name, resource_version),
                Action::MultiAttachError { volume, node, notes } => {
                    self.desired.mark_multi_attach_reported(&volume, &node);
                    self.executor.metrics.multi_attach_errors.inc();
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
    }

    /// The scrape-time gauges (volumes per state and driver, detaches waiting): counted by full
    /// passes only, which see every entry anyway.
    pub(crate) fn update_inventory(&mut self) {
        let mut by_driver: BTreeMap<(&'static str, &str), i64> = BTreeMap::new();
        for (_, d) in self.desired.iter() {
            *by_driver
                .entry(("desired_state_of_world", d.spec.driver.as_str()))
                .or_default() += 1;
        }
        for (_, a) in self.actual.iter().filter(|(_, a)| a.exists()) {
            *by_driver
                .entry(("actual_state_of_world", a.driver.as_str()))
                .or_default() += 1;
        }
        let volumes = by_driver
            .into_iter()
            .map(|((state, driver), n)| ((state, driver.to_string()), n))
            .collect();
        self.executor.metrics.set_snapshot(Snapshot {
            volumes,
            waiting_since: std::mem::take(&mut self.waiting_since),
        });
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start_attach(
        &mut self,
        volume: String,
        node: String,
        va_name: String,
        pv_name: String,
        driver: String,
        kind: Kind,
        now: Instant,
    ) {
        let Some(handle) = self.desired.get(&volume, &node).map(|d| d.spec.handle.clone()) else {
            return;
        };
        if let Some(t) = self.wanted_since.remove(&(volume.clone(), node.clone())) {
            self.executor
                .metrics
                .attach_decision_seconds
                .observe(t.elapsed().as_secs_f64());
        }
        let e = self.actual.entry(&volume, &node, &driver, &handle);
        let inline = match kind {
            Kind::Csi => None,
            Kind::Inline(spec) => Some(Box::new(spec.0.clone())),
            // iSCSI/FC: their plugins' attach does nothing and reports no device path, so the
            // volume is attached now; the next pass lists it in node status, and the pods hear
            // of it as upstream tells them.
            Kind::InTree => {
                e.reported = Some(String::new());
                e.succeeded();
                self.executor
                    .metrics
                    .operations
                    .with_label_values(&["attach", "success"])
                    .inc();
                self.pod_events(&volume, &node, false, "SuccessfulAttachVolume", |pv| {
                    crate::read::attach_succeeded_note(pv)
                });
                self.touch();
                return;
            }
        };
        e.op = Some(Op::Attach);
        e.attach_started.get_or_insert(now);
        let w = self.executor.clone();
        w.metrics.queue_depth.with_label_values(&["attach"]).inc();
        let va = VolumeAttachment {
            metadata: ObjectMeta {
                name: Some(va_name.clone()),
                ..Default::default()
            },
            spec: VolumeAttachmentSpec {
                attacher: driver,
                node_name: node.clone(),
                // An inline volume's attachment carries its translated spec instead of a PV.
                source: VolumeAttachmentSource {
                    persistent_volume_name: inline.is_none().then_some(pv_name),
                    inline_volume_spec: inline,
                },
            },
            status: None,
        };
        let owed = Owed::new(
            &w.done,
            vec![Outcome::Attach {
                volume: volume.clone(),
                node: node.clone(),
                va_name: va_name.clone(),
                result: Err(Error::Panic),
            }],
        );
        self.tasks.spawn(async move {
            let _guard = owed.guard();
            let _slot = w.attach_slots.clone().acquire_owned().await;
            let pv = va.spec.source.persistent_volume_name.clone();
            w.hooks.before_attach(pv.as_deref());
            let timer = w
                .metrics
                .operation_seconds
                .with_label_values(&["attach"])
                .start_timer();
            let result = w.vas.create(va).await.map_err(Error::Api);
            timer.observe_duration();
            w.hooks.before_attach_result(pv.as_deref()).await;
            owed.send(Outcome::Attach {
                volume,
                node,
                va_name,
                result,
            });
        });
    }

    /// Adds or removes the built-in attacher's finalizer on the PVs that changed (guarded by the
    /// resourceVersion read, so a PV that changed meanwhile is decided again).
    pub(crate) fn sync_pv_finalizers(&mut self) {
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
            let attached = self.pv_attachments.contains_key(&name);
            let Some(add) = pv
                .source()
                .and_then(|spec| pv_finalizer_change(pv.meta(), is_loop(&spec), attached))
            else {
                continue;
            };
            let mut fins: Vec<String> = pv
                .meta()
                .finalizers
                .iter()
                .flatten()
                .filter(|f| *f != stowage_common::vocab::annotations::LOOP_ATTACHER_FINALIZER)
                .cloned()
                .collect();
            if add {
                fins.push(stowage_common::vocab::annotations::LOOP_ATTACHER_FINALIZER.into());
            }
            let patch = serde_json::json!({
                "metadata": { "finalizers": fins, "resourceVersion": pv.meta().resource_version }
            });
            self.pv_patching.insert(name.clone());
            let w = self.executor.clone();
            let owed = Owed::new(
                &w.done,
                vec![Outcome::PvFinalizer {
                    pv: name.clone(),
                    result: Err(Error::Panic),
                }],
            );
            self.tasks.spawn(async move {
                let _guard = owed.guard();
                let result = w
                    .pvs
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map(|_| ())
                    .map_err(Error::Api);
                owed.send(Outcome::PvFinalizer { pv: name, result });
            });
        }
    }

    /// Drops the built-in attacher's finalizer from a dead node's VolumeAttachment (guarded by the
    /// resourceVersion decided on, so a finalizer list that changed meanwhile is decided again).
    pub(crate) fn start_release(
        &mut self,
        volume: String,
        node: String,
        va_name: String,
        rv: Option<String>,
    ) {
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
                    .filter(|f| !stowage_common::vocab::annotations::is_loop_attacher_finalizer(f))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        let w = self.executor.clone();
        let owed = Owed::new(
            &w.done,
            vec![Outcome::Release {
                volume: volume.clone(),
                node: node.clone(),
                result: Err(Error::Panic),
            }],
        );
        self.tasks.spawn(async move {
            let _guard = owed.guard();
            // The informer's word that the node is dead is not enough: one that came back (its
            // taint removed, or deleted and registered again) uses its volumes again.
            let live = w.nodes.get_opt(&node).await.map_err(|e| e.to_string());
            if let Err(e) = release_is_safe(&node, &live) {
                owed.send(Outcome::Release {
                    volume,
                    node,
                    result: Err(e),
                });
                return;
            }
            let patch = serde_json::json!({
                "metadata": { "finalizers": fins, "resourceVersion": rv }
            });
            let result = w.vas.merge_patch(&va_name, &patch).await.map_err(Error::Api);
            owed.send(Outcome::Release { volume, node, result });
        });
    }

    /// A node's status patch (if any) and then its detaches, in one task: a detach only starts
    /// once the node no longer advertises the volume as attached.
    pub(crate) fn start_node_writes(
        &mut self,
        node: String,
        patch: Option<StatusPatch>,
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
        let w = self.executor.clone();
        w.metrics
            .queue_depth
            .with_label_values(&["detach"])
            .add(jobs.len() as i64);
        let mut failures: Vec<Outcome> = jobs
            .iter()
            .map(|j| Outcome::Detach {
                volume: j.volume.clone(),
                node: node.clone(),
                forced: j.forced,
                result: Err(Error::Panic),
            })
            .collect();
        if patch.is_some() {
            failures.push(Outcome::Status {
                node: node.clone(),
                result: Err(Error::Panic),
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
                let result = patch_node_status(&w.nodes, &node, &volumes.volumes, volumes.guard.as_deref())
                    .await
                    .map(Box::new)
                    .map_err(Error::Api);
                timer.observe_duration();
                // A node that is gone advertises nothing any more.
                let blocked = match &result {
                    Err(e) if !e.is_not_found() => Some(e.to_string()),
                    Err(_) => {
                        fresh = Some(None);
                        None
                    }
                    Ok(n) => {
                        fresh = Some(Some(Node::clone(n)));
                        None
                    }
                };
                owed.send(Outcome::Status {
                    node: node.clone(),
                    result,
                });
                if let Some(msg) = blocked {
                    for j in jobs {
                        owed.send(Outcome::Detach {
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
                owed.send(Outcome::Detach {
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
                    // iSCSI/FC have no VolumeAttachment: their plugins' detach does nothing, so
                    // with the node status written and the live Node checked, it is done.
                    let result = if !crate::translate::is_csi_name(&j.volume) {
                        Ok(None)
                    } else {
                        match w.vas.delete(&j.va_name).await {
                            // The apiserver may answer with the object as it was when removed at
                            // once; only one still held by finalizers is still there.
                            Ok(answer) => Ok(answer.filter(|va| {
                                va.metadata.deletion_timestamp.is_some() && !va.finalizers().is_empty()
                            })),
                            Err(e) if stowage_common::errors::is_not_found(&e) => Ok(None),
                            Err(e) => Err(Error::Api(e)),
                        }
                    };
                    timer.observe_duration();
                    owed.send(Outcome::Detach {
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
}

/// Whether the live Node still allows releasing a dead node's attachment: it is gone, or it
/// still carries the out-of-service taint.
pub(crate) fn release_is_safe(node: &str, live: &Result<Option<Node>, String>) -> Result<(), Error> {
    match live {
        Err(e) => Err(Error::NodeUnreadable {
            node: node.to_string(),
            error: e.clone(),
        }),
        Ok(None) => Ok(()),
        Ok(Some(n)) => {
            let out_of_service = n
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .is_some_and(|t| t.iter().any(|t| t.key == crate::read::TAINT_OUT_OF_SERVICE));
            if out_of_service {
                Ok(())
            } else {
                Err(Error::NodeBack(node.to_string()))
            }
        }
    }
}

pub(crate) struct DetachJob {
    pub(crate) volume: String,
    pub(crate) va_name: String,
    pub(crate) forced: Option<ForceReason>,
    pub(crate) waited: Duration,
}

/// Replaces `status.volumesAttached` (a merge patch replaces the whole list, which this
/// controller owns).
/// Splits detach jobs into those safe by the live Node (`Ok(None)`: the Node is gone) and those
/// refused: a non-forced job whose volume the node lists in `status.volumesInUse`, or every
/// non-forced job when the Node could not be read.
pub(crate) fn split_unsafe_detaches(
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

/// A node's new `status.volumesAttached`, and the resourceVersion it must still have when the
/// list carries entries of other plugins (they were read there; a newer one may have more).
#[derive(Debug, Clone)]
pub(crate) struct StatusPatch {
    pub(crate) volumes: Vec<(String, String)>,
    pub(crate) guard: Option<String>,
}

pub(crate) async fn patch_node_status(
    api: &Api<Node>,
    node: &str,
    volumes: &[(String, String)],
    guard: Option<&str>,
) -> Result<Node, kube::Error> {
    let list: Vec<serde_json::Value> = volumes
        .iter()
        .map(|(name, path)| serde_json::json!({ "name": name, "devicePath": path }))
        .collect();
    let mut patch = serde_json::json!({ "status": { "volumesAttached": list } });
    if let Some(rv) = guard {
        patch["metadata"] = serde_json::json!({ "resourceVersion": rv });
    }
    api.patch_status(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await
}

#[cfg(test)]
mod live_check_tests {
    use super::*;
    use k8s_openapi::api::core::v1::NodeStatus;
    use stowage_common::errors::MetricLabel;

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
    fn a_dead_nodes_attachment_is_released_only_while_the_live_node_is_gone_or_out_of_service() {
        use k8s_openapi::api::core::v1::{NodeSpec, Taint};
        let tainted = Node {
            spec: Some(NodeSpec {
                taints: Some(vec![Taint {
                    key: crate::read::TAINT_OUT_OF_SERVICE.into(),
                    effect: "NoExecute".into(),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert!(release_is_safe("n1", &Ok(None)).is_ok(), "gone");
        assert!(
            release_is_safe("n1", &Ok(Some(tainted))).is_ok(),
            "out of service"
        );
        // Back in service since the informer's copy (the soak's seed 31 caught this race): the
        // node's own agent detaches.
        let back = release_is_safe("n1", &Ok(Some(Node::default()))).unwrap_err();
        assert!(matches!(&back, Error::NodeBack(n) if n == "n1"));
        assert_eq!(back.metric_label(), "node_back");
        let unreadable = release_is_safe("n1", &Err("timeout".into())).unwrap_err();
        assert_eq!(unreadable.metric_label(), "node_unreadable");
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
        assert_eq!(refused[0].1.metric_label(), "volume_in_use");
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
        assert_eq!(refused[0].1.metric_label(), "node_unreadable");
    }
}

//! Starting the writes a pass or an attach step decided: each action becomes a write task on
//! the executor's budgets, with the state marked as under way (`Parts`), and the results come
//! back through `results`.

use std::collections::BTreeMap;

use tokio::time::Instant;

use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::{ObjectMeta, Patch, PatchParams};
use kube::runtime::reflector::ObjectRef;
use stowage_common::store::{VolumeAttachment, VolumeAttachmentSource, VolumeAttachmentSpec};

use crate::actual::Op;
use crate::core::{Action, Kind};
use crate::error::Error;
use crate::exec::*;
use crate::metrics::Snapshot;
use crate::read::{is_loop, pv_finalizer_change};
use crate::state::Parts;

impl Parts<'_> {
    pub(crate) fn apply(&mut self, actions: Vec<Action>, now: Instant) {
        let mut detaches: BTreeMap<String, Vec<DetachJob>> = BTreeMap::new();
        let mut statuses: BTreeMap<String, StatusPatch> = BTreeMap::new();
        for a in actions {
            match a {
                Action::MarkDetachRequested { volume, node } => {
                    if let Some(e) = self.st.actual.get_mut(&volume, &node) {
                        e.detach_requested = Some(now);
                    }
                }
                Action::CancelDetachRequest { volume, node } => {
                    if let Some(e) = self.st.actual.get_mut(&volume, &node) {
                        e.detach_requested = None;
                    }
                }
                Action::WaitForUnmount { waited, .. } => self.st.waiting_since.push(now - waited),
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
                    self.st.desired.mark_multi_attach_reported(&volume, &node);
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
            if self.st.status_in_flight.contains(&node)
                || self.st.status_retry.get(&node).is_some_and(|t| *t > now)
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
        for (_, d) in self.st.desired.iter() {
            *by_driver
                .entry(("desired_state_of_world", d.spec.driver.as_str()))
                .or_default() += 1;
        }
        for (_, a) in self.st.actual.iter().filter(|(_, a)| a.exists()) {
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
            waiting_since: std::mem::take(&mut self.st.waiting_since),
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
        let Some(handle) = self.st.desired.get(&volume, &node).map(|d| d.spec.handle.clone()) else {
            return;
        };
        if let Some(t) = self.st.wanted_since.remove(&(volume.clone(), node.clone())) {
            self.executor
                .metrics
                .attach_decision_seconds
                .observe(t.elapsed().as_secs_f64());
        }
        let e = self.st.actual.entry(&volume, &node, &driver, &handle);
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
                self.st.touch();
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
            .st
            .pv_dirty
            .iter()
            .filter(|n| !self.st.pv_patching.contains(*n))
            .cloned()
            .collect();
        for name in names {
            self.st.pv_dirty.remove(&name);
            let Some(pv) = self.cluster.pvs.store().get(&ObjectRef::new(&name)) else {
                continue;
            };
            let attached = self.st.pv_attachments.contains_key(&name);
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
            self.st.pv_patching.insert(name.clone());
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
        let Some(e) = self.st.actual.get_mut(&volume, &node) else {
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
            if let Some(e) = self.st.actual.get_mut(&j.volume, &node) {
                e.op = Some(Op::Detach);
                e.detach_started = Some(now);
            }
        }
        let patch = patch.filter(|_| self.st.nodes.get(&node).is_some_and(|n| !n.deleted));
        if patch.is_some() {
            self.st.status_in_flight.insert(node.clone());
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

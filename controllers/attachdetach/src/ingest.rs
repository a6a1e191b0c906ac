//! Store and watch events into the controller's own state: nodes, pods (resolved to the
//! desired state), VolumeAttachments (the actual state) and the PV finalizer index.

use std::collections::HashSet;
use std::sync::Arc;
use tokio::time::Instant;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::storage::v1::CSIDriver;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use stowage_common::observe::events::{Occurrence, Repeat, Subject};
use stowage_common::observe::storageops::{VOLUME_ATTACH, VOLUME_DETACH};
use stowage_common::store::StoredPod;
use stowage_common::store::VolumeAttachment;
use stowage_common::store::informer::is_newer;
use stowage_common::store::informers::Informers;
use stowage_common::store::{StoredClaim, StoredVolume};

use crate::actual::Actual;
use crate::core::pass_unaffected;
use crate::desired::{Kind, Lookup, PodRef, driver_attachable, kept_note, resolve_pod};
use crate::metrics::observe_attempt;
use crate::read::{
    NodeInfo, VaState, is_loop, pod_claims, pod_is_active, pv_finalizer_change, unique_volume_name,
};
use crate::state::{Parts, PodKey, PodSeen};
use crate::translate::{is_csi_name, is_managed_name, managed, pv_target};

/// Resolves pod volumes through the shared stores.
pub(crate) struct Stores<'a>(&'a Informers);

impl Lookup for Stores<'_> {
    fn claim(&self, namespace: &str, name: &str) -> Option<Arc<StoredClaim>> {
        self.0.pvcs.store().get(&ObjectRef::new(name).within(namespace))
    }
    fn volume(&self, name: &str) -> Option<Arc<StoredVolume>> {
        self.0.pvs.store().get(&ObjectRef::new(name))
    }
    fn driver(&self, name: &str) -> Option<Arc<CSIDriver>> {
        self.0.csi_drivers.store().get(&ObjectRef::new(name))
    }
}

/// Reason of the Warning on a pod whose claims no longer resolve to volumes it keeps.
pub(crate) const REASON_VOLUME_KEPT: &str = "VolumeKeptAttached";

/// The events gate's subject of a pod's `VolumeKeptAttached` (said once per change of its note).
fn kept_subject(uid: &str) -> Subject {
    Subject::new("pod", uid).about("kept")
}

impl Parts<'_> {
    /// Initial state: nodes (and what their status says is attached, so a restart keeps it),
    /// then attachments, then pods.
    pub(crate) fn load(&mut self) {
        self.st.quiet = true;
        for node in self.cluster.nodes.store().state() {
            let info = NodeInfo::of(&node);
            let name = node.name_any();
            // CSI, iSCSI and FC entries become attachments; any other entry (a plugin this
            // controller does not have) is left to the node status as it is.
            for (volume, path) in &info.volumes_attached {
                if let Some((driver, handle)) = managed(volume) {
                    self.st.actual.entry(volume, &name, driver, handle).reported = Some(path.clone());
                }
            }
            self.st.nodes.insert(name, info);
        }
        for va in self.cluster.attachments.store().state() {
            self.va_applied(&va);
        }
        // PV finalizers left from before a restart are checked once.
        self.st
            .pv_dirty
            .extend(self.cluster.pvs.store().state().iter().map(|p| p.name_any()));
        self.all_pods_dirty();
        self.refresh_pods();
        self.st.quiet = false;
        self.st.dirty = true;
    }

    /// Reloads everything from the stores. `verify` also drops attachments known only from node
    /// status that have no VolumeAttachment (upstream's periodic verify, from the store: a CSI
    /// volume without one is not attached).
    pub(crate) fn resync(&mut self, verify: bool) {
        self.st.quiet = true;
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
            .st
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
        self.st.pv_attachments.clear();
        self.st
            .pv_dirty
            .extend(self.cluster.pvs.store().state().iter().map(|p| p.name_any()));
        for va in &vas {
            self.va_applied(va);
        }
        let now = Instant::now();
        for ((volume, _), a) in self.st.actual.iter_mut() {
            if a.va.as_ref().is_some_and(|v| !names.contains(&v.name)) {
                a.va = None;
            }
            // iSCSI/FC attachments have no VolumeAttachment to confirm them; their plugins
            // report every volume attached, as upstream's verify does.
            if verify && a.va.is_none() && a.op.is_none() && is_csi_name(volume) {
                a.reported = None;
            }
        }
        self.st.va_keys.retain(|name, _| names.contains(name));
        self.st.actual.tidy_all(now);
        self.all_pods_dirty();
        self.st.quiet = false;
        self.st.dirty = true;
    }

    pub(crate) fn all_pods_dirty(&mut self) {
        let keys = self
            .cluster
            .pods
            .store()
            .state()
            .iter()
            .map(|p| (p.namespace().unwrap_or_default(), p.name_any()))
            .collect::<Vec<_>>();
        self.st.dirty_pods.extend(keys);
        // Pods that vanished without an event (missed while a watch was down).
        self.st.dirty_pods.extend(self.st.pods.keys().cloned());
        self.st.touch();
    }

    /// A pod event: the pod is resolved again by the next attach step (`Controller::attach_step`),
    /// which starts a full pass only if the pod let go of a volume.
    pub(crate) fn pod_changed(&mut self, pod: &StoredPod) {
        let key = (pod.namespace().unwrap_or_default(), pod.name_any());
        self.st.pod_seen.entry(key.clone()).or_insert_with(Instant::now);
        self.st.dirty_pods.insert(key);
        self.st.backlog += 1;
    }

    pub(crate) fn claim_changed(&mut self, ns: &str, name: &str) {
        if let Some(pods) = self.st.claim_pods.get(&(ns.to_string(), name.to_string())) {
            let keys: Vec<PodKey> = pods.iter().map(|p| (ns.to_string(), p.clone())).collect();
            self.st.dirty_pods.extend(keys);
            self.st.touch();
        }
    }

    pub(crate) fn volume_changed(&mut self, pv: &StoredVolume) {
        let name = pv.meta().name.clone().unwrap_or_default();
        if let Some(spec) = pv.source() {
            if pv_finalizer_change(
                pv.meta(),
                is_loop(&spec),
                self.st.pv_attachments.contains_key(&name),
            )
            .is_some()
            {
                self.st.pv_dirty.insert(name.clone());
                self.st.touch();
            }
            if let Some(cr) = &spec.claim_ref
                && let (Some(ns), Some(claim)) = (cr.namespace.as_deref(), cr.name.as_deref())
            {
                self.claim_changed(ns, claim);
            }
        }
        // Attachments that arrived before their volume can be placed now.
        if let Some(waiting) = self.st.unresolved.remove(&name) {
            for name in waiting {
                if let Some(va) = self.cluster.attachments.store().get(&ObjectRef::new(&name)) {
                    self.va_applied(&va);
                }
            }
        }
    }

    pub(crate) fn node_applied(&mut self, node: &Node) {
        let name = node.name_any();
        let info = NodeInfo::of(node);
        let old = self.st.nodes.get(&name);
        // Older than the copy our own status patch returned.
        if old.is_some_and(|o| is_newer(o.resource_version.as_deref(), info.resource_version.as_deref())) {
            return;
        }
        let managed_changed = old.is_none_or(|o| o.managed != info.managed);
        if old != Some(&info) {
            self.st.nodes.insert(name.clone(), info);
            self.st.touch();
        }
        if managed_changed {
            self.pods_on_node_dirty(&name);
        }
    }

    /// A deleted Node stays known, as it was last seen but not Ready (upstream keeps it in the
    /// desired state while it has volumes, and its last `volumesInUse`): its volumes are
    /// force-detached only after --max-wait-for-unmount or with the out-of-service taint. It is
    /// forgotten once nothing is attached to it and no pod wants anything there.
    pub(crate) fn node_deleted(&mut self, name: &str) {
        self.st.status_retry.remove(name);
        let Some(info) = self.st.nodes.remove(name) else {
            return;
        };
        if !info.deleted {
            self.pods_on_node_dirty(name);
            self.st.touch();
        }
        self.st.nodes.insert(name.to_string(), info.gone());
    }

    /// Drops deleted nodes that nothing refers to any more.
    pub(crate) fn forget_gone_nodes(&mut self) {
        if !self.st.nodes.values().any(|n| n.deleted) {
            return;
        }
        let mut used: HashSet<&str> = self.st.actual.iter().map(|((_, n), _)| n.as_str()).collect();
        used.extend(self.st.desired.iter().map(|(n, _)| n.as_str()));
        self.st
            .nodes
            .retain(|name, n| !n.deleted || used.contains(name.as_str()));
    }

    pub(crate) fn pods_on_node_dirty(&mut self, node: &str) {
        let keys: Vec<PodKey> = self
            .st
            .pods
            .iter()
            .filter(|(_, p)| p.node == node)
            .map(|(k, _)| k.clone())
            .collect();
        if !keys.is_empty() {
            self.st.dirty_pods.extend(keys);
            self.st.touch();
        }
    }

    pub(crate) fn refresh_pods(&mut self) {
        let keys: Vec<PodKey> = self.st.dirty_pods.drain().collect();
        for key in keys {
            self.refresh_pod(key);
        }
    }

    /// Re-resolves one pod's contribution to the desired state.
    pub(crate) fn refresh_pod(&mut self, key: PodKey) {
        let pod = self
            .cluster
            .pods
            .store()
            .get(&ObjectRef::new(&key.1).within(&key.0))
            .filter(|p| pod_is_active(p));
        if let Some(old) = self.st.pods.remove(&key) {
            for c in &old.claims {
                let ck = (key.0.clone(), c.clone());
                if let Some(set) = self.st.claim_pods.get_mut(&ck) {
                    set.remove(&key.1);
                    if set.is_empty() {
                        self.st.claim_pods.remove(&ck);
                    }
                }
            }
            if pod.as_ref().and_then(|p| p.uid()).as_deref() != Some(old.uid.as_str()) {
                if self.st.desired.remove_pod(&old.uid) {
                    self.st.touch();
                }
                self.executor.events.forget(&kept_subject(&old.uid));
            }
        }
        let seen = self.st.pod_seen.remove(&key);
        let Some(pod) = pod else { return };
        let uid = pod.uid().unwrap_or_default();
        let node = pod.node_name().unwrap_or_default().to_string();
        let claims = pod_claims(&pod);
        for c in &claims {
            self.st
                .claim_pods
                .entry((key.0.clone(), c.clone()))
                .or_default()
                .insert(key.1.clone());
        }
        // A deleted node's pods stay desired until they go (pod GC): their volumes may still be
        // mounted there.
        if self.st.nodes.get(&node).is_some_and(|n| n.managed) {
            let stores = Stores(self.cluster);
            let resolved = resolve_pod(&pod, &stores);
            let volumes = resolved.attachable;
            if !resolved.unresolved.is_empty() {
                tracing::debug!(pod = %format!("{}/{}", key.0, key.1), unresolved = ?resolved.unresolved, "claims resolve to no volume yet");
            }
            for v in &volumes {
                // Only an attach still to start has a decision latency: a pod update of a running
                // pod must not leave a stale start for a later re-attach of its volume.
                if let Some(t) = seen.filter(|_| awaits_attach(&self.st.actual, &v.name, &node)) {
                    self.st
                        .wanted_since
                        .entry((v.name.clone(), node.clone()))
                        .or_insert(t);
                }
                self.st.attach_dirty.insert(v.name.clone());
            }
            // While the pod lives, what it already wanted stays even if its claim no longer
            // resolves; only a driver that stopped needing attachment lets it go (upstream).
            let still_attachable =
                |v: &crate::desired::VolumeSpec| driver_attachable(stores.driver(&v.driver).as_deref());
            let update = self
                .st
                .desired
                .update_pod(PodRef::of(&pod), &node, volumes, still_attachable);
            // Only a volume let go of can lead to a detach, which needs the full pass.
            if update.released {
                self.st.touch();
            }
            if update.kept.is_empty() {
                // Resolved again: a later loss is news at once.
                self.executor.events.forget(&kept_subject(&uid));
            } else {
                let note = kept_note(&node, &update.kept, &resolved.unresolved);
                let on = PodRef::of(&pod).reference();
                let e = Occurrence {
                    warning: true,
                    reason: REASON_VOLUME_KEPT,
                    action: "Attach",
                    note: note.clone(),
                };
                if self
                    .executor
                    .events
                    .report(&kept_subject(&uid), Repeat::OnChange, &on, e)
                {
                    tracing::warn!(pod = %format!("{}/{}", key.0, key.1), %note, "volumes kept for a running pod whose claims no longer resolve");
                }
            }
        } else if self.st.desired.remove_pod(&uid) {
            self.st.touch();
        }
        self.st.pods.insert(key, PodSeen { uid, node, claims });
    }

    /// (volume, node, driver, handle) of an attachment, through its PV (translated when it is a
    /// migrated in-tree volume) or its inline spec.
    pub(crate) fn resolve_va(
        &mut self,
        va: &VolumeAttachment,
        remember: bool,
    ) -> Option<(String, String, String, String)> {
        if let Some(spec) = va.spec.source.inline_volume_spec.as_deref() {
            let csi = spec.csi.as_ref()?;
            let volume = unique_volume_name(&csi.driver, &csi.volume_handle);
            return is_managed_name(&volume).then(|| {
                (
                    volume,
                    va.spec.node_name.clone(),
                    csi.driver.clone(),
                    csi.volume_handle.clone(),
                )
            });
        }
        let pv_name = va.spec.source.persistent_volume_name.as_deref()?;
        let pv = self
            .cluster
            .pvs
            .store()
            .get(&ObjectRef::new(pv_name))
            .and_then(|p| p.source());
        let target = pv.and_then(|p| pv_target(pv_name, &p).ok().flatten());
        let Some(csi) = target.filter(|t| !matches!(t.kind, Kind::InTree)) else {
            // Left alone until its volume shows up, as upstream skips it.
            if remember {
                self.st
                    .unresolved
                    .entry(pv_name.to_string())
                    .or_default()
                    .insert(va.name_any());
            }
            return None;
        };
        let volume = unique_volume_name(&csi.driver, &csi.handle);
        is_managed_name(&volume).then(|| (volume, va.spec.node_name.clone(), csi.driver, csi.handle))
    }

    /// A VolumeAttachment seen (watch) or returned by a write. Marks a full pass due unless the
    /// change provably leaves that pass's decisions as they were (`pass_unaffected`); returns
    /// whether it did.
    pub(crate) fn va_applied(&mut self, va: &VolumeAttachment) -> bool {
        if let Some(pv) = va.spec.source.persistent_volume_name.as_deref() {
            self.st
                .pv_attachments
                .entry(pv.to_string())
                .or_default()
                .insert(va.name_any());
            self.st.pv_dirty.insert(pv.to_string());
        }
        let name = va.name_any();
        let Some((volume, node, driver, handle)) = self.resolve_va(va, true) else {
            return false;
        };
        let state = VaState::of(va);
        let e = self.st.actual.entry(&volume, &node, &driver, &handle);
        let before = e.clone();
        if let Some(old) = &e.va
            && old.name == state.name
            && is_newer(old.resource_version.as_deref(), state.resource_version.as_deref())
        {
            return false;
        }
        // The watch echoing what the create (or another write) already returned: nothing to
        // decide again.
        if e.va.as_ref() == Some(&state) && e.reported.is_none() {
            return false;
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
        // KCM's attach attempt ends failed when the attachment reports an error (the attach
        // itself goes on: the attacher keeps trying).
        let failed_attempt = e.attach_started.filter(|_| new_error.is_some());
        e.va = Some(state);
        // The attachment object is the truth from now on.
        e.reported = None;
        self.st.va_keys.insert(name, (volume.clone(), node.clone()));
        if let Some(t) = started {
            self.executor
                .metrics
                .attach_seconds
                .observe(t.elapsed().as_secs_f64());
            observe_attempt(&driver, VOLUME_ATTACH, true, t);
        }
        if let Some(t) = failed_attempt {
            observe_attempt(&driver, VOLUME_ATTACH, false, t);
        }
        if !self.st.quiet {
            if newly_attached {
                self.pod_events(&volume, &node, false, "SuccessfulAttachVolume", |pv| {
                    crate::read::attach_succeeded_note(pv)
                });
            }
            if let Some(msg) = new_error {
                self.pod_events(&volume, &node, true, "FailedAttachVolume", |pv| {
                    format!("Attaching volume \"{pv}\" failed: {msg}")
                });
            }
        }
        let wanted = self.st.desired.get(&volume, &node).is_some();
        let unaffected = self
            .st
            .actual
            .get(&volume, &node)
            .is_some_and(|after| pass_unaffected(&before, after, wanted));
        let pv = va
            .spec
            .source
            .persistent_volume_name
            .as_deref()
            .unwrap_or_default();
        if unaffected && self.pv_settled(pv, &driver) {
            self.st.backlog += 1;
            return false;
        }
        self.st.touch();
        true
    }

    /// Whether the PV's attacher finalizer is already as it should be (nothing for the next
    /// pass to patch): then it leaves the set the pass checks. `driver`: the PV's CSI driver, as
    /// the attachment was just resolved through it, so only the PV's metadata is read here.
    fn pv_settled(&mut self, name: &str, driver: &str) -> bool {
        if self.st.pv_patching.contains(name) {
            return false;
        }
        let attached = self.st.pv_attachments.contains_key(name);
        let is_loop = driver == crate::read::LOOP_DRIVER;
        let settled = self
            .cluster
            .pvs
            .store()
            .get(&ObjectRef::new(name))
            .is_some_and(|pv| pv_finalizer_change(pv.meta(), is_loop, attached).is_none());
        if settled {
            self.st.pv_dirty.remove(name);
        }
        settled
    }

    pub(crate) fn va_deleted(&mut self, va: &VolumeAttachment) {
        let name = va.name_any();
        if let Some(pv) = va.spec.source.persistent_volume_name.as_deref() {
            if let Some(set) = self.st.pv_attachments.get_mut(pv) {
                set.remove(&name);
                if set.is_empty() {
                    self.st.pv_attachments.remove(pv);
                }
            }
            self.st.pv_dirty.insert(pv.to_string());
            self.st.touch();
        }
        if let Some(pv) = va.spec.source.persistent_volume_name.as_deref()
            && let Some(set) = self.st.unresolved.get_mut(pv)
        {
            set.remove(&name);
            if set.is_empty() {
                self.st.unresolved.remove(pv);
            }
        }
        let key = match self.st.va_keys.remove(&name) {
            Some(k) => Some(k),
            None => self.resolve_va(va, false).map(|(v, n, _, _)| (v, n)),
        };
        let Some((volume, node)) = key else { return };
        let Some(e) = self.st.actual.get_mut(&volume, &node) else {
            return;
        };
        if e.va.as_ref().is_some_and(|v| v.name != name) {
            return;
        }
        e.va = None;
        e.reported = None;
        e.detach_requested = None;
        if let Some(t) = e.detach_started.take() {
            self.executor
                .metrics
                .detach_seconds
                .observe(t.elapsed().as_secs_f64());
            observe_attempt(&e.driver, VOLUME_DETACH, true, t);
        }
        self.st.actual.tidy(&volume, &node, Instant::now());
        self.st.touch();
    }
}

/// Whether (volume, node) has no VolumeAttachment and no operation yet: an attach is still to
/// start, so its decision latency is open.
pub(crate) fn awaits_attach(actual: &Actual, volume: &str, node: &str) -> bool {
    actual
        .get(volume, node)
        .is_none_or(|a| a.va.is_none() && a.op.is_none())
}

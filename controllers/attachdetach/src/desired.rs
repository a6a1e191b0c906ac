//! Desired state of the world: which volume should be attached to which managed node, and for
//! which pods. No I/O: the executor feeds it pod by pod, resolving pod → claim → volume → driver
//! through a [`Lookup`].

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use k8s_openapi::api::storage::v1::CSIDriver;
use kube::ResourceExt;
use stowage_common::store::{StoredClaim, StoredPod, StoredVolume};

pub use crate::translate::Kind;
use crate::translate::{Target, inline_target, is_managed_name, pv_target};
use crate::vecmap::VecMap;

/// One attachable volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeSpec {
    /// Unique volume name (`kubernetes.io/csi/<driver>^<handle>`, or `<plugin>/<name>` for
    /// iSCSI and FC).
    pub name: String,
    /// The PV; for an inline volume, the name of its translated PV (or the pod volume's name
    /// for inline iSCSI/FC), which upstream's events show.
    pub pv_name: String,
    /// CSI driver (translated for migrated in-tree volumes), or the iSCSI/FC plugin.
    pub driver: String,
    pub handle: String,
    /// False for ReadWriteOnce / ReadWriteOncePod-only volumes.
    pub multi_attach: bool,
    /// How it is attached: a VolumeAttachment naming the PV, one with the inline spec, or only
    /// a mark in node status (iSCSI, FC).
    pub kind: Kind,
}

impl VolumeSpec {
    /// The desired entry of an attachable `target`.
    pub fn of(t: Target) -> Self {
        Self {
            name: t.unique_name(),
            pv_name: t.pv_name,
            driver: t.driver,
            handle: t.handle,
            multi_attach: t.multi_attach,
            kind: t.kind,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl PodRef {
    /// The pod as the object an event is about.
    pub fn reference(&self) -> k8s_openapi::api::core::v1::ObjectReference {
        stowage_common::observe::events::pod_reference(&self.namespace, &self.name, Some(&self.uid))
    }

    pub fn of(pod: &StoredPod) -> Self {
        Self {
            namespace: pod.namespace().unwrap_or_default(),
            name: pod.name_any(),
            uid: pod.uid().unwrap_or_default(),
        }
    }
}

/// A volume wanted on one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredVolume {
    pub spec: VolumeSpec,
    /// The pods on this node that use it, by UID (one, nearly always).
    pub pods: VecMap<PodRef>,
    /// The multi-attach event went out for this entry (once per entry, as upstream).
    pub multi_attach_reported: bool,
}

/// What [`Desired::update_pod`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Update {
    /// The pod let go of something it wanted before (only then can a detach follow).
    pub released: bool,
    /// Volumes the pod still wants although their claims no longer resolve to them.
    pub kept: Vec<VolumeSpec>,
}

#[derive(Debug, Clone, Default)]
pub struct Desired {
    /// node → unique volume name → entry; only managed nodes, only volumes with pods.
    nodes: BTreeMap<String, BTreeMap<String, DesiredVolume>>,
    /// pod UID → (node, volumes), to undo a pod's contribution.
    pods: HashMap<String, (String, Vec<String>)>,
    /// unique volume name → the nodes that want it, so one volume's entries are found without
    /// a scan (the attach pass of the volumes a pod event touched).
    by_volume: HashMap<String, VecMap<()>>,
}

impl Desired {
    /// Sets the volumes `pod` wants on `node`, replacing what it wanted before. Entries the pod
    /// keeps are kept as they are (with their multi-attach flag). Returns whether the pod let go
    /// of anything it wanted before (only then can a detach follow).
    pub fn set_pod(&mut self, pod: PodRef, node: &str, volumes: Vec<VolumeSpec>) -> bool {
        let names: Vec<String> = volumes.iter().map(|v| v.name.clone()).collect();
        let mut released = false;
        if let Some((old_node, old_names)) = self.pods.get(&pod.uid).cloned() {
            for n in old_names {
                if old_node != node || !names.contains(&n) {
                    self.unlink(&old_node, &n, &pod.uid);
                    released = true;
                }
            }
        }
        if volumes.is_empty() {
            self.pods.remove(&pod.uid);
            return released;
        }
        for spec in &volumes {
            self.by_volume
                .entry(spec.name.clone())
                .or_default()
                .insert(node.to_string(), ());
        }
        let entries = self.nodes.entry(node.to_string()).or_default();
        for spec in volumes {
            let e = entries.entry(spec.name.clone()).or_insert_with(|| DesiredVolume {
                spec: spec.clone(),
                pods: VecMap::default(),
                multi_attach_reported: false,
            });
            e.spec = spec;
            e.pods.insert(pod.uid.clone(), pod.clone());
        }
        self.pods.insert(pod.uid, (node.to_string(), names));
        released
    }

    /// Sets what an active `pod` wants on `node` (upstream's populator only adds while a pod
    /// lives): the volumes `resolved` now, plus every volume it already wanted there that no longer
    /// resolves, as long as `still_attachable` says its driver still needs attaching (upstream
    /// drops an entry only when its pod terminates or is deleted, or its volume stops being
    /// attachable). A claim that stops resolving (no longer Bound, its volume's claimRef UID
    /// changed, the volume gone) must not detach a volume a running pod has mounted. A pod moved
    /// to another node (a new UID in practice) lets go of everything on the old one.
    pub fn update_pod(
        &mut self,
        pod: PodRef,
        node: &str,
        resolved: Vec<VolumeSpec>,
        still_attachable: impl Fn(&VolumeSpec) -> bool,
    ) -> Update {
        let mut volumes = resolved;
        let mut kept = Vec::new();
        if let Some((old_node, old_names)) = self.pods.get(&pod.uid)
            && old_node == node
        {
            for n in old_names {
                if volumes.iter().any(|v| &v.name == n) {
                    continue;
                }
                if let Some(e) = self.get(n, node)
                    && still_attachable(&e.spec)
                {
                    kept.push(e.spec.clone());
                }
            }
        }
        volumes.extend(kept.iter().cloned());
        let released = self.set_pod(pod, node, volumes);
        Update { released, kept }
    }

    /// Forgets what the pod wanted; returns whether it wanted anything.
    pub fn remove_pod(&mut self, uid: &str) -> bool {
        let Some((node, names)) = self.pods.remove(uid) else {
            return false;
        };
        for n in &names {
            self.unlink(&node, n, uid);
        }
        !names.is_empty()
    }

    fn unlink(&mut self, node: &str, volume: &str, uid: &str) {
        let Some(entries) = self.nodes.get_mut(node) else {
            return;
        };
        if let Some(e) = entries.get_mut(volume) {
            e.pods.remove(uid);
            if e.pods.is_empty() {
                entries.remove(volume);
                if let Some(nodes) = self.by_volume.get_mut(volume) {
                    nodes.remove(node);
                    if nodes.is_empty() {
                        self.by_volume.remove(volume);
                    }
                }
            }
        }
        if entries.is_empty() {
            self.nodes.remove(node);
        }
    }

    pub fn has_pod(&self, uid: &str) -> bool {
        self.pods.contains_key(uid)
    }

    pub fn pod_uids(&self) -> impl Iterator<Item = &String> {
        self.pods.keys()
    }

    pub fn get(&self, volume: &str, node: &str) -> Option<&DesiredVolume> {
        self.nodes.get(node)?.get(volume)
    }

    pub fn mark_multi_attach_reported(&mut self, volume: &str, node: &str) {
        if let Some(e) = self.nodes.get_mut(node).and_then(|n| n.get_mut(volume)) {
            e.multi_attach_reported = true;
        }
    }

    /// Every (node, entry), ordered by node then volume.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &DesiredVolume)> {
        self.nodes
            .iter()
            .flat_map(|(n, vols)| vols.values().map(move |v| (n, v)))
    }

    /// Every (node, entry) that wants `volume`, ordered by node.
    pub fn wanting<'a>(&'a self, volume: &str) -> impl Iterator<Item = (&'a String, &'a DesiredVolume)> {
        self.by_volume
            .get(volume)
            .into_iter()
            .flat_map(VecMap::keys)
            .filter_map(move |n| self.nodes.get_key_value(n.as_str()))
            .filter_map(move |(n, vols)| vols.get(volume).map(|e| (n, e)))
    }

    /// The pods on `node` that use `volume`.
    pub fn pods_on<'a>(&'a self, volume: &str, node: &str) -> impl Iterator<Item = &'a PodRef> {
        self.nodes
            .get(node)
            .and_then(|vols| vols.get(volume))
            .into_iter()
            .flat_map(|e| e.pods.values())
    }

    pub fn len(&self) -> usize {
        self.nodes.values().map(BTreeMap::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
}

/// Read access to the objects a pod's volumes resolve through: volumes and claims as the
/// informers store them, read through the readers of the few fields resolving needs.
pub trait Lookup {
    fn claim(&self, namespace: &str, name: &str) -> Option<Arc<StoredClaim>>;
    fn volume(&self, name: &str) -> Option<Arc<StoredVolume>>;
    fn driver(&self, name: &str) -> Option<Arc<CSIDriver>>;
}

/// A driver needs attaching unless its CSIDriver object says otherwise; no object means yes.
pub fn driver_attachable(driver: Option<&CSIDriver>) -> bool {
    driver.is_none_or(|d| d.spec.attach_required.unwrap_or(true))
}

/// A claim of a pod that resolves to no volume now, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unresolved {
    pub claim: String,
    pub why: String,
}

/// A pod's volumes as its claims resolve now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodVolumes {
    /// Attachable volumes, in volume order, each once.
    pub attachable: Vec<VolumeSpec>,
    /// Claims that resolve to no volume (not found, not the pod's, not Bound, their volume
    /// missing or bound to another claim). Claims of volumes that need no attaching (non-CSI,
    /// or a CSIDriver with `attachRequired: false`) resolve fine and are in neither list.
    pub unresolved: Vec<Unresolved>,
}

/// The attachable volumes of `pod`. Claims not (yet) bound, volumes missing or pointing at
/// another claim, and non-CSI volumes are skipped: a later claim or volume event re-resolves.
pub fn pod_volumes(pod: &StoredPod, lookup: &impl Lookup) -> Vec<VolumeSpec> {
    resolve_pod(pod, lookup).attachable
}

/// [`pod_volumes`], with why each claim that resolves to no volume does not.
pub fn resolve_pod(pod: &StoredPod, lookup: &impl Lookup) -> PodVolumes {
    let ns = pod.namespace().unwrap_or_default();
    let mut out = PodVolumes::default();
    // persistentVolumeClaim volumes and generic ephemeral ones (`<pod>-<volume>`, only when the
    // pod controls that claim), as upstream's desired-state populator resolves them.
    for pc in stowage_common::store::pods::pod_claims(pod) {
        let resolved = match lookup.claim(&ns, &pc.claim) {
            None => Err("the claim does not exist".to_string()),
            Some(claim) if !pc.usable(pod, claim.meta()) => {
                Err("the claim is not this pod's ephemeral claim (another owner)".to_string())
            }
            Some(claim) => resolve_claim(&claim, lookup),
        };
        match resolved {
            Ok(Some(spec)) => {
                if !out.attachable.iter().any(|s| s.name == spec.name) {
                    out.attachable.push(spec);
                }
            }
            Ok(None) => {}
            Err(why) => out.unresolved.push(Unresolved {
                claim: pc.claim.clone(),
                why,
            }),
        }
    }
    // Inline volumes: migrated in-tree sources (translated to their CSI driver) and inline
    // iSCSI/FC, as upstream's populator creates their specs from the pod alone.
    for v in pod.volumes() {
        match inline_target(v, &ns) {
            Ok(Some(t)) if attachable(&t, lookup) => {
                if let Some(spec) = managed_spec(t)
                    && !out.attachable.iter().any(|s| s.name == spec.name)
                {
                    out.attachable.push(spec);
                }
            }
            Ok(_) => {}
            // Upstream skips such a volume (a debug log), and so does this.
            Err(e) => {
                tracing::debug!(pod = %pod.name_any(), volume = %v.name, error = %e, "inline volume does not translate")
            }
        }
    }
    out
}

/// Needs attaching: iSCSI/FC always, a CSI driver unless its CSIDriver says otherwise.
fn attachable(t: &Target, lookup: &impl Lookup) -> bool {
    matches!(t.kind, Kind::InTree) || driver_attachable(lookup.driver(&t.driver).as_deref())
}

/// The desired entry of an attachable target, if this controller manages its volume
/// (`translate::managed`, the rule its actual side applies too).
fn managed_spec(t: Target) -> Option<VolumeSpec> {
    Some(VolumeSpec::of(t)).filter(|s| is_managed_name(&s.name))
}

/// The claim's attachable volume, `Ok(None)` for a volume that needs no attaching, or why the
/// claim resolves to no volume.
fn resolve_claim(claim: &StoredClaim, lookup: &impl Lookup) -> Result<Option<VolumeSpec>, String> {
    // An error here is a bug (logged by the reader), and the claim then resolves nowhere until
    // its next event.
    let binding = claim
        .binding()
        .map_err(|e| format!("the stored claim does not read back: {e}"))?;
    let (pv_name, phase) = (binding.volume_name, binding.phase);
    if pv_name.is_empty() {
        return Err("the claim names no volume".into());
    }
    if phase.as_deref() != Some("Bound") {
        return Err(format!(
            "the claim is {}, not Bound",
            phase.as_deref().unwrap_or("without a phase")
        ));
    }
    let Some(pv) = lookup.volume(&pv_name) else {
        return Err(format!("its volume {pv_name} does not exist"));
    };
    let Some(pv) = pv.source() else {
        return Err(format!("its volume {pv_name} has no spec"));
    };
    let claim_ref_uid = pv.claim_ref.as_ref().and_then(|r| r.uid.as_deref());
    if claim_ref_uid != claim.meta().uid.as_deref() {
        return Err(format!(
            "its volume {pv_name} is bound to another claim (claimRef UID {})",
            claim_ref_uid.unwrap_or("none")
        ));
    }
    // A source that does not translate is skipped, as upstream skips it (logged).
    let target = match pv_target(&pv_name, &pv) {
        Ok(Some(t)) => t,
        Ok(None) => return Ok(None),
        Err(e) => {
            tracing::debug!(pv = %pv_name, error = %e, "volume source does not translate to CSI");
            return Ok(None);
        }
    };
    if !attachable(&target, lookup) {
        return Ok(None);
    }
    Ok(managed_spec(target))
}

/// The note of the event on a pod that keeps volumes its claims no longer resolve to: what is
/// kept, and why nothing could be resolved (bounded under the Event API's 1 KiB).
pub fn kept_note(node: &str, kept: &[VolumeSpec], unresolved: &[Unresolved]) -> String {
    let mut pvs: Vec<&str> = kept.iter().map(|v| v.pv_name.as_str()).collect();
    pvs.sort_unstable();
    let whys: Vec<String> = unresolved
        .iter()
        .map(|u| format!("claim {}: {}", u.claim, u.why))
        .collect();
    let note = format!(
        "volume(s) {} stay attached to node {node} while the pod runs, though its claims no longer resolve to them ({}); a volume leaves only when the pod terminates or is deleted",
        pvs.join(", "),
        whys.join("; ")
    );
    stowage_common::observe::events::bounded_note(note)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        CSIPersistentVolumeSource, ObjectReference, PersistentVolumeClaimSpec, PersistentVolumeClaimStatus,
        PersistentVolumeClaimVolumeSource, PersistentVolumeSpec, Pod as FullPod, PodSpec, Volume,
    };
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
    use k8s_openapi::api::storage::v1::CSIDriverSpec;
    use kube::api::ObjectMeta;
    use stowage_common::store::Stored;

    #[derive(Default)]
    struct Fake {
        claims: Vec<PersistentVolumeClaim>,
        pvs: Vec<PersistentVolume>,
        drivers: Vec<CSIDriver>,
    }

    impl Lookup for Fake {
        // Stored here, as the informers store them.
        fn claim(&self, ns: &str, name: &str) -> Option<Arc<StoredClaim>> {
            self.claims
                .iter()
                .find(|c| c.namespace().as_deref() == Some(ns) && c.name_any() == name)
                .cloned()
                .map(|c| Arc::new(Stored::new(c)))
        }
        fn volume(&self, name: &str) -> Option<Arc<StoredVolume>> {
            self.pvs
                .iter()
                .find(|p| p.name_any() == name)
                .cloned()
                .map(|p| Arc::new(Stored::new(p)))
        }
        fn driver(&self, name: &str) -> Option<Arc<CSIDriver>> {
            self.drivers
                .iter()
                .find(|d| d.name_any() == name)
                .cloned()
                .map(Arc::new)
        }
    }

    fn claim(name: &str, pv: &str, phase: &str) -> PersistentVolumeClaim {
        PersistentVolumeClaim {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                uid: Some(format!("uid-{name}")),
                ..Default::default()
            },
            spec: Some(PersistentVolumeClaimSpec {
                volume_name: Some(pv.into()),
                ..Default::default()
            }),
            status: Some(PersistentVolumeClaimStatus {
                phase: Some(phase.into()),
                ..Default::default()
            }),
        }
    }

    fn pv(name: &str, driver: &str, claim_uid: &str, modes: &[&str]) -> PersistentVolume {
        PersistentVolume {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            spec: Some(PersistentVolumeSpec {
                access_modes: Some(modes.iter().map(|m| m.to_string()).collect()),
                claim_ref: Some(ObjectReference {
                    uid: Some(claim_uid.into()),
                    ..Default::default()
                }),
                csi: Some(CSIPersistentVolumeSource {
                    driver: driver.into(),
                    volume_handle: format!("h-{name}"),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            status: None,
        }
    }

    fn pod(claims: &[&str]) -> StoredPod {
        StoredPod::from_pod(&full_pod(claims)).unwrap()
    }

    /// As the API has it; [`pod`]: as the informer stores it.
    fn full_pod(claims: &[&str]) -> FullPod {
        FullPod {
            metadata: ObjectMeta {
                name: Some("p".into()),
                namespace: Some("ns".into()),
                uid: Some("pod-uid".into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some("n1".into()),
                volumes: Some(
                    claims
                        .iter()
                        .map(|c| Volume {
                            name: c.to_string(),
                            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                                claim_name: c.to_string(),
                                read_only: None,
                            }),
                            ..Default::default()
                        })
                        .collect(),
                ),
                ..Default::default()
            }),
            status: None,
        }
    }

    fn driver(name: &str, attach: bool) -> CSIDriver {
        CSIDriver {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            spec: CSIDriverSpec {
                attach_required: Some(attach),
                ..Default::default()
            },
        }
    }

    #[test]
    fn resolves_bound_claims_of_attachable_drivers_only() {
        let lookup = Fake {
            claims: vec![
                claim("a", "pv-a", "Bound"),
                claim("b", "pv-b", "Pending"),
                claim("c", "pv-c", "Bound"),
                claim("d", "pv-d", "Bound"),
                claim("e", "pv-e", "Bound"),
            ],
            pvs: vec![
                pv("pv-a", "no-object.dev", "uid-a", &["ReadWriteOnce"]),
                pv("pv-b", "no-object.dev", "uid-b", &["ReadWriteOnce"]),
                pv("pv-c", "noattach.dev", "uid-c", &["ReadWriteOnce"]),
                pv("pv-d", "attach.dev", "uid-d", &["ReadWriteMany"]),
                // Bound to some other claim (stale PV): not ours.
                pv("pv-e", "attach.dev", "someone-else", &["ReadWriteOnce"]),
            ],
            drivers: vec![driver("noattach.dev", false), driver("attach.dev", true)],
        };
        let vols = pod_volumes(&pod(&["a", "b", "c", "d", "e", "missing", "a"]), &lookup);
        let names: Vec<_> = vols.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(
            names,
            vec![
                "kubernetes.io/csi/no-object.dev^h-pv-a",
                "kubernetes.io/csi/attach.dev^h-pv-d"
            ]
        );
        assert!(!vols[0].multi_attach);
        assert!(vols[1].multi_attach);
    }

    /// Generic ephemeral volumes resolve to `<pod>-<volume>`, only when the pod controls it.
    #[test]
    fn ephemeral_volumes_resolve_to_the_claim_the_pod_controls() {
        use k8s_openapi::api::core::v1::EphemeralVolumeSource;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
        let owned = |name: &str, owner_uid: &str| {
            let mut c = claim(name, &format!("pv-{name}"), "Bound");
            c.metadata.owner_references = Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Pod".into(),
                name: "p".into(),
                uid: owner_uid.into(),
                controller: Some(true),
                ..Default::default()
            }]);
            c
        };
        let lookup = Fake {
            claims: vec![owned("p-scratch", "pod-uid"), owned("p-foreign", "other-uid")],
            pvs: vec![
                pv("pv-p-scratch", "attach.dev", "uid-p-scratch", &["ReadWriteOnce"]),
                pv("pv-p-foreign", "attach.dev", "uid-p-foreign", &["ReadWriteOnce"]),
            ],
            drivers: vec![driver("attach.dev", true)],
        };
        let mut p = full_pod(&[]);
        let eph = |name: &str| Volume {
            name: name.into(),
            ephemeral: Some(EphemeralVolumeSource::default()),
            ..Default::default()
        };
        p.spec.as_mut().unwrap().volumes = Some(vec![eph("scratch"), eph("foreign")]);
        let vols = pod_volumes(&StoredPod::from_pod(&p).unwrap(), &lookup);
        let names: Vec<_> = vols.iter().map(|v| v.pv_name.as_str()).collect();
        assert_eq!(names, vec!["pv-p-scratch"]);
    }

    #[test]
    fn entries_follow_their_pods() {
        let spec = VolumeSpec {
            name: "v".into(),
            pv_name: "pv".into(),
            driver: "d".into(),
            handle: "h".into(),
            multi_attach: false,
            kind: Kind::Csi,
        };
        let p = |uid: &str| PodRef {
            namespace: "ns".into(),
            name: uid.into(),
            uid: uid.into(),
        };
        let mut d = Desired::default();
        d.set_pod(p("1"), "n1", vec![spec.clone()]);
        d.set_pod(p("2"), "n1", vec![spec.clone()]);
        d.mark_multi_attach_reported("v", "n1");
        assert_eq!(d.len(), 1);
        d.remove_pod("1");
        assert!(d.get("v", "n1").unwrap().multi_attach_reported);
        // Moving the pod to another node takes its volume along.
        d.set_pod(p("2"), "n2", vec![spec]);
        assert!(d.get("v", "n1").is_none());
        assert!(!d.get("v", "n2").unwrap().multi_attach_reported);
        d.remove_pod("2");
        assert!(d.is_empty());
    }

    /// A claim that stops resolving keeps the volume its running pod already wanted; a driver
    /// that stops needing attachment, or another node, lets it go.
    #[test]
    fn an_active_pods_volume_stays_when_its_claim_stops_resolving() {
        let spec = |n: &str| VolumeSpec {
            name: n.into(),
            pv_name: format!("pv-{n}"),
            driver: "d".into(),
            handle: n.into(),
            multi_attach: false,
            kind: Kind::Csi,
        };
        let p = PodRef {
            namespace: "ns".into(),
            name: "p".into(),
            uid: "u".into(),
        };
        let attachable = |_: &VolumeSpec| true;
        let mut d = Desired::default();
        let u = d.update_pod(p.clone(), "n1", vec![spec("v"), spec("w")], attachable);
        assert_eq!(u, Update::default());
        d.mark_multi_attach_reported("v", "n1");
        // Nothing resolves now: both stay, as they were.
        let u = d.update_pod(p.clone(), "n1", vec![], attachable);
        assert!(!u.released);
        assert_eq!(u.kept, vec![spec("v"), spec("w")]);
        assert!(d.get("v", "n1").unwrap().multi_attach_reported);
        assert!(d.get("w", "n1").is_some());
        // A new volume resolves: added beside the kept ones.
        let u = d.update_pod(p.clone(), "n1", vec![spec("x")], attachable);
        assert_eq!(u.kept.len(), 2);
        assert_eq!(d.len(), 3);
        // The driver of w no longer needs attaching: w goes (upstream's attachability check).
        let u = d.update_pod(p.clone(), "n1", vec![spec("x")], |v: &VolumeSpec| v.name != "w");
        assert!(u.released);
        assert!(d.get("w", "n1").is_none() && d.get("v", "n1").is_some());
        // Another node: nothing of the old one is kept there.
        let u = d.update_pod(p.clone(), "n2", vec![], attachable);
        assert!(u.released && u.kept.is_empty());
        assert!(d.is_empty());
        // Only termination or deletion of the pod removes what it wants.
        d.update_pod(p.clone(), "n1", vec![spec("v")], attachable);
        assert!(d.remove_pod("u"));
        assert!(d.is_empty());
    }

    /// Claims resolve with a reason when they do not: the claim is not Bound, its volume names
    /// another claim, is missing, or the claim is missing.
    #[test]
    fn unresolved_claims_say_why() {
        let lookup = Fake {
            claims: vec![
                claim("pending", "pv-p", "Pending"),
                claim("stolen", "pv-s", "Bound"),
                claim("lost", "pv-gone", "Bound"),
                claim("ok", "pv-ok", "Bound"),
            ],
            pvs: vec![
                pv("pv-p", "attach.dev", "uid-pending", &["ReadWriteOnce"]),
                pv("pv-s", "attach.dev", "someone-else", &["ReadWriteOnce"]),
                pv("pv-ok", "attach.dev", "uid-ok", &["ReadWriteOnce"]),
            ],
            drivers: vec![driver("attach.dev", true)],
        };
        let r = resolve_pod(&pod(&["pending", "stolen", "lost", "missing", "ok"]), &lookup);
        assert_eq!(r.attachable.len(), 1);
        let whys: Vec<(&str, &str)> = r
            .unresolved
            .iter()
            .map(|u| (u.claim.as_str(), u.why.as_str()))
            .collect();
        assert!(
            whys[0].0 == "pending" && whys[0].1.contains("Pending, not Bound"),
            "{whys:?}"
        );
        assert!(
            whys[1].0 == "stolen" && whys[1].1.contains("another claim"),
            "{whys:?}"
        );
        assert!(
            whys[2].0 == "lost" && whys[2].1.contains("does not exist"),
            "{whys:?}"
        );
        assert!(
            whys[3].0 == "missing" && whys[3].1.contains("claim does not exist"),
            "{whys:?}"
        );
        let note = kept_note("n1", &r.attachable, &r.unresolved);
        assert!(note.contains("pv-ok") && note.contains("claim stolen:"), "{note}");
    }

    proptest::proptest! {
        /// While a pod is active on one node, whatever it wanted there stays wanted whatever its
        /// claims resolve to next, unless its driver stops needing attachment; the index follows.
        #[test]
        fn an_active_pod_never_loses_an_attachable_volume(
            steps in proptest::collection::vec((proptest::collection::vec(0..4usize, 0..3), 0..5usize), 1..20)
        ) {
            let mut d = Desired::default();
            let p = PodRef { namespace: "ns".into(), name: "p".into(), uid: "u".into() };
            let mut wanted: std::collections::BTreeSet<String> = Default::default();
            for (vols, detachable) in steps {
                let specs: Vec<VolumeSpec> = vols.iter().map(|v| VolumeSpec {
                    name: format!("vol{v}"),
                    pv_name: format!("pv{v}"),
                    driver: format!("d{v}"),
                    handle: format!("h{v}"),
                    multi_attach: false,
                    kind: Kind::Csi,
                }).collect();
                // Driver `d<detachable>` no longer needs attaching (4: all still do).
                let gone = format!("d{detachable}");
                let u = d.update_pod(p.clone(), "n1", specs.clone(), |s: &VolumeSpec| s.driver != gone);
                let now: std::collections::BTreeSet<String> =
                    d.iter().map(|(_, e)| e.spec.name.clone()).collect();
                for w in &wanted {
                    let dropped = w == &format!("vol{detachable}") && !specs.iter().any(|s| &s.name == w);
                    proptest::prop_assert_eq!(now.contains(w), !dropped, "{}", w);
                }
                for s in &specs {
                    proptest::prop_assert!(now.contains(&s.name));
                }
                proptest::prop_assert_eq!(u.released, wanted.iter().any(|w| !now.contains(w)));
                for v in 0..4 {
                    let name = format!("vol{v}");
                    proptest::prop_assert_eq!(d.wanting(&name).count(), usize::from(now.contains(&name)));
                }
                wanted = now;
            }
        }

        /// The volume index agrees with the entries after any sequence of pod changes, and a
        /// pod reports releasing something exactly when an entry or one of its pods went.
        #[test]
        fn the_volume_index_follows_the_entries(
            ops in proptest::collection::vec((0..4usize, 0..3usize, proptest::collection::vec(0..3usize, 0..3), proptest::bool::ANY), 0..40)
        ) {
            let mut d = Desired::default();
            for (pod, node, vols, remove) in ops {
                let uid = format!("u{pod}");
                let before: Vec<(String, String)> = d.iter().flat_map(|(n, e)| {
                    e.pods.contains_key(&uid).then(|| (n.clone(), e.spec.name.clone()))
                }).collect();
                let released = if remove {
                    d.remove_pod(&uid)
                } else {
                    let specs = vols.iter().map(|v| VolumeSpec {
                        name: format!("vol{v}"),
                        pv_name: format!("pv{v}"),
                        driver: "d".into(),
                        handle: format!("h{v}"),
                        multi_attach: false,
                        kind: Kind::Csi,
                    }).collect();
                    let r = PodRef { namespace: "ns".into(), name: format!("p{pod}"), uid: uid.clone() };
                    d.set_pod(r, &format!("n{node}"), specs)
                };
                let after: Vec<(String, String)> = d.iter().flat_map(|(n, e)| {
                    e.pods.contains_key(&uid).then(|| (n.clone(), e.spec.name.clone()))
                }).collect();
                proptest::prop_assert_eq!(released, before.iter().any(|b| !after.contains(b)));
                for v in 0..3 {
                    let name = format!("vol{v}");
                    let indexed: Vec<(String, String)> = d.wanting(&name).map(|(n, e)| (n.clone(), e.spec.name.clone())).collect();
                    let scanned: Vec<(String, String)> = d.iter().filter(|(_, e)| e.spec.name == name).map(|(n, e)| (n.clone(), e.spec.name.clone())).collect();
                    proptest::prop_assert_eq!(indexed, scanned);
                }
            }
        }
    }
}

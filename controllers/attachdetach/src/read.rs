//! Reading pods, nodes, volumes and attachments the way upstream's attach/detach controller reads
//! them, in one place.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;
use sha2::{Digest, Sha256};
use stowage_common::store::{StoredPod, VolumeAttachment, VolumeSource};

/// Set by a kubelet (or stowage-agent) that leaves attach/detach to the controller.
pub const ANN_CONTROLLER_MANAGED: &str = "volumes.kubernetes.io/controller-managed-attach-detach";
/// An admin's statement that the node is down for good: its volumes may go at once.
pub const TAINT_OUT_OF_SERVICE: &str = "node.kubernetes.io/out-of-service";
/// The CSI plugin prefix of unique volume names.
pub const CSI_PLUGIN: &str = "kubernetes.io/csi";
/// Where CSI drivers put the device path in `status.attachmentMetadata`.
pub const META_DEVICE_PATH: &str = "devicePath";

/// `kubernetes.io/csi/<driver>^<handle>`: the name node status and the kubelet use.
pub fn unique_volume_name(driver: &str, handle: &str) -> String {
    format!("{CSI_PLUGIN}/{driver}^{handle}")
}

/// The inverse of [`unique_volume_name`], for attachments known only from node status.
pub fn split_unique_volume_name(name: &str) -> Option<(&str, &str)> {
    let rest = name.strip_prefix(CSI_PLUGIN)?.strip_prefix('/')?;
    rest.split_once('^')
}

/// The VolumeAttachment name upstream's CSI attacher uses, so both controllers (and a restart
/// after switching between them) agree on one object per (volume, node).
pub fn attachment_name(handle: &str, driver: &str, node: &str) -> String {
    let mut h = Sha256::new();
    h.update(handle.as_bytes());
    h.update(driver.as_bytes());
    h.update(node.as_bytes());
    format!("csi-{}", hex::encode(h.finalize()))
}

/// Upstream's `SuccessfulAttachVolume` note, to the byte (its empty suffix leaves the trailing
/// space), so the same greps match either controller's events.
pub fn attach_succeeded_note(pv: &str) -> String {
    format!("AttachVolume.Attach succeeded for volume \"{pv}\" ")
}

/// Scheduled and not finished. A pod being deleted still holds its volumes until it is gone or
/// its phase says its containers are done (the kubelet may still be writing).
pub fn pod_is_active(pod: &StoredPod) -> bool {
    pod.node_name().is_some() && !matches!(pod.phase(), Some("Succeeded" | "Failed"))
}

/// Names of the claims a pod mounts: persistentVolumeClaim and generic ephemeral volumes (the
/// index claim → pods; whether an ephemeral claim is really the pod's is checked on resolve).
pub fn pod_claims(pod: &StoredPod) -> Vec<String> {
    stowage_common::store::pods::pod_claims(pod)
        .into_iter()
        .map(|c| c.claim)
        .collect()
}

/// The built-in driver: an ext4 file system on a loop image.
pub use stowage_loopdriver::DRIVER as LOOP_DRIVER;

/// Why a `loop.stowage.dev` volume goes to one node at a time, for the multi-attach event.
pub const LOOP_SINGLE_NODE_RULE: &str = "loop.stowage.dev volumes that are not ReadOnlyMany are attached to one node at a time: ext4 on a loop image is corrupted when two kernels mount it read-write";

/// Is the volume's CSI driver the built-in one?
pub fn is_loop(spec: &VolumeSource) -> bool {
    spec.csi.as_ref().is_some_and(|c| c.driver == LOOP_DRIVER)
}

/// What the built-in attacher's finalizer on a PV needs, as external-attacher keeps it: on a
/// `loop.stowage.dev` PV while any VolumeAttachment names it (so the PV cannot vanish under an
/// attachment that a restarted controller could then no longer map), off once none does.
/// `Some(true)`: add, `Some(false)`: remove, `None`: nothing. No finalizer is added to a PV
/// being deleted (the apiserver refuses new finalizers then). `is_loop`: the PV's CSI driver is
/// the built-in one (callers that resolved the driver already need not read the PV again).
pub fn pv_finalizer_change(meta: &ObjectMeta, is_loop: bool, attached: bool) -> Option<bool> {
    let has = meta
        .finalizers
        .iter()
        .flatten()
        .any(|f| f == stowage_common::vocab::annotations::LOOP_ATTACHER_FINALIZER);
    match (is_loop && attached, has) {
        (true, false) if meta.deletion_timestamp.is_none() => Some(true),
        (false, true) => Some(false),
        _ => None,
    }
}

/// Only volumes whose access modes are all single-node are exclusive; no modes at all is
/// treated as shareable, as upstream does. Exception: a `loop.stowage.dev` volume is shareable
/// only when every mode is ReadOnlyMany (the agent then attaches and mounts it read-only), since
/// two kernels writing one ext4 image corrupt it, whatever the PV's modes claim.
pub fn pv_multi_attach_allowed(spec: &VolumeSource) -> bool {
    let modes = &spec.access_modes;
    if is_loop(spec) {
        return !modes.is_empty() && modes.iter().all(|m| m == "ReadOnlyMany");
    }
    modes.is_empty() || modes.iter().any(|m| m == "ReadWriteMany" || m == "ReadOnlyMany")
}

/// What the reconciler needs to know about one node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeInfo {
    /// Carries the controller-managed annotation.
    pub managed: bool,
    /// Ready condition is True.
    pub ready: bool,
    /// Carries the out-of-service taint.
    pub out_of_service: bool,
    /// `status.volumesInUse`: still mounted by the kubelet.
    pub in_use: BTreeSet<String>,
    /// `status.volumesAttached` as the node has it now: unique name → device path.
    pub volumes_attached: BTreeMap<String, String>,
    pub resource_version: Option<String>,
    /// The Node object is gone. Its last state is kept (as upstream keeps a deleted node in its
    /// desired state while it has volumes, with its last `volumesInUse`): a gone node is
    /// unhealthy, never a proof that its volumes are unmounted.
    pub deleted: bool,
}

impl NodeInfo {
    pub fn of(node: &Node) -> Self {
        let status = node.status.as_ref();
        Self {
            managed: node.annotations().contains_key(ANN_CONTROLLER_MANAGED),
            ready: status
                .and_then(|s| s.conditions.as_ref())
                .into_iter()
                .flatten()
                .any(|c| c.type_ == "Ready" && c.status == "True"),
            out_of_service: node
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .into_iter()
                .flatten()
                .any(|t| t.key == TAINT_OUT_OF_SERVICE),
            in_use: status
                .and_then(|s| s.volumes_in_use.clone())
                .unwrap_or_default()
                .into_iter()
                .collect(),
            volumes_attached: status
                .and_then(|s| s.volumes_attached.as_ref())
                .into_iter()
                .flatten()
                .map(|v| (v.name.clone(), v.device_path.clone()))
                .collect(),
            resource_version: node.resource_version(),
            deleted: false,
        }
    }

    /// The node as it was last seen, now that its object is gone: not Ready, nothing to write.
    pub fn gone(mut self) -> Self {
        self.ready = false;
        self.deleted = true;
        self
    }

    /// May volumes be attached to it (and its pods count as desired)?
    pub fn accepts_attach(&self) -> bool {
        self.managed && !self.deleted
    }
}

/// What the controller reads from one VolumeAttachment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VaState {
    pub name: String,
    pub attached: bool,
    /// Has a deletionTimestamp: the external attacher is detaching it.
    pub deleting: bool,
    pub device_path: String,
    pub attach_error: Option<String>,
    pub resource_version: Option<String>,
    /// Held by the built-in attacher's finalizer (current or legacy name).
    pub loop_finalizer: bool,
}

impl VaState {
    pub fn of(va: &VolumeAttachment) -> Self {
        let status = va.status.as_ref();
        Self {
            name: va.name_any(),
            attached: status.is_some_and(|s| s.attached),
            deleting: va.metadata.deletion_timestamp.is_some(),
            device_path: status
                .and_then(|s| s.attachment_metadata.as_ref())
                .and_then(|m| m.get(META_DEVICE_PATH).cloned())
                .unwrap_or_default(),
            attach_error: status
                .and_then(|s| s.attach_error.as_ref())
                .and_then(|e| e.message.clone()),
            resource_version: va.resource_version(),
            loop_finalizer: va
                .finalizers()
                .iter()
                .any(|f| stowage_common::vocab::annotations::is_loop_attacher_finalizer(f)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attachment_name_is_sha256_of_handle_driver_node() {
        // Plain concatenation, no separators: the same bytes in another split give the same name.
        assert_eq!(attachment_name("ab", "c", "n"), attachment_name("a", "bc", "n"));
        let n = attachment_name("vol-1", "loop.stowage.dev", "node-a");
        assert!(n.starts_with("csi-"));
        assert_eq!(n.len(), 4 + 64);
        assert!(
            n[4..]
                .chars()
                .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c))
        );
        // sha256("") is well known; checks hex encoding and prefix.
        assert_eq!(
            attachment_name("", "", ""),
            "csi-e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn unique_name_round_trips() {
        let n = unique_volume_name("loop.stowage.dev", "pv-1");
        assert_eq!(n, "kubernetes.io/csi/loop.stowage.dev^pv-1");
        assert_eq!(split_unique_volume_name(&n), Some(("loop.stowage.dev", "pv-1")));
        assert_eq!(split_unique_volume_name("kubernetes.io/aws-ebs/x"), None);
    }
}

#[cfg(test)]
mod access_mode_tests {
    use super::*;
    use k8s_openapi::api::core::v1::PersistentVolume;
    use k8s_openapi::api::core::v1::{CSIPersistentVolumeSource, PersistentVolumeSpec};
    use stowage_common::store::{BoundClaim, CsiSource, StoredVolume};

    fn pv(driver: &str, modes: &[&str]) -> PersistentVolume {
        PersistentVolume {
            metadata: ObjectMeta {
                name: Some("v".into()),
                ..Default::default()
            },
            spec: Some(PersistentVolumeSpec {
                access_modes: Some(modes.iter().map(|m| m.to_string()).collect()),
                csi: Some(CSIPersistentVolumeSource {
                    driver: driver.into(),
                    volume_handle: "h".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// What the controller reads, through a stored copy as in the informer.
    fn view(pv: &PersistentVolume) -> VolumeSource {
        StoredVolume::new(pv.clone()).source().unwrap()
    }

    fn change(pv: &PersistentVolume, attached: bool) -> Option<bool> {
        pv_finalizer_change(&pv.metadata, is_loop(&view(pv)), attached)
    }

    fn shared(pv: &PersistentVolume) -> bool {
        pv_multi_attach_allowed(&view(pv))
    }

    #[test]
    fn the_view_holds_what_the_volume_says() {
        let mut v = pv("nfs.csi.example", &["ReadWriteOnce", "ReadOnlyMany"]);
        v.spec.as_mut().unwrap().claim_ref = Some(k8s_openapi::api::core::v1::ObjectReference {
            namespace: Some("app".into()),
            name: Some("c".into()),
            uid: Some("u-1".into()),
            resource_version: Some("7".into()),
            ..Default::default()
        });
        assert_eq!(
            view(&v),
            VolumeSource {
                access_modes: vec!["ReadWriteOnce".into(), "ReadOnlyMany".into()],
                claim_ref: Some(BoundClaim {
                    namespace: Some("app".into()),
                    name: Some("c".into()),
                    uid: Some("u-1".into())
                }),
                csi: Some(CsiSource {
                    driver: "nfs.csi.example".into(),
                    volume_handle: "h".into()
                }),
                ..Default::default()
            }
        );
        assert_eq!(view(&PersistentVolume::default()), VolumeSource::default());
    }

    #[test]
    fn the_pv_finalizer_follows_the_attachments_of_loop_volumes() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let mut v = pv(LOOP_DRIVER, &["ReadWriteOnce"]);
        assert_eq!(change(&v, true), Some(true));
        assert_eq!(change(&v, false), None);
        v.metadata.finalizers = Some(vec![
            stowage_common::vocab::annotations::LOOP_ATTACHER_FINALIZER.into(),
        ]);
        assert_eq!(change(&v, true), None);
        assert_eq!(change(&v, false), Some(false));
        // Being deleted: released when nothing names it, never added.
        v.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        assert_eq!(change(&v, false), Some(false));
        v.metadata.finalizers = None;
        assert_eq!(change(&v, true), None);
        // Other drivers' volumes are their attacher's business.
        let other = pv("nfs.csi.example", &["ReadWriteMany"]);
        assert_eq!(change(&other, true), None);
    }

    #[test]
    fn loop_volumes_are_shared_only_when_read_only_many() {
        assert!(!shared(&pv(LOOP_DRIVER, &["ReadWriteMany"])));
        assert!(!shared(&pv(LOOP_DRIVER, &["ReadOnlyMany", "ReadWriteOnce"])));
        assert!(!shared(&pv(LOOP_DRIVER, &[])));
        assert!(shared(&pv(LOOP_DRIVER, &["ReadOnlyMany"])));
        // Other drivers keep upstream's rule.
        assert!(shared(&pv("nfs.csi.example", &["ReadWriteMany"])));
        assert!(shared(&pv("nfs.csi.example", &[])));
        assert!(!shared(&pv("nfs.csi.example", &["ReadWriteOnce"])));
    }
}

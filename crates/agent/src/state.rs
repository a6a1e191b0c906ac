//! Desired and actual state of the volume manager, as plain data. `desired()` turns the pods of
//! this node (plus their claims, volumes and attachments) into the set of (volume, pod) mounts the
//! node should have; the actual state is assembled from what the observer found in the mount table
//! and the pod directories. No I/O in here; time is an argument. (Over 600 lines with its tests,
//! which are the resolution rules' cases and read best next to them.)

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use k8s_openapi::jiff::Timestamp;

use crate::mountinfo::DevNo;
use crate::paths::{DRIVER, plain_component, unique_name};
pub use crate::probe::Health;
use stowage_common::store::pods::{PodClaim, pod_claims};
use stowage_common::vocab::resize;

/// The pod annotation-free facts the agent needs to talk about a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodInfo {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub created: Option<Timestamp>,
}

impl PodInfo {
    pub fn reference(&self) -> k8s_openapi::api::core::v1::ObjectReference {
        stowage_common::observe::events::pod_reference(&self.namespace, &self.name, Some(&self.uid))
    }
}

/// What the attach side says about a volume on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttachStatus {
    /// No VolumeAttachment for (volume, node) yet.
    Missing,
    /// Exists, not attached yet; `error` is the attacher's last complaint.
    Pending {
        error: Option<String>,
    },
    /// Being deleted: do not start new mounts on it.
    Detaching,
    Attached {
        device: String,
    },
}

/// One pod's use of a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodUse {
    pub pod: PodInfo,
    /// The pod's name for the volume (`spec.volumes[].name`).
    pub spec_name: String,
    pub read_only: bool,
    pub fs_group: Option<u32>,
    /// `fsGroupChangePolicy: OnRootMismatch`.
    pub fs_group_on_root_mismatch: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredVolume {
    pub pv: String,
    pub handle: String,
    pub block: bool,
    /// The file system the volume holds or is formatted with (`spec.csi.fsType`; empty: ext4).
    pub fs_type: String,
    /// The device itself is mounted read-only: `spec.csi.readOnly`, or access modes that are
    /// only multi-node read-only (`ReadOnlyMany`), whatever the pods ask.
    pub pv_read_only: bool,
    /// `pv.beta.kubernetes.io/gid`: a supplemental group for the pods using the volume.
    pub gid: Option<u32>,
    pub claim: Claim,
    pub attachment: AttachStatus,
    /// Listed in `node.status.volumesInUse` already (the controller will not detach it).
    pub reported_in_use: bool,
    /// Listed in `node.status.volumesAttached`: the attach/detach controller publishes an
    /// attachment there, and takes it away before it detaches. A kubelet mounts nothing the node
    /// status does not list (its verifyControllerAttachedVolume); an attached VolumeAttachment
    /// alone is not enough, since the controller may be about to delete it.
    pub listed_attached: bool,
    /// The size a pending node-side expansion should reach.
    pub resize_to: Option<String>,
    pub pods: BTreeMap<String, PodUse>,
}

impl DesiredVolume {
    pub fn unique_name(&self) -> String {
        unique_name(&self.handle)
    }
}

/// Why a pod's volume cannot be mounted (yet), in words for an Event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodError {
    pub pod: PodInfo,
    pub volume: String,
    pub reason: &'static str,
    pub message: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Desired {
    /// By PV name.
    pub volumes: BTreeMap<String, DesiredVolume>,
    /// Every pod of this node that may still run; mounts of these pods are never torn down, even
    /// while one of their claims cannot be resolved.
    pub live_pods: BTreeSet<String>,
    pub errors: Vec<PodError>,
}

/// Lookups into the caches, as closures so tests can feed maps.
pub struct Lookups<'a> {
    pub pvc: &'a dyn Fn(&str, &str) -> Option<Arc<PersistentVolumeClaim>>,
    pub pv: &'a dyn Fn(&str) -> Option<Arc<PersistentVolume>>,
    /// The VolumeAttachment of (PV name, volume handle) on this node.
    pub va: &'a dyn Fn(&str, &str) -> Option<Arc<VolumeAttachment>>,
    /// Unique names the node status lists in `volumesInUse`.
    pub reported: &'a BTreeSet<String>,
    /// Unique names the node status lists in `volumesAttached`.
    pub attached: &'a BTreeSet<String>,
    /// Claims whose node expansion this agent finished: uid → resourceVersion it wrote.
    pub expanded: &'a BTreeMap<String, String>,
    pub now: Timestamp,
}

/// A pod still needs its volumes unless it reached a terminal phase or its deletion deadline
/// passed (no container runtime here can tell us more about a terminating pod).
pub fn pod_is_live(pod: &Pod, now: Timestamp) -> bool {
    let terminal = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|p| p == "Succeeded" || p == "Failed");
    let past_deadline = pod
        .metadata
        .deletion_timestamp
        .as_ref()
        .is_some_and(|t| t.0 <= now);
    !terminal && !past_deadline
}

fn pod_info(pod: &Pod) -> Option<PodInfo> {
    Some(PodInfo {
        uid: pod.metadata.uid.clone()?,
        namespace: pod.metadata.namespace.clone()?,
        name: pod.metadata.name.clone()?,
        created: pod.metadata.creation_timestamp.as_ref().map(|t| t.0),
    })
}

/// How the pod's containers use a volume: as files, as a device, or not at all.
fn usage(pod: &Pod, vol: &str) -> (bool, bool) {
    let Some(spec) = pod.spec.as_ref() else {
        return (false, false);
    };
    let containers = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten());
    let (mut fs, mut block) = (false, false);
    for c in containers {
        fs |= c.volume_mounts.iter().flatten().any(|m| m.name == vol);
        block |= c.volume_devices.iter().flatten().any(|d| d.name == vol);
    }
    (fs, block)
}

fn attachment_of(va: Option<&VolumeAttachment>) -> AttachStatus {
    let Some(va) = va else {
        return AttachStatus::Missing;
    };
    if va.metadata.deletion_timestamp.is_some() {
        return AttachStatus::Detaching;
    }
    let st = va.status.as_ref();
    let device = st
        .filter(|s| s.attached)
        .and_then(|s| s.attachment_metadata.as_ref())
        .and_then(|m| m.get("devicePath"))
        .filter(|d| d.starts_with("/dev/"));
    match device {
        Some(d) => AttachStatus::Attached { device: d.clone() },
        None => AttachStatus::Pending {
            error: st
                .and_then(|s| s.attach_error.as_ref())
                .and_then(|e| e.message.clone()),
        },
    }
}

/// A resolved claim: the claim, its volume, and whether the pod asks for read-only.
type Resolved = (Arc<PersistentVolumeClaim>, Arc<PersistentVolume>, bool);

/// The volume a claim of a pod leads to, or why it leads nowhere. `Ok(None)`: not our driver.
fn resolve(
    info: &PodInfo,
    pod: &Pod,
    pod_claim: &PodClaim,
    lookups: &Lookups,
) -> Result<Option<Resolved>, String> {
    let claim_name = &pod_claim.claim;
    let pvc = (lookups.pvc)(&info.namespace, claim_name)
        .ok_or_else(|| format!("persistentvolumeclaim \"{claim_name}\" not found"))?;
    if !pod_claim.usable(pod, &pvc.metadata) {
        return Err(format!(
            "persistentvolumeclaim \"{claim_name}\" was not created for this pod"
        ));
    }
    let pv_name = pvc
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.clone())
        .filter(|n| !n.is_empty())
        .ok_or_else(|| format!("persistentvolumeclaim \"{claim_name}\" is not bound to a volume yet"))?;
    let pv = (lookups.pv)(&pv_name)
        .ok_or_else(|| format!("persistentvolume \"{pv_name}\" of claim \"{claim_name}\" not found"))?;
    let spec = pv.spec.as_ref();
    match spec.and_then(|s| s.csi.as_ref()) {
        Some(csi) if csi.driver == DRIVER => {}
        _ => return Ok(None),
    }
    let claim_ref = spec.and_then(|s| s.claim_ref.as_ref());
    let matches = claim_ref.is_some_and(|r| {
        r.namespace.as_deref() == Some(info.namespace.as_str())
            && r.name.as_deref() == Some(claim_name.as_str())
            && match (&r.uid, &pvc.metadata.uid) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            }
    });
    if !matches {
        return Err(format!(
            "persistentvolume \"{pv_name}\" is not bound to claim \"{claim_name}\" (its claimRef points elsewhere)"
        ));
    }
    if !plain_component(&pv_name) {
        return Err(format!(
            "persistentvolume name {pv_name:?} cannot be used as a path"
        ));
    }
    Ok(Some((pvc, pv, pod_claim.read_only)))
}

/// A PV whose access modes are all `ReadOnlyMany`: several nodes may have it, so no node may
/// write to it (one ext4 image mounted writable by two kernels is corrupted).
pub fn only_read_only_many(spec: &k8s_openapi::api::core::v1::PersistentVolumeSpec) -> bool {
    let modes = spec.access_modes.as_deref().unwrap_or_default();
    !modes.is_empty() && modes.iter().all(|m| m == "ReadOnlyMany")
}

/// Desired state from the pods of this node.
pub fn desired<'p>(pods: impl IntoIterator<Item = &'p Pod>, lookups: &Lookups) -> Desired {
    let mut d = Desired::default();
    for pod in pods {
        let Some(info) = pod_info(pod) else { continue };
        if !pod_is_live(pod, lookups.now) {
            continue;
        }
        d.live_pods.insert(info.uid.clone());
        let spec = pod.spec.as_ref();
        let sc = spec.and_then(|s| s.security_context.as_ref());
        let fs_group = sc.and_then(|s| s.fs_group).and_then(|g| u32::try_from(g).ok());
        let on_root_mismatch = sc.and_then(|s| s.fs_group_change_policy.as_deref()) == Some("OnRootMismatch");
        for pod_claim in pod_claims(pod) {
            let (fs_use, block_use) = usage(pod, &pod_claim.volume);
            if !fs_use && !block_use {
                continue;
            }
            let err = |message: String| PodError {
                pod: info.clone(),
                volume: pod_claim.volume.clone(),
                reason: "FailedMount",
                message,
            };
            let (pvc, pv, pod_ro) = match resolve(&info, pod, &pod_claim, lookups) {
                Ok(Some(x)) => x,
                Ok(None) => continue,
                Err(m) => {
                    d.errors.push(err(m));
                    continue;
                }
            };
            let pv_name = pv.metadata.name.clone().unwrap_or_default();
            let pv_spec = pv.spec.clone().unwrap_or_default();
            let csi = pv_spec.csi.clone().unwrap_or_default();
            let block = pv_spec.volume_mode.as_deref() == Some("Block");
            if block && !block_use {
                d.errors.push(err(format!(
                    "volume \"{pv_name}\" has volumeMode Block but the pod mounts it as files (volumeMounts)"
                )));
                continue;
            }
            if !block && !fs_use {
                d.errors.push(err(format!(
                    "volume \"{pv_name}\" has volumeMode Filesystem but the pod uses it as a device (volumeDevices)"
                )));
                continue;
            }
            let resize_to = resize::node_resize_pending(&pvc)
                .then(|| {
                    let st = pvc.status.as_ref()?;
                    let already = pvc.metadata.uid.as_ref().and_then(|u| lookups.expanded.get(u));
                    if let Some(rv) = already
                        && !stowage_common::store::informer::is_newer(
                            pvc.metadata.resource_version.as_deref(),
                            Some(rv),
                        )
                    {
                        return None;
                    }
                    st.allocated_resources
                        .as_ref()
                        .and_then(|m| m.get("storage"))
                        .or_else(|| pv_spec.capacity.as_ref().and_then(|c| c.get("storage")))
                        .map(|q| q.0.clone())
                })
                .flatten();
            let entry = d.volumes.entry(pv_name.clone()).or_insert_with(|| {
                let handle = csi.volume_handle.clone();
                let gid = pv
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get("pv.beta.kubernetes.io/gid"))
                    .and_then(|g| g.parse().ok());
                DesiredVolume {
                    attachment: attachment_of((lookups.va)(&pv_name, &handle).as_deref()),
                    reported_in_use: lookups.reported.contains(&unique_name(&handle)),
                    listed_attached: lookups.attached.contains(&unique_name(&handle)),
                    pv: pv_name.clone(),
                    handle,
                    block,
                    fs_type: stowage_common::store::pv::csi_fs_type(pv.as_ref())
                        .unwrap_or(stowage_loopdriver::csi::caps::FS_TYPE)
                        .into(),
                    pv_read_only: csi.read_only.unwrap_or(false) || only_read_only_many(&pv_spec),
                    gid,
                    claim: Claim {
                        namespace: info.namespace.clone(),
                        name: pvc.metadata.name.clone().unwrap_or_default(),
                        uid: pvc.metadata.uid.clone().unwrap_or_default(),
                    },
                    resize_to,
                    pods: BTreeMap::new(),
                }
            });
            let read_only = pod_ro || entry.pv_read_only;
            if let AttachStatus::Pending { error: Some(e) } = &entry.attachment {
                d.errors.push(PodError {
                    pod: info.clone(),
                    volume: pod_claim.volume.clone(),
                    reason: "FailedAttachVolume",
                    message: format!("AttachVolume.Attach failed for volume \"{pv_name}\": {e}"),
                });
            }
            entry.pods.insert(
                info.uid.clone(),
                PodUse {
                    pod: info.clone(),
                    spec_name: pod_claim.volume.clone(),
                    read_only,
                    fs_group,
                    fs_group_on_root_mismatch: on_root_mismatch,
                },
            );
        }
    }
    d
}

/// One thing the observer found under the root dir.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mounted {
    /// Something is mounted there (for a block file: a device node is there).
    pub mounted: bool,
    /// The judgement of the mount (see `probe::judge`); meaningless when not mounted.
    pub health: Health,
    pub devno: Option<DevNo>,
    pub source: Option<String>,
    pub read_only: bool,
}

impl Mounted {
    /// A directory (or nothing) where a mount could be.
    pub fn absent() -> Self {
        Self {
            mounted: false,
            health: Health::Unknown("not mounted".into()),
            devno: None,
            source: None,
            read_only: false,
        }
    }

    /// Mounted and healthy: usable as it is.
    pub fn ok(&self) -> bool {
        self.mounted && self.health == Health::Healthy
    }

    /// Mounted and known broken: may be torn down and mounted again.
    pub fn broken(&self) -> bool {
        self.mounted && self.health.is_broken()
    }

    /// Mounted but not judged (probe pending or an inconclusive error): left alone.
    pub fn unsure(&self) -> bool {
        self.mounted && self.health.is_unsure()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodMount {
    pub block: bool,
    pub state: Mounted,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ActualVolume {
    /// The global device mount (or its leftover directory).
    pub device: Option<Mounted>,
    pub pods: BTreeMap<String, PodMount>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Actual {
    pub volumes: BTreeMap<String, ActualVolume>,
}

impl Actual {
    pub fn pod_mounts(&self) -> usize {
        self.volumes.values().map(|v| v.pods.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        CSIPersistentVolumeSource, Container, ObjectReference, PersistentVolumeClaimSpec,
        PersistentVolumeClaimVolumeSource, PersistentVolumeSpec, PodSpec, Volume, VolumeMount,
    };
    use kube::api::ObjectMeta;
    use std::collections::HashMap;

    fn pod(uid: &str, claim: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(format!("p-{uid}")),
                namespace: Some("ns".into()),
                uid: Some(uid.into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "c".into(),
                    volume_mounts: Some(vec![VolumeMount {
                        name: "data".into(),
                        mount_path: "/d".into(),
                        ..Default::default()
                    }]),
                    ..Default::default()
                }],
                volumes: Some(vec![Volume {
                    name: "data".into(),
                    persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                        claim_name: claim.into(),
                        read_only: None,
                    }),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            status: None,
        }
    }

    fn pvc(name: &str, volume: Option<&str>) -> Arc<PersistentVolumeClaim> {
        Arc::new(PersistentVolumeClaim {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                uid: Some(format!("uid-{name}")),
                ..Default::default()
            },
            spec: Some(PersistentVolumeClaimSpec {
                volume_name: volume.map(Into::into),
                ..Default::default()
            }),
            status: None,
        })
    }

    fn pv(name: &str, claim: &str) -> Arc<PersistentVolume> {
        Arc::new(PersistentVolume {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            spec: Some(PersistentVolumeSpec {
                csi: Some(CSIPersistentVolumeSource {
                    driver: DRIVER.into(),
                    volume_handle: format!("h-{name}"),
                    ..Default::default()
                }),
                claim_ref: Some(ObjectReference {
                    namespace: Some("ns".into()),
                    name: Some(claim.into()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            status: None,
        })
    }

    fn run(pods: &[Pod], pvcs: &[Arc<PersistentVolumeClaim>], pvs: &[Arc<PersistentVolume>]) -> Desired {
        let pvcs: HashMap<_, _> = pvcs
            .iter()
            .map(|c| (c.metadata.name.clone().unwrap(), c.clone()))
            .collect();
        let pvs: HashMap<_, _> = pvs
            .iter()
            .map(|c| (c.metadata.name.clone().unwrap(), c.clone()))
            .collect();
        let reported = BTreeSet::new();
        let expanded = BTreeMap::new();
        let lookups = Lookups {
            pvc: &|_, n| pvcs.get(n).cloned(),
            pv: &|n| pvs.get(n).cloned(),
            va: &|_, _| None,
            reported: &reported,
            attached: &reported,
            expanded: &expanded,
            now: Timestamp::UNIX_EPOCH,
        };
        desired(pods, &lookups)
    }

    #[test]
    fn resolves_pod_claim_volume_and_shares_one_entry() {
        let d = run(
            &[pod("a", "c1"), pod("b", "c1")],
            &[pvc("c1", Some("v1"))],
            &[pv("v1", "c1")],
        );
        assert!(d.errors.is_empty(), "{:?}", d.errors);
        let v = &d.volumes["v1"];
        assert_eq!(v.handle, "h-v1");
        assert_eq!(v.pods.len(), 2);
        assert_eq!(v.attachment, AttachStatus::Missing);
        assert_eq!(d.live_pods.len(), 2);
    }

    #[test]
    fn bad_claims_become_pod_errors_not_volumes() {
        let d = run(
            &[pod("a", "missing"), pod("b", "unbound"), pod("c", "stolen")],
            &[pvc("unbound", None), pvc("stolen", Some("v1"))],
            &[pv("v1", "someone-else")],
        );
        assert!(d.volumes.is_empty());
        assert_eq!(d.errors.len(), 3);
        assert!(d.errors.iter().all(|e| e.reason == "FailedMount"));
        assert!(d.errors[0].message.contains("not found"));
        assert!(d.errors[1].message.contains("not bound"));
        assert_eq!(d.live_pods.len(), 3, "pods stay live, so their mounts are kept");
    }

    #[test]
    fn read_only_many_volumes_are_read_only_whatever_the_pod_asks() {
        let mut rox = (*pv("v1", "c1")).clone();
        rox.spec.as_mut().unwrap().access_modes = Some(vec!["ReadOnlyMany".into()]);
        let d = run(
            &[pod("a", "c1")],
            &[pvc("c1", Some("v1"))],
            &[Arc::new(rox.clone())],
        );
        assert!(d.volumes["v1"].pv_read_only);
        assert!(
            d.volumes["v1"].pods["a"].read_only,
            "the pod did not ask, it gets read-only"
        );
        for modes in [
            vec![],
            vec!["ReadWriteOnce"],
            vec!["ReadOnlyMany", "ReadWriteOnce"],
        ] {
            rox.spec.as_mut().unwrap().access_modes = Some(modes.iter().map(|m| m.to_string()).collect());
            let d = run(
                &[pod("a", "c1")],
                &[pvc("c1", Some("v1"))],
                &[Arc::new(rox.clone())],
            );
            assert!(!d.volumes["v1"].pv_read_only, "{modes:?}");
            assert!(!d.volumes["v1"].pods["a"].read_only, "{modes:?}");
        }
    }

    /// A generic ephemeral volume uses the claim `<pod>-<volume>`, and only while the pod
    /// controls it: a claim of that name someone else made is refused, not mounted.
    #[test]
    fn an_ephemeral_volume_uses_only_the_claim_its_pod_controls() {
        use k8s_openapi::api::core::v1::EphemeralVolumeSource;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
        let mut p = pod("a", "unused");
        p.spec.as_mut().unwrap().volumes = Some(vec![Volume {
            name: "data".into(),
            ephemeral: Some(EphemeralVolumeSource::default()),
            ..Default::default()
        }]);
        let owned_by = |uid: &str, controller: bool| {
            let mut c = (*pvc("p-a-data", Some("v1"))).clone();
            c.metadata.owner_references = Some(vec![OwnerReference {
                kind: "Pod".into(),
                name: "p-a".into(),
                uid: uid.into(),
                controller: Some(controller),
                ..Default::default()
            }]);
            Arc::new(c)
        };
        let d = run(&[p.clone()], &[owned_by("a", true)], &[pv("v1", "p-a-data")]);
        assert!(d.errors.is_empty(), "{:?}", d.errors);
        assert_eq!(d.volumes["v1"].pods["a"].spec_name, "data");
        for foreign in [owned_by("b", true), owned_by("a", false)] {
            let d = run(&[p.clone()], &[foreign], &[pv("v1", "p-a-data")]);
            assert!(d.volumes.is_empty());
            assert_eq!(d.errors.len(), 1);
            assert!(
                d.errors[0].message.contains("was not created for this pod"),
                "{:?}",
                d.errors
            );
        }
    }

    #[test]
    fn terminal_and_expired_pods_are_not_desired() {
        let mut done = pod("a", "c1");
        done.status = Some(k8s_openapi::api::core::v1::PodStatus {
            phase: Some("Succeeded".into()),
            ..Default::default()
        });
        let mut deleting = pod("b", "c1");
        deleting.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            Timestamp::UNIX_EPOCH,
        ));
        let d = run(&[done, deleting], &[pvc("c1", Some("v1"))], &[pv("v1", "c1")]);
        assert!(d.volumes.is_empty() && d.live_pods.is_empty());
    }
}

//! The part of each watched object the checks need, and how it is read from the object.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::{Resource, ResourceExt};

#[derive(Clone, Debug, PartialEq)]
pub struct ClaimSnap {
    pub name: String,
    pub volume: Option<String>,
    pub phase: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct PvSnap {
    pub claim_uid: Option<String>,
    pub claim: Option<String>,
    pub phase: Option<String>,
    /// `<driver>^<handle>` for CSI volumes.
    pub unique: Option<String>,
    pub read_only: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct VaSnap {
    pub name: String,
    pub node: String,
    pub pv: Option<String>,
    pub attached: bool,
    pub deleting: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct NodeSnap {
    pub in_use: BTreeSet<String>,
    /// `status.volumesAttached` names (written by the attach/detach controller).
    pub attached: BTreeSet<String>,
    pub out_of_service: bool,
}

pub(super) fn rv_of<K: Resource>(o: &K) -> u64 {
    o.meta()
        .resource_version
        .as_deref()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0)
}

pub const OUT_OF_SERVICE: &str = "node.kubernetes.io/out-of-service";

pub(super) fn claim_snap(c: &PersistentVolumeClaim) -> ClaimSnap {
    ClaimSnap {
        name: format!("{}/{}", c.namespace().unwrap_or_default(), c.name_any()),
        volume: c
            .spec
            .as_ref()
            .and_then(|s| s.volume_name.clone())
            .filter(|v| !v.is_empty()),
        phase: c.status.as_ref().and_then(|s| s.phase.clone()),
    }
}

pub(super) fn pv_snap(p: &PersistentVolume) -> PvSnap {
    let spec = p.spec.as_ref();
    let cref = spec.and_then(|s| s.claim_ref.as_ref());
    let modes = spec.and_then(|s| s.access_modes.clone()).unwrap_or_default();
    let csi = spec.and_then(|s| s.csi.as_ref());
    PvSnap {
        claim_uid: cref.and_then(|r| r.uid.clone()),
        claim: cref.map(|r| {
            format!(
                "{}/{}",
                r.namespace.clone().unwrap_or_default(),
                r.name.clone().unwrap_or_default()
            )
        }),
        phase: p.status.as_ref().and_then(|s| s.phase.clone()),
        unique: csi.map(|c| format!("{}^{}", c.driver, c.volume_handle)),
        read_only: csi.and_then(|c| c.read_only).unwrap_or(false)
            || (!modes.is_empty() && modes.iter().all(|m| m == "ReadOnlyMany")),
    }
}

pub(super) fn va_snap(v: &VolumeAttachment) -> VaSnap {
    VaSnap {
        name: v.name_any(),
        node: v.spec.node_name.clone(),
        pv: v.spec.source.persistent_volume_name.clone(),
        attached: v.status.as_ref().is_some_and(|s| s.attached),
        deleting: v.metadata.deletion_timestamp.is_some(),
    }
}

pub(super) fn node_snap(n: &Node) -> NodeSnap {
    NodeSnap {
        in_use: n
            .status
            .as_ref()
            .and_then(|s| s.volumes_in_use.clone())
            .unwrap_or_default()
            .into_iter()
            .collect(),
        attached: n
            .status
            .iter()
            .flat_map(|s| s.volumes_attached.iter().flatten())
            .map(|v| v.name.clone())
            .collect(),
        out_of_service: n
            .spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|t| t.iter().any(|t| t.key == OUT_OF_SERVICE)),
    }
}

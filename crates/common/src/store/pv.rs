//! Reading PVs, claims and classes the way upstream reads them (beta annotations win, nil volume
//! mode means Filesystem, …), in one place.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::ResourceExt;

use crate::store::quantity;
use crate::vocab::annotations::ANN_BETA_CLASS;

/// `namespace/name` of a claim (API type or stored: only the metadata is read).
pub fn claim_key<K: ResourceExt>(c: &K) -> String {
    format!("{}/{}", c.namespace().unwrap_or_default(), c.name_any())
}

pub fn has_ann<K: ResourceExt>(o: &K, key: &str) -> bool {
    o.annotations().contains_key(key)
}

pub fn ann<'a, K: ResourceExt>(o: &'a K, key: &str) -> Option<&'a str> {
    o.annotations().get(key).map(String::as_str)
}

/// A claim's class: the beta annotation wins over the field; `None` = no class asked for at all.
pub fn claim_class(c: &PersistentVolumeClaim) -> Option<&str> {
    ann(c, ANN_BETA_CLASS).or_else(|| c.spec.as_ref()?.storage_class_name.as_deref())
}

/// A volume's class, `""` when it has none.
pub fn pv_class(pv: &PersistentVolume) -> &str {
    ann(pv, ANN_BETA_CLASS)
        .or_else(|| pv.spec.as_ref()?.storage_class_name.as_deref())
        .unwrap_or("")
}

pub fn pv_phase(pv: &PersistentVolume) -> &str {
    pv.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

pub fn claim_phase(c: &PersistentVolumeClaim) -> &str {
    c.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

pub fn claim_volume_name(c: &PersistentVolumeClaim) -> &str {
    c.spec
        .as_ref()
        .and_then(|s| s.volume_name.as_deref())
        .unwrap_or("")
}

pub fn pv_modes(pv: &PersistentVolume) -> BTreeSet<String> {
    pv.spec
        .as_ref()
        .and_then(|s| s.access_modes.clone())
        .unwrap_or_default()
        .into_iter()
        .collect()
}

pub fn claim_modes(c: &PersistentVolumeClaim) -> BTreeSet<String> {
    c.spec
        .as_ref()
        .and_then(|s| s.access_modes.clone())
        .unwrap_or_default()
        .into_iter()
        .collect()
}

pub fn pv_block(pv: &PersistentVolume) -> bool {
    pv.spec.as_ref().and_then(|s| s.volume_mode.as_deref()) == Some("Block")
}

pub fn claim_block(c: &PersistentVolumeClaim) -> bool {
    c.spec.as_ref().and_then(|s| s.volume_mode.as_deref()) == Some("Block")
}

pub fn pv_capacity(pv: &PersistentVolume) -> Option<u128> {
    pv.spec
        .as_ref()?
        .capacity
        .as_ref()?
        .get("storage")
        .and_then(|q| quantity::bytes(&q.0))
}

/// The requested size; a claim without a request asks for 0 bytes.
pub fn claim_request(c: &PersistentVolumeClaim) -> Option<u128> {
    match c
        .spec
        .as_ref()
        .and_then(|s| s.resources.as_ref())
        .and_then(|r| r.requests.as_ref())
    {
        Some(r) => r.get("storage").map_or(Some(0), |q| quantity::bytes(&q.0)),
        None => Some(0),
    }
}

pub fn pv_vac(pv: &PersistentVolume) -> &str {
    pv.spec
        .as_ref()
        .and_then(|s| s.volume_attributes_class_name.as_deref())
        .unwrap_or("")
}

pub fn claim_vac(c: &PersistentVolumeClaim) -> &str {
    c.spec
        .as_ref()
        .and_then(|s| s.volume_attributes_class_name.as_deref())
        .unwrap_or("")
}

pub fn reclaim_policy(pv: &PersistentVolume) -> &str {
    pv.spec
        .as_ref()
        .and_then(|s| s.persistent_volume_reclaim_policy.as_deref())
        .unwrap_or("Retain")
}

pub fn csi_driver(pv: &PersistentVolume) -> Option<&str> {
    pv.spec.as_ref()?.csi.as_ref().map(|c| c.driver.as_str())
}

pub fn volume_handle(pv: &PersistentVolume) -> Option<&str> {
    pv.spec.as_ref()?.csi.as_ref().map(|c| c.volume_handle.as_str())
}

/// (namespace, name, uid) of the claim a PV points at.
pub fn claim_ref(pv: &PersistentVolume) -> Option<(&str, &str, &str)> {
    let r = pv.spec.as_ref()?.claim_ref.as_ref()?;
    Some((
        r.namespace.as_deref().unwrap_or(""),
        r.name.as_deref().unwrap_or(""),
        r.uid.as_deref().unwrap_or(""),
    ))
}

/// Whether `pv.spec.claimRef` names `claim` (and, when the ref carries a UID, that UID).
pub fn refers_to(pv: &PersistentVolume, claim: &PersistentVolumeClaim) -> bool {
    match claim_ref(pv) {
        Some((ns, name, uid)) => {
            ns == claim.namespace().unwrap_or_default()
                && name == claim.name_any()
                && (uid.is_empty() || Some(uid) == claim.metadata.uid.as_deref())
        }
        None => false,
    }
}

/// Access modes that let several nodes write one volume: refused for the built-in driver, whose
/// ext4 on a loop image cannot be mounted read-write by two kernels at once.
pub const MULTI_NODE_WRITER_MODES: &[&str] = &["ReadWriteMany"];

/// The file-system type a CSI volume names (`spec.csi.fsType`), if it names one.
pub fn csi_fs_type(pv: &PersistentVolume) -> Option<&str> {
    pv.spec
        .as_ref()?
        .csi
        .as_ref()?
        .fs_type
        .as_deref()
        .filter(|t| !t.is_empty())
}

/// Whether a volume is made with its file system at creation: a Filesystem volume whose only
/// access mode is ReadOnlyMany, of file-system type `fs` (or none given). Every node stages such a
/// volume read-only and never formats a device it cannot write, so an image left blank could
/// never be mounted. Block volumes and volumes with a writer mode stay blank: a writer's first
/// stage formats them on its node.
pub fn formatted_at_creation(pv: &PersistentVolume, fs: &str) -> bool {
    let Some(spec) = pv.spec.as_ref() else {
        return false;
    };
    let modes = spec.access_modes.as_deref().unwrap_or_default();
    let readers_only = !modes.is_empty() && modes.iter().all(|m| m == "ReadOnlyMany");
    let filesystem = spec.volume_mode.as_deref() != Some("Block");
    let of_type = csi_fs_type(pv).is_none_or(|t| t == fs);
    readers_only && filesystem && of_type
}

/// The one value a PV's required node affinity gives `key` (`key In [value]` in its first term
/// that names the key): the node of a node-local volume.
pub fn affinity_value<'a>(pv: &'a PersistentVolume, key: &str) -> Option<&'a str> {
    pv.spec
        .as_ref()?
        .node_affinity
        .as_ref()?
        .required
        .as_ref()?
        .node_selector_terms
        .iter()
        .flat_map(|t| t.match_expressions.iter().flatten())
        .find(|e| e.key == key && e.operator == "In")
        .and_then(|e| match e.values.as_deref() {
            Some([one]) => Some(one.as_str()),
            _ => None,
        })
}

pub fn being_deleted<K: ResourceExt>(o: &K) -> bool {
    o.meta().deletion_timestamp.is_some()
}

//! What a volume source is to the attach/detach controller, as upstream v1.36 reads it: a CSI
//! volume, an in-tree volume that csi-translation-lib translates to its CSI driver (migration is
//! complete for every such plugin in v1.36, so upstream translates on every node without reading
//! the node's CSINode), or one of the two in-tree attachable plugins still built in (iSCSI and
//! FC), whose attach is only a mark in the actual state and in `node.status.volumesAttached`.
//! Pure: no I/O.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{
    AzureDiskVolumeSource, CSIPersistentVolumeSource, FCVolumeSource, PersistentVolumeSpec, SecretReference,
};
use stowage_common::store::{PodVolume, VolumeSource};

use crate::read::{CSI_PLUGIN, pv_multi_attach_allowed};

/// The in-tree iSCSI plugin (still built into kube-controller-manager v1.36).
pub const ISCSI_PLUGIN: &str = "kubernetes.io/iscsi";
/// The in-tree Fibre Channel plugin (still built into kube-controller-manager v1.36).
pub const FC_PLUGIN: &str = "kubernetes.io/fc";

/// A translated inline volume's PV spec, as the VolumeAttachment carries it in
/// `spec.source.inlineVolumeSpec`. Compared by value (the API type has no `Eq`, but nothing in
/// it is a float).
#[derive(Debug, Clone, PartialEq)]
pub struct InlineSpec(pub PersistentVolumeSpec);

impl Eq for InlineSpec {}

/// How a volume is attached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// A VolumeAttachment naming the PV (`spec.source.persistentVolumeName`).
    Csi,
    /// A VolumeAttachment carrying the translated spec of a pod's inline volume.
    Inline(Arc<InlineSpec>),
    /// iSCSI or FC: no VolumeAttachment; the plugin's attach does nothing, so the volume is
    /// marked attached at once and only listed in the node's `status.volumesAttached`.
    InTree,
}

/// One attachable volume, whatever its source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// CSI driver, or the in-tree plugin name for [`Kind::InTree`].
    pub driver: String,
    /// CSI volume handle, or the plugin's volume name for [`Kind::InTree`].
    pub handle: String,
    /// What the VolumeAttachment's `persistentVolumeName` is (the PV), or, for an inline volume,
    /// the name csi-translation-lib gives the translated PV (upstream's events use it).
    pub pv_name: String,
    pub multi_attach: bool,
    pub kind: Kind,
}

impl Target {
    /// The unique volume name node status and the kubelet use: `kubernetes.io/csi/<driver>^<handle>`
    /// for CSI (translated or not), `<plugin>/<volume name>` for iSCSI and FC.
    pub fn unique_name(&self) -> String {
        match self.kind {
            Kind::InTree => format!("{}/{}", self.driver, self.handle),
            _ => crate::read::unique_volume_name(&self.driver, &self.handle),
        }
    }
}

/// What this controller manages, the one rule for both of its sides: a volume is managed when
/// its unique name is a CSI one (a driver and a handle; migrated in-tree volumes are named so
/// after translation) or an iSCSI or FC plugin's; this gives its (driver or plugin, handle).
/// The desired side wants only managed volumes (`desired::resolve_pod`), and the actual side
/// tracks only managed ones (`ingest::Parts::load` from node status, `ingest::Parts::resolve_va` from
/// VolumeAttachments), so what it does not manage (an old in-tree plugin's entry in a node's
/// `status.volumesAttached`, another writer's, a VolumeAttachment of a volume whose source does
/// not translate) is never tracked and so never detached: upstream cannot detach a volume whose
/// plugin it does not have either, so it leaves such entries as they are.
pub fn managed(name: &str) -> Option<(&str, &str)> {
    crate::read::split_unique_volume_name(name).or_else(|| split_in_tree_name(name))
}

/// [`managed`], as a yes or no.
pub fn is_managed_name(name: &str) -> bool {
    managed(name).is_some()
}

/// `(plugin, volume name)` of an iSCSI or FC unique name.
pub fn split_in_tree_name(name: &str) -> Option<(&'static str, &str)> {
    [ISCSI_PLUGIN, FC_PLUGIN].into_iter().find_map(|p| {
        let rest = name.strip_prefix(p)?.strip_prefix('/')?;
        (!rest.is_empty()).then_some((p, rest))
    })
}

/// Whether the volume of this unique name has VolumeAttachments (CSI, translated or not).
pub fn is_csi_name(name: &str) -> bool {
    name.strip_prefix(CSI_PLUGIN).is_some_and(|r| r.starts_with('/'))
}

/// `Ok(None)`: the PV needs no attaching (NFS, host path, local, …); `Err`: a source upstream
/// fails to translate (its volume is then skipped, as upstream skips it).
pub fn pv_target(pv_name: &str, pv: &VolumeSource) -> Result<Option<Target>, String> {
    let csi = |driver: &str, handle: String, modes: &[String]| Target {
        driver: driver.to_string(),
        handle,
        pv_name: pv_name.to_string(),
        multi_attach: modes_allow_multi_attach(modes),
        kind: Kind::Csi,
    };
    if let Some(c) = &pv.csi {
        return Ok(Some(Target {
            driver: c.driver.clone(),
            handle: c.volume_handle.clone(),
            pv_name: pv_name.to_string(),
            multi_attach: pv_multi_attach_allowed(pv),
            kind: Kind::Csi,
        }));
    }
    let modes = &pv.access_modes;
    if let Some(s) = &pv.aws_elastic_block_store {
        return Ok(Some(csi(EBS, ebs_volume_id(&s.volume_id)?, modes)));
    }
    if let Some(s) = &pv.gce_persistent_disk {
        let zones = pv
            .labels
            .get("failure-domain.beta.kubernetes.io/zone")
            .filter(|z| !z.is_empty())
            .or_else(|| pv.labels.get("topology.kubernetes.io/zone"))
            .cloned()
            .unwrap_or_default();
        let zones: Vec<&str> = zones.split("__").collect();
        let handle = match zones.as_slice() {
            [z] if !z.is_empty() => format!("projects/UNSPECIFIED/zones/{z}/disks/{}", s.pd_name),
            [_] => format!("projects/UNSPECIFIED/zones/UNSPECIFIED/disks/{}", s.pd_name),
            many => format!(
                "projects/UNSPECIFIED/regions/{}/disks/{}",
                gce_region(many)?,
                s.pd_name
            ),
        };
        return Ok(Some(csi(GCE_PD, handle, &gce_access_modes(modes))));
    }
    if let Some(s) = &pv.azure_disk {
        azure_disk_managed(s)?;
        return Ok(Some(csi(AZURE_DISK, s.disk_uri.clone(), modes)));
    }
    if let Some(s) = &pv.azure_file {
        let namespace = s
            .secret_namespace
            .clone()
            .or_else(|| pv.claim_ref.as_ref().and_then(|r| r.namespace.clone()))
            .unwrap_or_default();
        if namespace.is_empty() {
            return Err("could not find a secret namespace in PersistentVolumeSource or ClaimRef".into());
        }
        let group = pv
            .annotations
            .get("kubernetes.io/azure-file-resource-group")
            .cloned()
            .unwrap_or_default();
        let handle = format!(
            "{group}#{}#{}#{pv_name}#{namespace}",
            azure_account(&s.secret_name),
            s.share_name
        );
        return Ok(Some(csi(AZURE_FILE, handle, modes)));
    }
    if let Some(s) = &pv.cinder {
        return Ok(Some(csi(CINDER, s.volume_id.clone(), modes)));
    }
    if let Some(s) = &pv.vsphere_volume {
        return Ok(Some(csi(VSPHERE, s.volume_path.clone(), modes)));
    }
    if let Some(s) = &pv.portworx_volume {
        return Ok(Some(csi(PORTWORX, s.volume_id.clone(), modes)));
    }
    let in_tree = |plugin: &str, name: String| Target {
        driver: plugin.to_string(),
        handle: name,
        pv_name: pv_name.to_string(),
        multi_attach: modes_allow_multi_attach(modes),
        kind: Kind::InTree,
    };
    if let Some(s) = &pv.iscsi {
        return Ok(Some(in_tree(
            ISCSI_PLUGIN,
            iscsi_name(&s.target_portal, &s.iqn, s.lun),
        )));
    }
    if let Some(s) = &pv.fc {
        return fc_name(s).map(|n| Some(in_tree(FC_PLUGIN, n)));
    }
    Ok(None)
}

/// A pod's inline volume: `Ok(None)` when it is nothing attach/detach handles.
pub fn inline_target(v: &PodVolume, namespace: &str) -> Result<Option<Target>, String> {
    // Non-migrated inline volumes: upstream checks only two kinds for multi-attach, neither
    // of which is left.
    if let Some(s) = &v.iscsi {
        return Ok(Some(Target {
            driver: ISCSI_PLUGIN.into(),
            handle: iscsi_name(&s.target_portal, &s.iqn, s.lun),
            pv_name: v.name.clone(),
            multi_attach: true,
            kind: Kind::InTree,
        }));
    }
    if let Some(s) = &v.fc {
        return Ok(Some(Target {
            driver: FC_PLUGIN.into(),
            handle: fc_name(s)?,
            pv_name: v.name.clone(),
            multi_attach: true,
            kind: Kind::InTree,
        }));
    }
    let Some((name, spec)) = translate_inline(v, namespace)? else {
        return Ok(None);
    };
    let csi = spec.csi.as_ref().expect("translated specs are CSI");
    Ok(Some(Target {
        driver: csi.driver.clone(),
        handle: csi.volume_handle.clone(),
        pv_name: name,
        multi_attach: modes_allow_multi_attach(spec.access_modes.as_deref().unwrap_or_default()),
        kind: Kind::Inline(Arc::new(InlineSpec(spec))),
    }))
}

/// csi-translation-lib's translation of a migrated inline volume: the translated PV's name and
/// spec (volume mode Filesystem, as the library sets for every inline volume).
pub fn translate_inline(
    v: &PodVolume,
    namespace: &str,
) -> Result<Option<(String, PersistentVolumeSpec)>, String> {
    let src = |driver: &str, handle: &str| CSIPersistentVolumeSource {
        driver: driver.to_string(),
        volume_handle: handle.to_string(),
        ..Default::default()
    };
    let attrs = |pairs: &[(&str, String)]| -> Option<BTreeMap<String, String>> {
        Some(pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect())
    };
    let (name, csi, mode): (String, CSIPersistentVolumeSource, &str) =
        if let Some(s) = &v.aws_elastic_block_store {
            let handle = ebs_volume_id(&s.volume_id)?;
            let c = CSIPersistentVolumeSource {
                read_only: s.read_only,
                fs_type: s.fs_type.clone(),
                volume_attributes: attrs(&[("partition", s.partition.unwrap_or(0).to_string())]),
                ..src(EBS, &handle)
            };
            (format!("{EBS}-{handle}"), c, "ReadWriteOnce")
        } else if let Some(s) = &v.gce_persistent_disk {
            let partition = s
                .partition
                .filter(|p| *p != 0)
                .map(|p| p.to_string())
                .unwrap_or_default();
            let handle = format!("projects/UNSPECIFIED/zones/UNSPECIFIED/disks/{}", s.pd_name);
            let c = CSIPersistentVolumeSource {
                read_only: s.read_only,
                fs_type: s.fs_type.clone(),
                volume_attributes: attrs(&[("partition", partition)]),
                ..src(GCE_PD, &handle)
            };
            let mode = if s.read_only == Some(true) {
                "ReadOnlyMany"
            } else {
                "ReadWriteOnce"
            };
            (format!("{GCE_PD}-{}", s.pd_name), c, mode)
        } else if let Some(s) = &v.azure_disk {
            azure_disk_managed(s)?;
            let mut a = vec![("kind", "Managed".to_string())];
            if let Some(m) = s.caching_mode.as_ref().filter(|m| !m.is_empty()) {
                a.push(("cachingmode", m.clone()));
            }
            if let Some(f) = &s.fs_type {
                a.push(("fstype", f.clone()));
            }
            let c = CSIPersistentVolumeSource {
                read_only: s.read_only,
                fs_type: s.fs_type.clone(),
                volume_attributes: attrs(&a),
                ..src(AZURE_DISK, &s.disk_uri)
            };
            (s.disk_uri.clone(), c, "ReadWriteOnce")
        } else if let Some(s) = &v.azure_file {
            let ns = if namespace.is_empty() {
                "default"
            } else {
                namespace
            };
            let handle = format!(
                "#{}#{}#{}#{ns}",
                azure_account(&s.secret_name),
                s.share_name,
                v.name
            );
            let c = CSIPersistentVolumeSource {
                read_only: s.read_only,
                volume_attributes: attrs(&[("sharename", s.share_name.clone())]),
                node_stage_secret_ref: Some(SecretReference {
                    name: Some(s.secret_name.clone()),
                    namespace: Some(ns.to_string()),
                }),
                ..src(AZURE_FILE, &handle)
            };
            (handle, c, "ReadWriteMany")
        } else if let Some(s) = &v.cinder {
            let c = CSIPersistentVolumeSource {
                read_only: s.read_only,
                fs_type: s.fs_type.clone(),
                ..src(CINDER, &s.volume_id)
            };
            (format!("{CINDER}-{}", s.volume_id), c, "ReadWriteOnce")
        } else if let Some(s) = &v.vsphere_volume {
            // Upstream's inline translation with a storage policy name dereferences a nil source
            // (the controller's worker panics); the policy is left out here instead.
            let c = CSIPersistentVolumeSource {
                fs_type: s.fs_type.clone(),
                ..src(VSPHERE, &s.volume_path)
            };
            (format!("{VSPHERE}-{}", s.volume_path), c, "ReadWriteOnce")
        } else if let Some(s) = &v.portworx_volume {
            let c = CSIPersistentVolumeSource {
                fs_type: s.fs_type.clone(),
                ..src(PORTWORX, &s.volume_id)
            };
            let mode = if s.read_only == Some(true) {
                "ReadOnlyMany"
            } else {
                "ReadWriteOnce"
            };
            (format!("{PORTWORX}-{}", s.volume_id), c, mode)
        } else {
            return Ok(None);
        };
    Ok(Some((
        name,
        PersistentVolumeSpec {
            csi: Some(csi),
            access_modes: Some(vec![mode.to_string()]),
            volume_mode: Some("Filesystem".into()),
            ..Default::default()
        },
    )))
}

const EBS: &str = "ebs.csi.aws.com";
const GCE_PD: &str = "pd.csi.storage.gke.io";
const AZURE_DISK: &str = "disk.csi.azure.com";
const AZURE_FILE: &str = "file.csi.azure.com";
const CINDER: &str = "cinder.csi.openstack.org";
const VSPHERE: &str = "csi.vsphere.vmware.com";
const PORTWORX: &str = "pxd.portworx.com";

/// Upstream's multi-attach rule for a PV spec: no modes, or a shared mode, allows it.
fn modes_allow_multi_attach(modes: &[String]) -> bool {
    modes.is_empty() || modes.iter().any(|m| m == "ReadWriteMany" || m == "ReadOnlyMany")
}

/// `aws://<zone>/vol-…` or a bare `vol-…`, as csi-translation-lib reads EBS volume IDs.
fn ebs_volume_id(id: &str) -> Result<String, String> {
    let Some(rest) = id.strip_prefix("aws://") else {
        return Ok(id.to_string());
    };
    let path = rest.split_once('/').map(|(_, p)| p).unwrap_or("");
    let vol = path.trim_matches('/');
    if vol.starts_with("vol-") && !vol.contains('/') {
        Ok(vol.to_string())
    } else {
        Err(format!("Invalid format for AWS volume ({id})"))
    }
}

/// The region of `<locale>-<region>-<zone>` zones, which must agree.
fn gce_region(zones: &[&str]) -> Result<String, String> {
    let mut regions = std::collections::BTreeSet::new();
    for z in zones {
        let parts: Vec<&str> = z.split('-').collect();
        if parts.len() != 3 {
            return Err(format!(
                "zone in unexpected format, expected: {{locale}}-{{region}}-{{zone}}, got: {z}"
            ));
        }
        regions.insert(format!("{}-{}", parts[0], parts[1]));
    }
    match regions.len() {
        1 => Ok(regions.into_iter().next().unwrap_or_default()),
        _ => Err(format!(
            "multiple or no regions gotten from zones, got: {regions:?}"
        )),
    }
}

/// GCE PD's access modes as CSI reads them (ReadWriteMany and ReadOnlyMany+ReadWriteOnce were
/// ReadWriteOnce in-tree).
fn gce_access_modes(modes: &[String]) -> Vec<String> {
    if modes.is_empty() {
        return Vec::new();
    }
    let rwo = modes.iter().any(|m| m == "ReadWriteOnce" || m == "ReadWriteMany");
    let rox = modes.iter().any(|m| m == "ReadOnlyMany");
    vec![
        if rox && !rwo {
            "ReadOnlyMany"
        } else {
            "ReadWriteOnce"
        }
        .to_string(),
    ]
}

fn azure_disk_managed(s: &AzureDiskVolumeSource) -> Result<(), String> {
    match s.kind.as_deref() {
        Some(k) if !k.eq_ignore_ascii_case("managed") => {
            Err(format!("kind({k}) is not supported in csi migration"))
        }
        _ => Ok(()),
    }
}

/// The storage account from a secret named `azure-storage-account-<account>-secret`, else the
/// secret's name (as csi-translation-lib falls back).
fn azure_account(secret: &str) -> String {
    secret
        .find("azure-storage-account-")
        .map(|i| &secret[i + "azure-storage-account-".len()..])
        .and_then(|rest| rest.rfind("-secret").map(|j| &rest[..j]))
        .filter(|a| !a.is_empty())
        .unwrap_or(secret)
        .to_string()
}

/// The iSCSI plugin's volume name: `<targetPortal>:<iqn>:<lun>`.
fn iscsi_name(portal: &str, iqn: &str, lun: i32) -> String {
    format!("{portal}:{iqn}:{lun}")
}

/// The FC plugin's volume name: `[wwn1 wwn2]:<lun>` from target WWNs and a LUN, else `[wwid…]`
/// (Go's formatting of a string slice).
fn fc_name(s: &FCVolumeSource) -> Result<String, String> {
    let wwns = s.target_wwns.as_deref().unwrap_or_default();
    let wwids = s.wwids.as_deref().unwrap_or_default();
    match (wwns.is_empty(), s.lun, wwids.is_empty()) {
        (false, Some(lun), _) => Ok(format!("[{}]:{lun}", wwns.join(" "))),
        (_, _, false) => Ok(format!("[{}]", wwids.join(" "))),
        _ => Err("fc: no target WWNs with a LUN and no WWIDs".into()),
    }
}

#[cfg(test)]
mod tests;

//! The PV the built-in provisioner creates for a claim of a `loop.stowage.dev` class. The images
//! themselves are the driver crate's (`stowage_loopdriver::ImageStore`).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, PersistentVolume,
    PersistentVolumeClaim, PersistentVolumeSpec, VolumeNodeAffinity,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::ResourceExt;
use kube::api::ObjectMeta;

use crate::pv::*;

pub use stowage_loopdriver::{ImageError, ImageStore};

/// Whether the built-in provisioner makes the volume's ext4 when it creates the image (a
/// ReadOnlyMany-only Filesystem volume: `stowage_common::store::pv::formatted_at_creation`).
pub fn formatted_at_creation(pv: &PersistentVolume) -> bool {
    stowage_common::store::pv::formatted_at_creation(pv, stowage_loopdriver::csi::caps::FS_TYPE)
}

/// The file system a class asks for (`csi.storage.k8s.io/fstype`, or the older `fsType`).
pub fn class_fs_type(class: &StorageClass) -> Option<&str> {
    let params = class.parameters.as_ref()?;
    params
        .get("csi.storage.k8s.io/fstype")
        .or_else(|| params.get("fsType"))
        .map(String::as_str)
}

/// The name of the PV provisioned for a claim (one per claim UID, so retries are idempotent).
pub fn provisioned_name(claim: &PersistentVolumeClaim) -> Option<String> {
    claim.metadata.uid.as_ref().map(|u| format!("pvc-{u}"))
}

/// The PV the built-in provisioner creates for `claim` of `class`: pre-bound to the claim, its
/// image still pending, the deleter finalizer in place before any storage exists.
///
/// `node`: local mode, the node whose store gets the image. The volume then requires that node
/// (`TOPOLOGY_KEY In [node]`), the scheduler's choice already checked against the class's allowed
/// topologies, so the class's terms add nothing.
pub fn provisioned_pv(
    claim: &PersistentVolumeClaim,
    class: &StorageClass,
    node: Option<&str>,
) -> Option<PersistentVolume> {
    let name = provisioned_name(claim)?;
    let spec = claim.spec.as_ref()?;
    let request = spec
        .resources
        .as_ref()?
        .requests
        .as_ref()?
        .get("storage")?
        .clone();
    let policy = class.reclaim_policy.clone().unwrap_or_else(|| "Delete".into());
    let fs_type = class_fs_type(class)
        .unwrap_or(stowage_loopdriver::csi::caps::FS_TYPE)
        .to_string();
    let on_node = node.map(|n| VolumeNodeAffinity {
        required: Some(NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm {
                match_expressions: Some(vec![NodeSelectorRequirement {
                    key: stowage_loopdriver::TOPOLOGY_KEY.into(),
                    operator: "In".into(),
                    values: Some(vec![n.to_string()]),
                }]),
                match_fields: None,
            }],
        }),
    });
    let node_affinity = on_node.or_else(|| {
        class
            .allowed_topologies
            .as_ref()
            .filter(|t| !t.is_empty())
            .map(|terms| VolumeNodeAffinity {
                required: Some(NodeSelector {
                    node_selector_terms: terms
                        .iter()
                        .map(|t| NodeSelectorTerm {
                            match_expressions: Some(
                                t.match_label_expressions
                                    .iter()
                                    .flatten()
                                    .map(|e| NodeSelectorRequirement {
                                        key: e.key.clone(),
                                        operator: "In".into(),
                                        values: Some(e.values.clone()),
                                    })
                                    .collect(),
                            ),
                            match_fields: None,
                        })
                        .collect(),
                }),
            })
    });
    let annotations = BTreeMap::from([
        (ANN_PROVISIONED_BY.to_string(), LOOP_DRIVER.to_string()),
        (ANN_BOUND_BY_CONTROLLER.to_string(), "yes".to_string()),
        (ANN_IMAGE_PENDING.to_string(), "true".to_string()),
    ]);
    Some(PersistentVolume {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            annotations: Some(annotations),
            finalizers: (policy == "Delete").then(|| vec![FINALIZER_LOOP_DELETER.to_string()]),
            ..Default::default()
        },
        spec: Some(PersistentVolumeSpec {
            capacity: Some(BTreeMap::from([("storage".to_string(), Quantity(request.0))])),
            access_modes: spec.access_modes.clone(),
            volume_mode: spec.volume_mode.clone(),
            storage_class_name: Some(class.name_any()),
            persistent_volume_reclaim_policy: Some(policy),
            mount_options: class.mount_options.clone(),
            csi: Some(CSIPersistentVolumeSource {
                driver: LOOP_DRIVER.into(),
                volume_handle: name,
                fs_type: Some(fs_type),
                ..Default::default()
            }),
            claim_ref: Some(reference_to(claim)),
            node_affinity,
            volume_attributes_class_name: spec.volume_attributes_class_name.clone(),
            ..Default::default()
        }),
        status: None,
    })
}

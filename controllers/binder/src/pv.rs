//! What the binder reads of PVs and claims: the shared readers of `stowage_common::store::pv`, the
//! annotations and finalizers of `stowage_common::vocab`, and the built-in driver's name and
//! handle rule, from the driver's crate (common knows no driver).

use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolume, PersistentVolumeClaim};
use kube::ResourceExt;
pub use stowage_common::store::pv::*;
pub use stowage_common::vocab::annotations::*;
pub use stowage_common::vocab::migration::*;
/// The built-in driver.
pub use stowage_loopdriver::DRIVER as LOOP_DRIVER;
/// A handle that names a file directly inside the image dir (the driver's one rule).
pub use stowage_loopdriver::valid_handle as plain_handle;

/// Whether this provisioner made the volume (external-provisioner's `shouldDelete`: the
/// provisioned-by annotation names the driver). Only such volumes are ever deleted by it;
/// a hand-made volume's image belongs to whoever made it.
pub fn provisioned_here(pv: &PersistentVolume) -> bool {
    ann(pv, ANN_PROVISIONED_BY) == Some(LOOP_DRIVER)
}

/// The built-in driver's volume handle, when the volume is one of its volumes.
pub fn loop_handle(pv: &PersistentVolume) -> Option<&str> {
    (csi_driver(pv) == Some(LOOP_DRIVER))
        .then(|| volume_handle(pv))
        .flatten()
}

/// The node whose store holds a node-local volume's image (its node affinity on the driver's
/// topology key); `None` for a volume in a shared store.
pub fn loop_node(pv: &PersistentVolume) -> Option<&str> {
    affinity_value(pv, stowage_loopdriver::TOPOLOGY_KEY)
}

/// The claimRef a bind writes (and the built-in provisioner's pre-bound PV carries).
pub fn reference_to(claim: &PersistentVolumeClaim) -> ObjectReference {
    ObjectReference {
        kind: Some("PersistentVolumeClaim".into()),
        api_version: Some("v1".into()),
        namespace: claim.namespace(),
        name: Some(claim.name_any()),
        uid: claim.metadata.uid.clone(),
        resource_version: claim.resource_version(),
        field_path: None,
    }
}

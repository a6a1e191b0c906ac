//! The annotations and finalizers the storage controllers and the agent read and write: upstream's
//! (pv.kubernetes.io/…, volume.kubernetes.io/…, storageclass.kubernetes.io/…) and the built-in
//! driver's own (loop.stowage.dev/…).

pub const ANN_BIND_COMPLETED: &str = "pv.kubernetes.io/bind-completed";
pub const ANN_BOUND_BY_CONTROLLER: &str = "pv.kubernetes.io/bound-by-controller";
pub const ANN_PROVISIONED_BY: &str = "pv.kubernetes.io/provisioned-by";
pub const ANN_STORAGE_PROVISIONER: &str = "volume.kubernetes.io/storage-provisioner";
pub const ANN_BETA_STORAGE_PROVISIONER: &str = "volume.beta.kubernetes.io/storage-provisioner";
pub const ANN_SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";
pub const ANN_BETA_CLASS: &str = "volume.beta.kubernetes.io/storage-class";
pub const ANN_PRE_RESIZE_CAPACITY: &str = "volume.alpha.kubernetes.io/pre-resize-capacity";
pub const ANN_DEFAULT_CLASS: &str = "storageclass.kubernetes.io/is-default-class";
pub const ANN_BETA_DEFAULT_CLASS: &str = "storageclass.beta.kubernetes.io/is-default-class";
/// The built-in driver's PV is created before its image exists; the matcher leaves it alone
/// until the image is there, so no claim binds to a volume without storage.
pub const ANN_IMAGE_PENDING: &str = "loop.stowage.dev/image-pending";
/// The id of the image store (its marker's) that holds a built-in volume's image, written when
/// the image is made: a node or controller whose store has another id refuses the volume.
pub const ANN_STORE_ID: &str = "loop.stowage.dev/store-id";
/// Set by the binder on a built-in volume in a node-local store once it has decided the image is
/// to go (reclaim policy Delete, claim gone, nothing attached): the node holding the image removes
/// it, then the finalizer and the PV object.
pub const ANN_DELETE_IMAGE: &str = "loop.stowage.dev/delete-image";
/// Held on Delete-policy volumes of the built-in driver until their image is removed.
pub const FINALIZER_LOOP_DELETER: &str = "loop.stowage.dev/deleter";

/// Upstream's in-tree deletion guard; never needed on a volume a CSI driver has taken over.
pub const FINALIZER_IN_TREE_PROTECTION: &str = "kubernetes.io/pv-controller";
/// external-provisioner's deletion guard; not for volumes of an in-tree plugin.
pub const FINALIZER_EXTERNAL_PROTECTION: &str = "external-provisioner.volume.kubernetes.io/finalizer";

/// The finalizer the built-in driver's attacher (the agent) puts on its VolumeAttachments, in
/// external-attacher's convention (`external-attacher/` + the driver name with `.` and `/` as `-`),
/// so tools that know that convention recognise it.
pub const LOOP_ATTACHER_FINALIZER: &str = "external-attacher/loop-stowage-dev";

/// The finalizer older versions of the agent used; still honoured (and replaced) so no
/// VolumeAttachment made before an upgrade is stranded.
pub const LEGACY_LOOP_ATTACHER_FINALIZER: &str = "loop.stowage.dev/attached";

/// Is `f` the built-in attacher's finalizer, current or legacy?
pub fn is_loop_attacher_finalizer(f: &str) -> bool {
    f == LOOP_ATTACHER_FINALIZER || f == LEGACY_LOOP_ATTACHER_FINALIZER
}

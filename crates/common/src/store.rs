//! The shared informers and the read model: the forms in which controllers see stored objects
//! (`model`). How those are held is private to this module.

pub mod informer;
pub mod informers;
pub mod model;
mod packed;
pub mod pods;
pub mod pv;
pub mod quantity;
mod slim;

pub use model::{
    BoundClaim, ClaimBinding, CsiSource, IntoStored, PodRead, PodVolume, Storable, Stored, StoredClaim,
    StoredPod, StoredVolume, VolumeAttachment, VolumeAttachmentSource, VolumeAttachmentSpec,
    VolumeAttachmentStatus, VolumeSource,
};

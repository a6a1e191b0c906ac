//! The shared informers and the read model: the forms in which controllers see stored objects
//! (`model`). How those are held is private to this module.

mod attachment;
pub mod informer;
pub mod informers;
pub(crate) mod lean;
pub mod model;
mod packed;
pub mod pods;
pub mod pv;
pub mod quantity;
mod slim;

pub use model::{
    Attachment, AttachmentSource, AttachmentSpec, AttachmentStatus, BoundClaim, ClaimBinding, CsiSource,
    IntoStored, PodRead, PodVolume, Storable, Stored, StoredClaim, StoredPod, StoredVolume, VolumeSource,
};

//! `loop.stowage.dev`, the built-in driver: volumes are sparse image files attached as loop
//! devices. This crate is the driver's one home: the image store (handles and image files), the
//! device steps on a node (losetup, blkid, mkfs, mount, resize2fs, …) and the CSI v1 services
//! that let a kubelet, csi-sanity or the upstream sidecars drive it over gRPC.

pub mod csi;
pub mod fence;
pub mod image;
pub mod mountinfo;
pub mod sys;

pub use image::{HandleError, ImageError, ImageStore, NotReady, check_handle, valid_handle};

/// The driver name (CSI plugin name, `spec.csi.driver`, VolumeAttachment attacher, provisioner).
pub const DRIVER: &str = "loop.stowage.dev";
/// The driver's version as CSI GetPluginInfo reports it.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The key under which the attacher publishes the loop device in the VolumeAttachment's
/// `attachmentMetadata`; the kubelet hands it to NodeStageVolume as `publish_context`.
pub const PUBLISH_DEVICE_KEY: &str = "devicePath";

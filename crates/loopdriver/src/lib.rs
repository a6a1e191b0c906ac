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
/// The topology key a node plugin in local mode reports (CSI `accessible_topology`): the kubelet
/// labels its Node with it, and every volume provisioned there requires it in its node affinity.
pub const TOPOLOGY_KEY: &str = "topology.loop.stowage.dev/node";

/// Where the images of a cluster live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StoreMode {
    /// One store every node mounts (an NFS export, a claim of another driver): no topology,
    /// volumes move between nodes, fenced with ext4 MMP. The controller creates, grows and
    /// deletes images in its own mount of the store.
    #[default]
    Shared,
    /// Each node has a store of its own: volumes are pinned to the node that holds their image
    /// (node affinity on `TOPOLOGY_KEY`), and that node's agent creates, grows and deletes it.
    Local,
}

impl StoreMode {
    pub fn as_str(self) -> &'static str {
        match self {
            StoreMode::Shared => "shared",
            StoreMode::Local => "local",
        }
    }

    pub fn is_local(self) -> bool {
        self == StoreMode::Local
    }
}

impl std::str::FromStr for StoreMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "shared" => Ok(StoreMode::Shared),
            "local" => Ok(StoreMode::Local),
            other => Err(format!("image store mode {other:?}: local or shared")),
        }
    }
}

impl std::fmt::Display for StoreMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

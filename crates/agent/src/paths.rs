//! Names and on-disk layout of the built-in driver on a node. Paths are the only record of what
//! the agent mounted, so they must be parseable back into (pod, volume): that is what lets a
//! restarted agent reconstruct its actual state from the mount table.

use std::path::{Component, Path, PathBuf};

use sha2::{Digest, Sha256};

/// The driver (and VolumeAttachment attacher) this agent serves.
pub use stowage_loopdriver::DRIVER;
/// The plugin directory name of CSI volumes under a pod dir (`/` escaped as `~`, as upstream).
pub const CSI_PLUGIN_DIR: &str = "kubernetes.io~csi";
/// Finalizer that keeps a VolumeAttachment until the loop device is released (one name, shared
/// with the attach/detach controller that may release a dead node's attachment).
pub use stowage_common::vocab::annotations::LOOP_ATTACHER_FINALIZER as VA_FINALIZER;

/// The unique volume name reported in `node.status.volumesInUse` and `volumesAttached`.
pub fn unique_name(handle: &str) -> String {
    format!("kubernetes.io/csi/{DRIVER}^{handle}")
}

/// The name the attach/detach controller gives the VolumeAttachment of (volume, node).
pub fn va_name(handle: &str, node: &str) -> String {
    let mut h = Sha256::new();
    h.update(handle.as_bytes());
    h.update(DRIVER.as_bytes());
    h.update(node.as_bytes());
    format!("csi-{}", hex::encode(h.finalize()))
}

/// A name safe to use as one path component (PV names and pod UIDs are, but the API does not
/// guarantee it for everything we read).
pub fn plain_component(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && !s.contains(['/', '\0']) && s.len() <= 253
}

/// What a path under the root dir stands for.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Place {
    /// The node-global mount of a volume's device.
    Global { pv: String },
    /// A pod's file-system publish target.
    PodMount { uid: String, pv: String },
    /// A pod's block device file.
    PodDevice { uid: String, pv: String },
}

#[derive(Debug, Clone)]
pub struct Layout {
    pub root: PathBuf,
}

impl Layout {
    pub fn new(root: PathBuf) -> Self {
        Self { root }
    }
    pub fn global_dir(&self) -> PathBuf {
        self.root.join("plugins").join(DRIVER).join("globalmount")
    }
    pub fn global_mount(&self, pv: &str) -> PathBuf {
        self.global_dir().join(pv)
    }
    pub fn pods_dir(&self) -> PathBuf {
        self.root.join("pods")
    }
    /// `<root>/pods/<uid>/volumes/kubernetes.io~csi/<pv>`: parent of the publish target.
    pub fn pod_volume_dir(&self, uid: &str, pv: &str) -> PathBuf {
        self.pods_dir()
            .join(uid)
            .join("volumes")
            .join(CSI_PLUGIN_DIR)
            .join(pv)
    }
    pub fn pod_mount(&self, uid: &str, pv: &str) -> PathBuf {
        self.pod_volume_dir(uid, pv).join("mount")
    }
    /// This node's record of an offline repair of `pv` while its tools run
    /// (`<root>/plugins/<driver>/repairs/<pv>`; not a mount point, never parsed back).
    pub fn repair_record(&self, pv: &str) -> PathBuf {
        stowage_loopdriver::fence::record_path(&self.root.join("plugins").join(DRIVER), pv)
    }
    pub fn pod_device(&self, uid: &str, pv: &str) -> PathBuf {
        self.pods_dir()
            .join(uid)
            .join("volumeDevices")
            .join(CSI_PLUGIN_DIR)
            .join(pv)
    }
    pub fn path_of(&self, place: &Place) -> PathBuf {
        match place {
            Place::Global { pv } => self.global_mount(pv),
            Place::PodMount { uid, pv } => self.pod_mount(uid, pv),
            Place::PodDevice { uid, pv } => self.pod_device(uid, pv),
        }
    }

    /// The inverse of the path builders; `None` for anything else (including paths below a
    /// mount point, which belong to the volume's content, not to us).
    pub fn parse(&self, path: &Path) -> Option<Place> {
        let rest = path.strip_prefix(&self.root).ok()?;
        let parts: Vec<&str> = rest
            .components()
            .map(|c| match c {
                Component::Normal(s) => s.to_str(),
                _ => None,
            })
            .collect::<Option<_>>()?;
        match parts.as_slice() {
            ["plugins", d, "globalmount", pv] if *d == DRIVER && plain_component(pv) => {
                Some(Place::Global { pv: pv.to_string() })
            }
            ["pods", uid, "volumes", p, pv, "mount"] if *p == CSI_PLUGIN_DIR => Some(Place::PodMount {
                uid: uid.to_string(),
                pv: pv.to_string(),
            }),
            ["pods", uid, "volumeDevices", p, pv] if *p == CSI_PLUGIN_DIR => Some(Place::PodDevice {
                uid: uid.to_string(),
                pv: pv.to_string(),
            }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_round_trip() {
        let l = Layout::new("/var/lib/stowage".into());
        for place in [
            Place::Global { pv: "pv-1".into() },
            Place::PodMount {
                uid: "u-1".into(),
                pv: "pv-1".into(),
            },
            Place::PodDevice {
                uid: "u-1".into(),
                pv: "pv-1".into(),
            },
        ] {
            assert_eq!(l.parse(&l.path_of(&place)), Some(place));
        }
        assert_eq!(
            l.parse(Path::new(
                "/var/lib/stowage/pods/u/volumes/kubernetes.io~csi/p/mount/x"
            )),
            None
        );
        assert_eq!(
            l.parse(Path::new("/elsewhere/plugins/loop.stowage.dev/globalmount/p")),
            None
        );
    }

    #[test]
    fn va_name_matches_upstream_shape() {
        // sha256("h" + "loop.stowage.dev" + "n"), computed independently.
        let n = va_name("h", "n");
        assert!(n.starts_with("csi-") && n.len() == 68);
        assert_ne!(va_name("h", "n2"), n);
        assert_eq!(unique_name("h"), "kubernetes.io/csi/loop.stowage.dev^h");
    }
}

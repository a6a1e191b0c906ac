//! Which volume capabilities the driver accepts, decided once for every service.
//!
//! A loop image holds one ext4 (or, on node-local stores, XFS) file system, or raw blocks. ext4 is not a cluster file system:
//! mounted read-write by two kernels it is corrupted, so every multi-node mode with a writer is
//! refused. Several nodes may read it only through a read-only loop device and a read-only
//! mount, which is what a reader-only mode gets.

use tonic::Status;

use super::v1::VolumeCapability;
use super::v1::volume_capability::access_mode::Mode as CsiMode;
use super::v1::volume_capability::{AccessType, BlockVolume, MountVolume};

/// The file system the driver makes when none is asked for (an empty fs_type).
pub const FS_TYPE: &str = "ext4";

/// XFS, for node-local stores only: ext4's multi-mount protection is what fences a volume that
/// can move between nodes (shared stores), and XFS has none; a volume that never leaves its node
/// needs none.
pub const XFS: &str = "xfs";

/// The file systems the driver makes and mounts.
pub const FS_TYPES: [&str; 2] = [FS_TYPE, XFS];

/// The file system a request names (empty: the default), or why it cannot be served.
pub fn fs_type(requested: &str) -> Result<&'static str, String> {
    match requested {
        "" => Ok(FS_TYPE),
        t => FS_TYPES.into_iter().find(|f| *f == t).ok_or_else(|| {
            format!(
                "file system {t:?} is not supported: the driver makes and mounts {} (xfs on node-local stores only)",
                FS_TYPES.join(" and ")
            )
        }),
    }
}

/// Why a shared store cannot serve `fs` (XFS has no multi-mount protection), if it cannot.
pub fn shared_refusal(fs: &str) -> Option<String> {
    (fs == XFS).then(|| {
        "file system xfs is served on node-local image stores only: a volume of a shared store can be \
         staged on any node, and only ext4's multi-mount protection keeps two nodes from mounting it \
         read-write at once; use ext4, or imageStore.mode: local"
            .to_string()
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One node, read-write (SINGLE_NODE_WRITER / _SINGLE_WRITER / _MULTI_WRITER).
    SingleNodeWriter,
    /// One node, read-only.
    SingleNodeReader,
    /// Any number of nodes, all read-only.
    MultiNodeReader,
}

impl Mode {
    /// Whether the device and every mount must be read-only.
    pub fn read_only(self) -> bool {
        !matches!(self, Mode::SingleNodeWriter)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Access {
    Block,
    Mount { fs_type: String, flags: Vec<String> },
}

/// A capability the driver can serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requested {
    pub mode: Mode,
    pub access: Access,
}

impl Requested {
    pub fn block(&self) -> bool {
        self.access == Access::Block
    }
}

/// Checks one capability; the error says why it cannot be served.
pub fn check(cap: &VolumeCapability) -> Result<Requested, String> {
    let mode = cap
        .access_mode
        .as_ref()
        .ok_or("volume capability has no access mode")?
        .mode;
    let mode = match CsiMode::try_from(mode).map_err(|_| format!("unknown access mode {mode}"))? {
        CsiMode::SingleNodeWriter | CsiMode::SingleNodeSingleWriter | CsiMode::SingleNodeMultiWriter => {
            Mode::SingleNodeWriter
        }
        CsiMode::SingleNodeReaderOnly => Mode::SingleNodeReader,
        CsiMode::MultiNodeReaderOnly => Mode::MultiNodeReader,
        m @ (CsiMode::MultiNodeSingleWriter | CsiMode::MultiNodeMultiWriter) => {
            return Err(format!(
                "access mode {} is not supported: an ext4 image written by more than one node is \
                 corrupted; use a single-node mode, or MULTI_NODE_READER_ONLY",
                m.as_str_name()
            ));
        }
        CsiMode::Unknown => return Err("access mode is UNKNOWN".into()),
    };
    let access = match cap
        .access_type
        .as_ref()
        .ok_or("volume capability has no access type")?
    {
        AccessType::Block(BlockVolume {}) => Access::Block,
        AccessType::Mount(MountVolume {
            fs_type, mount_flags, ..
        }) => {
            let fs = self::fs_type(fs_type)?;
            if let Some(bad) = mount_flags.iter().find(|f| f.contains(',') || f.is_empty()) {
                return Err(format!("mount flag {bad:?} is not one option"));
            }
            Access::Mount {
                fs_type: fs.into(),
                flags: mount_flags.clone(),
            }
        }
    };
    Ok(Requested { mode, access })
}

/// A required capability, as an argument error when missing or unservable.
pub fn require(cap: Option<&VolumeCapability>) -> Result<Requested, Status> {
    let cap = cap.ok_or_else(|| Status::invalid_argument("volume capability is required"))?;
    check(cap).map_err(Status::invalid_argument)
}

/// Checks a list (CreateVolume, ValidateVolumeCapabilities): all must be servable.
pub fn check_all(caps: &[VolumeCapability]) -> Result<Vec<Requested>, String> {
    if caps.is_empty() {
        return Err("volume capabilities are required".into());
    }
    caps.iter().map(check).collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::csi::v1::volume_capability::AccessMode;

    pub fn cap(mode: CsiMode, access: AccessType) -> VolumeCapability {
        VolumeCapability {
            access_mode: Some(AccessMode { mode: mode as i32 }),
            access_type: Some(access),
        }
    }

    pub fn mount(fs: &str) -> AccessType {
        AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            ..Default::default()
        })
    }

    #[test]
    fn writers_on_several_nodes_are_refused_readers_are_read_only() {
        for m in [
            CsiMode::MultiNodeMultiWriter,
            CsiMode::MultiNodeSingleWriter,
            CsiMode::Unknown,
        ] {
            assert!(check(&cap(m, mount(""))).is_err(), "{m:?}");
        }
        let r = check(&cap(CsiMode::MultiNodeReaderOnly, mount(""))).unwrap();
        assert!(r.mode.read_only());
        let w = check(&cap(
            CsiMode::SingleNodeMultiWriter,
            AccessType::Block(BlockVolume {}),
        ))
        .unwrap();
        assert_eq!(w.mode, Mode::SingleNodeWriter);
        assert!(w.block());
        assert!(
            check(&VolumeCapability {
                access_mode: Some(AccessMode { mode: 99 }),
                access_type: Some(mount("")),
            })
            .is_err()
        );
    }

    #[test]
    fn only_ext4_xfs_and_plain_mount_flags_are_accepted() {
        assert!(check(&cap(CsiMode::SingleNodeWriter, mount("btrfs"))).is_err());
        let xfs = check(&cap(CsiMode::SingleNodeWriter, mount("xfs"))).unwrap();
        assert!(matches!(xfs.access, Access::Mount { ref fs_type, .. } if fs_type == "xfs"));
        assert!(shared_refusal("xfs").is_some());
        assert!(shared_refusal("ext4").is_none());
        let ok = check(&cap(CsiMode::SingleNodeWriter, mount(""))).unwrap();
        assert_eq!(
            ok.access,
            Access::Mount {
                fs_type: "ext4".into(),
                flags: vec![]
            }
        );
        let bad_flag = AccessType::Mount(MountVolume {
            mount_flags: vec!["ro,exec".into()],
            ..Default::default()
        });
        assert!(check(&cap(CsiMode::SingleNodeWriter, bad_flag)).is_err());
        assert!(check_all(&[]).is_err());
        assert!(require(None).is_err());
        let no_type = VolumeCapability {
            access_mode: Some(AccessMode {
                mode: CsiMode::SingleNodeWriter as i32,
            }),
            access_type: None,
        };
        assert!(check(&no_type).is_err());
    }
}

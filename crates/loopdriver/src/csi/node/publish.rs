//! NodePublishVolume and NodeUnpublishVolume: the bind mount of the staging mount (or, for Block,
//! the device node) at the pod's target, and its removal.

use std::path::{Path, PathBuf};

use tonic::Status;

use super::{NodeService, io_status};
use crate::csi::caps::{self, Requested};
use crate::csi::v1::{NodePublishVolumeRequest, NodeUnpublishVolumeRequest};
use crate::csi::{required, sys_status};
use crate::sys;

impl NodeService {
    pub(super) async fn publish(&self, req: NodePublishVolumeRequest) -> Result<(), Status> {
        let id = required(&req.volume_id, "volume id")?;
        let target = PathBuf::from(required(&req.target_path, "target path")?);
        let cap = caps::require(req.volume_capability.as_ref())?;
        let staging = PathBuf::from(required(&req.staging_target_path, "staging target path")?);
        let image = self.image(id).await?;
        let _guard = self.lock(id)?;
        let read_only = req.readonly || cap.mode.read_only();
        let source = self.publish_source(id, &image, &staging, &cap).await?;
        if let Some(m) = self.mounted(&target).await? {
            // A bound device node shows devtmpfs in the mount table; its rdev names the device.
            let (have, want) = if cap.block() {
                (sys::rdev(&target).await, sys::rdev(&source).await)
            } else {
                (Some(m.devno), sys::stat_dev(&source).await)
            };
            if have.is_some() && have == want && (m.read_only() || !read_only) {
                return Ok(());
            }
            return Err(Status::already_exists(format!(
                "target {} is already mounted with another device or mode than volume {id} asks",
                target.display()
            )));
        }
        if cap.block() {
            if let Some(parent) = target.parent() {
                tokio::fs::create_dir_all(parent)
                    .await
                    .map_err(|e| io_status("cannot create", parent, e))?;
            }
            if tokio::fs::symlink_metadata(&target).await.is_err() {
                tokio::fs::write(&target, b"")
                    .await
                    .map_err(|e| io_status("cannot create", &target, e))?;
            }
        } else {
            tokio::fs::create_dir_all(&target)
                .await
                .map_err(|e| io_status("cannot create", &target, e))?;
        }
        sys::bind_mount(&source, &target, read_only)
            .await
            .map_err(|e| sys_status("mount --bind", e))
    }

    /// What publish binds at the target: the staging mount, or the device node for Block.
    async fn publish_source(
        &self,
        id: &str,
        image: &Path,
        staging: &Path,
        cap: &Requested,
    ) -> Result<PathBuf, Status> {
        if cap.block() {
            return match self.record(id).await {
                Some(s) if sys::backs(&s.device, image).await => Ok(PathBuf::from(s.device)),
                _ => Err(Status::failed_precondition(format!(
                    "volume {id} is not staged on this node"
                ))),
            };
        }
        if self.mounted(staging).await?.is_none() {
            return Err(Status::failed_precondition(format!(
                "volume {id} is not staged at {}",
                staging.display()
            )));
        }
        Ok(staging.to_path_buf())
    }

    pub(super) async fn unpublish(&self, req: NodeUnpublishVolumeRequest) -> Result<(), Status> {
        let id = required(&req.volume_id, "volume id")?;
        let target = PathBuf::from(required(&req.target_path, "target path")?);
        let _guard = self.lock(id)?;
        sys::unmount(&target, false)
            .await
            .map_err(|e| sys_status("umount", e))?;
        // What publish made goes too; a directory that still holds files after the unmount is
        // someone's data written beside the volume, never removed.
        match tokio::fs::symlink_metadata(&target).await {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_status("cannot stat", &target, e)),
            Ok(m) if m.is_dir() => tokio::fs::remove_dir(&target).await.map_err(|e| {
                io_status(
                    "cannot remove (not empty after unmount, left for inspection)",
                    &target,
                    e,
                )
            }),
            Ok(_) => tokio::fs::remove_file(&target)
                .await
                .map_err(|e| io_status("cannot remove", &target, e)),
        }
    }
}

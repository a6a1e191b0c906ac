//! NodeStageVolume and NodeUnstageVolume: the device (taken from the attacher or attached here),
//! its file system (formatted only when blank and writable; ext4 with multi-mount protection
//! turned on before a read-write mount and grown offline when the image grew, XFS (node-local
//! stores) grown once mounted), and the staging mount.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tonic::Status;

use super::staged::Staged;
use super::{NodeService, io_status};
use crate::PUBLISH_DEVICE_KEY;
use crate::csi::caps::{self, Access};
use crate::csi::v1::{NodeStageVolumeRequest, NodeUnstageVolumeRequest};
use crate::csi::{VolumeGuard, required, sys_status};
use crate::fence;
use crate::sys::{self, Probe};

impl NodeService {
    /// The loop device that stage should use, and whether stage makes it.
    async fn device_for(
        &self,
        id: &str,
        image: &Path,
        publish_context: &HashMap<String, String>,
        read_only: bool,
    ) -> Result<Staged, Status> {
        if let Some(dev) = publish_context.get(PUBLISH_DEVICE_KEY) {
            // A device path from an attachment can go stale (freed, reused for another image):
            // mounting it unchecked could expose or format someone else's data.
            if sys::backs(dev, image).await {
                return Ok(Staged {
                    device: dev.clone(),
                    attached_here: false,
                });
            }
            return Err(Status::failed_precondition(format!(
                "device {dev} of the attachment no longer backs volume {id}; waiting for the attacher to attach it again"
            )));
        }
        if let Some(prev) = self.record(id).await
            && sys::backs(&prev.device, image).await
        {
            return Ok(prev);
        }
        // No attacher in front of this node plugin: the node attaches the image itself.
        let loops = sys::loops_of(image)
            .await
            .map_err(|e| sys_status("losetup -j", e))?;
        if let Some(dev) = loops.into_iter().next() {
            return Ok(Staged {
                device: dev,
                attached_here: false,
            });
        }
        let dev = sys::loop_attach(image, read_only)
            .await
            .map_err(|e| sys_status("losetup", e))?;
        Ok(Staged {
            device: dev,
            attached_here: true,
        })
    }

    /// Makes sure a file system of type `fs` is on the device: formats only a blank, writable one.
    async fn ensure_fs(&self, id: &str, dev: &str, read_only: bool, fs: &str) -> Result<(), Status> {
        match sys::probe(dev).await.map_err(|e| sys_status("blkid", e))? {
            Probe::Found(t) if t == fs => Ok(()),
            Probe::Found(t) => Err(Status::failed_precondition(format!(
                "volume {id} holds {t}, not {fs}; it is never reformatted"
            ))),
            Probe::Blank if read_only => Err(Status::failed_precondition(format!(
                "volume {id} has no file system and is staged read-only; a writer must stage it first"
            ))),
            Probe::Blank => {
                let devno = sys::rdev(Path::new(dev)).await;
                let writable = match devno {
                    Some(d) => sys::device_read_only(d).await == Some(false),
                    None => false,
                };
                if !writable {
                    return Err(Status::failed_precondition(format!(
                        "device {dev} of volume {id} is read-only or unreadable; not formatting it"
                    )));
                }
                tracing::info!(volume = %id, device = %dev, fs, "formatting blank device");
                sys::mkfs(fs, dev)
                    .await
                    .map_err(|e| sys_status(&format!("mkfs.{fs}"), e))
            }
        }
    }

    /// Grows the file system to its device before it is mounted when an expansion happened while
    /// nothing could grow it online (unstaged, or online resize not permitted on this node).
    ///
    /// The check and resize run in a task of their own that holds `guard` until they end
    /// (`repair.rs`): a cancelled stage never kills them halfway. This stage waits for them a
    /// while; a later one takes their result.
    ///
    /// `force`: check (and grow, if need be) even when the sizes match, because a repair of this
    /// node was stopped halfway (`fence::Ready::RepairFirst`).
    async fn grow_offline(
        &self,
        id: &str,
        dev: &str,
        force: bool,
        guard: &Arc<VolumeGuard>,
    ) -> Result<(), Status> {
        // A repair an earlier (cancelled or impatient) stage left has ended: its failure is this
        // stage's answer, as if it had run here; after a success the sizes below match.
        if let Some(result) = self.repairs.take_finished(id) {
            result?;
        }
        let record = fence::record_path(&self.state_dir, id);
        if force {
            return self.repairs.run(id, dev, record, guard.clone()).await;
        }
        let Some(devno) = sys::rdev(Path::new(dev)).await else {
            return Ok(());
        };
        sys::loop_refresh(dev)
            .await
            .map_err(|e| sys_status("losetup -c", e))?;
        let (Some(device), Ok(fs)) = (sys::device_bytes(devno).await, sys::ext_fs_bytes(dev).await) else {
            return Ok(());
        };
        if fs >= device {
            return Ok(());
        }
        tracing::info!(volume = %id, device = %dev, from = fs, to = device, "growing the file system before mounting");
        self.repairs.run(id, dev, record, guard.clone()).await
    }

    pub(super) async fn stage(&self, req: NodeStageVolumeRequest) -> Result<(), Status> {
        let id = required(&req.volume_id, "volume id")?;
        let staging = PathBuf::from(required(&req.staging_target_path, "staging target path")?);
        let cap = caps::require(req.volume_capability.as_ref())?;
        let image = self.image(id).await?;
        // Shared with an offline repair this stage may start, which keeps the lock after a
        // cancelled stage drops its own.
        let guard = Arc::new(self.lock(id)?);
        let read_only = cap.mode.read_only();
        let staged = self
            .device_for(id, &image, &req.publish_context, read_only)
            .await?;
        // Recorded before anything can fail, so unstage frees a device stage attached.
        self.save(id, &staged).await?;
        let Access::Mount { flags, fs_type } = &cap.access else {
            // Block: nothing to mount; publish binds the device node itself.
            return Ok(());
        };
        if !self.local
            && let Some(why) = caps::shared_refusal(fs_type)
        {
            return Err(Status::failed_precondition(why));
        }
        let devno = sys::rdev(Path::new(&staged.device)).await;
        if let Some(m) = self.mounted(&staging).await? {
            if Some(m.devno) == devno && m.read_only() == read_only {
                return Ok(());
            }
            if Some(m.devno) == devno {
                // Same device, other mode: answering OK would hand a writer a read-only mount
                // (writes fail later) or a reader a writable one (a reader mode's promise broken).
                return Err(Status::already_exists(format!(
                    "volume {id} is already staged at {} {}, and {} was asked; unstage it first",
                    staging.display(),
                    mode_word(m.read_only()),
                    mode_word(read_only)
                )));
            }
            return Err(Status::already_exists(format!(
                "staging path {} holds another device ({}:{}) than volume {id}",
                staging.display(),
                m.devno.0,
                m.devno.1
            )));
        }
        self.ensure_fs(id, &staged.device, read_only, fs_type).await?;
        let xfs = fs_type == caps::XFS;
        if !read_only && !xfs {
            // MMP before the mount (and before an offline repair, which would otherwise wait on
            // a "fsck" number its own stopped predecessor left). A read-only mount never
            // touches the MMP block and never turns it on.
            let ready =
                fence::ready_for_write(&staged.device, &image, &fence::record_path(&self.state_dir, id))
                    .await
                    .map_err(|e| sys_status("multi-mount protection", e))?;
            let force = ready == fence::Ready::RepairFirst;
            self.grow_offline(id, &staged.device, force, &guard).await?;
        }
        tokio::fs::create_dir_all(&staging)
            .await
            .map_err(|e| io_status("cannot create", &staging, e))?;
        sys::mount_device_with(&staged.device, &staging, read_only, flags)
            .await
            .map_err(|e| sys_status("mount", e))?;
        if xfs && !read_only {
            // XFS grows only while mounted: an image grown while the volume was not staged is
            // taken up here (a no-op when the sizes match).
            sys::loop_refresh(&staged.device)
                .await
                .map_err(|e| sys_status("losetup -c", e))?;
            sys::xfs_growfs(&staging)
                .await
                .map_err(|e| sys_status("xfs_growfs", e))?;
        }
        Ok(())
    }

    pub(super) async fn unstage(&self, req: NodeUnstageVolumeRequest) -> Result<(), Status> {
        let id = required(&req.volume_id, "volume id")?;
        let staging = PathBuf::from(required(&req.staging_target_path, "staging target path")?);
        let _guard = self.lock(id)?;
        // A repair result no stage took is stale once the volume is unstaged.
        self.repairs.forget(id);
        sys::unmount(&staging, false)
            .await
            .map_err(|e| sys_status("umount", e))?;
        if self.images.path(id).is_err() {
            return Ok(());
        }
        if let Some(staged) = self.record(id).await {
            if staged.attached_here
                && let Ok(image) = self.images.path(id)
                && sys::backs(&staged.device, &image).await
            {
                sys::loop_detach(&staged.device)
                    .await
                    .map_err(|e| sys_status("losetup -d", e))?;
            }
            self.forget(id).await?;
        }
        Ok(())
    }
}

fn mode_word(read_only: bool) -> &'static str {
    if read_only { "read-only" } else { "read-write" }
}

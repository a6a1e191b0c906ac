//! CSI Node: the loop device, the file system and the mounts on this node.
//!
//! Stage attaches (or takes the attacher's device from `publish_context`), formats only a blank
//! writable device, and mounts it at the staging path; publish bind-mounts the staging mount (or,
//! for Block volumes, the device node) at the pod's target. The mount table is the record of
//! what is mounted; the only other record is a small file per staged volume naming its device
//! and whether stage attached it, so unstage frees exactly what stage took, across restarts.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tonic::{Request, Response, Status};

use super::caps::{self, Access, Requested};
use super::v1::node_server::Node;
use super::v1::node_service_capability::{self, rpc};
use super::v1::*;
use super::{VolumeLocks, image_status, required, sys_status};
use crate::sys::{self, Probe};
use crate::{ImageStore, PUBLISH_DEVICE_KEY};

#[derive(Debug, Clone)]
pub struct NodeService {
    pub node_id: String,
    pub images: ImageStore,
    /// Where the per-volume stage records live (`<state_dir>/staged/<volume id>`).
    pub state_dir: PathBuf,
    /// Volumes this node may hold at once (0: no limit), reported to the scheduler.
    pub max_volumes: i64,
    pub locks: VolumeLocks,
}

/// What stage did for a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Staged {
    pub device: String,
    /// Stage made the loop device itself (no attacher in front); unstage frees it.
    pub attached_here: bool,
}

impl Staged {
    fn encode(&self) -> String {
        format!("device={}\nattached_here={}\n", self.device, self.attached_here)
    }

    fn decode(s: &str) -> Option<Self> {
        let mut device = None;
        let mut attached_here = None;
        for line in s.lines() {
            match line.split_once('=') {
                Some(("device", d)) if d.starts_with("/dev/") => device = Some(d.to_string()),
                Some(("attached_here", b)) => attached_here = b.parse().ok(),
                _ => {}
            }
        }
        Some(Self {
            device: device?,
            attached_here: attached_here?,
        })
    }
}

fn io_status(what: &str, path: &Path, e: std::io::Error) -> Status {
    Status::internal(format!("{what} {}: {e}", path.display()))
}

impl NodeService {
    fn record_path(&self, id: &str) -> PathBuf {
        // `id` passed the handle rules: a plain file name.
        self.state_dir.join("staged").join(id)
    }

    async fn record(&self, id: &str) -> Option<Staged> {
        let s = tokio::fs::read_to_string(self.record_path(id)).await.ok()?;
        Staged::decode(&s)
    }

    async fn save(&self, id: &str, staged: &Staged) -> Result<(), Status> {
        let path = self.record_path(id);
        let dir = path.parent().expect("record has a parent");
        tokio::fs::create_dir_all(dir)
            .await
            .map_err(|e| io_status("cannot create", dir, e))?;
        let tmp = path.with_extension("tmp");
        tokio::fs::write(&tmp, staged.encode())
            .await
            .map_err(|e| io_status("cannot write", &tmp, e))?;
        tokio::fs::rename(&tmp, &path)
            .await
            .map_err(|e| io_status("cannot write", &path, e))
    }

    async fn forget(&self, id: &str) -> Result<(), Status> {
        let path = self.record_path(id);
        match tokio::fs::remove_file(&path).await {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io_status("cannot remove", &path, e)),
            _ => Ok(()),
        }
    }

    /// The image of an existing volume; NotFound for an id no image has (a bad handle included).
    async fn image(&self, id: &str) -> Result<PathBuf, Status> {
        let not_found = || {
            Status::not_found(format!(
                "volume {id} does not exist in {}",
                self.images.dir().display()
            ))
        };
        let path = self.images.path(id).map_err(|_| not_found())?;
        match tokio::fs::metadata(&path).await {
            Ok(_) => Ok(path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(not_found()),
            Err(e) => Err(io_status("cannot stat", &path, e)),
        }
    }

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

    /// Makes sure a file system is on the device: formats only a blank, writable one.
    async fn ensure_fs(&self, id: &str, dev: &str, read_only: bool) -> Result<(), Status> {
        match sys::probe(dev).await.map_err(|e| sys_status("blkid", e))? {
            Probe::Found(t) if t == caps::FS_TYPE => Ok(()),
            Probe::Found(t) => Err(Status::failed_precondition(format!(
                "volume {id} holds {t}, not {}; it is never reformatted",
                caps::FS_TYPE
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
                tracing::info!(volume = %id, device = %dev, "formatting blank device");
                sys::mkfs_ext4(dev).await.map_err(|e| sys_status("mkfs.ext4", e))
            }
        }
    }

    /// Grows the file system to its device before it is mounted when an expansion happened while
    /// nothing could grow it online (unstaged, or online resize not permitted on this node).
    async fn grow_offline(&self, id: &str, dev: &str) -> Result<(), Status> {
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
        sys::fsck_ext(dev).await.map_err(|e| sys_status("e2fsck", e))?;
        sys::resize2fs(dev).await.map_err(|e| sys_status("resize2fs", e))
    }

    /// The single mount at `path`, if any, with its device numbers.
    async fn mounted(&self, path: &Path) -> Result<Option<crate::mountinfo::MountEntry>, Status> {
        let mut at = sys::mounts_at(path)
            .await
            .map_err(|e| sys_status("mount table", e))?;
        Ok(at.pop())
    }

    async fn stage(&self, req: NodeStageVolumeRequest) -> Result<(), Status> {
        let id = required(&req.volume_id, "volume id")?;
        let staging = PathBuf::from(required(&req.staging_target_path, "staging target path")?);
        let cap = caps::require(req.volume_capability.as_ref())?;
        let image = self.image(id).await?;
        let _guard = self.locks.try_lock(id)?;
        let read_only = cap.mode.read_only();
        let staged = self
            .device_for(id, &image, &req.publish_context, read_only)
            .await?;
        // Recorded before anything can fail, so unstage frees a device stage attached.
        self.save(id, &staged).await?;
        let Access::Mount { flags, .. } = &cap.access else {
            // Block: nothing to mount; publish binds the device node itself.
            return Ok(());
        };
        let devno = sys::rdev(Path::new(&staged.device)).await;
        if let Some(m) = self.mounted(&staging).await? {
            if Some(m.devno) == devno {
                return Ok(());
            }
            return Err(Status::already_exists(format!(
                "staging path {} holds another device ({}:{}) than volume {id}",
                staging.display(),
                m.devno.0,
                m.devno.1
            )));
        }
        self.ensure_fs(id, &staged.device, read_only).await?;
        if !read_only {
            self.grow_offline(id, &staged.device).await?;
        }
        tokio::fs::create_dir_all(&staging)
            .await
            .map_err(|e| io_status("cannot create", &staging, e))?;
        sys::mount_device_with(&staged.device, &staging, read_only, flags)
            .await
            .map_err(|e| sys_status("mount", e))
    }

    async fn unstage(&self, req: NodeUnstageVolumeRequest) -> Result<(), Status> {
        let id = required(&req.volume_id, "volume id")?;
        let staging = PathBuf::from(required(&req.staging_target_path, "staging target path")?);
        let _guard = self.locks.try_lock(id)?;
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

    async fn publish(&self, req: NodePublishVolumeRequest) -> Result<(), Status> {
        let id = required(&req.volume_id, "volume id")?;
        let target = PathBuf::from(required(&req.target_path, "target path")?);
        let cap = caps::require(req.volume_capability.as_ref())?;
        let staging = PathBuf::from(required(&req.staging_target_path, "staging target path")?);
        let image = self.image(id).await?;
        let _guard = self.locks.try_lock(id)?;
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

    async fn unpublish(&self, req: NodeUnpublishVolumeRequest) -> Result<(), Status> {
        let id = required(&req.volume_id, "volume id")?;
        let target = PathBuf::from(required(&req.target_path, "target path")?);
        let _guard = self.locks.try_lock(id)?;
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

    /// The loop device of a volume on this node, from stage's record or the kernel.
    async fn device_of(&self, id: &str, image: &Path) -> Result<Option<String>, Status> {
        if let Some(s) = self.record(id).await
            && sys::backs(&s.device, image).await
        {
            return Ok(Some(s.device));
        }
        let loops = sys::loops_of(image)
            .await
            .map_err(|e| sys_status("losetup -j", e))?;
        Ok(loops.into_iter().next())
    }

    async fn expand(&self, req: NodeExpandVolumeRequest) -> Result<u64, Status> {
        let id = required(&req.volume_id, "volume id")?;
        let path = PathBuf::from(required(&req.volume_path, "volume path")?);
        let image = self.image(id).await?;
        let meta = tokio::fs::metadata(&path)
            .await
            .map_err(|_| Status::not_found(format!("volume path {} does not exist", path.display())))?;
        let block = match req.volume_capability.as_ref() {
            Some(c) => caps::check(c).map_err(Status::invalid_argument)?.block(),
            None => !meta.is_dir(),
        };
        let _guard = self.locks.try_lock(id)?;
        let size = self.images.size(id).map_err(image_status)?;
        if let Some(r) = &req.capacity_range
            && r.required_bytes > 0
            && r.required_bytes as u64 > size
        {
            return Err(Status::out_of_range(format!(
                "volume {id} is {size} bytes, less than the {} asked: expand it on the controller first",
                r.required_bytes
            )));
        }
        let dev = self.device_of(id, &image).await?.ok_or_else(|| {
            Status::failed_precondition(format!("volume {id} is not attached on this node"))
        })?;
        sys::loop_refresh(&dev)
            .await
            .map_err(|e| sys_status("losetup -c", e))?;
        // ext4 grows online while mounted.
        if !block && let Err(e) = sys::resize2fs(&dev).await {
            let mut message = format!("resize2fs: {e}");
            if message.contains("Permission denied") {
                // Online ext4 growth needs CAP_SYS_RESOURCE; stage grows it offline instead.
                message.push_str(
                    "; online resize is not permitted here (CAP_SYS_RESOURCE missing), the file \
                     system grows when the volume is next staged",
                );
            }
            return Err(Status::internal(message));
        }
        Ok(size)
    }

    async fn stats(&self, req: NodeGetVolumeStatsRequest) -> Result<NodeGetVolumeStatsResponse, Status> {
        let id = required(&req.volume_id, "volume id")?;
        let path = PathBuf::from(required(&req.volume_path, "volume path")?);
        let image = self.image(id).await?;
        let meta = tokio::fs::metadata(&path)
            .await
            .map_err(|_| Status::not_found(format!("volume path {} does not exist", path.display())))?;
        let mount = self.mounted(&path).await?;
        let dev = self.device_of(id, &image).await?;
        let devno = match &dev {
            Some(d) => sys::rdev(Path::new(d)).await,
            None => None,
        };
        let mut problems = vec![];
        match (&mount, devno) {
            (None, _) => problems.push(format!("{} is not mounted", path.display())),
            (Some(_), None) => problems.push(format!("no loop device backs volume {id} on this node")),
            (Some(m), Some(d)) if m.devno != d => problems.push(format!(
                "{} is mounted from {}:{}, not from the volume's loop device",
                path.display(),
                m.devno.0,
                m.devno.1
            )),
            _ => {}
        }
        let mut usage = vec![];
        if meta.is_dir() {
            match sys::statvfs(&path).await {
                Ok(Some(u)) => {
                    usage.push(VolumeUsage {
                        available: u.bytes_available as i64,
                        total: u.bytes_total as i64,
                        used: (u.bytes_total - u.bytes_free) as i64,
                        unit: volume_usage::Unit::Bytes as i32,
                    });
                    usage.push(VolumeUsage {
                        available: u.inodes_free as i64,
                        total: u.inodes_total as i64,
                        used: (u.inodes_total - u.inodes_free) as i64,
                        unit: volume_usage::Unit::Inodes as i32,
                    });
                }
                Ok(None) => problems.push(format!("{} does not answer statvfs", path.display())),
                Err(e) => problems.push(e.to_string()),
            }
        } else {
            let size = self.images.size(id).map_err(image_status)?;
            usage.push(VolumeUsage {
                total: size as i64,
                unit: volume_usage::Unit::Bytes as i32,
                ..Default::default()
            });
        }
        Ok(NodeGetVolumeStatsResponse {
            usage,
            volume_condition: Some(VolumeCondition {
                abnormal: !problems.is_empty(),
                message: if problems.is_empty() {
                    "volume is mounted from its loop device".into()
                } else {
                    problems.join("; ")
                },
            }),
        })
    }
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_stage_volume(
        &self,
        request: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        self.stage(request.into_inner()).await?;
        Ok(Response::new(NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        self.unstage(request.into_inner()).await?;
        Ok(Response::new(NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        self.publish(request.into_inner()).await?;
        Ok(Response::new(NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        self.unpublish(request.into_inner()).await?;
        Ok(Response::new(NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        Ok(Response::new(self.stats(request.into_inner()).await?))
    }

    async fn node_expand_volume(
        &self,
        request: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        let capacity = self.expand(request.into_inner()).await?;
        Ok(Response::new(NodeExpandVolumeResponse {
            capacity_bytes: capacity as i64,
        }))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        let capabilities = [
            rpc::Type::StageUnstageVolume,
            rpc::Type::ExpandVolume,
            rpc::Type::GetVolumeStats,
            rpc::Type::VolumeCondition,
        ]
        .into_iter()
        .map(|t| NodeServiceCapability {
            r#type: Some(node_service_capability::Type::Rpc(node_service_capability::Rpc {
                r#type: t as i32,
            })),
        })
        .collect();
        Ok(Response::new(NodeGetCapabilitiesResponse { capabilities }))
    }

    async fn node_get_info(
        &self,
        _: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        Ok(Response::new(NodeGetInfoResponse {
            node_id: self.node_id.clone(),
            max_volumes_per_node: self.max_volumes,
            // Images live in one directory every node reaches; no topology to report.
            accessible_topology: None,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::csi::caps::tests::{cap, mount};
    use crate::csi::v1::volume_capability::access_mode::Mode as CsiMode;
    use tonic::Code;

    fn svc(dir: &Path) -> NodeService {
        NodeService {
            node_id: "n".into(),
            images: ImageStore::new(dir.join("images")),
            state_dir: dir.join("state"),
            max_volumes: 7,
            locks: VolumeLocks::default(),
        }
    }

    fn code<T>(r: Result<T, Status>) -> Code {
        r.err().map(|s| s.code()).unwrap_or(Code::Ok)
    }

    fn writer() -> Option<VolumeCapability> {
        Some(cap(CsiMode::SingleNodeWriter, mount("")))
    }

    /// Every method refuses a missing argument, an unservable capability and an unknown volume
    /// before it touches a device (none of these calls needs root: they never get that far).
    #[tokio::test]
    async fn argument_errors_and_unknown_volumes() {
        let dir = tempfile::tempdir().unwrap();
        let s = svc(dir.path());
        std::fs::create_dir_all(dir.path().join("images")).unwrap();
        let stage = |id: &str, path: &str, cap| NodeStageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: path.into(),
            volume_capability: cap,
            ..Default::default()
        };
        assert_eq!(
            code(s.stage(stage("", "/s", writer())).await),
            Code::InvalidArgument
        );
        assert_eq!(
            code(s.stage(stage("v", "", writer())).await),
            Code::InvalidArgument
        );
        assert_eq!(code(s.stage(stage("v", "/s", None)).await), Code::InvalidArgument);
        let rwx = Some(cap(CsiMode::MultiNodeMultiWriter, mount("")));
        assert_eq!(code(s.stage(stage("v", "/s", rwx)).await), Code::InvalidArgument);
        assert_eq!(code(s.stage(stage("v", "/s", writer())).await), Code::NotFound);
        assert_eq!(code(s.stage(stage("../v", "/s", writer())).await), Code::NotFound);

        let unstage = |id: &str, path: &str| NodeUnstageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: path.into(),
        };
        assert_eq!(code(s.unstage(unstage("", "/s")).await), Code::InvalidArgument);
        assert_eq!(code(s.unstage(unstage("v", "")).await), Code::InvalidArgument);

        let publish = |id: &str, target: &str, staging: &str, cap| NodePublishVolumeRequest {
            volume_id: id.into(),
            target_path: target.into(),
            staging_target_path: staging.into(),
            volume_capability: cap,
            ..Default::default()
        };
        assert_eq!(
            code(s.publish(publish("", "/t", "/s", writer())).await),
            Code::InvalidArgument
        );
        assert_eq!(
            code(s.publish(publish("v", "", "/s", writer())).await),
            Code::InvalidArgument
        );
        assert_eq!(
            code(s.publish(publish("v", "/t", "/s", None)).await),
            Code::InvalidArgument
        );
        assert_eq!(
            code(s.publish(publish("v", "/t", "", writer())).await),
            Code::InvalidArgument
        );
        assert_eq!(
            code(s.publish(publish("v", "/t", "/s", writer())).await),
            Code::NotFound
        );

        let unpublish = |id: &str, target: &str| NodeUnpublishVolumeRequest {
            volume_id: id.into(),
            target_path: target.into(),
        };
        assert_eq!(
            code(s.unpublish(unpublish("", "/t")).await),
            Code::InvalidArgument
        );
        assert_eq!(code(s.unpublish(unpublish("v", "")).await), Code::InvalidArgument);

        let expand = |id: &str, path: &str| NodeExpandVolumeRequest {
            volume_id: id.into(),
            volume_path: path.into(),
            ..Default::default()
        };
        assert_eq!(code(s.expand(expand("", "/t")).await), Code::InvalidArgument);
        assert_eq!(code(s.expand(expand("v", "")).await), Code::InvalidArgument);
        assert_eq!(code(s.expand(expand("v", "/t")).await), Code::NotFound);

        let stats = |id: &str, path: &str| NodeGetVolumeStatsRequest {
            volume_id: id.into(),
            volume_path: path.into(),
            ..Default::default()
        };
        assert_eq!(code(s.stats(stats("", "/t")).await), Code::InvalidArgument);
        assert_eq!(code(s.stats(stats("v", "")).await), Code::InvalidArgument);
        assert_eq!(code(s.stats(stats("v", "/t")).await), Code::NotFound);
        // An existing volume at a path that does not exist.
        std::fs::write(dir.path().join("images/v.img"), b"").unwrap();
        assert_eq!(code(s.stats(stats("v", "some/path")).await), Code::NotFound);
        assert_eq!(code(s.expand(expand("v", "some/path")).await), Code::NotFound);

        // A busy volume.
        let _held = s.locks.try_lock("v").unwrap();
        assert_eq!(code(s.stage(stage("v", "/s", writer())).await), Code::Aborted);

        let info = s
            .node_get_info(Request::new(NodeGetInfoRequest {}))
            .await
            .unwrap()
            .into_inner();
        assert_eq!((info.node_id.as_str(), info.max_volumes_per_node), ("n", 7));
    }

    #[test]
    fn stage_records_read_back_and_refuse_garbage() {
        let r = Staged {
            device: "/dev/loop3".into(),
            attached_here: true,
        };
        assert_eq!(Staged::decode(&r.encode()), Some(r));
        assert_eq!(Staged::decode("device=/etc/passwd\nattached_here=true\n"), None);
        assert_eq!(Staged::decode("device=/dev/loop1\n"), None);
    }
}

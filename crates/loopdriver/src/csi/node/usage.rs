//! NodeExpandVolume and NodeGetVolumeStats: growing a staged volume online, and what it holds and
//! whether its mount is still its loop device.

use std::path::{Path, PathBuf};

use tonic::Status;

use super::NodeService;
use crate::csi::caps;
use crate::csi::v1::*;
use crate::csi::{image_status, required, sys_status};
use crate::sys;

impl NodeService {
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

    pub(super) async fn expand(&self, req: NodeExpandVolumeRequest) -> Result<u64, Status> {
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
        let _guard = self.lock(id)?;
        let mut size = self.images.size(id).map_err(image_status)?;
        let required = req
            .capacity_range
            .as_ref()
            .map_or(0, |r| u64::try_from(r.required_bytes).unwrap_or(0));
        if self.local && required > size {
            // Local mode: the image is on this node only, so the controller recorded the new
            // size and left the growing to this call (a grow never shrinks or creates).
            let (store, h) = (self.images.clone(), id.to_string());
            size = tokio::task::spawn_blocking(move || store.grow(&h, required))
                .await
                .map_err(|e| Status::internal(format!("growing the image: {e}")))?
                .map_err(image_status)?;
        }
        if required > size {
            return Err(Status::out_of_range(format!(
                "volume {id} is {size} bytes, less than the {required} asked: expand it on the controller first"
            )));
        }
        let dev = self.device_of(id, &image).await?.ok_or_else(|| {
            Status::failed_precondition(format!("volume {id} is not attached on this node"))
        })?;
        sys::loop_refresh(&dev)
            .await
            .map_err(|e| sys_status("losetup -c", e))?;
        // XFS grows through its mount point (the volume path is one).
        let xfs = !block && matches!(sys::probe(&dev).await, Ok(sys::Probe::Found(t)) if t == caps::XFS);
        if xfs {
            sys::xfs_growfs(&path)
                .await
                .map_err(|e| sys_status("xfs_growfs", e))?;
            return Ok(size);
        }
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

    pub(super) async fn stats(
        &self,
        req: NodeGetVolumeStatsRequest,
    ) -> Result<NodeGetVolumeStatsResponse, Status> {
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
            // Block: the bind of a device node shows devtmpfs's numbers in the mount table; the
            // device is the one the bound node names (its rdev).
            (Some(_), Some(d)) if !meta.is_dir() => match sys::rdev(&path).await {
                Some(bound) if bound == d => {}
                Some(bound) => problems.push(format!(
                    "{} is the device node {}:{}, not the volume's loop device",
                    path.display(),
                    bound.0,
                    bound.1
                )),
                None => problems.push(format!("{} is not a block device node", path.display())),
            },
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

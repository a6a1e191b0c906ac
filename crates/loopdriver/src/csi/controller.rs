//! CSI Controller: volumes are image files, so create, delete and expand work on the image store
//! alone. With this service the driver also runs under the upstream external-provisioner and
//! external-resizer, not only under stowage's own provisioner.

use std::collections::HashMap;

use tonic::{Request, Response, Status};

use super::v1::controller_server::Controller;
use super::v1::controller_service_capability::{self, rpc};
use super::v1::*;
use super::{VolumeLocks, caps, image_status, required};
use crate::ImageStore;

/// The size of a volume created without a capacity request.
pub const DEFAULT_SIZE: u64 = 1 << 30;
/// The smallest image worth formatting: mkfs.ext4 needs room for its metadata and journal.
pub const MIN_SIZE: u64 = 4 << 20;
/// Image sizes are whole 4 KiB blocks: a loop device ignores a trailing partial sector.
const BLOCK: u64 = 4096;

#[derive(Debug, Clone)]
pub struct ControllerService {
    pub images: ImageStore,
    pub locks: VolumeLocks,
}

/// The size to create for a capacity range: the request rounded up to whole blocks, the
/// default when nothing is asked, never above the limit.
pub fn size_for(range: Option<&CapacityRange>) -> Result<u64, Status> {
    let (required, limit) = match range {
        Some(r) => (r.required_bytes, r.limit_bytes),
        None => (0, 0),
    };
    if required < 0 || limit < 0 {
        return Err(Status::invalid_argument("capacity range has a negative bound"));
    }
    let (required, limit) = (required as u64, limit as u64);
    if limit > 0 && limit < required {
        return Err(Status::invalid_argument(format!(
            "capacity limit {limit} is below the required {required} bytes"
        )));
    }
    let mut size = if required == 0 { DEFAULT_SIZE } else { required };
    size = size.div_ceil(BLOCK).saturating_mul(BLOCK);
    if limit > 0 && size > limit {
        size = limit / BLOCK * BLOCK;
    }
    if size < required || size < MIN_SIZE {
        return Err(Status::out_of_range(format!(
            "no size of whole 4 KiB blocks between {required} and {limit} bytes holds a file \
             system (at least {MIN_SIZE} bytes)"
        )));
    }
    Ok(size)
}

/// Whether an existing image of `size` answers a repeated CreateVolume with this range.
fn fits(size: u64, range: Option<&CapacityRange>) -> bool {
    let Some(r) = range else { return true };
    size >= r.required_bytes.max(0) as u64 && (r.limit_bytes <= 0 || size <= r.limit_bytes as u64)
}

impl ControllerService {
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(ImageStore) -> T + Send + 'static,
    ) -> Result<T, Status> {
        let images = self.images.clone();
        tokio::task::spawn_blocking(move || f(images))
            .await
            .map_err(|e| Status::internal(format!("image store task failed: {e}")))
    }

    /// Refuses while the image store's marker is missing (`ImageStore::ready`): `Unavailable`,
    /// which the caller retries, since the store may yet be mounted.
    async fn store_ready(&self, uncached: bool) -> Result<(), Status> {
        self.blocking(move |s| if uncached { s.ready_now() } else { s.ready() })
            .await?
            .map(|_| ())
            .map_err(|e| Status::unavailable(format!("image store not ready: {e}")))
    }
}

fn unimplemented<T>(what: &str) -> Result<Response<T>, Status> {
    Err(Status::unimplemented(format!(
        "{what} is not supported by {}",
        crate::DRIVER
    )))
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn create_volume(
        &self,
        request: Request<CreateVolumeRequest>,
    ) -> Result<Response<CreateVolumeResponse>, Status> {
        let req = request.into_inner();
        let name = required(&req.name, "name")?.to_string();
        let requested = caps::check_all(&req.volume_capabilities).map_err(Status::invalid_argument)?;
        // This service makes images in the one store every node reaches (shared mode).
        if let Some(why) = requested.iter().find_map(|r| match &r.access {
            caps::Access::Mount { fs_type, .. } => caps::shared_refusal(fs_type),
            caps::Access::Block => None,
        }) {
            return Err(Status::invalid_argument(why));
        }
        if req.volume_content_source.is_some() {
            // Cloning and restore are not supported: an empty volume where data was expected
            // would be silent data loss.
            return Err(Status::invalid_argument(
                "volume content source (clone or snapshot restore) is not supported by loop.stowage.dev",
            ));
        }
        // The name is the volume id: a repeated create finds the same image.
        crate::check_handle(&name)
            .map_err(|e| Status::invalid_argument(format!("name {name:?} cannot be a volume id: {e}")))?;
        let range = req.capacity_range;
        let size = size_for(range.as_ref())?;
        let _guard = self.locks.try_lock(&name)?;
        // Uncached: no new image on a store unmounted since the last check.
        self.store_ready(true).await?;
        let id = name.clone();
        let existing = self
            .blocking(move |s| match s.size(&id) {
                Ok(n) => Ok(Some(n)),
                Err(e) if e.not_found() => Ok(None),
                Err(e) => Err(e),
            })
            .await?
            .map_err(image_status)?;
        let capacity = match existing {
            Some(n) if fits(n, range.as_ref()) => n,
            Some(n) => {
                return Err(Status::already_exists(format!(
                    "volume {name} exists with {n} bytes, outside the requested range"
                )));
            }
            None => {
                let id = name.clone();
                self.blocking(move |s| s.ensure(&id, size))
                    .await?
                    .map_err(image_status)?;
                tracing::info!(volume = %name, bytes = size, "created image");
                size
            }
        };
        Ok(Response::new(CreateVolumeResponse {
            volume: Some(Volume {
                capacity_bytes: capacity as i64,
                volume_id: name,
                volume_context: HashMap::new(),
                content_source: None,
                accessible_topology: vec![],
            }),
        }))
    }

    async fn delete_volume(
        &self,
        request: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = required(&req.volume_id, "volume id")?.to_string();
        // A handle the store would refuse names no image: nothing to delete.
        let Ok(path) = self.images.path(&id) else {
            return Ok(Response::new(DeleteVolumeResponse {}));
        };
        let _guard = self.locks.try_lock(&id)?;
        // Without the marker an image "already gone" may be on a store not mounted here: the
        // caller would forget a volume whose data still exists.
        self.store_ready(false).await?;
        // An image still behind a loop device is in use on this host: deleting it would leave
        // the device serving an unlinked file until it is freed.
        let loops = crate::sys::loops_of(&path)
            .await
            .map_err(|e| super::sys_status("losetup -j", e))?;
        if !loops.is_empty() {
            return Err(Status::failed_precondition(format!(
                "volume {id} is still attached as {}; unstage it first",
                loops.join(", ")
            )));
        }
        let removed = self
            .blocking(move |s| s.remove(&id))
            .await?
            .map_err(image_status)?;
        if removed {
            tracing::info!(volume = %req.volume_id, "deleted image");
        } else {
            // "Already gone" from a store unmounted since the last check is not gone.
            self.store_ready(true).await?;
        }
        Ok(Response::new(DeleteVolumeResponse {}))
    }

    async fn controller_publish_volume(
        &self,
        _: Request<ControllerPublishVolumeRequest>,
    ) -> Result<Response<ControllerPublishVolumeResponse>, Status> {
        // Attachment is the node's job (a loop device exists only on the node that made it).
        unimplemented("ControllerPublishVolume")
    }

    async fn controller_unpublish_volume(
        &self,
        _: Request<ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<ControllerUnpublishVolumeResponse>, Status> {
        unimplemented("ControllerUnpublishVolume")
    }

    async fn validate_volume_capabilities(
        &self,
        request: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<ValidateVolumeCapabilitiesResponse>, Status> {
        let req = request.into_inner();
        let id = required(&req.volume_id, "volume id")?.to_string();
        if req.volume_capabilities.is_empty() {
            return Err(Status::invalid_argument("volume capabilities are required"));
        }
        let exists = match self.images.path(&id) {
            Err(_) => false,
            Ok(_) => self
                .blocking(move |s| s.exists(&id))
                .await?
                .map_err(image_status)?,
        };
        if !exists {
            return Err(Status::not_found(format!(
                "volume {} does not exist",
                req.volume_id
            )));
        }
        let answer = match caps::check_all(&req.volume_capabilities) {
            Ok(_) => ValidateVolumeCapabilitiesResponse {
                confirmed: Some(validate_volume_capabilities_response::Confirmed {
                    volume_context: req.volume_context,
                    volume_capabilities: req.volume_capabilities,
                    parameters: req.parameters,
                    mutable_parameters: HashMap::new(),
                }),
                message: String::new(),
            },
            Err(why) => ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message: why,
            },
        };
        Ok(Response::new(answer))
    }

    async fn list_volumes(
        &self,
        _: Request<ListVolumesRequest>,
    ) -> Result<Response<ListVolumesResponse>, Status> {
        unimplemented("ListVolumes")
    }

    async fn get_capacity(
        &self,
        _: Request<GetCapacityRequest>,
    ) -> Result<Response<GetCapacityResponse>, Status> {
        unimplemented("GetCapacity")
    }

    async fn controller_get_capabilities(
        &self,
        _: Request<ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<ControllerGetCapabilitiesResponse>, Status> {
        let capabilities = [rpc::Type::CreateDeleteVolume, rpc::Type::ExpandVolume]
            .into_iter()
            .map(|t| ControllerServiceCapability {
                r#type: Some(controller_service_capability::Type::Rpc(
                    controller_service_capability::Rpc { r#type: t as i32 },
                )),
            })
            .collect();
        Ok(Response::new(ControllerGetCapabilitiesResponse { capabilities }))
    }

    async fn create_snapshot(
        &self,
        _: Request<CreateSnapshotRequest>,
    ) -> Result<Response<CreateSnapshotResponse>, Status> {
        unimplemented("CreateSnapshot")
    }

    async fn delete_snapshot(
        &self,
        _: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        unimplemented("DeleteSnapshot")
    }

    async fn list_snapshots(
        &self,
        _: Request<ListSnapshotsRequest>,
    ) -> Result<Response<ListSnapshotsResponse>, Status> {
        unimplemented("ListSnapshots")
    }

    async fn get_snapshot(
        &self,
        _: Request<GetSnapshotRequest>,
    ) -> Result<Response<GetSnapshotResponse>, Status> {
        unimplemented("GetSnapshot")
    }

    async fn controller_expand_volume(
        &self,
        request: Request<ControllerExpandVolumeRequest>,
    ) -> Result<Response<ControllerExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = required(&req.volume_id, "volume id")?.to_string();
        let range = req
            .capacity_range
            .ok_or_else(|| Status::invalid_argument("capacity range is required"))?;
        if range.required_bytes <= 0 && range.limit_bytes <= 0 {
            return Err(Status::invalid_argument("capacity range asks for no size"));
        }
        let size = size_for(Some(&range))?;
        if self.images.path(&id).is_err() {
            return Err(Status::not_found(format!("volume {id} does not exist")));
        }
        let _guard = self.locks.try_lock(&id)?;
        let handle = id.clone();
        let capacity = self
            .blocking(move |s| s.grow(&handle, size))
            .await?
            .map_err(image_status)?;
        if range.limit_bytes > 0 && capacity > range.limit_bytes as u64 {
            // Images never shrink: an image already past the limit cannot honour it.
            return Err(Status::out_of_range(format!(
                "volume {id} already holds {capacity} bytes, more than the limit {}",
                range.limit_bytes
            )));
        }
        Ok(Response::new(ControllerExpandVolumeResponse {
            capacity_bytes: capacity as i64,
            // The loop device and the file system learn the new size on the node.
            node_expansion_required: true,
        }))
    }

    async fn controller_get_volume(
        &self,
        _: Request<ControllerGetVolumeRequest>,
    ) -> Result<Response<ControllerGetVolumeResponse>, Status> {
        unimplemented("ControllerGetVolume")
    }

    async fn controller_modify_volume(
        &self,
        _: Request<ControllerModifyVolumeRequest>,
    ) -> Result<Response<ControllerModifyVolumeResponse>, Status> {
        unimplemented("ControllerModifyVolume")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::csi::caps::tests::{cap, mount};
    use crate::csi::v1::volume_capability::access_mode::Mode as CsiMode;
    use tonic::Code;

    /// A service over a marked store, as every store is once installed.
    fn svc(dir: &std::path::Path) -> ControllerService {
        let images = ImageStore::new(dir);
        images.init().unwrap();
        ControllerService {
            images,
            locks: VolumeLocks::default(),
        }
    }

    #[tokio::test]
    async fn create_and_delete_wait_for_the_store_marker() {
        let dir = tempfile::tempdir().unwrap();
        let s = ControllerService {
            images: ImageStore::new(dir.path()),
            locks: VolumeLocks::default(),
        };
        let r = s.create_volume(Request::new(create("v", 0, 0))).await;
        assert_eq!(
            r.as_ref().err().map(|e| e.code()),
            Some(Code::Unavailable),
            "{r:?}"
        );
        assert!(r.unwrap_err().message().contains(crate::image::MARKER));
        assert!(
            !dir.path().join("v.img").exists(),
            "no image on an unmarked store"
        );
        // An image "missing" from an unmarked store is not reported deleted.
        let del = DeleteVolumeRequest {
            volume_id: "v".into(),
            ..Default::default()
        };
        assert_eq!(
            code(s.delete_volume(Request::new(del.clone())).await).await,
            Code::Unavailable
        );
        s.images.init().unwrap();
        assert_eq!(
            code(s.create_volume(Request::new(create("v", 0, 0))).await).await,
            Code::Ok
        );
        assert!(dir.path().join("v.img").exists());
        assert_eq!(
            code(s.delete_volume(Request::new(del.clone())).await).await,
            Code::Ok
        );
        // Unmounted a moment ago, the marker still cached as found: creation reads it again, and
        // so does a deletion that finds no image.
        std::fs::remove_file(dir.path().join(crate::image::MARKER)).unwrap();
        assert_eq!(
            code(s.create_volume(Request::new(create("w", 0, 0))).await).await,
            Code::Unavailable
        );
        assert!(!dir.path().join("w.img").exists());
        assert_eq!(
            code(s.delete_volume(Request::new(del)).await).await,
            Code::Unavailable
        );
    }

    fn create(name: &str, required: i64, limit: i64) -> CreateVolumeRequest {
        CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(CapacityRange {
                required_bytes: required,
                limit_bytes: limit,
            }),
            volume_capabilities: vec![cap(CsiMode::SingleNodeWriter, mount(""))],
            ..Default::default()
        }
    }

    async fn code<T>(r: Result<Response<T>, Status>) -> Code {
        r.err().map(|s| s.code()).unwrap_or(Code::Ok)
    }

    #[test]
    fn sizes_round_to_blocks_and_respect_limits() {
        assert_eq!(size_for(None).unwrap(), DEFAULT_SIZE);
        let r = |required, limit| CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        };
        assert_eq!(size_for(Some(&r(10 << 20, 0))).unwrap(), 10 << 20);
        assert_eq!(size_for(Some(&r((10 << 20) + 1, 0))).unwrap(), (10 << 20) + 4096);
        assert_eq!(
            size_for(Some(&r(0, 8 << 20))).unwrap(),
            8 << 20,
            "default capped by limit"
        );
        assert_eq!(size_for(Some(&r(5, 0))).unwrap_err().code(), Code::OutOfRange);
        assert_eq!(
            size_for(Some(&r(10, 5))).unwrap_err().code(),
            Code::InvalidArgument
        );
        assert_eq!(
            size_for(Some(&r(-1, 0))).unwrap_err().code(),
            Code::InvalidArgument
        );
        assert_eq!(
            size_for(Some(&r((8 << 20) + 1, (8 << 20) + 100)))
                .unwrap_err()
                .code(),
            Code::OutOfRange,
            "no whole block fits between the bounds"
        );
    }

    #[tokio::test]
    async fn argument_errors_come_before_any_work() {
        let dir = tempfile::tempdir().unwrap();
        let s = svc(dir.path());
        let mut no_name = create("", 0, 0);
        assert_eq!(
            code(s.create_volume(Request::new(no_name.clone())).await).await,
            Code::InvalidArgument
        );
        no_name.name = "v".into();
        no_name.volume_capabilities.clear();
        assert_eq!(
            code(s.create_volume(Request::new(no_name)).await).await,
            Code::InvalidArgument
        );
        let mut rwx = create("v", 0, 0);
        rwx.volume_capabilities = vec![cap(CsiMode::MultiNodeMultiWriter, mount(""))];
        assert_eq!(
            code(s.create_volume(Request::new(rwx)).await).await,
            Code::InvalidArgument
        );
        let mut clone = create("v", 0, 0);
        clone.volume_content_source = Some(VolumeContentSource::default());
        assert_eq!(
            code(s.create_volume(Request::new(clone)).await).await,
            Code::InvalidArgument
        );
        assert_eq!(
            code(s.create_volume(Request::new(create("a/b", 0, 0))).await).await,
            Code::InvalidArgument
        );
        assert_eq!(
            code(
                s.delete_volume(Request::new(DeleteVolumeRequest::default()))
                    .await
            )
            .await,
            Code::InvalidArgument
        );
        let expand = |id: &str, range| ControllerExpandVolumeRequest {
            volume_id: id.into(),
            capacity_range: range,
            ..Default::default()
        };
        assert_eq!(
            code(s.controller_expand_volume(Request::new(expand("", None))).await).await,
            Code::InvalidArgument
        );
        assert_eq!(
            code(s.controller_expand_volume(Request::new(expand("v", None))).await).await,
            Code::InvalidArgument
        );
        let range = Some(CapacityRange {
            required_bytes: 8 << 20,
            limit_bytes: 0,
        });
        assert_eq!(
            code(
                s.controller_expand_volume(Request::new(expand("missing", range)))
                    .await
            )
            .await,
            Code::NotFound
        );
        let validate = |id: &str, caps| ValidateVolumeCapabilitiesRequest {
            volume_id: id.into(),
            volume_capabilities: caps,
            ..Default::default()
        };
        let one = vec![cap(CsiMode::SingleNodeWriter, mount(""))];
        assert_eq!(
            code(
                s.validate_volume_capabilities(Request::new(validate("", one.clone())))
                    .await
            )
            .await,
            Code::InvalidArgument
        );
        assert_eq!(
            code(
                s.validate_volume_capabilities(Request::new(validate("v", vec![])))
                    .await
            )
            .await,
            Code::InvalidArgument
        );
        assert_eq!(
            code(
                s.validate_volume_capabilities(Request::new(validate("missing", one)))
                    .await
            )
            .await,
            Code::NotFound
        );
        assert!(
            std::fs::read_dir(dir.path())
                .unwrap()
                .all(|e| e.unwrap().file_name() == crate::image::MARKER),
            "no image made"
        );
    }

    #[tokio::test]
    async fn create_is_idempotent_by_name_and_refuses_a_different_size() {
        let dir = tempfile::tempdir().unwrap();
        let s = svc(dir.path());
        let a = s
            .create_volume(Request::new(create("v", 8 << 20, 0)))
            .await
            .unwrap()
            .into_inner();
        let b = s
            .create_volume(Request::new(create("v", 8 << 20, 0)))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(a, b);
        assert_eq!(a.volume.unwrap().capacity_bytes, 8 << 20);
        assert_eq!(
            code(s.create_volume(Request::new(create("v", 16 << 20, 0))).await).await,
            Code::AlreadyExists
        );
        assert_eq!(
            code(s.create_volume(Request::new(create("v", 0, 4 << 20))).await).await,
            Code::AlreadyExists
        );
        let grown = s
            .controller_expand_volume(Request::new(ControllerExpandVolumeRequest {
                volume_id: "v".into(),
                capacity_range: Some(CapacityRange {
                    required_bytes: 16 << 20,
                    limit_bytes: 0,
                }),
                ..Default::default()
            }))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(grown.capacity_bytes, 16 << 20);
        assert!(grown.node_expansion_required);
        let caps = vec![cap(CsiMode::MultiNodeMultiWriter, mount(""))];
        let v = s
            .validate_volume_capabilities(Request::new(ValidateVolumeCapabilitiesRequest {
                volume_id: "v".into(),
                volume_capabilities: caps,
                ..Default::default()
            }))
            .await
            .unwrap()
            .into_inner();
        assert!(v.confirmed.is_none() && v.message.contains("corrupted"), "{v:?}");
        s.delete_volume(Request::new(DeleteVolumeRequest {
            volume_id: "v".into(),
            ..Default::default()
        }))
        .await
        .unwrap();
        assert!(!dir.path().join("v.img").exists());
        // Deleting again, or an id no image can have, succeeds.
        for id in ["v", "../etc"] {
            s.delete_volume(Request::new(DeleteVolumeRequest {
                volume_id: id.into(),
                ..Default::default()
            }))
            .await
            .unwrap();
        }
    }

    #[tokio::test]
    async fn a_busy_volume_is_aborted() {
        let dir = tempfile::tempdir().unwrap();
        let s = svc(dir.path());
        let _held = s.locks.try_lock("v").unwrap();
        assert_eq!(
            code(s.create_volume(Request::new(create("v", 0, 0))).await).await,
            Code::Aborted
        );
    }
}

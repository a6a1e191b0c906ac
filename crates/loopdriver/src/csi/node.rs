//! CSI Node: the loop device, the file system and the mounts on this node.
//!
//! Stage attaches (or takes the attacher's device from `publish_context`), formats only a blank
//! writable device, and mounts it at the staging path; publish bind-mounts the staging mount (or,
//! for Block volumes, the device node) at the pod's target. The mount table is the record of
//! what is mounted; the only other record is a small file per staged volume naming its device
//! and whether stage attached it, so unstage frees exactly what stage took, across restarts.
//!
//! Here: the service, its RPC table and the lookups every RPC shares. Per RPC: `stage.rs`
//! (stage, unstage), `publish.rs` (publish, unpublish), `usage.rs` (expand, stats); the stage
//! record in `staged.rs`; stage's offline repairs, which outlive a cancelled RPC, in `repair.rs`.

use std::path::{Path, PathBuf};

use tonic::{Request, Response, Status};

use super::v1::node_server::Node;
use super::v1::node_service_capability::{self, rpc};
use super::v1::*;
use super::{VolumeGuard, VolumeLocks, sys_status};
use crate::ImageStore;
use crate::sys;

mod publish;
mod repair;
mod stage;
mod staged;
mod usage;

pub use repair::{OfflineRepairs, REPAIR_WAIT, RepairTools};
pub use staged::Staged;

#[derive(Debug, Clone)]
pub struct NodeService {
    pub node_id: String,
    pub images: ImageStore,
    /// Where the per-volume stage records live (`<state_dir>/staged/<volume id>`).
    pub state_dir: PathBuf,
    /// Volumes this node may hold at once (0: no limit), reported to the scheduler.
    pub max_volumes: i64,
    /// Local mode (`StoreMode::Local`): the store is this node's alone, so NodeGetInfo reports the
    /// node as the volume's topology, and NodeExpandVolume grows the image here (no controller
    /// reaches it).
    pub local: bool,
    pub locks: VolumeLocks,
    /// Offline checks and resizes stage started; each holds its volume's lock until it ends.
    pub repairs: OfflineRepairs,
}

fn io_status(what: &str, path: &Path, e: std::io::Error) -> Status {
    Status::internal(format!("{what} {}: {e}", path.display()))
}

impl NodeService {
    /// The volume's operation lock; Aborted while another call (or an offline repair, which
    /// then says so) holds it.
    fn lock(&self, id: &str) -> Result<VolumeGuard, Status> {
        self.locks
            .try_lock(id)
            .map_err(|busy| self.repairs.busy(id).unwrap_or(busy))
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

    /// The single mount at `path`, if any, with its device numbers.
    async fn mounted(&self, path: &Path) -> Result<Option<crate::mountinfo::MountEntry>, Status> {
        let mut at = sys::mounts_at(path)
            .await
            .map_err(|e| sys_status("mount table", e))?;
        Ok(at.pop())
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
            // Shared: one store every node reaches, no topology. Local: a volume lives on the
            // node whose store holds its image.
            accessible_topology: self.local.then(|| Topology {
                segments: [(crate::TOPOLOGY_KEY.to_string(), self.node_id.clone())].into(),
            }),
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
            local: false,
            locks: VolumeLocks::default(),
            repairs: OfflineRepairs::default(),
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
}

//! Serving the CSI services on a unix socket, the way a kubelet, csi-sanity and the CSI
//! sidecars reach a plugin.

use std::future::Future;
use std::path::{Path, PathBuf};

use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::server::NamedService;

use super::VolumeLocks;
use super::controller::ControllerService;
use super::identity::IdentityService;
use super::metrics::{RpcLayer, RpcMetrics};
use super::node::{NodeService, OfflineRepairs};
use super::v1::controller_server::ControllerServer;
use super::v1::identity_server::IdentityServer;
use super::v1::node_server::NodeServer;
use crate::ImageStore;

/// What one CSI endpoint serves.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// The driver name reported to the CO (`crate::DRIVER` unless served under a second name).
    pub driver: String,
    /// The socket path (`unix://` prefix accepted, as sidecars write it).
    pub socket: PathBuf,
    pub images: ImageStore,
    /// Node service settings; `None` serves no Node service (a controller-only plugin).
    pub node: Option<NodeSettings>,
    /// Serve the Controller service (create/delete/expand over the image store).
    pub controller: bool,
    /// Where every call served is recorded; `None` records nothing (no metrics endpoint).
    pub metrics: Option<RpcMetrics>,
}

#[derive(Debug, Clone)]
pub struct NodeSettings {
    pub node_id: String,
    pub state_dir: PathBuf,
    pub max_volumes: i64,
    /// Local image store: report topology, grow images on expand (`NodeService::local`).
    pub local: bool,
}

/// `unix:///csi/csi.sock` or `/csi/csi.sock` → the path.
pub fn socket_path(endpoint: &str) -> PathBuf {
    PathBuf::from(endpoint.strip_prefix("unix://").unwrap_or(endpoint))
}

pub(crate) fn bind(socket: &Path) -> std::io::Result<UnixListener> {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir)?;
    }
    // A socket left by an earlier run refuses the bind; only a socket is ever removed.
    if let Ok(m) = std::fs::symlink_metadata(socket) {
        use std::os::unix::fs::FileTypeExt;
        if m.file_type().is_socket() {
            std::fs::remove_file(socket)?;
        }
    }
    UnixListener::bind(socket)
}

/// Serves until `shutdown` completes, then removes the socket.
pub async fn serve(endpoint: Endpoint, shutdown: impl Future<Output = ()> + Send) -> Result<(), ServeError> {
    let listener = bind(&endpoint.socket).map_err(|e| ServeError::Bind(endpoint.socket.clone(), e))?;
    tracing::info!(socket = %endpoint.socket.display(), node = endpoint.node.is_some(), controller = endpoint.controller, "serving CSI");
    // One lock set for both services: a delete must not run while the node stages the volume.
    let locks = VolumeLocks::default();
    let repairs = OfflineRepairs::default();
    let identity = IdentityService {
        driver: endpoint.driver.clone(),
        images: endpoint.images.clone(),
        controller: endpoint.controller,
    };
    let mut services = vec![IdentityServer::<IdentityService>::NAME];
    if endpoint.node.is_some() {
        services.push(NodeServer::<NodeService>::NAME);
    }
    if endpoint.controller {
        services.push(ControllerServer::<ControllerService>::NAME);
    }
    // One layer for every service, so no handler has metrics code of its own.
    let layer = endpoint
        .metrics
        .as_ref()
        .map_or_else(RpcLayer::default, |m| m.layer(&endpoint.driver, &services));
    let mut router = tonic::transport::Server::builder()
        .layer(layer)
        .add_service(IdentityServer::new(identity));
    if let Some(n) = &endpoint.node {
        router = router.add_service(NodeServer::new(NodeService {
            node_id: n.node_id.clone(),
            images: endpoint.images.clone(),
            state_dir: n.state_dir.clone(),
            max_volumes: n.max_volumes,
            local: n.local,
            locks: locks.clone(),
            repairs: repairs.clone(),
        }));
    }
    if endpoint.controller {
        router = router.add_service(ControllerServer::new(ControllerService {
            images: endpoint.images.clone(),
            locks,
        }));
    }
    let served = router
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), shutdown)
        .await;
    let _ = std::fs::remove_file(&endpoint.socket);
    // An offline check or resize killed halfway can corrupt the file system: let them end.
    repairs.wait_all().await;
    served.map_err(ServeError::Serve)
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {0}: {1}")]
    Bind(PathBuf, #[source] std::io::Error),
    #[error("CSI server failed: {0}")]
    Serve(#[source] tonic::transport::Error),
}

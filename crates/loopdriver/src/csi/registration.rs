//! Registration with the kubelet: the plugin-watcher protocol a kubelet uses to find CSI node
//! plugins. A socket `<kubelet-dir>/plugins_registry/<driver>-reg.sock` serving `Registration`
//! tells the kubelet the plugin's name, CSI endpoint and versions; the kubelet then calls
//! NodeGetInfo, lists the driver in CSINode and annotates the Node. Deleting the socket
//! deregisters, so it is removed at start (a dead plugin leaves it) and at exit.
//!
//! This replaces the node-driver-registrar sidecar: one process and one image fewer per node, and
//! no second binary to build from Go for an offline cluster.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

use super::server::{ServeError, bind};

#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("pluginregistration");
}

use v1::registration_server::{Registration, RegistrationServer};
use v1::{InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse};

/// The CSI versions the plugin speaks, as the kubelet asks for them.
pub const SUPPORTED_VERSIONS: &[&str] = &["1.0.0"];

#[derive(Debug, Clone)]
pub struct Registrar {
    /// The driver name the kubelet registers (`crate::DRIVER`, or a second name the same driver
    /// is served under: an external driver path driven by the upstream sidecars).
    pub driver: String,
    /// The CSI endpoint as the kubelet reaches it (a path on the node).
    pub csi_endpoint: PathBuf,
    /// Set once the kubelet says the plugin is registered; cleared when it says it is not.
    pub registered: Arc<AtomicBool>,
}

#[tonic::async_trait]
impl Registration for Registrar {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: "CSIPlugin".into(),
            name: self.driver.clone(),
            endpoint: self.csi_endpoint.display().to_string(),
            supported_versions: SUPPORTED_VERSIONS.iter().map(|v| v.to_string()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let st = request.into_inner();
        self.registered.store(st.plugin_registered, Ordering::Relaxed);
        if st.plugin_registered {
            tracing::info!(driver = %self.driver, "registered with the kubelet");
        } else {
            tracing::error!(driver = %self.driver, error = %st.error, "the kubelet refused the registration");
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// `<kubelet-dir>/plugins_registry/<driver>-reg.sock`.
pub fn registration_socket(kubelet_dir: &Path, driver: &str) -> PathBuf {
    kubelet_dir
        .join("plugins_registry")
        .join(format!("{driver}-reg.sock"))
}

/// `<kubelet-dir>/plugins/<driver>/csi.sock`.
pub fn csi_socket(kubelet_dir: &Path, driver: &str) -> PathBuf {
    kubelet_dir.join("plugins").join(driver).join("csi.sock")
}

/// Serves the registration socket until `shutdown`, then removes it (deregistering). tonic
/// serves on `inner`, outside the kubelet's watched dir (the kubelet would try every socket
/// there); the kubelet's connections reach it through the relay that drops the socket path the
/// kubelet sends as `:authority` (see `authority.rs`).
pub async fn serve(
    socket: PathBuf,
    inner: PathBuf,
    registrar: Registrar,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let inner_listener = bind(&inner).map_err(|e| ServeError::Bind(inner.clone(), e))?;
    let listener = bind(&socket).map_err(|e| ServeError::Bind(socket.clone(), e))?;
    tracing::info!(socket = %socket.display(), endpoint = %registrar.csi_endpoint.display(), "serving kubelet plugin registration");
    let relay_to = inner.clone();
    let relays = tokio::spawn(async move {
        loop {
            let Ok((client, _)) = listener.accept().await else {
                continue;
            };
            let to = relay_to.clone();
            tokio::spawn(async move {
                if let Err(e) = super::authority::relay(client, &to).await {
                    tracing::warn!(error = %e, "registration connection failed");
                }
            });
        }
    });
    let served = tonic::transport::Server::builder()
        .add_service(RegistrationServer::new(registrar))
        .serve_with_incoming_shutdown(UnixListenerStream::new(inner_listener), shutdown)
        .await;
    relays.abort();
    let _ = std::fs::remove_file(&socket);
    let _ = std::fs::remove_file(&inner);
    served.map_err(ServeError::Serve)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_kubelet_learns_name_endpoint_and_versions() {
        let r = Registrar {
            driver: crate::DRIVER.into(),
            csi_endpoint: csi_socket(Path::new("/var/lib/kubelet"), crate::DRIVER),
            registered: Arc::default(),
        };
        let info = r
            .get_info(Request::new(InfoRequest {}))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(info.r#type, "CSIPlugin");
        assert_eq!(info.name, "loop.stowage.dev");
        assert_eq!(
            info.endpoint,
            "/var/lib/kubelet/plugins/loop.stowage.dev/csi.sock"
        );
        assert_eq!(info.supported_versions, vec!["1.0.0".to_string()]);
        r.notify_registration_status(Request::new(RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        }))
        .await
        .unwrap();
        assert!(r.registered.load(Ordering::Relaxed));
        assert_eq!(
            registration_socket(Path::new("/k"), crate::DRIVER),
            Path::new("/k/plugins_registry/loop.stowage.dev-reg.sock")
        );
        assert_eq!(
            csi_socket(Path::new("/k"), "ext.loop.stowage.dev"),
            Path::new("/k/plugins/ext.loop.stowage.dev/csi.sock")
        );
    }
}

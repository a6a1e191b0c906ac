//! CSI Identity: who the plugin is, what it offers, whether it is ready.

use std::collections::HashMap;

use tonic::{Request, Response, Status};

use super::v1::identity_server::Identity;
use super::v1::plugin_capability::{self, service, volume_expansion};
use super::v1::*;
use crate::ImageStore;

#[derive(Debug, Clone)]
pub struct IdentityService {
    /// The name GetPluginInfo reports: the sidecars take it as the provisioner's and attacher's.
    pub driver: String,
    pub images: ImageStore,
    /// Whether this endpoint also serves the Controller service.
    pub controller: bool,
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: self.driver.clone(),
            vendor_version: crate::VERSION.into(),
            manifest: HashMap::new(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        let mut capabilities = vec![PluginCapability {
            // A mounted ext4 grows with resize2fs while the pod runs.
            r#type: Some(plugin_capability::Type::VolumeExpansion(
                plugin_capability::VolumeExpansion {
                    r#type: volume_expansion::Type::Online as i32,
                },
            )),
        }];
        if self.controller {
            capabilities.push(PluginCapability {
                r#type: Some(plugin_capability::Type::Service(plugin_capability::Service {
                    r#type: service::Type::ControllerService as i32,
                })),
            });
        }
        Ok(Response::new(GetPluginCapabilitiesResponse { capabilities }))
    }

    /// Ready when the image dir can be read: without it no volume can be served.
    async fn probe(&self, _: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        let dir = self.images.dir().to_path_buf();
        let ok = tokio::task::spawn_blocking(move || std::fs::read_dir(&dir).map(|_| ()))
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        match ok {
            Ok(()) => Ok(Response::new(ProbeResponse { ready: Some(true) })),
            Err(e) => Err(Status::failed_precondition(format!(
                "image dir {} cannot be read: {e}",
                self.images.dir().display()
            ))),
        }
    }
}

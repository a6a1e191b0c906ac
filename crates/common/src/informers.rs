//! The state every controller shares: one client, one metrics registry and one informer per
//! resource type, started once when this replica becomes leader.

use std::sync::Arc;

use crate::metrics::Registry;
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::{CSIDriver, StorageClass, VolumeAttachment};
use kube::runtime::watcher;
use kube::{Api, Client};
use tokio::task::JoinSet;

use crate::informer::{Informer, strip_managed_fields};

pub struct Informers {
    /// The rate-limited client of this process.
    pub client: Client,
    /// Where controllers register their metric families.
    pub registry: Registry,
    pub pvs: Informer<PersistentVolume>,
    pub pvcs: Informer<PersistentVolumeClaim>,
    pub pods: Informer<Pod>,
    pub nodes: Informer<Node>,
    pub attachments: Informer<VolumeAttachment>,
    pub classes: Informer<StorageClass>,
    pub csi_drivers: Informer<CSIDriver>,
}

/// Pods are the biggest objects watched; controllers read spec (volumes, node), phase and
/// deletion state, never container statuses.
fn strip_pod(pod: &mut Pod) {
    strip_managed_fields(pod);
    if let Some(st) = pod.status.as_mut() {
        st.container_statuses = None;
        st.init_container_statuses = None;
        st.ephemeral_container_statuses = None;
    }
    pod.metadata.annotations = None;
}

impl Informers {
    /// Starts every watch on `tasks` (they end when the set is dropped).
    pub fn start(client: Client, registry: Registry, tasks: &mut JoinSet<()>) -> Arc<Self> {
        let cfg = watcher::Config::default;
        Arc::new(Self {
            pvs: Informer::spawn(Api::all(client.clone()), cfg(), strip_managed_fields, tasks),
            pvcs: Informer::spawn(Api::all(client.clone()), cfg(), strip_managed_fields, tasks),
            pods: Informer::spawn(Api::all(client.clone()), cfg(), strip_pod, tasks),
            nodes: Informer::spawn(Api::all(client.clone()), cfg(), strip_managed_fields, tasks),
            attachments: Informer::spawn(Api::all(client.clone()), cfg(), strip_managed_fields, tasks),
            classes: Informer::spawn(Api::all(client.clone()), cfg(), strip_managed_fields, tasks),
            csi_drivers: Informer::spawn(Api::all(client.clone()), cfg(), strip_managed_fields, tasks),
            client,
            registry,
        })
    }

    /// Waits for every initial list.
    pub async fn ready(&self) {
        tokio::join!(
            self.pvs.ready(),
            self.pvcs.ready(),
            self.pods.ready(),
            self.nodes.ready(),
            self.attachments.ready(),
            self.classes.ready(),
            self.csi_drivers.ready()
        );
    }
}

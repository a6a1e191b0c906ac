//! The state every controller shares: one client, one metrics registry and one informer per
//! resource type, started once: at start-up on a warm standby, else when this replica becomes leader.

use std::sync::Arc;

use crate::observe::metrics::Registry;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::storage::v1::{CSIDriver, CSIStorageCapacity, StorageClass};
use kube::Client;
use kube::runtime::watcher;
use tokio::task::JoinSet;

use crate::store::informer::{Informer, as_decoded};
use crate::store::model::{StoredClaim, StoredPod, StoredVolume, VolumeAttachment};

pub struct Informers {
    /// The rate-limited client of this process.
    pub client: Client,
    /// Where controllers register their metric families.
    pub registry: Registry,
    /// Stored (`model::Stored`): metadata decoded, the rest read through named readers. Every
    /// PV and claim of the cluster is held for as long as the process runs.
    pub pvs: Informer<StoredVolume>,
    pub pvcs: Informer<StoredClaim>,
    /// Only what the controllers read of a pod: read-only, never written back.
    pub pods: Informer<StoredPod>,
    pub nodes: Informer<Node>,
    /// The API type with its inline PV spec boxed.
    pub attachments: Informer<VolumeAttachment>,
    pub classes: Informer<StorageClass>,
    pub csi_drivers: Informer<CSIDriver>,
    /// What each node's store can still hold (node-local drivers' capacity tracking): where the
    /// binder provisions an Immediate claim of a node-local store. Watched only when asked
    /// (`start_with`: local mode), so a shared-mode install needs no new right.
    pub capacities: Option<Informer<CSIStorageCapacity>>,
}

impl Informers {
    /// Starts every watch on `tasks` (they end when the set is dropped).
    pub fn start(client: Client, registry: Registry, tasks: &mut JoinSet<()>) -> Arc<Self> {
        Self::start_with(client, registry, tasks, false)
    }

    /// `start`, with the CSIStorageCapacity watch when `capacities`.
    pub fn start_with(
        client: Client,
        registry: Registry,
        tasks: &mut JoinSet<()>,
        capacities: bool,
    ) -> Arc<Self> {
        let cfg = watcher::Config::default;
        Arc::new(Self {
            pvs: Informer::spawn(client.clone(), cfg(), as_decoded, tasks),
            pvcs: Informer::spawn(client.clone(), cfg(), as_decoded, tasks),
            pods: Informer::spawn(client.clone(), cfg(), StoredPod::trim, tasks),
            nodes: Informer::spawn(client.clone(), cfg(), as_decoded, tasks),
            attachments: Informer::spawn(client.clone(), cfg(), as_decoded, tasks),
            classes: Informer::spawn(client.clone(), cfg(), as_decoded, tasks),
            csi_drivers: Informer::spawn(client.clone(), cfg(), as_decoded, tasks),
            capacities: capacities.then(|| Informer::spawn(client.clone(), cfg(), as_decoded, tasks)),
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
            self.csi_drivers.ready(),
            async {
                if let Some(c) = &self.capacities {
                    c.ready().await
                }
            }
        );
    }
}

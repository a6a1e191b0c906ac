//! What every loop of the agent shares, built once.

use std::path::PathBuf;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::Client;
use kube::runtime::reflector::ObjectRef;
use stowage_common::observe::events::Events;
use stowage_common::store::informer::Informer;

use crate::metrics::Metrics;
use crate::paths::{DRIVER, Layout, va_name};

pub struct Ctx {
    /// The rate-limited API client.
    pub client: Client,
    /// The Node this agent serves.
    pub node: String,
    /// Paths under `--root-dir` (canonical, as the mount table shows them).
    pub layout: Layout,
    /// `--image-dir`, canonical.
    pub images: stowage_loopdriver::ImageStore,
    /// `--image-store-mode`: in local mode this node makes, grows and deletes the images of the
    /// volumes pinned to it (`crate::images`).
    pub store_mode: stowage_loopdriver::StoreMode,
    /// Woken when this node made or deleted an image: its published capacity changed.
    pub capacity_changed: std::sync::Arc<tokio::sync::Notify>,
    /// The mount table the volume manager observes (`/proc/self/mountinfo`; a test points it
    /// elsewhere to make the read fail).
    pub mount_table: PathBuf,
    /// Event recorder (component `stowage-agent`).
    pub events: Events,
    pub metrics: Metrics,
    /// Pods of this node only (field selector).
    pub pods: Informer<Pod>,
    pub pvcs: Informer<PersistentVolumeClaim>,
    pub pvs: Informer<PersistentVolume>,
    pub vas: Informer<VolumeAttachment>,
}

pub fn is_ours(va: &VolumeAttachment, node: &str) -> bool {
    va.spec.attacher == DRIVER && va.spec.node_name == node
}

impl Ctx {
    pub fn pv(&self, name: &str) -> Option<Arc<PersistentVolume>> {
        self.pvs.store().get(&ObjectRef::new(name))
    }

    pub fn pvc(&self, ns: &str, name: &str) -> Option<Arc<PersistentVolumeClaim>> {
        self.pvcs.store().get(&ObjectRef::new(name).within(ns))
    }

    /// The attachment of a PV to this node: by the name the attach/detach controller gives it,
    /// else by scanning (an attachment made by someone naming it differently still counts).
    pub fn va_for(&self, pv: &str, handle: &str) -> Option<Arc<VolumeAttachment>> {
        let matches = |va: &VolumeAttachment| {
            is_ours(va, &self.node) && va.spec.source.persistent_volume_name.as_deref() == Some(pv)
        };
        if let Some(va) = self
            .vas
            .store()
            .get(&ObjectRef::new(&va_name(handle, &self.node)))
            && matches(&va)
        {
            return Some(va);
        }
        self.vas.store().state().into_iter().find(|va| matches(va))
    }
}
